"""Collectives per token of one decoder layer under each TP strategy, and its weights per device.

Llama-3-70B proportions shrunk 32× (hidden 8192→256, 64 heads of 128→4, 8 KV heads, MLP
28672→896), 40% of each projection's params removed (ranks rounded to multiples of 8). Each
strategy is compiled on 8 simulated CPU devices; every collective in the compiled HLO is counted
with its bytes (all-reduce counted twice, DeInfer Table 1). Logits of a 1-layer model are compared
with single-device logits. Rows with ``fused`` run ``lrjax.fuse`` with CPU stand-in kernels that
lower to opaque custom calls (lrjax.sharding.testing), partitioned by lowering/partitioning.py.
Writes benchmarks/results/tp_collectives.json.

  python benchmarks/tp_collectives.py [--tp 2 4 8]
"""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402

import flax  # noqa: E402
import jax  # noqa: E402
from flax import nnx  # noqa: E402

from lrjax.models import LlamaForCausalLM, ModelConfig  # noqa: E402
from lrjax.sharding.analysis import compressed_ranks, measure  # noqa: E402

SHRINK = 32
RATIO = 0.4


def config():
  h, m, hd = 8192 // SHRINK, 28672 // SHRINK, 128 // SHRINK
  return ModelConfig(
    vocab_size=512,
    hidden_size=h,
    intermediate_size=m,
    num_layers=1,
    num_heads=64,
    num_kv_heads=8,
    head_dim=hd,
    rope_theta=500000.0,
  )


def table1(h=8192, hkv=1024, m=28672, ratio=RATIO):
  """DeInfer Table 1 at full size with our ranks (elements per token, all-reduce ×2)."""
  r = lambda k, n: (1 - ratio) * k * n / (k + n)  # noqa: E731
  naive = 2 * (2 * h + 2 * hkv) + 2 * (2 * m + h)
  low = (r(h, h) + 2 * r(h, hkv) + 2 * r(h, m)) + 2 * (r(h, h) + r(m, h))
  return {"naive_tp": naive, "lowrank_tp": low, "ratio": low / naive}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
  ap.add_argument(
    "--out", default=os.path.join(os.path.dirname(__file__), "results", "tp_collectives.json")
  )
  args = ap.parse_args()
  cfg = config()
  ranks = compressed_ranks(cfg, RATIO, multiple=8)
  mk_lr = lambda: LlamaForCausalLM(cfg, ranks=[ranks], rngs=nnx.Rngs(0))  # noqa: E731
  mk_dense = lambda: LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))  # noqa: E731
  records = []
  for tp in args.tp:
    for strategy, mk in (
      ("dense", mk_dense),
      ("naive_tp", mk_lr),
      ("lowrank_tp", mk_lr),
      ("repl_u_tp", mk_lr),
      ("lowrank_split", mk_lr),
      ("lowrank_megatron", mk_lr),
    ):
      for fused in (False, True) if strategy != "dense" else (False,):
        rec = measure(mk, cfg, strategy, tp, fused=fused)
        records.append(rec)
        print(
          f"tp={tp} {strategy:11s} fused={fused!s:5s} bytes/token={rec['bytes_per_token']:9.1f}"
          f" n={rec['n_collectives']:2d} err={rec['max_rel_logit_err']:.2e}"
          f" kernels={rec['kernel_custom_calls']}"
          f" whole-weight gathers={rec['whole_weight_all_gathers']}"
          f" layer weights/device={rec['layer_weight_bytes_per_device']}"
        )
  ratios = {}
  for tp in args.tp:
    get = lambda s: next(
      r
      for r in records
      if r["strategy"] == s
      and r["tp"] == tp  # noqa: E731
      and not r["fused"]
    )
    ratios[str(tp)] = get("lowrank_tp")["bytes_per_token"] / get("naive_tp")["bytes_per_token"]
  print("lowrank_tp / naive_tp bytes:", ratios)
  out = {
    "benchmark": "tp_collectives",
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "machine": {
      "platform": platform.platform(),
      "processor": platform.processor(),
      "devices": f"{jax.device_count()} simulated CPU devices",
    },
    "versions": {
      "jax": jax.__version__,
      "flax": flax.__version__,
      "python": platform.python_version(),
    },
    "model": {
      **cfg.to_dict(),
      "ranks": ranks,
      "compression_ratio": RATIO,
      "proportions": f"Llama-3-70B / {SHRINK}",
    },
    "cost_model": "bytes of every collective in the compiled HLO of one decoder layer per "
    "token; all-reduce counted 2x its operand, all-gather its result (Table 1); "
    "layer_weight_bytes_per_device: the layer's params held by device 0",
    "lowrank_over_naive_bytes": ratios,
    "deinfer_table1_full_size_elements": table1(),
    "records": records,
  }
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as fh:
    json.dump(out, fh, indent=1)
  print("wrote", args.out)


if __name__ == "__main__":
  main()
