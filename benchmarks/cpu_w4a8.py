"""W4A8 CPU kernel vs XLA's f32 and bf16 dots, side by side in one run.

Shapes: M in {1, 8, 128, 1024} with K = N = 4096, and the low-rank X·U·V
4096 -> r 1024 -> 14336 (ours: the fused ``lr_xuv_w4a8`` handler; XLA: (x@u)@v).

Timing: each jitted function runs C calls (distinct activations, round-robin over
R weight copies totalling ~3x the 32 MiB L3, so weights stream from DRAM
as in a real model); per-call time = median wall time / C after warm-up.
``ours_hot_us`` reuses one weight (L3 resident), as a micro-benchmark would.

Roofline: DRAM read bandwidth is measured here (numpy max over 1 GiB, 1 and 2
threads, best of 5). The VNNI peak is derived: cores x clock (/proc/cpuinfo
"cpu MHz") x 2 vpdpbusd zmm per cycle (Zen 4/5 issue 2 per cycle) x 64 int8
MACs x 2 ops.

Usage: python benchmarks/cpu_w4a8.py [--group 128] [--quick]
On a shared machine (Linux autogroup scheduling: each session gets an equal
share, whatever its nice value), run it in its own session with a raised
autogroup priority so other processes do not take the cores mid-measurement:
  setsid sh -c 'echo -10 > /proc/self/autogroup; exec nice -n -10 python benchmarks/cpu_w4a8.py'
The JSON records the niceness, the autogroup, the load average and each row's
CPU share (process CPU time / (wall time x cores)).
Writes benchmarks/results/cpu_w4a8.json (and cpu_w4a8.png if matplotlib exists).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

import lrjax
from lrjax.custom_calls.cpu import lowering as cpu_lowering
from lrjax.lowering import quantized as Q
from lrjax.quant import pack

L3_BYTES = 32 << 20
HERE = os.path.dirname(os.path.abspath(__file__))


def lscpu() -> dict:
  out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
  d = {}
  for line in out.splitlines():
    if ":" in line:
      k, v = line.split(":", 1)
      d[k.strip()] = v.strip()
  return d


def cpu_mhz() -> float:
  with open("/proc/cpuinfo") as f:
    for line in f:
      if line.startswith("cpu MHz"):
        return float(line.split(":")[1])
  raise RuntimeError("no 'cpu MHz' in /proc/cpuinfo")


def dram_read_gbs() -> float:
  a = np.ones(1 << 28, np.float32)  # 1 GiB
  best = 0.0
  with ThreadPoolExecutor(2) as ex:
    for threads in (1, 2):
      parts = np.array_split(a, threads)
      for _ in range(5):
        t = time.perf_counter()
        list(ex.map(np.max, parts))
        best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
  return best


CPU_SHARE = []  # per timed run: process CPU time / (wall time x cores)


def time_calls(fn, args, calls: int, reps: int) -> float:
  """Median seconds per call of a jitted fn that makes ``calls`` calls."""
  jax.block_until_ready(fn(*args))
  ts = []
  c0, w0 = time.process_time(), time.perf_counter()
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append((time.perf_counter() - t) / calls)
  CPU_SHARE.append((time.process_time() - c0) / ((time.perf_counter() - w0) * os.cpu_count()))
  return float(np.median(ts))


def n_calls(m: int) -> int:
  return 16 if m <= 8 else (4 if m <= 128 else 1)


def copies(nbytes: int, calls: int) -> int:
  return max(1, min(calls, -(-3 * L3_BYTES // nbytes)))


def make_fn(op, calls, r):
  """jit(xs, *ws): [op(xs[i], ws[i % r]) for i in range(calls)]."""

  def f(xs, *ws):
    return [op(xs[i], ws[i % r]) for i in range(calls)]

  return jax.jit(f)


def bench_dense(m, k, n, group, layout, reps, rng):
  w = rng.standard_normal((k, n)).astype(np.float32) / np.sqrt(k)
  q, s = pack.quantize_int4(w, group)
  wq = (jnp.asarray(pack.pack_int4(q, layout)), jnp.asarray(pack.pad_scales(s, layout)))
  wbytes = wq[0].nbytes + wq[1].nbytes
  calls = n_calls(m)
  xs = jnp.asarray(rng.standard_normal((calls, m, k)).astype(np.float32))
  ours_op = lambda x, ws: Q.w4a8_matmul(x, ws[0], ws[1], n=n, group=group, layout=layout)
  r = copies(wbytes, calls)
  f = make_fn(ours_op, calls, r)
  hlo = f.lower(xs, *([wq] * r)).compile().as_text()
  assert hlo.count('custom_call_target="lrjax_w4a8_matmul"') == calls, "kernel not lowered"
  ours = time_calls(f, (xs, *[tuple(jnp.array(a) for a in wq) for _ in range(r)]), calls, reps)
  hot = time_calls(make_fn(ours_op, calls, 1), (xs, wq), calls, reps)
  res = dict(ours_us=ours * 1e6, ours_hot_us=hot * 1e6, weight_bytes=wbytes, weight_copies=r)
  for name, dt in (("xla_f32_us", jnp.float32), ("xla_bf16_us", jnp.bfloat16)):
    wd = jnp.asarray(w, dt)
    rr = copies(wd.nbytes, calls)
    g = make_fn(lambda x, wd_: jnp.matmul(x.astype(dt), wd_), calls, rr)
    res[name] = time_calls(g, (xs, *[jnp.array(wd) for _ in range(rr)]), calls, reps) * 1e6
  return res


def bench_xuv(m, k, r_, n, group, layout, reps, rng):
  u = rng.standard_normal((k, r_)).astype(np.float32) / np.sqrt(k)
  v = rng.standard_normal((r_, n)).astype(np.float32) / np.sqrt(r_)
  qu, su = pack.quantize_int4(u, group)
  qv, sv = pack.quantize_int4(v, group)
  wq = (
    jnp.asarray(pack.pack_int4(qu, layout)),
    jnp.asarray(pack.pad_scales(su, layout)),
    jnp.asarray(pack.pack_int4(qv, layout)),
    jnp.asarray(pack.pad_scales(sv, layout)),
  )
  wbytes = sum(a.nbytes for a in wq)
  calls = n_calls(m)
  xs = jnp.asarray(rng.standard_normal((calls, m, k)).astype(np.float32))
  ours_op = lambda x, ws: Q.lr_xuv_w4a8(
    x, *ws, r=r_, n=n, group_u=group, group_v=group, layout=layout
  )
  chain_op = lambda x, ws: Q.w4a8_matmul(
    Q.w4a8_matmul(x, ws[0], ws[1], n=r_, group=group, layout=layout, out_dtype=jnp.float32),
    ws[2],
    ws[3],
    n=n,
    group=group,
    layout=layout,
  )
  rr = copies(wbytes, calls)
  f = make_fn(ours_op, calls, rr)
  hlo = f.lower(xs, *([wq] * rr)).compile().as_text()
  assert hlo.count('custom_call_target="lrjax_w4a8_xuv"') == calls, "fused kernel not lowered"
  wsets = [tuple(jnp.array(a) for a in wq) for _ in range(rr)]
  res = dict(
    ours_us=time_calls(f, (xs, *wsets), calls, reps) * 1e6,
    ours_hot_us=time_calls(make_fn(ours_op, calls, 1), (xs, wq), calls, reps) * 1e6,
    ours_unfused_us=time_calls(make_fn(chain_op, calls, rr), (xs, *wsets), calls, reps) * 1e6,
    weight_bytes=wbytes,
    weight_copies=rr,
  )
  for name, dt in (("xla_f32_us", jnp.float32), ("xla_bf16_us", jnp.bfloat16)):
    ud, vd = jnp.asarray(u, dt), jnp.asarray(v, dt)
    cr = copies(ud.nbytes + vd.nbytes, calls)
    g = make_fn(lambda x, uv: jnp.matmul(jnp.matmul(x.astype(dt), uv[0]), uv[1]), calls, cr)
    res[name] = (
      time_calls(g, (xs, *[(jnp.array(ud), jnp.array(vd)) for _ in range(cr)]), calls, reps) * 1e6
    )
  return res


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--group", type=int, default=128)
  ap.add_argument("--quick", action="store_true", help="fewer repetitions")
  ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu_w4a8.json"))
  args = ap.parse_args()
  if not cpu_lowering.extension_available():
    raise SystemExit("the W4A8 extension is not built: pip install --no-build-isolation -e .")
  ext = cpu_lowering.extension()
  layout = pack.default_layout()
  info = lscpu()
  cores = os.cpu_count()
  mhz = cpu_mhz()
  vnni_peak = cores * mhz * 1e6 * 2 * 64 * 2 / 1e9
  dram = dram_read_gbs()
  print(
    f"{info.get('Model name')} x{cores}, {mhz:.0f} MHz, DRAM read {dram:.1f} GB/s, "
    f"VNNI peak {vnni_peak:.0f} GOP/s, kernel ISA {ext.selected_isa(Q.LAYOUTS[layout])}, "
    f"{ext.num_threads()} threads, layout {layout}, group {args.group}"
  )
  load_start = os.getloadavg()
  rng = np.random.default_rng(0)
  rows = []
  shapes = [("dense", m, 4096, None, 4096) for m in (1, 8, 128, 1024)]
  shapes += [("lowrank_xuv", m, 4096, 1024, 14336) for m in (1, 8, 128, 1024)]
  for kind, m, k, r_, n in shapes:
    reps = (3 if args.quick else 7) if m >= 128 else (5 if args.quick else 20)
    CPU_SHARE.clear()
    if kind == "dense":
      res = bench_dense(m, k, n, args.group, layout, reps, rng)
      flops = 2 * m * k * n
    else:
      res = bench_xuv(m, k, r_, n, args.group, layout, reps, rng)
      flops = 2 * m * (k * r_ + r_ * n)
    t = res["ours_us"] * 1e-6
    row = dict(
      kind=kind,
      M=m,
      K=k,
      N=n,
      r=r_,
      group=args.group,
      **res,
      gflops=flops / t / 1e9,
      gflops_hot=flops / (res["ours_hot_us"] * 1e-6) / 1e9,
      xla_f32_gflops=flops / (res["xla_f32_us"] * 1e-6) / 1e9,
      xla_bf16_gflops=flops / (res["xla_bf16_us"] * 1e-6) / 1e9,
      weight_gbs=res["weight_bytes"] / t / 1e9,
      speedup_vs_xla_f32=res["xla_f32_us"] / res["ours_us"],
      speedup_vs_xla_bf16=res["xla_bf16_us"] / res["ours_us"],
    )
    row["ours_cpu_share"] = CPU_SHARE[0]  # < 1: other processes took cores meanwhile
    row["frac_dram_bw"] = row["weight_gbs"] / dram
    row["frac_vnni_peak"] = row["gflops"] / vnni_peak
    rows.append(row)
    print(
      f"{kind:12s} M={m:5d} K={k} N={n}{'' if r_ is None else f' r={r_}'}: "
      f"ours {res['ours_us']:9.1f} us (hot {res['ours_hot_us']:8.1f}) "
      f"{row['gflops']:7.1f} GFLOP/s {row['weight_gbs']:6.1f} GB/s "
      f"({100 * row['frac_dram_bw']:.0f}% DRAM, {100 * row['frac_vnni_peak']:.1f}% VNNI) | "
      f"XLA f32 {res['xla_f32_us']:9.1f} us bf16 {res['xla_bf16_us']:9.1f} us | "
      f"x{row['speedup_vs_xla_f32']:.1f} vs f32"
      + (f" | unfused {res['ours_unfused_us']:.1f} us" if "ours_unfused_us" in res else "")
      + f" | cpu share {row['ours_cpu_share']:.2f}"
    )
  flags = info.get("Flags", "").split()
  out = dict(
    benchmark="cpu_w4a8",
    date=datetime.datetime.now(datetime.UTC).isoformat(),
    machine=dict(
      cpu_model=info.get("Model name"),
      cores=cores,
      cpu_mhz=mhz,
      flags=[
        f for f in flags if any(s in f for s in ("avx", "vnni", "amx", "fma", "sse4", "bf16"))
      ],
      l3=info.get("L3 cache"),
      platform=platform.platform(),
    ),
    versions=dict(
      jax=jax.__version__,
      jaxlib=importlib.metadata.version("jaxlib"),
      numpy=np.__version__,
      lrjax=lrjax.__version__,
    ),
    kernel=dict(
      isa=ext.selected_isa(Q.LAYOUTS[layout]),
      threads=ext.num_threads(),
      layout=layout,
      group=args.group,
    ),
    load_average=dict(
      start=load_start,
      end=os.getloadavg(),
      niceness=os.nice(0),
      autogroup=open("/proc/self/autogroup").read().strip()
      if os.path.exists("/proc/self/autogroup")
      else None,
      note="1-min load averages; >2 on this 2-core machine means other "
      "processes shared the cores (see ours_cpu_share per row)",
    ),
    roofline=dict(
      dram_read_gbs=dram,
      vnni_peak_gops=vnni_peak,
      vnni_peak_derivation=f"{cores} cores x {mhz:.0f} MHz x 2 vpdpbusd zmm/cycle "
      "x 64 MACs x 2 ops",
    ),
    timing="median wall time per call; C calls per jit over R weight copies > L3 "
    "(ours_hot_us: one L3-resident weight)",
    results=rows,
  )
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
  print("wrote", args.out)
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed: no plot")
    return
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for ax, kind in zip(axes, ("dense", "lowrank_xuv")):
    rs = [r for r in rows if r["kind"] == kind]
    ms = [r["M"] for r in rs]
    for key, label in (
      ("gflops", "W4A8 (ours)"),
      ("xla_f32_gflops", "XLA f32"),
      ("xla_bf16_gflops", "XLA bf16"),
    ):
      ax.plot(ms, [r[key] for r in rs], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("M")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(kind)
    ax.legend()
  fig.tight_layout()
  fig.savefig(args.out.replace(".json", ".png"))


if __name__ == "__main__":
  main()
