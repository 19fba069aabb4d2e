"""Where a persistent decode X·U·V call's time goes, CTA by CTA, read from the GPU's clock.

The kernel's timing-only PROBE bit 4 makes each CTA write %globaltimer (ns) at five points:
entry, the end of its phase-1 tiles, the end of its wait for P, the end of phase 2, and its
exit (after zeroing the scratch chain's other half). This script launches a chain of L calls
(distinct weights, > 200 MB in all, so every call streams from HBM) captured in one CUDA
graph, as XLA runs a model's calls, each call writing its own stamps, and reports per call
(median over the chain's middle calls, in µs from the call's first CTA entry):

  period     first entry of this call to the first entry of the next (the per-call time)
  enter      when the last CTA entered (the launch ramp)
  p1_med / p1_end   phase-1 end, median and last CTA (CTAs with phase-1 tiles)
  wait_first / wait_med / wait_last   when the waits for P ended
  p2_med / p2_end   phase-2 end, median and last CTA
  exit       the last CTA's exit; gap = the next call's first entry minus it
and, for one call from the chain's middle, every CTA's stamps and SM (``ctas``).

Each variant also runs untraced in the same graph method ((t(3L) - t(L)) / 2L, as
pdl_probe.graph_per_call_us) and the stamped outputs are checked against an f32 reference.
``--phase1`` traces phase 1 alone (``xuv_decode(pv="xla")``'s kernel on
``planner.plan_decode_phase1``'s tiles, ending with P's f32 sums left in the scratch, or with
``:p16=1`` P rounded into bf16; XLA's ·V is not run): no wait or phase 2, so ``p2_*`` and
``wait_*`` are left out and P is what is checked.

  python benchmarks/decode_trace.py --out benchmarks/results/gpu_xuv_decode_trace_h200.json \
      --case 2,4096,2560,14336 --case 2,4096,2560,14336:prefetch=0

Needs a GPU and torch (Triton's own launcher and the CUDA graph; the H200 machine has it).
torch is this script's alone, not a dependency of lrjax.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

SLOTS = ("entry", "p1", "wait", "p2", "exit")


def parse_case(spec: str, plan_type=None, dims: str = "M,K,r,N"):
  """'M,K,r,N[:field=v,...]' -> ((M, K, r, N), {field: value}) (also benchmarks/mlp_trace.py's
  'T,D,r,F' cases, ``dims`` naming the four sizes). The fields must be ``plan_type``'s (a
  dataclass; default: planner.PersistentDecodePlan), bools given as 0 / 1; sizes positive."""
  if plan_type is None:
    from lrjax.custom_calls.triton import planner

    plan_type = planner.PersistentDecodePlan
  shape, _, kw = spec.partition(":")
  try:
    sizes = tuple(int(d) for d in shape.split(","))
  except ValueError:
    sizes = ()
  if len(sizes) != 4 or min(sizes) < 1:
    raise SystemExit(f"--case {spec!r}: expected {dims}[:field=value,...], positive sizes")
  types = {f.name: f.type for f in dataclasses.fields(plan_type)}
  over = {}
  for item in filter(None, kw.split(",")):
    key, _, val = item.partition("=")
    if key not in types:
      raise SystemExit(
        f"--case {spec!r}: {key!r} is not a {plan_type.__name__} field (one of {sorted(types)})"
      )
    try:
      over[key] = bool(int(val)) if types[key] in (bool, "bool") else int(val)
    except ValueError:
      raise SystemExit(f"--case {spec!r}: {key}={val!r} is not an integer") from None
  return sizes, over


def stamps_us(tr, grid: int, slots: int):
  """(t, t0): the stamps ``tr`` [calls, grid, 8] int64 ns in µs (NaN where a CTA has no such
  point: a 0 stamp), [calls, grid, slots], and each call's first entry (also used by
  benchmarks/mlp_trace.py)."""
  import numpy as np

  raw = tr[:, :grid, :slots]
  t = np.where(raw == 0, np.nan, raw.astype(np.float64) / 1e3)
  return t, np.nanmin(t[:, :, 0], axis=1)


def median_rows(rows: list) -> dict:
  """Each field's median over the per-call rows, in µs to 3 decimals."""
  return {k: round(float(statistics.median(r[k] for r in rows)), 3) for k in rows[0]}


def cta_stamps(tr, call: int, grid: int, slots) -> dict:
  """One call's stamps CTA by CTA (µs from its first entry; None: no such point) and SMs."""
  one = tr[call]
  t0 = one[:grid, 0].min()
  return dict(
    sm=one[:grid, 7].tolist(),
    **{
      s_: [round((v - t0) / 1e3, 3) if v else None for v in one[:grid, j]]
      for j, s_ in enumerate(slots)
    },
  )


def summarize(tr, grid: int, n1: int, pv: bool = True):
  """Per-call phase times (µs from the call's first entry), medians over the middle calls.
  ``tr`` [calls, grid, 8] int64 ns; CTAs < n1 ran phase-1 tiles (all of them when n1 >=
  grid); ``pv`` False: phase 1 alone (no wait, no phase 2)."""
  import numpy as np

  t, t0 = stamps_us(tr, grid, len(SLOTS))
  rows = []
  for i in range(1, t.shape[0] - 1):  # skip the first and last calls of the chain
    c = t[i] - t0[i]
    p1 = c[: min(n1, grid), 1]
    row = dict(
      period=t0[i + 1] - t0[i],
      enter=np.nanmax(c[:, 0]),
      p1_med=np.nanmedian(p1),
      p1_end=np.nanmax(p1),
    )
    if pv:
      row.update(
        wait_first=np.nanmin(c[:, 2]),
        wait_med=np.nanmedian(c[:, 2]),
        wait_last=np.nanmax(c[:, 2]),
        p2_med=np.nanmedian(c[:, 3]),
        p2_end=np.nanmax(c[:, 3]),
      )
    rows.append(dict(row, exit=np.nanmax(c[:, 4]), gap=t0[i + 1] - t0[i] - np.nanmax(c[:, 4])))
  return median_rows(rows)


def cli(case_help: str, parse=parse_case, phase1: bool = False, argv=None):
  """(args, cases) of a trace script (also benchmarks/mlp_trace.py): --out, --case
  (repeatable, ``case_help``), --reps, and ``phase1``: decode_trace's --phase1; every case
  parsed before any GPU work."""
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  ap.add_argument("--case", action="append", required=True, help=case_help)
  ap.add_argument("--reps", type=int, default=25)
  if phase1:
    ap.add_argument(
      "--phase1",
      action="store_true",
      help="phase 1 alone (pv='xla': P in bf16 or f32 as its plan says; XLA's ·V not run)",
    )
  args = ap.parse_args(argv)
  return args, [parse(spec) for spec in args.case]


def report(recs: list, rec: dict, hidden: tuple) -> None:
  """Keeps ``rec`` and prints it as one JSON line without the ``hidden`` (bulky) fields."""
  recs.append(rec)
  print(json.dumps({k: v for k, v in rec.items() if k not in hidden}), flush=True)


def save(out: str, torch, triton, dev, doc: str, recs: list) -> None:
  """Writes the records with the machine and the method (``doc``'s second and third
  paragraphs) to ``out``."""
  import pdl_probe

  pdl_probe.write_results(
    out, torch, triton, dev, " ".join(doc.split("\n\n")[1:3]).replace("\n", " "), recs
  )


def main(argv=None):
  args, cases = cli("M,K,r,N[:plan_field=value,...] (repeatable)", phase1=True, argv=argv)
  pv = not args.phase1

  import pdl_probe
  from lrjax.custom_calls.triton import planner, xuv_decode

  torch, triton, dev, sms = pdl_probe.cuda_setup()
  kern = xuv_decode._xuv_decode_persistent_kernel
  recs = []

  def per_call_us(issue, layers):
    return pdl_probe.graph_per_call_us(issue, layers, args.reps)[0]

  for spec, ((m, k, r, n), over) in zip(args.case, cases):
    layers, us, vs = pdl_probe.factor_layers(torch, dev, k, r, n, 8)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    outs = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    plan_fn = planner.plan_decode_persistent if pv else planner.plan_decode_phase1
    p = dataclasses.replace(plan_fn(m, k, r, n, programs=sms), **over)
    res = {}
    for probe in (0, 4):
      plan = xuv_decode.persistent_launch_plan(m, k, r, n, False, p, pv, probe)
      grid, half = plan["grid"], planner.round_up(plan["scratch"], 16)
      scratch = torch.zeros(2 * half, device=dev, dtype=torch.float32)
      p16 = torch.empty(plan["p16"], device=dev, dtype=torch.bfloat16)
      trace = torch.zeros(3 * layers, grid, 8, device=dev, dtype=torch.int64)

      def issue(count, plan=plan, scratch=scratch, p16=p16, trace=trace, half=half):
        for i in range(count):
          par = i % 2
          kern[(plan["grid"],)](
            x,
            us[i % layers],
            vs[i % layers],
            vs[i % layers],
            trace[i] if probe else x,
            m,
            (1 - par) * half,
            plan["scratch"],
            scratch,
            outs[i % layers],
            p16,
            **plan["meta"],
            WORK_OFF=par * half,
            num_warps=p.warps,
            num_stages=p.stages,
          )

      for o in outs[:2] if pv else [p16]:
        o.fill_(float("nan"))
      res[probe] = per_call_us(issue, layers)
      torch.cuda.synchronize()
      if pv:
        err = max(
          float(
            (
              outs[l].float()
              - ((x.float() @ us[l].float()).to(torch.bfloat16).float() @ vs[l].float())
            )
            .abs()
            .max()
            / (x.float() @ us[l].float() @ vs[l].float()).abs().max()
          )
          for l in (0, 1)
        )
      else:  # the last call's P (layer (3L - 1) % L): bf16 (p16), or f32 sums
        want = x.float() @ us[(3 * layers - 1) % layers].float()  # f32 in its scratch half
        if p.p16:
          got = p16[: m * r].view(m, r).float()
        else:
          off = (3 * layers - 1) % 2 * half
          got = scratch[off : off + m * r].view(m, r)
        err = float((got - want).abs().max() / want.abs().max())
      if not err < 2e-2:
        raise SystemExit(f"{spec} PROBE={probe}: relative error {err} (expected < 2e-2)")
    n1 = planner.cdiv(r, p.cols_r) * planner.cdiv(k, p.k_per)
    tr = trace.cpu().numpy()  # the last replay's (3L calls) stamps
    phases = summarize(tr, grid, n1, pv)
    ctas = cta_stamps(tr, layers, grid, SLOTS)  # one call from the chain's middle
    rec = dict(
      case=spec,
      M=m,
      K=k,
      r=r,
      N=n,
      pv="kernel" if pv else "xla",
      plan=dataclasses.asdict(p),
      layers=layers,
      per_call_us=round(res[0], 3),
      traced_per_call_us=round(res[4], 3),
      phase1_ctas=min(n1, grid),
      **phases,
      ctas=ctas,
    )
    report(recs, rec, ("plan", "ctas"))
  save(args.out, torch, triton, dev, __doc__, recs)


if __name__ == "__main__":
  main()
