"""Decode X·U·V (small M): inter-CTA split-K on X·U, then ·V, in one launch.

Stage 1 splits the long K reduction of X·U over ``split_k x ceil(r/block_r)`` CTAs.
Each streams a K-chunk x block_r slab of U through a software-pipelined loop
(``num_stages`` deep) and adds its [M, block_r] partial into an f32 accumulator P with
relaxed f32 atomics (the reduction of the split-K partials). It then bumps a
stage counter with a gpu-scope *release*.

Stage 2 CTAs (launched after the stage-1 CTAs, in the same grid) wait for the counter to
reach the number of stage-1 CTAs (acquire), then stream their block_n columns of V against
P (read from L2, rounded to V's dtype). They apply the bias and write the output.

Why one launch: at M <= 16 the whole op is 45-60 µs of HBM streaming, and a second
launch costs a dependent-launch gap plus a second tail. In one grid, stage-2 CTAs are
already resident when P completes. The accumulator and counter are zeroed by
jax-triton's pre-launch memset (``zeroed_outputs``), inside the same custom call.
Forward progress relies on CUDA dispatching lower block indices first, so every
stage-1 CTA is running or done before a stage-2 CTA can occupy its slot; that is the
same assumption as decoupled look-back scans. ``single_launch=False`` runs the
two stages as two launches (kept for the measurement in benchmarks/gpu_notes.md).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import jax_triton as jt
import triton
import triton.language as tl

from lrjax.custom_calls.triton import planner
from lrjax.custom_calls.triton._common import mm_acc, signal, wait_at_least


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  block_m: int  # token rows, padded (>= 16 for the mma)
  block_k: int  # stage-1 reduction step
  block_r: int  # stage-1 columns of U per CTA
  split_k: int  # stage-1 CTAs per column block (inter-CTA split-K)
  block_n: int  # stage-2 columns of V per CTA
  block_kv: int  # stage-2 reduction step over r
  num_warps: int = 4
  num_stages: int = 4
  single_launch: bool = True

  @classmethod
  def get_default(cls, m: int, k: int, r: int, n: int) -> "BlockSizes":
    key = (_m_class(m), _r_class(r))
    if key in TUNED:
      t = TUNED[key]
      split = max(1, min(t.split_k, planner.cdiv(k, 2 * t.block_k)))
      return dataclasses.replace(t, block_m=max(16, planner.next_pow2(m)), split_k=split)
    p = planner.plan_decode(m, k, r, n)
    return cls(p.block_m, p.block_k, p.block_r, p.split_k, p.block_n, p.block_kv,
               p.warps, p.stages)


def _m_class(m: int) -> str:
  return "m<=16" if m <= 16 else ("m<=64" if m <= 64 else "m<=128")


def _r_class(r: int) -> str:
  return "r>=2048" if r >= 2048 else "r<2048"


# Tuned on the H200 (benchmarks/gpu_lowrank.py); shape class -> blocks. Other shapes
# fall back to planner.plan_decode.
TUNED: dict[tuple[str, str], BlockSizes] = {
    ("m<=16", "r>=2048"): BlockSizes(16, 64, 128, 8, 64, 64, 4, 4),
    ("m<=16", "r<2048"): BlockSizes(16, 64, 64, 8, 64, 64, 4, 4),
    ("m<=64", "r>=2048"): BlockSizes(64, 64, 128, 8, 64, 64, 4, 3),
    ("m<=64", "r<2048"): BlockSizes(64, 64, 64, 8, 64, 64, 4, 3),
}

MAX_M = 128  # beyond this the prefill kernel serves


@triton.jit
def _stage1(pid, x_ptr, u_ptr, p_ptr,
            M: tl.constexpr, K: tl.constexpr, R: tl.constexpr, K_PER: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
            EVEN_K: tl.constexpr):
  n_r = (R + BLOCK_R - 1) // BLOCK_R
  rb = pid % n_r
  ks = pid // n_r
  offs_m = tl.arange(0, BLOCK_M)
  m_mask = offs_m < M
  offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
  r_mask = offs_r < R
  k_start = ks * K_PER
  acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
  acc = mm_acc(acc, x_ptr, u_ptr, offs_m, offs_r, m_mask, r_mask, k_start, k_start + K_PER,
               K, K, R, BLOCK_K, EVEN_K, False)
  tl.atomic_add(p_ptr + offs_m[:, None] * R + offs_r[None, :], acc,
                mask=m_mask[:, None] & r_mask[None, :], sem="relaxed")


@triton.jit
def _stage2(nb, p_ptr, v_ptr, b_ptr, o_ptr,
            M: tl.constexpr, R: tl.constexpr, N: tl.constexpr, HAS_BIAS: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KV: tl.constexpr,
            EVEN_R: tl.constexpr):
  offs_m = tl.arange(0, BLOCK_M)
  m_mask = offs_m < M
  offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
  n_mask = offs_n < N
  acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
  acc = mm_acc(acc, p_ptr, v_ptr, offs_m, offs_n, m_mask, n_mask, 0, R,
               R, R, N, BLOCK_KV, EVEN_R, True)
  if HAS_BIAS:
    acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
  tl.store(o_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(o_ptr.dtype.element_ty),
           mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _xuv_decode_kernel(
    x_ptr,  # [M, K] activations
    u_ptr,  # [K, R] first factor
    v_ptr,  # [R, N] second factor
    b_ptr,  # [N] bias (read only if HAS_BIAS)
    o_in_ptr,  # [M, N] caller's output buffer aliased to o_ptr (else x; never read)
    p_ptr,  # [M, R] f32 split-K accumulator of X·U, zeroed before launch
    cnt_ptr,  # [1] i32 stage-1 CTAs done, zeroed before launch
    o_ptr,  # [M, N] output (unused when STAGE == 1)
    M: tl.constexpr, K: tl.constexpr, R: tl.constexpr, N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STAGE: tl.constexpr,  # 0: both stages in one grid; 1 or 2: that stage alone
    K_PER: tl.constexpr,  # K-chunk per split (multiple of BLOCK_K; the last may be ragged)
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_KV: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_R: tl.constexpr,
):
  pid = tl.program_id(0)
  n1 = (R + BLOCK_R - 1) // BLOCK_R * SPLIT_K
  if STAGE == 1:
    _stage1(pid, x_ptr, u_ptr, p_ptr, M, K, R, K_PER, BLOCK_M, BLOCK_K, BLOCK_R, EVEN_K)
  elif STAGE == 2:
    _stage2(pid, p_ptr, v_ptr, b_ptr, o_ptr, M, R, N, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_KV,
            EVEN_R)
  else:
    if pid < n1:
      _stage1(pid, x_ptr, u_ptr, p_ptr, M, K, R, K_PER, BLOCK_M, BLOCK_K, BLOCK_R, EVEN_K)
      signal(cnt_ptr)
    else:
      wait_at_least(cnt_ptr, n1)
      _stage2(pid - n1, p_ptr, v_ptr, b_ptr, o_ptr, M, R, N, HAS_BIAS, BLOCK_M, BLOCK_N,
              BLOCK_KV, EVEN_R)


def launch_plan(m: int, k: int, r: int, n: int, has_bias: bool, bs: BlockSizes) -> dict:
  """Grid sizes and constexprs of one call (shared by the wrapper and the GPU tests)."""
  k_per = planner.cdiv(planner.cdiv(k, bs.split_k), bs.block_k) * bs.block_k
  split = planner.cdiv(k, k_per)  # no chunk starts past K
  n1 = planner.cdiv(r, bs.block_r) * split
  n2 = planner.cdiv(n, bs.block_n)
  meta = dict(M=m, K=k, R=r, N=n, HAS_BIAS=has_bias, K_PER=k_per, SPLIT_K=split,
              BLOCK_M=bs.block_m, BLOCK_K=bs.block_k, BLOCK_R=bs.block_r,
              BLOCK_N=bs.block_n, BLOCK_KV=bs.block_kv, EVEN_K=k % k_per == 0,
              EVEN_R=r % bs.block_kv == 0)
  return dict(n1=n1, n2=n2, meta=meta)


def xuv_decode(x, u, v, bias=None, *, out_dtype=None, block_sizes: BlockSizes | None = None,
               out=None):
  """y = (x·u)·v (+ bias) for few tokens. x [..., K], u [K, r], v [r, N], bias [N].

  ``out`` [M, N]: optional buffer the kernel writes into (aliased; the tests poison it).
  """
  if u.ndim != 2 or v.ndim != 2 or x.shape[-1] != u.shape[0] or u.shape[1] != v.shape[0]:
    raise ValueError(f"{x.shape=}, {u.shape=}, {v.shape=}: expected x [..., K], u [K, r], "
                     "v [r, N]")
  if u.dtype != v.dtype or x.dtype != u.dtype:
    raise TypeError(f"{x.dtype=}, {u.dtype=}, {v.dtype=} must match")
  lead = x.shape[:-1]
  k, r = u.shape
  n = v.shape[1]
  x2 = x.reshape(-1, k)
  m = x2.shape[0]
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  bs = block_sizes or BlockSizes.get_default(m, k, r, n)
  if bs.block_m < m:
    raise ValueError(f"{bs.block_m=} must cover the {m} rows; use xuv_prefill for large M")
  b = bias if bias is not None else v  # never read without HAS_BIAS
  plan = launch_plan(m, k, r, n, bias is not None, bs)
  meta = plan["meta"]
  acc_shape = jax.ShapeDtypeStruct((m, r), jnp.float32)
  cnt_shape = jax.ShapeDtypeStruct((1,), jnp.int32)
  o_shape = jax.ShapeDtypeStruct((m, n), out_dtype)
  common = dict(kernel=_xuv_decode_kernel, num_warps=bs.num_warps,
                num_stages=bs.num_stages, name="lrjax_xuv_decode")
  _check_out(out, (m, n), out_dtype)
  if bs.single_launch:
    _, _, o = jt.triton_call(x2, u, v, b, x2 if out is None else out, out_shape=(acc_shape, cnt_shape, o_shape),
                             grid=(plan["n1"] + plan["n2"],), zeroed_outputs=(0, 1),
                             input_output_aliases={4: 2} if out is not None else None,
                             STAGE=0, **common, **meta)
  else:
    p, cnt, _ = jt.triton_call(x2, u, v, b, x2, out_shape=(
        acc_shape, cnt_shape, jax.ShapeDtypeStruct((1,), out_dtype)),
        grid=(plan["n1"],), zeroed_outputs=(0, 1), STAGE=1, **common, **meta)
    o = jt.triton_call(x2, u, v, b, x2 if out is None else out, p, cnt, out_shape=o_shape, grid=(plan["n2"],),
                       input_output_aliases={4: 0} if out is not None else None,
                       STAGE=2, **common, **meta)
  return o.reshape(*lead, n)


def _check_out(out, shape, dtype):
  if out is not None and (tuple(out.shape) != shape or out.dtype != dtype):
    raise ValueError(f"{out.shape=} {out.dtype=}: expected {shape} {dtype}")


def xuv_decode_reference(x, u, v, bias=None, *, out_dtype=None):
  """f32-accumulating (x·u)·v (+ bias); X·U rounded to v's dtype as the kernel does."""
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  p = jnp.matmul(x, u, preferred_element_type=jnp.float32).astype(v.dtype)
  y = jnp.matmul(p, v, preferred_element_type=jnp.float32)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return y.astype(out_dtype)
