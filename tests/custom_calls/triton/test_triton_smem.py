"""Shared memory of the kernels' planned tiles, checked on the CPU: each kernel is
compiled for the H200 (sm_90, with the 16-byte pointer alignment jax-triton declares) and
Triton's metadata gives the bytes one CTA asks for. More than the H200's opt-in limit and the
kernel does not launch. Three planned shapes asked for more: the persistent SwiGLU kernel at
Llama-3-70B (session 11) and the grouped q/k/v kernel at 32 rows (session 12), both found
only by a GPU run, and the persistent SwiGLU kernel at 64 rows, found by this test. Runs
wherever triton is installed, GPU or not."""
import importlib.util
import textwrap

import pytest
from triton_offline import STUB, run_script

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="needs triton (pip install 'lrjax[cuda]') to compile the kernels for the H200")

H200_SMEM_OPTIN = 232448  # bytes a CTA may ask for (cudaDevAttrMaxSharedMemoryPerBlockOptin)

_COMPILE = STUB + textwrap.dedent('''
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource

  from lrjax.custom_calls.triton import (mlp_decode, mlp_prefill, planner, xuv_decode,
                                         xuv_prefill)

  def pointer(name):  # the element type of a kernel's pointer argument
    if name.startswith(("scratch", "s_in", "sacc")):
      return "*fp32"
    return "*i32" if name.startswith(("sched", "flag")) else "*bf16"

  def shared(kernel, meta, warps, stages):
    """Bytes of shared memory ``kernel`` asks for with these constexprs, on sm_90."""
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
      if p.is_constexpr:
        consts[p.name] = meta.get(p.name, p.default)
        sig[p.name] = "constexpr"
      elif p.name == "M":
        sig[p.name] = "i32"
      else:
        sig[p.name] = pointer(p.name)
        attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    opts = dict(num_warps=warps, num_stages=stages)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).metadata.shared

  def check(what, kernel, meta, warps, stages):
    b = shared(kernel, meta, warps, stages)
    print(what, b)
    assert b <= LIMIT, (what, b, LIMIT)

  for m, k, members in GROUPS:
    p = planner.plan_decode_group(m, k, members)
    meta = xuv_decode.group_launch_plan(m, k, [(r, n, False) for r, n in members], p)["meta"]
    check(("group", m, k), xuv_decode._xuv_group_kernel, meta, p.warps, p.stages)
  for m, k, r, n in XUV:
    pv = m < xuv_decode.PV_XLA_MIN_M
    p = (planner.plan_decode_persistent if pv else planner.plan_decode_phase1)(m, k, r, n)
    meta = xuv_decode.persistent_launch_plan(m, k, r, n, False, p, pv=pv)["meta"]
    check(("xuv", m, k, r, n), xuv_decode._xuv_decode_persistent_kernel, meta, p.warps,
          p.stages)
  for m, d, f, r in MLP:
    kw = dict(gated=True, act="silu", bias_mask=(False,) * 3)
    bs = mlp_decode.BlockSizes.get_default(m, d, f, r, d)
    meta = mlp_decode.launch_plan(m, d, r, f, r, d, bs=bs, **kw)["meta"]
    check(("mlp", m, d, f, r), mlp_decode._mlp_decode_kernel, meta, bs.num_warps,
          bs.num_stages)
    if m <= mlp_decode.PERSISTENT_MAX_M:
      p = planner.plan_mlp_decode_persistent(m, d, f, r, r, d)
      meta = mlp_decode.persistent_launch_plan(m, d, r, f, r, d, p=p, **kw)["meta"]
      check(("mlp persistent", m, d, f, r), mlp_decode._mlp_decode_persistent_kernel, meta,
            p.warps, p.stages)
  for m, k, r, n in XUV_PREFILL:
    bs = xuv_prefill.BlockSizes.get_default(m, k, r, n)
    meta = xuv_prefill.launch_plan(m, k, r, n, False, bs)["meta"]
    check(("xuv prefill", m, k, r, n), xuv_prefill._xuv_prefill_kernel, meta, bs.num_warps,
          bs.num_stages)
  for m, d, f, r in MLP_PREFILL:
    bs = mlp_prefill.BlockSizes.get_default(m, d, f, r, r, True)
    meta = mlp_prefill.launch_plan(m, d, r, f, r, d, gated=True, act="silu",
                                   bias_mask=(False,) * 3, bs=bs)["meta"]
    check(("mlp prefill", m, d, f, r), mlp_prefill._mlp_prefill_kernel, meta, bs.num_warps,
          bs.num_stages)
  print("ok")
''')


def test_planned_tiles_fit_a_cta_of_the_h200():
  """Llama-3 8B / 70B and 3.2-1B shapes at 40 % removed, 1-128 rows: the grouped q/k/v
  kernel, the persistent X·U·V kernel (with phase 2, or phase 1 alone from 64 rows), and the
  tiled and persistent SwiGLU kernels; 1024 and 4096 tokens: the two prefill kernels (the
  sweep's shapes). Each on its default tiles."""
  groups = [(m, k, mem) for m in (1, 16, 32, 64) for k, mem in (
      (8192, [(2456, 8192), (544, 1024), (544, 1024)]),
      (4096, [(1216, 4096), (512, 1024), (512, 1024)]),
      (2048, [(640, 2048), (256, 512), (256, 512)]))]
  xuv = [(m, k, r, n) for m in (1, 16, 32, 64, 128) for k, r, n in (
      (8192, 4096, 16384), (4096, 1024, 14336), (8192, 2456, 8192))]
  mlp = [(m, d, f, r) for m in (1, 16, 32, 64, 128) for d, f, r in (
      (4096, 14336, 2560), (8192, 28672, 3824), (2048, 8192, 1280))]
  xuv_prefill = [(m, k, r, n) for m in (1024, 4096)
                 for k, r, n in ((8192, 4096, 16384), (7168, 4096, 18432))]
  mlp_prefill = [(m, d, f, r) for m in (1024, 4096)
                 for d, f, r in ((4096, 14336, 2560), (2048, 8192, 1280), (4096, 14336, 1024))]
  out = run_script(f"LIMIT = {H200_SMEM_OPTIN}\nGROUPS = {groups!r}\nXUV = {xuv!r}\n"
                   f"MLP = {mlp!r}\nXUV_PREFILL = {xuv_prefill!r}\n"
                   f"MLP_PREFILL = {mlp_prefill!r}\n" + _COMPILE, interpret=False)
  checked = len(groups) + len(xuv) + 2 * len(mlp) - 3 + len(xuv_prefill) + len(mlp_prefill)
  assert out.count("\n") == checked + 1, out  # no persistent SwiGLU at 128 rows; "ok"
