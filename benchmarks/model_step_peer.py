"""Decode step of a Llama-shaped model: lrjax against a PyTorch peer, on one GPU, in one run.

  python benchmarks/model_step_peer.py --model 8b --batch 1 8 16 --ctx 1024 --max-len 2048 \\
      --ratio 0.4 --out benchmarks/results/model_step_peer.json

Both sides build the same decoder (random bf16 weights; low-rank: every projection at the rank
that removes ``--ratio`` of its params, a multiple of 64) and time one greedy decode step per
row at context ``--ctx``:

  lrjax  dense (XLA) and low-rank through ``lrjax.fuse`` (the serving engine's default path):
         ``--steps`` steps inside one jit (a fori_loop), host-timed around block_until_ready,
         median of ``--reps`` calls divided by the steps; attention over the first ``--ctx``
         cache positions (the engine's attend bucket).
  torch  the same decoder written here: dense and low-rank (two nn.Linear a projection), cuBLAS
         GEMMs, SDPA over the filled part of a static KV cache, the whole step captured in one
         CUDA graph, once eager and once after ``torch.compile``; CUDA-event median of graph
         replays. ``torch_*_ms`` is the faster of the two; both are kept.

Each side runs in its own subprocess, one after the other, so one framework holds the GPU at a
time (or run them yourself: ``--side torch --side-out t.json``, ``--side lrjax --side-out
l.json``, then ``--merge t.json l.json --out ...``; a side writes after every record, and
``--partial`` keeps a batch whose torch side ran out of time, its torch fields null).
Records: device, model, batch, ctx, ratio, lrjax_ms (the step of ``--lrjax-kind``, by default
``lowrank``: lrjax's step as the card's table chooses it), lrjax_kind, lrjax_dense_ms,
lrjax_xla_attention_ms (the
low-rank step with the model's attention left to XLA instead of the decode-attention kernel),
lrjax_variants_ms (every ``--kinds`` step timed, e.g. with XLA's command buffers off or wider),
torch_dense_ms, torch_lowrank_ms, the ratios, bytes a step must read and hbm_roofline_frac (those
bytes over the card's HBM bandwidth, divided by the step), targets (``TARGETS``: each met or
short by what fraction, and the step's time above its HBM floor; ``--annotate F`` recomputes
them in a results file); with ``--profile``, each low-rank
step's kernel time per class (GEMM-like, attention, XLA fusions, memsets/copies, idle gaps),
launches, and every kernel's launches and time a step (a profile runs without command buffers).
``--out`` keeps the records of other devices and contexts already in it.
``--model tiny --device cpu`` checks the script on a CPU (no CUDA graphs there; nothing it
prints is a performance number).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import hbm_bps, write_json  # noqa: E402

MODELS = {
  # Llama-3-8B: hidden, heads, kv heads, head dim, MLP, vocab, layers
  "8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, vocab=128256, layers=32),
  "1b": dict(hidden=2048, heads=32, kv_heads=8, head_dim=64, mlp=8192, vocab=128256, layers=16),
  "tiny": dict(hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=128, vocab=256, layers=2),
}
PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def proj_shapes(m: dict) -> dict[str, tuple[int, int]]:
  h, q, kv, f = m["hidden"], m["heads"] * m["head_dim"], m["kv_heads"] * m["head_dim"], m["mlp"]
  return {
    "q_proj": (h, q),
    "k_proj": (h, kv),
    "v_proj": (h, kv),
    "o_proj": (q, h),
    "gate_proj": (h, f),
    "up_proj": (h, f),
    "down_proj": (f, h),
  }


def ranks_for(m: dict, ratio: float, multiple: int) -> dict[str, int]:
  """The rank keeping (1 - ratio) of each projection's params, rounded to ``multiple``."""
  out = {}
  for name, (k, n) in proj_shapes(m).items():
    r = (1.0 - ratio) * k * n / (k + n)
    out[name] = max(multiple, int(round(r / multiple)) * multiple)
  return out


def step_bytes(m: dict, ranks: dict | None, batch: int, ctx: int, elem: int = 2) -> int:
  """Bytes one decode step must read at least: every weight once, and the K/V of ``ctx``
  positions of every row and layer (embedding row reads are negligible and left out)."""
  w = 0
  for name, (k, n) in proj_shapes(m).items():
    w += (ranks[name] * (k + n)) if ranks else k * n
  w = w * m["layers"] + m["vocab"] * m["hidden"] + (2 * m["layers"] + 1) * m["hidden"]
  kv = 2 * m["layers"] * batch * m["kv_heads"] * ctx * m["head_dim"]
  return (w + kv) * elem


# ---------------------------------------------------------------------------------------- lrjax

# Kernel classes of a step's profile, by kernel name (first match wins).
CLASSES = (
  # lrjax's decode attention: a flash-decoding launch, then a merge launch (walk or tile)
  (
    "attention kernel",
    ("mha_forward", "decode_attention", "kv_attention", "_merge_kernel", "_merge_tile_kernel"),
  ),
  ("memsets/copies", ("memset", "memcpy", "copy")),
  (
    "GEMM-like",
    ("gemm", "cublas", "cutlass", "xmma", "sm90_", "sm80_", "matmul", "xuv", "mlp_", "triton"),
  ),
)
OTHER = "XLA fusions (norms, rope, residuals, cache writes, XLA's attention)"


# lrjax's step variants (--kinds): dense (XLA), low-rank fused (the default lowerings), the
# same with the model's attention through jax's Pallas kernel or lrjax's Triton kernel alone
# (its merge chosen by the split count, or the tile / walk merge at every count), or left to
# XLA, with XLA's command buffers (CUDA graphs) off / as wide as XLA takes them (its default
# captures runs of >= 5 fusions, GEMMs and custom calls; the whole capture adds the step's
# loop and conditionals, from runs of one), and with the Pallas kernel given a copied slice
# of each cache buffer instead of the whole buffer; and with RoPE and the cache writes in
# lrjax's attention launches (decode_attention_append's kernel: the ``lowrank_append_*``
# kinds choose it; the table's default since it measured faster); and with XLA's experimental
# Triton fusions (priority fusion making Triton fusions first, as of normalizations; or every fusion
# re-emitted by Triton's block-level emitter); and with the layers' norms in the grouped q/k/v
# and SwiGLU kernels (lr_normed's kernels: the ``*_norm*`` kinds choose them) and the
# residual adds in the o_proj and SwiGLU kernels' stores (lr_residual's: the ``*_residual*``
# kinds), or with them, RoPE and the cache writes left to XLA (``lowrank_xla_norms``); and
# with the attention kernels' splits bounded to a number of keys (the ``*_split_keys<n>``
# kinds: at ctx 1024 in a 2048 cache, the default plan's splits past the filled half return
# at once); and with the append kernel attending the new key apart from its cache loop (its
# default) or spliced into the loop's K and V tiles (``lowrank_append_apart`` /
# ``lowrank_append_splice``: decode_attention_append.NEW_KEY_APART True / False); and with the
# kernels launched by lrjax's own launcher (``lowrank_launch_pdl``: LRJAX_TRITON_LAUNCH=pdl)
# and each kernel letting the next launch start after its wait, its first tile prefetched
# before it (the ``*_pdl_overlap`` kinds: LRJAX_TRITON_PDL_OVERLAP=1).
LRJAX_KINDS = (
  "dense",
  "lowrank",
  "lowrank_xla_attention",
  "lowrank_pallas_attention",
  "lowrank_lrjax_attention",
  "lowrank_lrjax_attention_tile_merge",
  "lowrank_lrjax_attention_walk_merge",
  "lowrank_cmdbuf_off",
  "lowrank_cmdbuf_whole",
  "lowrank_sliced_cache",
  "lowrank_append_attention",
  "lowrank_xla_triton_norms",
  "lowrank_append_xla_triton_norms",
  "lowrank_xla_block_level_fusions",
  "lowrank_norm",
  "lowrank_append_norm",
  "lowrank_residual_epilogue",
  "lowrank_norm_residual",
  "lowrank_append_norm_residual",
  "lowrank_xla_norms",
  "lowrank_split_keys256",
  "lowrank_append_split_keys256",
  "lowrank_append_split_keys128",
  "lowrank_append_apart",
  "lowrank_append_splice",
  "lowrank_pdl_overlap",
  "lowrank_launch_pdl",
  "lowrank_launch_pdl_overlap",
)
# the gated kernels a kind runs with, the others off (whatever the card's table and the GPU
# flags say): decode_attention_append's (custom_calls/triton/lowering.py's
# APPEND_GPU_VERIFIED, dispatch.attention_append), lr_normed's and lr_residual's
# (dispatch.norm_in_kernels, .residual_epilogue); a kind not here runs with the table's choice
ALL_GATED = ("APPEND", "NORM", "RESIDUAL")
CHOSEN = {
  "lowrank_append_attention": ("APPEND",),
  "lowrank_append_xla_triton_norms": ("APPEND",),
  "lowrank_norm": ("NORM",),
  "lowrank_append_norm": ("APPEND", "NORM"),
  "lowrank_residual_epilogue": ("RESIDUAL",),
  "lowrank_norm_residual": ("NORM", "RESIDUAL"),
  "lowrank_append_norm_residual": ALL_GATED,
  "lowrank_xla_norms": (),  # norms, residual adds, RoPE and cache writes by XLA
  "lowrank_append_split_keys256": ALL_GATED,
  "lowrank_append_split_keys128": ALL_GATED,
  "lowrank_append_apart": ALL_GATED,
  "lowrank_append_splice": ALL_GATED,
}
# decode_attention_append.NEW_KEY_APART a kind runs with
APART = {"lowrank_append_apart": True, "lowrank_append_splice": False}
# the table's decode_attention.max_split_keys a kind runs with
SPLIT_KEYS = {k: int(k.rsplit("split_keys", 1)[1]) for k in LRJAX_KINDS if "_split_keys" in k}
# the decode_attention lowerings a kind goes without
WITHOUT = {
  "lowrank_pallas_attention": ("triton.decode_attention",),
  "lowrank_lrjax_attention": ("pallas.decode_attention",),
  "lowrank_lrjax_attention_tile_merge": ("pallas.decode_attention",),
  "lowrank_lrjax_attention_walk_merge": ("pallas.decode_attention",),
  "lowrank_sliced_cache": ("triton.decode_attention",),
  "lowrank_xla_attention": ("triton.decode_attention", "pallas.decode_attention"),
}
# the environment a kind's kernels are lowered under (launch_modes: the launcher, and
# whether a kernel launched as a programmatic dependent lets the next launch start after its
# wait and prefetches its first tile before it)
ENV = {
  "lowrank_pdl_overlap": {"LRJAX_TRITON_PDL_OVERLAP": "1"},
  "lowrank_launch_pdl": {"LRJAX_TRITON_LAUNCH": "pdl"},
  "lowrank_launch_pdl_overlap": {"LRJAX_TRITON_LAUNCH": "pdl", "LRJAX_TRITON_PDL_OVERLAP": "1"},
}
# XLA's priority fusion making Triton fusions first where it can (normalizations among them)
TRITON_NORMS = {"xla_gpu_experimental_enable_triton_heroless_priority_fusion": True}
COMPILER_OPTIONS = {
  "lowrank_xla_triton_norms": TRITON_NORMS,
  "lowrank_append_xla_triton_norms": TRITON_NORMS,
  "lowrank_xla_block_level_fusions": {
    "xla_gpu_experimental_enable_fusion_block_level_rewriter": True
  },
  "lowrank_cmdbuf_off": {"xla_gpu_enable_command_buffer": ""},
  "lowrank_cmdbuf_whole": {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
    "xla_gpu_graph_min_graph_size": 1,
  },
}
# profiled kinds: the low-rank ones but the command-buffer variants (a profile runs without
# command buffers, so theirs would not differ)
PROFILED = tuple(
  k for k in LRJAX_KINDS if k != "dense" and k not in ("lowrank_cmdbuf_off", "lowrank_cmdbuf_whole")
)
# lrjax's attention kernel's merge, forced for a kind
MERGE = {"lowrank_lrjax_attention_tile_merge": "tile", "lowrank_lrjax_attention_walk_merge": "walk"}


def kernel_class(name: str) -> str:
  low = name.lower()
  for cls, marks in CLASSES:
    if any(m in low for m in marks):
      return cls
  return OTHER


def attribute(fn, fn_args, steps: int) -> dict:
  """One profiled call of the ``steps``-step decode loop: per step, the kernel time of each
  class (ms and its fraction of the step's device span), launches, and the idle gaps."""
  import tempfile

  import jax

  from gpu_lowrank import busy_ns, device_kernel_events

  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      jax.block_until_ready(fn(*fn_args))
    events = sorted(device_kernel_events(d))
  span = (max(e for _, e, _ in events) - events[0][0]) / steps / 1e6
  busy = busy_ns(events) / steps / 1e6
  names, counts = {}, {}
  for st, en, name in events:
    key = name[:60]
    names[key] = names.get(key, 0.0) + (en - st) / steps / 1e3
    counts[key] = counts.get(key, 0) + 1 / steps
  ranked = sorted(names.items(), key=lambda kv: -kv[1])
  # every kernel: [launches a step, µs a step] (XLA names a reused kernel once)
  kernels = {k: [counts[k], us] for k, us in ranked}
  return classify({"span_ms": span, "busy_ms": busy, "kernels": kernels})


def classify(profile: dict) -> dict:
  """``profile`` with its per-class times (``classes``, ``launches_per_step``) computed from
  its kernel list, so that a profile measured earlier is read with the current classes."""
  span, busy = profile["span_ms"], profile["busy_ms"]
  ms, launches = {}, {}
  for name, (count, us) in profile["kernels"].items():
    c = kernel_class(name)
    ms[c] = ms.get(c, 0.0) + us / 1e3
    launches[c] = launches.get(c, 0) + count
  classes = {
    c: {"ms": ms[c], "frac_of_span": ms[c] / span, "launches": launches[c]} for c in sorted(ms)
  }
  classes["gaps (GPU idle)"] = {"ms": span - busy, "frac_of_span": (span - busy) / span}
  return {
    **profile,
    "launches_per_step": sum(launches.values()),
    "classes": classes,
  }


def _save(args, out) -> None:
  """Writes a side's results so far (a later step may run out of time)."""
  if args.side_out:
    with open(args.side_out, "w") as fh:
      json.dump(out, fh)


def run_lrjax(args, ranks) -> dict:
  import jax
  import jax.numpy as jnp

  from lrjax.models import ModelConfig

  m = MODELS[args.model]
  cfg = ModelConfig(
    model_type="llama",
    vocab_size=m["vocab"],
    hidden_size=m["hidden"],
    intermediate_size=m["mlp"],
    num_layers=m["layers"],
    num_heads=m["heads"],
    num_kv_heads=m["kv_heads"],
    head_dim=m["head_dim"],
    rope_theta=500000.0,
    max_position_embeddings=max(8192, args.max_len),
  )
  dtype = jnp.bfloat16
  out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "records": {}}
  out["argv"] = sys.argv[1:]
  built = None
  for kind in args.kinds:
    with _attention_lowerings(kind):
      try:
        built = _time_kind(args, cfg, ranks, dtype, kind, built, out)
      except Exception as e:  # e.g. a compiler option this XLA lacks: the other kinds still run
        if kind in ("dense", "lowrank"):
          raise
        print(f"lrjax {kind}: failed, {type(e).__name__}: {e}", flush=True)
        out.setdefault("failed", {})[kind] = f"{type(e).__name__}: {e}"[:2000]
        _save(args, out)
  return out


@contextlib.contextmanager
def _patched(module, name, value):
  """``module.name`` set to ``value`` for the block, restored after."""
  saved = getattr(module, name)
  setattr(module, name, value)
  try:
    yield
  finally:
    setattr(module, name, saved)


@contextlib.contextmanager
def _env(name, value):
  """``os.environ[name]`` set to ``value`` for the block, restored after."""
  saved = os.environ.get(name)
  os.environ[name] = value
  try:
    yield
  finally:
    if saved is None:
      os.environ.pop(name, None)
    else:
      os.environ[name] = saved


@contextlib.contextmanager
def _attention_lowerings(kind):
  """The decode_attention lowerings ``kind`` goes without (``WITHOUT``) removed for its run;
  for ``lowrank_sliced_cache`` the Pallas kernel's whole-buffer plan off, lrjax's merge
  forced for the kinds in ``MERGE``, and the kernels in ``CHOSEN`` chosen. Module flags
  below are read when the step is traced."""
  import importlib

  from lrjax.custom_calls.triton import lowering as cuda
  from lrjax.custom_calls.triton import policy
  from lrjax.lowering import registry

  registry.load_platform("cuda")
  chosen = CHOSEN.get(kind, ())
  switches = {
    "attention_append": "APPEND",
    "norm_in_kernels": "NORM",
    "residual_epilogue": "RESIDUAL",
  }
  table = policy.current()
  if kind in CHOSEN:  # the kind's kernels switched on, the others off, for its run
    table = table.with_values("dispatch", **{k: n in chosen for k, n in switches.items()})
  if kind in SPLIT_KEYS:
    table = table.with_values("decode_attention", max_split_keys=SPLIT_KEYS[kind])
  replans = kind == "lowrank_sliced_cache" or kind in SPLIT_KEYS
  with contextlib.ExitStack() as stack:
    for name, value in ENV.get(kind, {}).items():
      stack.enter_context(_env(name, value))
    gone = [
      k for k in registry.candidates("decode_attention", "cuda") if k.name in WITHOUT.get(kind, ())
    ]
    for k in gone:
      registry.unregister("decode_attention", "cuda", k.name)
    stack.callback(lambda: [registry.register(k) for k in gone])  # in their order
    for name in chosen:
      stack.enter_context(_patched(cuda, f"{name}_GPU_VERIFIED", True))
    kernels = "lrjax.custom_calls.triton."  # imported only where needed: they need jax-triton
    if kind in MERGE:
      ours = importlib.import_module(kernels + "decode_attention")
      stack.enter_context(_patched(ours, "MERGE", MERGE[kind]))
    if kind in APART:
      dap = importlib.import_module(kernels + "decode_attention_append")
      stack.enter_context(_patched(dap, "NEW_KEY_APART", APART[kind]))
    if replans:
      pallas = importlib.import_module(kernels + "decode_attention_pallas")
      if kind == "lowrank_sliced_cache":
        stack.enter_context(_patched(pallas, "MAX_BUFFER_SPLITS", 0))
      pallas.decode_attention.clear_cache()  # traced again under the new plan, and after it
      stack.callback(pallas.decode_attention.clear_cache)
    stack.enter_context(policy.use(table))
    yield


def _time_kind(args, cfg, ranks, dtype, kind, built, out):
  """Times lrjax's step ``kind`` at every batch into ``out["records"]``; returns the model
  built (reused by the next low-rank kind)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from decode_timing import greedy_loop

  import lrjax
  from lrjax.models import LlamaForCausalLM
  from lrjax.models.llama import KVCache

  lowrank = kind != "dense"
  if built is None or built[0] != lowrank:
    built = None  # one model on the GPU at a time
    t0 = time.perf_counter()
    model = LlamaForCausalLM(
      cfg,
      ranks=[ranks] * cfg.num_layers if lowrank else None,
      dtype=dtype,
      param_dtype=dtype,
      scan_layers=False,
      rngs=nnx.Rngs(0),
    )
    print(f"lrjax: built {kind} in {time.perf_counter() - t0:.1f} s", flush=True)
    built = (lowrank, *nnx.split(model))
    del model
  _, gdef, state = built
  decode = functools.partial(LlamaForCausalLM.decode, attend_len=args.ctx)
  if lowrank:
    decode = lrjax.fuse(decode)
  steps = args.steps
  fn = greedy_loop(gdef, decode, steps, compiler_options=COMPILER_OPTIONS.get(kind))
  for batch in args.batch:
    start = args.ctx - steps  # every step's position stays inside the attended ctx

    def fresh(batch=batch, start=start):
      c = KVCache.init(cfg, batch, args.max_len, dtype)
      k = tuple(jax.random.normal(jax.random.key(i), a.shape, dtype) for i, a in enumerate(c.k))
      return KVCache(k, k, jnp.full((batch,), start, jnp.int32))

    base = fresh()
    reset = lambda c, base=base: KVCache(  # noqa: E731
      tuple(jnp.copy(a) for a in base.k), tuple(jnp.copy(a) for a in base.v), jnp.copy(base.pos)
    )
    toks = jnp.ones((batch,), jnp.int32)
    t0 = time.perf_counter()
    for _ in range(2):
      _, toks = fn(state, reset(None), toks)
    toks.block_until_ready()
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(args.reps):
      c = reset(None)
      jax.block_until_ready(c)
      t0 = time.perf_counter()
      _, toks = fn(state, c, toks)
      toks.block_until_ready()
      times.append((time.perf_counter() - t0) / steps)
    times.sort()
    ms = times[len(times) // 2] * 1e3
    out["records"][f"{kind}/{batch}"] = {"ms": ms, "all_ms": [t * 1e3 for t in times]}
    if args.profile and kind in PROFILED:
      out["records"][f"{kind}/{batch}"]["profile"] = attribute(
        fn, (state, reset(None), toks), steps
      )
    _save(args, out)
    print(f"lrjax {kind:8s} batch {batch:3d}: {ms:.3f} ms (compile {compile_s:.1f} s)", flush=True)
    del base
  return built


# ---------------------------------------------------------------------------------------- torch


def run_torch(args, ranks) -> dict:
  import torch
  import torch.nn.functional as F
  from torch import nn

  dev = torch.device(args.device)
  cuda = dev.type == "cuda"
  m = MODELS[args.model]
  dtype = torch.bfloat16
  torch.manual_seed(0)
  hd, nh, nkv = m["head_dim"], m["heads"], m["kv_heads"]

  def linear(k, n, r=None):
    if r is None:
      lin = nn.Linear(k, n, bias=False)
    else:
      lin = nn.Sequential(nn.Linear(k, r, bias=False), nn.Linear(r, n, bias=False))
    for p in lin.parameters():
      nn.init.normal_(p, std=1.0 / math.sqrt(p.shape[1]))
    return lin

  class RMSNorm(nn.Module):
    def __init__(self, d):
      super().__init__()
      self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
      x32 = x.float()
      x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)
      return (x32 * self.weight.float()).to(x.dtype)

  def rope(x, cos, sin):  # x [B, H, 1, D]; cos/sin [B, 1, 1, D]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin

  class Layer(nn.Module):
    def __init__(self, rk):
      super().__init__()
      s = proj_shapes(m)
      for name in PROJS:
        setattr(self, name, linear(*s[name], None if rk is None else rk[name]))
      self.ln1, self.ln2 = RMSNorm(m["hidden"]), RMSNorm(m["hidden"])

    def forward(self, h, cos, sin, pos, kc, vc, ctx):
      b = h.shape[0]
      x = self.ln1(h)
      q = self.q_proj(x).view(b, 1, nh, hd).transpose(1, 2)
      k = self.k_proj(x).view(b, 1, nkv, hd).transpose(1, 2)
      v = self.v_proj(x).view(b, 1, nkv, hd).transpose(1, 2)
      q, k = rope(q, cos, sin), rope(k, cos, sin)
      kc.index_copy_(2, pos, k)  # the new key/value at position pos, in place
      vc.index_copy_(2, pos, v)
      a = F.scaled_dot_product_attention(q, kc[:, :, :ctx], vc[:, :, :ctx], enable_gqa=True)
      h = h + self.o_proj(a.transpose(1, 2).reshape(b, 1, nh * hd))
      x = self.ln2(h)
      return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

  class Model(nn.Module):
    def __init__(self, rk):
      super().__init__()
      self.embed = nn.Embedding(m["vocab"], m["hidden"])
      self.layers = nn.ModuleList([Layer(rk) for _ in range(m["layers"])])
      self.norm = RMSNorm(m["hidden"])
      self.lm_head = linear(m["hidden"], m["vocab"])
      inv = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
      self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, tok, pos, kcs, vcs, ctx: int):
      h = self.embed(tok)[:, None]  # [B, 1, hidden]
      ang = pos.float()[:, None] * self.inv_freq[None]  # [1, D/2]
      ang = torch.cat([ang, ang], -1)[None, None].to(h.dtype)  # [1, 1, 1, D]
      cos, sin = ang.cos(), ang.sin()
      for layer, kc, vc in zip(self.layers, kcs, vcs):
        h = layer(h, cos, sin, pos, kc, vc, ctx)
      return self.lm_head(self.norm(h))[:, 0].argmax(-1)

  out = {"device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__}
  out["records"], out["argv"] = {}, sys.argv[1:]
  for kind in ("dense", "lowrank"):
    with torch.device(dev):
      model = Model(None if kind == "dense" else ranks).to(dtype).eval()
    for batch in args.batch:
      kcs = [
        torch.randn(batch, nkv, args.max_len, hd, device=dev, dtype=dtype)
        for _ in range(m["layers"])
      ]
      vcs = [torch.randn_like(k) for k in kcs]
      tok = torch.ones(batch, dtype=torch.long, device=dev)
      pos = torch.full((1,), args.ctx - 1, dtype=torch.long, device=dev)
      rec = {}
      variants = [("eager", model.forward)]
      if not args.no_compile:
        variants.append(("compile", torch.compile(model.forward, fullgraph=True, dynamic=False)))
      for name, fn in variants:
        t0 = time.perf_counter()
        with torch.inference_mode():
          if cuda:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
              for _ in range(3):
                fn(tok, pos, kcs, vcs, args.ctx)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
              nxt = fn(tok, pos, kcs, vcs, args.ctx)
            graph.replay()
            torch.cuda.synchronize()
            setup_s = time.perf_counter() - t0
            times = []
            for _ in range(args.reps):
              e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
              e0.record()
              for _ in range(args.steps):
                graph.replay()
              e1.record()
              e1.synchronize()
              times.append(e0.elapsed_time(e1) / args.steps)
          else:  # CPU check only
            nxt = fn(tok, pos, kcs, vcs, args.ctx)
            setup_s = time.perf_counter() - t0
            times = []
            for _ in range(max(1, args.reps // 4)):
              t1 = time.perf_counter()
              fn(tok, pos, kcs, vcs, args.ctx)
              times.append((time.perf_counter() - t1) * 1e3)
        assert nxt.shape == (batch,)
        times.sort()
        rec[name] = {"ms": times[len(times) // 2], "all_ms": times, "setup_s": setup_s}
        print(
          f"torch {kind:8s} {name:8s} batch {batch:3d}: {rec[name]['ms']:.3f} ms "
          f"(setup {setup_s:.1f} s)",
          flush=True,
        )
      out["records"][f"{kind}/{batch}"] = rec
      _save(args, out)
      del kcs, vcs
    del model
    if cuda:
      torch.cuda.empty_cache()
  return out


# ---------------------------------------------------------------------------------------- main


def child(side: str, args, ranks) -> dict:
  """Runs one side in a subprocess and returns its JSON."""
  with tempfile.NamedTemporaryFile("r", suffix=".json") as fh:
    cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--side-out", fh.name]
    cmd += ["--ranks-json", json.dumps(ranks)] + sys.argv[1:]
    subprocess.run(cmd, check=True)
    return json.load(open(fh.name))


def side_of(doc) -> str | None:
  """ "lrjax" or "torch": which side wrote a --side JSON (an lrjax record is {"ms": ...}, a
  torch one a time per variant); None for one without records."""
  recs = list(doc.get("records", {}).values())
  if not recs:
    return None
  return "lrjax" if all("ms" in r for r in recs) else "torch"


def merge_sides(paths, ap):
  """(torch side, lrjax side) from --merge's JSONs: each side's records merged (a later
  file's record of a kind and batch replaces an earlier one's), all of one card."""
  sides: dict = {"torch": [], "lrjax": []}
  for f in paths:
    doc = json.load(open(f))
    if side_of(doc) is None:
      ap.error(f"--merge: {f} holds no records")
    sides[side_of(doc)].append(doc)
  if not sides["torch"] or not sides["lrjax"]:
    ap.error("--merge needs at least one JSON of each side (--side torch, --side lrjax)")
  merged = []
  for docs in (sides["torch"], sides["lrjax"]):
    out = dict(docs[0], records={})
    for doc in docs:
      if doc["device"] != out["device"]:
        ap.error(f"--merge: JSONs of two cards ({out['device']}, {doc['device']})")
      out["records"].update(doc["records"])
    if len(docs) > 1:
      out["argv"] = [doc.get("argv") for doc in docs]
    merged.append(out)
  return tuple(merged)


# The decode step's targets (docs/results.md#against-the-targets): (name, record field, the value
# to reach at batch 1, at other batches; None: no target there)
TARGETS = (
  ("vs_torch_dense", "speedup_vs_torch_dense", 1.5, 1.3),
  ("hbm_roofline", "hbm_roofline_frac", 0.8, None),
  ("vs_torch_lowrank", "speedup_vs_torch_lowrank", 1.25, 1.25),
)


def targets(rec: dict) -> dict:
  """Each target of ``rec``'s batch against its measured field: met, or short by what fraction;
  and the step's time above its HBM floor (bytes over bandwidth), the rest being the profile's."""
  out = {}
  for name, field, at_1, other in TARGETS:
    goal, got = at_1 if rec["batch"] == 1 else other, rec.get(field)
    if goal is None or got is None:
      continue
    out[name] = {"target": goal, "measured": got, "met": got >= goal,
                 "short_by": max(0.0, 1.0 - got / goal)}  # fmt: skip
  if rec.get("hbm_bps"):
    floor = rec["lowrank_step_bytes"] / rec["hbm_bps"] * 1e3
    out["floor_ms"], out["above_floor_ms"] = floor, rec["lrjax_ms"] - floor
  return out


def annotate(path: str) -> dict:
  """Recompute the ``targets`` block of every record in a results file (a function of the
  record's measured fields alone) and write it back."""
  doc = json.load(open(path))
  for r in doc["records"]:
    r["targets"] = targets(r)
  write_json(path, doc)
  return doc


def build_records(args, ranks, lj, pt) -> list[dict]:
  m = MODELS[args.model]
  bps = hbm_bps(pt["device"])
  recs = []
  for batch in args.batch:
    key = lambda kind, b=batch: f"{kind}/{b}"  # noqa: E731
    need = [(pt, "dense"), (pt, "lowrank"), (lj, args.lrjax_kind)]  # lrjax's dense: optional
    if not all(key(k) in side["records"] for side, k in need):
      if not (args.partial and key(args.lrjax_kind) in lj["records"]):
        print(f"batch {batch}: not measured on both sides, left out")
        continue
      print(f"batch {batch}: a side ran out of time; lrjax's side kept (--partial)")
    best = {
      k: min(v["ms"] for v in pt["records"][key(k)].values()) if key(k) in pt["records"] else None
      for k in ("dense", "lowrank")
    }
    lr_ms = lj["records"][key(args.lrjax_kind)]["ms"]
    nbytes = step_bytes(m, ranks, batch, args.ctx)
    rec = {
      "device": pt["device"],
      "model": args.model,
      "layers": m["layers"],
      "batch": batch,
      "ctx": args.ctx,
      "max_len": args.max_len,
      "ratio": args.ratio,
      "ranks": ranks,
      "lrjax_ms": lr_ms,
      "lrjax_kind": args.lrjax_kind,
      "lrjax_dense_ms": lj["records"].get(key("dense"), {}).get("ms"),
      "lrjax_xla_attention_ms": lj["records"].get(key("lowrank_xla_attention"), {}).get("ms"),
      "lrjax_variants_ms": {
        k: lj["records"][key(k)]["ms"] for k in LRJAX_KINDS if key(k) in lj["records"]
      },
      "profile": {
        k: classify(lj["records"][key(k)]["profile"])
        for k in PROFILED
        if "profile" in lj["records"].get(key(k), {})
      },
      "torch_dense_ms": best["dense"],
      "torch_lowrank_ms": best["lowrank"],
      "torch_variants_ms": {
        k: {n: v["ms"] for n, v in pt["records"].get(key(k), {}).items()}
        for k in ("dense", "lowrank")
      },
      "speedup_vs_torch_dense": best["dense"] / lr_ms if best["dense"] else None,
      "speedup_vs_torch_lowrank": best["lowrank"] / lr_ms if best["lowrank"] else None,
      "lowrank_step_bytes": nbytes,
      "dense_step_bytes": step_bytes(m, None, batch, args.ctx),
      "hbm_bps": bps,
      "hbm_roofline_frac": (nbytes / bps) / (lr_ms * 1e-3) if bps else None,
    }
    rec["targets"] = targets(rec)
    recs.append(rec)
  return recs


def print_targets(rec: dict) -> None:
  tg = rec.get("targets", {})
  parts = [
    f"{n} {v['measured']:.2f} (target {v['target']}: "
    + ("met" if v["met"] else f"{v['short_by']:.1%} short")
    + ")"
    for n, v in tg.items()
    if isinstance(v, dict)
  ]
  above = f"; {tg['above_floor_ms']:.2f} ms above the HBM floor" if "above_floor_ms" in tg else ""
  print(f"{rec['device']} batch {rec['batch']}: " + ", ".join(parts) + above)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", choices=sorted(MODELS), default="8b")
  ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
  ap.add_argument("--ctx", type=int, default=1024, help="attended context per step")
  ap.add_argument("--max-len", type=int, default=2048, help="KV cache length")
  ap.add_argument("--ratio", type=float, default=0.4, help="fraction of params removed")
  ap.add_argument("--steps", type=int, default=32, help="decode steps per timed call")
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--device", default="cuda", help="torch device (cpu: a check only)")
  ap.add_argument("--no-compile", action="store_true", help="torch eager+graph only")
  ap.add_argument("--out", help="results JSON")
  ap.add_argument(
    "--merge",
    nargs="+",
    metavar="JSON",
    help="build --out from the sides run separately (--side torch|lrjax --side-out F): their "
    "JSONs in any order, several of a side (e.g. one per batch) merged; one card",
  )
  ap.add_argument(
    "--lrjax-kind",
    choices=LRJAX_KINDS,
    default="lowrank",
    help="the kind that stands for lrjax's step in a record (lrjax_ms, the ratios, the roofline):"
    " with --merge, the kind whose choices are now the defaults when the sides were run before"
    " a default changed",
  )
  ap.add_argument(
    "--partial",
    action="store_true",
    help="with --merge: keep a batch whose torch side is missing (it ran out of time), its "
    "torch fields null",
  )
  ap.add_argument(
    "--annotate",
    metavar="JSON",
    help="recompute the targets block of every record in a results file, print them, and exit",
  )
  ap.add_argument("--side", choices=("lrjax", "torch"), help="run one side only")
  ap.add_argument("--side-out", metavar="JSON", help="where --side writes (after each record)")
  ap.add_argument("--ranks-json", help=argparse.SUPPRESS)
  ap.add_argument(
    "--profile", action="store_true", help="attribute lrjax's low-rank step per kernel class"
  )
  ap.add_argument(
    "--kinds",
    nargs="+",
    choices=LRJAX_KINDS,
    default=list(LRJAX_KINDS[:3]),
    help="lrjax's step variants to time (lowrank is needed for a record)",
  )
  args = ap.parse_args(argv)
  if args.annotate:
    for r in annotate(args.annotate)["records"]:
      print_targets(r)
    return 0
  if not 0.0 < args.ratio < 1.0:
    ap.error(f"--ratio {args.ratio} must be in (0, 1)")
  if not 0 < args.steps < args.ctx <= args.max_len:
    ap.error(f"need 0 < --steps ({args.steps}) < --ctx ({args.ctx}) <= --max-len ({args.max_len})")
  multiple = 8 if args.model == "tiny" else 64
  ranks = (
    json.loads(args.ranks_json)
    if args.ranks_json
    else ranks_for(MODELS[args.model], args.ratio, multiple)
  )
  if args.side:
    (run_lrjax if args.side == "lrjax" else run_torch)(args, ranks)
    return 0
  t0 = time.perf_counter()
  if args.merge:
    pt, lj = merge_sides(args.merge, ap)
  else:
    pt = child("torch", args, ranks)
    lj = child("lrjax", args, ranks)
  recs = build_records(args, ranks, lj, pt)
  meta = {
    "command": "python benchmarks/model_step_peer.py " + " ".join(sys.argv[1:]),
    "side_commands": {"torch": pt.get("argv"), "lrjax": lj.get("argv")},
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "device": pt["device"],
    "lrjax_device": lj["device"],
    "jax": lj["jax"],
    "torch": pt["torch"],
    "python": platform.python_version(),
    "wall_s": time.perf_counter() - t0,
    "method": __doc__.split("\n\n")[1],
  }
  print(
    f"{'batch':>5} {'lrjax':>8} {'xla attn':>8} {'lrjax dense':>11} {'torch dense':>11}"
    f" {'torch lr':>9}"
    f" {'vs dense':>8} {'vs lr':>6} {'roofline':>8}"
  )
  for r in recs:
    frac = f"{r['hbm_roofline_frac']:.2f}" if r["hbm_roofline_frac"] else "-"
    num = lambda v, w, p: f"{v:{w}.{p}f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
    print(
      f"{r['batch']:5d} {r['lrjax_ms']:8.3f} {r['lrjax_xla_attention_ms'] or 0:8.3f} "
      f"{r['lrjax_dense_ms'] or 0:11.3f} "
      f"{num(r['torch_dense_ms'], 11, 3)} {num(r['torch_lowrank_ms'], 9, 3)} "
      f"{num(r['speedup_vs_torch_dense'], 8, 2)} {num(r['speedup_vs_torch_lowrank'], 6, 2)}"
      f" {frac:>8}"
    )
  for r in recs:
    print_targets(r)
  if args.out:  # records of other devices (or other contexts) already in --out are kept
    old = json.load(open(args.out)) if os.path.exists(args.out) else {}
    if "meta" in old:  # one run per file, as written before runs were kept per device
      old = {"runs": {old["meta"]["device"]: old["meta"]}, "records": old["records"]}
    mine = {(r["device"], r["ctx"]) for r in recs}
    doc = {
      "runs": {**old.get("runs", {}), meta["device"]: meta},
      "records": [r for r in old.get("records", []) if (r["device"], r["ctx"]) not in mine] + recs,
    }
    write_json(args.out, doc)
    print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
