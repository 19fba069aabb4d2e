"""Where a short call's time goes: the benchmark's chain, kernel by kernel.

gpu_lowrank.py reports one number per call: the device span of 3L chained calls less that
of L calls, over 2L. This script shows what is inside that span for a few decode shapes,
from the same chained jit (3 passes over L distinct layers) under ``jax.profiler.trace``:

- ``kernels``: each kernel's launches per call and median duration;
- ``gpu_busy_us``: the union of kernel intervals per call, ``gpu_span_us`` the execution's
  span per call, so span - busy is the time the GPU sat idle between kernels;
- ``device_us`` and ``host_us``: gpu_lowrank.per_call_us with device and with host timing.

  python benchmarks/gpu_timeline.py --out benchmarks/results/gpu_timeline_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics

import jax

import gpu_lowrank as gl
import lrjax

SHAPES = (
  (1, 8192, 4096, 16384),
  (8, 8192, 4096, 16384),
  (1, 4096, 1024, 14336),
  (8, 4096, 1024, 14336),
  (8, 4096, 2560, 14336),
  (128, 8192, 4096, 16384),
)
PASSES, EXECUTIONS = 3, 5


def timeline(fn, x, layers):
  """Kernel table and busy/span per call of the 3-pass chain, medians over executions."""
  f = gl.chained(fn, PASSES)
  for _ in range(2):
    gl._sync(f(x, layers))
  groups = gl.profiled_executions([f] * EXECUTIONS, x, layers)
  calls = PASSES * len(layers)
  kernels = gl.kernel_table(groups, calls, name_len=60)
  return dict(
    gpu_busy_us=statistics.median(gl.busy_ns(g) for g in groups) / calls / 1e3,
    gpu_span_us=statistics.median(map(gl.span_ns, groups)) / calls / 1e3,
    kernels=kernels[:6],
  )


# "ours_legacy": the kernel launched through jax-triton's legacy custom call
# (LRJAX_TRITON_LEGACY_CALL=1), not jaxlib's typed-FFI one (custom_calls/triton/launch.py)
CASES = {
  "xla": lambda x, u, v: (x @ u) @ v,
  "ours": lrjax.lowering.lr_xuv,
  "ours_legacy": lrjax.lowering.lr_xuv,
}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="benchmarks/results/gpu_timeline_h200.json")
  ap.add_argument(
    "--shapes", nargs="*", default=[",".join(map(str, s)) for s in SHAPES], help="M,K,r,N"
  )
  args = ap.parse_args()
  if jax.devices()[0].platform != "gpu":
    raise SystemExit(f"needs a GPU; this machine's JAX devices are {jax.devices()}")
  import triton

  dev = jax.devices()[0]
  meta = dict(
    machine=dev.device_kind,
    jax=jax.__version__,
    triton=triton.__version__,
    jax_triton=__import__("jax_triton").__version__,
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    method=f"the chain of gpu_lowrank.chained ({PASSES} passes over L layers), "
    f"{EXECUTIONS} executions under jax.profiler.trace, medians over "
    "executions divided by the calls per execution; 'ours' is lrjax.lowering.lr_xuv "
    "under prefer_kernels, launched through triton_kernel_call_ffi; "
    "'ours_legacy' the same through jax-triton's legacy triton_kernel_call",
  )
  recs = []
  for spec in args.shapes:
    m, k, r, n = (int(t) for t in spec.split(","))
    key = jax.random.key(m + k + r + n)
    nl = gl.n_layers(2 * (k * r + r * n), m)
    x = gl.rand(key, (m, k))
    layers = [
      (
        gl.rand(jax.random.fold_in(key, 2 * i + 1), (k, r), k**-0.5),
        gl.rand(jax.random.fold_in(key, 2 * i + 2), (r, n), r**-0.5),
      )
      for i in range(nl)
    ]
    for name, fn in CASES.items():
      os.environ["LRJAX_TRITON_LEGACY_CALL"] = "1" if name == "ours_legacy" else "0"
      with lrjax.lowering.prefer_kernels():  # acts when each fresh jit is lowered
        times = {}
        for timing in ("device", "host"):
          gl.TIMING = timing
          times[timing + "_us"], times[timing + "_spread"] = gl.per_call_us(fn, x, layers)
        gl.TIMING = "device"
        rec = dict(
          op="xuv", case=name, M=m, K=k, r=r, N=n, layers=nl, **times, **timeline(fn, x, layers)
        )
      recs.append(rec)
      print(
        f"M={m:<3} {k}->{r}->{n} {name:<11} device {rec['device_us']:6.1f} us  host "
        f"{rec['host_us']:6.1f}  busy {rec['gpu_busy_us']:6.1f}  span "
        f"{rec['gpu_span_us']:6.1f}  "
        + ", ".join(
          f"{q['name'][:24]} x{q['per_call']:.2f} {q['median_us']:.1f}" for q in rec["kernels"][:3]
        ),
        flush=True,
      )
      gl.write_json(args.out, dict(meta=meta, records=recs))


if __name__ == "__main__":
  main()
