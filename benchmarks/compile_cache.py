"""Start-up with and without the on-disk compilation cache (lrjax.compile_cache): the engine's
warm-up (every prefill and decode step compiled and run once, what `lrjax serve` does before it
opens its port) in a fresh process, first with an empty cache directory, then again in a new
process that finds the first one's entries. Random weights (their values are arguments of the
compiled steps, so the programs match across processes); the tokens a short request then
generates are compared between the two processes. A second warm-up in the same process (all
compiled) times the steps' run, so each process's compile time is its warm-up less that.

  python benchmarks/compile_cache.py   # -> benchmarks/results/compile_cache_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

# (label, load_model_for_bench keywords, engine keywords)
CASES = (
  ("llama3.2-1b shapes, ratio 0.4, f32", dict(preset="llama3_2_1b", ratio=0.4), {}),
  (
    "llama3.2-1b shapes, ratio 0.4, W4A8",
    dict(preset="llama3_2_1b", ratio=0.4, quantize="w4a8"),
    {},
  ),
)
ENGINE = dict(max_slots=4, max_len=512)

CHILD = r"""
import json, sys, time
from lrjax import compile_cache
path = compile_cache.enable()
from lrjax.bench import load_model_for_bench
from lrjax.serving import Engine, Request, SamplingParams
model_kw, engine_kw = json.loads(sys.argv[1]), json.loads(sys.argv[2])
model, _ = load_model_for_bench(**model_kw)
t = time.perf_counter()
engine = Engine(model, **engine_kw)
steps = engine.warmup()
warm = time.perf_counter() - t
t = time.perf_counter()
engine.warmup()  # everything compiled: the steps' run time alone
run = time.perf_counter() - t
[res] = engine.generate([Request([1, 2, 3, 4], SamplingParams(max_new_tokens=8))])
print(json.dumps(dict(cache=path, warmup_s=warm, run_s=run, steps=steps, tokens=list(res.tokens))))
"""


def run_child(cache: str, model_kw: dict, engine_kw: dict) -> dict:
  env = {**os.environ, "LRJAX_COMPILE_CACHE": cache}
  out = subprocess.run(
    [sys.executable, "-c", CHILD, json.dumps(model_kw), json.dumps(engine_kw)],
    env=env,
    capture_output=True,
    text=True,
    check=False,
  )
  if out.returncode:
    raise SystemExit(f"child failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def dir_stats(path: str) -> tuple[int, int]:
  files = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
  return len(files), sum(os.path.getsize(f) for f in files)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default=os.path.join(HERE, "results", "compile_cache_cpu.json"))
  args = ap.parse_args(argv)
  sys.path.insert(0, os.path.dirname(HERE))
  from lrjax.bench import machine, versions

  records = []
  for label, model_kw, engine_kw in CASES:
    engine_kw = {**ENGINE, **engine_kw}
    with tempfile.TemporaryDirectory() as cache:
      cold = run_child(cache, model_kw, engine_kw)
      entries, nbytes = dir_stats(cache)
      warm = run_child(cache, model_kw, engine_kw)
    rec = dict(
      case=label,
      model=model_kw,
      engine=engine_kw,
      steps=cold["steps"],
      cold_warmup_s=round(cold["warmup_s"], 2),
      cached_warmup_s=round(warm["warmup_s"], 2),
      speedup=round(cold["warmup_s"] / warm["warmup_s"], 2),
      # the warm-up less a second warm-up in the same process (its steps' run time)
      cold_compile_s=round(cold["warmup_s"] - cold["run_s"], 2),
      cached_compile_s=round(warm["warmup_s"] - warm["run_s"], 2),
      run_s=round(cold["run_s"], 2),
      cache_entries=entries,
      cache_mb=round(nbytes / 1e6, 1),
      same_tokens=cold["tokens"] == warm["tokens"],
    )
    print(json.dumps(rec), flush=True)
    records.append(rec)
  out = dict(
    benchmark="compile_cache",
    command="python benchmarks/compile_cache.py",
    method=(
      "per case: two fresh processes with LRJAX_COMPILE_CACHE set to one new directory; "
      "each times Engine(...) + engine.warmup(), then warmup() again (the steps' run time "
      "alone; *_compile_s = the first less the second), then generates 8 greedy tokens"
    ),
    machine=machine(),
    versions=versions(),
    records=records,
  )
  with open(args.out, "w") as fh:
    json.dump(out, fh, indent=1)
    fh.write("\n")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
