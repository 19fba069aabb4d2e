"""CPU deployment numbers: decode tokens/s of a Llama-3.2-1B-shaped model through ``lrjax bench``.

Four variants, random weights, batch 1 and 8, each in its own ``lrjax bench`` process:
dense f32, dense bf16, low-rank f32 at ``--ratio`` (ranks as ``lrjax convert --ratio`` gives
them) and the same low-rank model quantized to W4A8 at load (``--quantize w4a8``, group
``--group``; the tied LM head quantized too). Each variant's decode rate is set against this
machine's DRAM read bandwidth, measured in the same run (``cpu_dram_bandwidth.measure``): the
fraction = (weight bytes a decode step reads x decode steps/s) / DRAM read GB/s.
Target: low-rank W4A8 decodes >= 4x faster than dense f32 at batch 1.

Usage: python benchmarks/cpu_serving.py [--gen-len 16] [--reps 3]
On a shared machine run it in its own session with a raised autogroup priority:
  setsid sh -c 'echo -10 > /proc/self/autogroup; exec nice -n -10 \
    python benchmarks/cpu_serving.py'
Writes benchmarks/results/cpu_serving.json (and each variant's bench JSON beside it under
benchmarks/results/cpu_serving/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import jax

import lrjax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cpu_dram_bandwidth import measure  # noqa: E402
from results_io import write_json  # noqa: E402

VARIANTS = {
  "dense_f32": [],
  "dense_bf16": ["--dtype", "bfloat16"],
  "lowrank_f32": ["--ratio", "{ratio}"],
  "lowrank_w4a8": ["--ratio", "{ratio}", "--quantize", "w4a8", "--group", "{group}"],
}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--preset", default="llama3_2_1b")
  ap.add_argument("--ratio", type=float, default=0.4)
  ap.add_argument("--group", type=int, default=128)
  ap.add_argument("--prompt-len", type=int, default=32)
  ap.add_argument("--gen-len", type=int, default=16)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--variants", default=",".join(VARIANTS))
  ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu_serving.json"))
  a = ap.parse_args()
  t_start = time.perf_counter()
  load0 = os.getloadavg()
  dram_rows = measure(1.0, 5)
  dram = max(r["best_gbs"] for r in dram_rows if r["kind"] == "read")
  print(f"DRAM read {dram:.1f} GB/s")
  parts = os.path.join(os.path.dirname(a.out), "cpu_serving")
  os.makedirs(parts, exist_ok=True)
  out_rows, machine = {}, None
  for name in a.variants.split(","):
    extra = [x.format(ratio=a.ratio, group=a.group) for x in VARIANTS[name]]
    path = os.path.join(parts, f"{name}.json")
    cmd = [
      "lrjax",
      "bench",
      "--preset",
      a.preset,
      *extra,
      "--concurrency",
      "1,8",
      "--prompt-len",
      str(a.prompt_len),
      "--gen-len",
      str(a.gen_len),
      "--reps",
      str(a.reps),
      "--out",
      path,
      "--overwrite",  # the earlier run's result for this variant
      "--no-plot",
    ]
    t = time.perf_counter()
    exe = os.path.join(os.path.dirname(sys.executable), "lrjax")
    subprocess.run([exe, *cmd[1:]], check=True)
    secs = time.perf_counter() - t
    with open(path) as fh:
      res = json.load(fh)
    machine = res["machine"]
    levels = {}
    for lv in res["levels"]:
      levels[f"batch_{lv['concurrency']}"] = dict(
        decode_tps=lv["decode_tps"],
        itl_ms_median=lv["itl_ms_median"],
        itl_ms_p90=lv["itl_ms_p90"],
        ttft_ms_median=lv["ttft_ms_median"],
        prefill_tps=lv["prefill_tps"],
        decode_weight_gbs=lv["decode_weight_gbs"],
        frac_dram_bw=lv["decode_weight_gbs"] / dram,
      )
    out_rows[name] = dict(
      command=" ".join(cmd),
      wall_s=secs,
      decode_weight_bytes=res["model"]["decode_weight_bytes"],
      param_bytes=res["model"]["param_bytes"],
      ranks_layer0=res["model"]["ranks_layer0"],
      quantized=res["model"].get("quantized"),
      decode_kernels=res["model"]["decode_kernels"],
      **levels,
      bench_json=os.path.relpath(path, os.path.dirname(a.out)),
    )
    print(
      f"{name:13s} "
      + "  ".join(
        f"{b}: {v['decode_tps']:.1f} tok/s ({100 * v['frac_dram_bw']:.0f}% DRAM)"
        for b, v in levels.items()
      )
      + f"  [{secs:.0f} s]"
    )
  target = None
  if "dense_f32" in out_rows and "lowrank_w4a8" in out_rows:
    x = (
      out_rows["lowrank_w4a8"]["batch_1"]["decode_tps"]
      / out_rows["dense_f32"]["batch_1"]["decode_tps"]
    )
    target = dict(
      goal="low-rank W4A8 (ratio 0.4) decodes >= 4x faster than dense f32 at batch 1",
      speedup_batch_1=x,
      met=x >= 4.0,
    )
    print(f"low-rank W4A8 vs dense f32 at batch 1: {x:.2f}x (target 4x)")
  write_json(
    a.out,
    dict(
      benchmark="cpu_serving",
      command=" ".join([os.path.basename(sys.executable)] + sys.argv),
      date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
      model=f"{a.preset}, random weights",
      settings=dict(
        ratio=a.ratio,
        group=a.group,
        prompt_len=a.prompt_len,
        gen_len=a.gen_len,
        reps=a.reps,
        concurrency=[1, 8],
      ),
      machine=machine,
      versions={"jax": jax.__version__, "lrjax": lrjax.__version__},
      load_average=dict(start=load0, end=os.getloadavg()),
      niceness=os.nice(0),
      dram=dict(read_gbs=dram, rows=dram_rows, method="cpu_dram_bandwidth.measure(1 GiB, 5)"),
      frac_dram_bw_definition="decode_weight_bytes x decode steps/s / dram.read_gbs "
      "(decode_weight_bytes: every weight a step reads; the embedding table only when the "
      "head is tied to it)",
      variants=out_rows,
      target=target,
      wall_s=time.perf_counter() - t_start,
    ),
  )
  print("wrote", a.out)


if __name__ == "__main__":
  main()
