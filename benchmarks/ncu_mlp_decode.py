"""Nsight Compute counters of the tiled SwiGLU decode kernel at several token counts.

Where does a call's time go as T grows? (benchmarks/gpu_notes.md, session 9). For each T the
script profiles one launch of ``mlp_decode`` at Llama-3-8B widths, r=2560 (after warm-up
launches), with ncu's speed-of-light, memory, warp-state, scheduler, occupancy and launch
sections plus L2 reduction/read sectors, DRAM bytes and stall samples, and writes the numbers
as JSON:

  python benchmarks/ncu_mlp_decode.py --tokens 1 16 --out benchmarks/results/gpu_mlp_decode_ncu_h200.json

``--parse T=FILE ...`` converts saved ncu text reports instead (no GPU needed). ncu locks the
SM clock (1.35 GHz on the H200), so its durations are longer than the profiler timings of
gpu_lowrank.py; compare counters between token counts, not durations with other files.
"""  # noqa: E501

import argparse
import datetime
import os
import subprocess
import sys

import ncu_report
from results_io import write_json

D, F, R = 4096, 14336, 2560
METRICS = (
  "dram__bytes_read.sum",
  "gpu__time_duration.sum",
  "lts__t_sectors_op_red.sum",
  "lts__t_sectors_op_atom.sum",
  "lts__t_sectors_srcunit_tex_op_read.sum",
  "smsp__pcsamp_warps_issue_stalled_long_scoreboard",
  "smsp__pcsamp_warps_issue_stalled_wait",
  "smsp__pcsamp_warps_issue_stalled_barrier",
  "smsp__pcsamp_warps_issue_stalled_lg_throttle",
  "smsp__pcsamp_warps_issue_stalled_membar",
  "smsp__pcsamp_warps_issue_stalled_math_pipe_throttle",
)
SECTIONS = (
  "SpeedOfLight",
  "MemoryWorkloadAnalysis",
  "WarpStateStats",
  "SchedulerStats",
  "Occupancy",
  "LaunchStats",
)


def child(t: int) -> None:
  """Four launches of the kernel at T tokens (ncu profiles the third)."""
  import jax
  import jax.numpy as jnp
  from lrjax.custom_calls.triton import mlp_decode

  k = jax.random.split(jax.random.key(0), 7)

  def fac(i, a, b):
    return (jax.random.normal(k[i], (a, b), jnp.float32) * a**-0.5).astype(jnp.bfloat16)

  x = jax.random.normal(k[0], (t, D), jnp.float32).astype(jnp.bfloat16)
  gate, up, down = (
    (fac(1, D, R), fac(2, R, F)),
    (fac(3, D, R), fac(4, R, F)),
    (fac(5, F, R), fac(6, R, D)),
  )
  fn = jax.jit(lambda x, g, u, dn: mlp_decode.mlp_decode(x, u, dn, g))
  for _ in range(4):
    y = fn(x, gate, up, down)
  jax.block_until_ready(y)


def parse(text: str) -> dict:
  """{metric or section row name: value} of one ncu text report (the first kernel in it)."""
  first = ncu_report.parse_kernels(text)[0]
  return {k: v for k, v in first.items() if k not in ncu_report.HEADER_KEYS}


def profile(t: int) -> str:
  cmd = [
    ncu_report.ncu_path(),
    "--target-processes",
    "all",
    "--kernel-name",
    "regex:_mlp_decode_kernel",
    "--launch-skip",
    "2",
    "--launch-count",
    "1",
    "--metrics",
    ",".join(METRICS),
  ]
  for s in SECTIONS:
    cmd += ["--section", s]
  cmd += [sys.executable, os.path.abspath(__file__), "--child", str(t)]
  res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  if res.returncode:
    raise SystemExit(f"ncu failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
  return res.stdout


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
  ap.add_argument("--parse", nargs="+", metavar="T=FILE", help="saved ncu text reports")
  ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
  ap.add_argument("--note", default="")
  ap.add_argument(
    "--out",
    default=os.path.join(os.path.dirname(__file__), "results", "gpu_mlp_decode_ncu_h200.json"),
  )
  args = ap.parse_args()
  if args.child is not None:
    return child(args.child)
  if args.parse:
    reports = {}
    for spec in args.parse:
      t, _, path = spec.partition("=")
      with open(path) as fh:
        reports[int(t)] = fh.read()
  else:
    reports = {t: profile(t) for t in args.tokens}
  meta = dict(
    kernel="mlp_decode (tiled, defaults)",
    D=D,
    F=F,
    r=R,
    dtype="bfloat16",
    metrics=METRICS,
    sections=SECTIONS,
    note=args.note,
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
  )
  data = dict(meta=meta, records=[dict(T=t, **parse(txt)) for t, txt in sorted(reports.items())])
  write_json(args.out, data)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
