"""Serving decode cost against the cache's size: attend over the whole cache or a context bucket.

One lrjax.serving.Engine per setting over the same random low-rank model (40 % of each
projection's params removed) and the same requests: ``--requests`` prompts of
``--prompt-len`` tokens, ``--new-tokens`` each, in an engine with ``max_len`` = each of
``--max-len``. ``whole``: ``attend_buckets=(max_len,)``, every step attends over the whole
cache (the engine before context buckets); ``buckets``: the default buckets (powers of two from
128). Each engine first serves the same requests once to compile; the second pass is timed:
median inter-token latency, tokens/s and TTFT.

  python benchmarks/serving_attend.py [--model tiny|8b] [--layers 4] [--max-len 512 2048 8192]

Writes benchmarks/results/serving_attend_<platform>.json.
"""

import argparse
import datetime
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lrjax.models import LlamaForCausalLM, ModelConfig
from lrjax.serving import Engine, Request, SamplingParams, itl
from lrjax.sharding.analysis import compressed_ranks
from results_io import write_json


def config(name, layers):
  if name == "tiny":
    return ModelConfig(
      vocab_size=512,
      hidden_size=256,
      intermediate_size=896,
      num_layers=layers,
      num_heads=8,
      num_kv_heads=2,
      head_dim=32,
    )
  return ModelConfig.llama3_8b().replace(num_layers=layers)


def serve(model, args, max_len, attend_buckets):
  rng = np.random.default_rng(0)
  sp = SamplingParams(max_new_tokens=args.new_tokens)
  reqs = [
    Request(list(rng.integers(0, model.cfg.vocab_size, args.prompt_len)), sp)
    for _ in range(args.requests)
  ]
  eng = Engine(
    model,
    max_slots=args.requests,
    max_len=max_len,
    buckets=(args.prompt_len,),
    attend_buckets=attend_buckets,
  )
  eng.generate(reqs)  # compiles every step this run takes
  t0 = time.perf_counter()
  res = eng.generate(reqs)
  wall = time.perf_counter() - t0
  n = sum(len(r.tokens) for r in res)
  return {
    "attend_buckets": list(eng.attend_buckets),
    "itl_ms_median": float(np.median(itl(res))) * 1e3,
    "ttft_ms_median": float(np.median([r.ttft_s for r in res])) * 1e3,
    "tokens_per_s": n / wall,
  }


def plot(path_json: str) -> str:
  """ITL over max_len beside the JSON (whole cache vs context bucket). Needs matplotlib."""
  from plotting import pyplot, save_beside

  plt = pyplot()
  with open(path_json) as fh:
    recs = sorted(json.load(fh)["records"], key=lambda r: r["max_len"])
  fig, ax = plt.subplots(figsize=(5, 3.6))
  x = [r["max_len"] for r in recs]
  for key, style, label in (
    ("whole", "x--", "attend over the whole cache"),
    ("buckets", "o-", "attend over a context bucket"),
  ):
    ax.plot(x, [r[key]["itl_ms_median"] for r in recs], style, label=label)
  ax.set(
    yscale="log",
    xlabel="engine max_len",
    ylabel="ITL, ms (median)",
    title="decode step vs cache size",
  )
  ax.set_xscale("log", base=2)
  ax.set_xticks(x, [str(v) for v in x])
  ax.minorticks_off()
  ax.legend(fontsize=7)
  return save_beside(fig, path_json)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--plot", metavar="JSON", help="only draw the plot of a results file")
  ap.add_argument("--model", choices=["tiny", "8b"], default="tiny")
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--max-len", type=int, nargs="+", default=[512, 2048, 8192])
  ap.add_argument("--requests", type=int, default=8)
  ap.add_argument("--prompt-len", type=int, default=48)
  ap.add_argument("--new-tokens", type=int, default=32)
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  if args.plot:
    print("wrote", plot(args.plot))
    return
  if min(args.max_len) <= args.prompt_len + args.new_tokens:
    ap.error(
      f"--max-len must exceed --prompt-len + --new-tokens ({args.prompt_len + args.new_tokens})"
    )
  dtype = jnp.dtype(args.dtype)
  cfg = config(args.model, args.layers)
  model = LlamaForCausalLM(
    cfg,
    ranks=[compressed_ranks(cfg, 0.4, multiple=8)] * cfg.num_layers,
    dtype=dtype,
    param_dtype=dtype,
    scan_layers=False,
    rngs=nnx.Rngs(0),
  )
  dev = jax.devices()[0]
  out = {
    "benchmark": "serving_attend",
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "machine": {
      "platform": platform.platform(),
      "device": dev.device_kind,
      "cpu_count": os.cpu_count(),
    },
    "versions": {"jax": jax.__version__},
    "argv": vars(args),
    "model": {**cfg.to_dict(), "compression_ratio": 0.4, "weights": "random"},
    "records": [],
  }
  for max_len in args.max_len:
    whole = serve(model, args, max_len, (max_len,))
    buckets = serve(model, args, max_len, None)
    rec = {
      "max_len": max_len,
      "whole": whole,
      "buckets": buckets,
      "itl_speedup": whole["itl_ms_median"] / buckets["itl_ms_median"],
    }
    out["records"].append(rec)
    print(
      f"max_len={max_len}: ITL {whole['itl_ms_median']:.3f} ms over the whole cache, "
      f"{buckets['itl_ms_median']:.3f} ms over a context bucket "
      f"(x{rec['itl_speedup']:.2f})",
      flush=True,
    )
  plat = "h200" if dev.platform == "gpu" else dev.platform
  path = args.out or os.path.join(
    os.path.dirname(__file__), "results", f"serving_attend_{plat}.json"
  )
  write_json(path, out)
  print("wrote", path)


if __name__ == "__main__":
  main()
