"""Compression quality in excess nats over an exact entropy floor.

A small Llama (hidden 128, 2 layers, GQA 4/2 heads, MLP 384) is trained on a sparse random
second-order Markov source over 256 tokens whose entropy rate is computed exactly
(``lrjax.quality``), then compressed at ratios 0.1, 0.2 and 0.4 with plain SVD, whitened SVD,
whitened + LoRA (eq. 9), and whitened with per-head q/k/v. Every variant is scored on the same
held-out tokens: excess = cross-entropy − entropy rate (nats/token).

The trained model is cached by config under ~/.cache/lrjax/quality (``--cache-dir``).

Usage: python benchmarks/quality.py [--cache-dir DIR] [--out benchmarks/results/quality.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time


from lrjax.bench import machine, versions
from lrjax.quality.report import VARIANTS, format_table, quality_table

HERE = os.path.dirname(os.path.abspath(__file__))


def checks(res: dict) -> dict:
  cell = {(r["variant"], r["ratio"]): r["excess_nats"] for r in res["rows"]}
  ratios = sorted({r["ratio"] for r in res["rows"]})
  return {
    "whiten_beats_svd_at_every_ratio": all(cell["whiten", q] < cell["svd", q] for q in ratios),
    "lora_improves_whiten_at_every_ratio": all(
      cell["whiten+lora", q] < cell["whiten", q] for q in ratios
    ),
    "lora_recovered_fraction": {
      str(q): (cell["whiten", q] - cell["whiten+lora", q])
      / (cell["whiten", q] - res["dense"]["excess_nats"])
      for q in ratios
    },
  }


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument(
    "--cache-dir",
    default=None,
    help="trained-model cache (default ~/.cache/lrjax/quality; '' disables)",
  )
  ap.add_argument("--out", default=os.path.join(HERE, "results", "quality.json"))
  ap.add_argument("--ratios", default="0.1,0.2,0.4")
  args = ap.parse_args()
  t0 = time.perf_counter()
  res = quality_table(
    tuple(float(q) for q in args.ratios.split(",")),
    variants=VARIANTS + ("whiten+per_head",),
    cache_dir=args.cache_dir,
  )
  res["checks"] = checks(res)
  res["machine"], res["versions"] = machine(), versions("optax", "scipy")
  res["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
  res["wall_seconds"] = round(time.perf_counter() - t0, 1)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as fh:
    json.dump(res, fh, indent=1)
  print(format_table(res))
  print(json.dumps(res["checks"], indent=1))
  print(f"wrote {args.out} ({res['wall_seconds']} s)")


if __name__ == "__main__":
  main()
