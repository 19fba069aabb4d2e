"""When does the low-rank KV cache pay off? Dense K/V cache vs rank-space cache (x·U_k, x·U_v).

GQA (Llama-3-8B shapes: 8 KV heads) and MHA (Llama-2-7B shapes: 32 KV heads) with ``--layers``
layers, 40% of every projection's params removed. For each context length: cache bytes per
token and the decode step time of ``--batch`` sequences (``--steps`` steps inside one jit, median
of ``--reps``), dense cache vs low-rank cache (which rebuilds K and V for the whole cache every
step). Writes benchmarks/results/lowrank_kv_<platform>.json.

  python benchmarks/lowrank_kv.py [--ctx 1024 4096] [--tp 1]
"""

import argparse
import dataclasses
import datetime
import json
import os
import platform

import jax
import jax.numpy as jnp
from flax import nnx

from lrjax import sharding
from lrjax.models import KVCache, LlamaForCausalLM, ModelConfig
from lrjax.serving import lowrank_kv as lrkv
from lrjax.sharding.analysis import compressed_ranks

from decode_timing import greedy_loop, median_step, time_loop


def configs(args):
  if args.smoke:
    gqa = ModelConfig(
      vocab_size=256,
      hidden_size=128,
      intermediate_size=448,
      num_layers=2,
      num_heads=8,
      num_kv_heads=2,
      head_dim=16,
    )
    return {"gqa": gqa, "mha": gqa.replace(num_kv_heads=8)}
  return {
    "gqa": ModelConfig.llama3_8b().replace(num_layers=args.layers),
    "mha": ModelConfig.llama2_7b().replace(num_layers=args.layers),
  }


def run(model, cfg, args, ctx, lowrank, dtype, plan):
  gdef, state = nnx.split(model)
  if lowrank:
    cache = lrkv.LowRankKVCache.init(model, args.batch, ctx, dtype)
    spec = jax.sharding.PartitionSpec("data") if plan else None
  else:
    cache = KVCache.init(cfg, args.batch, ctx, dtype)
    spec = plan.cache_sharding().spec if plan else None
  if plan:
    sh = jax.tree.map(
      lambda a: jax.sharding.NamedSharding(plan.mesh, spec) if a.ndim > 1 else plan.replicated(),
      cache,
    )
  else:
    sh = jax.tree.map(lambda a: a.sharding, cache)
  dec = lrkv.decode if lowrank else type(model).decode
  fn = greedy_loop(gdef, dec, args.steps, sh)
  half = lambda c: jax.device_put(  # noqa: E731
    dataclasses.replace(c, pos=jnp.full((args.batch,), ctx // 2, jnp.int32)), sh
  )
  tok = jnp.zeros((args.batch,), jnp.int32)
  times, _, _, _ = time_loop(fn, state, cache, tok, half, args.reps)
  return median_step(times, args.steps) * 1e3


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--ctx", type=int, nargs="+", default=[1024, 4096])
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--tp", type=int, default=1)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--smoke", action="store_true")
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  dtype = jnp.dtype(args.dtype)
  plat = jax.devices()[0].platform
  out = {
    "benchmark": "lowrank_kv",
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "machine": {
      "platform": platform.platform(),
      "devices": [d.device_kind for d in jax.devices()[: args.tp]],
    },
    "versions": {"jax": jax.__version__},
    "batch": args.batch,
    "tp": args.tp,
    "dtype": str(dtype),
    "records": [],
  }
  for name, cfg in configs(args).items():
    ranks = compressed_ranks(cfg, 0.4, multiple=8 if args.smoke else 64)
    model = LlamaForCausalLM(
      cfg,
      ranks=[ranks] * cfg.num_layers,
      dtype=dtype,
      param_dtype=dtype,
      scan_layers=False,
      rngs=nnx.Rngs(0),
    )
    plan = None
    if args.tp > 1:
      plan = sharding.shard(model, sharding.make_mesh(args.tp), "lowrank_tp").tp_plan
    dense_b = lrkv.bytes_per_token(model, dtype.itemsize, lowrank=False)
    low_b = lrkv.bytes_per_token(model, dtype.itemsize, lowrank=True)
    for ctx in args.ctx:
      d = run(model, cfg, args, ctx, False, dtype, plan)
      lo = run(model, cfg, args, ctx, True, dtype, plan)
      rec = {
        "model": name,
        "kv_heads": cfg.num_kv_heads,
        "ranks_kv": [ranks["k_proj"], ranks["v_proj"]],
        "ctx": ctx,
        "dense_step_ms": d,
        "lowrank_step_ms": lo,
        "lowrank_speedup": d / lo,
        "dense_kv_bytes_per_token": dense_b,
        "lowrank_kv_bytes_per_token": low_b,
        "memory_saving": dense_b / low_b,
      }
      out["records"].append(rec)
      print(
        f"{name} ctx={ctx}: dense {d:.3f} ms, low-rank {lo:.3f} ms "
        f"(x{d / lo:.2f}); cache {dense_b} → {low_b} B/token (x{dense_b / low_b:.2f})",
        flush=True,
      )
  path = args.out or os.path.join(
    os.path.dirname(__file__), "results", f"lowrank_kv_{'h200' if plat == 'gpu' else plat}.json"
  )
  with open(path, "w") as fh:
    json.dump(out, fh, indent=1)
  print("wrote", path)


if __name__ == "__main__":
  main()
