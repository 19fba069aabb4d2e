"""UpGateProjection (NeuronMM Algorithm 2): Y^T = (act(X·Ug·Vg + bg) ⊙ (X·Uu·Vu + bu))^T.

The XUV TrainiumFusion dataflow run for the gate and up projections together: one
X_mk^T block (transposed by DMA) feeds both first matmuls, both (X·U)^T strips stay
cached in SBUF, and in the second phase the gate and up output tiles accumulate
side by side in PSUM (V as stationary, so the result is already transposed). The
activation runs on the Scalar Engine straight out of PSUM, the product on the Vector
Engine, and Y^T [D_ff, M] is written once: the layout DownProjection (``xuv.py`` with
``x_transposed=True, out_t=False``) loads with plain DMAs, so the chain of Algorithm 3
(``mlp.py``) has no transpose in between. Non-gated MLPs use the same kernel with
the up path only: Y^T = act(X·U·V + b)^T.

Gate and up may have different ranks; :func:`prepare` zero-pads both to the larger
rank (exact). Dims are padded to multiples of 128; bf16/f16 only.

Rank-space scales (``(x @ u) * s`` between a projection's factors) multiply the cached
strips after they were rounded to the input dtype, as in ``xuv.py``; when only one of gate
and up has a scale the other gets ones (exact).

Targets NKI 0.7 (AWS Neuron SDK 2.33, ``import nki``). Not compiled or run on
Trainium here; see the README's "Trainium status".
"""

from __future__ import annotations

import dataclasses

from lrjax.custom_calls.nki import _api, planner

nki, nl, nisa = _api.toolchain(globals())

P = 128
ACT_NAMES = ("silu", "gelu_tanh", "gelu", "relu")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  bm: int  # B_M rows of X per strip
  bk: int  # B_K contraction block of X·U
  br: int  # B_r rank block
  bn: int  # B_N block of D_ff
  x_cache: bool = False  # hold the whole X^T row strip in SBUF: X read once per strip

  @classmethod
  def get_default(cls, M, K, r, d_ff, dtype, *, gated=True, n_bias=0, n_scale=0) -> BlockSizes:
    """Tuned table first, the planner's least-traffic plan otherwise."""
    key = (tuple(planner.pad128(d) for d in (K, r, d_ff)), gated)
    blocks = TUNED.get(key)
    kw = dict(out_t=True, n_bias=n_bias, gated=gated, n_scale=n_scale)
    p = None
    if blocks is not None:
      try:
        p = planner.plan("mlp_up_gate", M, K, r, d_ff, dtype, blocks=blocks, **kw)
      except ValueError:
        p = None
    p = p or planner.plan("mlp_up_gate", M, K, r, d_ff, dtype, **kw)
    return cls(*p.blocks.as_tuple(), p.blocks.x_cache)


# ((K, r, D_ff) padded, gated) -> blocks. Empty: nothing has been tuned on hardware yet.
TUNED: dict = {}


def _moving_tile(b):
  return 512 if b % 512 == 0 else (256 if b % 256 == 0 else P)


def _act(name):
  if name == "silu":
    return nl.silu
  if name == "gelu_tanh":
    return nl.gelu_apprx_tanh
  if name == "gelu":
    return nl.gelu
  return nl.relu


def _load_xt(x, m0, k0, bm, bk, tm):
  """X_mk^T into SBUF as [P, bk/P, bm], transposed by DMA in transit."""
  xt = nl.ndarray((P, bk // P, bm), dtype=x.dtype, buffer=nl.sbuf)
  for kt in nl.affine_range(bk // P):
    for mt in nl.affine_range(bm // tm):
      nisa.dma_transpose(
        dst=xt[:, kt, mt * tm : (mt + 1) * tm],
        src=x[m0 + mt * tm : m0 + (mt + 1) * tm, k0 + kt * P : k0 + (kt + 1) * P],
      )
  return xt


def _load_block(dst, src, r0, c0, cols):
  """Rows r0.. of ``src`` (partition-major, dst.shape[1] row tiles) into dst [P, tiles, cols]."""
  for t in nl.affine_range(dst.shape[1]):
    nisa.dma_copy(dst=dst[:, t, :], src=src[r0 + t * P : r0 + (t + 1) * P, c0 : c0 + cols])


def _scaled(strip, sc, i, cols):
  """strip[:, i, cols] ⊙ the per-rank scale column i (after its rounding to the strip dtype)."""
  if sc is not None:
    t = strip[:, i, cols]
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=sc[:, i : i + 1])


def _strips(x, ug, uu, m0, bm, bk, br, x_cache, scg=None, scu=None):
  """Phase 1: the (X·Ug)^T and (X·Uu)^T strips of rows m0..m0+bm (ug is None if not gated),
  times their per-rank scales ``scg`` / ``scu`` [P, r/P] when given."""
  K, r = uu.shape
  tm = _moving_tile(bm)
  n_mt = bm // tm
  n_rt = br // P
  su = nl.ndarray((P, r // P, bm), dtype=x.dtype, buffer=nl.sbuf)
  sg = None
  if ug is not None:
    sg = nl.ndarray((P, r // P, bm), dtype=x.dtype, buffer=nl.sbuf)
  if x_cache:
    xs = _load_xt(x, m0, 0, bm, K, tm)  # X_m*^T, read once for all rank blocks
  for p in nl.affine_range(r // br):
    accu = nl.ndarray((P, n_rt * n_mt, tm), dtype=nl.float32, buffer=nl.psum)
    nisa.memset(dst=accu, value=0.0)
    if ug is not None:
      accg = nl.ndarray((P, n_rt * n_mt, tm), dtype=nl.float32, buffer=nl.psum)
      nisa.memset(dst=accg, value=0.0)
    for k in nl.affine_range(K // bk):
      if x_cache:
        xt = xs[:, k * (bk // P) : (k + 1) * (bk // P), :]
      else:
        xt = _load_xt(x, m0, k * bk, bm, bk, tm)
      uub = nl.ndarray((P, bk // P, br), dtype=uu.dtype, buffer=nl.sbuf)
      _load_block(uub, uu, k * bk, p * br, br)
      if ug is not None:
        ugb = nl.ndarray((P, bk // P, br), dtype=ug.dtype, buffer=nl.sbuf)
        _load_block(ugb, ug, k * bk, p * br, br)
      for rt in nl.affine_range(n_rt):
        for mt in nl.affine_range(n_mt):
          for kt in nl.affine_range(bk // P):
            mov = xt[:, kt, mt * tm : (mt + 1) * tm]
            nisa.nc_matmul(
              dst=accu[:, rt * n_mt + mt, :],
              stationary=uub[:, kt, rt * P : (rt + 1) * P],
              moving=mov,
              accumulate=True,
            )
            if ug is not None:
              nisa.nc_matmul(
                dst=accg[:, rt * n_mt + mt, :],
                stationary=ugb[:, kt, rt * P : (rt + 1) * P],
                moving=mov,
                accumulate=True,
              )
    for rt in nl.affine_range(n_rt):
      for mt in nl.affine_range(n_mt):
        cols = slice(mt * tm, (mt + 1) * tm)
        nisa.tensor_copy(dst=su[:, p * n_rt + rt, cols], src=accu[:, rt * n_mt + mt, :])
        _scaled(su, scu, p * n_rt + rt, cols)
        if ug is not None:
          nisa.tensor_copy(dst=sg[:, p * n_rt + rt, cols], src=accg[:, rt * n_mt + mt, :])
          _scaled(sg, scg, p * n_rt + rt, cols)
  return sg, su


def _rank1(acc, brow, ones, bm, bn, tm):
  """acc[n, m] += bias[n] via nc_matmul(stationary=bias row, moving=ones row)."""
  for nt in nl.affine_range(bn // P):
    for mt in nl.affine_range(bm // tm):
      nisa.nc_matmul(
        dst=acc[:, nt * (bm // tm) + mt, :],
        stationary=brow[0:1, nt * P : (nt + 1) * P],
        moving=ones[0:1, mt * tm : (mt + 1) * tm],
        accumulate=True,
      )


def _project(sg, su, vg, vu, bg, bu, yt, m0, bm, br, bn, act):
  """Phase 2: Y^T blocks = act(Vg^T·sg + bg) ⊙ (Vu^T·su + bu), written to HBM."""
  r, N = vu.shape
  tm = _moving_tile(bm)
  n_rt = br // P
  n_acc = (bn // P) * (bm // tm)
  if bg is not None or bu is not None:
    ones = nl.ndarray((1, bm), dtype=vu.dtype, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
  for n in nl.affine_range(N // bn):
    n0 = n * bn
    accu = nl.ndarray((P, n_acc, tm), dtype=nl.float32, buffer=nl.psum)
    nisa.memset(dst=accu, value=0.0)
    if sg is not None:
      accg = nl.ndarray((P, n_acc, tm), dtype=nl.float32, buffer=nl.psum)
      nisa.memset(dst=accg, value=0.0)
    for p in nl.affine_range(r // br):
      vub = nl.ndarray((P, n_rt, bn), dtype=vu.dtype, buffer=nl.sbuf)
      _load_block(vub, vu, p * br, n0, bn)
      if sg is not None:
        vgb = nl.ndarray((P, n_rt, bn), dtype=vg.dtype, buffer=nl.sbuf)
        _load_block(vgb, vg, p * br, n0, bn)
      for rt in nl.affine_range(n_rt):
        for nt in nl.affine_range(bn // P):
          for mt in nl.affine_range(bm // tm):
            i = nt * (bm // tm) + mt
            nisa.nc_matmul(
              dst=accu[:, i, :],
              stationary=vub[:, rt, nt * P : (nt + 1) * P],
              moving=su[:, p * n_rt + rt, mt * tm : (mt + 1) * tm],
              accumulate=True,
            )
            if sg is not None:
              nisa.nc_matmul(
                dst=accg[:, i, :],
                stationary=vgb[:, rt, nt * P : (nt + 1) * P],
                moving=sg[:, p * n_rt + rt, mt * tm : (mt + 1) * tm],
                accumulate=True,
              )
    if bu is not None:
      bur = nl.ndarray((1, bn), dtype=bu.dtype, buffer=nl.sbuf)
      nisa.dma_copy(dst=bur, src=bu[0:1, n0 : n0 + bn])
      _rank1(accu, bur, ones, bm, bn, tm)
    if bg is not None:
      bgr = nl.ndarray((1, bn), dtype=bg.dtype, buffer=nl.sbuf)
      nisa.dma_copy(dst=bgr, src=bg[0:1, n0 : n0 + bn])
      _rank1(accg, bgr, ones, bm, bn, tm)
    yb = nl.ndarray((P, bn // P, bm), dtype=yt.dtype, buffer=nl.sbuf)
    for nt in nl.affine_range(bn // P):
      for mt in nl.affine_range(bm // tm):
        i = nt * (bm // tm) + mt
        if sg is not None:
          g = nl.ndarray((P, tm), dtype=nl.float32, buffer=nl.sbuf)
          nisa.activation(dst=g, op=act, data=accg[:, i, :])  # Scalar Engine, from PSUM
          nisa.tensor_tensor(
            dst=yb[:, nt, mt * tm : (mt + 1) * tm], data1=g, data2=accu[:, i, :], op=nl.multiply
          )  # Vector Engine
        else:
          nisa.activation(dst=yb[:, nt, mt * tm : (mt + 1) * tm], op=act, data=accu[:, i, :])
      nisa.dma_copy(dst=yt[n0 + nt * P : n0 + (nt + 1) * P, m0 : m0 + bm], src=yb[:, nt, :])


def _load_scale(sc, scale):
  """A rank-space scale ([r, 1] on HBM) into ``sc`` [P, r/P] in SBUF (see xuv.load_scale)."""
  for t in nl.affine_range(sc.shape[1]):
    nisa.dma_copy(dst=sc[:, t : t + 1], src=scale[t * P : (t + 1) * P, 0:1])
  return sc


def _up_gate_body(x, ug, vg, bg, uu, vu, bu, act, bm, bk, br, bn, x_cache, sg_=None, su_=None):
  M = x.shape[0]
  N = vu.shape[1]
  yt = nl.ndarray((N, M), dtype=x.dtype, buffer=nl.shared_hbm)
  f = _act(act)
  r = uu.shape[1]
  scg = scu = None  # one SBUF allocation each: both live for the whole launch
  if sg_ is not None:
    scg = _load_scale(nl.ndarray((P, r // P), dtype=sg_.dtype, buffer=nl.sbuf), sg_)
  if su_ is not None:
    scu = _load_scale(nl.ndarray((P, r // P), dtype=su_.dtype, buffer=nl.sbuf), su_)
  for m in nl.affine_range(M // bm):
    sg, su = _strips(x, ug, uu, m * bm, bm, bk, br, x_cache, scg, scu)
    _project(sg, su, vg, vu, bg, bu, yt, m * bm, bm, br, bn, f)
  return yt


@nki.jit
def up_gate_kernel(x, ug, vg, uu, vu, act, bm, bk, br, bn, x_cache=False):
  """Y^T = act(X·Ug·Vg) ⊙ (X·Uu·Vu), transposed.

  x: [M, K]; ug, uu: [K, r]; vg, vu: [r, D_ff]; returns [D_ff, M] in x.dtype.
  """
  return _up_gate_body(x, ug, vg, None, uu, vu, None, act, bm, bk, br, bn, x_cache)


@nki.jit
def up_gate_bias_kernel(x, ug, vg, bg, uu, vu, bu, act, bm, bk, br, bn, x_cache=False):
  """As :func:`up_gate_kernel` with biases bg, bu: [1, D_ff] each."""
  return _up_gate_body(x, ug, vg, bg, uu, vu, bu, act, bm, bk, br, bn, x_cache)


@nki.jit
def up_kernel(x, uu, vu, act, bm, bk, br, bn, x_cache=False):
  """Non-gated: Y^T = act(X·U·V)^T. x: [M, K]; uu: [K, r]; vu: [r, D_ff] -> [D_ff, M]."""
  return _up_gate_body(x, None, None, None, uu, vu, None, act, bm, bk, br, bn, x_cache)


@nki.jit
def up_bias_kernel(x, uu, vu, bu, act, bm, bk, br, bn, x_cache=False):
  """Non-gated with bias bu: [1, D_ff]."""
  return _up_gate_body(x, None, None, None, uu, vu, bu, act, bm, bk, br, bn, x_cache)


@nki.jit
def up_gate_scale_kernel(x, ug, vg, sg, uu, vu, su, act, bm, bk, br, bn, x_cache=False):
  """As :func:`up_gate_kernel` with rank-space scales sg, su: [r, 1] each."""
  return _up_gate_body(x, ug, vg, None, uu, vu, None, act, bm, bk, br, bn, x_cache, sg, su)


@nki.jit
def up_gate_bias_scale_kernel(
  x, ug, vg, bg, sg, uu, vu, bu, su, act, bm, bk, br, bn, x_cache=False
):
  """As :func:`up_gate_bias_kernel` with rank-space scales sg, su: [r, 1] each."""
  return _up_gate_body(x, ug, vg, bg, uu, vu, bu, act, bm, bk, br, bn, x_cache, sg, su)


@nki.jit
def up_scale_kernel(x, uu, vu, su, act, bm, bk, br, bn, x_cache=False):
  """Non-gated with the rank-space scale su: [r, 1]."""
  return _up_gate_body(x, None, None, None, uu, vu, None, act, bm, bk, br, bn, x_cache, None, su)


@nki.jit
def up_bias_scale_kernel(x, uu, vu, bu, su, act, bm, bk, br, bn, x_cache=False):
  """Non-gated with bias bu: [1, D_ff] and the rank-space scale su: [r, 1]."""
  return _up_gate_body(x, None, None, None, uu, vu, bu, act, bm, bk, br, bn, x_cache, None, su)


# ----------------------------------------------------------------------------- wrapper


def _pad2(xp, a, rows, cols):
  pr, pc = rows - a.shape[0], cols - a.shape[1]
  return a if (pr, pc) == (0, 0) else xp.pad(a, ((0, pr), (0, pc)))


def _proj4(p):
  """(u, v), (u, v, bias) or (u, v, bias, scale) -> (u, v, bias|None, scale|None)."""
  if len(p) not in (2, 3, 4):
    raise ValueError(f"a projection must be (u, v[, bias[, scale]]); got {len(p)} items")
  return tuple(p) + (None,) * (4 - len(p))


def prepare(x, up, gate=None, *, xp, act="silu", block_sizes=None):
  """Pads operands and picks the kernel; ``up``/``gate`` are (u, v[, bias|None[, scale]]).

  x: [M, K]. Returns (kernel name, args, kwargs, (M, D_ff)).
  """
  if act not in ACT_NAMES:
    raise ValueError(f"{act=} is not supported; expected one of {ACT_NAMES}")
  if x.ndim != 2:
    raise ValueError(f"{x.shape=} must be 2-D [M, K]")
  M, K = x.shape
  up = _proj4(up)
  gate = None if gate is None else _proj4(gate)
  uu, vu, bu, _ = up
  d_ff = vu.shape[1]
  r = max(uu.shape[1], gate[0].shape[1]) if gate is not None else uu.shape[1]
  Mp, Kp, rp, Np = (planner.pad128(d) for d in (M, K, r, d_ff))
  has_bias = bu is not None or (gate is not None and gate[2] is not None)
  n_bias = (2 if gate is not None else 1) if has_bias else 0  # a missing bias is passed as zeros
  has_scale = up[3] is not None or (gate is not None and gate[3] is not None)
  n_scale = (2 if gate is not None else 1) if has_scale else 0  # a missing one as ones
  bs = block_sizes or BlockSizes.get_default(
    M, K, r, d_ff, x.dtype, gated=gate is not None, n_bias=n_bias, n_scale=n_scale
  )

  def proj(u, v, b, s):
    if u.shape[0] != K or v.shape[0] != u.shape[1] or v.shape[1] != d_ff:
      raise ValueError(f"{u.shape=}, {v.shape=} must be [K={K}, r] and [r, D_ff={d_ff}]")
    ops = (_pad2(xp, u, Kp, rp), _pad2(xp, v, rp, Np))
    if has_bias:
      b = xp.zeros((d_ff,), x.dtype) if b is None else b
      ops += (_pad2(xp, b.reshape(1, d_ff), 1, Np),)
    if has_scale:
      s = xp.ones((u.shape[1],), x.dtype) if s is None else s
      if s.shape != (u.shape[1],):
        raise ValueError(f"scale {s.shape=} must be ({u.shape[1]},)")
      ops += (_pad2(xp, s.reshape(-1, 1), rp, 1),)
    return ops

  args = (_pad2(xp, x, Mp, Kp),)
  if gate is not None:
    args += proj(*gate)
  args += proj(*up)
  name = (
    ("up_gate" if gate is not None else "up")
    + ("_bias" if has_bias else "")
    + ("_scale" if has_scale else "")
    + "_kernel"
  )
  kwargs = dict(act=act, bm=bs.bm, bk=bs.bk, br=bs.br, bn=bs.bn, x_cache=bs.x_cache)
  return name, args, kwargs, (M, d_ff)


def up_gate(x, up, gate=None, *, act="silu", block_sizes=None):
  """JAX entry point: Y^T [D_ff_padded, M_padded] (padding kept: DownProjection consumes it)."""
  import jax.numpy as jnp

  name, args, kwargs, _ = prepare(x, up, gate, xp=jnp, act=act, block_sizes=block_sizes)
  return globals()[name](*args, **kwargs)


def up_gate_reference(x, up, gate=None, *, act="silu"):
  """Y^T from the lrjax reference chain (f32 accumulation, rounded to x.dtype)."""
  import jax
  from lrjax.lowering.primitives import ACTIVATIONS, lr_xuv_reference

  up, gate = _proj4(up), None if gate is None else _proj4(gate)
  dt = x.dtype
  h = lr_xuv_reference(x, *up[:3], scale=up[3], inter_dtype=dt, out_dtype=dt)
  if gate is not None:
    g = lr_xuv_reference(x, *gate[:3], scale=gate[3], inter_dtype=dt, out_dtype=dt)
    h = ACTIVATIONS[act](g) * h
  else:
    h = ACTIVATIONS[act](h)
  return jax.numpy.asarray(h).T
