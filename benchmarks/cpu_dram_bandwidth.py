"""DRAM bandwidth of this machine from large numpy reads and copies (the decode roofline).

read:  np.max over a 1 GiB float32 array split among T threads (bytes read / time);
copy:  np.copyto of 1 GiB into another 1 GiB split among T threads (bytes read + written /
       time, as STREAM counts it).
T = 1 and every core; each measurement repeated ``--reps`` times after one warm-up pass
(the pages are touched first); best and median kept. The arrays are 32x the L3, so the caches
do not serve them.

Usage: python benchmarks/cpu_dram_bandwidth.py [--gib 1] [--reps 9]
Writes benchmarks/results/cpu_dram_bandwidth.json.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from results_io import write_json  # noqa: E402


def _timed(ex, fn, parts, reps: int) -> list[float]:
  list(ex.map(fn, parts))  # warm-up
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    list(ex.map(fn, parts))
    ts.append(time.perf_counter() - t)
  return ts


def measure(gib: float, reps: int) -> list[dict]:
  n = int(gib * (1 << 30)) // 4
  src = np.ones(n, np.float32)
  dst = np.empty_like(src)
  dst.fill(0)
  cores = os.cpu_count() or 1
  rows = []
  with ThreadPoolExecutor(cores) as ex:
    for threads in sorted({1, cores}):
      s_parts = np.array_split(src, threads)
      d_parts = np.array_split(dst, threads)
      for kind, fn, parts, nbytes in (
        ("read", np.max, s_parts, src.nbytes),
        ("copy", lambda p: np.copyto(p[0], p[1]), list(zip(d_parts, s_parts)), 2 * src.nbytes),
      ):
        ts = _timed(ex, fn, parts, reps)
        rows.append(
          dict(
            kind=kind,
            threads=threads,
            bytes=nbytes,
            best_gbs=nbytes / min(ts) / 1e9,
            median_gbs=nbytes / float(np.median(ts)) / 1e9,
            seconds=ts,
          )
        )
        print(
          f"{kind} x{threads}: best {rows[-1]['best_gbs']:.1f} GB/s, "
          f"median {rows[-1]['median_gbs']:.1f} GB/s"
        )
  return rows


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--gib", type=float, default=1.0)
  ap.add_argument("--reps", type=int, default=9)
  ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu_dram_bandwidth.json"))
  a = ap.parse_args()
  load0 = os.getloadavg()
  rows = measure(a.gib, a.reps)
  read = max(r["best_gbs"] for r in rows if r["kind"] == "read")
  cpu = ""
  with open("/proc/cpuinfo") as fh:
    cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "")
  write_json(
    a.out,
    dict(
      benchmark="cpu_dram_bandwidth",
      command=" ".join([os.path.basename(sys.executable)] + sys.argv),
      date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
      machine=dict(cpu=cpu, cores=os.cpu_count(), platform=platform.platform()),
      versions=dict(numpy=np.__version__, python=platform.python_version()),
      load_average=dict(start=load0, end=os.getloadavg()),
      array_gib=a.gib,
      rows=rows,
      dram_read_gbs=read,
      note="dram_read_gbs: the best read rate over thread counts, the roofline a decode step "
      "(which reads every weight once) is compared against",
    ),
  )
  print(f"DRAM read {read:.1f} GB/s; wrote {a.out}")


if __name__ == "__main__":
  main()
