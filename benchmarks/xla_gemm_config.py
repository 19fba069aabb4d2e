"""Which GEMM XLA runs for a decode X·U·V call, with what tiles, and how long each kernel takes.

At 64-128 rows lrjax's phase-1 kernel (X·U split over K) trails XLA's own X·U GEMM by 3-4 µs
on the large shapes (results/gpu_timeline_wide_m_h200.json). This script reads what XLA
chose for ``(x @ u) @ v`` in the benchmark's own chain (gpu_lowrank.chained, one pass over
its layers):

- from the compiled HLO, every GEMM fusion or custom call and every Triton fusion (a split-K
  GEMM's reduction among them): its kind (``__triton_gemm`` / ``__triton_nested_gemm_fusion``:
  XLA's Triton emitters with the autotuner's tiles; ``__cublas$...``: cuBLAS), output shape,
  and the parameter shapes of its fused computation;
- from a profile of the chain (gpu_timeline.timeline): each kernel's median duration;
- for the X·U GEMM when XLA's Triton emitter runs it, the phase-1 plan with the same tiles
  (``pv_xla:...``, a gpu_lowrank._xuv_variant), so ``--emit-cases`` can hand decode_ab.py
  cases that time XLA's tiles in lrjax's kernel on the same weights.

  python benchmarks/xla_gemm_config.py --out cfg.json --min-m 64 \\
      --points benchmarks/results/gpu_lowrank_h200.json --emit-cases cases.txt
  python benchmarks/decode_ab.py --out ab.json $(cat cases.txt)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_SHAPE = re.compile(r"\b(bf16|f16|f32|s8|u8|s32)\[([\d,]*)\]")
_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_COMMENT = re.compile(r"/\*.*?\*/")  # /*index=5*/ in long parameter lists
_PARAM = re.compile(r"=\s*(\w+)\[([\d,]*)\][^ ]*\s+parameter\((\d+)\)")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def _json_after(line: str, key: str):
  """The JSON object that follows ``key`` in ``line`` (brace-matched), or None."""
  i = line.find(key)
  if i < 0:
    return None
  i = line.index("{", i)
  depth = 0
  for j in range(i, len(line)):
    depth += {"{": 1, "}": -1}.get(line[j], 0)
    if depth == 0:
      return json.loads(line[i : j + 1])
  raise ValueError(f"unbalanced backend_config in {line[:200]!r}")


def _dims(s: str) -> list:
  return [int(t) for t in s.split(",") if t]


def hlo_gemms(hlo: str) -> list:
  """Every GEMM and Triton fusion of an optimized HLO module's text (split-K reductions
  too): [{name, computation, calls, kind, out, params, backend}]. ``kind`` is the fusion's backend kind
  (``__triton_gemm``, ``__triton_nested_gemm_fusion`` ...) or the custom call's target
  (``__cublas$lt$matmul`` ...); ``params`` the parameter shapes of a fusion's computation;
  ``backend`` the fusion's backend config as XLA wrote it (its tiles: ``triton_gemm_config``
  or ``block_level_fusion_config``), or a custom call's whole config."""  # noqa: E501
  params, comp, lines = {}, None, []
  for line in hlo.splitlines():  # parameter shapes of every computation
    m = _COMP.match(line)
    if m and "=" not in _COMMENT.sub("", line).split("{")[0]:
      comp = m.group(1)
      params[comp] = {}
      continue
    p = _PARAM.search(line)
    if p and comp is not None:
      params[comp][int(p.group(3))] = [p.group(1), _dims(p.group(2))]
    lines.append((comp, line))
  out = []
  for comp, line in lines:
    m = _INSTR.match(line)
    if not m or "backend_config=" not in line:
      continue
    cfg = _json_after(line, "backend_config=") or {}
    fusion = cfg.get("fusion_backend_config", {})
    target = re.search(r'custom_call_target="([^"]+)"', line)
    kind = fusion.get("kind") or (target.group(1) if target else "")
    if not any(w in kind for w in ("gemm", "cublas", "matmul", "triton")):
      continue
    shape = _SHAPE.search(m.group(2))
    called = re.search(r"calls=%?([\w.\-]+)", line)
    ps = params.get(called.group(1), {}) if called else {}
    out.append(
      dict(
        name=m.group(1),
        computation=comp,
        kind=kind,
        calls=called.group(1) if called else None,
        out=[shape.group(1), _dims(shape.group(2))] if shape else None,
        params=[ps[i] for i in sorted(ps)],
        backend=fusion or cfg,
      )
    )
  return out


def xu_gemm(gemms: list, m: int, r: int):
  """The GEMM of ``gemms`` that computes X·U: output [m, r], or [split_k, m, r] under XLA's
  split-K (whose parameters are X and U reshaped to [.., split_k, K / split_k]); not the
  reductions (kind ``__triton``) that finish a split-K GEMM."""
  for g in gemms:
    if g["kind"] != "__triton" and g["out"] and tuple(g["out"][1][-2:]) == (m, r):
      return g
  return None


def xla_tiles(gemm: dict, m: int, r: int):
  """XLA's tiles of a Triton GEMM fusion of X·U as {block_m, block_n, block_k, split_k,
  num_stages, num_warps}: from ``triton_gemm_config``, or from the generic emitter's
  ``block_level_fusion_config`` (the output tile [.., block_m, block_n] of an output
  [split_k, m, r] or [m, r]; that config holds no K step, so block_k is None); None if
  neither."""
  be = gemm["backend"]
  if "triton_gemm_config" in be:
    c = be["triton_gemm_config"]
    return {
      f: int(c.get(f, 1))
      for f in ("block_m", "block_n", "block_k", "split_k", "num_stages", "num_warps")
    }
  blc = be.get("block_level_fusion_config")
  if not blc or not gemm["out"]:
    return None
  dims = gemm["out"][1]
  if tuple(dims[-2:]) != (m, r):
    return None
  sizes = [int(s) for s in blc["output_tiles"][0]["sizes"]]
  return dict(
    block_m=sizes[-2],
    block_n=sizes[-1],
    block_k=None,
    split_k=dims[0] if len(dims) == 3 else 1,
    num_stages=int(blc.get("num_stages", 1)),
    num_warps=int(blc.get("num_warps", 4)),
  )


def phase1_variant(m: int, k: int, r: int, t: dict) -> tuple[str, str]:
  """(``pv_xla:...`` variant with XLA's Triton tiles ``t``, what it could not copy): a CTA a
  tile (``programs``; phase 1 alone never waits, so they need not all be resident). lrjax's
  tile holds every row (block_m = M padded), so XLA's row blocks are not copied; where XLA's
  config gives no K step the kernel's 64 is kept."""
  from lrjax.custom_calls.triton import planner

  bn, split = t["block_n"], t["split_k"]
  bk = t["block_k"] or 64
  k_per = planner.part_len(k, split, bk)
  tiles = planner.cdiv(r, bn) * planner.cdiv(k, k_per)
  v = (
    f"pv_xla:block_r={bn},cols_r={bn},block_k={bk},k_per={k_per},"
    f"stages={t['num_stages']},warps={t['num_warps']},programs={tiles}"
  )
  missed = (
    []
    if t["block_m"] >= m
    else [f"XLA's {planner.cdiv(m, t['block_m'])} row blocks of {t['block_m']}"]
  )
  if t["block_k"] is None:
    missed.append("XLA's K step (not in its config; 64 kept)")
  return v, "; ".join(missed)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("points", nargs="*", help="M,K,r,N")
  ap.add_argument("--points", dest="from_file", help="a gpu_lowrank.py results file")
  ap.add_argument("--min-m", type=int, default=1)
  ap.add_argument("--max-m", type=int, default=128)
  ap.add_argument("--out", required=True)
  ap.add_argument(
    "--emit-cases",
    help="write decode_ab.py cases: xla, auto and, where XLA's "
    "Triton emitter runs X·U, its tiles in lrjax's phase-1 kernel",
  )
  args = ap.parse_args(argv)

  import jax
  import jax.numpy as jnp
  import decode_ab
  import gpu_lowrank as gl
  import gpu_timeline

  pts = [tuple(int(t) for t in p.split(",")) for p in args.points]
  if args.from_file:
    pts += decode_ab.sweep_points(args.from_file, args.max_m)
  pts = sorted({p for p in pts if len(p) == 4 and args.min_m <= p[0] <= args.max_m})
  if not pts:
    raise SystemExit("no points: give M,K,r,N or --points FILE within --min-m/--max-m")

  fn = lambda x, u, v: (x @ u) @ v  # noqa: E731  gpu_lowrank's XLA baseline
  records, cases = [], []
  for m, k, r, n in pts:
    nl = gl.n_layers(2 * (k * r + r * n), m)
    key = jax.random.split(jax.random.key(m + k + r + n), 1 + 2 * nl)
    x = gl.rand(key[0], (m, k))
    layers = [
      (gl.rand(key[1 + 2 * i], (k, r), k**-0.5), gl.rand(key[2 + 2 * i], (r, n), r**-0.5))
      for i in range(nl)
    ]
    hlo = gl.chained(fn, 1).lower(x, layers).compile().as_text()
    gemms, seen = [], set()
    for g in hlo_gemms(hlo):  # one of each: the layers' GEMMs repeat
      sig = json.dumps([g["kind"], g["out"], g["params"], g["backend"]], sort_keys=True)
      if sig not in seen:
        seen.add(sig)
        gemms.append(g)
    rec = dict(
      M=m,
      K=k,
      r=r,
      N=n,
      dtype=str(jnp.dtype(gl.DT)),
      layers=nl,
      gemms=gemms,
      kernels=gpu_timeline.timeline(fn, x, layers)["kernels"],
    )
    if not gemms:  # keep what the HLO holds for a reader, rather than guess
      rec["hlo_excerpt"] = [
        ln.strip()[:600]
        for ln in hlo.splitlines()
        if "kCustom" in ln or "custom-call(" in ln or " dot(" in ln
      ][:12]
    xu = xu_gemm(gemms, m, r)
    tiles = xla_tiles(xu, m, r) if xu else None
    case = f"{m},{k},{r},{n}|xla,,auto"
    if tiles:
      rec["xla_xu_tiles"] = tiles
      rec["phase1_variant"], rec["not_copied"] = phase1_variant(m, k, r, tiles)
      case += ",," + rec["phase1_variant"]
    cases.append(case)
    records.append(rec)
    print(
      m,
      k,
      r,
      n,
      [(g["kind"], g["out"]) for g in gemms],
      tiles,
      [(kk["name"], round(kk["median_us"], 2)) for kk in rec["kernels"]],
      flush=True,
    )

  dev = jax.devices()[0]
  meta = dict(
    machine=getattr(dev, "device_kind", str(dev)),
    jax=jax.__version__,
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    method="gpu_lowrank.chained((x@u)@v) over the benchmark's L layers, one pass, "
    "compiled; GEMMs read from its optimized HLO text (one of each); "
    "kernel medians from gpu_timeline.timeline (3 passes)",
  )
  with open(args.out, "w") as f:
    json.dump(dict(meta=meta, records=records), f, indent=1)
  if args.emit_cases:
    with open(args.emit_cases, "w") as f:
      f.write(" ".join(cases) + "\n")  # no spaces inside a case: $(cat FILE) splits them


if __name__ == "__main__":
  main()
