"""A Triton GEMM whose kernel builds TMA descriptors on the device (a helper of the tests of
lrjax's own launcher, launch.py): it needs Triton's global scratch, and with its K loop
warp-specialized more warps than ``num_warps``, which only lrjax's launcher passes. Not a
product kernel: no ring, no epilogue beyond the store."""

from __future__ import annotations

import jax
import triton
import triton.language as tl

from lrjax.custom_calls.triton import launch


@triton.jit
def _grouped_tile(t, n_m, n_n, GROUP: tl.constexpr):
  """Tile t's (row block, column block): GROUP row blocks share each B column block while it
  is in L2."""
  width = GROUP * n_n
  first = (t // width) * GROUP
  size = tl.minimum(n_m - first, GROUP)
  return first + (t % width) % size, (t % width) // size


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
  ``out`` [M, N]: a buffer the kernel writes into (aliased; the tests poison it)."""
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
    name="lrjax_gemm_tma",
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
