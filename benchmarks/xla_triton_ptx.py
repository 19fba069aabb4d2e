"""One persistent decode X·U·V plan built two ways, compared instruction by instruction (GPU).

Launch mode ``xla`` hands XLA the PTX Triton (the installed one) compiles; ``xla_triton``
hands XLA the kernel's frontend TTIR, which XLA compiles with the Triton bundled in jaxlib.
Session 27 timed plans with phase-1 tiles of 160 of 256 columns 2.3 µs slower the second way
(planner.xla_triton_serves keeps them off it). This builds one such plan both ways (XLA's
Triton forced for it), pulls each build's PTX (the second from ``--xla_dump_to``), assembles
both with Triton's ptxas (registers, spills), counts their memory and tensor-core
instructions, and with ``--time`` times both on the same weights. Extra ``XLA_FLAGS`` (e.g.
``--xla_gpu_enable_pdl=false``) are kept in the run's meta.

  python benchmarks/xla_triton_ptx.py --case 8,8192,2456,8192 --out ptx.json --ptx-dir $OUT --time
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

USER_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")  # recorded with each run (e.g. PDL off)
DUMP = ""  # main's dump folder
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import triton  # noqa: E402

import gpu_lowrank as g  # noqa: E402
import kernel_resources  # noqa: E402
from lrjax.custom_calls.triton import launch, planner, xuv_decode  # noqa: E402

# instruction classes counted in each build (a PTX opcode's leading fields)
CLASSES = (
  "ld.global",
  "st.global",
  "cp.async",
  "ld.shared",
  "st.shared",
  "ldmatrix",
  "mma",
  "wgmma",
  "atom",
  "red",
  "bar",
  "mbarrier",
  "prefetch",
  "setp",
  "selp",
  "bra",
)


def entries(ptx: str) -> dict[str, str]:
  """{entry name: its text} of one PTX module."""
  out = {}
  for m in re.finditer(r"\.entry\s+(\w+)\s*\(", ptx):
    end = ptx.find("\n}\n", m.end())
    out[m.group(1)] = ptx[m.start() : end + 3 if end >= 0 else len(ptx)]
  return out


def histogram(body: str) -> dict[str, int]:
  """Count of each opcode (with its modifiers) and of each class in CLASSES."""
  ops = collections.Counter()
  for line in body.splitlines():
    t = line.strip()
    if not t or t.startswith(("//", ".", "$", "{", "}", ")")) or t.endswith(":"):
      continue
    if t.startswith("@"):  # predicated
      t = t.split(None, 1)[1] if " " in t else ""
    op = t.split(None, 1)[0].rstrip(";") if t else ""
    if op:
      ops[op] += 1
  classes = {
    c: sum(n for op, n in ops.items() if op == c or op.startswith(c + ".")) for c in CLASSES
  }
  return dict(classes=classes, opcodes=dict(ops.most_common()))


def _dumped() -> set[str]:
  """Every file under the dump folder (XLA writes some into a folder per module)."""
  return {f for f in glob.glob(os.path.join(DUMP, "**", "*"), recursive=True) if os.path.isfile(f)}


def _ptxas(b: dict) -> dict:
  """kernel_resources.ptxas_info of one build's entry. Triton's ptxas may not know the PTX ISA
  of XLA's build (9.0 from jaxlib 0.11.2's CUDA 13 against 8.7): then the module is assembled
  again with its ``.version`` lowered to the one ptxas names, and ``assembled_as`` says so."""
  try:
    return kernel_resources.ptxas_info(b["ptx"], b["shared"], b["warps"], b["entry"])
  except ValueError as e:  # no such entry in the module
    return dict(error=str(e))
  except subprocess.CalledProcessError as e:
    known = re.search(r"current version is '([\d.]+)'", e.stderr or "")
    if not known:
      return dict(error=(e.stderr or str(e))[-2000:])
    ptx = re.sub(r"\.version\s+\S+", f".version {known.group(1)}", b["ptx"], count=1)
    try:
      info = kernel_resources.ptxas_info(ptx, b["shared"], b["warps"], b["entry"])
    except (subprocess.CalledProcessError, ValueError) as e2:
      return dict(error=(getattr(e2, "stderr", None) or str(e2))[-2000:])
    return dict(info, assembled_as=f"PTX ISA {known.group(1)} (Triton's ptxas)")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument(
    "--case",
    default="8,8192,2456,8192",
    help="M,K,r,N[:field=value,...] (a planner.PersistentDecodePlan's fields)",
  )
  ap.add_argument("--out", required=True, help="results JSON: each call appends one run")
  ap.add_argument("--ptx-dir", help="also write each build's kernel PTX here")
  ap.add_argument("--time", action="store_true", help="time both builds on the same weights")
  args = ap.parse_args(argv)
  global DUMP
  DUMP = tempfile.mkdtemp(prefix="xla_dump_")  # read when the backend starts (below)
  os.environ["XLA_FLAGS"] = (
    USER_XLA_FLAGS
    + f" --xla_dump_to={DUMP}"
    + " --xla_gpu_dump_llvmir=true --xla_dump_emitter_re=.*"
  ).strip()
  dims, _, fields = args.case.partition(":")
  m, k, r, n = (int(t) for t in dims.split(","))
  plan = xuv_decode.plan_persistent(m, k, r, n, "kernel", None)
  if fields:
    import dataclasses

    plan = dataclasses.replace(
      plan, **{f: int(v) for f, v in (t.split("=") for t in fields.split(","))}
    )
  name = xuv_decode._xuv_decode_persistent_kernel.__name__
  planner.xla_triton_serves = lambda kernel, meta: kernel == name  # force it for this plan
  fn = lambda x, u, v: xuv_decode.xuv_decode(x, u, v, persistent=plan, pv="kernel")  # noqa
  x, layers, _ = g.xuv_inputs(m, k, r, n)
  u, v = layers[0]
  ours_key = "triton_" + triton.__version__
  modes = {ours_key: "xla", "xla_bundled_triton": "xla_triton"}  # each build's launch mode
  os.environ["LRJAX_TRITON_LAUNCH"] = modes[ours_key]
  jax.jit(fn).lower(x, u, v).compile()
  ours = [kk for kk in launch._xla_kernels.values() if isinstance(kk, launch.XlaKernel)]
  if len(ours) != 1:
    raise SystemExit(f"expected one kernel built for XLA's PTX call, found {len(ours)}")
  before = _dumped()
  os.environ["LRJAX_TRITON_LAUNCH"] = modes["xla_bundled_triton"]
  jax.jit(lambda x, u, v: fn(x, u, v) + 0).lower(x, u, v).compile()  # a new module to dump
  found = {}
  for path in sorted(_dumped() - before):
    with open(path, errors="replace") as fh:
      text = fh.read()
    if ".version" in text and ".entry" in text:  # a PTX module
      for e, body in entries(text).items():
        found[e] = (path, body)
  theirs = {e: v for e, v in found.items() if "xuv" in e or "triton" in e.lower()}
  if len(theirs) != 1:
    files = sorted(os.path.relpath(f, DUMP) for f in _dumped() - before)
    raise SystemExit(
      f"expected one XLA-built kernel entry in the dump, found {sorted(found)} "
      f"in {len(files)} files: {files[-40:]}"
    )
  ((xla_entry, (xla_path, xla_body)),) = theirs.items()
  with open(xla_path) as fh:
    xla_module = fh.read()
  # ctas_per_sm from our build's shared memory for both (XLA's is set inside its compile)
  common = dict(shared=ours[0].shared, warps=plan.warps)
  builds = {
    ours_key: dict(
      entry=ours[0].name, ptx=ours[0].ptx, body=entries(ours[0].ptx)[ours[0].name], **common
    ),
    "xla_bundled_triton": dict(entry=xla_entry, ptx=xla_module, body=xla_body, **common),
  }
  out = dict(
    meta=dict(
      machine=jax.devices()[0].device_kind,
      jax=jax.__version__,
      triton=triton.__version__,
      date=datetime.date.today().isoformat(),
      case=args.case,
      plan=str(plan),
      xla_flags=USER_XLA_FLAGS,
    ),
    builds={},
  )
  for key, b in builds.items():
    head = re.search(r"\.version\s+(\S+)", b["ptx"])
    out["builds"][key] = dict(
      entry=b["entry"],
      ptx_version=head.group(1) if head else None,
      lines=b["body"].count("\n"),
      ptxas=_ptxas(b),
      **histogram(b["body"]),
    )
    if args.ptx_dir:
      with open(os.path.join(args.ptx_dir, key + ".ptx"), "w") as fh:
        fh.write(b["body"])
  if args.time:
    for key, mode in modes.items():
      os.environ["LRJAX_TRITON_LAUNCH"] = mode
      call = lambda x, u, v: fn(x, u, v)  # noqa: E731 (a fresh function: traced again)
      out["builds"][key]["us"] = g.per_call_us(call, x, layers)[0]
  runs = []
  if os.path.exists(args.out):
    with open(args.out) as fh:
      runs = json.load(fh)["runs"]
  g.write_json(args.out, dict(runs=runs + [out]))
  for key, b in out["builds"].items():
    print(key, b["entry"], b["ptx_version"], b["lines"], "lines", b["ptxas"], b.get("us"))
    print("   ", b["classes"])


if __name__ == "__main__":
  main()
