"""Wall time of ``import lrjax`` in a fresh interpreter, and of the first use of its API.

  python benchmarks/import_time.py [--runs 11] [--python LABEL=INTERPRETER ...]

Each run starts a new interpreter (``-P``, working directory a temporary folder) and times,
with ``time.perf_counter`` inside it: ``import lrjax``; then ``lrjax.fuse`` (which imports
jax and the lowering package); then one jitted, fused CPU call. It also records which heavy
modules the bare import loaded. With several ``--python`` (e.g. another checkout's venv),
their runs alternate, so that all see the same machine load. The medians per label go to
benchmarks/results/import_time.json (labels not measured again are kept), with the machine.
The page cache is warm after the first run: these are fresh-process, not cold-disk, times.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

from results_io import write_json

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results", "import_time.json")

_PROBE = """if True:
  import json, sys, time
  t0 = time.perf_counter()
  import lrjax
  t1 = time.perf_counter()
  heavy = sorted(m for m in ("jax", "flax", "numpy", "lrjax.lowering", "lrjax.custom_calls")
                 if m in sys.modules)
  fuse = lrjax.fuse
  t2 = time.perf_counter()
  import jax, jax.numpy as jnp
  u, v = jnp.ones((64, 8)), jnp.ones((8, 32))
  jax.jit(fuse(lambda x: (x @ u) @ v))(jnp.ones((4, 64))).block_until_ready()
  t3 = time.perf_counter()
  print(json.dumps({"import_lrjax_s": t1 - t0, "then_lrjax_fuse_s": t2 - t1,
                    "then_first_fused_call_s": t3 - t2, "loaded_by_import": heavy,
                    "version": lrjax.__version__, "file": lrjax.__file__}))
"""


def run_once(python: str) -> dict:
  with tempfile.TemporaryDirectory() as cwd:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run(
      [python, "-P", "-c", _PROBE], cwd=cwd, env=env, capture_output=True, text=True, check=True
    )
  return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--runs", type=int, default=11)
  ap.add_argument(
    "--python",
    action="append",
    metavar="LABEL=INTERPRETER",
    help="an interpreter with lrjax installed, and the key of its results (repeatable; "
    "default: this one, as 'this')",
  )
  ap.add_argument("--out", default=OUT)
  args = ap.parse_args()
  if args.runs < 1:
    ap.error(f"--runs={args.runs}: expected at least 1")
  pythons = {}
  for item in args.python or [f"this={sys.executable}"]:
    label, sep, python = item.partition("=")
    if not sep or not label or not python:
      ap.error(f"--python {item!r}: expected LABEL=INTERPRETER")
    pythons[label] = python
  runs = {label: [] for label in pythons}
  for _ in range(args.runs):
    for label, python in pythons.items():
      runs[label].append(run_once(python))
  data = {"benchmark": "import_time", "command": "python benchmarks/import_time.py --python L=PY"}
  if os.path.exists(args.out):
    with open(args.out) as f:
      data = json.load(f)
  for label, python in pythons.items():
    data.setdefault("results", {})[label] = summarize(runs[label], python)
    keys = ("import_lrjax_s", "then_lrjax_fuse_s", "then_first_fused_call_s")
    print(label, {k: round(data["results"][label][k], 4) for k in keys})
  write_json(args.out, data)


def summarize(runs: list[dict], python: str) -> dict:
  """Medians and samples of one interpreter's runs, with where its lrjax came from."""
  keys = ("import_lrjax_s", "then_lrjax_fuse_s", "then_first_fused_call_s")
  result = {k: statistics.median(r[k] for r in runs) for k in keys}
  src = os.path.dirname(os.path.dirname(runs[-1]["file"]))
  commit = subprocess.run(
    ["git", "-C", src, "rev-parse", "HEAD"], capture_output=True, text=True
  ).stdout.strip()
  result.update(
    runs=len(runs),
    lrjax_source=src,
    lrjax_commit=commit or None,
    samples={k: [round(r[k], 4) for r in runs] for k in keys},
    loaded_by_import=runs[-1]["loaded_by_import"],
    lrjax_version=runs[-1]["version"],
    python=python,
    date=datetime.datetime.now(datetime.UTC).isoformat(),
    machine=dict(platform=platform.platform(), cpus=os.cpu_count()),
    load_average=os.getloadavg(),
  )
  return result


if __name__ == "__main__":
  main()
