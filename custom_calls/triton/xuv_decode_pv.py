"""The ·V launch of decode X·U·V: Y = P·V (+ bias) from phase 1's f32 sums P = X·U.

From 33 rows, where V is small, ``xuv_decode`` runs its persistent kernel's phase 1 alone and
then this launch (``pv="launch"``). One [block_m, block_n] output tile a CTA reads its rows of
P's f32 sums where phase 1 left them, rounds them to V's dtype as it loads them and applies V
over all of r. On a scratch chain P is a slice of the chain's buffer and the launch reads it
there (``launch._read_in_place``), so XLA runs no kernel between the two launches; XLA may
start it as a programmatic dependent of phase 1 (it waits on the grid dependency first).
Against XLA's GEMM on the same P (which needs a rounding fusion before it and, at these
shapes, a split-K reduction after it) it is faster where V is small; where V is large XLA's
GEMM applies V instead (``xuv_decode.default_pv``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from lrjax.custom_calls.triton import launch, planner
from lrjax.custom_calls.triton._common import (
  check_out,
  mm_acc,
  pdl_join,
  prefetch_ahead,
  residual_operand,
  residual_reference,
  store_out,
)


@dataclasses.dataclass(frozen=True)
class BlockSizes(planner.PvLaunchPlan):
  """The launch's tiles (``planner.PvLaunchPlan``'s fields: block_m, block_n, block_kv, warps,
  stages); any ``planner.PvLaunchPlan`` is accepted where a BlockSizes is."""

  @classmethod
  def get_default(cls, m: int, r: int, n: int) -> BlockSizes:
    return cls(**dataclasses.asdict(planner.plan_pv_launch(m, r, n)))


@triton.jit
def _xuv_decode_pv_kernel(
  scratch_ptr,  # f32 P [M, R] at READ_OFF floats: phase 1's scratch (or the chain's buffer)
  v_ptr,  # [R, N] second factor
  b_ptr,  # [N] bias, or [M, N] residual (read only if HAS_BIAS; _common.store_out)
  o_in_ptr,  # the caller's output buffer aliased to o_ptr, else V; never read
  M,
  o_ptr,  # [M, N] output
  R: tl.constexpr,
  N: tl.constexpr,
  HAS_BIAS: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_N: tl.constexpr,
  BLOCK_KV: tl.constexpr,
  EVEN_R: tl.constexpr,
  READ_OFF: tl.constexpr = 0,  # where P starts in scratch_ptr (launch._read_in_place sets it)
  PDL: tl.constexpr = 0,  # launched as a programmatic dependent: wait for phase 1 first
):
  """Y = P·V (+ bias or residual): one [BLOCK_M, BLOCK_N] output tile a CTA, P's f32 sums
  rounded to V's dtype as they are loaded (XLA's own lowering rounds X·U once too), f32
  accumulation over all of r."""
  offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
  offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
  m_mask = offs_m < M
  n_mask = offs_n < N
  if PDL >= 2:  # before the wait: the first rows of this tile's V columns
    c0 = tl.program_id(0) * BLOCK_N
    prefetch_ahead(v_ptr, 0, c0, R, tl.minimum(c0 + BLOCK_N, N), N, True)
  pdl_join(PDL)
  acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
  acc = mm_acc(
    acc,
    scratch_ptr + READ_OFF,
    v_ptr,
    offs_m,
    offs_n,
    m_mask,
    n_mask,
    0,
    R,
    R,
    R,
    N,
    BLOCK_KV,
    EVEN_R,
    True,
  )
  store_out(
    acc,
    b_ptr,
    o_ptr,
    offs_m[:, None] * N + offs_n[None, :],
    m_mask[:, None] & n_mask[None, :],
    offs_n,
    n_mask,
    HAS_BIAS,
  )


def launch_meta(r: int, n: int, has_bias: bool, p: planner.PvLaunchPlan) -> dict:
  """Constexprs of one launch (shared by the wrapper and the tests)."""
  return dict(
    R=r,
    N=n,
    HAS_BIAS=has_bias,
    BLOCK_M=p.block_m,
    BLOCK_N=p.block_n,
    BLOCK_KV=p.block_kv,
    EVEN_R=r % p.block_kv == 0,
  )


def _launch(
  p_f32, v, bias, m: int, out_dtype, block_sizes: planner.PvLaunchPlan | None, out, residual
):
  r, n = v.shape
  b, has_b = residual_operand(residual, bias, (m,), n, out_dtype)
  if p_f32.dtype != jnp.float32 or p_f32.shape != (m * r,):
    raise ValueError(f"P must be phase 1's f32 [{m * r}] sums, got {p_f32.dtype}{p_f32.shape}")
  check_out(out, (m, n), out_dtype)
  p = block_sizes or planner.plan_pv_launch(m, r, n)  # PvLaunchPlan refuses tiles under 16
  return launch.triton_call(
    p_f32,
    v,
    b if has_b else v,
    v if out is None else out,
    m,
    kernel=_xuv_decode_pv_kernel,
    out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
    grid=(planner.cdiv(n, p.block_n), planner.cdiv(m, p.block_m)),
    num_warps=p.warps,
    num_stages=p.stages,
    input_output_aliases=None if out is None else {3: 0},
    name="lrjax_xuv_pv",
    **launch_meta(r, n, has_b, p),
  )


def xuv_decode_pv(
  p,
  v,
  bias=None,
  *,
  m: int,
  out_dtype=None,
  block_sizes: planner.PvLaunchPlan | None = None,
  out=None,
  residual=None,
):
  """y [m, N] = P·V (+ bias) (+ residual). p: phase 1's f32 sums, flat [m·r] (a slice of a
  chained scratch is read in place); v [r, N], bias [N], residual [m, N] in the output dtype
  (no bias with it). ``out`` [m, N]: optional buffer the kernel writes into (aliased)."""
  return _launch(p, v, bias, m, jnp.dtype(out_dtype or v.dtype), block_sizes, out, residual)


def xuv_decode_pv_reference(p, v, bias=None, *, m: int, out_dtype=None, residual=None):
  """P rounded once to V's dtype, times V in f32 (+ bias) (+ residual)."""
  r = v.shape[0]
  pm = p.reshape(m, r).astype(v.dtype)
  y = jnp.matmul(pm, v, preferred_element_type=jnp.float32)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return residual_reference(y.astype(out_dtype or v.dtype), residual)
