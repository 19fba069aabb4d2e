"""Naive fused XUV (NeuronMM Algorithm 1), kept as the baseline of the traffic comparison.

For every output block O_mn it recomputes each intermediate block Y_mp = X_m·U_p
(already as Y^T by operand order) and multiplies it with V_pn: X and U are re-read
from HBM for every one of the ceil(N/B_N) output blocks of a row strip, and the
first matmul's flops are paid ceil(N/B_N) times (paper §3.2, Table 1). It is not
registered as a lowering; ``xuv.py`` is the TrainiumFusion kernel that caches the
strip instead.

x: [M, K], u: [K, r], v: [r, N], multiples of 128, bf16/f16; writes O [M, N].
Targets NKI 0.7 (AWS Neuron SDK 2.33, ``import nki``).
"""

from __future__ import annotations

import dataclasses

from lrjax.custom_calls.nki import _api, planner

nki, nl, nisa = _api.toolchain(globals())

P = 128


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  bm: int
  bk: int
  br: int
  bn: int

  @classmethod
  def get_default(cls, M, K, r, N, dtype) -> BlockSizes:
    """The tuned blocks of the shape class if they fit, else the planner's."""
    blocks = TUNED.get(tuple(planner.pad128(d) for d in (K, r, N)))
    if blocks is not None:
      try:
        return cls(*planner.plan("xuv_naive", M, K, r, N, dtype, blocks=blocks).blocks.as_tuple())
      except ValueError:
        pass
    return cls(*planner.plan("xuv_naive", M, K, r, N, dtype).blocks.as_tuple())


# (K, r, N) padded -> blocks. Table 1's shape: B_N = 512 is the paper's (§3.2); B_M, B_K,
# B_r are our assumption (they reproduce the paper's naive traffic within 4%).
TUNED = {(2048, 2048, 8192): (128, 512, 512, 512)}


def _moving_tile(b):
  return 512 if b % 512 == 0 else (256 if b % 256 == 0 else P)


@nki.jit
def xuv_naive_kernel(x, u, v, bm, bk, br, bn):
  """O = X·U·V, recomputing X·U per output block. x: [M, K]; u: [K, r]; v: [r, N] -> [M, N]."""
  M, K = x.shape
  r, N = v.shape
  tm = _moving_tile(bm)
  tn = _moving_tile(bn)
  n_rt = br // P
  out = nl.ndarray((M, N), dtype=x.dtype, buffer=nl.shared_hbm)
  for m in nl.affine_range(M // bm):
    m0 = m * bm
    for n in nl.affine_range(N // bn):
      n0 = n * bn
      acc_o = nl.ndarray((P, (bm // P) * (bn // tn), tn), dtype=nl.float32, buffer=nl.psum)
      nisa.memset(dst=acc_o, value=0.0)
      for p in nl.affine_range(r // br):
        acc_y = nl.ndarray((P, n_rt * (bm // tm), tm), dtype=nl.float32, buffer=nl.psum)
        nisa.memset(dst=acc_y, value=0.0)
        for k in nl.affine_range(K // bk):
          k0 = k * bk
          xt = nl.ndarray((P, bk // P, bm), dtype=x.dtype, buffer=nl.sbuf)
          ub = nl.ndarray((P, bk // P, br), dtype=u.dtype, buffer=nl.sbuf)
          for kt in nl.affine_range(bk // P):
            for mt in nl.affine_range(bm // tm):
              nisa.dma_transpose(
                dst=xt[:, kt, mt * tm : (mt + 1) * tm],
                src=x[m0 + mt * tm : m0 + (mt + 1) * tm, k0 + kt * P : k0 + (kt + 1) * P],
              )
            nisa.dma_copy(
              dst=ub[:, kt, :], src=u[k0 + kt * P : k0 + (kt + 1) * P, p * br : (p + 1) * br]
            )
          for rt in nl.affine_range(n_rt):
            for mt in nl.affine_range(bm // tm):
              for kt in nl.affine_range(bk // P):
                nisa.nc_matmul(
                  dst=acc_y[:, rt * (bm // tm) + mt, :],
                  stationary=ub[:, kt, rt * P : (rt + 1) * P],
                  moving=xt[:, kt, mt * tm : (mt + 1) * tm],
                  accumulate=True,
                )
        yb = nl.ndarray((P, n_rt, bm), dtype=x.dtype, buffer=nl.sbuf)
        for rt in nl.affine_range(n_rt):
          for mt in nl.affine_range(bm // tm):
            nisa.tensor_copy(
              dst=yb[:, rt, mt * tm : (mt + 1) * tm], src=acc_y[:, rt * (bm // tm) + mt, :]
            )
        vb = nl.ndarray((P, n_rt, bn), dtype=v.dtype, buffer=nl.sbuf)
        for rt in nl.affine_range(n_rt):
          nisa.dma_copy(
            dst=vb[:, rt, :], src=v[p * br + rt * P : p * br + (rt + 1) * P, n0 : n0 + bn]
          )
        for rt in nl.affine_range(n_rt):
          for mi in nl.affine_range(bm // P):
            for nj in nl.affine_range(bn // tn):
              nisa.nc_matmul(
                dst=acc_o[:, mi * (bn // tn) + nj, :],
                stationary=yb[:, rt, mi * P : (mi + 1) * P],
                moving=vb[:, rt, nj * tn : (nj + 1) * tn],
                accumulate=True,
              )
      ob = nl.ndarray((P, bm // P, bn), dtype=x.dtype, buffer=nl.sbuf)
      for mi in nl.affine_range(bm // P):
        for nj in nl.affine_range(bn // tn):
          nisa.tensor_copy(
            dst=ob[:, mi, nj * tn : (nj + 1) * tn], src=acc_o[:, mi * (bn // tn) + nj, :]
          )
        nisa.dma_copy(dst=out[m0 + mi * P : m0 + (mi + 1) * P, n0 : n0 + bn], src=ob[:, mi, :])
  return out


def xuv_naive(x, u, v, *, block_sizes=None):
  """JAX entry point (for comparisons only). x, u, v already padded to multiples of 128."""
  bs = block_sizes or BlockSizes.get_default(
    x.shape[0], x.shape[1], u.shape[1], v.shape[1], x.dtype
  )
  return xuv_naive_kernel(x, u, v, bm=bs.bm, bk=bs.bk, br=bs.br, bn=bs.bn)


def xuv_naive_reference(x, u, v):
  from lrjax.lowering import lr_xuv_reference

  return lr_xuv_reference(x, u, v)
