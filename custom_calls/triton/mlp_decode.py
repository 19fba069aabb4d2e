"""Fused low-rank (Swi)GLU MLP for few tokens, in one launch of dependent stages.

  stage A  Pg = X·Ug, Pu = X·Uu          one pass over X (both factors per K tile),
                                         inter-CTA split-K, f32 atomics into [M, r]
  stage B  per B_F slice of the intermediate dim (one CTA each), consuming Pg, Pu
           r-chunk by r-chunk as stage A completes them (so Vg, Vu stream while Ug, Uu do):
           h = act(Pg·Vg[:, f] + bg) ⊙ (Pu·Vu[:, f] + bu)      [M, B_F], registers only
           S += h · Ud[f, :]                                   f32 atomics into [M, r_d]
  stage C  Y = S·Vd + bd        split over r_d chunks, f32 atomics; the last chunk to arrive
                                for a column block writes the output (as in xuv_decode)

The [M, D_ff] intermediate exists only as one [M, B_F] tile per CTA; only the rank-space
vectors Pg, Pu, S (a few KB to a few hundred KB) go through L2, and every byte of the six
factors is read once, so the floor is their size over the HBM bandwidth. Stages are ordered
inside the grid by counters: stage-A CTAs ``signal`` the counter of their r-chunk and stage-B
CTAs wait on each chunk before using it; stage-B CTAs ``signal`` one counter that stage-C
CTAs wait on. Lower block indices are dispatched first, which is the forward-progress
argument (as in xuv_decode). All accumulators and counters live in one scratch buffer,
zeroed by an XLA op aliased into the call, or by the call before it on a scratch chain
(launch.py), or, with ``out=``, by jax-triton's memset. Non-gated MLPs (act(X·U1·V1 + b1)·
U2·V2 + b2) run the same kernel with GATED=False.

With ``BlockSizes.park_h`` (the default from 2 tokens) stage B's partials of S, one
[M, r_d] f32 add per slice, give way to a fourth stage: stage B stores h once in the
factors' dtype into an [M, D_ff] buffer (written, then read back from L2), and stage H
projects it, S += h[:, split]·Ud[split, cols] over D_ff splits that each wait only for their
own slices, one partial of S per split. With ``p16`` the last stage-A tile of each rank
column block rounds Pg/Pu once to the factors' dtype and stage B reads that copy (half the L2
bytes); where stage A runs in one wave the rounding tail delays stage B more than the f32
reads cost, so it is off there.

From the tuning table's ``compose_min_m`` rows the MLP is X·U·V decode calls instead: X·Ug
and X·Uu in one grouped launch of phase 1 alone (xuv_decode_group.py, XLA's GEMMs apply the V
factors), one XLA fusion for the activation, then ``xuv_decode`` for the down projection.
There the f32 partials of stage B's split-K reductions outweigh the [M, D_ff] round trip.

A persistent schedule of the same stages (``_mlp_decode_persistent_kernel``, one CTA per SM,
tiles from ``planner.plan_mlp_decode_persistent``) measured within ±5 % of the tiled one and
is not the default; ``_mlp_decode(persistent=...)`` runs it.
"""

from __future__ import annotations

import dataclasses
import math
import types

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from lrjax.custom_calls.triton import launch, planner, policy
from lrjax.custom_calls.triton._common import (
  ACT_CODES,
  check_out,
  join_chain,
  last_arrival,
  leave_chain,
  mm_acc,
  mm_acc2,
  norm_operands,
  normed_reference,
  num_sms,
  prefetch_ahead,
  prefetch_splitk_tile,
  prefetch_l2,
  residual_operand,
  residual_reference,
  round_once,
  row_scale,
  signal,
  splitr_finish,
  splitr_out_tile,
  stamp,
  swiglu_epilogue,
  unpack_mlp_args,
  wait_at_least,
)
from lrjax.custom_calls.triton.lowering import MLP_DECODE_MAX_M

# how stage B flushes its partial of S: atomics; timing probes (wrong output): plain stores
# or none (stores masked off by a data test that never holds: same instructions, no bytes)
S_FLUSH_CODES = {"atomic": 0, "store": 1, "none": 2}
MAX_M = MLP_DECODE_MAX_M  # beyond this the prefill kernel serves
C_RESIDENT_MAX = 128 * 128  # V_d elements a stage-C CTA may hold with c_resident (64
# registers a thread at 4 warps)
PERSISTENT_MAX_M = 64  # the persistent schedule serves up to here (f32 tiles in registers)


def _t() -> types.SimpleNamespace:
  """This device's ``mlp_decode`` thresholds (policy.py)."""
  return policy.values("mlp_decode")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  block_m: int  # token rows, padded (>= 16)
  block_k: int  # stage-A reduction step over D
  block_r: int  # stage-A rank columns per CTA
  split_k: int  # stage-A inter-CTA split of D
  block_f: int  # stage-B slice of the intermediate dim per CTA
  block_rd: int  # stage-B chunk of the down rank per atomic flush
  block_n: int  # stage-C output columns per CTA
  block_kr: int = 64  # reduction step over a rank (stages B and C)
  c_chunks: int = 4  # stage-C split of r_d
  a_chunks: int = 4  # r-chunks of Pg/Pu that stage B consumes as they complete
  num_warps: int = 4
  num_stages: int = 3
  p16: bool = False  # stage B reads Pg, Pu rounded once to the factors' dtype
  park_h: bool = False  # stage B parks h in a global buffer; stage H projects it
  block_h: int = 128  # stage-H columns of the down rank per CTA
  h_splits: int = 0  # stage-H split of D_ff (0: about h_per_sm stage-H tiles per SM)
  h_per_sm: int = 1  # with h_splits=0: stage-H splits of about this many tiles an SM

  @classmethod
  def get_default(cls, m: int, d: int, f: int, r: int, d_out: int) -> BlockSizes:
    """The tuning table's blocks for M tokens of a D -> D_ff (rank r) -> D_out MLP."""
    return _default_blocks(m, d, f, r, d_out)


@dataclasses.dataclass(frozen=True)
class Variant:
  """Options of the tiled schedule that measured slower than its defaults, kept for tests and
  benchmarks (``_mlp_decode(variant=...)``)."""

  cols_f: int = 0  # D_ff columns a stage-B slice owns (<= block_f, the rest masked; 0: all)
  h_inline: bool = False  # park_h: stage-B CTAs run their split's stage-H tiles themselves,
  # splits of ceil(r_d / block_h) slices (one tile each) unless h_splits is set
  # L2 prefetch before a CTA's first wait (rows, 0 or a power of two): stage B's first rows of
  # its Vg, Vu slices, stage H's of its U_d tile, stage C's of its V_d tile
  prefetch: int = 0
  prefetch_h: int = 0
  prefetch_c: int = 0
  c_resident: bool = False  # stage C loads its whole V_d chunk into registers before its wait


def _default_blocks(m: int, d: int, f: int, r: int, d_out: int, park_small: bool = True):
  """``BlockSizes.get_default``; ``park_small=False``: at T <= 16 the unparked blocks (for
  tests and benchmarks that time stage B's own projection into S)."""
  T = _t()
  bm = max(16, planner.next_pow2(m))
  key = f"{'m<=16' if m <= 16 else 'm<=64'},{'r>=2048' if r >= 2048 else 'r<2048'}"
  tiles = policy.tiles("mlp_decode").get(key)
  if tiles is not None:
    t = BlockSizes(**tiles)
  else:
    p = planner.plan_decode(m, d, r, f)
    t = BlockSizes(p.block_m, p.block_k, p.block_r, p.split_k, 64, 128, 128)
  sms = planner.H200.num_sms
  max_split = max(1, d // (8 * t.block_k))  # >= 8 pipelined K steps per CTA
  n_rb = planner.cdiv(r, t.block_r)
  split = max(1, min(max_split, planner.cdiv(2 * sms, n_rb)))
  if bm <= 16 and n_rb * split < sms:  # stage A in one wave that leaves SMs idle: split D
    # finer, down to fill_k_steps K steps a CTA
    split = max(split, min(sms // n_rb, d // (T.fill_k_steps * t.block_k)))
  a_chunks, one_wave = t.a_chunks, False
  if bm <= 16:  # stage A in one wave completes every chunk of Pg/Pu at about the same time:
    # one chunk (no refill per chunk); in two waves, two chunks let stage B start early
    one_wave = n_rb * stage_a_splits(d, split, t.block_k)[1] <= sms
    a_chunks = 1 if one_wave else 2
  warps = t.num_warps if bm <= 32 else 8  # [bm, block_f] x2 f32 accumulators per CTA
  block_f, stages = t.block_f, t.num_stages
  block_rd = t.block_rd
  slices = planner.cdiv(f, 128)  # of 128 columns: the stage-B / stage-H rules below
  if bm <= 16 and slices >= int(T.wide_slice_frac * sms):  # fewer, longer stage-B slices
    block_f, stages = 128, 3
    if sms < slices <= T.shared_sm_slices * sms:  # two CTAs an SM: every slice resident
      block_rd, stages = 128, 4
  block_k, park = t.block_k, bm > 16
  if park_small and bm <= 16 and (m > 1 or block_f == 128):  # h parked, one CTA an SM
    park, stages = True, T.park_small_stages
  elif park:  # from 17 tokens: 64-row K steps, 4 stages where they fit (3 at 128 rows)
    block_f, block_k, stages = 128, 64, 4 if bm <= 64 else 3
  h_per_sm = 1
  if park and slices > sms and m <= 64:  # shorter stage-H tiles, each ready sooner
    h_per_sm = T.h_per_sm_wide
  block_h = t.block_h
  if 16 < bm <= 64 and slices >= int(T.wide_rule_slices * sms):  # two chunks of Pg/Pu,
    # 256-column stage-H tiles; 5 stages at 32 rows, one stage-H tile an SM at 64
    a_chunks, block_h = 2, 256
    if bm <= 32:
      stages = 5
    else:
      h_per_sm = 1
  p16 = not one_wave  # f32 Pg/Pu after a one-wave stage A (its rounding tail costs more)
  return dataclasses.replace(
    t,
    block_m=bm,
    block_k=block_k,
    split_k=split,
    a_chunks=a_chunks,
    num_warps=warps,
    block_f=block_f,
    block_rd=block_rd,
    num_stages=stages,
    p16=p16,
    park_h=park,
    h_per_sm=h_per_sm,
    block_h=block_h,
  )


@triton.jit
def _up_tile(
  rb,
  k0,  # column block of the rank, first row of D
  x_ptr,
  ug_ptr,
  uu_ptr,
  pg_ptr,
  pu_ptr,
  cnt_ptr,
  offs_m,
  m_mask,
  D: tl.constexpr,
  R: tl.constexpr,
  GATED: tl.constexpr,
  K_PER: tl.constexpr,
  RB_PER_CHUNK: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_K: tl.constexpr,
  BLOCK_R: tl.constexpr,
  COLS_R: tl.constexpr,
  EVEN_D: tl.constexpr,
  STREAM: tl.constexpr,
  P16: tl.constexpr,
  pg16_ptr,
  pu16_ptr,
  rb_cnt_ptr,
  SPLIT_K: tl.constexpr,
  NORM: tl.constexpr = False,
  g_ptr=None,  # with NORM: X·g streamed (_common.mm_acc); r-block 0's tiles add X's squares
  sq_ptr=None,  # to sq_ptr [M]
):
  """One split-K tile of Pg = X·Ug and Pu = X·Uu (X loaded once per K step): f32 atomics
  into Pg/Pu, then this rank chunk's counter. P16: the column block's last tile
  (``last_arrival``) rounds it once into pg16/pu16 (the factors' dtype) and alone signals.
  STREAM=False only signals (phase timing)."""
  offs_r = rb * COLS_R + tl.arange(0, BLOCK_R)
  r_mask = offs_r < R
  if COLS_R < BLOCK_R:
    r_mask = r_mask & (tl.arange(0, BLOCK_R) < COLS_R)
  out_off = offs_m[:, None] * R + offs_r[None, :]
  out_mask = m_mask[:, None] & r_mask[None, :]
  if STREAM:
    acc_u = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    if GATED:
      acc_g = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
      acc_g, acc_u = mm_acc2(
        acc_g,
        acc_u,
        x_ptr,
        x_ptr,
        ug_ptr,
        uu_ptr,
        offs_m,
        offs_r,
        m_mask,
        r_mask,
        k0,
        k0 + K_PER,
        D,
        D,
        R,
        BLOCK_K,
        EVEN_D,
        False,
        True,
        NORM,
        g_ptr,
        sq_ptr,
        rb == 0,
      )
      tl.atomic_add(pg_ptr + out_off, acc_g, mask=out_mask, sem="relaxed")
    else:
      acc_u = mm_acc(
        acc_u,
        x_ptr,
        uu_ptr,
        offs_m,
        offs_r,
        m_mask,
        r_mask,
        k0,
        k0 + K_PER,
        D,
        D,
        R,
        BLOCK_K,
        EVEN_D,
        False,
        NORM,
        g_ptr,
        sq_ptr,
        rb == 0,
      )
    tl.atomic_add(pu_ptr + out_off, acc_u, mask=out_mask, sem="relaxed")
  if P16:
    if last_arrival(rb_cnt_ptr + rb, SPLIT_K):
      if GATED:
        round_once(pg_ptr, pg16_ptr, out_off, out_mask)
      round_once(pu_ptr, pu16_ptr, out_off, out_mask)
      signal(cnt_ptr + rb // RB_PER_CHUNK)
  else:
    signal(cnt_ptr + rb // RB_PER_CHUNK)


@triton.jit
def _project_rank(
  h,  # [BLOCK_M, BLOCK_F] slice of the intermediate, the only copy of it
  ud_ptr,
  s_ptr,
  offs_m,
  m_mask,
  offs_f,
  f_mask,
  RD: tl.constexpr,
  BLOCK_RD: tl.constexpr,
  S_FLUSH: tl.constexpr,
):
  """S += h · Ud[f, :]: f32 atomics into the down factor's rank space, BLOCK_RD at a time
  (S_FLUSH 0. Timing only, a wrong S: 1 plain stores; 2 stores masked off by a test on
  the data that never holds, so the dot and the instructions stay but no byte moves)."""
  for c0 in range(0, RD, BLOCK_RD):
    offs_c = c0 + tl.arange(0, BLOCK_RD)
    c_mask = offs_c < RD
    udt = tl.load(
      ud_ptr + offs_f[:, None] * RD + offs_c[None, :],
      mask=f_mask[:, None] & c_mask[None, :],
      other=0.0,
    )
    part = tl.dot(h, udt)
    if S_FLUSH == 0:
      tl.atomic_add(
        s_ptr + offs_m[:, None] * RD + offs_c[None, :],
        part,
        mask=m_mask[:, None] & c_mask[None, :],
        sem="relaxed",
      )
    elif S_FLUSH == 1:
      tl.store(
        s_ptr + offs_m[:, None] * RD + offs_c[None, :], part, mask=m_mask[:, None] & c_mask[None, :]
      )
    else:
      tl.store(
        s_ptr + offs_m[:, None] * RD + offs_c[None, :],
        part,
        mask=m_mask[:, None] & c_mask[None, :] & (part > 3.0e38),
      )


@triton.jit
def _down_slice(
  fb,  # slice of the intermediate dim
  pg_ptr,
  pu_ptr,
  vg_ptr,
  bg_ptr,
  vu_ptr,
  bu_ptr,
  ud_ptr,
  s_ptr,
  cnt_ptr,
  offs_m,
  m_mask,
  n_r,
  R: tl.constexpr,
  F: tl.constexpr,
  RD: tl.constexpr,
  GATED: tl.constexpr,
  ACT: tl.constexpr,
  HAS_BG: tl.constexpr,
  HAS_BU: tl.constexpr,
  SPLIT_K: tl.constexpr,
  A_CHUNKS: tl.constexpr,
  RB_PER_CHUNK: tl.constexpr,
  R_PER: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_F: tl.constexpr,
  COLS_F: tl.constexpr,
  BLOCK_RD: tl.constexpr,
  BLOCK_KR: tl.constexpr,
  EVEN_R: tl.constexpr,
  STREAM: tl.constexpr,
  P16: tl.constexpr,
  S_FLUSH: tl.constexpr,
  PARK_H: tl.constexpr,
  h_ptr,
  h_cnt_ptr,
  SLICES_PER_SPLIT: tl.constexpr,
  trace_ptr,
  TRACE: tl.constexpr,
  NORM: tl.constexpr = False,  # Pg/Pu are (X·g)·U: rows scaled by row_scale(sq_ptr) first
  sq_ptr=None,
  D: tl.constexpr = 1,
  EPS: tl.constexpr = 0.0,
):
  """One COLS_F-wide slice h of the intermediate, consuming Pg/Pu chunk by chunk as they
  complete, projected straight into S (the down factor's rank space); then the counter.
  P16: pg_ptr/pu_ptr are the rounded copies (one signal per column block, not per tile).
  PARK_H: h is stored to h_ptr [M, F] instead, and its stage-H split's counter signalled.
  STREAM=False only waits and signals (phase timing). TRACE: ``stamp`` slots 1 and 2 when
  the first and the last chunk's waits end."""
  offs_f = fb * COLS_F + tl.arange(0, BLOCK_F)
  f_mask = offs_f < F
  if COLS_F < BLOCK_F:
    f_mask = f_mask & (tl.arange(0, BLOCK_F) < COLS_F)
  acc_u = tl.zeros([BLOCK_M, BLOCK_F], tl.float32)
  acc_g = tl.zeros([BLOCK_M, BLOCK_F], tl.float32)
  for c in range(A_CHUNKS):
    if P16:
      wait_at_least(cnt_ptr + c, tl.minimum(n_r - c * RB_PER_CHUNK, RB_PER_CHUNK))
    else:
      wait_at_least(cnt_ptr + c, tl.minimum(n_r - c * RB_PER_CHUNK, RB_PER_CHUNK) * SPLIT_K)
    if c == 0:
      stamp(trace_ptr, 1, TRACE)
    if c == A_CHUNKS - 1:
      stamp(trace_ptr, 2, TRACE)
    if STREAM:
      if GATED:
        acc_g, acc_u = mm_acc2(
          acc_g,
          acc_u,
          pg_ptr,
          pu_ptr,
          vg_ptr,
          vu_ptr,
          offs_m,
          offs_f,
          m_mask,
          f_mask,
          c * R_PER,
          c * R_PER + R_PER,
          R,
          R,
          F,
          BLOCK_KR,
          EVEN_R,
          True,
          False,
        )
      else:
        acc_u = mm_acc(
          acc_u,
          pu_ptr,
          vu_ptr,
          offs_m,
          offs_f,
          m_mask,
          f_mask,
          c * R_PER,
          c * R_PER + R_PER,
          R,
          R,
          F,
          BLOCK_KR,
          EVEN_R,
          True,
        )
  if STREAM:
    if NORM:  # every chunk is in, r-block 0's tiles (and their squares) among them
      rs = row_scale(sq_ptr, offs_m, m_mask, D, EPS)[:, None]
      acc_g, acc_u = acc_g * rs, acc_u * rs
    h = swiglu_epilogue(
      acc_g, acc_u, bg_ptr, bu_ptr, offs_f, f_mask, GATED, ACT, HAS_BG, HAS_BU
    ).to(ud_ptr.dtype.element_ty)
    if PARK_H:
      tl.store(
        h_ptr + offs_m[:, None] * F + offs_f[None, :], h, mask=m_mask[:, None] & f_mask[None, :]
      )
    else:
      _project_rank(h, ud_ptr, s_ptr, offs_m, m_mask, offs_f, f_mask, RD, BLOCK_RD, S_FLUSH)
  if PARK_H:
    signal(h_cnt_ptr + fb // SLICES_PER_SPLIT)
  else:
    signal(cnt_ptr + A_CHUNKS)


@triton.jit
def _prefetch_first(
  pid,
  ug_ptr,
  uu_ptr,
  vg_ptr,
  vu_ptr,
  D: tl.constexpr,
  R: tl.constexpr,
  F: tl.constexpr,
  GATED: tl.constexpr,
  K_PER: tl.constexpr,
  SPLIT_K: tl.constexpr,
  COLS_R: tl.constexpr,
  COLS_F: tl.constexpr,  # 0: no stage-B CTAs of their own (the persistent schedule)
):
  """The L2 prefetch before the PDL wait (_common.prefetch_ahead): the first rows of the CTA's
  first stage-A tile of Uu (and Ug), or of its stage-B slice of Vu (and Vg)."""
  n_a = ((R + COLS_R - 1) // COLS_R) * SPLIT_K
  if pid < n_a:
    prefetch_splitk_tile(uu_ptr, pid, D, R, K_PER, SPLIT_K, COLS_R, True)
    prefetch_splitk_tile(ug_ptr, pid, D, R, K_PER, SPLIT_K, COLS_R, GATED)
  elif COLS_F > 0:
    if pid < n_a + (F + COLS_F - 1) // COLS_F:
      f0 = (pid - n_a) * COLS_F
      prefetch_ahead(vu_ptr, 0, f0, R, tl.minimum(f0 + COLS_F, F), F, True)
      prefetch_ahead(vg_ptr, 0, f0, R, tl.minimum(f0 + COLS_F, F), F, GATED)


@triton.jit
def _prefetch_slice(
  vg_ptr,
  vu_ptr,
  col0,
  R,
  F: tl.constexpr,
  GATED: tl.constexpr,
  ROWS: tl.constexpr,
  BLOCK_F: tl.constexpr,
):
  """The first ROWS rows of one stage-B slice of Vu (and Vg) into L2 (BlockSizes.prefetch)."""
  prefetch_l2(vu_ptr, 0, col0, R, F, F, ROWS, BLOCK_F)
  if GATED:
    prefetch_l2(vg_ptr, 0, col0, R, F, F, ROWS, BLOCK_F)


@triton.jit
def _park_h_tile(
  q,  # stage-H tile: split of D_ff (major), column block of the down rank
  h_ptr,
  ud_ptr,
  s_ptr,
  cnt_ptr,
  h_cnt_ptr,
  offs_m,
  m_mask,
  n_b,
  F: tl.constexpr,
  RD: tl.constexpr,
  A_CHUNKS: tl.constexpr,
  F_PER: tl.constexpr,
  SLICES_PER_SPLIT: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_H: tl.constexpr,
  BLOCK_KR: tl.constexpr,
  EVEN_F: tl.constexpr,
  PREFETCH: tl.constexpr,
  trace_ptr,
  TRACE: tl.constexpr,
):
  """S += h[:, split] · Ud[split, cols] once the stage-B slices of its split have parked h
  (f32 atomics into S, one partial per split), then the counter stage C waits on. PREFETCH:
  the tile's first U_d rows into L2 before the wait; TRACE: ``stamp`` slots 1, 2 when the
  wait ends."""
  n_cb = (RD + BLOCK_H - 1) // BLOCK_H
  j = q // n_cb
  offs_c = (q % n_cb) * BLOCK_H + tl.arange(0, BLOCK_H)
  c_mask = offs_c < RD
  if PREFETCH > 0:
    prefetch_l2(
      ud_ptr,
      j * F_PER,
      (q % n_cb) * BLOCK_H,
      tl.minimum(F, j * F_PER + F_PER),
      RD,
      RD,
      PREFETCH,
      BLOCK_H,
    )
  wait_at_least(h_cnt_ptr + j, tl.minimum(n_b - j * SLICES_PER_SPLIT, SLICES_PER_SPLIT))
  stamp(trace_ptr, 1, TRACE)
  stamp(trace_ptr, 2, TRACE)
  acc = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
  acc = mm_acc(
    acc,
    h_ptr,
    ud_ptr,
    offs_m,
    offs_c,
    m_mask,
    c_mask,
    j * F_PER,
    j * F_PER + F_PER,
    F,
    F,
    RD,
    BLOCK_KR,
    EVEN_F,
    True,
  )
  tl.atomic_add(
    s_ptr + offs_m[:, None] * RD + offs_c[None, :],
    acc,
    mask=m_mask[:, None] & c_mask[None, :],
    sem="relaxed",
  )
  signal(cnt_ptr + A_CHUNKS)


@triton.jit
def _mlp_decode_kernel(
  x_ptr,  # [M, D] activations
  ug_ptr,
  vg_ptr,
  bg_ptr,  # [D, R], [R, F], [F] gate factors (unread if not GATED)
  uu_ptr,
  vu_ptr,
  bu_ptr,  # [D, R], [R, F], [F] up factors
  ud_ptr,
  vd_ptr,
  bd_ptr,  # [F, RD], [RD, DO], [DO] down factors
  o_in_ptr,  # [M, DO] caller's output buffer aliased to o_ptr, or the zeroed scratch
  # aliased to scratch_ptr (xla_zeroing), else x; never read
  g_ptr,  # [D] the norm's weight with NORM (else x, never read)
  M,  # rows (runtime: one compile serves every M <= BLOCK_M)
  clear_off,
  clear_n,  # the scratch chain (launch.py): the half of scratch_ptr this call
  # zeroes [clear_n floats]; WORK_OFF: the half it works in
  scratch_ptr,  # f32, zeroed before the launch: Pg [M, R], Pu [M, R], S [M, RD],
  # output accumulator [M, DO], then (i32) A_CHUNKS stage-A counters,
  # the counter stage C waits on (stage-B slices or, PARK_H, stage-H
  # tiles), ceil(DO/BLOCK_N) stage-C semaphores, with P16 one stage-A
  # counter per column block of Pg/Pu, with PARK_H one per stage-H split,
  # then (f32, NORM) the sums of X's squares [M]
  o_ptr,  # [M, DO] output
  p16_ptr,  # in the factors' dtype: Pg, Pu [2, M, R] rounded once (P16), then h [M, F]
  # (PARK_H); else unused
  D: tl.constexpr,
  R: tl.constexpr,
  F: tl.constexpr,
  RD: tl.constexpr,
  DO: tl.constexpr,
  GATED: tl.constexpr,
  ACT: tl.constexpr,
  HAS_BG: tl.constexpr,
  HAS_BU: tl.constexpr,
  HAS_BD: tl.constexpr,
  K_PER: tl.constexpr,
  SPLIT_K: tl.constexpr,
  C_CHUNKS: tl.constexpr,
  RD_PER: tl.constexpr,
  A_CHUNKS: tl.constexpr,
  RB_PER_CHUNK: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_K: tl.constexpr,
  BLOCK_R: tl.constexpr,
  BLOCK_F: tl.constexpr,
  BLOCK_RD: tl.constexpr,
  BLOCK_N: tl.constexpr,
  BLOCK_KR: tl.constexpr,
  EVEN_D: tl.constexpr,
  EVEN_R: tl.constexpr,
  EVEN_RD: tl.constexpr,
  P16: tl.constexpr,
  S_FLUSH: tl.constexpr,  # 0 (atomics); timing only: 1 stores, 2 masked-off stores
  PARK_H: tl.constexpr,  # stage B parks h; stage H (H_SPLITS x ceil(RD/BLOCK_H) CTAs) projects it
  H_SPLITS: tl.constexpr,
  F_PER: tl.constexpr,
  BLOCK_H: tl.constexpr,
  EVEN_F: tl.constexpr,
  COLS_F: tl.constexpr,  # D_ff columns per stage-B slice (<= BLOCK_F; the rest masked)
  H_INLINE: tl.constexpr,  # PARK_H: each stage-B CTA then runs stage-H tiles of its own
  # split (no stage-H CTAs of their own)
  NORM: tl.constexpr,  # rms_norm of X (weight g, epsilon EPS): stage A streams X·g, B scales rows
  EPS: tl.constexpr,
  PREFETCH: tl.constexpr = 0,
  PREFETCH_H: tl.constexpr = 0,  # Variant.prefetch{,_h,_c}
  PREFETCH_C: tl.constexpr = 0,
  C_RESIDENT: tl.constexpr = 0,  # Variant.c_resident; its chunk padded to RD_PER_P2 rows
  RD_PER_P2: tl.constexpr = 16,
  WORK_OFF: tl.constexpr = 0,  # the scratch chain's offset of this call's half (launch.py)
  PDL: tl.constexpr = 0,  # launched as a programmatic dependent (launch.py, join_chain)
  TRACE: tl.constexpr = 0,  # timing only (output right): each CTA stamps its entry, first
  # and last wait ends, work end and exit into o_in_ptr as int64
  # [grid, 8] (_common.stamp)
):
  pid = tl.program_id(0)
  if PDL >= 2:  # before the wait: a stage-A CTA's first U rows, a stage-B CTA's V slice's
    _prefetch_first(
      pid, ug_ptr, uu_ptr, vg_ptr, vu_ptr, D, R, F, GATED, K_PER, SPLIT_K, BLOCK_R, COLS_F
    )
  chain_ptr = scratch_ptr
  scratch_ptr = join_chain(scratch_ptr, WORK_OFF, PDL)
  stamp(o_in_ptr, 0, TRACE)
  pg_ptr = scratch_ptr
  pu_ptr = scratch_ptr + M * R
  s_ptr = scratch_ptr + 2 * M * R
  acc_ptr = scratch_ptr + 2 * M * R + M * RD
  cnt_ptr = (scratch_ptr + 2 * M * R + M * RD + M * DO).to(tl.pointer_type(tl.int32))
  sem_ptr = cnt_ptr + A_CHUNKS + 1
  n_r = (R + BLOCK_R - 1) // BLOCK_R
  n_a = n_r * SPLIT_K
  n_b = (F + COLS_F - 1) // COLS_F
  rb_cnt_ptr = sem_ptr + (DO + BLOCK_N - 1) // BLOCK_N
  pg16_ptr = p16_ptr
  pu16_ptr = p16_ptr + M * R
  h_ptr = p16_ptr  # PARK_H: h [M, F] in the factors' dtype, after Pg, Pu's copies with P16
  h_cnt_ptr = rb_cnt_ptr  # PARK_H: one counter per stage-H split, after P16's counters
  if P16:
    h_ptr = p16_ptr + 2 * M * R
    h_cnt_ptr = rb_cnt_ptr + n_r
  sq_ptr = h_cnt_ptr.to(tl.pointer_type(tl.float32))  # NORM: [M] X's squares, summed
  if PARK_H:
    sq_ptr = (h_cnt_ptr + H_SPLITS).to(tl.pointer_type(tl.float32))
  n_cb = (RD + BLOCK_H - 1) // BLOCK_H
  n_h = 0  # stage-H tiles (stage C waits for them all)
  if PARK_H:
    n_h = H_SPLITS * n_cb
  n_h_ctas = 0 if H_INLINE else n_h
  offs_m = tl.arange(0, BLOCK_M)
  m_mask = offs_m < M
  if pid < n_a:
    # ---- stage A: split-K X·Ug and X·Uu, X loaded once per K tile (with NORM, X·g; the
    # r-block-0 tiles sum X's squares from the same loads, stage B applies the row scale)
    _up_tile(
      pid // SPLIT_K,
      (pid % SPLIT_K) * K_PER,
      x_ptr,
      ug_ptr,
      uu_ptr,
      pg_ptr,
      pu_ptr,
      cnt_ptr,
      offs_m,
      m_mask,
      D,
      R,
      GATED,
      K_PER,
      RB_PER_CHUNK,
      BLOCK_M,
      BLOCK_K,
      BLOCK_R,
      BLOCK_R,
      EVEN_D,
      True,
      P16,
      pg16_ptr,
      pu16_ptr,
      rb_cnt_ptr,
      SPLIT_K,
      NORM,
      g_ptr,
      sq_ptr,
    )
  elif pid < n_a + n_b:
    # ---- stage B: one slice of the intermediate dim, projected straight into rank space
    if PREFETCH > 0:  # the first rows of its Vu (Vg) slice load while it waits
      _prefetch_slice(vg_ptr, vu_ptr, (pid - n_a) * COLS_F, R, F, GATED, PREFETCH, BLOCK_F)
    _down_slice(
      pid - n_a,
      pg16_ptr if P16 else pg_ptr,
      pu16_ptr if P16 else pu_ptr,
      vg_ptr,
      bg_ptr,
      vu_ptr,
      bu_ptr,
      ud_ptr,
      s_ptr,
      cnt_ptr,
      offs_m,
      m_mask,
      n_r,
      R,
      F,
      RD,
      GATED,
      ACT,
      HAS_BG,
      HAS_BU,
      SPLIT_K,
      A_CHUNKS,
      RB_PER_CHUNK,
      RB_PER_CHUNK * BLOCK_R,
      BLOCK_M,
      BLOCK_F,
      COLS_F,
      BLOCK_RD,
      BLOCK_KR,
      EVEN_R,
      True,
      P16,
      S_FLUSH,
      PARK_H,
      h_ptr,
      h_cnt_ptr,
      F_PER // COLS_F,
      o_in_ptr,
      TRACE,
      NORM,
      sq_ptr,
      D,
      EPS,
    )
    if H_INLINE:
      # the split's slices share its n_cb tiles (the last split may have fewer slices):
      # S gets one partial per split instead of one per slice. Deadlock-free as long as
      # F_PER // COLS_F CTAs fit on the GPU at once: with in-order dispatch only the split
      # being dispatched can have members waiting for undispatched ones
      fb = pid - n_a
      j = fb // (F_PER // COLS_F)
      first = j * (F_PER // COLS_F)
      members = tl.minimum(n_b - first, F_PER // COLS_F)
      for t in range(fb - first, n_cb, members):
        _park_h_tile(
          j * n_cb + t,
          h_ptr,
          ud_ptr,
          s_ptr,
          cnt_ptr,
          h_cnt_ptr,
          offs_m,
          m_mask,
          n_b,
          F,
          RD,
          A_CHUNKS,
          F_PER,
          F_PER // COLS_F,
          BLOCK_M,
          BLOCK_H,
          BLOCK_KR,
          EVEN_F,
          0,
          o_in_ptr,
          False,
        )
  elif pid < n_a + n_b + n_h_ctas:
    # ---- stage H (PARK_H): S += h · Ud, split over D_ff, each split once its slices parked h
    _park_h_tile(
      pid - n_a - n_b,
      h_ptr,
      ud_ptr,
      s_ptr,
      cnt_ptr,
      h_cnt_ptr,
      offs_m,
      m_mask,
      n_b,
      F,
      RD,
      A_CHUNKS,
      F_PER,
      F_PER // COLS_F,
      BLOCK_M,
      BLOCK_H,
      BLOCK_KR,
      EVEN_F,
      PREFETCH_H,
      o_in_ptr,
      TRACE,
    )
  else:
    # ---- stage C: Y = S·Vd + bd, split over r_d chunks, once S is complete
    n_nb = (DO + BLOCK_N - 1) // BLOCK_N
    q = pid - n_a - n_b - n_h_ctas
    if PREFETCH_C > 0:  # the first rows of its V_d tile load while it waits
      row0 = (q // n_nb) * RD_PER
      prefetch_l2(
        vd_ptr,
        row0,
        (q % n_nb) * BLOCK_N,
        tl.minimum(RD, row0 + RD_PER),
        DO,
        DO,
        PREFETCH_C,
        BLOCK_N,
      )
    if C_RESIDENT:  # its V_d chunk into registers while it waits
      offs_n = (q % n_nb) * BLOCK_N + tl.arange(0, BLOCK_N)
      n_mask = offs_n < DO
      offs_c = (q // n_nb) * RD_PER + tl.arange(0, RD_PER_P2)
      c_mask = (offs_c < RD) & (tl.arange(0, RD_PER_P2) < RD_PER)
      vdt = tl.load(
        vd_ptr + offs_c[:, None] * DO + offs_n[None, :],
        mask=c_mask[:, None] & n_mask[None, :],
        other=0.0,
      )
    if PARK_H:
      wait_at_least(cnt_ptr + A_CHUNKS, n_h)
    else:
      wait_at_least(cnt_ptr + A_CHUNKS, n_b)
    stamp(o_in_ptr, 1, TRACE)
    stamp(o_in_ptr, 2, TRACE)
    if C_RESIDENT:
      st = tl.load(
        s_ptr + offs_m[:, None] * RD + offs_c[None, :],
        mask=m_mask[:, None] & c_mask[None, :],
        other=0.0,
        cache_modifier=".cg",
      )
      splitr_finish(
        tl.dot(st.to(vdt.dtype), vdt),
        q % n_nb,
        bd_ptr,
        acc_ptr,
        sem_ptr,
        o_ptr,
        offs_m,
        m_mask,
        offs_n,
        n_mask,
        DO,
        C_CHUNKS,
        HAS_BD,
      )
    else:
      splitr_out_tile(
        q % n_nb,
        q // n_nb,
        s_ptr,
        vd_ptr,
        bd_ptr,
        acc_ptr,
        sem_ptr,
        o_ptr,
        M,
        RD,
        DO,
        RD_PER,
        C_CHUNKS,
        HAS_BD,
        BLOCK_M,
        BLOCK_N,
        BLOCK_KR,
        EVEN_RD,
        BLOCK_N,
      )
  stamp(o_in_ptr, 3, TRACE)
  leave_chain(chain_ptr, clear_off, clear_n)
  stamp(o_in_ptr, 4, TRACE)


@triton.jit
def _mlp_decode_persistent_kernel(
  x_ptr,
  ug_ptr,
  vg_ptr,
  bg_ptr,
  uu_ptr,
  vu_ptr,
  bu_ptr,
  ud_ptr,
  vd_ptr,
  bd_ptr,  # as above
  o_in_ptr,  # aliased buffer (as above); never read
  M,
  clear_off,
  clear_n,  # as above
  scratch_ptr,  # as above, less the [M, DO] accumulator when C_CHUNKS == 1
  o_ptr,
  p16_ptr,  # as above
  D: tl.constexpr,
  R: tl.constexpr,
  F: tl.constexpr,
  RD: tl.constexpr,
  DO: tl.constexpr,
  GATED: tl.constexpr,
  ACT: tl.constexpr,
  HAS_BG: tl.constexpr,
  HAS_BU: tl.constexpr,
  HAS_BD: tl.constexpr,
  K_PER: tl.constexpr,
  SPLIT_K: tl.constexpr,
  C_CHUNKS: tl.constexpr,
  RD_PER: tl.constexpr,
  A_CHUNKS: tl.constexpr,
  RB_PER_CHUNK: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_K: tl.constexpr,
  BLOCK_R: tl.constexpr,
  BLOCK_F: tl.constexpr,
  BLOCK_RD: tl.constexpr,
  BLOCK_N: tl.constexpr,
  BLOCK_KR: tl.constexpr,
  EVEN_D: tl.constexpr,
  EVEN_R: tl.constexpr,
  EVEN_RD: tl.constexpr,
  COLS_R: tl.constexpr,
  COLS_F: tl.constexpr,
  COLS_N: tl.constexpr,
  PROGRAMS: tl.constexpr,
  PREFETCH: tl.constexpr,
  PREFETCH_C: tl.constexpr,
  PHASES: tl.constexpr,  # 7; timing only: bits 1, 2, 4 stream phases A, B, C
  P16: tl.constexpr,
  WORK_OFF: tl.constexpr = 0,  # as above
  PDL: tl.constexpr = 0,  # as above
):
  pid = tl.program_id(0)
  if PDL >= 2:  # before the wait: the first U rows of this CTA's first phase-A tile
    _prefetch_first(pid, ug_ptr, uu_ptr, vg_ptr, vu_ptr, D, R, F, GATED, K_PER, SPLIT_K, COLS_R, 0)
  chain_ptr = scratch_ptr
  scratch_ptr = join_chain(scratch_ptr, WORK_OFF, PDL)
  pg_ptr = scratch_ptr
  pu_ptr = scratch_ptr + M * R
  s_ptr = scratch_ptr + 2 * M * R
  acc_ptr = scratch_ptr + 2 * M * R + M * RD  # the output accumulator: only at C_CHUNKS > 1
  if C_CHUNKS > 1:
    cnt_ptr = (scratch_ptr + 2 * M * R + M * RD + M * DO).to(tl.pointer_type(tl.int32))
  else:
    cnt_ptr = (scratch_ptr + 2 * M * R + M * RD).to(tl.pointer_type(tl.int32))
  sem_ptr = cnt_ptr + A_CHUNKS + 1
  n_r = (R + COLS_R - 1) // COLS_R
  n_a = n_r * SPLIT_K
  n_b = (F + COLS_F - 1) // COLS_F
  n_nb = (DO + COLS_N - 1) // COLS_N
  rb_cnt_ptr = sem_ptr + n_nb
  pg16_ptr = p16_ptr
  pu16_ptr = p16_ptr + M * R
  offs_m = tl.arange(0, BLOCK_M)
  m_mask = offs_m < M
  if PREFETCH > 0:  # the first rows of this CTA's first Vu (Vg) slice load during phase A
    if pid < n_b:
      _prefetch_slice(vg_ptr, vu_ptr, pid * COLS_F, R, F, GATED, PREFETCH, BLOCK_F)
  # ---- phase A: split-K X·Ug and X·Uu, X loaded once per K tile; never waits
  for t in range(pid, n_a, PROGRAMS):
    _up_tile(
      t // SPLIT_K,
      (t % SPLIT_K) * K_PER,
      x_ptr,
      ug_ptr,
      uu_ptr,
      pg_ptr,
      pu_ptr,
      cnt_ptr,
      offs_m,
      m_mask,
      D,
      R,
      GATED,
      K_PER,
      RB_PER_CHUNK,
      BLOCK_M,
      BLOCK_K,
      BLOCK_R,
      COLS_R,
      EVEN_D,
      (PHASES & 1) != 0,
      P16,
      pg16_ptr,
      pu16_ptr,
      rb_cnt_ptr,
      SPLIT_K,
    )
  # ---- phase B: one D_ff slice per tile, consuming Pg/Pu chunk by chunk
  for fb in range(pid, n_b, PROGRAMS):
    _down_slice(
      fb,
      pg16_ptr if P16 else pg_ptr,
      pu16_ptr if P16 else pu_ptr,
      vg_ptr,
      bg_ptr,
      vu_ptr,
      bu_ptr,
      ud_ptr,
      s_ptr,
      cnt_ptr,
      offs_m,
      m_mask,
      n_r,
      R,
      F,
      RD,
      GATED,
      ACT,
      HAS_BG,
      HAS_BU,
      SPLIT_K,
      A_CHUNKS,
      RB_PER_CHUNK,
      RB_PER_CHUNK * COLS_R,
      BLOCK_M,
      BLOCK_F,
      COLS_F,
      BLOCK_RD,
      BLOCK_KR,
      EVEN_R,
      (PHASES & 2) != 0,
      P16,
      0,
      False,
      s_ptr,
      cnt_ptr,
      1,
      o_in_ptr,
      False,
    )  # S_FLUSH 0; h not parked
  # ---- phase C: Y = S·Vd + bd once every phase-B tile has landed in S
  if (PHASES & 4) != 0:
    if PREFETCH_C > 0:
      if pid < C_CHUNKS * n_nb:
        row0 = (pid // n_nb) * RD_PER  # this CTA's first chunk, no further
        prefetch_l2(
          vd_ptr,
          row0,
          (pid % n_nb) * COLS_N,
          tl.minimum(RD, row0 + RD_PER),
          DO,
          DO,
          PREFETCH_C,
          BLOCK_N,
        )
    for q in range(pid, C_CHUNKS * n_nb, PROGRAMS):
      wait_at_least(cnt_ptr + A_CHUNKS, n_b)
      splitr_out_tile(
        q % n_nb,
        q // n_nb,
        s_ptr,
        vd_ptr,
        bd_ptr,
        acc_ptr,
        sem_ptr,
        o_ptr,
        M,
        RD,
        DO,
        RD_PER,
        C_CHUNKS,
        HAS_BD,
        BLOCK_M,
        BLOCK_N,
        BLOCK_KR,
        EVEN_RD,
        COLS_N,
      )
  leave_chain(chain_ptr, clear_off, clear_n)


def stage_a_splits(d: int, split_k: int, block_k: int) -> tuple[int, int]:
  """(K_PER, splits) of stage A asked for ``split_k`` splits of D: whole block_k steps each,
  so the splits that result may be fewer (the last one ragged)."""
  k_per = planner.part_len(d, split_k, block_k)
  return k_per, planner.cdiv(d, k_per)


def launch_plan(
  m, d, r, f, rd, d_out, *, gated, act, bias_mask, bs: BlockSizes, variant: Variant | None = None
) -> dict:
  """Grid size, scratch size and constexprs of one tiled call (shared by the wrapper and the
  tests); ``variant``: the options measured slower (None: none of them)."""
  vt = variant or Variant()
  planner.check_prefetch_rows(vt, "prefetch", "prefetch_h", "prefetch_c")
  for rows, width, name in (
    (vt.prefetch, bs.block_f, "block_f"),
    (vt.prefetch_h, bs.block_h, "block_h"),
    (vt.prefetch_c, bs.block_n, "block_n"),
  ):
    if rows and width < 64:  # prefetch_l2 asks for one address per 64 columns
      raise ValueError(f"{bs}: an L2 prefetch needs tiles of >= 64 columns ({name}={width})")
  cols_f = vt.cols_f or bs.block_f
  if not 0 < cols_f <= bs.block_f:
    raise ValueError(f"{vt.cols_f=} must be in [1, {bs.block_f=}] (0: block_f)")
  k_per, split = stage_a_splits(d, bs.split_k, bs.block_k)
  n_rb = planner.cdiv(r, bs.block_r)
  rb_per_chunk = planner.cdiv(n_rb, bs.a_chunks)
  a_chunks = planner.cdiv(n_rb, rb_per_chunk)
  n_a = n_rb * split
  n_b = planner.cdiv(f, cols_f)
  n_nb = planner.cdiv(d_out, bs.block_n)
  rd_per = planner.part_len(rd, bs.c_chunks, bs.block_kr)
  c_chunks = planner.cdiv(rd, rd_per)
  rd_per_p2 = max(16, planner.next_pow2(rd_per))
  if vt.c_resident and rd_per_p2 * bs.block_n > C_RESIDENT_MAX:
    raise ValueError(
      f"{bs}: c_resident holds a V_d chunk of {rd_per_p2} x {bs.block_n} "
      f"elements in registers; at most {C_RESIDENT_MAX} (more c_chunks or a "
      "narrower block_n)"
    )
  h_splits, f_per, n_h = 1, cols_f, 0
  if vt.h_inline and not bs.park_h:
    raise ValueError("h_inline=True runs stage H inside stage B: it needs park_h=True")
  if bs.park_h:
    n_cb = planner.cdiv(rd, bs.block_h)
    want = bs.h_splits or bs.h_per_sm * max(1, planner.H200.num_sms // n_cb)
    step = math.lcm(cols_f, bs.block_kr)  # whole stage-B slices, whole K steps
    f_per = planner.part_len(f, want, step)
    if vt.h_inline and not bs.h_splits:  # a split's slices share its n_cb tiles, one each
      f_per = planner.round_up(n_cb * cols_f, step)
    h_splits = planner.cdiv(f, f_per)
    n_h = h_splits * n_cb
    if vt.h_inline and f_per // cols_f > planner.H200.num_sms:
      raise ValueError(
        f"h_inline with {f_per // cols_f} slices a split: the CTAs of a split "
        f"wait for each other, so at most {planner.H200.num_sms} may share one"
      )
  has = dict(zip(("bg", "bu", "bd") if gated else ("bu", "bd"), bias_mask))
  meta = dict(
    D=d,
    R=r,
    F=f,
    RD=rd,
    DO=d_out,
    GATED=gated,
    ACT=ACT_CODES[act],
    HAS_BG=has.get("bg", False),
    HAS_BU=has["bu"],
    HAS_BD=has["bd"],
    K_PER=k_per,
    SPLIT_K=split,
    C_CHUNKS=c_chunks,
    RD_PER=rd_per,
    A_CHUNKS=a_chunks,
    RB_PER_CHUNK=rb_per_chunk,
    BLOCK_M=bs.block_m,
    BLOCK_K=bs.block_k,
    BLOCK_R=bs.block_r,
    BLOCK_F=bs.block_f,
    BLOCK_RD=bs.block_rd,
    BLOCK_N=bs.block_n,
    BLOCK_KR=bs.block_kr,
    EVEN_D=d % k_per == 0,
    EVEN_R=r % (rb_per_chunk * bs.block_r) == 0 and (rb_per_chunk * bs.block_r) % bs.block_kr == 0,
    EVEN_RD=rd % rd_per == 0,
    P16=bs.p16,
    S_FLUSH=0,
    PARK_H=bs.park_h,
    H_SPLITS=h_splits,
    F_PER=f_per,
    BLOCK_H=bs.block_h,
    EVEN_F=f % f_per == 0,
    COLS_F=cols_f,
    H_INLINE=vt.h_inline,
    PREFETCH=vt.prefetch,
    PREFETCH_H=vt.prefetch_h,
    PREFETCH_C=vt.prefetch_c,
    C_RESIDENT=int(vt.c_resident),
    RD_PER_P2=rd_per_p2 if vt.c_resident else 16,  # read by c_resident alone
    TRACE=0,
    NORM=0,  # the wrapper's norm= sets NORM and EPS
    EPS=0.0,
  )  # jax-triton passes no constexpr default (a missing one is None)
  scratch = (
    m * (2 * r + rd + d_out)
    + a_chunks
    + 1
    + n_nb
    + (n_rb if bs.p16 else 0)
    + (h_splits if bs.park_h else 0)
    + m  # the sums of X's squares (NORM)
  )
  p16 = (2 * m * r if bs.p16 else 0) + (m * f if bs.park_h else 0)
  grid = n_a + n_b + (0 if vt.h_inline else n_h) + n_nb * c_chunks
  return dict(grid=grid, n_nb=n_nb, scratch=scratch, meta=meta, p16=max(p16, 1))


def persistent_launch_plan(
  m, d, r, f, rd, d_out, *, gated, act, bias_mask, p: planner.PersistentMlpPlan, phases: int = 7
) -> dict:
  """Grid size, scratch size and constexprs of one persistent call (``phases`` < 7 leaves
  phases out, to time the others: wrong output)."""
  planner.check_prefetch_rows(p, "prefetch", "prefetch_c")
  split = planner.cdiv(d, p.k_per)
  n_rb = planner.cdiv(r, p.cols_r)
  rb_per_chunk = planner.cdiv(n_rb, 4)  # phase B consumes Pg/Pu in up to 4 chunks...
  if (rb_per_chunk * p.cols_r) % 64:  # ...of whole 64-row reduction steps
    rb_per_chunk = n_rb
  a_chunks = planner.cdiv(n_rb, rb_per_chunk)
  rd_per = planner.cdiv(planner.cdiv(rd, 64), p.c_chunks) * 64
  c_chunks = planner.cdiv(rd, rd_per)
  n_nb = planner.cdiv(d_out, p.cols_n)
  r_per = rb_per_chunk * p.cols_r
  has = dict(zip(("bg", "bu", "bd") if gated else ("bu", "bd"), bias_mask))
  meta = dict(
    D=d,
    R=r,
    F=f,
    RD=rd,
    DO=d_out,
    GATED=gated,
    ACT=ACT_CODES[act],
    HAS_BG=has.get("bg", False),
    HAS_BU=has["bu"],
    HAS_BD=has["bd"],
    K_PER=p.k_per,
    SPLIT_K=split,
    C_CHUNKS=c_chunks,
    RD_PER=rd_per,
    A_CHUNKS=a_chunks,
    RB_PER_CHUNK=rb_per_chunk,
    BLOCK_M=p.block_m,
    BLOCK_K=64,
    BLOCK_R=p.block_r,
    BLOCK_F=p.block_f,
    BLOCK_RD=256,
    BLOCK_N=p.block_n,
    BLOCK_KR=64,
    EVEN_D=d % p.k_per == 0,
    EVEN_R=r % r_per == 0 and r_per % 64 == 0,
    EVEN_RD=rd % rd_per == 0,
    COLS_R=p.cols_r,
    COLS_F=p.cols_f,
    COLS_N=p.cols_n,
    PROGRAMS=p.programs,
    PREFETCH=p.prefetch,
    PREFETCH_C=p.prefetch_c,
    PHASES=phases,
    P16=p.p16,
  )
  scratch = (
    m * (2 * r + rd + (d_out if c_chunks > 1 else 0)) + a_chunks + 1 + n_nb + (n_rb if p.p16 else 0)
  )
  return dict(grid=p.programs, n_nb=n_nb, scratch=scratch, meta=meta, p16=2 * m * r if p.p16 else 1)


def _composed(x2, up, down, gate, act, out_dtype, out, group=True, norm=None, residual=None):
  """The MLP as X·U·V decode calls and XLA's activation fusion (``compose=True``):
  act(X·Ug·Vg + bg) ⊙ (X·Uu·Vu + bu) in f32 from the calls' outputs in the factors' dtype,
  rounded once to it, then ·Ud·Vd + bd (into ``out``, if given). ``group``: X·Ug and X·Uu in
  one grouped launch (phase 1 alone, ``pv="xla"``; on these tiles if a GroupDecodePlan),
  else one call each. A projection given as (u, v, bias | None, scale) carries a rank-space
  scale, applied as xuv_decode and the grouped kernel apply one. ``norm``: (weight, eps), X
  rms-normalised by the grouped launch (by XLA first without one). ``residual`` [M, D_out]:
  added by the down call as it stores y."""
  from lrjax.custom_calls.triton.xuv_decode import xuv_decode
  from lrjax.custom_calls.triton.xuv_decode_group import _xuv_decode_group
  from lrjax.lowering.primitives import ACTIVATIONS

  def xuv(a, p, odt, o=None, res=None):
    b = p[2] if len(p) >= 3 else None
    if len(p) == 4 and p[3] is not None:  # a rank-space scale: phase 1, then XLA
      return xuv_decode(a, p[0], p[1], b, out_dtype=odt, scale=p[3], residual=res)
    return xuv_decode(a, p[0], p[1], b, out_dtype=odt, out=o, residual=res)

  f32, fn, dt = jnp.float32, ACTIVATIONS[act], up[1].dtype
  if gate is None or not group:
    x2, norm = normed_reference(x2, norm), None
  if gate is None:
    h = fn(xuv(x2, up, dt).astype(f32))
  else:
    plan = group if isinstance(group, planner.GroupDecodePlan) else None
    yg, yu = (
      _xuv_decode_group(x2, [gate, up], out_dtype=dt, pv="xla", plan=plan, norm=norm)
      if group
      else (xuv(x2, gate, dt), xuv(x2, up, dt))
    )
    h = fn(yg.astype(f32)) * yu.astype(f32)
  return xuv(h.astype(down[0].dtype), down, out_dtype, out, residual)


def _mlp_decode(
  x,
  up,
  down,
  gate=None,
  *,
  act="silu",
  out_dtype=None,
  block_sizes: BlockSizes | None = None,
  out=None,
  xla_zeroing: bool | None = None,
  persistent: bool | planner.PersistentMlpPlan = False,
  compose: bool | None = None,
  variant: Variant | None = None,
  phases: int = 7,
  s_flush: str = "atomic",
  compose_group: bool | planner.GroupDecodePlan = True,
  norm=None,
  residual=None,
):
  """``mlp_decode`` with every schedule option (tests, and the benchmarks through
  benchmarks/kernel_variants.py).

  ``norm``: (weight [D], eps): x is rms_norm(x, weight, eps) (lowering/rms_norm.py), applied
  as stage A (the composed schedule's grouped launch) loads it; the persistent schedule has
  it applied by XLA first.
  ``residual`` [..., D_out] (out_dtype; down has no bias): y + residual, added as stage C (the
  composed schedule's down call) stores y.

  ``compose``: X·U·V decode calls and an XLA fusion instead of the fused kernel (module
  docstring); default: from the table's ``compose_min_m`` rows, unless an option of the fused
  kernel is given.
  ``xla_zeroing``: zero the scratch with an XLA op aliased into the call instead of
  jax-triton's memset inside the custom call (default as in xuv_decode).
  ``persistent``: one CTA per SM runs its share of each phase
  (``planner.plan_mlp_decode_persistent`` unless a plan is given); measured within ±5 % of
  the tiled schedule, so not the default.
  ``variant``: the tiled schedule's options measured slower (``Variant``).
  Timing probes (the output is then wrong): ``phases`` (persistent: bits 1, 2, 4 stream
  phases A, B, C) and ``s_flush`` (tiled: "store" stores stage B's partial of S instead of
  adding it, "none" masks those stores off by a data test that never holds).
  ``compose_group``: the composed schedule's X·Ug and X·Uu as two calls (False) instead of
  one grouped launch, or that launch on a ``planner.GroupDecodePlan``'s tiles.
  """
  gated = gate is not None
  x2, lead, (d, r, f, rd, d_out), bias_mask, ops = unpack_mlp_args(x, up, down, gate, act)
  m = x2.shape[0]
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  w, eps = norm_operands(norm, d)
  bd, has_bd = residual_operand(residual, ops[9] if bias_mask[-1] else None, lead, d_out, out_dtype)
  if residual is not None:  # stage C's bias operand carries the residual
    ops, bias_mask = ops[:9] + (bd,), bias_mask[:-1] + (has_bd,)
  fused_asked = (
    block_sizes is not None
    or persistent is not False
    or variant is not None
    or phases != 7
    or s_flush != "atomic"
    or xla_zeroing is not None
  )
  if compose is None:
    compose = m >= _t().compose_min_m and not fused_asked
  if compose:
    if fused_asked:
      raise ValueError(
        "compose=True runs X·U·V decode calls, not the fused kernel: "
        "block_sizes=, persistent=, variant=, xla_zeroing=, phases= and s_flush= "
        "do not apply"
      )
    if m > MAX_M:
      raise ValueError(f"{m} rows: the decode MLP serves M <= {MAX_M}")
    check_out(out, (m, d_out), out_dtype)
    r2 = None if residual is None else bd
    return _composed(x2, up, down, gate, act, out_dtype, out, compose_group, norm, r2).reshape(
      *lead, d_out
    )
  if persistent:
    if norm is not None:  # the persistent schedule takes no norm: XLA normalises x
      x2, w = normed_reference(x2, norm), None
      ops = (x2,) + tuple(ops[1:])
    if block_sizes is not None or variant is not None:
      raise ValueError(
        "block_sizes= and variant= apply to the tiled schedule (persistent=False); "
        "pass a planner.PersistentMlpPlan instead"
      )
    p = (
      persistent
      if isinstance(persistent, planner.PersistentMlpPlan)
      else planner.plan_mlp_decode_persistent(m, d, f, r, rd, d_out, gated, programs=num_sms())
    )
    if m > PERSISTENT_MAX_M or p.block_m < m:
      raise ValueError(
        f"{m} rows ({p.block_m=}): the persistent schedule serves M <= {PERSISTENT_MAX_M}"
      )
    if not 0 < p.programs <= num_sms():
      raise ValueError(
        f"{p.programs=} must be in [1, {num_sms()}] (the SMs; 0: unknown): "
        "every CTA must be resident, or a waiting CTA could block its producer"
      )
    if phases not in range(1, 8):
      raise ValueError(f"{phases=} must be in 1..7")
    if s_flush != "atomic":
      raise ValueError("s_flush= applies to the tiled schedule only")
    plan = persistent_launch_plan(
      m, d, r, f, rd, d_out, gated=gated, act=act, bias_mask=bias_mask, p=p, phases=phases
    )
    kernel, warps, stages = _mlp_decode_persistent_kernel, p.warps, p.stages
  else:
    if phases != 7:
      raise ValueError("phases= applies to the persistent schedule only")
    bs = block_sizes or BlockSizes.get_default(m, d, f, r, d_out)
    if bs.block_m < m:
      raise ValueError(f"{bs.block_m=} must cover the {m} rows; use mlp_prefill for large M")
    plan = launch_plan(
      m, d, r, f, rd, d_out, gated=gated, act=act, bias_mask=bias_mask, bs=bs, variant=variant
    )
    if s_flush not in S_FLUSH_CODES:
      raise ValueError(f"{s_flush=} must be one of {sorted(S_FLUSH_CODES)}")
    if s_flush != "atomic":
      if bs.park_h:
        raise ValueError(
          "s_flush= times stage B's own projection into S; with "
          "park_h=True stage H projects h (pass park_h=False blocks)"
        )
      plan["meta"]["S_FLUSH"] = S_FLUSH_CODES[s_flush]
    plan["meta"].update(NORM=int(w is not None), EPS=eps)
    kernel, warps, stages = _mlp_decode_kernel, bs.num_warps, bs.num_stages
  check_out(out, (m, d_out), out_dtype)
  if xla_zeroing is None:
    xla_zeroing = out is None and launch.xla_zeroing()
  if xla_zeroing and out is not None:
    raise ValueError("out= and xla_zeroing=True cannot be combined")
  if xla_zeroing:  # the 11th operand is then the zeroed scratch, aliased to output 0
    eleventh, aliases, zeroed = jnp.zeros((plan["scratch"],), jnp.float32), {10: 0}, ()
  else:
    eleventh = x2 if out is None else out
    aliases, zeroed = ({10: 1} if out is not None else None), (0,)
  outs = launch.triton_call(
    *ops,
    eleventh,
    *(() if persistent else (w if w is not None else x2,)),  # the tiled kernel's g_ptr
    m,
    *launch.UNCHAINED,
    kernel=kernel,
    out_shape=(
      jax.ShapeDtypeStruct((plan["scratch"],), jnp.float32),
      jax.ShapeDtypeStruct((m, d_out), out_dtype),
      jax.ShapeDtypeStruct((plan["p16"],), ops[5].dtype),
    ),  # P16's Pg, Pu; not zeroed
    grid=(plan["grid"],),
    zeroed_outputs=zeroed,
    input_output_aliases=aliases,
    num_warps=warps,
    num_stages=stages,
    name="lrjax_mlp_decode",
    **plan["meta"],
  )
  return outs[1].reshape(*lead, d_out)


def mlp_decode(
  x,
  up,
  down,
  gate=None,
  *,
  act="silu",
  out_dtype=None,
  block_sizes: BlockSizes | None = None,
  out=None,
  norm=None,
  residual=None,
):
  """Low-rank (Swi)GLU MLP for few tokens; ``up``/``down``/``gate`` are (u, v) or (u, v, bias).

  x [..., D]; up (u [D, r], v [r, F]); gate like up (None: not gated); down (u [F, r_d],
  v [r_d, D_out]). ``block_sizes``: the fused kernel's blocks (default: the table's, and from
  ``compose_min_m`` rows X·U·V decode calls instead of the fused kernel). ``out`` [M, D_out]:
  optional buffer the kernel writes into (aliased). ``norm``: (weight [D], eps), x
  rms-normalised in the kernel (lowering/rms_norm.py). ``residual`` [..., D_out] in
  the output dtype (down without a bias): y + residual, added as y is stored.
  """
  return _mlp_decode(
    x,
    up,
    down,
    gate,
    act=act,
    out_dtype=out_dtype,
    block_sizes=block_sizes,
    out=out,
    norm=norm,
    residual=residual,
  )


def mlp_decode_scaled(x, up, down, gate=None, *, act="silu", out_dtype=None, residual=None):
  """``mlp_decode`` with rank-space scales: each projection (u, v, bias | None, scale | None).
  Runs the composed schedule (the grouped launch for gate and up, a decode call for down),
  where the scales are applied after phase 1 by XLA; the fused kernel takes none.
  ``residual`` (as mlp_decode's) is added by the down call."""
  from lrjax.custom_calls.triton._common import ACT_CODES

  if act not in ACT_CODES:
    raise ValueError(f"{act=} is not supported; expected one of {sorted(ACT_CODES)}")
  projs = ((gate,) if gate is not None else ()) + (up, down)
  if any(not isinstance(p, (tuple, list)) or len(p) != 4 for p in projs):
    raise ValueError("each projection must be (u, v, bias | None, scale | None)")
  lead, d_out = x.shape[:-1], down[1].shape[1]
  x2 = x.reshape(-1, x.shape[-1])
  if x2.shape[0] > MAX_M:
    raise ValueError(f"{x2.shape[0]} rows: the decode MLP serves M <= {MAX_M}")
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  r2, _ = residual_operand(residual, None, lead, d_out, out_dtype)  # [M, D_out] or None
  return _composed(x2, up, down, gate, act, out_dtype, None, residual=r2).reshape(*lead, d_out)


def mlp_decode_reference(
  x, up, down, gate=None, *, act="silu", out_dtype=None, norm=None, residual=None
):
  """f32-accumulating low-rank MLP with the kernel's roundings (X·U and h to the factor dtype),
  of rms_norm(x) with ``norm`` = (weight, eps), plus ``residual`` (rounded to out_dtype first)."""
  from lrjax.lowering.primitives import ACTIVATIONS

  out_dtype = jnp.dtype(out_dtype or x.dtype)
  x = normed_reference(x, norm)
  f32 = jnp.float32

  def xuv(a, p):
    t = jnp.matmul(a, p[0], preferred_element_type=f32).astype(p[1].dtype)
    y = jnp.matmul(t, p[1], preferred_element_type=f32)
    return y + p[2].astype(f32) if len(p) == 3 else y

  fn = ACTIVATIONS[act]
  h = fn(xuv(x, gate)) * xuv(x, up) if gate is not None else fn(xuv(x, up))
  return residual_reference(xuv(h.astype(down[0].dtype), down).astype(out_dtype), residual)
