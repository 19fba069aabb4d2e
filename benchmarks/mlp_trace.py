"""Where a SwiGLU decode call's time goes, CTA by CTA and stage by stage, read from the GPU's
clock (the tiled ``mlp_decode`` kernel, the default schedule).

The kernel's timing-only TRACE switch makes each CTA write %globaltimer (ns) at five points:
entry, the end of its first and of its last wait (stage B waits once per chunk of Pg/Pu;
stages H and C once; stage A never), the end of its work, and its exit (after zeroing the
scratch chain's other half). This script launches a chain of L calls (distinct weights,
> 200 MB in all, so every call streams from HBM) captured in one CUDA graph, each call
writing its own stamps, and reports per call and per stage (A, B, H, C; medians over the
chain's middle calls, µs from the call's first CTA entry):

  period              first entry of this call to the first entry of the next (per call)
  <S>_enter_first / <S>_enter_last     when the stage's first and last CTAs entered
  <S>_wait1_med / <S>_wait1_last       when its first wait ended (median, last CTA)
  <S>_wait_med / <S>_wait_last         when its last wait ended
  <S>_work_med / <S>_work_last         when its work ended
  exit / gap          the last CTA's exit; the next call's first entry minus it
and, for one call from the chain's middle, every CTA's stamps and SM (``ctas``), and
``floor_us``: the call's bytes (planner.hbm_bytes_mlp) over the H200's 4.3 TB/s.

Each case also runs untraced in the same graph method ((t(3L) - t(L)) / 2L, as
pdl_probe.graph_per_call_us); the cases of one shape share their layers, so they are an A/B
on the same weights. Every output is checked against an f32 reference with the kernel's
roundings.

A case is ``T,D,r,F[:field=value,...]``: T tokens, D -> r -> F (gate and up), F -> r -> D
(down), silu, no bias, on ``mlp_decode.BlockSizes.get_default``'s blocks with the given
fields replaced (e.g. ``prefetch=256``, ``park_h=0``):

  python benchmarks/mlp_trace.py --out benchmarks/results/gpu_mlp_decode_trace_h200.json \\
      --case 1,2048,1280,8192 --case 1,2048,1280,8192:prefetch=128

Needs a GPU and torch (Triton's own launcher and the CUDA graph; the H200 machine has it).
torch is this script's alone, not a dependency of lrjax.
"""

from __future__ import annotations

import dataclasses

import decode_trace

SLOTS = ("entry", "wait1", "wait", "work", "exit")


def parse_case(spec: str):
  """'T,D,r,F[:field=v,...]' -> ((T, D, r, F), {BlockSizes field: value})."""
  from lrjax.custom_calls.triton import mlp_decode

  return decode_trace.parse_case(spec, mlp_decode.BlockSizes, "T,D,r,F")


def stage_bounds(meta: dict, grid: int) -> dict:
  """{stage: (first pid, end pid)} of one launch of the tiled kernel, from its constexprs."""
  cdiv = lambda a, b: -(-a // b)
  n_a = cdiv(meta["R"], meta["BLOCK_R"]) * meta["SPLIT_K"]
  n_b = cdiv(meta["F"], meta["COLS_F"])
  n_h = (
    meta["H_SPLITS"] * cdiv(meta["RD"], meta["BLOCK_H"])
    if meta["PARK_H"] and not meta["H_INLINE"]
    else 0
  )
  return dict(
    A=(0, n_a), B=(n_a, n_a + n_b), H=(n_a + n_b, n_a + n_b + n_h), C=(n_a + n_b + n_h, grid)
  )


def summarize(tr, bounds: dict):
  """Per-call stage times (µs from the call's first entry), medians over the middle calls.
  ``tr`` [calls, grid, 8] int64 ns."""
  import numpy as np

  t, t0 = decode_trace.stamps_us(tr, max(hi for _, hi in bounds.values()), len(SLOTS))
  rows = []
  for i in range(1, t.shape[0] - 1):  # skip the first and last calls of the chain
    c = t[i] - t0[i]
    row = dict(
      period=t0[i + 1] - t0[i], exit=np.nanmax(c[:, 4]), gap=t0[i + 1] - t0[i] - np.nanmax(c[:, 4])
    )
    for s_, (lo, hi) in bounds.items():
      if hi <= lo:
        continue
      st = c[lo:hi]
      row[f"{s_}_enter_first"] = np.nanmin(st[:, 0])
      row[f"{s_}_enter_last"] = np.nanmax(st[:, 0])
      if s_ != "A":
        for j, name in ((1, "wait1"), (2, "wait")):
          row[f"{s_}_{name}_med"] = np.nanmedian(st[:, j])
          row[f"{s_}_{name}_last"] = np.nanmax(st[:, j])
      row[f"{s_}_work_med"] = np.nanmedian(st[:, 3])
      row[f"{s_}_work_last"] = np.nanmax(st[:, 3])
    rows.append(row)
  return decode_trace.median_rows(rows)


def main():
  args, cases = decode_trace.cli("T,D,r,F[:BlockSizes_field=value,...] (repeatable)", parse_case)

  import pdl_probe
  from lrjax.custom_calls.triton import mlp_decode, planner

  torch, triton, dev, sms = pdl_probe.cuda_setup()
  kern = mlp_decode._mlp_decode_kernel
  bf16 = torch.bfloat16
  recs, weights, xs = [], {}, {}
  for spec, ((m, d, r, f), over) in zip(args.case, cases):
    per_layer = planner.hbm_bytes_mlp(m, d, f, r)  # the six factors, x and the output
    layers = min(128, max(8, -(-200_000_000 // per_layer)))
    layers += layers % 2
    mk = lambda a, b: torch.randn(a, b, device=dev, dtype=bf16) / a**0.5
    if (d, r, f) not in weights:  # the cases of one shape share their layers (same weights)
      weights[d, r, f] = [
        dict(ug=mk(d, r), vg=mk(r, f), uu=mk(d, r), vu=mk(r, f), ud=mk(f, r), vd=mk(r, d))
        for _ in range(layers)
      ]
    ws = weights[d, r, f]
    x = xs.setdefault((m, d), torch.randn(m, d, device=dev, dtype=bf16))
    outs = [torch.empty(m, d, device=dev, dtype=bf16) for _ in range(layers)]
    bs = dataclasses.replace(mlp_decode.BlockSizes.get_default(m, d, f, r, d), **over)
    plan = mlp_decode.launch_plan(
      m, d, r, f, r, d, gated=True, act="silu", bias_mask=(False, False, False), bs=bs
    )
    grid, half = plan["grid"], planner.round_up(plan["scratch"], 16)
    res = {}
    for traced in (0, 1):
      scratch = torch.zeros(2 * half, device=dev, dtype=torch.float32)
      p16 = torch.empty(plan["p16"], device=dev, dtype=bf16)
      trace = torch.zeros(3 * layers, grid, 8, device=dev, dtype=torch.int64)

      def issue(count, scratch=scratch, p16=p16, trace=trace, traced=traced):
        for i in range(count):
          par, w = i % 2, ws[i % layers]
          kern[(grid,)](
            x,
            w["ug"],
            w["vg"],
            w["vg"],
            w["uu"],
            w["vu"],
            w["vu"],
            w["ud"],
            w["vd"],
            w["vd"],
            trace[i] if traced else x,
            m,
            (1 - par) * half,
            plan["scratch"],
            scratch,
            outs[i % layers],
            p16,
            **{**plan["meta"], "TRACE": traced},
            WORK_OFF=par * half,
            num_warps=bs.num_warps,
            num_stages=bs.num_stages,
          )

      for o in outs[:2]:
        o.fill_(float("nan"))
      res[traced] = pdl_probe.graph_per_call_us(issue, layers, args.reps)[0]
      torch.cuda.synchronize()
      for l in (0, 1):
        w, rnd = ws[l], lambda a: a.to(bf16).float()
        xf = x.float()
        h = torch.nn.functional.silu(rnd(xf @ w["ug"].float()) @ w["vg"].float()) * (
          rnd(xf @ w["uu"].float()) @ w["vu"].float()
        )
        ref = rnd(rnd(h) @ w["ud"].float()) @ w["vd"].float()
        err = float((outs[l].float() - ref).abs().max() / ref.abs().max())
        if not err < 2e-2:
          raise SystemExit(f"{spec} TRACE={traced}: relative error {err} (expected < 2e-2)")
    bounds = stage_bounds(plan["meta"], grid)
    tr = trace.cpu().numpy()  # the last replay's (3L calls) stamps
    stages = summarize(tr, bounds)
    ctas = decode_trace.cta_stamps(tr, layers, grid, SLOTS)  # a call from the middle
    rec = dict(
      case=spec,
      T=m,
      D=d,
      r=r,
      F=f,
      blocks=dataclasses.asdict(bs),
      layers=layers,
      floor_us=round(per_layer / planner.H200.hbm_bw * 1e6, 3),
      per_call_us=round(res[0], 3),
      traced_per_call_us=round(res[1], 3),
      ctas_per_stage={s_: hi - lo for s_, (lo, hi) in bounds.items()},
      **stages,
      ctas=ctas,
    )
    decode_trace.report(recs, rec, ("blocks", "ctas"))
  decode_trace.save(args.out, torch, triton, dev, __doc__, recs)


if __name__ == "__main__":
  main()
