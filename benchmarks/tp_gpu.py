"""Decode latency, tokens/s and serving under TP: dense Megatron against the low-rank layouts.

Strategies (``--strategies``; lrjax.sharding.rules): ``dense`` (Megatron on the uncompressed
model), ``naive_tp``, ``lowrank_tp`` (DeInfer), ``lowrank_split`` (no factor replicated, four
rank-space all-reduces a layer), ``lowrank_megatron`` (two rank-space all-reduces a layer), and
``auto``: not timed again, but recorded per model, TP size and batch as the strategy
``lrjax.sharding.explain`` picks, the step it predicts for each strategy, and how the pick's
measured step compares with the fastest measured one.

``--model 8b``: Llama-3-8B shapes (hidden 4096, 32/8 heads of 128, MLP 14336, vocab 128256);
``--model 70b``: Llama-3-70B shapes (hidden 8192, 64/8 heads of 128, MLP 28672, vocab 128256).
Each with ``--layers`` decoder layers and random weights; the low-rank model keeps 1 - ``--ratio``
of each projection's params (ranks rounded to a multiple of 64). For each model, TP size and
strategy:

  decode   ``--steps`` greedy decode steps of ``--batch`` sequences at ``--ctx`` cache length,
           inside one jit (a fori_loop), timed on the host around block_until_ready (the
           steps amortise the dispatch), median of ``--reps``; per-step latency, tokens/s,
           per-device bytes read and the fraction of the HBM roofline (bytes / 4.3 TB/s).
           With ``--fuse``, also the Triton calls in the compiled step, each call judged by
           its own benchmarked shape (these records are the tuning table's ``model_ab``);
           ``--whole-policy`` times the policy as shipped, its whole-model rules included;
           ``--no-group`` keeps q/k/v as three calls instead of one lr_xuv_group;
           ``--kernels`` serves only some ops' kernels, for each kernel's share of a step
           (one op left out, then ``--fuse`` in the next run, gives the table's
           ``model_op_ab``); with ``--profile``, the GPU's busy time per step, the kernels
           that fill it, the idle gaps between kernel pairs and the kernels that ran at once
           (one traced call; ``--events-out`` keeps
           its raw events and the compiled HLO).
  serving  ``--requests`` concurrent requests through lrjax.serving.Engine (continuous batching,
           prompts of ``--prompt-len``; through lrjax.fuse for the low-rank strategies when
           fused steps are measured): TTFT (submit → first token) and ITL (token gaps),
           median and p90, after a warm-up pass that compiles every shape.

Every decode record also carries the cost model's step (``predicted_ms``, lrjax.sharding.cost
with this host's table entry); ``--fuse both`` times each low-rank strategy unfused and fused;
``--profile`` adds the kernel time per step by kind (``kernel_ms_by_kind``: GEMM, collective,
other), which shows where a step that misses its target goes.

  python benchmarks/tp_gpu.py --model 8b 70b --tp 2 4 8 [--layers 4] [--out results/tp_gpu.json]

Runs unchanged for any TP size the host has devices for (TP=8 on 8 GPUs); ``--append`` adds to
``--out`` (one TP size or model per command keeps each run to a few minutes). On CPU:
``XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python
benchmarks/tp_gpu.py --smoke --tp 2 4 --out /tmp/tp_smoke.json`` checks the script. Several
``--ratio`` values sweep the compression (DeInfer Fig. 7); dense runs once and serving at the
first ratio. Records carry the model's name and ratio; ``models`` in the JSON holds each
model's config and ``ranks`` each ``model@ratio``'s ranks. ``--plot JSON`` draws the step per
strategy over TP and each layout's speed-up over dense Megatron against the targets.
"""

import argparse
import contextlib
import datetime
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import lrjax
from lrjax import sharding
from lrjax.bench import machine, versions
from lrjax.custom_calls.triton import launch_modes, policy  # pure Python: no triton import
from lrjax.models import LlamaForCausalLM, ModelConfig
from lrjax.models.llama import KVCache
from lrjax.serving import Engine, Request, SamplingParams, itl
from lrjax.sharding.analysis import compressed_ranks

from decode_timing import greedy_loop, median_step, time_loop
from policy_tables import op_ab_pair
from results_io import roofline_bps, write_json


LOWRANK = ("naive_tp", "lowrank_tp", "lowrank_split", "lowrank_megatron")
STRATEGIES = ("dense",) + LOWRANK + ("auto",)
# speed-up over dense Megatron at 40 % removed that the layouts aim for, per TP size
TARGETS = {2: 1.3, 4: 1.3, 8: 1.15}


MODELS = {
  "8b": ModelConfig.llama3_8b,
  "70b": ModelConfig.llama3_70b,
  "qwen2.5-7b": ModelConfig.qwen2_5_7b,
  "1b": ModelConfig.llama3_2_1b,
}


def config(args, name):
  if args.smoke:
    return ModelConfig(
      vocab_size=512,
      hidden_size=128,
      intermediate_size=448,
      num_layers=2,
      num_heads=8,
      num_kv_heads=8,
      head_dim=16,
    )
  return MODELS[name]().replace(num_layers=args.layers)


def device_bytes(tree) -> int:
  """Bytes held by device 0 of every array in ``tree``."""
  n = 0
  for a in jax.tree.leaves(tree):
    if isinstance(a, jax.Array):
      n += a.addressable_shards[0].data.nbytes
  return n


def fused_ops(gdef, state, cache, toks, group=True):
  """lr_xuv / lr_mlp / lr_xuv_group equations lrjax.fuse puts into one decode step (an op with
  its norm or residual add folded in, inside an lr_normed or lr_residual, counted too), and
  the lr_normed and lr_residual among them."""

  def step(state, cache, toks):
    model = nnx.merge(gdef, state)
    return lrjax.fuse(type(model).decode, group=group)(model, toks, cache)

  text = str(jax.make_jaxpr(step)(state, cache, toks))

  def count(p):  # bound, an lr_normed's / lr_residual's inner op, or one nested in both
    return (
      text.count(f" {p}[")
      + len(re.findall(rf"\binner={p}\b", text))
      + text.count(f"('inner', '{p}')")
    )

  return {p: count(p) for p in ("lr_xuv", "lr_mlp", "lr_xuv_group", "lr_normed", "lr_residual")}


@contextlib.contextmanager
def calls_judged_alone():
  """The kernel policy without its whole-model rules (the tuning table's model_ab and
  model_op_ab), which this script's ``--fuse`` records are the source of: each call is judged
  by its own benchmarked shape."""
  with policy.use(policy.current().replace(model_ab=(), model_op_ab=())):
    yield


@contextlib.contextmanager
def only_kernels(ops):
  """With ``ops`` (lr ops by their policy names: "xuv", "xuv_group", "mlp_swiglu"), the
  kernel policy declines every other op, so a step's A/B isolates some kernels' share."""
  if not ops:
    yield
    return
  saved = policy.verdict

  def verdict(op, *args):
    if op not in ops:
      return f"left to XLA by tp_gpu.py --kernels {' '.join(sorted(ops))}"
    return saved(op, *args)

  policy.verdict = verdict
  try:
    yield
  finally:
    policy.verdict = saved


def base_name(name: str) -> str:
  """A kernel's name without its trailing fusion and layer numbers, or the hash that names
  each specialization of a Triton kernel under XLA's PTX call (launch.xla_kernel)."""
  return re.sub(r"(_[0-9a-f]{12})?([._]\d+)*$", "", name)


_COLLECTIVE = ("nccl", "allreduce", "all_reduce", "all-reduce", "allgather", "all_gather")
_GEMM = ("gemm", "cublas", "cutlass", "xmma", "sm90_", "sm80_", "triton", "dot", "matmul")


def kernel_kind(name: str) -> str:
  """ "collective", "gemm" or "other" for a GPU kernel's name (NCCL kernels; cuBLAS/CUTLASS GEMMs,
  XLA's Triton GEMM fusions and lrjax's Triton kernels; everything else)."""
  low = name.lower()
  if any(k in low for k in _COLLECTIVE):
    return "collective"
  if any(k in low for k in _GEMM):
    return "gemm"
  return "other"


def kernel_profile(fn, fn_args, steps, top=40, events_out=None):
  """One traced call ``fn(*fn_args)`` of the decode loop. Returns its outputs and, per step,
  the GPU's busy time (the union of kernel intervals), its span, the ``top`` kernel names by
  time, the ``top`` (previous kernel, next kernel) pairs by the idle time between them, and
  the ``top`` pairs of kernels by the time they ran at once (names with trailing layer and
  fusion numbers stripped, so a name sums over the layers)."""
  import tempfile
  from gpu_lowrank import busy_ns, device_kernel_events, idle_gaps_ns, overlaps_ns, span_ns

  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      outs = jax.block_until_ready(fn(*fn_args))
    events = sorted(device_kernel_events(d))
  if events_out:  # the raw trace and the program, for reading kernels back to HLO ops
    with open(events_out, "w") as f:
      json.dump({"events": events, "hlo": fn.lower(*fn_args).compile().as_text()}, f)
  key = lambda name: base_name(name)[:64]  # noqa: E731
  by_name = {}
  for s, e, name in events:
    t, n = by_name.get(key(name), (0, 0))
    by_name[key(name)] = (t + e - s, n + 1)
  kernels = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
  gaps = sorted(idle_gaps_ns(events, key).items(), key=lambda kv: -kv[1][0])[:top]
  overlaps = sorted(overlaps_ns(events, key).items(), key=lambda kv: -kv[1])[:top]
  busy, span = busy_ns(events) / steps / 1e6, span_ns(events) / steps / 1e6
  split = {"gemm": 0.0, "collective": 0.0, "other": 0.0}  # kernel time per step (may overlap)
  for s, e, name in events:
    split[kernel_kind(name)] += (e - s) / steps / 1e6
  return outs, {
    "kernel_ms_by_kind": split,
    "gpu_busy_ms": busy,
    "gpu_span_ms": span,
    "gpu_idle_ms": span - busy,
    "kernels": [
      {"name": k, "us_per_step": t / steps / 1e3, "launches_per_step": n / steps}
      for k, (t, n) in kernels
    ],
    "idle_gaps": [
      {"after": a, "before": b, "us_per_step": t / steps / 1e3, "gaps_per_step": n / steps}
      for (a, b), (t, n) in gaps
    ],
    "overlaps": [{"kernels": list(pair), "us_per_step": t / steps / 1e3} for pair, t in overlaps],
  }


def time_decode(model, plan, args, dtype):
  cfg = model.cfg
  gdef, state = nnx.split(model)
  cache = KVCache.init(cfg, args.batch, args.ctx, dtype)
  shardings = jax.tree.map(
    lambda a: plan.cache_sharding() if a.ndim > 1 else plan.replicated(), cache
  )
  half = lambda c: jax.device_put(  # noqa: E731
    KVCache(c.k, c.v, jnp.full((args.batch,), args.ctx // 2, jnp.int32)), shardings
  )
  # Start half-full so attention reads real context; steps stay inside the cache.
  cache = half(cache)
  toks = jnp.zeros((args.batch,), jnp.int32)
  decode = (
    lrjax.fuse(type(model).decode, group=not args.no_group) if args.fuse else type(model).decode
  )
  fn = greedy_loop(gdef, decode, args.steps, shardings)
  kernels = {}
  with (
    contextlib.nullcontext() if args.whole_policy else calls_judged_alone(),
    only_kernels(args.kernels),
  ):
    times, compile_s, cache, toks = time_loop(fn, state, cache, toks, half, args.reps)
    if args.fuse:  # what the fused step really runs: Triton custom calls in the compiled HLO
      text = fn.lower(state, half(cache), toks).compile().as_text()
      kernels = {
        "triton_calls": launch_modes.count_calls(text),
        "fused_ops_in_jaxpr": fused_ops(gdef, state, cache, toks, not args.no_group),
      }
  step = median_step(times, args.steps)
  if args.profile:
    (cache, toks), kernels["profile"] = kernel_profile(
      fn,
      (state, half(cache), toks),
      args.steps,
      events_out=args.events_out and args.events_out.format(**vars(args)),
    )
  w_bytes = device_bytes(state)
  kv_bytes = device_bytes(cache)
  bps = roofline_bps(jax.devices()[0].device_kind)
  return {
    "step_ms": step * 1e3,
    "tokens_per_s": args.batch / step,
    "step_ms_all_reps": [t / args.steps * 1e3 for t in times],
    "compile_s": compile_s,
    "device0_weight_bytes": w_bytes,
    "device0_kv_bytes": kv_bytes,
    "roofline_step_ms": (w_bytes + kv_bytes) / bps * 1e3,
    "roofline_fraction": (w_bytes + kv_bytes) / bps / step,
    **kernels,
  }


def time_serving(model, args):
  rng = np.random.default_rng(0)
  eng = Engine(
    model,
    max_slots=args.requests,
    max_len=args.prompt_len + args.new_tokens + 1,
    buckets=(args.prompt_len,),
    fuse=args.fuse,
  )
  sp = SamplingParams(max_new_tokens=args.new_tokens)
  mk = lambda: [
    Request(list(rng.integers(0, model.cfg.vocab_size, args.prompt_len)), sp)  # noqa: E731
    for _ in range(args.requests)
  ]
  eng.generate(mk()[:2])  # compile prefill and decode
  t0 = time.perf_counter()
  res = eng.generate(mk())
  wall = time.perf_counter() - t0
  ttft = [r.ttft_s * 1e3 for r in res]
  gaps = [g * 1e3 for g in itl(res)]
  n = sum(len(r.tokens) for r in res)
  return {
    "requests": args.requests,
    "prompt_len": args.prompt_len,
    "new_tokens": args.new_tokens,
    "ttft_ms_median": float(np.median(ttft)),
    "ttft_ms_p90": float(np.percentile(ttft, 90)),
    "itl_ms_median": float(np.median(gaps)),
    "itl_ms_p90": float(np.percentile(gaps, 90)),
    "tokens_per_s": n / wall,
  }


def fuse_modes(args) -> tuple[bool, ...]:
  return {"no": (False,), "yes": (True,), "both": (False, True)}[args.fuse_mode]


def predicted_ms(model, strategy, tp, batch, ctx, dtype) -> float | None:
  """The cost model's step for ``strategy`` (lrjax.sharding.cost, this host's table entry)."""
  c = sharding.cost.predict(
    strategy,
    model.cfg,
    model.layer_ranks() if any(model.layer_ranks()) else None,
    tp,
    batch=batch,
    ctx=ctx,
    dtype_bytes=jnp.dtype(dtype).itemsize,
    ic=sharding.cost.interconnect_for(jax.devices()[0].device_kind)[0],
  )
  return c.ms


def auto_record(name, model, ratio, tp, batch, args, dtype, out):
  """What ``strategy="auto"`` picks here, the step the cost model predicts for every strategy,
  and the pick's measured (unfused) step against the fastest measured low-rank one."""
  rep = sharding.explain(model, tp, batch=batch, ctx=args.ctx, device=jax.devices()[0].device_kind)
  measured = {
    r["strategy"]: r["step_ms"]
    for r in out["records"]
    if "step_ms" in r
    and not r.get("fuse")
    and (r["model"], r["ratio"], r["tp"], r["batch"]) == (name, ratio, tp, batch)
  }
  rec = {
    "model": name,
    "strategy": "auto",
    "ratio": ratio,
    "tp": tp,
    "batch": batch,
    "ctx": args.ctx,
    "layers": model.cfg.num_layers,
    "fuse": False,
    "chose": rep.choice,
    "interconnect": rep.interconnect,
    "predicted_ms": {c.strategy: c.ms for c in rep.costs if c.ms is not None},
    "measured_ms": measured,
  }
  if rep.choice in measured:
    best = min(measured, key=measured.get)
    rec.update(
      step_ms_of_choice=measured[rep.choice],
      fastest_measured=best,
      choice_over_fastest=measured[rep.choice] / measured[best],
    )
  return rec


def run_model(name, cfg, args, dtype, out, save):
  """Every TP size × strategy × ratio × batch (× unfused / fused) of one model, each record
  saved as it comes, then ``auto``'s pick per TP size and batch.

  Dense runs once (it has no ratio), unfused only (it has no factor pairs to fuse); serving runs
  for the first ratio only, through lrjax.fuse when fused steps are measured."""

  def build(ranks):
    t0 = time.perf_counter()
    m = LlamaForCausalLM(
      cfg,
      ranks=None if ranks is None else [ranks] * cfg.num_layers,
      dtype=dtype,
      param_dtype=dtype,
      scan_layers=False,
      rngs=nnx.Rngs(0),
    )
    print(
      f"{name}: built {'dense' if ranks is None else 'low-rank'} model in "
      f"{time.perf_counter() - t0:.1f} s",
      flush=True,
    )
    return m

  runs = []  # (strategy, ratio, model)
  lowrank_models = []  # (ratio, model)
  if "dense" in args.strategies:
    runs.append(("dense", None, build(None)))
  for ratio in args.ratio:
    ranks = compressed_ranks(cfg, ratio, multiple=8 if args.smoke else 64)
    out["ranks"][f"{name}@{ratio}"] = ranks
    lowrank = [s for s in args.strategies if s in LOWRANK]
    if lowrank or "auto" in args.strategies:
      m = build(ranks)
      runs += [(s, ratio, m) for s in lowrank]
      lowrank_models.append((ratio, m))
  for tp in args.tp:
    if tp > jax.device_count():
      print(f"skip tp={tp}: only {jax.device_count()} devices", flush=True)
      continue
    mesh = sharding.make_mesh(tp)
    for strategy, ratio, model in runs:
      try:
        sharding.shard(model, mesh, strategy)
      except ValueError as e:  # e.g. heads that do not split tp ways
        print(f"skip {name} tp={tp} {strategy}: {e}", flush=True)
        continue
      plan = model.tp_plan
      modes = (False,) if strategy == "dense" else fuse_modes(args)
      for fuse in modes:
        fa = argparse.Namespace(**{**vars(args), "fuse": fuse})
        tag = {
          "model": name,
          "strategy": strategy,
          "ratio": ratio,
          "tp": tp,
          "fuse": fuse,
          **({"group": not args.no_group} if fuse else {}),
          **({"whole_policy": True} if args.whole_policy else {}),
          **({"kernels": sorted(args.kernels)} if args.kernels else {}),
          # each call's scratch zeroed by XLA (LRJAX_TRITON_SCRATCH_CHAIN=0): not the default
          **({"scratch_chain": False} if fuse and not launch_modes.chain_scratch() else {}),
          # the Triton launcher (LRJAX_TRITON_LAUNCH or the default)
          **({"triton_launch": launch_modes.launch_mode()} if fuse else {}),
        }
        for batch in args.batch:
          a = argparse.Namespace(**{**vars(fa), "batch": batch})
          rec = {
            **tag,
            "batch": batch,
            "ctx": args.ctx,
            "layers": cfg.num_layers,
            **time_decode(model, plan, a, dtype),
            "predicted_ms": predicted_ms(model, strategy, tp, batch, args.ctx, dtype),
          }
          print(
            f"{name} tp={tp} {strategy:16s} fuse={int(fuse)} ratio={ratio} batch={batch:3d} "
            f"step {rec['step_ms']:.3f} ms (predicted {rec['predicted_ms']:.3f}) "
            f"{rec['tokens_per_s']:.0f} tok/s roofline {rec['roofline_fraction']:.2f} "
            f"(compile {rec['compile_s']:.1f} s)",
            flush=True,
          )
          out["records"].append(rec)
          save()
        serve = fuse == modes[-1]  # the fused engine when fused steps are measured
        if serve and not args.no_serving and ratio in (None, args.ratio[0]):
          s = time_serving(model, fa)
          out["records"].append({**tag, "serving": s})
          print(
            f"{name} tp={tp} {strategy:16s} fuse={int(fuse)} serving ttft "
            f"{s['ttft_ms_median']:.1f} ms itl {s['itl_ms_median']:.2f} ms "
            f"{s['tokens_per_s']:.0f} tok/s",
            flush=True,
          )
          save()
    if "auto" in args.strategies:
      for ratio, model in lowrank_models:
        for batch in args.batch:
          rec = auto_record(name, model, ratio, tp, batch, args, dtype, out)
          print(
            f"{name} tp={tp} auto ratio={ratio} batch={batch:3d} chose {rec['chose']}"
            + (
              f" (measured {rec['choice_over_fastest']:.2f}x the fastest, "
              f"{rec['fastest_measured']})"
              if "choice_over_fastest" in rec
              else ""
            ),
            flush=True,
          )
          out["records"].append(rec)
          save()


MARKERS = {"dense": "s", "naive_tp": "x", "lowrank_tp": "o", "lowrank_split": "D"}
MARKERS["lowrank_megatron"] = "^"


def plot(path_json: str) -> str:
  """Beside the JSON: the decode step per strategy over TP (one panel per model and batch;
  fused steps dotted), and per model each layout's speed-up over dense Megatron over TP with
  the targets (gray). Needs matplotlib."""
  from plotting import pyplot, save_beside

  plt = pyplot()
  with open(path_json) as fh:
    recs = [r for r in json.load(fh)["records"] if "step_ms" in r and r["ratio"] in (None, 0.4)]
  panels = sorted({(r["model"], r["batch"]) for r in recs})
  models = sorted({r["model"] for r in recs})
  n = len(panels) + len(models)
  cols = min(n, 4)
  rows = -(-n // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False)
  axes = list(axes.flat)
  for ax, (model, batch) in zip(axes, panels):
    lines = sorted({(r["strategy"], bool(r["fuse"])) for r in recs if r["model"] == model})
    for strategy, fuse in lines:
      rs = sorted(
        (
          r
          for r in recs
          if (r["model"], r["batch"], r["strategy"], bool(r["fuse"]))
          == (model, batch, strategy, fuse)
        ),
        key=lambda r: r["tp"],
      )
      if rs:
        ax.plot(
          [r["tp"] for r in rs],
          [r["step_ms"] for r in rs],
          marker=MARKERS.get(strategy, "."),
          ls=":" if fuse else "-",
          label=strategy + (" (fused)" if fuse else ""),
          alpha=0.6 if fuse else 1.0,
        )
    ax.set(xlabel="TP", ylabel="ms per decode step", title=f"{model}, batch {batch}")
    ax.legend(fontsize=6)
  sp = over_dense(recs)
  for ax, model in zip(axes[len(panels) :], models):
    curves = {}  # (strategy, batch) -> [(tp, speed-up)], unfused
    for r in recs:
      key = f"{r['model']}_{r['strategy']}_r{r['ratio']}_tp{r['tp']}_b{r['batch']}"
      if r["model"] == model and not r["fuse"] and key in sp:
        curves.setdefault((r["strategy"], r["batch"]), []).append((r["tp"], sp[key]["speedup"]))
    for (strategy, batch), pts in sorted(curves.items()):
      ax.plot(
        *zip(*sorted(pts)),
        marker=MARKERS.get(strategy, "."),
        ms=3 + batch / 16,
        lw=0.8,
        label=f"{strategy} b{batch}",
      )
    for tp, t in TARGETS.items():
      ax.plot([tp], [t], "s", color="gray", ms=9, alpha=0.5)
    ax.axhline(1.0, color="gray", lw=0.6)
    ax.set(
      xlabel="TP", ylabel="speed-up over dense Megatron", title=f"{model}: vs dense (targets gray)"
    )
    ax.legend(fontsize=5, ncol=2)
  tps = sorted({r["tp"] for r in recs})
  for ax in axes[:n]:
    ax.set_xscale("log", base=2)
    ax.set_xticks(tps, [str(t) for t in tps])
    ax.minorticks_off()
  for ax in axes[n:]:
    ax.set_visible(False)
  return save_beside(fig, path_json)


def over_dense(records) -> dict:
  """Each low-rank layout's decode speed-up over dense Megatron at the same model, TP size and
  batch (unfused dense against the layout's unfused and fused steps), with the target."""
  dense = {
    (r["model"], r["tp"], r["batch"]): r["step_ms"]
    for r in records
    if "step_ms" in r and r["strategy"] == "dense"
  }
  out = {}
  for r in records:
    if "step_ms" not in r or r["strategy"] == "dense":
      continue
    base = dense.get((r["model"], r["tp"], r["batch"]))
    if base is None:
      continue
    key = f"{r['model']}_{r['strategy']}_r{r['ratio']}_tp{r['tp']}_b{r['batch']}" + (
      "_fused" * bool(r["fuse"])
    )
    target = TARGETS.get(r["tp"])
    # the targets hold at 40 % removed, at every batch for TP 2 and 4, at batch 8 and 32 at TP 8
    applies = r["ratio"] == 0.4 and target and (r["tp"] != 8 or r["batch"] in (8, 32))
    out[key] = {
      "speedup": base / r["step_ms"],
      "target": target,
      "meets_target": (base / r["step_ms"] >= target) if applies else None,
    }
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--plot", metavar="JSON", help="only draw the plot of a results file")
  ap.add_argument("--model", nargs="+", choices=sorted(MODELS), default=["8b", "70b"])
  ap.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
  ap.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument(
    "--ratio",
    type=float,
    nargs="+",
    default=[0.4],
    help="fractions of each projection's params removed (serving: the first)",
  )
  ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
  ap.add_argument("--ctx", type=int, default=2048)
  ap.add_argument("--steps", type=int, default=32)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--requests", type=int, default=16)
  ap.add_argument("--prompt-len", type=int, default=128)
  ap.add_argument("--new-tokens", type=int, default=32)
  ap.add_argument("--no-serving", action="store_true")
  ap.add_argument(
    "--fuse",
    dest="fuse_mode",
    nargs="?",
    const="yes",
    default="no",
    choices=("no", "yes", "both"),
    help="run the low-rank steps through lrjax.fuse (Triton kernels on GPU, per the policy); "
    "'both': unfused and fused records (serving fused)",
  )
  ap.add_argument(
    "--whole-policy",
    action="store_true",
    help="with --fuse: the policy as shipped, its whole-model rules included "
    "(these records are not the tuning table's model_ab source)",
  )
  ap.add_argument(
    "--no-group",
    action="store_true",
    help="with --fuse: lrjax.fuse(..., group=False) (q/k/v as three lr_xuv)",
  )
  ap.add_argument(
    "--kernels",
    nargs="+",
    choices=policy.OPS,
    help="with --fuse: serve only these ops' kernels (the others on XLA), to see "
    "each kernel's share of a step; such records are not the table's model_ab; "
    "all ops but one, then --fuse as the next run: its model_op_ab",
  )
  ap.add_argument(
    "--profile",
    action="store_true",
    help="also trace one call: GPU busy time, top kernels, idle gaps by kernel "
    "pair and overlapping kernels per step",
  )
  ap.add_argument(
    "--events-out",
    metavar="PATH",
    help="with --profile: write the traced call's kernel events and compiled HLO "
    "as JSON to PATH (formatted with the arguments, e.g. {batch}, {fuse})",
  )
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--smoke", action="store_true", help="tiny dims (CPU check of the script)")
  ap.add_argument(
    "--append",
    action="store_true",
    help="keep --out's other records (a re-measured one replaces its record; "
    "each run's 'steps' keeps every step time it measured)",
  )
  ap.add_argument(
    "--out", default=os.path.join(os.path.dirname(__file__), "results", "tp_gpu.json")
  )
  args = ap.parse_args()
  if args.plot:
    print("wrote", plot(args.plot))
    return
  fused = args.fuse_mode != "no"
  if args.no_group and not fused:
    raise SystemExit("--no-group applies to the chains lrjax.fuse finds: it needs --fuse")
  for flag, given in (("--kernels", args.kernels), ("--whole-policy", args.whole_policy)):
    if given and not fused:
      raise SystemExit(
        f"{flag} chooses among the kernels lrjax.fuse's ops lower to: it needs --fuse"
      )
  if args.events_out and not args.profile:
    raise SystemExit("--events-out writes the trace --profile takes: it needs --profile")
  if args.profile and jax.devices()[0].platform != "gpu":
    raise SystemExit(
      f"--profile reads GPU kernel traces; this machine's devices are {jax.devices()}"
    )
  dtype = jnp.dtype(args.dtype)
  start = time.perf_counter()
  run = {
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "machine": machine(topology=True),
    "versions": versions("triton", "jax-triton"),
    "argv": sys.argv[1:],
    "env": {  # what steers lrjax's choices (the compile cache changes compile time only)
      k: v
      for k, v in sorted(os.environ.items())
      if k.startswith("LRJAX_") and not k.startswith("LRJAX_COMPILE_CACHE")
    },
  }
  out = {
    "benchmark": "tp_gpu",
    "roofline": "device-0 bytes (weights + KV cache) / "
    f"{roofline_bps(jax.devices()[0].device_kind) / 1e12} TB/s per step",
    "runs": [],
    "models": {},
    "ranks": {},
    "records": [],
  }
  if args.append and os.path.exists(args.out):
    with open(args.out) as fh:
      old = json.load(fh)
    for k in ("runs", "models", "ranks", "records"):
      out[k] = old[k]
  run["index"] = len(out["runs"])
  out["runs"].append(run)

  run["steps"] = []  # every step this run timed, kept when a later run replaces its record

  class Records(list):  # a re-measured record replaces the earlier one of the same kind,
    # except the step that follows a --kernels run (a model_op_ab pair)
    def append(self, rec):
      rec = {**rec, "run": run["index"]}
      if "step_ms" in rec:
        run["steps"].append(
          {
            k: rec.get(k)
            for k in (
              "model",
              "strategy",
              "ratio",
              "tp",
              "fuse",
              "group",
              "triton_launch",
              "kernels",
              "batch",
              "step_ms",
            )
            if rec.get(k) is not None
          }
        )
      kind = lambda r: (
        tuple(
          r.get(k)
          for k in (  # noqa: E731
            "model",
            "strategy",
            "ratio",
            "tp",
            "fuse",
            "group",
            "whole_policy",
            "scratch_chain",
            "triton_launch",
            "batch",
          )
        )
        + (tuple(r.get("kernels") or ()), "serving" in r)
      )
      self[:] = [r for r in self if kind(r) != kind(rec) or any(op_ab_pair(k, r) for k in self)]
      super().append(rec)

  out["records"] = Records(out["records"])

  def save():
    run["elapsed_s"] = time.perf_counter() - start
    write_json(args.out, out)

  for name in args.model:
    cfg = config(args, name)
    out["models"][name] = {**cfg.to_dict(), "param_dtype": str(dtype), "weights": "random"}
    run_model(name, cfg, args, dtype, out, save)
  speed = {}
  for r in out["records"]:
    if "step_ms" in r and r["strategy"] == "lowrank_tp":
      same = ("model", "ratio", "tp", "batch", "fuse")
      base = next(
        (
          b
          for b in out["records"]
          if b["strategy"] == "naive_tp" and "step_ms" in b and all(b[k] == r[k] for k in same)
        ),
        None,
      )
      if base:
        key = f"{r['model']}_r{r['ratio']}_tp{r['tp']}_b{r['batch']}" + ("_fused" * r["fuse"])
        speed[key] = base["step_ms"] / r["step_ms"]
  out["lowrank_over_naive_decode_speedup"] = speed
  print("lowrank_tp / naive_tp decode speed-up:", speed)
  out["over_dense_decode_speedup"] = over_dense(out["records"])
  for key, v in sorted(out["over_dense_decode_speedup"].items()):
    mark = "" if v["meets_target"] is None else (" meets" if v["meets_target"] else " misses")
    print(f"over dense {key}: {v['speedup']:.2f}x (target {v['target']}){mark}")
  save()
  print("wrote", args.out)


if __name__ == "__main__":
  main()
