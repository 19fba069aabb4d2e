"""Decode attention from a low-rank KV cache (FlashSVD's attention from factors, for decode):
``lr_kv_attention`` (lowering/kv_attention.py) without rebuilding K or V in HBM.

Flash-decoding grid (batch, KV head, split of the cache). Each program:
  - loads the G = Hq/Hkv query heads of its KV head (padded to 16 rows for the tensor cores);
  - for each block of B_N keys, rebuilds K = zk·v_k[:, head] + b_k on chip, as two halves
    of D/2 columns (one pass over zk, both halves in its accumulators). Rotate-half RoPE is
    then elementwise: K_lo·cos − K_hi·sin and K_hi·cos + K_lo·sin, and the scores are
    q_lo·K_loᵀ + q_hi·K_hiᵀ;
  - keeps an online softmax and accumulates p·zv in the value rank space [G, r_v]: V is never
    rebuilt.
It writes (max, sum, p·zv) per split. The wrapper merges the splits in f32, projects once with
v_v[:, head] and adds b_v (the merged weights sum to 1). Keys past pos[b] are skipped, so a
short sequence in a long static cache costs only its own length.

Work per KV head and key: 2·r_k·D FLOPs to rebuild K (shared by the G query heads), against
2·(r_k + r_v) bytes read: compute-bound at LLM ranks, where the unfused program also writes
and reads K and V for the whole cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from lrjax.custom_calls.triton import launch, planner, policy
from lrjax.custom_calls.triton._common import mm_acc2, num_sms
from lrjax.custom_calls.triton.lowering import kv_attention_shape_reason
from lrjax.lowering.kv_attention import fold_values, lr_kv_attention_reference


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  block_n: int = 128  # keys per block
  block_k: int = 64  # reduction step over r_k when rebuilding K
  num_warps: int = 8
  num_stages: int = 3
  splits: int = 0  # programs per (sequence, KV head); 0: ``planner.plan_kv_splits``

  @classmethod
  def get_default(cls, b: int, hkv: int, t: int, d: int, rk: int, rv: int) -> BlockSizes:
    """The tuning table's blocks by shape class (``kv_attention`` tiles): 128 keys, 8 warps,
    3 stages; 64 keys and 2 stages above r_v = 512, where the [block_n, r_v] zv block goes
    through shared memory; no pipelining with a one-step r_k loop (Triton would multi-buffer
    that block past 227 KB)."""
    del b, hkv, t, d
    key = f"{'rk<=64' if rk <= cls.block_k else 'rk>64'},{'rv>512' if rv > 512 else 'rv<=512'}"
    return cls(**policy.tiles("kv_attention")[key])


@triton.jit
def _kv_attention_kernel(
  q_ptr,  # [B, HQ, D]
  zk_ptr,
  zv_ptr,  # [B, T, RK], [B, T, RV]
  vk_ptr,  # [RK, HKV*D]
  bk_ptr,  # [HKV*D] (read only if HAS_BK)
  pos_ptr,  # [B] i32
  inv_ptr,  # [D/2] f32
  m_ptr,
  l_ptr,  # [B, HKV, S, GP] f32 running max / sum per split
  z_ptr,  # [B, HKV, S, GP, RVP] f32 softmax-weighted zv per split
  T: tl.constexpr,
  HQ: tl.constexpr,
  HKV: tl.constexpr,
  D: tl.constexpr,
  RK: tl.constexpr,
  RV: tl.constexpr,
  G: tl.constexpr,
  GP: tl.constexpr,
  RVP: tl.constexpr,
  S: tl.constexpr,
  CHUNK: tl.constexpr,
  WINDOW: tl.constexpr,
  HAS_BK: tl.constexpr,
  SCALE: tl.constexpr,
  BLOCK_N: tl.constexpr,
  BLOCK_K: tl.constexpr,
  EVEN_RK: tl.constexpr,
):
  b = tl.program_id(0)
  h = tl.program_id(1)
  s = tl.program_id(2)
  HALF: tl.constexpr = D // 2
  pos = tl.load(pos_ptr + b)
  hi = tl.minimum(tl.minimum(s * CHUNK + CHUNK, T), pos + 1)  # keys [lo, hi) of this split
  lo = s * CHUNK
  if WINDOW > 0:  # first visible key, rounded down to a block start of this split
    first = tl.maximum(pos - WINDOW + 1, 0)
    lo = tl.maximum(lo, lo + ((first - lo) // BLOCK_N) * BLOCK_N)
  offs_g = tl.arange(0, GP)
  g_mask = offs_g < G
  offs_d = tl.arange(0, HALF)
  q_rows = (b * HQ + h * G + offs_g)[:, None] * D
  q_lo = tl.load(q_ptr + q_rows + offs_d[None, :], mask=g_mask[:, None], other=0.0)
  q_hi = tl.load(q_ptr + q_rows + HALF + offs_d[None, :], mask=g_mask[:, None], other=0.0)
  inv = tl.load(inv_ptr + offs_d)
  offs_r = tl.arange(0, RVP)
  r_mask = offs_r < RV
  m_i = tl.full([GP], -1.0e30, tl.float32)
  l_i = tl.zeros([GP], tl.float32)
  acc = tl.zeros([GP, RVP], tl.float32)
  zk_b = zk_ptr + b * T * RK
  d_all = offs_d < HALF
  # (one flat loop over (key block, r_k step), keeping the rebuild's pipeline running across
  # blocks, measured slower)
  for start in range(lo, hi, BLOCK_N):
    offs_t = start + tl.arange(0, BLOCK_N)
    t_mask = offs_t < hi
    if WINDOW > 0:
      t_mask = t_mask & (pos - offs_t < WINDOW)
    k_lo = tl.zeros([BLOCK_N, HALF], tl.float32)
    k_hi = tl.zeros([BLOCK_N, HALF], tl.float32)
    k_lo, k_hi = mm_acc2(
      k_lo,
      k_hi,
      zk_b,
      zk_b,
      vk_ptr + h * D,
      vk_ptr + h * D + HALF,
      offs_t,
      offs_d,
      t_mask,
      d_all,
      0,
      RK,
      RK,
      RK,
      HKV * D,
      BLOCK_K,
      EVEN_RK,
      False,
      True,
    )
    if HAS_BK:
      k_lo += tl.load(bk_ptr + h * D + offs_d).to(tl.float32)[None, :]
      k_hi += tl.load(bk_ptr + h * D + HALF + offs_d).to(tl.float32)[None, :]
    ang = offs_t.to(tl.float32)[:, None] * inv[None, :]
    cos = tl.cos(ang)
    sin = tl.sin(ang)
    r_lo = (k_lo * cos - k_hi * sin).to(q_lo.dtype)
    r_hi = (k_hi * cos + k_lo * sin).to(q_lo.dtype)
    sc = tl.dot(q_lo, tl.trans(r_lo)) + tl.dot(q_hi, tl.trans(r_hi))
    sc = tl.where(t_mask[None, :], sc * SCALE, -1.0e30)
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.where(t_mask[None, :], tl.exp(sc - m_new[:, None]), 0.0)
    l_i = l_i * alpha + tl.sum(p, 1)
    zv = tl.load(
      zv_ptr + (b * T + offs_t)[:, None] * RV + offs_r[None, :],
      mask=t_mask[:, None] & r_mask[None, :],
      other=0.0,
    )
    acc = acc * alpha[:, None] + tl.dot(p.to(zv.dtype), zv)
    m_i = m_new
  row = ((b * HKV + h) * S + s) * GP + offs_g
  tl.store(m_ptr + row, m_i)
  tl.store(l_ptr + row, l_i)
  tl.store(z_ptr + row[:, None] * RVP + offs_r[None, :], acc)


def launch_plan(
  b: int,
  hq: int,
  hkv: int,
  t: int,
  d: int,
  rk: int,
  rv: int,
  window,
  has_bk: bool,
  bs: BlockSizes,
  sms: int,
) -> dict:
  g = hq // hkv
  splits = min(bs.splits, planner.cdiv(t, bs.block_n)) or planner.plan_kv_splits(
    b, hkv, t, bs.block_n, bs.num_warps, sms
  )
  chunk = planner.part_len(t, splits, bs.block_n)
  splits = planner.cdiv(t, chunk)
  meta = dict(
    T=t,
    HQ=hq,
    HKV=hkv,
    D=d,
    RK=rk,
    RV=rv,
    G=g,
    GP=max(16, planner.next_pow2(g)),
    RVP=max(16, planner.next_pow2(rv)),
    S=splits,
    CHUNK=chunk,
    WINDOW=0 if window is None else int(window),
    HAS_BK=has_bk,
    SCALE=float(d) ** -0.5,
    BLOCK_N=bs.block_n,
    BLOCK_K=bs.block_k,
    EVEN_RK=rk % bs.block_k == 0,
  )
  return dict(grid=(b, hkv, splits), meta=meta)


def kv_attention(
  q,
  zk,
  zv,
  vk,
  vv,
  pos,
  inv_freq,
  bk=None,
  bv=None,
  *,
  window=None,
  block_sizes: BlockSizes | None = None,
):
  """lr_kv_attention on the GPU: q [B, Hq, D] → [B, Hq·D] (see the module docstring)."""
  b, hq, d = q.shape
  t, rk, rv = zk.shape[1], zk.shape[2], zv.shape[2]
  hkv = vk.shape[1] // d
  if zk.dtype != q.dtype or zv.dtype != q.dtype or vk.dtype != q.dtype:
    raise TypeError(f"{q.dtype=} {zk.dtype=} {zv.dtype=} {vk.dtype=} must match")
  if (reason := kv_attention_shape_reason(d, rv, hq // hkv)) is not None:
    raise ValueError(reason)
  bs = block_sizes or BlockSizes.get_default(b, hkv, t, d, rk, rv)
  plan = launch_plan(b, hq, hkv, t, d, rk, rv, window, bk is not None, bs, num_sms())
  meta = plan["meta"]
  s, gp, rvp = meta["S"], meta["GP"], meta["RVP"]
  m, l, z = launch.triton_call(
    q,
    zk,
    zv,
    vk,
    bk if bk is not None else vk,
    jnp.asarray(pos, jnp.int32),
    jnp.asarray(inv_freq, jnp.float32),
    kernel=_kv_attention_kernel,
    out_shape=(
      jax.ShapeDtypeStruct((b, hkv, s, gp), jnp.float32),
      jax.ShapeDtypeStruct((b, hkv, s, gp), jnp.float32),
      jax.ShapeDtypeStruct((b, hkv, s, gp, rvp), jnp.float32),
    ),
    grid=plan["grid"],
    num_warps=bs.num_warps,
    num_stages=bs.num_stages,
    name="lrjax_kv_attention",
    **meta,
  )
  return merge_splits(m, l, z, vv, bv, meta["G"], rv, q.dtype)


def merge_splits(m, l, z, vv, bv, g, rv, dtype):
  """Merges the per-split softmax states (f32) and projects p·zv with v_v once."""
  big = jnp.max(m, axis=2, keepdims=True)
  w = jnp.exp(m - big)  # empty splits: exp(-1e30 - max) = 0
  norm = jnp.sum(w * l, axis=2)[..., :g]  # [B, HKV, G]
  zsum = jnp.sum(w[..., None] * z, axis=2)[:, :, :g, :rv] / norm[..., None]
  return fold_values(zsum, vv, bv, dtype)


kv_attention_reference = lr_kv_attention_reference
