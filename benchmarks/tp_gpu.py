"""Decode latency and tokens/s under TP: dense vs naive_tp vs lowrank_tp (8B proportions).

Llama-3-8B shapes (hidden 4096, 32/8 heads of 128, MLP 14336, vocab 128256) with ``--layers``
decoder layers and random weights; the low-rank model keeps 60% of each projection's params
(ranks rounded to a multiple of 64). For each TP size and strategy:

  decode   ``--steps`` greedy decode steps of ``--batch`` sequences at ``--ctx`` cache length,
           inside one jit (a fori_loop), timed device-side (block_until_ready), median of
           ``--reps``; per-step latency, tokens/s, per-device bytes read and the fraction of
           the HBM roofline (bytes / 4.3 TB/s).
  serving  ``--requests`` concurrent requests through lrjax.serving.Engine (continuous batching,
           prompts of ``--prompt-len``): TTFT (submit → first token) and ITL (token gaps),
           median and p90, after a warm-up pass that compiles every shape.

  python benchmarks/tp_gpu.py --tp 2 4 [--layers 4] [--out results/tp_h200.json]

Runs unchanged for any TP size the host has devices for (TP=8 on 8 GPUs).
"""
import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lrjax import sharding
from lrjax.models import LlamaForCausalLM, ModelConfig
from lrjax.models.llama import KVCache
from lrjax.serving import Engine, Request, SamplingParams, itl
from lrjax.sharding.analysis import compressed_ranks

HBM_BPS = 4.3e12


def machine():
  d = jax.devices()
  info = {"platform": platform.platform(), "python": platform.python_version(),
          "devices": [str(x.device_kind) for x in d], "n_devices": len(d)}
  try:
    info["nvidia_smi"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
  except Exception as e:  # noqa: BLE001 (not an NVIDIA host)
    info["nvidia_smi"] = f"unavailable: {e}"
  return info


def versions():
  import flax
  out = {"jax": jax.__version__, "flax": flax.__version__}
  try:
    import jaxlib
    out["jaxlib"] = jaxlib.__version__
  except ImportError:
    pass
  return out


def config(args):
  if args.smoke:
    return ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=448, num_layers=2,
                       num_heads=8, num_kv_heads=8, head_dim=16)
  base = ModelConfig.llama3_8b()
  return base.replace(num_layers=args.layers)


def device_bytes(tree) -> int:
  """Bytes held by device 0 of every array in ``tree``."""
  n = 0
  for a in jax.tree.leaves(tree):
    if isinstance(a, jax.Array):
      n += a.addressable_shards[0].data.nbytes
  return n


def decode_loop(gdef, steps, cache_shardings):
  def run(state, cache, tokens):
    model = nnx.merge(gdef, state)

    def body(_, carry):
      cache, tok = carry
      logits, cache = model.decode(tok, cache)
      return cache, jnp.argmax(logits, -1).astype(jnp.int32)
    cache, tok = jax.lax.fori_loop(0, steps, body, (cache, tokens))
    return cache, tok
  return jax.jit(run, donate_argnums=(1,), out_shardings=(cache_shardings, None))


def time_decode(model, plan, args, dtype):
  cfg = model.cfg
  gdef, state = nnx.split(model)
  cache = KVCache.init(cfg, args.batch, args.ctx, dtype)
  shardings = jax.tree.map(lambda a: plan.cache_sharding() if a.ndim > 1 else plan.replicated(),
                           cache)
  half = lambda c: jax.device_put(  # noqa: E731
      KVCache(c.k, c.v, jnp.full((args.batch,), args.ctx // 2, jnp.int32)), shardings)
  # Start half-full so attention reads real context; steps stay inside the cache.
  cache = half(cache)
  toks = jnp.zeros((args.batch,), jnp.int32)
  fn = decode_loop(gdef, args.steps, shardings)
  t0 = time.perf_counter()
  for _ in range(2):   # the second call compiles for the committed token sharding
    cache, toks = fn(state, half(cache), toks)
  toks.block_until_ready()
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(args.reps):
    cache = half(cache)
    t0 = time.perf_counter()
    cache, toks = fn(state, cache, toks)
    toks.block_until_ready()
    times.append(time.perf_counter() - t0)
  step = float(np.median(times)) / args.steps
  w_bytes = device_bytes(state)
  kv_bytes = device_bytes(cache)
  return {"step_ms": step * 1e3, "tokens_per_s": args.batch / step,
          "step_ms_all_reps": [t / args.steps * 1e3 for t in times],
          "compile_s": compile_s, "device0_weight_bytes": w_bytes,
          "device0_kv_bytes": kv_bytes,
          "roofline_step_ms": (w_bytes + kv_bytes) / HBM_BPS * 1e3,
          "roofline_fraction": (w_bytes + kv_bytes) / HBM_BPS / step}


def time_serving(model, args):
  rng = np.random.default_rng(0)
  eng = Engine(model, max_slots=args.requests, max_len=args.prompt_len + args.new_tokens + 1,
               buckets=(args.prompt_len,))
  sp = SamplingParams(max_new_tokens=args.new_tokens)
  mk = lambda: [Request(list(rng.integers(0, model.cfg.vocab_size, args.prompt_len)), sp)  # noqa: E731
                for _ in range(args.requests)]
  eng.generate(mk()[:2])           # compile prefill and decode
  t0 = time.perf_counter()
  res = eng.generate(mk())
  wall = time.perf_counter() - t0
  ttft = [r.ttft_s * 1e3 for r in res]
  gaps = [g * 1e3 for g in itl(res)]
  n = sum(len(r.tokens) for r in res)
  return {"requests": args.requests, "prompt_len": args.prompt_len,
          "new_tokens": args.new_tokens, "ttft_ms_median": float(np.median(ttft)),
          "ttft_ms_p90": float(np.percentile(ttft, 90)), "itl_ms_median": float(np.median(gaps)),
          "itl_ms_p90": float(np.percentile(gaps, 90)), "tokens_per_s": n / wall}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
  ap.add_argument("--strategies", nargs="+", default=["dense", "naive_tp", "lowrank_tp"])
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--ratio", type=float, default=0.4)
  ap.add_argument("--batch", type=int, nargs="+", default=[32])
  ap.add_argument("--ctx", type=int, default=2048)
  ap.add_argument("--steps", type=int, default=32)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--requests", type=int, default=16)
  ap.add_argument("--prompt-len", type=int, default=128)
  ap.add_argument("--new-tokens", type=int, default=32)
  ap.add_argument("--no-serving", action="store_true")
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--smoke", action="store_true", help="tiny dims (CPU check of the script)")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                "tp_h200.json"))
  args = ap.parse_args()
  dtype = jnp.dtype(args.dtype)
  cfg = config(args)
  ranks = compressed_ranks(cfg, args.ratio, multiple=8 if args.smoke else 64)
  out = {"benchmark": "tp_gpu", "date": datetime.datetime.now(
      datetime.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
      "versions": versions(), "argv": sys.argv[1:],
      "model": {**cfg.to_dict(), "ranks": ranks, "compression_ratio": args.ratio,
                "param_dtype": str(dtype), "weights": "random"},
      "roofline": f"device-0 bytes (weights + KV cache) / {HBM_BPS / 1e12} TB/s per step",
      "records": []}

  def save():
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
      json.dump(out, fh, indent=1)

  models = {}
  for strategy in args.strategies:
    key = "dense" if strategy == "dense" else "lowrank"
    if key not in models:
      t0 = time.perf_counter()
      models[key] = LlamaForCausalLM(cfg, ranks=None if key == "dense" else [ranks] * cfg.num_layers,
                                     dtype=dtype, param_dtype=dtype, scan_layers=False,
                                     rngs=nnx.Rngs(0))
      print(f"built {key} model in {time.perf_counter() - t0:.1f} s", flush=True)
  for tp in args.tp:
    if tp > jax.device_count():
      print(f"skip tp={tp}: only {jax.device_count()} devices", flush=True)
      continue
    mesh = sharding.make_mesh(tp)
    for strategy in args.strategies:
      model = models["dense" if strategy == "dense" else "lowrank"]
      sharding.shard(model, mesh, strategy)
      plan = model.tp_plan
      for batch in args.batch:
        a = argparse.Namespace(**{**vars(args), "batch": batch})
        rec = {"strategy": strategy, "tp": tp, "batch": batch, "ctx": args.ctx,
               "layers": cfg.num_layers, **time_decode(model, plan, a, dtype)}
        print(f"tp={tp} {strategy:10s} batch={batch:3d} step {rec['step_ms']:.3f} ms "
              f"{rec['tokens_per_s']:.0f} tok/s roofline {rec['roofline_fraction']:.2f} "
              f"(compile {rec['compile_s']:.1f} s)", flush=True)
        out["records"].append(rec)
        save()
      if not args.no_serving:
        s = time_serving(model, args)
        out["records"].append({"strategy": strategy, "tp": tp, "serving": s})
        print(f"tp={tp} {strategy:10s} serving ttft {s['ttft_ms_median']:.1f} ms itl "
              f"{s['itl_ms_median']:.2f} ms {s['tokens_per_s']:.0f} tok/s", flush=True)
        save()
  speed = {}
  for r in out["records"]:
    if "step_ms" in r and r["strategy"] == "lowrank_tp":
      base = next((b for b in out["records"] if b.get("strategy") == "naive_tp" and
                   b["tp"] == r["tp"] and b.get("batch") == r["batch"] and "step_ms" in b), None)
      if base:
        speed[f"tp{r['tp']}_b{r['batch']}"] = base["step_ms"] / r["step_ms"]
  out["lowrank_over_naive_decode_speedup"] = speed
  print("lowrank_tp / naive_tp decode speed-up:", speed)
  save()
  print("wrote", args.out)


if __name__ == "__main__":
  main()
