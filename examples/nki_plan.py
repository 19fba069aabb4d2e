"""Plan a low-rank layer for Trainium and show which NKI kernel lrjax would lower it to.

Runs anywhere: it only uses the block planner (NeuronMM eq. 10-11) and the neuron
platform's ``would_serve``; nothing is compiled for or run on Trainium. (The kernels
themselves are exercised on CPU by the numpy NKI test double in
tests/custom_calls/nki/, which this example deliberately does not import.)

    python examples/nki_plan.py --M 4096 --K 7168 --r 4096 --N 18432 --out-t
"""

import argparse
import json

import jax
import jax.numpy as jnp

from lrjax.custom_calls.nki import lowering, planner


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--M", type=int, default=4096, help="tokens (rows of X)")
  ap.add_argument("--K", type=int, default=7168)
  ap.add_argument("--r", type=int, default=4096)
  ap.add_argument("--N", type=int, default=18432)
  ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
  ap.add_argument("--out-t", action="store_true", help="write O^T (for a following NKI kernel)")
  a = ap.parse_args()

  print("== planner (model predictions, not measurements) ==")
  try:
    p = planner.plan("xuv", a.M, a.K, a.r, a.N, jnp.dtype(a.dtype), out_t=a.out_t)
    print(json.dumps(p.summary(), indent=1))
  except planner.PlanError as e:
    print("no plan:", e)
  print("\n== B_M sweep (least-traffic blocks per B_M) ==")
  for bm in planner.table4_bm_values(planner.pad128(a.M)):
    if planner.pad128(a.M) % bm:
      continue
    q = planner.best_for_bm("xuv", a.M, a.K, a.r, a.N, jnp.dtype(a.dtype), bm, out_t=a.out_t)
    if q is not None:
      print(
        f"B_M={bm:5d} blocks={q.blocks.as_tuple()} AI eq10={q.ai_eq10:7.1f} kernel={q.ai:7.1f} "
        f"SBUF(pipelined)={q.sbuf_pipelined_bytes / 2**20:5.1f}/24 MiB "
        f"{'SPILLS' if not q.fits else 'fits'}"
      )

  print("\n== what lrjax.lowering would select on platform 'neuron' ==")
  dt = jnp.dtype(a.dtype)
  S = jax.ShapeDtypeStruct
  avals = [S((a.M, a.K), dt), S((a.K, a.r), dt), S((a.r, a.N), dt)]
  name, why = lowering.would_serve(
    "lr_xuv", avals, dict(has_bias=False, inter_dtype=dt, out_dtype=dt)
  )
  print(f"lr_xuv -> {name or 'XLA reference'}: {why}")
  print(
    f"(registered here: {lowering.neuron_available()}; without the Neuron SDK the reference serves)"
  )


if __name__ == "__main__":
  main()
