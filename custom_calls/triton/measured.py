"""Measured speed of the Triton lowerings against XLA's, per benchmarked shape (H200).

The registry asks ``faster`` before it lowers a primitive with a Triton kernel: the
verdict of the benchmarked shape nearest to the call's (distance: |log2| of the token
ratio plus |log2| of the weight-bytes ratio, same op). Where the kernel measured slower
than XLA's unfused chain there (below PARITY), the call is declined and XLA lowers the
reference; ``lrjax.lowering.prefer_kernels()`` overrides that. Non-gated MLPs use the
SwiGLU measurements. Measured on one H200; other NVIDIA GPUs get the same verdicts.

RECORDS is generated from the committed benchmark results, never edited by hand:
``python benchmarks/gpu_lowrank.py --emit-policy benchmarks/results/gpu_lowrank_h200.json``
(tests/custom_calls/triton/test_triton_policy.py checks that they agree).
"""
from __future__ import annotations

import json
import math
import re

SOURCE = "benchmarks/results/gpu_lowrank_h200.json"
# At or above this fraction of XLA's speed the kernel keeps serving: run-to-run spread of
# the per-call timings is several percent at decode (benchmarks/gpu_notes.md), and the fused
# kernels also keep the intermediates out of HBM.
PARITY = 0.97

# (op, M, K, r, N, ours_us, xla_us); mlp rows: K = D, N = D_ff.
# BEGIN GENERATED
MEASURED_ON = 'NVIDIA H200, 2026-11-22'
RECORDS: tuple[tuple[str, int, int, int, int, float, float], ...] = (
    ('mlp_swiglu', 1, 2048, 1280, 8192, 45.9, 64.7),
    ('mlp_swiglu', 1, 4096, 1024, 14336, 54.8, 70.6),
    ('mlp_swiglu', 1, 4096, 2560, 14336, 91.1, 86.5),
    ('mlp_swiglu', 2, 4096, 2560, 14336, 96.2, 97.5),
    ('mlp_swiglu', 4, 2048, 1280, 8192, 44.6, 38.8),
    ('mlp_swiglu', 4, 4096, 2560, 14336, 99.0, 91.3),
    ('mlp_swiglu', 8, 4096, 2560, 14336, 101.9, 68.0),
    ('mlp_swiglu', 16, 2048, 1280, 8192, 51.0, 55.0),
    ('mlp_swiglu', 16, 4096, 1024, 14336, 67.6, 53.9),
    ('mlp_swiglu', 16, 4096, 2560, 14336, 105.2, 99.2),
    ('mlp_swiglu', 32, 4096, 2560, 14336, 142.6, 102.9),
    ('mlp_swiglu', 64, 2048, 1280, 8192, 96.1, 49.7),
    ('mlp_swiglu', 64, 4096, 2560, 14336, 182.9, 119.8),
    ('mlp_swiglu', 128, 4096, 2560, 14336, 287.1, 127.8),
    ('mlp_swiglu', 1024, 2048, 1280, 8192, 257.0, 154.2),
    ('mlp_swiglu', 1024, 4096, 2560, 14336, 589.1, 437.0),
    ('mlp_swiglu', 4096, 2048, 1280, 8192, 943.0, 524.5),
    ('mlp_swiglu', 4096, 4096, 1024, 14336, 1428.0, 740.9),
    ('mlp_swiglu', 4096, 4096, 2560, 14336, 2462.0, 1793.5),
    ('xuv', 1, 4096, 2560, 14336, 30.3, 29.4),
    ('xuv', 1, 8192, 4096, 16384, 58.4, 58.2),
    ('xuv', 2, 4096, 2560, 14336, 27.6, 30.3),
    ('xuv', 2, 8192, 4096, 16384, 60.1, 51.9),
    ('xuv', 4, 4096, 2560, 14336, 33.9, 32.7),
    ('xuv', 4, 8192, 4096, 16384, 58.3, 55.6),
    ('xuv', 8, 4096, 2560, 14336, 38.1, 31.5),
    ('xuv', 8, 8192, 4096, 16384, 61.5, 56.2),
    ('xuv', 16, 4096, 2560, 14336, 38.0, 31.8),
    ('xuv', 16, 8192, 4096, 16384, 66.0, 56.3),
    ('xuv', 32, 4096, 2560, 14336, 39.7, 37.2),
    ('xuv', 32, 8192, 4096, 16384, 66.1, 70.6),
    ('xuv', 64, 4096, 2560, 14336, 45.8, 40.4),
    ('xuv', 64, 8192, 4096, 16384, 79.0, 68.2),
    ('xuv', 128, 4096, 2560, 14336, 52.0, 40.6),
    ('xuv', 128, 8192, 4096, 16384, 109.8, 71.2),
    ('xuv', 1024, 8192, 4096, 16384, 281.7, 267.2),
    ('xuv', 4096, 7168, 4096, 18432, 1320.5, 1218.9),
    ('xuv', 4096, 8192, 4096, 16384, 1280.2, 1149.3),
)
# END GENERATED


def records_from_results(path: str) -> tuple[str, tuple]:
  """(MEASURED_ON, RECORDS) from a gpu_lowrank.py results file: the default-kernel
  ("auto") record of each shape; of repeated shapes, the last in the file."""
  with open(path) as fh:
    data = json.load(fh)
  rows = {}
  for r in data["records"]:
    if r["variant"] != "auto" or not r.get("canonical", True):
      continue
    key = (r["op"], r["M"], r["K"], r["r"], r["N"])
    rows[key] = key + (round(r["ours_us"], 1), round(r["xla_lowrank_us"], 1))
  meta = data["meta"]
  return f"{meta['machine'].split(' (')[0]}, {meta['date'][:10]}", tuple(sorted(rows.values()))


def render(path: str, module_text: str) -> str:
  """``module_text`` with its generated block replaced by the records of ``path``."""
  on, recs = records_from_results(path)
  body = "\n".join(f"    {r!r}," for r in recs)
  block = (f"# BEGIN GENERATED\nMEASURED_ON = {on!r}\n"
           f"RECORDS: tuple[tuple[str, int, int, int, int, float, float], ...] = (\n"
           f"{body}\n)\n# END GENERATED")
  return re.sub(r"^# BEGIN GENERATED$.*?^# END GENERATED$", lambda _: block, module_text,
                flags=re.S | re.M)


def _weight_elems(op: str, k: int, r: int, n: int) -> int:
  return r * (k + n) if op == "xuv" else 3 * r * (k + n)


def nearest(op: str, m: int, k: int, r: int, n: int):
  """The benchmarked record of ``op`` nearest to this shape, or None."""
  w = _weight_elems(op, k, r, n)
  best, best_d = None, math.inf
  for rec in RECORDS:
    if rec[0] != op:
      continue
    d = abs(math.log2(m / rec[1])) + abs(math.log2(w / _weight_elems(op, *rec[2:5])))
    if d < best_d:
      best, best_d = rec, d
  return best


def verdict(op: str, m: int, k: int, r: int, n: int) -> str | None:
  """None if the kernel measured at least PARITY x XLA's speed at the nearest benchmarked
  shape (or nothing was benchmarked), else the reason to leave this call to XLA."""
  rec = nearest(op, m, k, r, n)
  if rec is None:
    return None
  _, rm, rk, rr, rn, ours, xla = rec
  if xla / ours >= PARITY:
    return None
  dims = f"K={rk} r={rr} N={rn}" if op == "xuv" else f"D={rk} r={rr} D_ff={rn}"
  return (f"XLA measured faster at the nearest benchmarked shape ({op} M={rm} {dims}: "
          f"{ours} us vs XLA {xla} us, {xla / ours:.2f}x; {MEASURED_ON}, "
          f"{SOURCE}); lrjax.lowering.prefer_kernels() or LRJAX_PREFER_KERNELS=1 uses the "
          f"kernel anyway")
