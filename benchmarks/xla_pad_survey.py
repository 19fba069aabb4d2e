"""Where XLA pads V for the ·V GEMM of its own decode ``(x @ u) @ v`` (compile only, no timing).

Where XLA splits the ·V GEMM over the rank r (a batched cuBLAS call on the H200), it pads r to a
multiple the split divides (2456 -> 2464 = 4 x 616) and copies V into the padded buffer first,
every call: 25 µs a call at 64 x 8192->2456->8192, where the whole call takes 61
(gpu_lowrank.py --distinct-weights). The sweep's reused weights hid the copy, which then ran
once a layer. Both XLA's chain and lrjax's phase 1 + XLA's GEMM (``xuv_decode``'s ``pv="xla"``)
pay it, so ``xuv_decode.default_pv`` keeps V in the fused kernel where this survey found XLA
padding (``PV_XLA_PAD_*``: up to 64 rows, r >= 2048 not a multiple of 16). Whether XLA splits
follows its GEMM autotuner; the survey records which (M, K, r, N) it padded.

  python benchmarks/xla_pad_survey.py --out benchmarks/results/gpu_xla_pad_survey_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CONTEXTS = ((64, 8192, 8192), (128, 8192, 8192), (64, 4096, 14336), (128, 4096, 14336))
RANKS = (2456, 2440, 2448, 2432, 2464, 2400, 3824, 1000, 1032, 1016, 520, 152)
_PAD = re.compile(r"=\s*\w+\[(\d+),(\d+)\]\{1,0\}\s+(?:pad\(|fusion\([^\n]*calls=%fused_pad)")


def v_pads(hlo: str, r: int, n: int) -> list[int]:
  """Row counts of every padded copy of an [r, N] operand in an optimized HLO module's text:
  a pad, or a fusion of one, whose result has N columns and more than r rows."""
  return sorted({int(a) for a, b in _PAD.findall(hlo) if int(b) == n and int(a) > r})


def survey(contexts=CONTEXTS, ranks=RANKS) -> list[dict]:
  import jax
  import jax.numpy as jnp

  out = []
  for m, k, n in contexts:
    for r in ranks:
      spec = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((m, k), (k, r), (r, n))]
      hlo = jax.jit(lambda x, u, v: (x @ u) @ v).lower(*spec).compile().as_text()
      pads = v_pads(hlo, r, n)
      out.append(dict(M=m, K=k, r=r, N=n, v_padded_to=pads[0] if pads else None))
      print(
        f"M={m} K={k} r={r} N={n}: {'V padded to ' + str(pads[0]) if pads else 'no pad'}",
        flush=True,
      )
  return out


def parse_context(text: str) -> tuple[int, int, int]:
  """ "M,K,N" -> (M, K, N), each a positive integer."""
  parts = text.split(",")
  if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
    raise ValueError(f"{text!r}: expected M,K,N (three positive integers)")
  return tuple(int(p) for p in parts)


def _context_arg(text: str) -> tuple[int, int, int]:
  try:
    return parse_context(text)
  except ValueError as e:  # argparse shows an ArgumentTypeError's own message
    raise argparse.ArgumentTypeError(str(e)) from None


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", required=True, help="results JSON")
  ap.add_argument(
    "--contexts",
    nargs="*",
    type=_context_arg,
    default=list(CONTEXTS),
    metavar="M,K,N",
    help="row counts and the chain's K and N",
  )
  ap.add_argument("--ranks", nargs="*", type=int, default=list(RANKS), help="ranks r to compile")
  args = ap.parse_args()
  if any(r <= 0 for r in args.ranks):
    ap.error(f"--ranks: expected positive integers, got {args.ranks}")
  import jax
  from results_io import write_json

  dev = jax.devices()[0]
  records = survey(args.contexts, args.ranks)
  meta = dict(
    machine=getattr(dev, "device_kind", str(dev)),
    jax=jax.__version__,
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    method="compile (x @ u) @ v for bf16 ShapeDtypeStructs of each (M, K, r, N) in a "
    "fresh jit; a pad (or pad fusion) producing [r' > r, N] is a padded V",
  )
  write_json(args.out, dict(meta=meta, records=records))


if __name__ == "__main__":
  main()
