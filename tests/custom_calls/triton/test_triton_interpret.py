"""Kernel logic on the CPU, in Triton's interpreter (``TRITON_INTERPRET=1``): runs wherever
triton is installed, GPU or not (``make test`` installs it where pip can), and skips
elsewhere saying why. Without jax-triton the kernel module imports against a stub of it
(nothing here launches through jax-triton).

The interpreter runs a grid's programs one after another, so a kernel runs in it only where
every wait is on programs that ran before: the decode X·U·V kernel's phase 1 alone
(``PV=False``, what ``pv="xla"`` and ``pv="launch"`` launch) on ``planner.plan_decode_phase1``'s
tiles, and the ·V launch after it (no waits); the
tiled decode kernel, whose stage-1 programs come first; the persistent one on a grid of one
program (and V-resident on one program a tile, phase 1's first); the grouped q/k/v kernel on
one program; the fused SwiGLU decode kernels the same two ways;
the two prefill kernels on one program, which claims their tiles in schedule order. The
whole decode kernels run as the second call of a scratch chain (launch.py): their scratch
in one half of a buffer, the other half left dirty, which they must zero.
It stands in for torch tensors with numpy arrays, and uses float16: the interpreter
multiplies bfloat16 as its uint16 storage."""

import importlib.util
import textwrap

import pytest
from conftest import split_plan_violations
from triton_offline import STUB, run_script

pytestmark = pytest.mark.skipif(
  importlib.util.find_spec("triton") is None,
  reason="needs triton (pip install 'lrjax[cuda]'); its interpreter runs on the CPU",
)

_PRELUDE = STUB + textwrap.dedent("""
  import numpy as np
  from triton.runtime import interpreter

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

  DTYPES = {}

  class Dtype:
    def __init__(self, name): self.name = name
    def __str__(self): return "torch." + self.name

  class T:  # the torch.Tensor methods the interpreter calls, on a numpy array in place
    def __init__(self, arr): self.set_(Storage(arr))
    def set_(self, storage, *_):
      self.arr, self.shape = storage.arr, storage.arr.shape
      # one object per dtype, as torch has: with a fresh Dtype per array, a pointer was now
      # and then typed as an earlier, freed Dtype's (f16 stores at f32 strides, past the
      # buffer: about 1 run in 20), as if triton's type lookup were keyed by object identity
      self.dtype = DTYPES.setdefault(self.arr.dtype.name, Dtype(self.arr.dtype.name))
      return self
    def data_ptr(self): return self.arr.ctypes.data
    def untyped_storage(self): return Storage(self.arr)
    def storage_offset(self): return 0
    def size(self): return self.arr.shape
    def stride(self, *_): return tuple(s // self.arr.itemsize for s in self.arr.strides)
    def new_empty(self, *_, **__): return T(np.empty(0, self.arr.dtype))
    def copy_(self, other): pass

  import dataclasses

  from lrjax.custom_calls.triton import planner, xuv_decode, xuv_decode_group, xuv_decode_pv
  rng = np.random.default_rng(0)
  f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
  r16 = lambda a: f64(a).astype(np.float16).astype(np.float64)  # the kernels' one rounding

  def rand(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float16)

  def factors(k, r, n, bias):  # u [K, r], v [r, N], the bias (v where none: never read)
    u, v = rand(k, r, scale=k ** -0.5), rand(r, n, scale=r ** -0.5)
    return u, v, (rand(n) if bias else v)

  def xuv_ref(x, u, v, b, bias):  # round(x·u)·v (+ b) in float64
    return r16(f64(x) @ f64(u)) @ f64(v) + (f64(b) if bias else 0.0)

  def chained(n):  # a scratch chain's buffer (launch.py) as a call finds it: this call's
    # half of n floats zeroed, after the half the call before it used, left dirty
    half = -(-n // 16) * 16
    buf = np.zeros(2 * half, np.float32)
    buf[:half] = 7.0
    return buf, (0, half), {"WORK_OFF": half}  # clear_off, clear_n; the constexpr

  def check_cleared(buf, args):  # the call zeroed the half the one before it used
    clear_off, clear_n = args
    assert not buf[clear_off:clear_off + clear_n].any(), "the chain's other half is dirty"

  def check(out, ref, tol, what):  # every element written, and close to the reference
    assert not np.isnan(out).any(), (what, "unwritten elements")
    err = np.abs(f64(out) - ref).max() / np.abs(ref).max()
    assert err < tol, (what, err)
    return err
""")

_PHASE1 = textwrap.dedent("""
  for (m, k, r, n, programs) in SHAPES:
    p = dataclasses.replace(planner.plan_decode_phase1(m, k, r, n, programs=programs), **FIELDS)
    plan = xuv_decode.persistent_launch_plan(m, k, r, n, False, p, pv=False)
    x, u = rand(m, k), rand(k, r, scale=k ** -0.5)
    v = np.zeros((r, n), np.float16)  # never read: no phase 2
    # zeroed as the chain zeroes it, with 64 floats past the plan's scratch that must stay 0
    scratch = np.zeros(plan["scratch"] + 64, np.float32)
    p16 = np.full(plan["p16"], np.nan, np.float16)  # poisoned: every element must be written
    xuv_decode._xuv_decode_persistent_kernel[(plan["grid"],)](
        T(x), T(u), T(v), T(v), T(x), m, 0, 0, T(scratch), T(np.zeros(1, np.float16)),
        T(p16),
        **plan["meta"])
    assert (scratch[plan["scratch"]:] == 0).all(), (m, k, r, "written past the scratch")
    if p.p16:  # f16 split-K sums, rounded once
      err = check(p16.reshape(m, r), f64(x) @ f64(u), 2e-3, (m, k, r, "P"))
    else:  # the f32 sums, the whole scratch: no flag or counter (xuv_decode hands P to XLA)
      assert plan["meta"]["P16"] is False and np.isnan(p16).all(), "p16 written without P16"
      assert plan["scratch"] == m * r, (m, k, r, plan["scratch"])
      err = check(scratch[:m * r].reshape(m, r), f64(x) @ f64(u), 1e-5, (m, k, r, "P f32"))
    # the r-chunk's flag after the scratch's P: no phase 2 waits on it, so no tile signals
    flag = scratch[m * r:m * r + 1].view(np.int32)[0]
    assert flag == 0, (m, k, r, "phase 1 alone signalled its r-chunk", flag)
    print(m, k, r, plan["grid"], p.cols_r, p.k_per, plan["meta"]["SPLIT_K"], f"{err:.1e}")
  print("ok")
""")

# The whole decode X·U·V: the tiled kernel (its stage-1 programs come first, so each stage-2
# program finds its chunk of P complete) and the persistent one on a grid of one program (it
# runs every phase-1 tile, then every phase-2 tile), with a bias, r-chunks (the f32 output
# accumulator and its semaphores) and P rounded once (P16). Scratch zeroed as XLA zeroes it;
# the output and the rounded P poisoned.
_WHOLE = textwrap.dedent("""
  def run(kernel, plan, m, k, r, n, bias):
    x = rand(m, k)
    u, v, b = factors(k, r, n, bias)
    scratch, chain, work = chained(plan["scratch"])
    out = np.full((m, n), np.nan, np.float16)
    p16 = np.full(plan["p16"], np.nan, np.float16)
    kernel[(plan["grid"],)](T(x), T(u), T(v), T(b), T(x), m, *chain, T(scratch), T(out),
                            T(p16), **plan["meta"], **work)
    check_cleared(scratch, chain)
    return check(out, xuv_ref(x, u, v, b, bias), 5e-3, (m, k, r, n))

  for (m, k, r, n, bias, fields) in PERSISTENT:
    p = planner.plan_decode_persistent(m, k, r, n, programs=1)  # no L2 prefetch: inline asm
    p = dataclasses.replace(p, prefetch=0, **fields)
    if p.v_resident:  # the planned V-resident tiles, one program each (phase 1's first)
      p = planner.plan_decode_persistent(m, k, r, n)
      assert p.v_resident, p
      p = dataclasses.replace(p, programs=planner.cdiv(r, p.cols_r) * planner.cdiv(k, p.k_per)
                              + planner.cdiv(n, p.cols_n))
    plan = xuv_decode.persistent_launch_plan(m, k, r, n, bias, p)
    err = run(xuv_decode._xuv_decode_persistent_kernel, plan, m, k, r, n, bias)
    print("persistent", m, k, r, n, plan["chunks"], p.p16, f"{err:.1e}")
  for (m, k, r, n, bias, fields) in TILED:
    bs = dataclasses.replace(xuv_decode.TiledBlockSizes.get_default(m, k, r, n), **fields)
    plan = xuv_decode.launch_plan(m, k, r, n, bias, bs)
    err = run(xuv_decode._xuv_decode_kernel, plan, m, k, r, n, bias)
    print("tiled", m, k, r, n, plan["grid"], plan["chunks"], f"{err:.1e}")
  for (m, k, members) in GROUPS:  # [(r_i, n_i, bias_i)]: the grouped kernel on one program
    p = dataclasses.replace(planner.plan_decode_group(m, k, [(r, n) for r, n, _ in members],
                                                      programs=1), prefetch=0)
    plan = xuv_decode_group.launch_plan(m, k, members, p)
    x = rand(m, k)
    ops, outs, refs = [], [], []
    for r, n, bias in members:
      u, v, b = factors(k, r, n, bias)
      ops += [u, v, b]
      outs.append(np.full((m, n), np.nan, np.float16))
      refs.append(xuv_ref(x, u, v, b, bias))
    ops += ops[-3:] * (3 - len(members))  # two members: the third repeats the second
    outs3 = outs + [np.full_like(outs[-1], np.nan)] * (3 - len(members))
    scratch, chain, work = chained(plan["scratch"])
    xuv_decode_group._xuv_decode_group_kernel[(1,)](
        T(x), *map(T, ops), T(x), T(scratch), T(x), T(x), T(x), m, *chain, T(scratch),
        *map(T, outs3), **plan["meta"], **work)
    check_cleared(scratch, chain)
    for i, (out, ref) in enumerate(zip(outs, refs)):
      err = check(out, ref, 5e-3, (m, k, members, i))
    print("group", m, k, members, f"{err:.1e}")
  # a stream-K plan it cannot run is refused by name (here: rounded P, fewer steps than CTAs)
  sk = dataclasses.replace(planner.plan_decode_persistent(2, 4096, 2560, 14336), stream_k=True,
                           block_r=128, cols_r=128, r_chunks=1)
  for bad in (dict(p16=True), dict(programs=10 ** 6)):
    try:
      xuv_decode.persistent_launch_plan(2, 4096, 2560, 14336, False,
                                        dataclasses.replace(sk, **bad))
    except ValueError as e:
      assert "stream_k needs" in str(e), e
    else:
      raise AssertionError(f"{bad}: not refused")
  print("ok")
""")

# The fused SwiGLU kernels, gated with silu, with and without biases: the tiled decode kernel
# (stage A's programs, then B's, then C's), the persistent one on a grid of one program, and
# the prefill kernel on one program (schedule order, as _PREFILL).
_MLP = textwrap.dedent("""
  from lrjax.custom_calls.triton import mlp_decode, mlp_prefill

  def operands(m, d, f, r, bias):  # x and (ug, vg, bg), (uu, vu, bu), (ud, vd, bd)
    x = rand(m, d)
    return x, factors(d, r, f, bias), factors(d, r, f, bias), factors(f, r, d, bias)

  def mlp_ref(x, gate, up, down, bias):  # the kernels' roundings: X·U, h and h·Ud
    g, u = xuv_ref(x, *gate, bias), xuv_ref(x, *up, bias)
    return xuv_ref(r16(g / (1 + np.exp(-g)) * u), *down, bias)

  def run(kernel, plan, m, d, f, r, bias):  # a decode kernel: scratch, output, rounded P
    x, gate, up, down = operands(m, d, f, r, bias)
    scratch, chain, work = chained(plan["scratch"])
    out = np.full((m, d), np.nan, np.float16)
    p16 = np.full(plan["p16"], np.nan, np.float16)
    g = (T(x),) if kernel is mlp_decode._mlp_decode_kernel else ()  # its norm weight, unread
    kernel[(plan["grid"],)](T(x), *map(T, gate + up + down), T(x), *g, m, *chain, T(scratch),
                            T(out), T(p16), **plan["meta"], **work)
    check_cleared(scratch, chain)
    return check(out, mlp_ref(x, gate, up, down, bias), 1e-2, (m, d, f, r))

  for (m, d, f, r, bias, fields) in PERSISTENT:
    p = planner.plan_mlp_decode_persistent(m, d, f, r, r, d, True, programs=1)
    p = dataclasses.replace(p, prefetch=0, prefetch_c=0, **fields)  # prefetch: inline asm
    plan = mlp_decode.persistent_launch_plan(m, d, r, f, r, d, gated=True, act="silu",
                                             bias_mask=(bias,) * 3, p=p)
    err = run(mlp_decode._mlp_decode_persistent_kernel, plan, m, d, f, r, bias)
    print("persistent", m, d, f, r, p.c_chunks, p.p16, f"{err:.1e}")
  VARIANT = {f.name for f in dataclasses.fields(mlp_decode.Variant)}
  for (m, d, f, r, bias, fields) in TILED:
    var = mlp_decode.Variant(**{k: v for k, v in fields.items() if k in VARIANT})
    fields = {k: v for k, v in fields.items() if k not in VARIANT}
    bs = dataclasses.replace(mlp_decode.BlockSizes.get_default(m, d, f, r, d), **fields)
    plan = mlp_decode.launch_plan(m, d, r, f, r, d, gated=True, act="silu",
                                  bias_mask=(bias,) * 3, bs=bs, variant=var)
    err = run(mlp_decode._mlp_decode_kernel, plan, m, d, f, r, bias)
    print("tiled", m, d, f, r, plan["grid"], bs.p16, bs.park_h, f"{err:.1e}")
  for (m, d, f, r, bias, fields) in PREFILL:  # one program, schedule order (see _PREFILL)
    bs = dataclasses.replace(mlp_prefill.BlockSizes.get_default(m, d, f, r, r, True),
                             programs=1, **fields)
    plan = mlp_prefill.launch_plan(m, d, r, f, r, d, gated=True, act="silu",
                                   bias_mask=(bias,) * 3, bs=bs)
    x, gate, up, down = operands(m, d, f, r, bias)
    rr, out = plan["ring_rows"], np.full((m, d), np.nan, np.float16)
    rings = [np.full((rr, 2 * r), np.nan, np.float16), np.full((rr, f), np.nan, np.float16),
             np.full((rr, r), np.nan, np.float16), np.zeros(plan["sacc_shape"], np.float32),
             np.zeros(plan["n_flags"], np.int32)]
    mlp_prefill._mlp_prefill_kernel[(plan["programs"],)](
        T(x), *map(T, gate + up + down), T(np.asarray(plan["sched"])), T(x), *map(T, rings),
        T(out), **plan["meta"])
    err = check(out, mlp_ref(x, gate, up, down, bias), 1e-2, (m, d, f, r, "prefill"))
    print("prefill", m, d, f, r, plan["n_mb"], rr, f"{err:.1e}")
  print("ok")
""")


# The prefill X·U·V kernel on a grid of one program: it claims every tile of the schedule in
# order (step s: A(super-block s), then D(s - 1)), so each wait is on its own earlier work as
# long as the ring has two slots or more (A(s) waits for D(s - RING)); a two-slot ring of one
# row block each makes every third row block reuse a slot.
_PREFILL = textwrap.dedent("""
  from lrjax.custom_calls.triton import xuv_prefill

  for (m, k, r, n, bias, fields) in PREFILL:
    bs = dataclasses.replace(xuv_prefill.BlockSizes.get_default(m, k, r, n), programs=1,
                             **fields)
    plan = xuv_prefill.launch_plan(m, k, r, n, bias, bs)
    x = rand(m, k)
    u, v, b = factors(k, r, n, bias)
    ring = np.full((plan["ring_rows"], r), np.nan, np.float16)
    counters = np.zeros(plan["n_mb"] + 1, np.int32)
    flags = np.zeros(plan["n_mb"], np.int32)
    out = np.full((m, n), np.nan, np.float16)
    sched = np.asarray(plan["sched"])
    xuv_prefill._xuv_prefill_kernel[(plan["programs"],)](
        T(x), T(u), T(v), T(b), T(sched), T(x), T(ring), T(counters), T(flags), T(out),
        **plan["meta"])
    err = check(out, xuv_ref(x, u, v, b, bias), 5e-3, (m, k, r, n))
    print("prefill", m, k, r, n, plan["n_mb"], plan["ring_rows"], f"{err:.1e}")
  print("ok")
""")


# The norm in the kernels (NORM): the grouped kernel on one program and the tiled SwiGLU
# kernel stream X·g and scale P's rows by rms_norm's 1/rms (lowering/rms_norm.py); the
# reference rounds as the model does (x·rs to f16, then ·g to f16). Each case also checks
# that the un-normalised result would fail, so the test sees the norm.
_NORM = textwrap.dedent("""
  from lrjax.custom_calls.triton import mlp_decode

  def normed(x, g, eps):
    x32 = x.astype(np.float32)
    ms = (x32 * x32).sum(-1, keepdims=True, dtype=np.float32) / np.float32(x.shape[-1])
    y = (x32 / np.sqrt(ms + np.float32(eps))).astype(np.float16)
    return (y.astype(np.float32) * g.astype(np.float32)).astype(np.float16)

  def check_normed(out, ref, raw, tol, what):
    err = check(out, ref, tol, what)
    assert np.abs(raw - ref).max() / np.abs(ref).max() > 10 * tol, (what, "x barely changed")
    return err

  for (m, k, members, eps) in GROUPS:
    p = dataclasses.replace(planner.plan_decode_group(m, k, [(r, n) for r, n, _ in members],
                                                      programs=1), prefetch=0)
    plan = xuv_decode_group.launch_plan(m, k, members, p)
    plan["meta"].update(NORM=1, EPS=eps)
    x, g = rand(m, k, scale=3.0), rand(k)
    xn = normed(x, g, eps)
    ops, outs, refs, raws = [], [], [], []
    for r, n, bias in members:
      u, v, b = factors(k, r, n, bias)
      ops += [u, v, b]
      outs.append(np.full((m, n), np.nan, np.float16))
      refs.append(xuv_ref(xn, u, v, b, bias))
      raws.append(xuv_ref(x, u, v, b, bias))
    ops += ops[-3:] * (3 - len(members))
    outs3 = outs + [np.full_like(outs[-1], np.nan)] * (3 - len(members))
    scratch, chain, work = chained(plan["scratch"])
    xuv_decode_group._xuv_decode_group_kernel[(1,)](
        T(x), *map(T, ops), T(g), T(scratch), T(x), T(x), T(x), m, *chain, T(scratch),
        *map(T, outs3), **plan["meta"], **work)
    for i, (out, ref, raw) in enumerate(zip(outs, refs, raws)):
      err = check_normed(out, ref, raw, 5e-3, (m, k, members, i))
    print("group", m, k, members, eps, f"{err:.1e}")
  for (m, d, f, r, eps, fields) in MLPS:
    bs = dataclasses.replace(mlp_decode.BlockSizes.get_default(m, d, f, r, d), **fields)
    plan = mlp_decode.launch_plan(m, d, r, f, r, d, gated=True, act="silu",
                                  bias_mask=(False,) * 3, bs=bs)
    plan["meta"].update(NORM=1, EPS=eps)
    x, g = rand(m, d, scale=3.0), rand(d)
    gate, up, down = (factors(d, r, f, False), factors(d, r, f, False),
                      factors(f, r, d, False))
    scratch, chain, work = chained(plan["scratch"])
    out = np.full((m, d), np.nan, np.float16)
    p16 = np.full(plan["p16"], np.nan, np.float16)
    mlp_decode._mlp_decode_kernel[(plan["grid"],)](
        T(x), *map(T, gate + up + down), T(x), T(g), m, *chain, T(scratch), T(out), T(p16),
        **plan["meta"], **work)

    def ref(a):  # the kernel's roundings: X·U, h and h·Ud
      gg, uu = xuv_ref(a, *gate, False), xuv_ref(a, *up, False)
      return xuv_ref(r16(gg / (1 + np.exp(-gg)) * uu), *down, False)

    err = check_normed(out, ref(normed(x, g, eps)), ref(x), 1e-2, (m, d, f, r))
    print("mlp", m, d, f, r, eps, bs.p16, bs.park_h, f"{err:.1e}")
  print("ok")
""")


# The residual epilogue (HAS_BIAS / HAS_BD = RESIDUAL): the kernel's bias operand is an
# [M, N] residual added as each output tile is stored. The interpreter runs a grid's programs
# in order, so a kernel run twice sums its partials in the same order: the output with the
# residual must be the plain output rounded, plus the residual in f32, rounded (what XLA's
# add computes), bit for bit. Each case also checks that the residual changed the output.
_RESIDUAL = textwrap.dedent("""
  from lrjax.custom_calls.triton import mlp_decode
  from lrjax.custom_calls.triton._common import RESIDUAL

  def both(launch, m, n, meta, key):  # (plain output, output with the residual, residual)
    res = rand(m, n, scale=4.0)
    outs = []
    for mode, b in ((0, None), (RESIDUAL.value, res)):
      out = np.full((m, n), np.nan, np.float16)
      launch(out, b, dict(meta, **{key: mode}))
      outs.append(out)
    return outs[0], outs[1], res

  def xuv_launch(kernel, plan, m, k, r, n):  # launch(out, residual | None, meta), one input
    x, (u, v, _) = rand(m, k), factors(k, r, n, False)

    def launch(out, b, meta):
      scratch, chain, work = chained(plan["scratch"])
      p16 = np.full(plan["p16"], np.nan, np.float16)
      kernel[(plan["grid"],)](T(x), T(u), T(v), T(v if b is None else b), T(x), m, *chain,
                              T(scratch), T(out), T(p16), **meta, **work)

    return launch

  def check_added(plain, got, res, what):
    assert not np.isnan(plain).any(), (what, "unwritten elements")
    want = (plain.astype(np.float32) + res.astype(np.float32)).astype(np.float16)
    assert np.array_equal(got, want), (what, np.abs(f64(got) - f64(want)).max())
    assert np.abs(f64(got) - f64(plain)).max() > 1.0, (what, "the residual changed nothing")

  for (m, k, r, n, fields) in PERSISTENT:
    p = dataclasses.replace(planner.plan_decode_persistent(m, k, r, n, programs=1), prefetch=0,
                            **fields)
    if p.v_resident:  # one program a tile, phase 1's first (as _WHOLE)
      p = planner.plan_decode_persistent(m, k, r, n)
      p = dataclasses.replace(p, programs=planner.cdiv(r, p.cols_r) * planner.cdiv(k, p.k_per)
                              + planner.cdiv(n, p.cols_n))
    plan = xuv_decode.persistent_launch_plan(m, k, r, n, False, p)
    launch = xuv_launch(xuv_decode._xuv_decode_persistent_kernel, plan, m, k, r, n)
    check_added(*both(launch, m, n, plan["meta"], "HAS_BIAS"), ("persistent", m, k, r, n))
  for (m, k, r, n) in TILED:
    plan = xuv_decode.launch_plan(m, k, r, n, False,
                                  xuv_decode.TiledBlockSizes.get_default(m, k, r, n))
    launch = xuv_launch(xuv_decode._xuv_decode_kernel, plan, m, k, r, n)
    check_added(*both(launch, m, n, plan["meta"], "HAS_BIAS"), ("tiled", m, k, r, n))
  for (m, r, n) in PV:
    pp = planner.plan_pv_launch(m, r, n)
    pf = rng.standard_normal((m * r,)).astype(np.float32)
    _, v, _ = factors(8, r, n, False)
    grid = (planner.cdiv(n, pp.block_n), planner.cdiv(m, pp.block_m))

    def launch(out, b, meta):
      xuv_decode_pv._xuv_decode_pv_kernel[grid](T(pf), T(v), T(v if b is None else b), T(v),
                                                m, T(out), **meta, READ_OFF=0, PDL=0)

    check_added(*both(launch, m, n, xuv_decode_pv.launch_meta(r, n, False, pp), "HAS_BIAS"),
                ("pv", m, r, n))
  for (m, d, f, r, persistent, fields) in MLPS:
    kw = dict(gated=True, act="silu", bias_mask=(False,) * 3)
    if persistent:
      pl = dataclasses.replace(planner.plan_mlp_decode_persistent(m, d, f, r, r, d, True,
                                                                   programs=1),
                               prefetch=0, prefetch_c=0, **fields)
      plan = mlp_decode.persistent_launch_plan(m, d, r, f, r, d, p=pl, **kw)
      kernel, g = mlp_decode._mlp_decode_persistent_kernel, ()
    else:
      names = {f.name for f in dataclasses.fields(mlp_decode.Variant)}
      var = mlp_decode.Variant(**{a: b for a, b in fields.items() if a in names})
      bs = dataclasses.replace(mlp_decode.BlockSizes.get_default(m, d, f, r, d),
                               **{a: b for a, b in fields.items() if a not in names})
      plan = mlp_decode.launch_plan(m, d, r, f, r, d, bs=bs, variant=var, **kw)
      kernel = mlp_decode._mlp_decode_kernel
    x = rand(m, d)
    g = () if persistent else (T(x),)  # the tiled kernel's norm weight, unread
    gate, up, (ud, vd, _) = factors(d, r, f, False), factors(d, r, f, False), factors(f, r, d,
                                                                                      False)

    def launch(out, b, meta):
      scratch, chain, work = chained(plan["scratch"])
      p16 = np.full(plan["p16"], np.nan, np.float16)
      kernel[(plan["grid"],)](T(x), *map(T, gate + up), T(ud), T(vd),
                              T(vd if b is None else b), T(x), *g, m, *chain, T(scratch),
                              T(out), T(p16), **meta, **work)

    check_added(*both(launch, m, d, plan["meta"], "HAS_BD"), ("mlp", m, d, f, r, fields))
  print("ok")
""")


def test_residual_epilogue_of_the_decode_kernels():
  """y + residual as the decode X·U·V kernels (persistent, tiled, the ·V launch) and the
  fused SwiGLU kernels (tiled, persistent) store y: bit for bit XLA's add of the rounded y,
  with r-chunks and split-r stage C (the residual added once, by the last arrival)."""
  persistent = [  # (M, K, r, N, plan fields replaced)
    (1, 200, 72, 130, {}),
    (3, 640, 1100, 300, {"cols_n": 48, "block_n": 64, "r_chunks": 3, "p16": True}),
    (3, 1000, 200, 300, {"v_resident": True}),
  ]
  tiled = [(5, 300, 200, 260)]
  pv = [(1, 72, 130), (77, 136, 200)]
  mlps = [  # (M, D, F, r, persistent, fields)
    (1, 200, 520, 72, False, {}),
    (7, 320, 700, 136, False, {"c_chunks": 2}),
    (20, 320, 700, 136, False, {"park_h": True, "c_resident": True, "block_n": 64}),
    (3, 320, 700, 136, True, {"c_chunks": 3, "cols_n": 48, "block_n": 64}),
  ]
  _interpret(
    f"PERSISTENT = {persistent!r}\nTILED = {tiled!r}\nPV = {pv!r}\nMLPS = {mlps!r}\n"
    + _PRELUDE
    + _RESIDUAL
  )


def test_norm_of_the_grouped_and_swiglu_kernels():
  """rms_norm(X) as the grouped q/k/v and the tiled SwiGLU decode kernels load X: ragged K
  and D (the statistics' last step masked), rows past M, epsilons small and large."""
  groups = [  # (M, K, [(r_i, N_i, bias_i)], eps)
    (8, 1000, [(136, 520, True), (72, 130, False), (72, 130, True)], 1e-5),
    (1, 200, [(96, 300, False), (40, 64, True)], 1e-6),
    (3, 256, [(64, 128, False), (64, 128, False), (64, 64, False)], 0.5),
  ]
  mlps = [  # (M, D, F, r, eps, block fields replaced)
    (1, 200, 520, 72, 1e-5, {}),
    (5, 256, 1000, 96, 1e-6, {"p16": True}),
    (20, 320, 700, 136, 0.5, {"park_h": True, "h_splits": 3}),
  ]
  _interpret(f"GROUPS = {groups!r}\nMLPS = {mlps!r}\n" + _PRELUDE + _NORM)


def _interpret(script: str) -> str:
  return run_script(script, interpret=True)


@pytest.mark.parametrize(
  "shapes",
  [
    # (M, K, r, N, CTAs): 64-column tiles over several K ranges; ragged K and r; r > 1024 on
    # 64-column tiles (fewer partials) and on 112 of 128 columns (phase1_balance_cols);
    # a grid smaller than the tiles (each CTA loops)
    [
      (64, 384, 136, 200, 132),
      (100, 320, 256, 384, 132),
      (128, 1000, 200, 96, 16),
      (64, 640, 1100, 64, 132),
      (16, 512, 1100, 64, 40),
      (77, 200, 72, 130, 7),
    ],
  ],
)
def test_decode_phase1_alone_on_its_planned_tiles(shapes):
  """P = X·U from the phase-1-only decode kernel, its f32 sums the whole scratch, equals the
  f64 product at f32's tolerance, and nothing is written past P (no flag is signalled)."""
  out = _interpret(f"SHAPES = {shapes!r}\nFIELDS = {{}}\n" + _PRELUDE + _PHASE1)
  cols = {
    tuple(map(int, ln.split()[:3])): int(ln.split()[4]) for ln in out.splitlines() if ln != "ok"
  }
  assert cols[(16, 512, 1100)] == 112 and cols[(64, 640, 1100)] == 64, cols


def test_decode_phase1_alone_rounds_p_itself_with_p16():
  """``p16`` on (the plan's default is off): the last split-K tile of each column block
  rounds P = X·U once into the p16 buffer, close to the f64 product at f16's tolerance."""
  shapes = [(64, 384, 136, 200, 132), (77, 200, 72, 130, 7), (128, 640, 1100, 64, 132)]
  _interpret(f"SHAPES = {shapes!r}\nFIELDS = {{'p16': True}}\n" + _PRELUDE + _PHASE1)


def test_grouped_phase1_alone_leaves_every_members_p():
  """``_xuv_decode_group(pv="xla")``: the grouped kernel with no phase-2 tiles leaves each
  member's P_i = X·U_i as f32 sums side by side in its scratch (P_0 first), equal to the f64
  product at f32's tolerance, and writes no output; on ``plan_decode_group_phase1``'s tiles
  over a grid of 3, 5 and 7 programs (several tiles each), K, r and M ragged, 2 and 3
  members; members of one rank also through the kernel's one phase-1 call site (ONE)."""
  _interpret(
    _PRELUDE
    + textwrap.dedent("""
    for m, k, rs, programs, one in ((65, 1000, (200, 200), 7, False),
                                    (65, 1000, (200, 200), 7, True),
                                    (128, 200, (72, 72, 40), 3, False),
                                    (33, 300, (72, 72, 72), 5, True),
                                    (1, 640, (136, 72), 7, False)):
      members = [(r, 64, False) for r in rs]
      p = planner.plan_decode_group_phase1(m, k, [(r, n) for r, n, _ in members],
                                           programs=programs, one_branch=one)
      plan = xuv_decode_group.launch_plan(m, k, members, p, phase2=False)
      assert plan["meta"]["PREFETCH"] == 0 and not any(plan["meta"][f"Q{i}"] for i in range(3))
      assert plan["meta"]["ONE"] == int(one)
      x = rand(m, k)
      us = [rand(k, r, scale=k ** -0.5) for r in rs]
      ops = []
      for u in us + us[-1:] * (3 - len(rs)):  # two members: the third repeats the second
        v = np.zeros((u.shape[1], 64), np.float16)  # never read: no phase 2
        ops += [u, v, v]
      scratch = np.zeros(plan["scratch"], np.float32)
      outs = [np.full((1,), np.nan, np.float16) for _ in range(3)]  # never written
      xuv_decode_group._xuv_decode_group_kernel[(p.programs,)](
          T(x), *map(T, ops), T(x), T(scratch), T(x), T(x), T(x), m, 0, 0, T(scratch),
          *map(T, outs),
          **plan["meta"])
      off = 0
      for i, u in enumerate(us):
        err = check(scratch[off:off + m * u.shape[1]].reshape(m, -1), f64(x) @ f64(u), 1e-5,
                    (m, k, rs, i))
        off += m * u.shape[1]
      assert all(np.isnan(o).all() for o in outs), "an output written without phase 2"
      print(m, k, rs, p.programs, p.cols_r, p.k_per, one, f"{err:.1e}")
    p = planner.plan_decode_group_phase1(8, 256, [(64, 64), (64, 64)], one_branch=True)
    try:  # one call site for members of two ranks
      xuv_decode_group.launch_plan(8, 256, [(64, 64, False), (32, 64, False)], p, phase2=False)
    except ValueError as e:
      assert "one_branch" in str(e), e
    else:
      raise AssertionError("a one_branch plan was launched on members of two ranks")
    print("ok")
  """)
  )


def test_pv_launch_reads_f32_p_at_its_offset_and_writes_every_element():
  """``_xuv_decode_pv_kernel`` (``pv="launch"``): y = round(P)·V (+ bias) from f32 P that sits at
  READ_OFF floats into a buffer of dirt (a chained scratch's half), on the planner's tiles and
  on ragged 16 x 16 ones with r not a multiple of the step; the output poisoned."""
  _interpret(
    _PRELUDE
    + textwrap.dedent("""
    for m, r, n, bias, fields in ((1, 72, 130, True, {}), (77, 136, 200, False,
                                  dict(block_m=16, block_n=16, block_kv=32)),
                                  (128, 100, 96, True, {}), (64, 256, 520, False, {})):
      pp = dataclasses.replace(planner.plan_pv_launch(m, r, n), **fields)
      pf = rng.standard_normal((m, r)).astype(np.float32)
      off = 48
      buf = np.full(off + m * r + 32, 7.0, np.float32)
      buf[off:off + m * r] = pf.reshape(-1)
      _, v, b = factors(8, r, n, bias)
      out = np.full((m, n), np.nan, np.float16)
      meta = xuv_decode_pv.launch_meta(r, n, bias, pp)
      grid = (planner.cdiv(n, pp.block_n), planner.cdiv(m, pp.block_m))
      xuv_decode_pv._xuv_decode_pv_kernel[grid](T(buf), T(v), T(b), T(v), m, T(out), **meta,
                                                READ_OFF=off, PDL=0)
      want = r16(pf) @ f64(v) + (f64(b) if bias else 0.0)
      err = check(out, want, 5e-3, (m, r, n, fields))
      print(m, r, n, pp, f"{err:.1e}")
    print("ok")
  """)
  )


STREAM_K = dict(stream_k=True, r_chunks=1, p16=False, v_resident=False)


def test_whole_decode_kernels_on_ragged_shapes():
  """Y = round(X·U)·V (+ bias) from the persistent, the tiled and the grouped decode kernels."""
  persistent = [  # (M, K, r, N, bias, plan fields replaced)
    (1, 200, 72, 130, True, {}),
    (7, 1000, 96, 520, True, {"p16": True}),
    (16, 512, 256, 1024, False, {"block_r": 64, "cols_r": 64, "r_chunks": 2}),
    (3, 640, 1100, 300, True, {"cols_n": 48, "block_n": 64, "r_chunks": 3, "p16": True}),
    # V-resident phase 2 (V in registers before the wait): ragged K, r and N
    (3, 1000, 200, 300, True, {"v_resident": True}),
    (1, 512, 40, 96, False, {"v_resident": True}),
    # stream-K phase 1 (one program runs every step: each run of a column block flushes)
    (3, 1000, 200, 300, True, dict(STREAM_K, block_r=64, cols_r=64, block_n=64, cols_n=48)),
    (16, 512, 256, 1024, False, dict(STREAM_K, block_r=128, cols_r=128)),
  ]
  tiled = [
    (1, 200, 72, 130, True, {}),
    (5, 300, 200, 260, False, {}),
    (
      7,
      1000,
      96,
      520,
      True,
      {"block_r": 32, "split_k": 3, "block_n": 32, "block_kv": 32, "r_chunks": 3},
    ),
  ]
  groups = [
    (8, 1000, [(136, 520, True), (72, 130, False), (72, 130, True)]),
    (1, 200, [(96, 300, False), (40, 64, True)]),
  ]
  _interpret(
    f"PERSISTENT = {persistent!r}\nTILED = {tiled!r}\nGROUPS = {groups!r}\n" + _PRELUDE + _WHOLE
  )


def test_fused_swiglu_kernels_on_ragged_shapes():
  """Y = (silu(X·Ug·Vg) * X·Uu·Vu)·Ud·Vd (+ biases) from the tiled and persistent decode
  kernels and the prefill kernel."""
  persistent = [  # (M, D, F, r, biases, plan fields replaced)
    (1, 200, 520, 72, True, {}),
    (5, 256, 1000, 96, False, {"p16": True}),
    (3, 320, 700, 136, True, {"c_chunks": 3, "cols_n": 48, "block_n": 64}),
  ]
  tiled = [
    (1, 200, 520, 72, True, {}),
    (5, 256, 1000, 96, False, {"p16": True}),
    (7, 320, 700, 136, True, {"c_chunks": 2}),
    # U_d in 128-column chunks (the default where D_ff's slices outnumber the SMs):
    # two flushes of S per slice, the second ragged
    (3, 320, 700, 136, True, {"block_f": 128, "block_rd": 128, "num_stages": 4}),
    # h parked for stage H: ragged D_ff and r_d blocks, several D_ff splits
    (33, 320, 700, 136, True, {"park_h": True, "block_h": 64, "h_splits": 3}),
    (5, 256, 1000, 96, False, {"park_h": True, "p16": False, "c_chunks": 2}),
    # slices narrower than the block (cols_f < block_f, the rest masked): a ragged
    # last slice; then with h parked, D_ff splits of whole slices
    (4, 256, 1000, 96, True, {"block_f": 128, "cols_f": 112}),
    (20, 320, 700, 136, False, {"park_h": True, "cols_f": 48, "h_splits": 3}),
    # stage H run by the stage-B CTAs (h_inline), on splits of one slice each (the
    # interpreter runs programs one after another, so a CTA may wait only for
    # itself): each loops over its split's r_d blocks, the last one ragged
    (5, 256, 1000, 96, True, {"park_h": True, "h_inline": True, "block_h": 32, "h_splits": 16}),
    (20, 320, 700, 136, False, {"park_h": True, "h_inline": True, "block_h": 64, "h_splits": 11}),
    # the default blocks where D_ff's 128-wide slices (133, the last ragged) outnumber
    # the H200's SMs: h parked at one token too, stage H in four times the splits
    # (here one slice each, 133 of them)
    (1, 64, 17000, 64, False, {}),
    (2, 64, 17000, 64, True, {}),
    # Pg/Pu consumed in three chunks (T <= 16 defaults to one where stage A's CTAs fit
    # the SMs): 64-column rank blocks, two a chunk, the last chunk ragged (264 = 4 x 64
    # + 8)
    (3, 320, 700, 264, True, {"a_chunks": 4, "block_r": 64}),
    # stage C with its V_d chunk held in registers before the wait (c_resident): two
    # chunks, the last ragged (72 = 64 + 8), ragged column blocks; one chunk padded
    # (96 rows in a 128-row tile); h parked, three chunks of 64-column blocks
    (1, 200, 520, 72, True, {"c_resident": True}),
    (5, 256, 1000, 96, False, {"c_resident": True, "c_chunks": 1}),
    (20, 320, 700, 136, True, {"park_h": True, "c_resident": True, "block_n": 64}),
  ]
  prefill = [
    (200, 256, 520, 72, True, {}),
    (300, 320, 700, 136, False, {"block_m": 64, "group_m": 1, "split_c": 2}),
  ]
  _interpret(
    f"PERSISTENT = {persistent!r}\nTILED = {tiled!r}\nPREFILL = {prefill!r}\n" + _PRELUDE + _MLP
  )


def test_prefill_xuv_kernel_with_its_ring_reused():
  """Y = round(X·U)·V (+ bias) from the prefill kernel: several row blocks, ragged K, r and
  N, and a two-slot ring the row blocks take turns in."""
  prefill = [  # (M, K, r, N, bias, block sizes replaced)
    (200, 320, 136, 200, True, {}),
    (
      333,
      200,
      72,
      130,
      False,
      {"block_m": 64, "block_n": 64, "block_k": 32, "group_m": 1, "ring": 2},
    ),
  ]
  _interpret(f"PREFILL = {prefill!r}\n" + _PRELUDE + _PREFILL)


def test_resident_stage_c_refuses_a_chunk_too_large_for_registers():
  """Variant.c_resident holds a stage-C CTA's whole V_d chunk in registers: a plan whose
  chunk (padded to a power of two) times block_n exceeds C_RESIDENT_MAX is refused, naming
  the limit and the way out; ten 128-row chunks of Llama-3.2-1B's r_d = 1280 fit."""
  run_script(
    STUB
    + textwrap.dedent("""
    import dataclasses
    from lrjax.custom_calls.triton import mlp_decode
    kw = dict(gated=True, act="silu", bias_mask=(False, False, False))
    bs = mlp_decode.BlockSizes.get_default(1, 2048, 8192, 1280, 2048)
    kw["variant"] = mlp_decode.Variant(c_resident=True)
    try:
      mlp_decode.launch_plan(1, 2048, 1280, 8192, 1280, 2048, bs=bs, **kw)
      raise SystemExit("four 320-row chunks (512 x 128 in registers) were not refused")
    except ValueError as e:
      assert "c_resident" in str(e) and "512 x 128" in str(e) and "more c_chunks" in str(e), e
    plan = mlp_decode.launch_plan(1, 2048, 1280, 8192, 1280, 2048,
                                  bs=dataclasses.replace(bs, c_chunks=10), **kw)
    assert plan["meta"]["C_RESIDENT"] == 1 and plan["meta"]["RD_PER_P2"] == 128
    assert plan["meta"]["C_CHUNKS"] == 10
    print("ok")
  """),
    interpret=False,
  )


# decode attention of the query rows over keys [0, pos] (in the window, before ``length``), f64
_ATTENTION_ORACLE = textwrap.dedent("""
  def oracle(q, k, v, pos, length, window):
    b, hq, d = q.shape
    hkv = k.shape[1]
    out = np.zeros((b, hq, d))
    for i in range(b):
      p = min(int(pos[i]), length - 1)
      lo = 0 if window is None else max(0, p - window + 1)
      for j in range(hq):
        kh = j // (hq // hkv)
        s = f64(k[i, kh, lo:p + 1]) @ f64(q[i, j]) / np.sqrt(d)
        w = np.exp(s - s.max())
        out[i, j] = (w / w.sum()) @ f64(v[i, kh, lo:p + 1])
    return out.reshape(b, hq * d)
""")

# lrjax's decode attention: every split of a (row, KV head) writes its partial softmax, then
# the merge launch combines them (both merges: the splits in turn, or all in one tile).
# Poisoned partials and output: the merge must read only the splits that ran, and every
# output element must be written.
_DECODE_ATTENTION = _ATTENTION_ORACLE + textwrap.dedent("""
  from lrjax.custom_calls.triton import decode_attention as da

  for (b, hq, hkv, t, d, length, window, positions, fields) in CASES:
    q, k, v = rand(b, hq, d), rand(b, hkv, t, d), rand(b, hkv, t, d)
    pos = np.asarray(positions, np.int32)
    # the new key spliced into the cache loop's tiles (walk merge) or attended apart (tile)
    for merge, kernel, apart in (("walk", da._merge_kernel, False),
                                 ("tile", da._merge_tile_kernel, True)):
      bs = dataclasses.replace(da.BlockSizes(), merge=merge, **fields)
      plan = da.launch_plan(b, hq, hkv, t, d, length, window, bs)
      meta = plan["meta"]
      part = np.full(plan["part"], np.nan, np.float32)
      out = np.full((b, hq * d), np.nan, np.float16)
      da._decode_attention_kernel[plan["grid"]](T(q), T(k), T(v), T(pos), T(part), **meta)
      kernel[plan["merge_grid"]](T(part), T(pos), T(out), **meta)
      err = check(out, oracle(q, k, v, pos, length, window), 4e-3, (merge, b, hq, hkv, t, length))
    print(b, hq, hkv, t, d, length, window, meta["S"], meta["CHUNK"], meta["BLOCK_N"], f"{err:.1e}")
  print("ok")
""")


def test_decode_attention_kernels_merge_the_splits_that_ran():
  """lrjax's decode attention against an f64 oracle: G of 1, 4 and 7 query heads a KV head,
  head dims 16-128, ragged lengths and chunks (the last block of a split masked), sliding
  windows that start mid-split (splits before the window never run), rows at position 0 and
  at the last attended key, a cache longer than the attended length, and one split or many."""
  cases = [  # b, hq, hkv, t, d, length, window, positions, BlockSizes fields
    (1, 32, 8, 256, 64, 256, None, [255], {}),
    (3, 28, 4, 300, 32, 300, None, [0, 137, 299], {"block_n": 32}),
    (2, 8, 8, 512, 16, 200, 50, [199, 120], {"splits": 5, "block_n": 16}),
    (2, 12, 3, 1024, 128, 1000, 300, [999, 640], {"splits": 7}),
    (2, 4, 1, 64, 32, 64, None, [63, 5], {"splits": 1}),
    (1, 2, 2, 100, 16, 37, 1, [36], {"splits": 3, "block_n": 16}),
  ]
  out = _interpret(f"CASES = {cases!r}\n" + _PRELUDE + _DECODE_ATTENTION)
  rows = [ln.split() for ln in out.splitlines() if ln != "ok"]
  for row in rows:  # the splits of ``length`` keys: whole blocks, the last one ragged
    length, splits, chunk, block = int(row[5]), int(row[7]), int(row[8]), int(row[9])
    assert chunk % block == 0 and splits == -(-length // chunk), row
  assert [int(r[7]) for r in rows] == [16, 10, 5, 6, 1, 3], rows  # one split to many


def test_decode_attention_merge_follows_the_split_count_and_the_table():
  """The merge lrjax's decode attention launches: the tuning table's tile merge from
  ``tile_merge_min_splits`` splits (Llama-3-8B heads: 32 splits at batch 1, 4 at batch 8, 2 at
  batch 16), the walk merge below; a table with another threshold moves the switch; MERGE or
  BlockSizes.merge force one; an unknown merge is refused."""
  script = STUB + textwrap.dedent("""
    import dataclasses
    from lrjax.custom_calls.triton import decode_attention as da, policy

    def merges(**fields):
      bs = da.BlockSizes(**fields)
      return [(p["meta"]["S"], p["merge"]) for p in
              (da.launch_plan(b, 32, 8, 1024, 128, 1024, None, bs) for b in (1, 8, 16))]

    print(policy.values("decode_attention").tile_merge_min_splits)
    print(merges())
    with policy.use(policy.current().with_values("decode_attention", tile_merge_min_splits=4)):
      print(merges())
    print(merges(merge="walk"), merges(merge="tile"))
    da.MERGE = "walk"
    print(merges())
    try:
      merges(merge="zigzag")
    except ValueError as e:
      print(e)
    print("ok")
  """)
  lines = run_script(script, interpret=True).splitlines()
  threshold = int(lines[0])
  default = eval(lines[1])  # noqa: S307 - our own script's printed list
  assert [s for s, _ in default] == [32, 4, 2]
  assert default == [(s, "tile" if s >= threshold else "walk") for s in (32, 4, 2)]
  assert default[0][1] == "tile" and default[2][1] == "walk"
  assert eval(lines[2]) == [(32, "tile"), (4, "tile"), (2, "walk")]  # noqa: S307
  assert lines[3] == f"{[(s, 'walk') for s in (32, 4, 2)]} {[(s, 'tile') for s in (32, 4, 2)]}"
  assert eval(lines[4]) == [(32, "walk"), (4, "walk"), (2, "walk")]  # noqa: S307
  assert "merge='zigzag'" in lines[5] and "walk" in lines[5]


def test_decode_attention_split_plan_is_the_fewest_meeting_both_bounds():
  """lrjax's kernel's split count: the fewest powers of two giving TARGET_PROGRAMS programs and
  at most the table's decode_attention.max_split_keys keys a split, short of its caps."""
  script = STUB + textwrap.dedent("""
    import itertools
    from lrjax.custom_calls.triton import decode_attention as da, policy

    print(da.TARGET_PROGRAMS, da.MAX_SPLITS, da.MIN_CHUNK)
    for mk in (0, 16, 128, 256, 1024):
      with policy.use(policy.current().with_values("decode_attention", max_split_keys=mk)):
        for b, hkv, t in itertools.product((1, 3, 8, 16, 64), (1, 8), (16, 100, 1024, 2048, 65536)):
          print(b, hkv, t, mk, da.plan_splits(b, hkv, t))
    print("ok")
  """)
  lines = run_script(script, interpret=True).splitlines()[:-1]
  bounds = tuple(int(x) for x in lines[0].split())
  rows = [tuple(int(x) for x in line.split()) for line in lines[1:]]
  assert len(rows) == 5 * 5 * 2 * 5
  bad = [(r, why) for r in rows if (why := split_plan_violations(r[4], *r[:4], *bounds))]
  assert not bad, bad
  assert (16, 8, 2048, 256, 8) in rows and (16, 8, 2048, 0, 2) in rows


_DECODE_ATTENTION_APPEND = _ATTENTION_ORACLE + textwrap.dedent("""
  from lrjax.custom_calls.triton import decode_attention as da
  from lrjax.custom_calls.triton import decode_attention_append as dap

  def rope16(x, cos, sin):  # the models' rotate-half RoPE, rounded to f16 after each operation
    h = x.shape[-1] // 2
    turned = np.concatenate([-x[..., h:], x[..., :h]], axis=-1)
    return (x * cos + turned * sin).astype(np.float16)

  for (b, hq, hkv, t, d, length, window, positions, fields) in CASES:
    q, kn, vn = rand(b, hq, d), rand(b, hkv, d), rand(b, hkv, d)
    kc, vc = rand(b, hkv, t, d), rand(b, hkv, t, d)
    pos = np.asarray(positions, np.int32)
    inv = (10000.0 ** (-np.arange(0, d, 2) / d)).astype(np.float32)
    ang = pos[:, None].astype(np.float32) * inv
    ang = np.concatenate([ang, ang], axis=-1)
    cos, sin = np.cos(ang).astype(np.float16), np.sin(ang).astype(np.float16)
    want_k, want_v = kc.copy(), vc.copy()
    for i in range(b):
      want_k[i, :, pos[i]] = rope16(kn[i], cos[i], sin[i])
      want_v[i, :, pos[i]] = vn[i]
    want = oracle(rope16(q, cos[:, None], sin[:, None]), want_k, want_v, pos, length, window)
    # the new key spliced into the cache loop's tiles (walk merge) or attended apart (tile)
    for merge, kernel, apart in (("walk", da._merge_kernel, False),
                                 ("tile", da._merge_tile_kernel, True)):
      bs = dataclasses.replace(da.BlockSizes(), merge=merge, **fields)
      plan = da.launch_plan(b, hq, hkv, t, d, length, window, bs)
      meta = plan["meta"]
      # the caches read from one copy and written to another (on a GPU they alias): the
      # attention must take the new rows from registers, never from a write it may not see
      kin, vin, kout, vout = kc.copy(), vc.copy(), kc.copy(), vc.copy()
      part = np.full(plan["part"], np.nan, np.float32)
      out = np.full((b, hq * d), np.nan, np.float16)
      dap._decode_attention_append_kernel[plan["grid"]](
        T(q), T(kn), T(vn), T(kin), T(vin), T(pos), T(cos), T(sin), T(part), T(kout), T(vout),
        APART=apart, **meta)
      kernel[plan["merge_grid"]](T(part), T(pos), T(out), **meta)
      err = check(out, want, 4e-3, (merge, apart, b, hq, hkv, t, length))
      # the new rows written bit for bit as the reference rounds them; no other row touched
      assert np.array_equal(kout, want_k) and np.array_equal(vout, want_v), (merge, b, t)
      assert np.array_equal(kin, kc) and np.array_equal(vin, vc)
    print(b, hq, hkv, t, d, length, window, meta["S"], f"{err:.1e}")
  print("ok")
""")


def test_decode_attention_append_ropes_writes_and_attends():
  """decode_attention_append's launch against an f16-rounded RoPE and an f64 oracle: the new
  key and value written at each row's position bit for bit (every other cache row unchanged),
  and the attention over the cache with them, for one split or many, the new key first or last
  in its split, windows, a cache longer than the attended length, G of 1, 4 and 7; the new key
  spliced into the loop's tiles and attended apart (NEW_KEY_APART)."""
  cases = [  # b, hq, hkv, t, d, length, window, positions, BlockSizes fields
    (1, 32, 8, 256, 64, 256, None, [255], {}),
    (3, 28, 4, 300, 32, 300, None, [0, 137, 299], {"block_n": 32}),
    (2, 8, 8, 512, 16, 200, 50, [199, 144], {"splits": 5, "block_n": 16}),
    (2, 4, 1, 64, 32, 64, None, [63, 5], {"splits": 1}),
  ]
  out = _interpret(f"CASES = {cases!r}\n" + _PRELUDE + _DECODE_ATTENTION_APPEND)
  rows = [ln.split() for ln in out.splitlines() if ln != "ok"]
  assert [int(r[7]) for r in rows] == [16, 10, 5, 1], rows  # one split to many


def test_decode_attention_append_reference_is_the_models_decode_attention():
  """The append op's XLA reference equals what a Llama decode step does today (apply_rope on
  q and k, write_kv into each cache buffer, the decode_attention primitive): bit for bit op by
  op, within an f32 ulp compiled, in f32 and bf16, with a window and an attended length short
  of the cache; cos/sin of the wrong shape are refused."""
  script = STUB + textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from lrjax.custom_calls.triton import decode_attention_append as dap
    from lrjax.lowering.decode_attention import decode_attention, rope_tables
    from lrjax.models.llama import apply_rope, write_kv

    b, hq, hkv, t, d = 3, 8, 2, 64, 32
    inv = jnp.asarray(1.0 / (10000.0 ** (np.arange(0, d, 2) / d)), jnp.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
      ks = jax.random.split(jax.random.key(0), 5)
      q = jax.random.normal(ks[0], (b, hq, d), dtype)
      kn, vn = (jax.random.normal(k, (b, hkv, d), dtype) for k in ks[1:3])
      kc, vc = (jax.random.normal(k, (b, hkv, t, d), dtype) for k in ks[3:5])
      pos = jnp.asarray([0, 20, 47], jnp.int32)
      for window, length in ((None, None), (9, 48)):
        def model(q, kn, vn, kc, vc, pos):
          qr = apply_rope(q[:, None], pos[:, None], inv)[:, 0]
          kr = apply_rope(kn[:, None], pos[:, None], inv)
          kc = write_kv(kc, kr, pos, heads_first=True)
          vc = write_kv(vc, vn[:, None], pos, heads_first=True)
          return decode_attention(qr, kc, vc, pos, window=window, length=length), kc, vc

        def op(q, kn, vn, kc, vc, pos):
          cos, sin = rope_tables(pos, inv, dtype)
          return dap.decode_attention_append_reference(
            q, kn, vn, kc, vc, pos, cos, sin, window=window, length=length)

        # op by op, bit for bit; compiled, XLA may contract x·cos + y·sin differently in the
        # two programs (an f32 ulp)
        want, got = model(q, kn, vn, kc, vc, pos), op(q, kn, vn, kc, vc, pos)
        for g, w in zip(got, want):
          assert g.dtype == w.dtype and np.array_equal(np.asarray(g), np.asarray(w)), dtype
        want, got = jax.jit(model)(q, kn, vn, kc, vc, pos), jax.jit(op)(q, kn, vn, kc, vc, pos)
        for g, w in zip(got, want):
          g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
          assert np.abs(g - w).max() <= 1e-6 * np.abs(w).max(), dtype
    try:
      dap.decode_attention_append_reference(q, kn, vn, kc, vc, pos, q, q)
    except ValueError as e:
      print(e)
    print("ok")
  """)
  out = run_script(script, interpret=True).splitlines()
  assert "cos.shape" in out[0] and "expected [B, D]" in out[0], out
