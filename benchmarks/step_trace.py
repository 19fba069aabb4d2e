"""Where a decode step's time goes, layer block by layer block, from a traced step.

``tp_gpu.py --profile --events-out PATH`` writes the GPU kernel events of one traced call of
the decode loop. This script cuts each step at its norm kernels: in XLA's program, fused or
not, each layer's RMSNorm is a ``fusion`` kernel, and the one right before a projection (an
XLA GEMM ``gemm_fusion_dot``, or one of lrjax's Triton kernels) starts a block. A step of L
layers has 2L + 1 of them: each layer's attention block (q/k/v, the cache update, attention,
o_proj, the residual add), its MLP block, and the final norm with the LM head. It reports the
median of each block over the layers and steps, and the median duration of each Triton
kernel, so a kernel's time inside the model can be set beside its time alone.

  python benchmarks/step_trace.py ev_4_False.json.gz ev_4_True.json.gz --layers 8 \\
      --out benchmarks/results/model_70b_blocks_h200.json

``--steps N`` (the traced steps) adds each kernel's time and launches a step, so that what a
change adds or removes (say, the scratch zeroing's copies) can be counted.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics

from gpu_lowrank import busy_ns  # the union of the kernel intervals

PROJECTION = ("gemm_fusion_dot", "_xuv", "_mlp")


def base_name(name: str) -> str:
  """A kernel's name without its trailing fusion and layer numbers, or the hash that names
  each specialization of a Triton kernel under XLA's PTX call (launch.xla_kernel)."""
  return re.sub(r"(_[0-9a-f]{12})?([._]\d+)*$", "", name)


def load(path: str) -> list:
  """[(start_ns, end_ns, name)], time-sorted, from a ``--events-out`` file (.json or .gz)."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as fh:
    data = json.load(fh)
  if "events" not in data:
    raise ValueError(f"{path}: no 'events' list (write one with tp_gpu.py --events-out)")
  return sorted(tuple(e) for e in data["events"])


FILL = ("loop_broadcast_fusion", "memcpy", "memset")  # zero fills, such as a scratch's


def block_starts(events: list) -> list:
  """Start times of the norm kernels that open a block: a ``fusion`` kernel whose next
  kernel, zero fills aside, is a projection."""
  work = [e for e in events if not e[2].startswith(FILL)]
  return [
    s
    for (s, _, name), nxt in zip(work, work[1:])
    if base_name(name) == "fusion" and nxt[2].startswith(PROJECTION)
  ]


def kernel_totals(events: list, steps: int) -> dict:
  """Each kernel's time and launches a step (names without their fusion and layer numbers),
  longest first, and the step's busy time and span (µs), over ``steps`` traced steps."""
  by = {}
  for s, e, name in events:
    t, n = by.get(base_name(name), (0, 0))
    by[base_name(name)] = (t + e - s, n + 1)
  busy = busy_ns(events)
  span = max(e for _, e, _ in events) - events[0][0]
  return {
    "busy_us_per_step": busy / 1e3 / steps,
    "span_us_per_step": span / 1e3 / steps,
    "kernels": {
      k: {"us_per_step": round(t / 1e3 / steps, 2), "launches_per_step": n / steps}
      for k, (t, n) in sorted(by.items(), key=lambda kv: -kv[1][0])
    },
  }


def summarize(events: list, layers: int) -> dict:
  """Median attention and MLP block (µs), their sum a layer, the rest of a step (span less
  the layers at their medians); the blocks' means and the final norm + LM head + loop's to
  the next step (these add up to the span); span and busy time a step; each Triton kernel's
  median duration (µs)."""
  starts = block_starts(events)
  per_step = 2 * layers + 1
  if not starts or len(starts) % per_step:
    raise ValueError(
      f"{len(starts)} block starts is not a whole number of steps of "
      f"{layers} layers ({per_step} a step): is --layers right?"
    )
  steps = len(starts) // per_step
  attn, mlp, head = [], [], []
  for st in range(steps):
    s = starts[st * per_step : (st + 1) * per_step]
    for i in range(layers):
      attn.append((s[2 * i + 1] - s[2 * i]) / 1e3)
      mlp.append((s[2 * i + 2] - s[2 * i + 1]) / 1e3)
    if st + 1 < steps:  # the final norm and LM head, to the next step's first block
      head.append((starts[(st + 1) * per_step] - s[-1]) / 1e3)
  span = (max(e for _, e, _ in events) - events[0][0]) / 1e3 / steps
  busy = busy_ns(events)
  kernels = {}
  for s, e, name in events:
    if name.startswith("_"):  # lrjax's Triton kernels
      kernels.setdefault(base_name(name), []).append((e - s) / 1e3)
  layer = statistics.median(attn) + statistics.median(mlp)
  return {
    "steps": steps,
    "layers": layers,
    "attention_block_us": statistics.median(attn),
    "mlp_block_us": statistics.median(mlp),
    "layer_us": layer,
    "rest_of_step_us": span - layers * layer,
    # means: a step's blocks add up to its span, slow outliers included
    "attention_block_mean_us": statistics.fmean(attn),
    "mlp_block_mean_us": statistics.fmean(mlp),
    "head_and_loop_mean_us": statistics.fmean(head) if head else None,
    "span_us_per_step": span,
    "busy_us_per_step": busy / 1e3 / steps,
    "triton_kernels_median_us": {k: statistics.median(v) for k, v in sorted(kernels.items())},
    "triton_launches_per_step": {k: len(v) / steps for k, v in sorted(kernels.items())},
  }


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("traces", nargs="+", help="tp_gpu.py --events-out files")
  ap.add_argument("--layers", type=int, required=True, help="decoder layers in the step")
  ap.add_argument("--out", help="write the summaries as JSON here")
  ap.add_argument("--note", default="", help="what the traces are, for --out")
  ap.add_argument(
    "--steps", type=int, help="traced steps: also report each kernel's time and launches a step"
  )
  args = ap.parse_args()
  out = {}
  for path in args.traces:
    events = load(path)
    rec = summarize(events, args.layers)
    if args.steps:
      rec["totals"] = kernel_totals(events, args.steps)
    out[path.rsplit("/", 1)[-1]] = rec
    print(
      f"{path}: attention block {rec['attention_block_us']:.1f} us, MLP block "
      f"{rec['mlp_block_us']:.1f} us, layer {rec['layer_us']:.1f} us, rest of step "
      f"{rec['rest_of_step_us']:.1f} us, span {rec['span_us_per_step']:.1f} us a step; "
      + ", ".join(f"{k} {v:.1f} us" for k, v in rec["triton_kernels_median_us"].items())
    )
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(
        {"script": "benchmarks/step_trace.py", "note": args.note, "traces": out}, fh, indent=1
      )


if __name__ == "__main__":
  main()
