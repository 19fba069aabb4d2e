"""lrjax's Triton launcher (custom_calls/triton/pdl_launch.cc, launch.py) without a GPU: the
parameter list handed to the kernel against the PTX entry Triton compiles, the library's
driver check, and the errors for a bad mode or a missing library. Each runs as a script in a
fresh Python (launch.py imports jax-triton; the stub stands in where it is absent)."""

import importlib.util
import textwrap

import pytest
from triton_offline import STUB, run_script

pytestmark = pytest.mark.skipif(
  importlib.util.find_spec("triton") is None,
  reason="needs triton (pip install 'lrjax[cuda]'): launch.py compiles through it",
)

_RAISES = STUB + textwrap.dedent("""
  def raises(exc, fn, *words):  # fn() raises exc, its message naming every word
    try:
      fn()
    except exc as e:
      assert all(w in str(e) for w in words), e
    else:
      raise AssertionError(f"{fn} did not raise {exc.__name__}")
""")


def test_kernel_params_follow_jax_tritons_argument_order():
  """Operands, each scalar at its index (one equal to 1 dropped: Triton specializes it),
  then the results (a zeroed one with its bytes), then Triton's two scratch pointers."""
  out = run_script(
    _RAISES
    + textwrap.dedent("""
    import struct
    import jax.numpy as jnp
    import numpy as np
    from jax.core import ShapedArray
    from lrjax.custom_calls.triton import launch
    ins = [ShapedArray((4,), np.float32), ShapedArray((2, 3), jnp.bfloat16)]
    outs = [ShapedArray((8,), np.float32), ShapedArray((2,), jnp.bfloat16)]
    got = launch.kernel_params(ins, outs, [(2, "i32", 7), (3, "i32", 1), (4, "fp32", 0.5)], (0,))
    half = struct.unpack("<I", struct.pack("<f", 0.5))[0]
    assert got == [0, 0, 0,  0, 1, 0,  1, 7, 0,  4, half, 0,  0, 2, 32,  0, 3, 0,
                   3, 0, 0,  3, 0, 0], got
    raises(ValueError, lambda: launch.kernel_params(ins, outs, [(2, "fp64", 0.5)], ()),
           "fp64", "i32")
    # Triton's global scratch: the buffer after the results, its address rounded up to 128
    got = launch.kernel_params(ins, outs, [], (), scratch_align=128)
    assert got[-6:] == [5, 4, 128,  3, 0, 0], got
    print("ok")
  """),
    interpret=False,
  )
  assert out.rstrip().endswith("ok")


def test_the_launch_passes_as_many_parameters_as_the_ptx_entry_takes():
  """Each kernel that takes PDL, compiled for the H200 with it set, as jax-triton compiles it
  (M and the chain's two scalars runtime i32, every other argument a pointer): its PTX waits
  on the grid dependency, and the PTX entry's parameter count is what kernel_params hands
  cuLaunchKernelEx."""
  out = run_script(
    STUB
    + textwrap.dedent("""
    import numpy as np
    from jax.core import ShapedArray
    from lrjax.custom_calls.triton import launch
    n, seen = 0, set()
    for name, kernel, meta, warps, stages in kernel_resources.planned():
      if "PDL" not in [p.name for p in kernel.params] or kernel in seen:
        continue  # one planned configuration of each kernel that takes PDL
      seen.add(kernel)
      ins, scalars = [], []  # the arguments jax-triton passes: runtime i32s, else buffers
      for i, p in enumerate(kernel.params):
        if p.is_constexpr:
          continue
        if p.name in ("M", "clear_off", "clear_n"):
          scalars.append((i, "i32", 5))
        else:
          ins.append(ShapedArray((4,), np.float32))
      c = kernel_resources.compile_for_sm90(kernel, dict(meta, PDL=1), warps, stages)
      assert "griddepcontrol.wait" in c.asm["ptx"], name
      triples = launch.kernel_params(ins, [], scalars, ())
      assert launch.ptx_param_count(c.asm["ptx"], c.metadata.name) == len(triples) // 3, name
      n += 1
    assert n >= 4, n  # the tiled and persistent X·U·V and SwiGLU kernels, the group
    print(n, "ok")
  """),
    interpret=False,
  )
  assert int(out.split()[-2]) >= 4, out


def test_kernels_for_xlas_ptx_call_take_their_buffers_alone():
  """LRJAX_TRITON_LAUNCH=xla: each chained kernel (and the ·V launch, its READ_OFF in place
  of WORK_OFF) compiled with its scalars as constants (M and the chain's two) has a PTX entry
  that takes the buffers alone, operands then results, as XLA's PTX call passes them
  (Triton's two unused scratch pointers dropped); it waits on the grid dependency; its entry
  name is unique to the specialization (two halves of one chain are two kernels in one
  module) and stable for the same one. A kernel that builds TMA
  descriptors on the device needs Triton's global scratch, which XLA cannot pass: None."""
  out = run_script(
    STUB
    + textwrap.dedent("""
    import re
    import tma_gemm
    from lrjax.custom_calls.triton import launch
    n, seen = 0, set()
    for name, kernel, meta, warps, stages in kernel_resources.planned():
      names = [p.name for p in kernel.params]
      if "PDL" not in names or kernel in seen or not {"WORK_OFF", "READ_OFF"} & set(names):
        continue  # (the attention's launches take PDL but no scratch offset)
      seen.add(kernel)
      types, scalars = kernel_resources.xla_args(kernel, 3)
      at = kernel_resources.offset_constexpr(kernel)
      compile = lambda off: launch.xla_kernel(kernel, types, scalars,
                                              dict(meta, PDL=1, **{at: off}), warps, stages, 90)
      a, b, again = compile(0), compile(4096), compile(0)
      buffers = len(types) - len(scalars)
      for k in (a, b):
        assert launch.ptx_param_count(k.ptx, k.name) == buffers, name
        assert "griddepcontrol.wait" in k.ptx and k.threads == 32 * warps, name
        assert re.search(r"\\.visible \\.entry " + k.name + r"\\(", k.ptx), name
      assert a.name != b.name and again is a, name
      n += 1
    assert n >= 4, n  # the tiled and persistent X·U·V and SwiGLU kernels, the group
    meta = dict(M=64, N=256, K=128, BM=64, BN=128, BK=64, GROUP=8, PROGRAMS=4, WS=False)
    assert launch.xla_kernel(tma_gemm._gemm_tma_kernel, ["*bf16"] * 4, [], meta, 8, 3,
                             90) is None
    print(n, "ok")
  """),
    interpret=False,
  )
  assert int(out.split()[-2]) >= 4, out


def test_kernels_for_xlas_triton_call_take_their_buffers_alone():
  """LRJAX_TRITON_LAUNCH=xla_triton: the persistent X·U·V decode kernel and the ·V launch
  (launch_modes.XLA_TRITON_KERNELS; no other kernel, whatever its constexprs) as Triton's frontend
  TTIR with its scalars as constants, on each planned shape: its public function takes the
  buffers alone, each 16-byte aligned, as XLA's Triton call passes them; it waits on the grid
  dependency; it carries no debug locations (no source paths) and parses back with Triton's
  own parser."""
  out = run_script(
    STUB
    + textwrap.dedent("""
    import re, tempfile
    from triton._C import libtriton
    from lrjax.custom_calls.triton import (launch, launch_modes, planner, xuv_decode,
                                           xuv_decode_pv)
    assert launch_modes.XLA_TRITON_KERNELS == (xuv_decode._xuv_decode_persistent_kernel.__name__,
                                               xuv_decode_pv._xuv_decode_pv_kernel.__name__)
    assert "xla_triton" in launch_modes.LAUNCH_MODES
    assert launch_modes.count_calls('custom_call_target="__gpu$xla.gpu.triton"') == 1
    def serves(m, k, r, n, pv=True):
      p = (planner.plan_decode_persistent if pv else planner.plan_decode_phase1)(m, k, r, n)
      return launch_modes.xla_triton_serves("_xuv_decode_persistent_kernel",
          xuv_decode.persistent_launch_plan(m, k, r, n, False, p, pv=pv)["meta"])
    # timed on the same weights: whole or V-resident phase-1 tiles gained, phase 1 alone
    # (XLA applies V) too on average, tiles of 160 of 256 columns lost
    assert serves(2, 4096, 2560, 14336) and serves(4, 4096, 152, 4096)
    assert serves(1, 8192, 4096, 16384) and serves(2, 8192, 2456, 8192)
    assert not serves(8, 8192, 2456, 8192) and not serves(8, 8192, 2432, 8192)
    assert serves(64, 4096, 2560, 14336, pv=False) and serves(128, 8192, 2048, 16384, pv=False)
    # phase 1 alone on 112 of 128 columns (phase1_balance_cols): the PTX call (a tie)
    assert not serves(128, 8192, 2456, 8192, pv=False)
    p = planner.plan_decode_persistent(2, 4096, 2560, 14336)
    meta = xuv_decode.persistent_launch_plan(2, 4096, 2560, 14336, False, p)["meta"]
    assert not launch_modes.xla_triton_serves("_xuv_decode_group_kernel", meta)
    n, kinds = 0, set()
    for name, kernel, meta, warps, stages in kernel_resources.planned():
      # one plan of each kind the call serves: V-resident, stream-K, r-chunks
      kind = (meta.get("V_RES"), meta.get("STREAM_K"), meta.get("R_CHUNKS", 1) > 1)
      if kind in kinds or not launch_modes.xla_triton_serves(kernel.__name__, meta):
        continue
      kinds.add(kind)
      types, scalars = kernel_resources.xla_args(kernel, 3)
      at = kernel_resources.offset_constexpr(kernel)
      compile = lambda: launch.xla_triton_kernel(kernel, types, scalars,
                                                 dict(meta, PDL=1, **{at: 0}), warps, stages,
                                                 90)
      k = compile()
      assert compile() is k, name
      head = re.search(r"tt\\.func public @" + re.escape(k.name)
                       + r"\\((.*?)\\)\\s*(attributes|\\{)", k.ttir, re.S)
      buffers = len(types) - len(scalars)
      assert head and head.group(1).count("!tt.ptr") == buffers, name
      assert head.group(1).count("tt.divisibility = 16") == buffers, name
      assert "griddepcontrol.wait" in k.ttir and "loc(" not in k.ttir, name
      context = libtriton.ir.context()
      libtriton.ir.load_dialects(context)
      with tempfile.NamedTemporaryFile("w", suffix=".ttir") as fh:
        fh.write(k.ttir)
        fh.flush()
        assert libtriton.ir.parse_mlir_module(fh.name, context).get_entry_func_name() == k.name
      n += 1
    assert n >= 3, n
    print(n, "ok")
  """),
    interpret=False,
  )
  assert int(out.split()[-2]) >= 3, out


def test_bad_mode_and_missing_library_are_named():
  out = run_script(
    _RAISES
    + textwrap.dedent("""
    import os
    from lrjax.custom_calls.triton import launch
    os.environ["LRJAX_TRITON_LAUNCH"] = "fast"
    raises(ValueError, launch.launch_mode, "fast", "pdl", "xla_triton")
    from lrjax.custom_calls.triton import launch_modes
    for value, level in (("", 1), ("0", 1), ("1", 2)):  # PDL constexpr of a dependent's launch
      os.environ["LRJAX_TRITON_PDL_OVERLAP"] = value
      assert launch_modes.pdl_level() == level, (value, launch_modes.pdl_level())
    os.environ["LRJAX_TRITON_PDL_OVERLAP"] = "yes"
    raises(ValueError, launch_modes.pdl_overlap, "LRJAX_TRITON_PDL_OVERLAP='yes'", "0 or 1")
    del os.environ["LRJAX_TRITON_PDL_OVERLAP"]
    os.environ["LRJAX_TRITON_LAUNCH"] = "pdl"
    launch._launcher_paths = lambda: ["/nonexistent/_pdl_launch.so"]
    raises(RuntimeError, launch.launcher, "/nonexistent/_pdl_launch.so",
           "LRJAX_TRITON_LAUNCH=pdl")
    print("ok")
  """),
    interpret=False,
  )
  assert out.rstrip().endswith("ok")


def test_the_built_library_loads_and_checks_the_driver():
  """The library from the package build (or a source-tree build) loads without a GPU and
  registers its handler; it opens the CUDA driver only when asked, and says why it cannot."""
  out = run_script(
    STUB
    + textwrap.dedent("""
    import ctypes.util, os
    from lrjax.custom_calls.triton import launch
    if not any(os.path.exists(p) for p in launch._launcher_paths()):
      print("absent ok")
    else:
      err = launch.launcher().lrjax_triton_launch_driver_error().decode()
      if ctypes.util.find_library("cuda") is None:
        assert "libcuda.so.1" in err, err
      else:
        assert err == "", err
      print("loaded ok")
  """),
    interpret=False,
  )
  if out.split()[-2] == "absent":
    pytest.skip("the Triton launcher was not built (no Triton at build time)")
  assert out.split()[-2] == "loaded", out


def test_the_compile_keeps_the_scratch_and_warps_triton_reports():
  """jax-triton drops the metadata Triton's stages fill; launch.py's tap keeps what lrjax's
  launcher needs of it. A kernel that builds TMA descriptors on the device asks for 128 bytes
  of global scratch a descriptor, and warp-specializing its K loop launches 12 warps for 4:
  both need lrjax's launcher, and the PTX entry takes as many parameters as it passes. The
  compile step is jax-triton 0.3.1's stages in order (here without jax-triton)."""
  out = run_script(
    STUB
    + textwrap.dedent("""
    import types
    import numpy as np
    import triton
    from jax.core import ShapedArray
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    import tma_gemm
    from lrjax.custom_calls.triton import launch

    def jax_triton_compile(ttir, backend, options, cc, platform):
      metadata = {}
      mod = backend.make_ttir(ttir, metadata, options, cc)
      mod = backend.make_ttgir(mod, metadata, options, cc)
      ptx = backend.make_ptx(backend.make_llir(mod, metadata, options, cc), metadata, options,
                             cc)
      return types.SimpleNamespace(name=metadata["name"], binary=ptx,
                                   shared_mem_bytes=metadata["shared"])
    launch._jax_triton_compile = jax_triton_compile

    target = GPUTarget("cuda", 90, 32)
    kernel = tma_gemm._gemm_tma_kernel
    for ws, warps in ((False, 8), (True, 4)):
      meta = dict(M=64, N=256, K=128, BM=64, BN=128, BK=64, GROUP=8, PROGRAMS=4, WS=ws)
      sig = {p.name: "constexpr" if p.is_constexpr else "*bf16" for p in kernel.params}
      attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kernel.params)
               if not p.is_constexpr}
      src = ASTSource(fn=kernel, signature=sig, constexprs=meta, attrs=attrs)
      backend = make_backend(target)
      options = backend.parse_options(dict(num_warps=warps, num_stages=3))
      context = ir.context()
      ir.load_dialects(context)
      backend.load_dialects(context)
      ttir = src.make_ir(target, options, backend.get_codegen_implementation(options),
                         backend.get_module_map(), context)
      launch._ours.active = False
      compiled = launch._compile_checked(ttir, backend, options, 90, "cuda")
      result, image = launch._ours.compiled
      assert result is compiled
      assert image.scratch >= 3 * 128 and image.scratch_align == 128, image
      assert image.num_warps == (12 if ws else 8), image
      assert image.needs_own_launcher(warps)
      ins = [ShapedArray((8,), np.float32)] * 3  # a, b, the aliased output; c is the result
      triples = launch.kernel_params(ins, [ShapedArray((8,), np.float32)], [], (), 128)
      assert launch.ptx_param_count(compiled.binary, compiled.name) == len(triples) // 3
    assert not launch.Image(4, 0, 1).needs_own_launcher(4)
    print("ok")
  """),
    interpret=False,
  )
  assert out.rstrip().endswith("ok")


def test_the_ctas_done_early_zero_the_scratch_chain():
  """Who zeroes the chain's other half (the X·U·V decode kernel's CLEAR_FIRST/CLEAR_COUNT): a
  V-resident call's phase-1 CTAs; else the CTAs with no phase-2 tile where there are at least
  clear_min_idle of them; else every CTA (a phase-1-only call too)."""
  run_script(
    STUB
    + textwrap.dedent("""
    from lrjax.custom_calls.triton import planner, policy, xuv_decode as xd

    def clearers(m, k, r, n, pv=True):
      plan = (planner.plan_decode_persistent if pv else planner.plan_decode_phase1)(
          m, k, r, n, programs=132)
      meta = xd.persistent_launch_plan(m, k, r, n, False, plan, pv=pv)["meta"]
      return plan, (meta["CLEAR_FIRST"], meta["CLEAR_COUNT"])

    p, who = clearers(4, 4096, 152, 4096)  # V-resident: 64 phase-1 tiles, 64 phase-2 ones
    assert p.v_resident and who == (0, 64), (p, who)
    p, who = clearers(2, 4096, 2560, 14336)  # 112 whole-line phase-2 tiles on 132 CTAs
    assert (p.cols_n, p.r_chunks) == (128, 1) and who == (112, 20), (p, who)
    assert policy.values("xuv_decode").clear_min_idle > 4
    p, who = clearers(2, 8192, 4096, 16384)  # 128 phase-2 tiles: 4 CTAs idle, too few
    assert who == (0, 0), (p, who)
    assert clearers(64, 8192, 4096, 16384, pv=False)[1] == (0, 0)  # phase 1 alone
    print("ok")
  """),
    interpret=False,
  )


def test_a_prefetch_that_is_not_a_power_of_two_is_refused_by_name():
  """The kernels' L2 prefetch covers tl.arange(0, PREFETCH) rows; Triton would fail deep in
  its compiler ("arange's range must be a power of 2") without saying which plan field. The
  X·U·V, grouped and SwiGLU decode plans are each checked (planner.check_prefetch_rows)."""
  run_script(
    STUB
    + textwrap.dedent("""
    import dataclasses
    from lrjax.custom_calls.triton import planner, xuv_decode as xd

    p = planner.plan_decode_persistent(2, 4096, 2560, 14336, programs=132)
    for rows in (0, 32, 64, 256):
      xd.persistent_launch_plan(2, 4096, 2560, 14336, False, dataclasses.replace(p, prefetch=rows))
    for rows in (96, -64):
      try:
        xd.persistent_launch_plan(2, 4096, 2560, 14336, False,
                                  dataclasses.replace(p, prefetch=rows))
      except ValueError as e:
        assert f"prefetch={rows} V rows must be 0 or a power of two" in str(e), e
      else:
        raise AssertionError(f"prefetch={rows}: not refused")
    from lrjax.custom_calls.triton import mlp_decode, xuv_decode_group
    g = planner.plan_decode_group(2, 4096, [(1216, 4096), (512, 1024)], programs=132)
    q = planner.plan_mlp_decode_persistent(2, 4096, 14336, 2560, 2560, 4096, programs=132)
    for call, field in (
        (lambda: xuv_decode_group.launch_plan(2, 4096, [(1216, 4096, False), (512, 1024, False)],
                                      dataclasses.replace(g, prefetch=48)), "prefetch=48"),
        (lambda: mlp_decode.persistent_launch_plan(
            2, 4096, 2560, 14336, 2560, 4096, gated=True, act="silu",
            bias_mask=(False, False, False), p=dataclasses.replace(q, prefetch_c=24)),
         "prefetch_c=24")):
      try:
        call()
      except ValueError as e:
        assert f"{field} V rows must be 0 or a power of two" in str(e), e
      else:
        raise AssertionError(f"{field}: not refused")
    print("ok")
  """),
    interpret=False,
  )


def test_the_pv_launch_refuses_bad_input_by_name():
  """pv="launch" (the launch recorded, not run): a ·V plan without pv="launch", a phase-1
  plan that rounds P itself (p16), the tiled schedule, a P that is not m·r f32 sums, tiles
  under the mma's 16 (refused where the plan is built) and an out= of the wrong shape are each
  refused, naming what was expected."""
  run_script(
    _RAISES
    + textwrap.dedent("""
    import dataclasses
    import jax.numpy as jnp
    from lrjax.custom_calls.triton import launch, planner, xuv_decode as xd, xuv_decode_pv
    launch.triton_call = lambda *a, out_shape, **kw: out_shape  # never reached below
    xd.num_sms = lambda: 132
    m, k, r, n = 64, 512, 136, 200
    x, u, v = (jnp.zeros(s, jnp.bfloat16) for s in ((m, k), (k, r), (r, n)))
    pp = planner.plan_pv_launch(m, r, n)
    raises(ValueError, lambda: xd._xuv_decode(x, u, v, pv="xla", pv_plan=pp), "pv_plan=",
           "pv='launch'")
    p16 = dataclasses.replace(planner.plan_decode_phase1(m, k, r, n, programs=132), p16=True)
    raises(ValueError, lambda: xd._xuv_decode(x, u, v, persistent=p16, pv="launch"), "p16",
           "f32 P")
    raises(ValueError, lambda: xd._xuv_decode(x, u, v, persistent=False, pv="launch"),
           "persistent schedule")
    pv_launch = lambda p, **kw: xuv_decode_pv.xuv_decode_pv(p, v, m=m, out_dtype=jnp.bfloat16,
                                                            **kw)
    raises(ValueError, lambda: pv_launch(jnp.zeros((m * r,), jnp.bfloat16)), f"f32 [{m * r}]",
           "bfloat16")
    raises(ValueError, lambda: pv_launch(jnp.zeros((m * r + 1,), jnp.float32)), f"f32 [{m * r}]")
    raises(ValueError, lambda: pv_launch(jnp.zeros((m * r,), jnp.float32),
                                         block_sizes=dataclasses.replace(pp, block_n=8)),
           "block_n", ">= 16")
    raises(ValueError, lambda: xd._xuv_decode(x, u, v, out=jnp.zeros((m, n + 1), jnp.bfloat16),
                                             pv="launch"), str((m, n)))
    print("ok")
  """),
    interpret=False,
  )


def test_the_decode_wrapper_launches_the_planners_persistent_plan():
  """xuv_decode.xuv_decode on 132 SMs (the launch recorded, not run): where V has at most
  pv_launch_max_v elements, from pv_launch_min_m rows (from 17 where N <= K/4 and K >= 4096),
  phase 1 alone and then the ·V launch (into out= where given); otherwise below
  pv_xla_min_m rows the persistent kernel with
  phase 2, from it phase 1 alone (XLA applies V) except where out= is given, and from 33 rows
  where N <= K/4 and K >= 4096; each call's grid and constexprs are persistent_launch_plan's
  of plan_persistent's plan for that many SMs, and the ·V launch's those of
  plan_pv_launch's tiles."""
  out = run_script(
    STUB
    + textwrap.dedent("""
    import jax, jax.numpy as jnp
    from lrjax.custom_calls.triton import launch, planner, policy, xuv_decode, xuv_decode_pv
    calls = []
    def record(*args, kernel, out_shape, grid, **kw):
      calls.append((kernel.__name__, grid, kw))
      if not isinstance(out_shape, (list, tuple)):
        return jnp.zeros(out_shape.shape, out_shape.dtype)
      return tuple(jnp.zeros(s.shape, s.dtype) for s in out_shape)
    launch.triton_call = record
    xuv_decode.num_sms = lambda: 132
    t = policy.values("xuv_decode")
    assert (t.pv_launch_min_m, t.pv_launch_max_v) == (33, 2 << 20)
    assert t.pv_launch_small_v_min_m == 17
    assert t.pv_xla_min_m == 64
    assert (t.pv_xla_k_over_n, t.pv_xla_min_k) == (4, 4096)
    for m, k, r, n, given, pv in (
        (2, 512, 200, 8200, False, "kernel"), (32, 4096, 200, 1025, False, "kernel"),
        # 17-32 rows: the ·V launch where N <= K/4 and K >= 4096 as well
        (32, 8192, 200, 1024, False, "launch"), (17, 4096, 200, 1024, False, "launch"),
        (16, 8192, 200, 1024, False, "kernel"), (32, 2048, 200, 512, False, "kernel"),
        # from 33 rows, V of at most 2 << 20 elements: the ·V launch (into out= if given)
        (33, 8192, 200, 1024, False, "launch"), (63, 512, 200, 8200, False, "launch"),
        (128, 512, 2000, 1048, False, "launch"), (128, 512, 200, 1000, True, "launch"),
        # larger V: XLA's GEMM from 64 rows, the fused kernel where out= is given
        (64, 512, 2000, 4096, False, "xla"), (128, 512, 2000, 1100, False, "xla"),
        (64, 512, 2000, 8200, True, "kernel"),
        # ... unless XLA's GEMM would pad V every call: up to 64 rows, r >= 2048 not a
        # multiple of 16
        (64, 512, 2056, 4096, False, "kernel"), (40, 8192, 2056, 1024, False, "kernel"),
        (64, 512, 2064, 4096, False, "xla"), (128, 512, 2056, 1100, False, "xla"),
        (64, 512, 2040, 1100, False, "xla"),
        # 33-63 rows (the 64-row block), larger V: phase 1 alone where N <= K/4, K >= 4096
        (63, 4096, 4000, 1024, False, "xla"), (63, 4096, 4000, 1025, False, "kernel"),
        (48, 2048, 5000, 512, False, "kernel"), (33, 8192, 4000, 1024, False, "xla"),
        (64, 8192, 4000, 1024, True, "kernel")):
      u = jnp.zeros((k, r), jnp.bfloat16)
      v = jnp.zeros((r, n), jnp.bfloat16)
      x = jnp.zeros((m, k), jnp.bfloat16)
      o = jnp.zeros((m, n), jnp.bfloat16) if given else None
      y = xuv_decode.xuv_decode(x, u, v, out=o)
      assert y.shape == (m, n), y.shape
      assert xuv_decode.default_pv(m, k, r, n, given) == pv, (m, k, r, n, given)
      if pv == "launch":  # the ·V launch, last: into out= where given
        name, grid, kw = calls.pop()
        pp = planner.plan_pv_launch(m, r, n)
        assert name == "_xuv_decode_pv_kernel", name
        assert grid == (planner.cdiv(n, pp.block_n), planner.cdiv(m, pp.block_m)), grid
        assert kw["input_output_aliases"] == ({3: 0} if given else None), kw
        assert all(kw[key] == val for key, val in
                   xuv_decode_pv.launch_meta(r, n, False, pp).items()), (m, r, n)
      p = xuv_decode.plan_persistent(m, k, r, n, pv, 132)
      want = xuv_decode.persistent_launch_plan(m, k, r, n, False, p, pv == "kernel")
      name, grid, kw = calls.pop()
      assert not calls, calls
      assert name == "_xuv_decode_persistent_kernel" and grid == (want["grid"],), (name, grid)
      assert all(kw[key] == val for key, val in want["meta"].items()), (m, given)
      assert kw["PV"] == (pv == "kernel") and p.programs == 132
      if pv == "launch":  # out= is the ·V launch's: phase 1 aliases only its zeroed scratch
        assert kw["input_output_aliases"] == {4: 0}, kw["input_output_aliases"]
      if not given:  # the benchmarks' and tests' account of the same call
        assert xuv_decode.default_persistent_launch(m, k, r, n, False, 132) == (pv, p, want)
      bs = xuv_decode.BlockSizes.get_default(m, k, r, n, out_given=given, programs=132)
      assert (bs.pv, bs.plan) == (pv, p) and (bs.pv_plan is None) == (pv != "launch"), bs
    print("ok")
  """),
    interpret=False,
  )
  assert out.strip().endswith("ok")


def test_phase1_alone_hands_xla_the_p_its_launch_returns():
  """xuv_decode(pv="xla") with the launch faked (it returns a known P, not run): on f32 P
  (the default plan) the scratch the call asks for is P alone, m·r floats, and y is that P
  rounded once to V's dtype times V, plus the bias; with p16 y is the returned bf16 P times
  V. Ragged M, r and N."""
  out = run_script(
    STUB
    + textwrap.dedent("""
    import dataclasses
    import jax, jax.numpy as jnp, numpy as np
    from lrjax.custom_calls.triton import launch, planner, xuv_decode
    xuv_decode.num_sms = lambda: 132
    rng = np.random.default_rng(0)
    for m, k, r, n, fields in ((128, 512, 200, 1000, {}), (77, 256, 136, 130, {}),
                               (64, 512, 136, 200, {"p16": True}),
                               (77, 256, 136, 130, {"p16": True})):
      p = dataclasses.replace(planner.plan_decode_phase1(m, k, r, n, programs=132), **fields)
      pf = rng.standard_normal((m, r)).astype(np.float32)
      shapes = []
      def fake(*args, kernel, out_shape, grid, **kw):
        shapes.append([s.shape for s in out_shape])
        scratch = np.zeros(out_shape[0].shape, np.float32)
        scratch[:m * r] = pf.reshape(-1)
        return (jnp.asarray(scratch), jnp.zeros(out_shape[1].shape, out_shape[1].dtype),
                jnp.asarray(pf.reshape(-1)[:out_shape[2].shape[0]], out_shape[2].dtype))
      launch.triton_call = fake
      x = jnp.zeros((m, k), jnp.bfloat16)
      u = jnp.zeros((k, r), jnp.bfloat16)
      v = jnp.asarray(rng.standard_normal((r, n)), jnp.bfloat16)
      b = jnp.asarray(rng.standard_normal(n), jnp.bfloat16)
      y = np.asarray(xuv_decode._xuv_decode(x, u, v, b, persistent=p, pv="xla"), np.float64)
      (scratch_shape, _, p16_shape), = shapes
      if not p.p16:
        assert scratch_shape == (m * r,), (m, r, scratch_shape)  # P alone: nothing to slice
      else:
        assert p16_shape == (m * r,), (m, r, p16_shape)
      f64 = lambda a: np.asarray(a, np.float64)
      want = f64(jnp.asarray(pf, jnp.bfloat16)) @ f64(v) + f64(b)
      err = np.abs(y - want).max() / np.abs(want).max()
      assert y.shape == (m, n) and err < 2e-2, (m, k, r, n, fields, err)
    print("ok")
  """),
    interpret=False,
  )
  assert out.strip().endswith("ok")


def test_a_rank_space_scale_is_applied_by_xla_after_phase_1():
  """xuv_decode and xuv_decode_group with a scale (the launch faked: it returns a known P, not
  run): the call is phase 1 alone (PV off), and y is P rounded to V's dtype, times the scale
  in the scale's dtype, rounded to scaled_dtype, times V, plus the bias: lr_xuv's reference
  on that P. Both P forms (f32 sums, p16), an f32 Σ with bf16 factors, ragged shapes; and the
  schedules that cannot take a scale refuse it by name."""
  out = run_script(
    _RAISES
    + textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from lrjax.custom_calls.triton import launch, policy, xuv_decode, xuv_decode_group
    from lrjax.lowering.primitives import apply_scale, rank_space_out
    xuv_decode.num_sms = xuv_decode_group.num_sms = lambda: 132
    rng = np.random.default_rng(0)
    pvs = []
    def faker(ps):  # ps: the P of each member, f32 [m, r_i]
      def fake(*args, kernel, out_shape, grid, **kw):
        # phase 2 in the launch: the decode kernel's PV, the grouped kernel's ·V tiles Q0..Q2
        pvs.append(kw["PV"] if "PV" in kw else any(kw.get(f"Q{i}", 0) for i in range(3)))
        scratch = np.zeros(out_shape[0].shape, np.float32)
        flat = np.concatenate([p.reshape(-1) for p in ps])
        scratch[:flat.size] = flat
        rest = [jnp.zeros(o.shape, o.dtype) for o in out_shape[1:]]
        if len(out_shape) == 3 and out_shape[2].shape[0] == flat.size:  # p16: P rounded
          rest[1] = jnp.asarray(flat, out_shape[2].dtype)
        return (jnp.asarray(scratch), *rest)
      return fake
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    for m, k, r, n, sdt in ((1, 512, 200, 1000, jnp.bfloat16), (7, 256, 136, 130, jnp.float32),
                            (16, 4096, 512, 1024, jnp.bfloat16)):
      pf = rng.standard_normal((m, r)).astype(np.float32)
      launch.triton_call = faker([pf])
      x = jnp.zeros((m, k), jnp.bfloat16)
      u = jnp.zeros((k, r), jnp.bfloat16)
      v = jnp.asarray(rng.standard_normal((r, n)), jnp.bfloat16)
      b = jnp.asarray(rng.standard_normal(n), jnp.bfloat16)
      s = jnp.asarray(rng.uniform(0.5, 4.0, r), sdt)
      y = xuv_decode.xuv_decode(x, u, v, b, scale=s)
      assert pvs.pop() is False and not pvs  # phase 1 alone
      p = apply_scale(jnp.asarray(pf, jnp.bfloat16), s, jnp.bfloat16)
      want = f64(rank_space_out(p, v, b, jnp.bfloat16))
      err = np.abs(f64(y) - want).max() / np.abs(want).max()
      assert y.shape == (m, n) and err < 1e-2, (m, k, r, n, err)
      # the kernel's other schedules cannot take it
      raises(ValueError, lambda: xuv_decode._xuv_decode(x, u, v, scale=s, pv="kernel"), "pv='xla'")
      raises(ValueError, lambda: xuv_decode.xuv_decode(x, u, v, scale=s[:-1]), "the rank")
    big = policy.values("xuv_decode").persistent_max_m + 1
    xb = jnp.zeros((big, 64), jnp.bfloat16)
    raises(ValueError, lambda: xuv_decode.xuv_decode(
        xb, jnp.zeros((64, 16), jnp.bfloat16), jnp.zeros((16, 32), jnp.bfloat16),
        scale=jnp.ones(16, jnp.bfloat16)), "persistent schedule")
    # q/k/v: per-member scales (or none), P_i side by side in the scratch
    m, k = 5, 512
    shapes = ((256, 512), (64, 128), (64, 128))
    ps = [rng.standard_normal((m, r)).astype(np.float32) for r, _ in shapes]
    launch.triton_call = faker(ps)
    x = jnp.zeros((m, k), jnp.bfloat16)
    members, wants = [], []
    for i, ((r, n), pf) in enumerate(zip(shapes, ps)):
      v = jnp.asarray(rng.standard_normal((r, n)), jnp.bfloat16)
      s = None if i == 1 else jnp.asarray(rng.uniform(0.5, 4.0, r), jnp.bfloat16)
      members.append((jnp.zeros((k, r), jnp.bfloat16), v, None, s))
      p = apply_scale(jnp.asarray(pf, jnp.bfloat16), s, jnp.bfloat16)
      wants.append(f64(rank_space_out(p, v, None, jnp.bfloat16)))
    ys = xuv_decode_group.xuv_decode_group(x, members)
    assert pvs.pop() is False and not pvs
    for y, want in zip(ys, wants):
      assert np.abs(f64(y) - want).max() / np.abs(want).max() < 1e-2
    raises(ValueError, lambda: xuv_decode_group._xuv_decode_group(x, members, pv="kernel"),
           "pv='xla'")
    print("ok")
  """),
    interpret=False,
  )
  assert out.strip().endswith("ok")


def test_a_scaled_mlp_runs_as_its_composed_calls():
  """lr_mlp with rank-space scales through the CUDA lowering's impl (the launches faked: each
  phase-1 launch returns the exact f32 X·U of its members, computed here): the gate/up
  group and the down call apply each projection's scale after phase 1, and the result is
  lr_mlp's reference within bf16 rounding. Gated (gate unscaled) and non-gated, scales on
  up and down."""
  out = run_script(
    STUB
    + textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from lrjax.custom_calls.triton import launch, lowering, mlp_decode, xuv_decode
    from lrjax.custom_calls.triton import xuv_decode_group
    from lrjax.lowering.primitives import _mlp_flatten, lr_mlp_reference
    xuv_decode.num_sms = xuv_decode_group.num_sms = lambda: 132
    def fake(*args, kernel, out_shape, grid, **kw):
      x = np.asarray(args[0], np.float32)
      scratch = np.zeros(out_shape[0].shape, np.float32)
      if kernel.__name__ == "_xuv_decode_group_kernel":
        assert not any(kw[f"Q{i}"] for i in range(3))  # phase 1 alone
        off = 0
        for i in range(3):
          if kw[f"A{i}"]:
            p = x @ np.asarray(args[1 + 3 * i], np.float32)
            scratch[off:off + p.size] = p.reshape(-1)
            off += p.size
        return (jnp.asarray(scratch), *[jnp.zeros(o.shape, o.dtype) for o in out_shape[1:]])
      assert kernel.__name__ == "_xuv_decode_persistent_kernel" and not kw["PV"], kernel
      p = (x @ np.asarray(args[1], np.float32)).reshape(-1)
      scratch[:p.size] = p
      p16 = jnp.asarray(p, out_shape[2].dtype) if out_shape[2].shape == p.shape else (
          jnp.zeros(out_shape[2].shape, out_shape[2].dtype))
      return (jnp.asarray(scratch), jnp.zeros(out_shape[1].shape, out_shape[1].dtype), p16)
    launch.triton_call = fake
    impl = lowering._mlp_impl("mlp_decode", "mlp_decode")()
    rng = np.random.default_rng(0)
    bf = jnp.bfloat16
    r = lambda *s, scale=1.0: jnp.asarray(rng.standard_normal(s) * scale, bf)
    m, d, f, rk, rd = 3, 256, 512, 64, 48
    x = r(m, d)
    for gated in (True, False):
      gate = (r(d, rk, scale=d**-0.5), r(rk, f, scale=rk**-0.5), None, None)
      up = (r(d, rk, scale=d**-0.5), r(rk, f, scale=rk**-0.5), r(f), r(rk) + 2)
      down = (r(f, rd, scale=f**-0.5), r(rd, d, scale=rd**-0.5), None, r(rd) + 2)
      projs = ((gate,) if gated else ()) + (up, down)
      flat, bmask, smask = _mlp_flatten(projs)
      params = dict(gated=gated, act="silu", bias_mask=bmask, inter_dtype=jnp.dtype(bf),
                    out_dtype=jnp.dtype(bf), scale_mask=smask)
      y = impl(x, *flat, **params)
      want = lr_mlp_reference(x, up, down, gate if gated else None, act="silu")
      f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
      err = np.linalg.norm(f64(y) - f64(want)) / np.linalg.norm(f64(want))
      assert y.shape == (m, d) and err < 2e-2, (gated, err)
    print("ok")
  """),
    interpret=False,
  )
  assert out.strip().endswith("ok")


def test_a_kernel_with_read_off_reads_a_slice_in_its_source_buffer():
  """launch._read_in_place, on a hand-built module: a kernel that takes READ_OFF and whose
  first operand is a contiguous slice of a 1-D buffer (a chained call's half) gets the whole
  buffer, its aval widened, and the slice's offset as READ_OFF; a strided slice, a slice of
  another operand, an operand that is no slice, or a kernel without READ_OFF is left alone."""
  out = run_script(
    STUB
    + textwrap.dedent("""
    import jax, numpy as np
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import func, hlo
    from jax.interpreters import mlir
    from lrjax.custom_calls.triton import launch

    class Ctx:  # the two things _read_in_place uses of a lowering context
      def __init__(self, avals_in):
        self.avals_in = avals_in
      def replace(self, avals_in):
        return Ctx(avals_in)

    aval = lambda n: jax.core.ShapedArray((n,), np.float32)
    ints = mlir.dense_int_array
    with mlir.make_ir_context(), ir.Location.unknown():
      module = ir.Module.create()
      with ir.InsertionPoint(module.body):
        t = ir.RankedTensorType.get((64,), ir.F32Type.get())
        f = func.FuncOp("f", ir.FunctionType.get([t, t], []))
        block = f.add_entry_block()
        with ir.InsertionPoint(block):
          buf, other = block.arguments
          half = hlo.slice(buf, ints([32]), ints([56]), ints([1]))
          strided = hlo.slice(buf, ints([0]), ints([48]), ints([2]))
          func.ReturnOp([])
      params = {launch.READ_OFF: 0, "num_warps": 4}
      ctx, args, got = launch._read_in_place(Ctx([aval(24), aval(64)]), [half, other], params)
      assert args[0] == buf and args[1] == other, args
      assert ctx.avals_in[0].shape == (64,) and ctx.avals_in[1].shape == (64,), ctx.avals_in
      assert got[launch.READ_OFF] == 32 and got["num_warps"] == 4, got
      for first, p in ((strided, params), (other, params), (half, {"num_warps": 4})):
        c = Ctx([aval(24), aval(64)])
        c2, a2, p2 = launch._read_in_place(c, [first, other], p)
        assert c2 is c and a2[0] == first and p2 is p, (first, p)
    print("ok")
  """),
    interpret=False,
  )
  assert out.strip().endswith("ok")


def test_every_launch_names_every_constexpr_of_its_kernel():
  """jax-triton passes a kernel only the constexprs its launch names, never a signature
  default (Triton then reads the missing one as None, and the kernel fails to compile on the
  GPU). Every product wrapper, on shapes reaching each of
  its kernels and schedules (the launch recorded, not run), names every constexpr, and each
  launch goes through Triton's frontend as lrjax's default launch compiles it
  (``launch._frontend``: the recorded operands' types, scalars and constexprs alone);
  ``launch.triton_call`` itself refuses a launch that leaves one out."""
  out = run_script(
    STUB
    + textwrap.dedent("""
    import jax.numpy as jnp, numpy as np
    from lrjax.custom_calls.triton import (kv_attention, launch, mlp_decode, mlp_prefill,
                                           xuv_decode, xuv_decode_group, xuv_prefill)
    seen = set()
    CALL_KEYS = {"name", "custom_call_target_name", "num_warps", "num_stages", "num_ctas",
                 "compute_capability", "enable_fp_fusion", "input_output_aliases",
                 "zeroed_outputs", "debug", "serialized_metadata"}  # jt.triton_call's own
    TYPES = {"bfloat16": "*bf16", "float32": "*fp32", "int32": "*i32", "float16": "*fp16"}
    def record(*args, kernel, out_shape, grid, **kw):
      missing = [p.name for p in kernel.params if p.is_constexpr and p.name not in kw]
      assert not missing, (kernel.__name__, missing)
      seen.add(kernel.__name__)
      types, scalars = [], []
      one = not isinstance(out_shape, (list, tuple))  # a single output, returned bare
      out_shape = [out_shape] if one else out_shape
      for a in list(args) + list(out_shape):
        if isinstance(a, int):
          scalars.append((len(types), "i32", a))
          types.append("i32")
        else:
          types.append(TYPES[str(a.dtype)])
      meta = {k: v for k, v in kw.items() if k not in CALL_KEYS}
      launch._frontend(kernel, types, scalars, meta, kw["num_warps"], kw["num_stages"], 90,
                       True)  # raises as on the GPU where a constexpr is missing or wrong
      outs = tuple(jnp.zeros(s.shape, s.dtype) for s in out_shape)
      return outs[0] if one else outs
    launch.jt.triton_call = record  # below launch.triton_call, which adds WORK_OFF and PDL
    for mod in (xuv_decode, xuv_decode_group, mlp_decode, kv_attention):
      mod.num_sms = lambda: 132
    z = lambda *s: jnp.zeros(s, jnp.bfloat16)
    for m, k, r, n in ((1, 512, 200, 1000), (64, 8192, 2456, 8192), (128, 4096, 152, 4096),
                       (64, 4096, 1024, 1024), (33, 8192, 1000, 1024)):
      xuv_decode.xuv_decode(z(m, k), z(k, r), z(r, n), z(n))
      xuv_decode._xuv_decode(z(m, k), z(k, r), z(r, n), persistent=False)
      xuv_decode._xuv_decode(z(m, k), z(k, r), z(r, n), z(n), pv="launch")
    xuv_decode_group.xuv_decode_group(z(4, 512),
                                      [(z(512, 64), z(64, 256)), (z(512, 40), z(40, 128))])
    xuv_prefill.xuv_prefill(z(300, 512), z(512, 72), z(72, 260), z(260))
    up, down, gate = (z(256, 64), z(64, 700)), (z(700, 48), z(48, 256)), (z(256, 64), z(64, 700))
    for m in (1, 16, 33):
      mlp_decode.mlp_decode(z(m, 256), up, down, gate)
      mlp_decode._mlp_decode(z(m, 256), up, down, gate, persistent=True)
    mlp_prefill.mlp_prefill(z(300, 256), up, down, gate)
    b, hq, hkv, d, t, rk, rv = 2, 8, 2, 64, 300, 136, 72
    kv_attention.kv_attention(z(b, hq, d), z(b, t, rk), z(b, t, rv), z(rk, hkv * d),
                              z(rv, hkv * d), np.array([t - 1, 5], np.int32),
                              np.ones(d // 2, np.float32), window=64)
    want = {"_xuv_decode_kernel", "_xuv_decode_persistent_kernel", "_xuv_decode_group_kernel",
            "_xuv_decode_pv_kernel",
            "_xuv_prefill_kernel", "_mlp_decode_kernel", "_mlp_decode_persistent_kernel",
            "_mlp_prefill_kernel", "_kv_attention_kernel"}
    assert seen == want, want ^ seen
    try:  # launch.triton_call's own check, before jax-triton: the missing ones by name
      launch.triton_call(kernel=xuv_decode._xuv_decode_persistent_kernel, out_shape=(), grid=1,
                         K=1)
    except ValueError as e:
      assert "'STREAM_K'" in str(e) and "'K'" not in str(e) and "WORK_OFF" not in str(e), e
    else:
      raise AssertionError("a launch without its constexprs was accepted")
    print("ok")
  """),
    interpret=False,
  )
  assert out.strip().endswith("ok")


def test_explicit_block_sizes_launch_what_the_defaults_do():
  """The public wrappers given their ``BlockSizes.get_default`` (the launch recorded, not
  run) launch exactly the calls they launch with no block sizes: X·U·V decode on each of
  its schedules (the fused kernel, phase 1 then XLA's GEMM, phase 1 then the ·V launch) and
  the grouped q/k/v kernel."""
  out = run_script(
    STUB
    + textwrap.dedent("""
    import jax.numpy as jnp
    from lrjax.custom_calls.triton import launch, xuv_decode, xuv_decode_group
    calls = []
    def record(*args, kernel, out_shape, grid, **kw):
      calls.append((kernel.__name__, grid, sorted((k, str(v)) for k, v in kw.items())))
      if not isinstance(out_shape, (list, tuple)):
        return jnp.zeros(out_shape.shape, out_shape.dtype)
      return tuple(jnp.zeros(s.shape, s.dtype) for s in out_shape)
    launch.triton_call = record
    for mod in (xuv_decode, xuv_decode_group):
      mod.num_sms = lambda: 132
    z = lambda *s: jnp.zeros(s, jnp.bfloat16)
    pvs = set()
    for m, k, r, n in ((2, 512, 200, 8200), (64, 512, 2000, 4096), (33, 8192, 200, 1024)):
      x, u, v = z(m, k), z(k, r), z(r, n)
      xuv_decode.xuv_decode(x, u, v, z(n))
      default, calls[:] = list(calls), []
      bs = xuv_decode.BlockSizes.get_default(m, k, r, n)
      xuv_decode.xuv_decode(x, u, v, z(n), block_sizes=bs)
      assert calls == default, (m, k, r, n, bs.pv)
      pvs.add(bs.pv)
      calls.clear()
    assert pvs == {"kernel", "xla", "launch"}, pvs
    members = [(z(512, 64), z(64, 256)), (z(512, 40), z(40, 128), z(128))]
    xuv_decode_group.xuv_decode_group(z(4, 512), members)
    default, calls[:] = list(calls), []
    bs = xuv_decode_group.BlockSizes.get_default(4, 512, [(64, 256), (40, 128)])
    xuv_decode_group.xuv_decode_group(z(4, 512), members, block_sizes=bs)
    assert calls == default and bs.pv == "kernel"
    print("ok")
  """),
    interpret=False,
  )
  assert out.strip().endswith("ok")
