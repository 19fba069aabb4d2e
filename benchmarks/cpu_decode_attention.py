"""Decode attention over a dense KV cache on the CPU: lrjax's C++ kernel (its AVX2 body where
the CPU has one, and its portable body) against XLA's lowering of the models' attention, the
baseline without lrjax.

  python benchmarks/cpu_decode_attention.py --out benchmarks/results/cpu_decode_attention.json

Query heads 32, KV heads 8, head dim 64 (Llama-3.2-1B) and 128 (Llama-3-8B), f32, a cache of
``ctx`` positions all filled (each row at position ctx - 1), per batch size. Each function is
jitted alone and timed as the median of ``--reps`` calls (host timer around
block_until_ready). ``read_gbs``: the K and V bytes a call must read (2 · B · Hkv · ctx · D · 4)
over its time; ``dram_frac``: that over this machine's DRAM read rate, measured in the run
(numpy max over 1 GiB, 1 and 2 threads, best of 5). The same K and V are read call after
call, so where they fit in the CPU's last-level cache (``l3_cache``, from lscpu) the rate can
pass the DRAM rate: ``dram_frac`` over 1.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from lrjax import bench as B
from lrjax.custom_calls.cpu import decode_attention as C
from lrjax.custom_calls.cpu import lowering as cpu_lowering
from lrjax.lowering.decode_attention import decode_attention_reference

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cpu_w4a8 import dram_read_gbs  # noqa: E402
from results_io import write_json  # noqa: E402

HEADS = {"llama3_2_1b": (32, 8, 64), "llama3_8b": (32, 8, 128)}
POINTS = [(1, 128), (1, 1024), (1, 4096), (8, 1024), (8, 2048), (8, 4096), (16, 4096)]


def l3_cache() -> str | None:
  try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError):
    return None
  return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("L3")), None)


def median_ms(fn, args, reps: int) -> float:
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t)
  return float(np.median(ts)) * 1e3


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--reps", type=int, default=9)
  ap.add_argument("--models", default=",".join(HEADS))
  ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu_decode_attention.json"))
  a = ap.parse_args()
  if not cpu_lowering.extension_available():
    raise SystemExit("the CPU extension is not built: pip install --no-build-isolation -e .")
  ext = cpu_lowering.extension()
  dram = dram_read_gbs()
  print(f"DRAM read {dram:.1f} GB/s; {ext.num_threads()} kernel threads")
  load0 = os.getloadavg()
  records = []
  for model in a.models.split(","):
    hq, hkv, d = HEADS[model]
    for b, ctx in POINTS:
      ks = jax.random.split(jax.random.key(b * ctx + d), 3)
      q = jax.random.normal(ks[0], (b, hq, d))
      k = jax.random.normal(ks[1], (b, hkv, ctx, d))
      v = jax.random.normal(ks[2], (b, hkv, ctx, d))
      pos = jnp.full((b,), ctx - 1, jnp.int32)
      args = (q, k, v, pos)
      kernel = jax.jit(lambda *x: C.decode_attention(*x))
      xla = jax.jit(lambda *x: decode_attention_reference(*x))
      want = np.asarray(xla(*args))
      rec = dict(model=model, hq=hq, hkv=hkv, d=d, batch=b, ctx=ctx)
      for name, env in (("kernel", {}), ("kernel_portable", {"LRJAX_W4A8_ISA": "scalar"})):
        with mock.patch.dict(os.environ, env):
          rec[f"{name}_body"] = ext.attention_isa(d)
          got = np.asarray(kernel(*args))  # checked before it is timed
          np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
          rec[f"{name}_ms"] = median_ms(kernel, args, a.reps)
      rec["xla_ms"] = median_ms(xla, args, a.reps)
      nbytes = 2 * b * hkv * ctx * d * 4
      rec["kv_bytes"] = nbytes
      rec["speedup_vs_xla"] = rec["xla_ms"] / rec["kernel_ms"]
      rec["read_gbs"] = nbytes / rec["kernel_ms"] / 1e6
      rec["dram_frac"] = rec["read_gbs"] / dram
      records.append(rec)
      print(
        f"{model} B={b:2d} ctx={ctx:5d} ({nbytes >> 20:4d} MiB): kernel {rec['kernel_ms']:7.2f} ms "
        f"({rec['kernel_body']}, {rec['read_gbs']:.1f} GB/s, {100 * rec['dram_frac']:.0f}% DRAM), "
        f"portable {rec['kernel_portable_ms']:7.2f} ms, XLA {rec['xla_ms']:7.2f} ms "
        f"({rec['speedup_vs_xla']:.2f}x)"
      )
      del q, k, v, args
  write_json(
    a.out,
    dict(
      benchmark="cpu_decode_attention",
      command=" ".join(["python"] + sys.argv),
      date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
      machine=B.machine(),
      versions=dict(jax=jax.__version__),
      kernel_threads=ext.num_threads(),
      l3_cache=l3_cache(),
      dram_read_gbs=dram,
      load_average=dict(start=load0, end=os.getloadavg()),
      records=records,
    ),
  )
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()
