"""Prefill attention on the CPU: lrjax's C++ kernel for the ``attention`` primitive against XLA's
lowering of the models' attention (the baseline without lrjax), alone and in a prompt's
time to first token.

  python benchmarks/cpu_prefill_attention.py --out benchmarks/results/cpu_prefill_attention.json

calls   a causal prompt of S tokens attending to itself (q [1, S, 32, D], k and v [1, S, 8, D],
        f32, D 64 as Llama-3.2-1B and 128 as Llama-3-8B): each function jitted alone, the
        median of ``--reps`` calls. ``gflops``: the visible half of the scores and p·V,
        4 · S(S+1)/2 · 32 · D, over the time.
ttft    ``lrjax bench`` of the Llama-3.2-1B-shaped model at 40 % removed, W4A8 (group 128),
        one request of ``--prompt-len`` tokens, run twice in turn: with the kernel and with
        ``LRJAX_CPU_ATTENTION=0`` (XLA's attention); each run's median time to first token.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from lrjax import bench as B
from lrjax.custom_calls.cpu import attention as C
from lrjax.custom_calls.cpu import lowering as cpu_lowering
from lrjax.lowering.attention import attention_reference

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cpu_decode_attention import median_ms  # noqa: E402
from results_io import write_json  # noqa: E402


def calls(seqs, dims, reps) -> list[dict]:
  rows = []
  kernel = jax.jit(lambda *a: C.attention(*a))
  xla = jax.jit(attention_reference)
  for d in dims:
    for s in seqs:
      ks = jax.random.split(jax.random.key(s + d), 3)
      q = jax.random.normal(ks[0], (1, s, 32, d))
      k, v = (jax.random.normal(kk, (1, s, 8, d)) for kk in ks[1:])
      mask = jnp.asarray(np.tril(np.ones((s, s), bool))[None])
      args = (q, k, v, mask)
      np.testing.assert_allclose(kernel(*args), xla(*args), rtol=2e-5, atol=1e-5)  # checked
      row = dict(seq=s, d=d, kernel_ms=median_ms(kernel, args, reps))
      row["xla_ms"] = median_ms(xla, args, reps)
      row["speedup_vs_xla"] = row["xla_ms"] / row["kernel_ms"]
      row["gflops"] = 4 * s * (s + 1) / 2 * 32 * d / row["kernel_ms"] / 1e6
      rows.append(row)
      print(
        f"S={s:5d} D={d:3d}: kernel {row['kernel_ms']:8.1f} ms ({row['gflops']:.0f} GFLOP/s), "
        f"XLA {row['xla_ms']:8.1f} ms ({row['speedup_vs_xla']:.2f}x)"
      )
  return rows


def ttft(prompt_len: int) -> dict:
  out = {}
  for name, env in (("kernel", {}), ("xla", {C.ENV: "0"})):
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, "bench.json")
      cmd = [
        sys.executable, "-m", "lrjax", "bench", "--preset", "llama3_2_1b", "--ratio", "0.4",
        "--quantize", "w4a8", "--group", "128", "--concurrency", "1",
        "--prompt-len", str(prompt_len), "--gen-len", "3", "--reps", "1", "--out", path,
        "--no-plot",
      ]  # fmt: skip
      subprocess.run(cmd, env={**os.environ, **env}, check=True, stdout=subprocess.DEVNULL)
      with open(path) as f:
        level = json.load(f)["levels"][0]
    out[f"{name}_ttft_ms"] = level["ttft_ms_median"]
    out[f"{name}_prefill_tps"] = level["prefill_tps"]
    print(f"prompt {prompt_len}: TTFT with {name} attention {level['ttft_ms_median']:.0f} ms")
  out["prompt_len"] = prompt_len
  out["ttft_speedup"] = out["xla_ttft_ms"] / out["kernel_ttft_ms"]
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--seqs", default="128,512,1024,2048")
  ap.add_argument("--dims", default="64,128")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--prompt-len", type=int, default=1024)
  ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu_prefill_attention.json"))
  a = ap.parse_args()
  if not cpu_lowering.extension_available():
    raise SystemExit("the CPU extension is not built: pip install --no-build-isolation -e .")
  ext = cpu_lowering.extension()
  load0 = os.getloadavg()
  rows = calls([int(x) for x in a.seqs.split(",")], [int(x) for x in a.dims.split(",")], a.reps)
  end_to_end = ttft(a.prompt_len)
  write_json(
    a.out,
    dict(
      benchmark="cpu_prefill_attention",
      command=" ".join(["python"] + sys.argv),
      date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
      machine=B.machine(),
      versions=dict(jax=jax.__version__),
      kernel_body=ext.prefill_attention_isa(),
      kernel_threads=ext.num_threads(),
      load_average=dict(start=load0, end=os.getloadavg()),
      calls=rows,
      ttft=end_to_end,
    ),
  )
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()
