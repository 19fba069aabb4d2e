"""What XLA's ·V costs for each form of P that phase 1 alone could hand it (run on a GPU).

From 64 rows ``xuv_decode(pv="xla")`` ends its kernel with P = X·U as f32 sums in a slice of
its scratch output; XLA slices, rounds and multiplies by V. At the small M=128 points the
whole call trails XLA's own chain by about 1 µs, and in the compiled HLO the slice and the
rounding were a loop fusion of their own before the GEMM (session 38). This times XLA alone
on the forms P could take, each call on its own layer (``gpu_lowrank.per_call_us(distinct=
True)``, so a per-layer rounding is paid every call, as in a model step):

  bf16        P already rounded (the kernel's p16): dot(P, V)
  f32         P as its own f32 array: dot(convert(P), V)
  f32_slice   P as the first M·r floats of a larger f32 buffer, as the kernel hands it over:
              dot(convert(reshape(slice(S))), V)
  f32_flat    P as its own f32 array of M·r floats: dot(convert(reshape(P)), V)
  f32_rows    P as rows M..2M of an f32 [3M, r] buffer: dot(convert(slice(S)), V)

and lists the ENTRY computation's kernels (fusions with their backend kind, custom calls) so
one sees whether XLA fused the rounding into its GEMM. Outputs are checked against an f64
reference of round(P)·V.

  python benchmarks/xla_p_handover.py --out benchmarks/results/gpu_xla_p_handover_h200.json \\
      128,256,512 128,152,4096 128,640,2048
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

FORMS = ("bf16", "f32", "f32_slice", "f32_flat", "f32_rows")
_KIND = re.compile(r"\bkind=(\w+)")
_BACKEND_KIND = re.compile(r'"kind":"(\w+)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def parse_point(spec: str) -> tuple[int, int, int]:
  """'M,r,N' -> (M, r, N), each a positive integer."""
  try:
    m, r, n = (int(t) for t in spec.split(","))
  except ValueError:
    raise ValueError(f"point {spec!r}: expected M,r,N (three integers)") from None
  if min(m, r, n) < 1:
    raise ValueError(f"point {spec!r}: M, r and N must be positive")
  return m, r, n


def entry_kernels(hlo: str) -> list[str]:
  """The ENTRY computation's fusions and custom calls of an optimized HLO module, in order:
  'fusion:<kind>[/<backend kind>]' or 'custom-call:<target>'."""
  out, inside = [], False
  for line in hlo.splitlines():
    if line.startswith("ENTRY"):
      inside = True
      continue
    if inside and line.startswith("}"):
      break
    if not inside:
      continue
    if " custom-call(" in line and (t := _TARGET.search(line)):
      out.append(f"custom-call:{t.group(1)}")
    elif " fusion(" in line and (k := _KIND.search(line)):
      b = _BACKEND_KIND.search(line)
      out.append(f"fusion:{k.group(1)}" + (f"/{b.group(1)}" if b else ""))
  return out


def form_fn(form: str, m: int, r: int):
  """fn(x, p, v) -> y [m, N] bf16 for one form of P (x, the chain's input, is not read)."""

  def fn(x, p, v):
    if form == "f32_slice":
      p = p[: m * r].reshape(m, r)
    elif form == "f32_flat":
      p = p.reshape(m, r)
    elif form == "f32_rows":
      p = p[m : 2 * m]
    return jnp.dot(p.astype(jnp.bfloat16), v)

  return fn


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("points", nargs="+", help="M,r,N")
  ap.add_argument("--out", required=True)
  ap.add_argument("--reps", type=int, default=15)
  args = ap.parse_args(argv)
  points = [parse_point(p) for p in args.points]
  import gpu_lowrank as g
  from results_io import write_json

  g.REPS = args.reps
  dev = jax.devices()[0]
  if dev.platform != "gpu":
    raise SystemExit(f"needs a GPU (jax sees {dev.platform})")
  recs = []
  for m, r, n in points:
    layers = 3 * g.n_layers(0, m)
    keys = jax.random.split(jax.random.key(m * 7919 + r * 31 + n), 2 * layers)
    p32 = [jax.random.normal(keys[2 * i], (m, r), jnp.float32) for i in range(layers)]
    v = [
      (jax.random.normal(keys[2 * i + 1], (r, n), jnp.float32) * r**-0.5).astype(jnp.bfloat16)
      for i in range(layers)
    ]
    x = jnp.zeros((1,), jnp.float32)
    for form in FORMS:
      if form == "bf16":
        ps = [p.astype(jnp.bfloat16) for p in p32]
      elif form == "f32":
        ps = p32
      elif form == "f32_slice":  # the kernel's scratch holds P first, then flags and counters
        ps = [jnp.concatenate([p.reshape(-1), jnp.zeros((m * r,), jnp.float32)]) for p in p32]
      elif form == "f32_flat":
        ps = [p.reshape(-1) for p in p32]
      else:
        ps = [jnp.concatenate([jnp.zeros_like(p), p, jnp.zeros_like(p)]) for p in p32]
      fn = form_fn(form, m, r)
      us, spread = g.per_call_us(fn, x, list(zip(ps, v)), distinct=True)
      hlo = jax.jit(fn).lower(x, ps[0], v[0]).compile().as_text()
      got = np.asarray(jax.jit(fn)(x, ps[0], v[0]), np.float64)
      want = np.asarray(p32[0].astype(jnp.bfloat16), np.float64) @ np.asarray(v[0], np.float64)
      err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
      if err > 2e-2:
        raise SystemExit(f"{m},{r},{n} {form}: relative error {err} (expected < 2e-2)")
      rec = dict(
        M=m,
        r=r,
        N=n,
        form=form,
        us=round(us, 3),
        spread=round(spread, 4),
        kernels=entry_kernels(hlo),
        rel_err=err,
        layers=layers,
      )
      recs.append(rec)
      print(f"{m},{r},{n} {form:10s} {us:7.3f} us  {' '.join(rec['kernels'])}", flush=True)
  meta = dict(
    machine=dev.device_kind,
    jax=jax.__version__,
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    method=__doc__.split("\n\n")[1].replace("\n", " "),
    timing="per_call_us(distinct=True): 3L layers, each call on its own",
  )
  write_json(args.out, dict(meta=meta, records=recs))
  print(f"wrote {len(recs)} records to {args.out}")


if __name__ == "__main__":
  main()
