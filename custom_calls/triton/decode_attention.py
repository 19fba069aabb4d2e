"""Decode attention over a dense KV cache on NVIDIA GPUs: ``decode_attention``
(lowering/decode_attention.py) as two Triton launches, flash decoding and the merge of its
splits. The second choice of the CUDA lowering: it serves the cache lengths that jax's Pallas
kernel (decode_attention_pallas.py) declines, any length where that one needs the length to
split into powers of two.

1. One program per (row b, KV head h, split s of the attended keys). It loads the G = Hq/Hkv
   query heads of its KV head (padded to 16 rows for the tensor cores) and walks its split's
   keys in blocks of ``block_n`` with an online softmax, from the first visible key (the
   sliding window's start) to the row's last (pos[b]): keys past a row's position are never
   read, so a short sequence in a long cache costs only its own length. It writes its
   (max, sum, p·V) in f32. A split with no visible key returns at once.
2. The merge of the splits that ran (known from pos[b]), as one of two launches (``merge_for``
   picks by the split count): "walk", one program per (b, h) loading every split's max and
   sum, then weighting each split's p·V rows in turn; "tile", a program per (b, h, block of
   columns) loading every split's rows at once. Either writes the G output rows.

The split count follows the Pallas kernel's rule: the fewest splits, in powers of two, that
give ``TARGET_PROGRAMS`` programs. Two launches against the Pallas kernel's one plus four XLA
fusions that merge its splits; in the Llama-3-8B decode step it is within 2 % of the Pallas
kernel on an H100 and an H200 (docs/kernels.md), so it is not the first choice.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from lrjax.custom_calls.triton import launch, planner, policy
from lrjax.custom_calls.triton._common import pdl_join, prefetch_ahead
from lrjax.custom_calls.triton.lowering import decode_attention_shape_reason

TARGET_PROGRAMS = 256  # about two programs per SM on an H100 or H200 (132 SMs)
MAX_SPLITS = 64
MIN_CHUNK = 16  # keys per split at least (one key block of the tensor cores' 16)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  block_n: int = 64  # keys per inner step, at most (a shorter split: its length, a power of 2)
  num_warps: int = 4
  num_stages: int = 2
  splits: int = 0  # splits of the attended keys; 0: :func:`plan_splits`
  merge: str = ""  # "walk" (the splits one after another) or "tile"; "": merge_for(splits)

  @classmethod
  def get_default(cls) -> BlockSizes:
    """The defaults: the tuning tables hold no tiles of this kernel (it is measured against
    the Pallas kernel only, at these blocks)."""
    return cls()


MERGES = ("walk", "tile")
# the merge launch, when BlockSizes.merge is "": MERGE if set, else by the split count
# (merge_for). "walk" merges a (row, KV head)'s splits one after another; "tile" loads every
# split's rows at once ([splits, G, columns] tiles, a program per block of columns)
MERGE = ""


def merge_for(splits: int) -> str:
  """The merge of ``splits`` splits: "tile" from the tuning table's
  ``decode_attention.tile_merge_min_splits`` (the tile merge measured faster at 32 splits,
  the walk at 2 and 4; docs/kernels.md), else "walk"."""
  if MERGE:
    return MERGE
  return "tile" if splits >= policy.values("decode_attention").tile_merge_min_splits else "walk"


def plan_splits(b: int, hkv: int, length: int) -> int:
  """The fewest splits, a power of two up to ``MAX_SPLITS``, giving ``TARGET_PROGRAMS``
  programs and at most the tuning table's ``decode_attention.max_split_keys`` keys a split
  (0: no bound), with at least ``MIN_CHUNK`` keys each."""
  max_keys = policy.values("decode_attention").max_split_keys
  s = 1
  while (
    (b * hkv * s < TARGET_PROGRAMS or (max_keys and length > s * max_keys))
    and 2 * s <= MAX_SPLITS
    and 2 * s * MIN_CHUNK <= length
  ):
    s *= 2
  return s


@triton.jit
def _decode_attention_kernel(
  q_ptr,  # [B, HQ, D]
  k_ptr,
  v_ptr,  # [B, HKV, T, D]
  pos_ptr,  # [B] i32
  part_ptr,  # f32: each split's p·V rows [NROWS, D], then their maxima and sums [NROWS] each
  T: tl.constexpr,
  LEN: tl.constexpr,  # attended keys: those at or past LEN are never visible
  HQ: tl.constexpr,
  HKV: tl.constexpr,
  D: tl.constexpr,
  G: tl.constexpr,
  GP: tl.constexpr,
  S: tl.constexpr,
  SP: tl.constexpr,
  CHUNK: tl.constexpr,
  WINDOW: tl.constexpr,
  SCALE: tl.constexpr,
  BLOCK_N: tl.constexpr,
  NROWS: tl.constexpr,  # B * HKV * S * G
  GM: tl.constexpr,
  BLOCK_D: tl.constexpr,  # (the tile merge's)
  PDL: tl.constexpr = 0,  # launched as a programmatic dependent (launch.py, _common.pdl_join)
):
  pid = tl.program_id(0)
  bh = pid // S
  s = pid % S
  b = bh // HKV
  h = bh % HKV
  kv_off = (b * HKV + h).to(tl.int64) * T * D
  pdl_start_split(k_ptr + kv_off, v_ptr + kv_off, pos_ptr, b, s, LEN, WINDOW, CHUNK, D, PDL)
  lo, hi = _split_range(pos_ptr, b, s, LEN, WINDOW, CHUNK)
  if lo < hi:
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    q = tl.load(
      q_ptr + (b * HQ + h * G + offs_g)[:, None] * D + offs_d[None, :],
      mask=(offs_g < G)[:, None],
      other=0.0,
    )
    acc, m_i, l_i = _attend_split(
      q, k_ptr + kv_off, v_ptr + kv_off, lo, hi, q, q, -1, D, GP, SCALE, BLOCK_N, False
    )
    _store_partials(part_ptr, acc, m_i, l_i, bh, s, S, G, GP, D, NROWS)


@triton.jit
def _visible(pos_ptr, b, LEN: tl.constexpr, WINDOW: tl.constexpr):
  """[first, end): the keys visible to row b (causal, inside the window, before LEN)."""
  pos = tl.load(pos_ptr + b)
  first = 0
  if WINDOW > 0:
    first = tl.maximum(pos - WINDOW + 1, 0)
  return first, tl.minimum(pos + 1, LEN)


@triton.jit
def _split_range(pos_ptr, b, s, LEN: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr):
  """[lo, hi): the keys of split s visible to row b (empty where lo >= hi)."""
  first, end = _visible(pos_ptr, b, LEN, WINDOW)
  return tl.maximum(s * CHUNK, first), tl.minimum(s * CHUNK + CHUNK, end)


@triton.jit
def pdl_start_split(
  k_ptr, v_ptr, pos_ptr, b, s, LEN: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr,
  D: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
  """A flash-decoding program's start under PDL (_common.pdl_join): at PDL >= 2 the first
  keys and values of its split into L2 before the wait (the cache's rows before the new
  position were written by earlier steps; ``pos`` read before the wait may be stale, which
  only misdirects the hint), then the wait."""
  if PDL >= 2:
    lo, hi = _split_range(pos_ptr, b, s, LEN, WINDOW, CHUNK)
    if lo < hi:
      prefetch_ahead(k_ptr, lo, 0, hi, D, D, True)
      prefetch_ahead(v_ptr, lo, 0, hi, D, D, True)
  pdl_join(PDL)


@triton.jit
def _attend_split(
  q,  # [GP, D] the KV head's query rows
  k_ptr,
  v_ptr,  # the (row, KV head)'s cache rows [T, D]
  lo,
  hi,
  k_new,
  v_new,  # [D] rows standing in for cache row ``w`` (read only if SPLICE)
  w,
  D: tl.constexpr,
  GP: tl.constexpr,
  SCALE: tl.constexpr,
  BLOCK_N: tl.constexpr,
  SPLICE: tl.constexpr,
):
  """Online softmax of q over keys [lo, hi) in blocks of BLOCK_N: (p·V [GP, D], max, sum) in
  f32. With SPLICE, key and value ``w`` are taken from k_new / v_new, not from the cache."""
  offs_d = tl.arange(0, D)
  m_i = tl.full([GP], -1.0e30, tl.float32)
  l_i = tl.zeros([GP], tl.float32)
  acc = tl.zeros([GP, D], tl.float32)
  for start in range(lo, hi, BLOCK_N):
    offs_t = start + tl.arange(0, BLOCK_N)
    t_mask = offs_t < hi
    rows = offs_t[:, None] * D + offs_d[None, :]
    k = tl.load(k_ptr + rows, mask=t_mask[:, None], other=0.0)
    if SPLICE:
      k = tl.where((offs_t == w)[:, None], k_new[None, :], k)
    sc = tl.dot(q, tl.trans(k)) * SCALE
    sc = tl.where(t_mask[None, :], sc, -1.0e30)
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + rows, mask=t_mask[:, None], other=0.0)
    if SPLICE:
      v = tl.where((offs_t == w)[:, None], v_new[None, :], v)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    m_i = m_new
  return acc, m_i, l_i


@triton.jit
def _store_partials(
  part_ptr,
  acc,
  m_i,
  l_i,
  bh,
  s,
  S: tl.constexpr,
  G: tl.constexpr,
  GP: tl.constexpr,
  D: tl.constexpr,
  NROWS: tl.constexpr,
):
  """Split s's G rows of the partials: p·V [G, D], then the maxima and sums."""
  offs_g = tl.arange(0, GP)
  offs_d = tl.arange(0, D)
  g_mask = offs_g < G
  row = (bh * S + s) * G + offs_g
  tl.store(part_ptr + row[:, None] * D + offs_d[None, :], acc, mask=g_mask[:, None])
  tl.store(part_ptr + NROWS * D + row, m_i, mask=g_mask)
  tl.store(part_ptr + NROWS * D + NROWS + row, l_i, mask=g_mask)


@triton.jit
def _splits_that_ran(pos_ptr, b, LEN: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr):
  """[s_lo, s_hi): the splits of row b holding a visible key, the ones the first launch ran."""
  first, end = _visible(pos_ptr, b, LEN, WINDOW)
  return first // CHUNK, (end + CHUNK - 1) // CHUNK


@triton.jit
def _merge_kernel(
  part_ptr,  # as written by _decode_attention_kernel
  pos_ptr,
  o_ptr,  # [B, HQ * D]
  T: tl.constexpr,
  LEN: tl.constexpr,
  HQ: tl.constexpr,
  HKV: tl.constexpr,
  D: tl.constexpr,
  G: tl.constexpr,
  GP: tl.constexpr,
  S: tl.constexpr,
  SP: tl.constexpr,  # S rounded up to a power of two
  CHUNK: tl.constexpr,
  WINDOW: tl.constexpr,
  SCALE: tl.constexpr,
  BLOCK_N: tl.constexpr,
  NROWS: tl.constexpr,
  GM: tl.constexpr,
  BLOCK_D: tl.constexpr,
  PDL: tl.constexpr = 0,  # as in _decode_attention_kernel
):
  pdl_join(PDL)
  bh = tl.program_id(0)
  b = bh // HKV
  h = bh % HKV
  s_lo, s_hi = _splits_that_ran(pos_ptr, b, LEN, WINDOW, CHUNK)
  offs_s = tl.arange(0, SP)
  offs_g = tl.arange(0, GP)
  offs_d = tl.arange(0, D)
  g_mask = offs_g < G
  ran = (offs_s >= s_lo) & (offs_s < s_hi)
  rows = (bh * S + offs_s)[:, None] * G + offs_g[None, :]  # [SP, GP]
  both = ran[:, None] & g_mask[None, :]
  m = tl.load(part_ptr + NROWS * D + rows, mask=both, other=-1.0e30)
  l = tl.load(part_ptr + NROWS * D + NROWS + rows, mask=both, other=0.0)
  mx = tl.max(m, 0)
  w = tl.where(both, tl.exp(m - mx[None, :]), 0.0)  # [SP, GP]
  den = tl.sum(w * l, 0)
  out = tl.zeros([GP, D], tl.float32)
  for j in tl.static_range(S):
    valid = (j >= s_lo) & (j < s_hi)
    r = (bh * S + j) * G + offs_g
    mj = tl.load(part_ptr + NROWS * D + r, mask=g_mask & valid, other=-1.0e30)
    aj = tl.load(
      part_ptr + r[:, None] * D + offs_d[None, :], mask=(g_mask & valid)[:, None], other=0.0
    )
    out += aj * tl.exp(mj - mx)[:, None]
  out = out / tl.where(g_mask, den, 1.0)[:, None]
  tl.store(
    o_ptr + (b * HQ + h * G + offs_g)[:, None] * D + offs_d[None, :],
    out.to(o_ptr.dtype.element_ty),
    mask=g_mask[:, None],
  )


@triton.jit
def _merge_tile_kernel(
  part_ptr,  # as written by _decode_attention_kernel
  pos_ptr,
  o_ptr,  # [B, HQ * D]
  T: tl.constexpr,
  LEN: tl.constexpr,
  HQ: tl.constexpr,
  HKV: tl.constexpr,
  D: tl.constexpr,
  G: tl.constexpr,
  GP: tl.constexpr,
  S: tl.constexpr,
  SP: tl.constexpr,  # S rounded up to a power of two
  CHUNK: tl.constexpr,
  WINDOW: tl.constexpr,
  SCALE: tl.constexpr,
  BLOCK_N: tl.constexpr,
  NROWS: tl.constexpr,
  GM: tl.constexpr,  # G rounded up to a power of two
  BLOCK_D: tl.constexpr,  # output columns a program
  PDL: tl.constexpr = 0,  # as in _decode_attention_kernel
):
  pdl_join(PDL)
  bh = tl.program_id(0)
  b = bh // HKV
  h = bh % HKV
  s_lo, s_hi = _splits_that_ran(pos_ptr, b, LEN, WINDOW, CHUNK)
  offs_s = tl.arange(0, SP)
  offs_g = tl.arange(0, GM)
  offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
  ran = (offs_s >= s_lo) & (offs_s < s_hi)
  both = ran[:, None] & (offs_g < G)[None, :]  # [SP, GM]
  rows = (bh * S + offs_s)[:, None] * G + offs_g[None, :]
  m = tl.load(part_ptr + NROWS * D + rows, mask=both, other=-1.0e30)
  l = tl.load(part_ptr + NROWS * D + NROWS + rows, mask=both, other=0.0)
  mx = tl.max(m, 0)
  w = tl.where(both, tl.exp(m - mx[None, :]), 0.0)  # every split's weight, [SP, GM]
  den = tl.sum(w * l, 0)
  # every split's p·V rows at once: [SP, GM, BLOCK_D]
  acc = tl.load(
    part_ptr + rows[:, :, None] * D + offs_d[None, None, :], mask=both[:, :, None], other=0.0
  )
  out = tl.sum(acc * w[:, :, None], 0) / tl.where(offs_g < G, den, 1.0)[:, None]
  tl.store(
    o_ptr + (b * HQ + h * G + offs_g)[:, None] * D + offs_d[None, :],
    out.to(o_ptr.dtype.element_ty),
    mask=(offs_g < G)[:, None],
  )


def launch_plan(
  b: int, hq: int, hkv: int, t: int, d: int, length: int, window, bs: BlockSizes
) -> dict:
  """Grids and constexprs of one call (shared by the wrapper and the tests)."""
  splits = bs.splits or plan_splits(b, hkv, length)
  chunk = planner.cdiv(length, min(splits, length))
  block_n = min(bs.block_n, max(16, planner.next_pow2(chunk)))
  chunk = planner.round_up(chunk, block_n)
  splits = planner.cdiv(length, chunk)
  g = hq // hkv
  meta = dict(
    T=t,
    LEN=length,
    HQ=hq,
    HKV=hkv,
    D=d,
    G=g,
    GP=max(16, planner.next_pow2(g)),
    S=splits,
    SP=max(2, planner.next_pow2(splits)),
    CHUNK=chunk,
    WINDOW=0 if window is None else int(window),
    SCALE=float(d) ** -0.5,
    BLOCK_N=block_n,
    NROWS=b * hkv * splits * g,
    GM=planner.next_pow2(g),
    BLOCK_D=min(d, max(16, 4096 // (max(2, planner.next_pow2(splits)) * planner.next_pow2(g)))),
  )
  merge = bs.merge or merge_for(splits)
  if merge not in MERGES:
    raise ValueError(f"merge={merge!r}: expected one of {MERGES}")
  tile = merge == "tile"
  return dict(grid=(b * hkv * splits,), merge=merge,
              merge_grid=(b * hkv, d // meta["BLOCK_D"]) if tile else (b * hkv,), meta=meta,
              part=b * hkv * splits * g * (d + 2))  # fmt: skip


def decode_attention(q, k, v, pos, *, window=None, length=None, block_sizes=None):
  """q [B, Hq, D], k/v [B, Hkv, T, D], pos [B] → [B, Hq·D] (the primitive's semantics), as
  two Triton launches (module docstring)."""
  b, hq, d = q.shape
  _, hkv, t, _ = k.shape
  length = t if length is None else length
  reason = decode_attention_shape_reason(q.shape, (q.dtype.name, k.dtype.name, v.dtype.name))
  if reason is not None:
    raise ValueError(reason)
  bs = block_sizes or BlockSizes.get_default()
  plan = launch_plan(b, hq, hkv, t, d, length, window, bs)
  pos = jnp.asarray(pos, jnp.int32)
  part = launch.triton_call(
    q,
    k,
    v,
    pos,
    kernel=_decode_attention_kernel,
    out_shape=jax.ShapeDtypeStruct((plan["part"],), jnp.float32),
    grid=plan["grid"],
    num_warps=bs.num_warps,
    num_stages=bs.num_stages,
    name="lrjax_decode_attention",
    **plan["meta"],
  )
  return launch.triton_call(
    part,
    pos,
    kernel=_merge_tile_kernel if plan["merge"] == "tile" else _merge_kernel,
    out_shape=jax.ShapeDtypeStruct((b, hq * d), q.dtype),
    grid=plan["merge_grid"],
    num_warps=4,
    num_stages=1,
    name="lrjax_decode_attention_merge",
    **plan["meta"],
  )


def decode_attention_reference(q, k, v, pos, *, window=None, length=None):
  """The primitive's XLA reference (lowering/decode_attention.py): the models' attention."""
  from lrjax.lowering.decode_attention import decode_attention_reference as ref

  return ref(q, k, v, pos, window=window, length=length)
