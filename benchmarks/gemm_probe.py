"""Plain Triton GEMMs, for measuring the tile throughput the persistent prefill kernels could
work under, side by side with XLA's own dot on the same shape (``gpu_lowrank.py --suite
gemm_ceiling``):

- ``gemm``: the lrjax kernels' pointer tile loop (``_common.mm_acc``: masked loads that Triton
  pipelines with cp.async), one output tile per CTA;
- ``gemm_tma``: the same product from TMA tensor descriptors built on the device
  (``tl.make_tensor_descriptor``; Triton then loads through the bulk tensor copy engine), one
  tile per CTA or persistent (one CTA per SM walking the tiles), optionally with the K loop
  warp-specialized (a producer warpgroup issuing the TMA loads, two consumer warpgroups issuing
  wgmma). jaxlib's launcher cannot pass the descriptors' global scratch or launch the extra
  warps, so these go through lrjax's own (custom_calls/triton/launch.py).

Not product kernels. They have no dependencies, no ring and no epilogue beyond the store, so
their time is what the tile loop alone costs. ``check`` compares either with XLA's dot before
it is timed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax_triton as jt
import numpy as np
import triton
import triton.language as tl

from lrjax.custom_calls.triton import launch
from lrjax.custom_calls.triton._common import mm_acc


@triton.jit
def _grouped_tile(t, n_m, n_n, GROUP: tl.constexpr):
  """Tile t's (row block, column block): GROUP row blocks share each B column block while it
  is in L2."""
  width = GROUP * n_n
  first = (t // width) * GROUP
  size = tl.minimum(n_m - first, GROUP)
  return first + (t % width) % size, (t % width) // size


@triton.jit
def _gemm_kernel(
  a_ptr,
  b_ptr,
  c_ptr,
  M: tl.constexpr,
  N: tl.constexpr,
  K: tl.constexpr,
  BM: tl.constexpr,
  BN: tl.constexpr,
  BK: tl.constexpr,
  GROUP: tl.constexpr,
):
  pm, pn = _grouped_tile(tl.program_id(0), (M + BM - 1) // BM, (N + BN - 1) // BN, GROUP)
  offs_m = pm * BM + tl.arange(0, BM)
  offs_n = pn * BN + tl.arange(0, BN)
  m_mask = offs_m < M
  n_mask = offs_n < N
  acc = tl.zeros([BM, BN], tl.float32)
  acc = mm_acc(
    acc, a_ptr, b_ptr, offs_m, offs_n, m_mask, n_mask, 0, K, K, K, N, BK, K % BK == 0, False
  )
  tl.store(
    c_ptr + offs_m[:, None] * N + offs_n[None, :],
    acc.to(c_ptr.dtype.element_ty),
    mask=m_mask[:, None] & n_mask[None, :],
  )


@triton.jit
def _gemm_tma_kernel(
  a_ptr,  # [M, K]
  b_ptr,  # [K, N]
  o_in_ptr,  # [M, N] the caller's output buffer aliased to c_ptr (never read)
  c_ptr,  # [M, N]
  M: tl.constexpr,
  N: tl.constexpr,
  K: tl.constexpr,
  BM: tl.constexpr,
  BN: tl.constexpr,
  BK: tl.constexpr,
  GROUP: tl.constexpr,
  PROGRAMS: tl.constexpr,
  WS: tl.constexpr,
):
  a_d = tl.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [BM, BK])
  b_d = tl.make_tensor_descriptor(b_ptr, [K, N], [N, 1], [BK, BN])
  c_d = tl.make_tensor_descriptor(c_ptr, [M, N], [N, 1], [BM, BN])
  n_m, n_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
  for t in tl.range(tl.program_id(0), n_m * n_n, PROGRAMS):
    pm, pn = _grouped_tile(t, n_m, n_n, GROUP)
    acc = tl.zeros([BM, BN], tl.float32)
    for kb in tl.range(tl.cdiv(K, BK), warp_specialize=WS):  # out of bounds reads are zeros
      acc = tl.dot(a_d.load([pm * BM, kb * BK]), b_d.load([kb * BK, pn * BN]), acc)
    c_d.store([pm * BM, pn * BN], acc.to(c_d.dtype))


def gemm_tma(
  a, b, *, bm=128, bn=256, bk=64, group=8, warps=8, stages=3, programs=0, ws=False, out=None
):
  """a [M, K] @ b [K, N] in a's dtype from TMA descriptors: one tile per CTA (programs=0) or
  ``programs`` persistent CTAs; ``ws`` warp-specializes the K loop (then ``warps`` is each
  of its three warpgroups' count, 4). K and N must be multiples of 8 (16-byte row strides).
  ``out`` [M, N]: a buffer the kernel writes into (aliased; ``check`` poisons it)."""
  (m, k), (k2, n) = a.shape, b.shape
  if k != k2 or a.dtype != b.dtype or k % 8 or n % 8:
    raise ValueError(
      f"{a.shape=} {a.dtype=} @ {b.shape=} {b.dtype=}: expected [M, K] @ [K, N] "
      "of one dtype, K and N multiples of 8"
    )
  tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
  grid = min(programs, tiles) if programs else tiles
  return launch.triton_call(
    a,
    b,
    a if out is None else out,
    kernel=_gemm_tma_kernel,
    input_output_aliases=None if out is None else {2: 0},
    out_shape=jax.ShapeDtypeStruct((m, n), a.dtype),
    grid=(grid,),
    num_warps=warps,
    num_stages=stages,
    name="lrjax_gemm_tma_probe",
    M=m,
    N=n,
    K=k,
    BM=bm,
    BN=bn,
    BK=bk,
    GROUP=group,
    PROGRAMS=grid,
    WS=bool(ws),
  )


def gemm_variant(a, b, kind="ptr", **cfg):
  """``gemm`` (kind "ptr") or ``gemm_tma`` (kind "tma")."""
  if kind not in ("ptr", "tma"):
    raise ValueError(f"{kind=}: expected 'ptr' or 'tma'")
  return (gemm if kind == "ptr" else gemm_tma)(a, b, **cfg)


def gemm(a, b, *, bm=128, bn=256, bk=64, group=8, warps=8, stages=3):
  """a [M, K] @ b [K, N] in a's dtype, one output tile per CTA."""
  (m, k), (k2, n) = a.shape, b.shape
  if k != k2 or a.dtype != b.dtype:
    raise ValueError(
      f"{a.shape=} {a.dtype=} @ {b.shape=} {b.dtype=}: expected [M, K] @ [K, N] of one dtype"
    )
  grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
  return jt.triton_call(
    a,
    b,
    kernel=_gemm_kernel,
    out_shape=jax.ShapeDtypeStruct((m, n), a.dtype),
    grid=grid,
    num_warps=warps,
    num_stages=stages,
    name="lrjax_gemm_probe",
    M=m,
    N=n,
    K=k,
    BM=bm,
    BN=bn,
    BK=bk,
    GROUP=group,
  )


def check(a, b, **cfg):
  """Raises unless the probe (``gemm_variant``'s arguments) matches XLA's f32-accumulated dot
  (bf16 output rounding); a TMA probe's output is poisoned (NaN) first, so unwritten tiles fail."""
  if cfg.get("kind") == "tma":
    cfg = dict(cfg, out=jnp.full((a.shape[0], b.shape[1]), jnp.nan, a.dtype))
  got = np.asarray(jax.jit(lambda a, b: gemm_variant(a, b, **cfg))(a, b), np.float32)
  want = np.asarray(jnp.dot(a, b, preferred_element_type=jnp.float32), np.float32)
  err = np.max(np.abs(got - want)) / max(1e-6, float(np.max(np.abs(want))))
  if not err < 2e-2:  # NaN fails too
    raise AssertionError(f"GEMM probe {a.shape} @ {b.shape} {cfg}: max error {err:.3g} of max")
