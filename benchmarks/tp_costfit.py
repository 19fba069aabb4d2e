"""Fit the TP cost model's constants (lrjax/sharding/interconnect.json) to measured decode steps.

Reads the decode records of ``benchmarks/tp_gpu.py`` results files (unfused steps of every
strategy, model, TP size and batch), predicts each record's bytes and collectives with
:mod:`lrjax.sharding.cost` (the features ``auto`` itself uses) and fits, by least squares,

  step_ms = overhead + per_token·batch + bytes/HBM + collectives·latency + cost bytes/link

  python benchmarks/tp_costfit.py benchmarks/results/tp_h200.json            # print the fit
  python benchmarks/tp_costfit.py benchmarks/results/tp_h200.json --write    # and store it
  python benchmarks/tp_costfit.py --predict [--device "NVIDIA H200"]         # predictions

``--write`` replaces the entry of the records' device kind in interconnect.json, citing the
files and this command. ``--predict`` prints, as markdown, each strategy's predicted decode step
and speed-up over dense Megatron for Llama-3-8B and 70B shapes at 40 % removed (4 layers and
all layers), TP 2/4/8 and batch 1/8/32/64, with that device's table entry
(docs/tensor_parallel.md quotes it).
"""

import argparse
import json
import os
import sys

import numpy as np

from lrjax.models import ModelConfig
from lrjax.sharding import cost


def records(paths):
  """(record, its results file's models/ranks tables, device kind) of every unfused decode step."""
  for path in paths:
    with open(path) as f:
      d = json.load(f)
    runs = {r.get("index", i): r for i, r in enumerate(d["runs"])}
    for r in d["records"]:
      if "step_ms" not in r or r.get("fuse") or r.get("strategy") == "auto":
        continue
      kinds = runs.get(r.get("run", 0), d["runs"][-1])["machine"]["devices"]
      yield r, d, kinds[0]


def features(r, d):
  m = {k: v for k, v in d["models"][r["model"]].items() if k not in ("param_dtype", "weights")}
  cfg = ModelConfig.from_dict(m).replace(num_layers=r["layers"])
  ranks = None
  if r["ratio"] is not None:
    ranks = [d["ranks"][f"{r['model']}@{r['ratio']}"]] * cfg.num_layers
  c = cost.predict(r["strategy"], cfg, ranks, r["tp"], batch=r["batch"], ctx=r["ctx"])
  if c.ms is None:
    raise ValueError(f"{r['strategy']} at tp={r['tp']}: {c.note}")
  nbytes = (c.read_bytes + c.kv_bytes) / 1e9
  return [1.0, r["batch"], nbytes, c.collectives, c.collective_bytes / 1e9]


def predict_table(device: str) -> str:
  from lrjax.sharding.analysis import compressed_ranks

  ic, how = cost.interconnect_for(device)
  names = ("lowrank_megatron", "lowrank_split", "lowrank_tp", "naive_tp")
  lines = [f"Predicted decode step (ms) and speed-up over dense Megatron; {how}", ""]
  for label, preset in (
    ("Llama-3-8B", ModelConfig.llama3_8b),
    ("Llama-3-70B", ModelConfig.llama3_70b),
  ):
    full = preset()
    for layers in (4, full.num_layers):
      cfg = full.replace(num_layers=layers)
      ranks = [compressed_ranks(cfg, 0.4, 64)] * layers
      lines += [
        f"**{label} shapes, {layers} layers, 40 % removed**",
        "",
        "| TP | batch | dense | " + " | ".join(names) + " | auto |",
        "|---|---|---|" + "---|" * (len(names) + 1),
      ]
      for tp in (2, 4, 8):
        for batch in (1, 8, 32, 64):
          kw = dict(batch=batch, ctx=cost.DEFAULT_CTX, interconnect=ic)
          dense = cost.explain(cfg, None, tp, **kw).costs[0].ms
          rep = cost.explain(cfg, ranks, tp, **kw)
          ms = {c.strategy: c.ms for c in rep.costs}
          cells = [f"{ms[n]:.3f} ({dense / ms[n]:.2f}x)" for n in names]
          lines.append(
            f"| {tp} | {batch} | {dense:.3f} | " + " | ".join(cells) + f" | {rep.choice} |"
          )
      lines.append("")
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("results", nargs="*", help="tp_gpu.py results JSON files")
  ap.add_argument("--write", action="store_true", help="store the fit in interconnect.json")
  ap.add_argument("--predict", action="store_true", help="print the predictions (markdown)")
  ap.add_argument("--device", default="NVIDIA H200", help="with --predict: the table entry")
  args = ap.parse_args()
  if args.predict:
    print(predict_table(args.device))
    return
  if not args.results:
    raise SystemExit("give tp_gpu.py results files to fit, or --predict")
  rows, ys, kinds, recs = [], [], set(), []
  for r, d, kind in records(args.results):
    rows.append(features(r, d))
    ys.append(r["step_ms"])
    kinds.add(kind)
    recs.append(r)
  if len(kinds) != 1:
    raise SystemExit(f"records from several device kinds {sorted(kinds)}: fit one at a time")
  a, y = np.asarray(rows), np.asarray(ys)
  x, *_ = np.linalg.lstsq(a, y, rcond=None)
  if (x[1:] <= 0).any():
    raise SystemExit(f"a non-positive constant {x}: these records cannot separate the terms")
  pred = a @ x
  err = np.abs(pred - y) / y
  kind = kinds.pop()
  # columns: 1, batch, GB read, collectives, cost GB; the coefficients are ms per unit
  fit = {
    "hbm_tbps": round(float(1.0 / x[2]), 3),  # GB per ms is TB/s
    "latency_us": round(float(x[3] * 1e3), 2),
    "link_gbps": round(float(1e3 / x[4]), 1),
    "overhead_ms": round(float(x[0]), 4),
    "per_token_us": round(float(x[1] * 1e3), 3),
  }
  print(f"{kind}: {len(y)} records; fit {fit}")
  print(f"relative error: median {np.median(err):.3f}, max {err.max():.3f}")
  for r, p, yy in sorted(zip(recs, pred, y), key=lambda t: -abs(t[1] - t[2]) / t[2])[:5]:
    print(
      f"  worst: {r['model']} {r['strategy']} tp={r['tp']} batch={r['batch']}: "
      f"measured {yy:.3f} predicted {p:.3f} ms"
    )
  if args.write:
    with open(cost.TABLE_PATH) as f:
      table = json.load(f)
    files = ", ".join(os.path.relpath(p) for p in args.results)
    table["devices"][kind] = {
      **fit,
      "measured": True,
      "source": (
        f"least-squares fit to {len(y)} decode steps in {files} (median error "
        f"{np.median(err):.1%}, max {err.max():.1%}): python benchmarks/tp_costfit.py "
        + " ".join(args.results)
        + " --write"
      ),
    }
    with open(cost.TABLE_PATH, "w") as f:
      json.dump(table, f, indent=1)
      f.write("\n")
    print("wrote", cost.TABLE_PATH)


if __name__ == "__main__":
  sys.exit(main())
