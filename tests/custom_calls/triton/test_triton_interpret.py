"""Kernel logic on the CPU, in Triton's interpreter (``TRITON_INTERPRET=1``): runs wherever
triton is installed, GPU or not, and skips elsewhere (CI) saying why. Without jax-triton the
kernel module imports against a stub of it (nothing here launches through jax-triton).

The interpreter runs programs one after another, so only kernels without inter-CTA waits can
run in it: here the decode X·U·V kernel's phase 1 alone (``PV=False``, what ``pv="xla"``
launches) on ``planner.plan_decode_phase1``'s tiles. It stands in for torch tensors with
numpy arrays, and uses float16: the interpreter multiplies bfloat16 as its uint16 storage."""
import importlib.util
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="needs triton (pip install 'lrjax[cuda]'); its interpreter runs on the CPU")

_SCRIPT = textwrap.dedent('''
  import importlib.util
  import sys
  import types

  import numpy as np
  from triton.runtime import interpreter

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

  _patch = interpreter._patch_lang_tensor

  def _patch_index(tensor, scope):  # numpy >= 2 refuses int() of a 1-element array
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))
  interpreter._patch_lang_tensor = _patch_index

  class Storage:
    def __init__(self, arr): self.arr = arr
    def data_ptr(self): return self.arr.ctypes.data
    def cpu(self): return self
    def copy_(self, other): pass

  class Dtype:
    def __init__(self, name): self.name = name
    def __str__(self): return "torch." + self.name

  class T:  # the torch.Tensor methods the interpreter calls, on a numpy array in place
    def __init__(self, arr): self.set_(Storage(arr))
    def set_(self, storage, *_):
      self.arr, self.shape = storage.arr, storage.arr.shape
      self.dtype = Dtype(self.arr.dtype.name)
      return self
    def data_ptr(self): return self.arr.ctypes.data
    def untyped_storage(self): return Storage(self.arr)
    def storage_offset(self): return 0
    def size(self): return self.arr.shape
    def stride(self, *_): return tuple(s // self.arr.itemsize for s in self.arr.strides)
    def new_empty(self, *_, **__): return T(np.empty(0, self.arr.dtype))
    def copy_(self, other): pass

  from lrjax.custom_calls.triton import planner, xuv_decode
  rng = np.random.default_rng(0)
  for (m, k, r, n, programs) in SHAPES:
    p = planner.plan_decode_phase1(m, k, r, n, programs=programs)
    plan = xuv_decode.persistent_launch_plan(m, k, r, n, False, p, pv=False)
    x = rng.standard_normal((m, k)).astype(np.float16)
    u = (rng.standard_normal((k, r)) * k ** -0.5).astype(np.float16)
    v = np.zeros((r, n), np.float16)  # never read: no phase 2
    scratch = np.zeros(plan["scratch"], np.float32)
    p16 = np.full(plan["p16"], np.nan, np.float16)  # poisoned: every element must be written
    xuv_decode._xuv_decode_persistent_kernel[(plan["grid"],)](
        T(x), T(u), T(v), T(v), T(x), m, T(scratch), T(np.zeros(1, np.float16)), T(p16),
        **plan["meta"])
    got = p16.reshape(m, r).astype(np.float64)
    ref = x.astype(np.float64) @ u.astype(np.float64)
    assert not np.isnan(got).any(), (m, k, r, "unwritten elements of P")
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 2e-3, (m, k, r, err)  # f16 split-K sums, rounded once
    print(m, k, r, plan["grid"], p.cols_r, p.k_per, plan["meta"]["SPLIT_K"], f"{err:.1e}")
  print("ok")
''')


@pytest.mark.parametrize("shapes", [
    # (M, K, r, N, CTAs): 64-column tiles over several K ranges; ragged K and r; 128-column
    # tiles (r > 1024); a grid smaller than the tiles (each CTA loops)
    [(64, 384, 136, 200, 132), (100, 320, 256, 384, 132), (128, 1000, 200, 96, 16),
     (64, 640, 1100, 64, 132), (77, 200, 72, 130, 7)],
])
def test_decode_phase1_alone_on_its_planned_tiles(shapes):
  """P = X·U from the phase-1-only decode kernel equals the f64 product rounded once."""
  import os
  env = dict(os.environ, TRITON_INTERPRET="1")
  res = subprocess.run([sys.executable, "-c", f"SHAPES = {shapes!r}\n" + _SCRIPT], env=env,
                       capture_output=True, text=True, timeout=1200)
  assert res.returncode == 0 and res.stdout.rstrip().endswith("ok"), res.stdout + res.stderr
