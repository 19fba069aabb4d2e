"""Shared memory of the kernels' default tiles, checked on the CPU: each kernel is compiled for
the H200 (sm_90, with the 16-byte pointer alignment jax-triton declares;
benchmarks/kernel_resources.py) and Triton's metadata gives the bytes one CTA asks for. More
than the H200's opt-in limit and the kernel does not launch. Three planned shapes asked for
more: the persistent SwiGLU kernel at Llama-3-70B (session 11) and the grouped q/k/v kernel
at 32 rows (session 12), both found only by a GPU run, and the persistent SwiGLU kernel at 64
rows, found by this test. Runs wherever triton is installed, GPU or not."""
import importlib.util
import textwrap

import pytest
from triton_offline import STUB, run_script

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="needs triton (pip install 'lrjax[cuda]') to compile the kernels for the H200")

_CHECK = STUB + textwrap.dedent('''
  n = 0
  for name, kernel, meta, warps, stages in kernel_resources.planned():
    rec = kernel_resources.compile_sm90(kernel, meta, warps, stages, ptxas=n == 0)
    assert rec["shared"] <= kernel_resources.H200_SMEM_OPTIN, (name, rec)
    if n == 0:  # ptxas -v read back (the benchmark's registers and spills)
      assert 0 < rec["registers"] <= 255 and rec["spill_store_bytes"] >= 0, rec
    n += 1
  print(n, "ok")
''')


def test_planned_tiles_fit_a_cta_of_the_h200():
  """Llama-3 8B / 70B and 3.2-1B shapes at 40 % removed, the 70B's and Qwen2.5-7B's q/k/v at
  their models' ranks, and Qwen2.5-7B's SwiGLU, whose stage-B slices outnumber the SMs
  (kernel_resources.planned): the
  grouped q/k/v kernel at 1-64 rows, the persistent X·U·V kernel (with phase 2, or phase 1
  alone from 64 rows) and the tiled and persistent SwiGLU kernels at 1-128 rows, the two
  prefill kernels at 1024 and 4096 tokens; each on its default tiles."""
  out = run_script(_CHECK, interpret=False)
  assert int(out.split()[-2]) == 81, out  # every configuration was compiled


_RESIDENT = STUB + textwrap.dedent('''
  n = 0
  for name, kernel, meta, warps, stages in kernel_resources.planned():
    if name in CASES:
      rec = kernel_resources.compile_sm90(kernel, meta, warps, stages)
      assert rec["ctas_per_sm"] == CASES[name], (name, rec)
      n += 1
  print(n, "ok")
''')


def test_swiglu_decode_runs_two_ctas_a_sm_where_its_slices_outnumber_the_sms():
  """The T <= 16 default's gain where D_ff has 133-264 slices of 128 columns (Qwen2.5-7B's
  148, Llama-3-70B's 224) rests on two CTAs sharing an SM (108 KB of shared memory each), so
  every slice is resident at once; with 112 slices (Llama-3-8B) the default stays at one."""
  cases = {"mlp decode T=1 D=3584 F=18944 r=2048": 2, "mlp decode T=16 D=3584 F=18944 r=2048": 2,
           "mlp decode T=1 D=8192 F=28672 r=3824": 2, "mlp decode T=1 D=4096 F=14336 r=2560": 1}
  out = run_script(f"CASES = {cases!r}\n" + _RESIDENT, interpret=False)
  assert int(out.split()[-2]) == len(cases), out  # every case found in planned() and checked
