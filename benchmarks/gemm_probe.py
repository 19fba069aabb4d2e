"""A plain Triton GEMM built from the lrjax kernels' tile loop (``_common.mm_acc``), for
measuring the tile-throughput ceiling the persistent prefill kernels work under, side by side
with XLA's own dot on the same shape (``gpu_lowrank.py --suite gemm_ceiling``).

Not a product kernel. It has no dependencies, no ring and no epilogue beyond the store, so its
time is what the tile loop alone costs. ``gemm`` checks its result against XLA's dot before it is
timed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import jax_triton as jt
import numpy as np
import triton
import triton.language as tl

from lrjax.custom_calls.triton._common import mm_acc


@triton.jit
def _gemm_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
  pid = tl.program_id(0)
  n_m = (M + BM - 1) // BM
  n_n = (N + BN - 1) // BN
  width = GROUP * n_n  # GROUP row blocks share each B column block while it is in L2
  first = (pid // width) * GROUP
  size = tl.minimum(n_m - first, GROUP)
  pm = first + (pid % width) % size
  pn = (pid % width) // size
  offs_m = pm * BM + tl.arange(0, BM)
  offs_n = pn * BN + tl.arange(0, BN)
  m_mask = offs_m < M
  n_mask = offs_n < N
  acc = tl.zeros([BM, BN], tl.float32)
  acc = mm_acc(acc, a_ptr, b_ptr, offs_m, offs_n, m_mask, n_mask, 0, K, K, K, N, BK,
               K % BK == 0, False)
  tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
           mask=m_mask[:, None] & n_mask[None, :])


def gemm(a, b, *, bm=128, bn=256, bk=64, group=8, warps=8, stages=3):
  """a [M, K] @ b [K, N] in a's dtype, one output tile per CTA."""
  (m, k), (k2, n) = a.shape, b.shape
  if k != k2 or a.dtype != b.dtype:
    raise ValueError(f"{a.shape=} {a.dtype=} @ {b.shape=} {b.dtype=}: expected [M, K] @ [K, N] "
                     "of one dtype")
  grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
  return jt.triton_call(a, b, kernel=_gemm_kernel,
                        out_shape=jax.ShapeDtypeStruct((m, n), a.dtype), grid=grid,
                        num_warps=warps, num_stages=stages, name="lrjax_gemm_probe", M=m, N=n,
                        K=k, BM=bm, BN=bn, BK=bk, GROUP=group)


def check(a, b, **cfg):
  """Raises unless the probe matches XLA's f32-accumulated dot (bf16 output rounding)."""
  got = np.asarray(jax.jit(lambda a, b: gemm(a, b, **cfg))(a, b), np.float32)
  want = np.asarray(jnp.dot(a, b, preferred_element_type=jnp.float32), np.float32)
  err = np.max(np.abs(got - want)) / max(1e-6, float(np.max(np.abs(want))))
  if not err < 2e-2:
    raise AssertionError(f"GEMM probe {a.shape} @ {b.shape} {cfg}: max error {err:.3g} of max")
