"""TrainiumFusion XUV kernel: O = (X·U)·V (+ bias) on one NeuronCore (NeuronMM §4.2.1-4.2.2).

Dataflow, per row strip m of B_M rows (loop over M):
  phase 1  for each rank block p, for each K block k: X_mk^T arrives already
           transposed (``dma_transpose`` of X, or a plain DMA when the input is
           pre-transposed X^T), U_kp by plain DMA; ``nc_matmul(stationary=U tile,
           moving=X^T tile)`` yields (X·U)^T directly (implicit transpose, no
           transpose instruction), accumulated over K in PSUM, then cached in SBUF.
           The whole strip (X·U)^T_{m*} [r, B_M] stays in SBUF (the capacity-aware
           strip cache; the planner sizes B_M so it fits).
  phase 2  for each N block n: V_pn by plain DMA; the output block is accumulated
           over r in PSUM and written once. Output layout is selectable by operand
           order: O^T = V^T·(XU)^T with V as stationary (``out_t=True``, what a
           following NKI kernel wants as its stationary input), or O = (XU)·V with
           the cached strip as stationary (``out_t=False``, the model's layout).
  bias     a rank-1 nc_matmul of the bias row with a row of ones into the same
           PSUM accumulator (no broadcast DMA, no extra engine pass).
  scale    optional rank-space scale s [r] (Σ of an SVD, ``(x @ u) * s``): the strip is
           (X·U)^T, so s is one scalar per partition. It is loaded once per launch as [P, r/P]
           and multiplied into each strip tile after the tile was rounded to the input dtype
           (``tensor_scalar`` with a per-partition vector), the rounding the reference does.

HBM traffic: X once per strip when its X^T row strip [K, B_M] also fits in SBUF
(``x_cache``), else once per (strip, rank block); U and V once per strip, O once; the
intermediate X·U never leaves the chip. The planner (``planner.py``) computes the
same numbers exactly. DownProjection of the MLP (Algorithm 3) is this kernel with
``x_transposed=True, out_t=False``.

Shapes: all dims are padded to multiples of 128 by :func:`prepare` (zeros, exact for
the contractions; padded output rows/cols are sliced off by :func:`finish`).
Supported dtypes: bf16 and f16 (DMA transpose moves 2-byte types); PSUM is f32;
the cached strip and the output are in the input dtype.

Targets NKI 0.7 (AWS Neuron SDK 2.33, ``import nki``), destination-passing API.
Not compiled or run on Trainium here; see the README's "Trainium status".
"""

from __future__ import annotations

import dataclasses

from lrjax.custom_calls.nki import _api, planner

nki, nl, nisa = _api.toolchain(globals())

P = 128


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  bm: int  # B_M rows of X per strip
  bk: int  # B_K contraction block of X·U
  br: int  # B_r rank block
  bn: int  # B_N output-column block
  x_cache: bool = False  # hold the whole X^T row strip in SBUF: X read once per strip

  @classmethod
  def get_default(
    cls, M, K, r, N, dtype, *, out_t=False, x_transposed=False, has_bias=False, has_scale=False
  ) -> BlockSizes:
    """Tuned B_M for known shape classes, the planner's least-traffic plan otherwise."""
    kw = dict(out_t=out_t, x_transposed=x_transposed, n_bias=int(has_bias), n_scale=int(has_scale))
    bm = TUNED_BM.get(tuple(planner.pad128(d) for d in (K, r, N)))
    if bm is not None and planner.pad128(M) % bm == 0:
      p = planner.best_for_bm("xuv", M, K, r, N, dtype, bm, **kw)
      if p is not None and p.fits:
        return cls(*p.blocks.as_tuple(), p.blocks.x_cache)
    p = planner.plan("xuv", M, K, r, N, dtype, **kw)
    return cls(*p.blocks.as_tuple(), p.blocks.x_cache)


# (K, r, N) padded -> B_M measured best on trn1 by NeuronMM (Table 4, DeepSeek-V3 up_proj,
# M=4096: 10.99 ms at B_M=1024). The other blocks come from the planner.
TUNED_BM = {(7168, 4096, 18432): 1024}


def _moving_tile(b):
  return 512 if b % 512 == 0 else (256 if b % 256 == 0 else P)


def _load_xt(x, m0, k0, bm, bk, tm, x_transposed):
  """X_mk^T into SBUF as [P, bk/P, bm]: DMA transposes X in transit."""
  xt = nl.ndarray((P, bk // P, bm), dtype=x.dtype, buffer=nl.sbuf)
  for kt in nl.affine_range(bk // P):
    if x_transposed:
      nisa.dma_copy(dst=xt[:, kt, :], src=x[k0 + kt * P : k0 + (kt + 1) * P, m0 : m0 + bm])
    else:
      for mt in nl.affine_range(bm // tm):
        nisa.dma_transpose(
          dst=xt[:, kt, mt * tm : (mt + 1) * tm],
          src=x[m0 + mt * tm : m0 + (mt + 1) * tm, k0 + kt * P : k0 + (kt + 1) * P],
        )
  return xt


def load_scale(scale, r):
  """The rank-space scale ([r, 1] on HBM) as [P, r/P] in SBUF: column t holds ranks t·P...;
  each column is the per-partition vector that scales rank tile t of a (X·U)^T strip."""
  sc = nl.ndarray((P, r // P), dtype=scale.dtype, buffer=nl.sbuf)
  for t in nl.affine_range(r // P):
    nisa.dma_copy(dst=sc[:, t : t + 1], src=scale[t * P : (t + 1) * P, 0:1])
  return sc


def _xu_strip(x, u, m0, bm, bk, br, x_transposed, x_cache, sc=None):
  """Phase 1: the strip (X·U)^T of rows m0..m0+bm, cached in SBUF as [P, r/P, bm]
  (times the per-rank scale ``sc`` [P, r/P] when given)."""
  K, r = u.shape
  tm = _moving_tile(bm)
  n_mt = bm // tm
  n_rt = br // P
  strip = nl.ndarray((P, r // P, bm), dtype=x.dtype, buffer=nl.sbuf)
  if x_cache:
    xs = _load_xt(x, m0, 0, bm, K, tm, x_transposed)  # X_m*^T, read once for all rank blocks
  for p in nl.affine_range(r // br):
    acc = nl.ndarray((P, n_rt * n_mt, tm), dtype=nl.float32, buffer=nl.psum)
    nisa.memset(dst=acc, value=0.0)
    for k in nl.affine_range(K // bk):
      if x_cache:
        xt = xs[:, k * (bk // P) : (k + 1) * (bk // P), :]
      else:
        xt = _load_xt(x, m0, k * bk, bm, bk, tm, x_transposed)
      ub = nl.ndarray((P, bk // P, br), dtype=u.dtype, buffer=nl.sbuf)
      for kt in nl.affine_range(bk // P):
        nisa.dma_copy(
          dst=ub[:, kt, :], src=u[k * bk + kt * P : k * bk + (kt + 1) * P, p * br : (p + 1) * br]
        )
      for rt in nl.affine_range(n_rt):
        for mt in nl.affine_range(n_mt):
          for kt in nl.affine_range(bk // P):
            # Implicit transpose: stationary=U, moving=X^T gives U^T·X^T = (X·U)^T.
            nisa.nc_matmul(
              dst=acc[:, rt * n_mt + mt, :],
              stationary=ub[:, kt, rt * P : (rt + 1) * P],
              moving=xt[:, kt, mt * tm : (mt + 1) * tm],
              accumulate=True,
            )
    for rt in nl.affine_range(n_rt):
      for mt in nl.affine_range(n_mt):
        t = strip[:, p * n_rt + rt, mt * tm : (mt + 1) * tm]
        nisa.tensor_copy(dst=t, src=acc[:, rt * n_mt + mt, :])
        if sc is not None:  # ⊙ s after the rounding to the strip's dtype, as (x @ u) * s
          i = p * n_rt + rt
          nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=sc[:, i : i + 1])
  return strip


def _strip_times_v(strip, v, bias, out, m0, bm, br, bn, out_t):
  """Phase 2: every output block of the strip from the cached (X·U)^T and V."""
  r, N = v.shape
  tm = _moving_tile(bm)
  tn = _moving_tile(bn)
  n_rt = br // P
  if bias is not None:
    ones = nl.ndarray((1, bm), dtype=v.dtype, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
  for n in nl.affine_range(N // bn):
    n0 = n * bn
    if out_t:
      acc = nl.ndarray((P, (bn // P) * (bm // tm), tm), dtype=nl.float32, buffer=nl.psum)
    else:
      acc = nl.ndarray((P, (bm // P) * (bn // tn), tn), dtype=nl.float32, buffer=nl.psum)
    nisa.memset(dst=acc, value=0.0)
    for p in nl.affine_range(r // br):
      vb = nl.ndarray((P, n_rt, bn), dtype=v.dtype, buffer=nl.sbuf)
      for rt in nl.affine_range(n_rt):
        nisa.dma_copy(
          dst=vb[:, rt, :], src=v[p * br + rt * P : p * br + (rt + 1) * P, n0 : n0 + bn]
        )
      for rt in nl.affine_range(n_rt):
        if out_t:
          for nt in nl.affine_range(bn // P):
            for mt in nl.affine_range(bm // tm):
              # O^T tile = V^T·(XU)^T: V is the stationary operand.
              nisa.nc_matmul(
                dst=acc[:, nt * (bm // tm) + mt, :],
                stationary=vb[:, rt, nt * P : (nt + 1) * P],
                moving=strip[:, p * n_rt + rt, mt * tm : (mt + 1) * tm],
                accumulate=True,
              )
        else:
          for mi in nl.affine_range(bm // P):
            for nj in nl.affine_range(bn // tn):
              # O tile = (XU)·V: the cached (XU)^T is already the stationary layout.
              nisa.nc_matmul(
                dst=acc[:, mi * (bn // tn) + nj, :],
                stationary=strip[:, p * n_rt + rt, mi * P : (mi + 1) * P],
                moving=vb[:, rt, nj * tn : (nj + 1) * tn],
                accumulate=True,
              )
    if bias is not None:
      brow = nl.ndarray((1, bn), dtype=bias.dtype, buffer=nl.sbuf)
      nisa.dma_copy(dst=brow, src=bias[0:1, n0 : n0 + bn])
      if out_t:
        for nt in nl.affine_range(bn // P):
          for mt in nl.affine_range(bm // tm):
            nisa.nc_matmul(
              dst=acc[:, nt * (bm // tm) + mt, :],
              stationary=brow[0:1, nt * P : (nt + 1) * P],
              moving=ones[0:1, mt * tm : (mt + 1) * tm],
              accumulate=True,
            )
      else:
        for mi in nl.affine_range(bm // P):
          for nj in nl.affine_range(bn // tn):
            nisa.nc_matmul(
              dst=acc[:, mi * (bn // tn) + nj, :],
              stationary=ones[0:1, mi * P : (mi + 1) * P],
              moving=brow[0:1, nj * tn : (nj + 1) * tn],
              accumulate=True,
            )
    if out_t:
      ob = nl.ndarray((P, bn // P, bm), dtype=out.dtype, buffer=nl.sbuf)
      for nt in nl.affine_range(bn // P):
        for mt in nl.affine_range(bm // tm):
          nisa.tensor_copy(
            dst=ob[:, nt, mt * tm : (mt + 1) * tm], src=acc[:, nt * (bm // tm) + mt, :]
          )
        nisa.dma_copy(dst=out[n0 + nt * P : n0 + (nt + 1) * P, m0 : m0 + bm], src=ob[:, nt, :])
    else:
      ob = nl.ndarray((P, bm // P, bn), dtype=out.dtype, buffer=nl.sbuf)
      for mi in nl.affine_range(bm // P):
        for nj in nl.affine_range(bn // tn):
          nisa.tensor_copy(
            dst=ob[:, mi, nj * tn : (nj + 1) * tn], src=acc[:, mi * (bn // tn) + nj, :]
          )
        nisa.dma_copy(dst=out[m0 + mi * P : m0 + (mi + 1) * P, n0 : n0 + bn], src=ob[:, mi, :])


def _xuv_body(x, u, v, bias, bm, bk, br, bn, out_t, x_transposed, x_cache, scale=None):
  if x_transposed:
    K, M = x.shape
  else:
    M, K = x.shape
  N = v.shape[1]
  if out_t:
    out = nl.ndarray((N, M), dtype=x.dtype, buffer=nl.shared_hbm)
  else:
    out = nl.ndarray((M, N), dtype=x.dtype, buffer=nl.shared_hbm)
  sc = load_scale(scale, u.shape[1]) if scale is not None else None
  for m in nl.affine_range(M // bm):
    strip = _xu_strip(x, u, m * bm, bm, bk, br, x_transposed, x_cache, sc)
    _strip_times_v(strip, v, bias, out, m * bm, bm, br, bn, out_t)
  return out


@nki.jit
def xuv_kernel(x, u, v, bm, bk, br, bn, out_t, x_transposed, x_cache=False):
  """O (or O^T) = X·U·V.

  x: [M, K] (or X^T [K, M] if x_transposed); u: [K, r]; v: [r, N]; all dims multiples
  of 128 and of their blocks; returns [M, N] (or [N, M] if out_t) in x.dtype.
  """
  return _xuv_body(x, u, v, None, bm, bk, br, bn, out_t, x_transposed, x_cache)


@nki.jit
def xuv_bias_kernel(x, u, v, bias, bm, bk, br, bn, out_t, x_transposed, x_cache=False):
  """As :func:`xuv_kernel` plus bias: [1, N] added to every output row."""
  return _xuv_body(x, u, v, bias, bm, bk, br, bn, out_t, x_transposed, x_cache)


@nki.jit
def xuv_scale_kernel(x, u, v, scale, bm, bk, br, bn, out_t, x_transposed, x_cache=False):
  """As :func:`xuv_kernel` with the rank-space scale: [r, 1], O = ((X·U) ⊙ s)·V."""
  return _xuv_body(x, u, v, None, bm, bk, br, bn, out_t, x_transposed, x_cache, scale)


@nki.jit
def xuv_bias_scale_kernel(x, u, v, bias, scale, bm, bk, br, bn, out_t, x_transposed, x_cache=False):
  """As :func:`xuv_bias_kernel` with the rank-space scale: [r, 1]."""
  return _xuv_body(x, u, v, bias, bm, bk, br, bn, out_t, x_transposed, x_cache, scale)


def kernel_for(has_bias: bool, has_scale: bool):
  """The entry point taking (x, u, v[, bias][, scale], blocks...)."""
  return {
    (False, False): xuv_kernel,
    (True, False): xuv_bias_kernel,
    (False, True): xuv_scale_kernel,
    (True, True): xuv_bias_scale_kernel,
  }[(bool(has_bias), bool(has_scale))]


# ----------------------------------------------------------------------------- wrapper


def _pad2(xp, a, rows, cols):
  pr, pc = rows - a.shape[0], cols - a.shape[1]
  return a if (pr, pc) == (0, 0) else xp.pad(a, ((0, pr), (0, pc)))


def prepare(
  x, u, v, bias=None, scale=None, *, xp, out_t=False, x_transposed=False, block_sizes=None
):
  """Pads 2-D operands to multiples of 128 and picks blocks.

  x: [M, K] (or [K, M] if x_transposed); u: [K, r]; v: [r, N]; bias: [N] or None; scale:
  [r] or None (zero-padded to [r padded, 1]); ``xp`` is numpy or jax.numpy. Returns
  (kernel args, kernel kwargs, (M, N)); :func:`kernel_for` names the kernel to call.
  """
  if x.ndim != 2:
    raise ValueError(f"{x.shape=} must be 2-D: [M, K] (or [K, M] with x_transposed)")
  K, r = u.shape
  N = v.shape[1]
  M = x.shape[1] if x_transposed else x.shape[0]
  if (x.shape[0] if x_transposed else x.shape[1]) != K or v.shape[0] != r:
    raise ValueError(f"{x.shape=}, {u.shape=}, {v.shape=} do not chain as X·U·V")
  Mp, Kp, rp, Np = (planner.pad128(d) for d in (M, K, r, N))
  bs = block_sizes or BlockSizes.get_default(
    M,
    K,
    r,
    N,
    x.dtype,
    out_t=out_t,
    x_transposed=x_transposed,
    has_bias=bias is not None,
    has_scale=scale is not None,
  )
  x = _pad2(xp, x, Kp, Mp) if x_transposed else _pad2(xp, x, Mp, Kp)
  args = (x, _pad2(xp, u, Kp, rp), _pad2(xp, v, rp, Np))
  if bias is not None:
    if bias.shape != (N,):
      raise ValueError(f"{bias.shape=} must be ({N},)")
    args += (_pad2(xp, bias.reshape(1, N), 1, Np),)
  if scale is not None:
    if scale.shape != (r,):
      raise ValueError(f"{scale.shape=} must be ({r},)")
    args += (_pad2(xp, scale.reshape(r, 1), rp, 1),)
  kwargs = dict(
    bm=bs.bm,
    bk=bs.bk,
    br=bs.br,
    bn=bs.bn,
    out_t=out_t,
    x_transposed=x_transposed,
    x_cache=bs.x_cache,
  )
  return args, kwargs, (M, N)


def finish(out, shape, out_t=False):
  """Slices the padding off the kernel's output."""
  M, N = shape
  return out[:N, :M] if out_t else out[:M, :N]


def xuv(x, u, v, bias=None, scale=None, *, out_t=False, x_transposed=False, block_sizes=None):
  """JAX entry point: y = ((x·u) ⊙ scale)·v (+ bias) through the NKI kernel (jax-neuronx).

  x: [..., K] (or [K, M] with x_transposed); returns [..., N] (or [N, M] with out_t).
  Calling an ``@nki.jit`` kernel with jax arrays inside a jitted function lowers
  to a Neuron custom call (the integration that replaced jax_neuronx.nki_call).
  """
  import jax.numpy as jnp

  lead = x.shape[:-1] if not x_transposed else ()
  x2 = x.reshape(-1, x.shape[-1]) if not x_transposed else x
  args, kwargs, shape = prepare(
    x2, u, v, bias, scale, xp=jnp, out_t=out_t, x_transposed=x_transposed, block_sizes=block_sizes
  )
  kern = kernel_for(bias is not None, scale is not None)
  y = finish(kern(*args, **kwargs), shape, out_t)
  return y if (out_t or x_transposed) else y.reshape(lead + (v.shape[1],))


def xuv_reference(x, u, v, bias=None, scale=None, *, out_t=False, x_transposed=False):
  """The lrjax reference in this kernel's layouts (f32 accumulation, strip in x.dtype)."""
  from lrjax.lowering import lr_xuv_reference

  y = lr_xuv_reference(x.T if x_transposed else x, u, v, bias, scale=scale)
  return y.T if out_t else y
