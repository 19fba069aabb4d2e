"""For the CPU tests that use lrjax's Triton kernels without a GPU (in Triton's interpreter,
or compiled for the H200 to read what they ask of it): each runs as a script in a fresh
Python, with jax-triton stubbed where it is not installed (nothing there launches through
it; the kernel modules only import it)."""
import os
import subprocess
import sys
import textwrap

STUB = textwrap.dedent('''
  import importlib.util
  import sys
  import types

  if importlib.util.find_spec("jax_triton") is None:  # the kernel module's import, stubbed
    from jax.extend.core import Primitive

    def _absent(*_, **__):
      raise NotImplementedError("jax-triton stub")
    stub = types.ModuleType("jax_triton")
    stub.triton_call = _absent
    stub.triton_lib = types.SimpleNamespace(
        triton_kernel_call_p=Primitive("stub_triton_kernel_call"),
        triton_kernel_call_lowering=_absent, get_cuda_backend=_absent)
    sys.modules["jax_triton"] = stub
''')


def run_script(script: str, interpret: bool) -> str:
  """Runs ``script`` (it must print "ok" last) with or without TRITON_INTERPRET; its output."""
  env = dict(os.environ)
  env.pop("TRITON_INTERPRET", None)
  if interpret:
    env["TRITON_INTERPRET"] = "1"
  res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                       text=True, timeout=1200)
  assert res.returncode == 0 and res.stdout.rstrip().endswith("ok"), res.stdout + res.stderr
  return res.stdout
