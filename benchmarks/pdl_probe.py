"""Does programmatic dependent launch (PDL) shorten a chain of decode X·U·V calls?

jaxlib launches Triton kernels with a plain cuLaunchKernel, so under JAX a kernel starts only
after the kernel ahead of it has finished and flushed. With PDL (the launch attribute
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION) its CTAs may start earlier and wait in
``griddepcontrol.wait`` (``_common.join_chain``); before the wait they may only touch weights,
e.g. ask L2 for their first U tile. Before building a launcher of our own for XLA, this probe
measures the effect outside JAX: Triton's own launcher (which sets the attribute when a kernel
is compiled with ``launch_pdl=True``), torch buffers, the chain captured in a CUDA graph as XLA
captures its command buffers.

Per-call time = median over reps of (t(3L calls) - t(L calls)) / 2L, L layers of distinct
weights (> 200 MB in all, beyond L2), CUDA-event timed graph replays. Variants:
  plain      the kernel as lrjax launches it (PDL=0), plain launch
  pdl        gdc_wait at entry (PDL=1, _common.join_chain), PDL launch
  cublas     torch's (x @ U) @ V (two cuBLAS GEMMs), the baseline outside XLA
The committed results also hold variants measured on the kernel of git 820896d (see their
meta): an early gdc_launch_dependents, right after the wait ("pdl_trig1") or at the start of
phase 2 ("pdl_trig2"), and an L2 prefetch of each CTA's first U tile before the wait ("_pf64":
its first 64 rows, "_pftile": all of it).
Each runs back to back (pre=False) and with an elementwise torch kernel (x * 1.0001, standing
for a norm) before each call (pre=True), as in a model, where the kernel ahead of ours is
XLA's and never triggers early. Outputs are checked against an f32 reference.

  python benchmarks/pdl_probe.py --out benchmarks/results/gpu_pdl_probe_h200.json

Needs a GPU, jax-triton and torch (for Triton's launcher and the CUDA graph; the H200 machine
has it). torch is this probe's alone, not a dependency of lrjax.
"""

from __future__ import annotations

import argparse
import datetime
import statistics

from results_io import write_json

SHAPES = (
  (2048, 256, 512),
  (4096, 152, 4096),
  (4096, 1216, 4096),
  (8192, 2456, 8192),
  (4096, 2560, 14336),
)
VARIANTS = {"plain": 0, "pdl": 1}  # name: PDL (launched with the PDL attribute when set)


def cuda_setup():
  """(torch, triton, the CUDA device, its SMs) for a probe that launches through Triton's own
  launcher (also used by benchmarks/decode_trace.py). jax-triton empties Triton's cache dir,
  into which that launcher compiles: a temporary one stands in."""
  import tempfile

  import torch
  import triton

  if not triton.knobs.cache.dir:
    triton.knobs.cache.dir = tempfile.mkdtemp(prefix="triton-cache-")
  dev = torch.device("cuda")
  return torch, triton, dev, torch.cuda.get_device_properties(dev).multi_processor_count


def factor_layers(torch, dev, k: int, r: int, n: int, min_layers: int):
  """(L, [U], [V]): L distinct random bf16 layers K -> r -> N, over 200 MB in all (beyond
  L2), at least ``min_layers`` and at most 128, an even count (the scratch chain alternates
  halves)."""
  layers = min(128, max(min_layers, -(-200_000_000 // (2 * r * (k + n)))))
  layers += layers % 2
  us = [torch.randn(k, r, device=dev, dtype=torch.bfloat16) / k**0.5 for _ in range(layers)]
  vs = [torch.randn(r, n, device=dev, dtype=torch.bfloat16) / r**0.5 for _ in range(layers)]
  return layers, us, vs


def write_results(path: str, torch, triton, dev, method: str, recs: list) -> None:
  """The records and what they were measured on (machine, versions, date, method) as JSON at
  ``path``, written whole or not at all (also used by benchmarks/decode_trace.py)."""
  meta = dict(
    machine=torch.cuda.get_device_name(dev),
    torch=torch.__version__,
    triton=triton.__version__,
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    method=method,
  )
  write_json(path, dict(meta=meta, records=recs))
  print(f"wrote {len(recs)} records to {path}")


def graph_per_call_us(issue, layers: int, reps: int):
  """(median, IQR / median) over ``reps`` of (t(3L calls) - t(L calls)) / 2L µs: ``issue(count)``
  launches ``count`` calls; each count is captured once in a CUDA graph and replayed, timed with
  CUDA events (also used by benchmarks/decode_trace.py)."""
  import torch

  graphs = []
  for count in (layers, 3 * layers):
    issue(count)  # compile and warm outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
      issue(count)
    graphs.append(g)
  for g in graphs:
    g.replay()
  diffs = []
  for _ in range(reps):
    ts = []
    for g in graphs:
      a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
      a.record()
      g.replay()
      b.record()
      b.synchronize()
      ts.append(a.elapsed_time(b) * 1e3)  # µs
    diffs.append((ts[1] - ts[0]) / (2 * layers))
  q = statistics.quantiles(diffs, n=4)
  med = statistics.median(diffs)
  return med, (q[2] - q[0]) / med


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="benchmarks/results/gpu_pdl_probe_h200.json")
  ap.add_argument("--m", type=int, nargs="+", default=[1, 16])
  ap.add_argument("--reps", type=int, default=25)
  ap.add_argument("--shapes", nargs="+", help="K,r,N ... (default: SHAPES)")
  ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=sorted(VARIANTS))
  args = ap.parse_args()

  from lrjax.custom_calls.triton import planner, xuv_decode

  torch, triton, dev, sms = cuda_setup()
  kern = xuv_decode._xuv_decode_persistent_kernel
  recs = []

  def timed(issue, layers):
    return graph_per_call_us(issue, layers, args.reps)

  shapes = [tuple(map(int, s.split(","))) for s in args.shapes] if args.shapes else SHAPES
  for k, r, n in shapes:
    layers, us, vs = factor_layers(torch, dev, k, r, n, 4)
    for m in args.m:
      x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
      xb = torch.empty_like(x)
      outs = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
      p = planner.plan_decode_persistent(m, k, r, n, programs=sms)
      plan = xuv_decode.persistent_launch_plan(m, k, r, n, False, p, True)
      half = planner.round_up(plan["scratch"], 16)
      scratch = torch.zeros(2 * half, device=dev, dtype=torch.float32)
      p16 = torch.empty(plan["p16"], device=dev, dtype=torch.bfloat16)
      ref = [
        ((x.float() @ us[l].float()).to(torch.bfloat16).float() @ vs[l].float()) for l in (0, 1)
      ]
      for pre in (False, True):
        src = xb if pre else x

        def cublas(count):
          for i in range(count):
            if pre:
              torch.mul(x, 1.0001, out=xb)
            torch.matmul(torch.matmul(src, us[i % layers]), vs[i % layers], out=outs[i % layers])

        issues = {"cublas": cublas}
        for name, pdl in ((v, VARIANTS[v]) for v in args.variants):

          def issue(count, pdl=pdl):
            for i in range(count):
              if pre:
                torch.mul(x, 1.0001, out=xb)
              par = i % 2
              kern[(plan["grid"],)](
                src,
                us[i % layers],
                vs[i % layers],
                vs[i % layers],
                x,
                m,
                (1 - par) * half,
                plan["scratch"],
                scratch,
                outs[i % layers],
                p16,
                **plan["meta"],
                WORK_OFF=par * half,
                PDL=pdl,
                num_warps=p.warps,
                num_stages=p.stages,
                launch_pdl=pdl > 0,
              )

          issues[name] = issue
        for name, issue in issues.items():
          for o in outs[:2]:
            o.fill_(float("nan"))
          med, spread = timed(issue, layers)
          torch.cuda.synchronize()
          scale = 1.0001 if pre else 1.0
          err = max(
            float((outs[l].float() - ref[l] * scale).abs().max() / ref[l].abs().max())
            for l in (0, 1)
          )
          rec = dict(
            K=k,
            r=r,
            N=n,
            M=m,
            layers=layers,
            pre=pre,
            variant=name,
            per_call_us=med,
            spread=spread,
            max_rel_err=err,
          )
          recs.append(rec)
          print(
            f"{k}->{r}->{n} M={m:3d} pre={int(pre)} {name:11s} {med:7.2f} us "
            f"(spread {spread:.2f}, err {err:.1e})",
            flush=True,
          )
          if not err < 2e-2:
            raise SystemExit(f"{name}: relative error {err} (expected < 2e-2)")
  write_results(args.out, torch, triton, dev, __doc__.split("\n\n")[2].replace("\n", " "), recs)


if __name__ == "__main__":
  main()
