"""For the CPU tests that use lrjax's Triton kernels without a GPU (in Triton's interpreter,
or compiled for the H200 to read what they ask of it): each runs as a script in a fresh
Python, whose ``STUB`` prelude makes the kernel modules importable without jax-triton
(custom_calls/triton/kernel_resources.py's stub; nothing there launches through it)."""

import os
import subprocess
import sys
import textwrap

HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "custom_calls", "triton")
STUB = textwrap.dedent(f"""
  import sys
  sys.path.insert(0, {HELPERS!r})
  import kernel_resources
  kernel_resources.install_jax_triton_stub()
""")


def run_script(script: str, interpret: bool) -> str:
  """Runs ``script`` (it must print "ok" last) with or without TRITON_INTERPRET; its output."""
  env = dict(os.environ)
  env.pop("TRITON_INTERPRET", None)
  env["LRJAX_TRITON_POLICY"] = "NVIDIA H200"  # the table the scripts' expectations are for
  if interpret:
    env["TRITON_INTERPRET"] = "1"
  res = subprocess.run(
    [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=1200
  )
  assert res.returncode == 0 and res.stdout.rstrip().endswith("ok"), res.stdout + res.stderr
  return res.stdout
