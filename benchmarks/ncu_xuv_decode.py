"""Nsight Compute counters of every kernel in one decode X·U·V call, for decode_ab.py variants.

Where does a wide decode call's time go (M = 64 / 128, where XLA's chain leads)? For each
case ``M,K,r,N|variant,,variant`` (decode_ab.py's syntax and variants: ``xla``, ``auto``,
``pv_xla:warps=8`` ...) the child process compiles the variant, runs it twice to warm up, then
runs it twice more between cuProfilerStart / cuProfilerStop; ncu (``--profile-from-start
off``, so nothing of compilation or XLA's autotuning is profiled) reports every kernel of
those two calls with its speed-of-light, memory, warp-state, scheduler, occupancy, launch and
compute sections and the counters below, and the second call's kernels are kept:

  python benchmarks/ncu_xuv_decode.py --out benchmarks/results/gpu_xuv_decode_ncu_h200.json \\
      "64,8192,2456,8192|xla,,auto"

The child runs with XLA_PYTHON_CLIENT_ALLOCATOR=platform and, under ncu, with the XLA
autotuning results it dumped in a run without ncu (see ``profile``; that hand-over is not yet
run on a GPU: in session 36 the ``auto`` variant was profiled without it, and the ``xla``
variant did not finish under ncu). ncu runs with ``--clock-control none`` (the GPU's own
clocks, as the profiler timings of gpu_lowrank.py) and flushes caches between kernels, so a
kernel's duration here includes its cold L2; compare kernels within one file. The results
file is rewritten after each variant. ``--parse CASE=FILE`` reads saved reports instead (no
GPU).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ncu_report  # noqa: E402
from results_io import write_json  # noqa: E402

CALLS = 2  # profiled calls of each variant; the last one's kernels are kept
PROFILE_TIMEOUT_S = 120  # one variant under ncu (about 16 s on an H200 for six kernels)
METRICS = (
  "dram__bytes_read.sum",
  "lts__t_sectors_op_red.sum",
  "lts__t_sectors_srcunit_tex_op_read.sum",
)
# the tensor pipes' busy fraction, under whichever name this ncu knows (wgmma: gmma on sm_90)
TENSOR_METRICS = ("sm__pipe_tensor_op_gmma_cycles_active", "sm__pipe_tensor_op_hmma_cycles_active")
SECTIONS = (
  "SpeedOfLight",
  "MemoryWorkloadAnalysis",
  "ComputeWorkloadAnalysis",
  "WarpStateStats",
  "SchedulerStats",
  "Occupancy",
  "LaunchStats",
)


def last_call(kernels: list[dict], calls: int = CALLS) -> list[dict]:
  """The kernels of the last of ``calls`` identical calls profiled in a row."""
  if len(kernels) % calls:
    raise ValueError(
      f"{len(kernels)} profiled kernels do not split into {calls} equal calls "
      f"({[k['kernel'] for k in kernels]})"
    )
  per = len(kernels) // calls
  names = [k["kernel"] for k in kernels]
  if any(names[i * per : (i + 1) * per] != names[:per] for i in range(calls)):
    raise ValueError(f"the {calls} profiled calls launched different kernels: {names}")
  return kernels[-per:]


def _profiler(on: bool) -> None:
  """cuProfilerStart/Stop on the primary context of device 0, the context XLA runs in."""
  cuda = ctypes.CDLL("libcuda.so.1")
  ctx, dev = ctypes.c_void_p(), ctypes.c_int()
  for call, args in (
    ("cuDeviceGet", (ctypes.byref(dev), 0)),
    ("cuDevicePrimaryCtxRetain", (ctypes.byref(ctx), dev)),
    ("cuCtxSetCurrent", (ctx,)),
    ("cuProfilerStart" if on else "cuProfilerStop", ()),
  ):
    rc = getattr(cuda, call)(*args)
    if rc:
      raise RuntimeError(f"{call} returned CUDA error {rc}")


def child(case: str, variant: str) -> None:
  """Compile ``variant`` at ``case``'s shape, two warm-up calls, CALLS profiled calls."""
  import jax
  import decode_ab

  (m, k, r, n), _ = decode_ab.parse_case(case)
  x, layers, _ = decode_ab.g.xuv_inputs(m, k, r, n)  # decode_ab's weights; the first layer
  u, v = layers[0]
  with decode_ab.variant_setup(variant) as var:
    fn = jax.jit(decode_ab._fn(var, m, k, r, n))
    for _ in range(2):
      jax.block_until_ready(fn(x, u, v))
    _profiler(True)
    for _ in range(CALLS):
      jax.block_until_ready(fn(x, u, v))
    _profiler(False)


def tensor_metrics() -> tuple[str, ...]:
  """TENSOR_METRICS this ncu lists, as percentages of their peak."""
  known = subprocess.run(
    [ncu_report.ncu_path(), "--query-metrics"], capture_output=True, text=True
  ).stdout
  return tuple(
    f"{m}.avg.pct_of_peak_sustained_active"
    for m in TENSOR_METRICS
    if re.search(rf"^{m}\b", known, re.M)
  )


def _run(cmd: list, env: dict, what: str) -> str:
  res = subprocess.run(cmd, capture_output=True, text=True, timeout=PROFILE_TIMEOUT_S, env=env)
  if res.returncode:
    raise RuntimeError(
      f"{what} failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
    )
  return res.stdout


def profile(case: str, variant: str, metrics: tuple[str, ...], workdir: str) -> str:
  """ncu's text report of ``variant``'s profiled calls. The child first runs once without ncu
  and dumps XLA's autotuning results, which the profiled run loads. In session 36, without
  that, the ``xla`` variant did not finish in 120 s under ncu with these sections (``auto``
  took 9-16 s; why was not found): autotuning under ncu is the guess this hand-over tests."""
  child_cmd = [sys.executable, os.path.abspath(__file__), "--child", case, variant]
  tuned = os.path.join(workdir, f"autotune_{abs(hash((case, variant)))}.textproto")
  # one cudaMalloc a buffer: under XLA's preallocated pool ncu would save and restore the whole
  # pool around every replay pass of every kernel
  env = dict(os.environ, XLA_PYTHON_CLIENT_ALLOCATOR="platform")
  flags = env.get("XLA_FLAGS", "")
  t0 = time.time()
  print(f"ncu: {case.partition('|')[0]}|{variant} ...", end=" ", file=sys.stderr, flush=True)
  _run(
    child_cmd,
    dict(env, XLA_FLAGS=f"{flags} --xla_gpu_dump_autotune_results_to={tuned}"),
    "the child without ncu",
  )
  cmd = [
    ncu_report.ncu_path(),
    "--profile-from-start",
    "off",
    "--clock-control",
    "none",
    "--metrics",
    ",".join(metrics),
  ]
  for sec in SECTIONS:
    cmd += ["--section", sec]
  env["XLA_FLAGS"] = f"{flags} --xla_gpu_load_autotune_results_from={tuned}"
  out = _run(cmd + child_cmd, env, "ncu")
  print(f"{time.time() - t0:.0f} s", file=sys.stderr, flush=True)
  return out


def summary(k: dict) -> str:
  keys = (
    ("Duration [us]", "us"),
    ("DRAM Throughput [%]", "dram%"),
    ("Compute (SM) Throughput [%]", "sm%"),
    *((f"{m}.avg.pct_of_peak_sustained_active [%]", "tensor%") for m in TENSOR_METRICS),
    ("L2 Cache Throughput [%]", "l2%"),
    ("Achieved Occupancy [%]", "occ%"),
    ("Registers Per Thread [register/thread]", "regs"),
  )
  return "  ".join(f"{short}={k[key]:g}" for key, short in keys if key in k)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("cases", nargs="*", help="M,K,r,N|variant,,variant (decode_ab.py's syntax)")
  ap.add_argument(
    "--parse",
    nargs="+",
    metavar="CASE=FILE",
    help="saved ncu text reports, CASE being M,K,r,N|variant",
  )
  ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
  ap.add_argument("--note", default="")
  ap.add_argument(
    "--out",
    default=os.path.join(os.path.dirname(__file__), "results", "gpu_xuv_decode_ncu_h200.json"),
  )
  args = ap.parse_args(argv)
  if args.child:
    return child(*args.child)
  import decode_ab

  meta = dict(
    dtype="bfloat16",
    metrics=METRICS,
    sections=SECTIONS,
    calls=CALLS,
    note=args.note,
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
  )
  records = []

  def add(case: str, text: str) -> None:  # one variant's kernels, the file rewritten whole
    (m, k, r, n), (var,) = decode_ab.parse_case(case)
    for kern in last_call(ncu_report.parse_kernels(text)):
      records.append(dict(op="xuv", M=m, K=k, r=r, N=n, variant=var, **kern))
      print(f"{case:28s} {kern['kernel'][:40]:40s} {summary(kern)}", flush=True)
    write_json(args.out, dict(meta=meta, records=records))

  try:  # bad input fails before any profiling
    for case in args.cases:
      decode_ab.parse_case(case)
    for spec in args.parse or ():
      case, eq, path = spec.rpartition("=")
      if not eq or len(decode_ab.parse_case(case)[1]) != 1:
        raise ValueError(f"--parse {spec!r}: expected M,K,r,N|variant=FILE (one variant)")
  except ValueError as e:
    ap.error(str(e))
  if args.parse:
    meta["machine"] = "as the reports' note says (parsed with --parse)"
    for spec in args.parse:
      case, _, path = spec.rpartition("=")
      with open(path) as fh:
        add(case, fh.read())
  else:
    if not args.cases:
      ap.error("expected at least one case M,K,r,N|variant,,variant (or --parse)")
    import jax  # its version only: this process leaves the GPU to the children

    gpus = subprocess.run(
      ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
    ).stdout.split("\n")
    meta.update(
      machine=gpus[0].strip() or "unknown",
      jax=jax.__version__,
      metrics=METRICS + tensor_metrics(),
      ncu=subprocess.run([ncu_report.ncu_path(), "--version"], capture_output=True, text=True)
      .stdout.strip()
      .splitlines()[-1],
    )
    with tempfile.TemporaryDirectory() as workdir:
      for case in args.cases:
        for var in decode_ab.parse_case(case)[1]:
          try:
            add(f"{case.partition('|')[0]}|{var}", profile(case, var, meta["metrics"], workdir))
          except (RuntimeError, subprocess.TimeoutExpired) as e:  # the other cases go on
            print(f"{case.partition('|')[0]}|{var}: {e}", flush=True)
  print(f"wrote {args.out} ({len(records)} kernels)")


if __name__ == "__main__":
  main()
