"""Fused low-rank (Swi)GLU MLP for few tokens, in one launch of three or four dependent
stages (four where h is parked, below: the default from 2 tokens).

  stage A  Pg = X·Ug, Pu = X·Uu          one pass over X (both factors per K tile),
                                         inter-CTA split-K, f32 atomics into [M, r]
  stage B  per B_F slice of the intermediate dim (one CTA each), consuming Pg, Pu
           r-chunk by r-chunk as stage A completes them (so Vg, Vu stream while Ug, Uu do;
           one chunk where stage A runs in one wave at T <= 16, BlockSizes.get_default):
           h = act(Pg·Vg[:, f] + bg) ⊙ (Pu·Vu[:, f] + bu)      [M, B_F], registers only
           S += h · Ud[f, :]                                   f32 atomics into [M, r_d]
  stage C  Y = S·Vd + bd        split over r_d chunks, f32 atomics; the last chunk to arrive
                                for a column block writes the output (as in xuv_decode)

Unparked (below), the [M, D_ff] intermediate exists only as one [M, B_F] register tile per
CTA; it never touches HBM. Only the rank-space vectors Pg, Pu, S (a few KB to a few hundred KB) go
through L2. Stages are ordered inside the grid by counters: stage-A CTAs ``signal`` the
counter of their r-chunk and stage-B CTAs wait on each chunk before using it; stage-B
CTAs ``signal`` one counter that stage-C CTAs wait on. This has the same forward-progress
argument as xuv_decode: lower block indices are dispatched first. All accumulators and
counters live in one scratch buffer, zeroed by an XLA op aliased into the call, or by the
call before it on a scratch chain (launch.py), or, with ``out=``, by jax-triton's memset
inside the custom call. Non-gated MLPs
(act(X·U1·V1 + b1)·U2·V2 + b2) run the same kernel with GATED=False.

With ``BlockSizes.park_h`` stage B's S partials, one [M, r_d] f32 add per slice (147 MB of
L2 atomics at T=64 on Llama-3-8B r=2560, 18 MB at T=16), give way to parked h and a fourth
stage that projects it:

  stage B  h [M, B_F] stored once in the factors' dtype, into an [M, D_ff] buffer (1.8 MB
           at T=64, D_ff=14336: written, then read back from L2)
  stage H  S += h[:, split] · Ud[split, cols]   D_ff in about SMs / ceil(r_d / B_H) splits
                                                (four times that where D_ff's slices outnumber
                                                the SMs), each waiting only for its own
                                                stage-B slices; f32 atomics, one partial of S
                                                per split
  stage C  as above, once every stage-H tile has landed in S

Against the unparked kernel it measured 1.2-2.1x faster at T=32..128 (1.06x / 1.18x XLA at
T=32 / 64 on Llama-3-8B r=2560; session 12), and at T=2..16, once 5 pipeline stages keep one
CTA on each SM, 2-12 % faster (session 15: at 3-4 stages two or three CTAs shared an SM and
it had measured 2-9 % slower). At one token it is the default where stage B takes 128-wide
slices (``BlockSizes.get_default``; benchmarks/gpu_notes.md, sessions 15-16).

Every byte of the six factors is read once, so the floor is their size over HBM bandwidth.

With ``p16`` the last stage-A tile of each rank column block (``_common.last_arrival``)
rounds its f32 sums once to the factors' dtype, and stage B reads that copy: half the L2
bytes per slice, 1-3 % faster at Llama-3-8B r=2560 and Llama-3.2-1B (benchmarks/gpu_notes.md,
session 9). The kernel rounded P to that dtype before its dot anyway, so the output is the
same. It is the tiled default except where stage A runs in one wave at T <= 16: there the
rounding tail delayed stage B more than reading f32 costs it (session 33).

From ``COMPOSE_MIN_M`` rows the wrapper runs no fused kernel: the MLP is X·U·V decode calls,
each phase 1 split over K with XLA's GEMM applying V at these rows (X·Ug and X·Uu in one
grouped launch, ``xuv_decode_group(pv="xla")``; then ``xuv_decode`` for down), and one XLA
fusion for the activation, so the [M, D_ff] outputs of gate and up go through HBM (two bf16
[M, D_ff] writes and reads, 29 MB at Llama-3-70B's 128 rows). At 128 rows, as three calls,
that took 113.6 against the fused kernel's 126.4 µs on Llama-3-8B r=2560 and 263.2 against
312.2 on Llama-3-70B (XLA's unfused MLP 116.4 / 255.5; session 43,
benchmarks/results/gpu_mlp_decode_compose_h200.json); with gate and up in one launch 110.8
against two calls' 112.6 on the 8B (XLA 116.4), 262.9 against 262.0 on the 70B (XLA 253.7).
At 64 rows the fused kernel was faster
on the 8B (93.2 against 103.8) and, timed with weights of its own for every call, on the
70B (242.2 against 284.1: there XLA's ·V GEMMs inside the composed calls pad V every call). On Llama-3.2-1B at
128 rows the fused kernel was 1 % faster (59.4 against 60.2; XLA 55.7, which the policy
serves there); other widths from 65 rows are not measured.

``persistent=True`` runs the same three phases on one CTA per SM
(``_mlp_decode_persistent_kernel``, tiles from ``planner.plan_mlp_decode_persistent``, as
xuv_decode's persistent schedule): measured within ±5 % of this tiled schedule on most
shapes (benchmarks/gpu_notes.md, session 3), so it is not the default.
"""  # noqa: E501

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from lrjax.custom_calls.triton import launch, planner
from lrjax.custom_calls.triton.lowering import MLP_COMPOSE_MIN_M, MLP_DECODE_MAX_M
from lrjax.custom_calls.triton._common import (
  check_out,
  join_chain,
  last_arrival,
  leave_chain,
  mm_acc,
  mm_acc2,
  num_sms,
  prefetch_l2,
  round_once,
  signal,
  splitr_finish,
  splitr_out_tile,
  stamp,
  swiglu_epilogue,
  wait_at_least,
)

ACT_CODES = {"silu": 0, "gelu_tanh": 1, "gelu": 2, "relu": 3}
# how stage B flushes its partial of S: atomics; timing only (wrong output), plain stores or
# none (stores masked off by a data test that never holds: same instructions, no bytes)
S_FLUSH_CODES = {"atomic": 0, "store": 1, "none": 2}


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
  park_h: bool = False  # stage B parks h in a global buffer; stage H projects it (below)
  block_h: int = 128  # stage-H columns of the down rank per CTA
  h_splits: int = 0  # stage-H split of D_ff (0: about h_per_sm stage-H tiles per SM)
  h_per_sm: int = 1  # with h_splits=0: stage-H splits of about this many tiles an SM
  # A/B options, measured slower and so not defaults (benchmarks/gpu_notes.md, session 15):
  cols_f: int = 0  # D_ff columns a stage-B slice owns (<= block_f, the rest masked; 0: block_f)
  h_inline: bool = False  # park_h: stage-B CTAs run their split's stage-H tiles themselves,
  # splits of ceil(r_d / block_h) slices (one tile each) by default
  # L2 prefetch before a CTA's first wait (rows, 0 or a power of two): stage B's first rows of
  # its Vg, Vu slices, stage H's of its U_d tile, stage C's of its V_d tile
  prefetch: int = 0
  prefetch_h: int = 0
  prefetch_c: int = 0
  # stage C loads its whole V_d chunk (r_d / c_chunks rows, padded to a power of two, by
  # block_n columns: at most C_RESIDENT_MAX elements) into registers before its wait, and
  # after it does one dot with its chunk of S. The chunks that fit need 160-256 stage-C
  # CTAs on the 1B, past one wave: 0.8-2.2 us slower at T = 1-16 (session 34)
  c_resident: bool = False

  @classmethod
  def get_default(
    cls, m: int, d: int, f: int, r: int, d_out: int, *, park_small: bool = True
  ) -> BlockSizes:
    """The measured defaults; ``park_small=False``: at T <= 16 the unparked blocks that were
    the default before session 15 (kept for A/Bs and the S-flush probes)."""
    bm = max(16, planner.next_pow2(m))
    t = TUNED.get(("m<=16" if m <= 16 else "m<=64", "r>=2048" if r >= 2048 else "r<2048"))
    if t is None:
      p = planner.plan_decode(m, d, r, f)
      t = cls(p.block_m, p.block_k, p.block_r, p.split_k, 64, 128, 128)
    max_split = max(1, d // (8 * t.block_k))  # >= 8 pipelined K steps per CTA
    n_rb = planner.cdiv(r, t.block_r)
    split = max(1, min(max_split, planner.cdiv(2 * planner.H200.num_sms, n_rb)))
    if bm <= 16 and n_rb * split < planner.H200.num_sms:
      # stage A in one wave that leaves SMs idle (one CTA an SM at T <= 16): split D finer,
      # to >= 2 K steps a CTA, so that it fills them. Same weights, T = 1-16: 1.0-1.7 us
      # less on Llama-3.2-1B (40 -> 110 CTAs), 0.2-2.3 on Llama-3-8B r=1024 (64 -> 128),
      # 2.1-2.2 on Qwen2.5-7B (112 -> 128), 0.0-2.0 on Gemma-7B (78 -> 130), each with four
      # chunks (below). Where stage A already takes two waves (8B r=2560, 70B), fewer,
      # longer splits in one wave were 3-5 us slower: stage B starts on the first wave's
      # rank chunks (results/gpu_mlp_decode_trace_splits_h200.json)
      split = max(split, min(planner.H200.num_sms // n_rb, d // (2 * t.block_k)))
    a_chunks, one_wave = t.a_chunks, False
    if bm <= 16:
      # stage A in one wave completes every chunk of Pg/Pu at about the same time, so stage B
      # gains nothing from consuming them chunk by chunk and pays a pipeline refill per
      # chunk: one chunk, same weights, 0.0-5.1 us less at T = 1-16 (1B T=4/16 -3.2/-3.6,
      # 8B r=1024 -1.4/-0.7, Qwen2.5-7B -0.35/0.0, Gemma-7B -5.1/-4.9; two chunks -2.5 at
      # the 1B T=1). Where stage A takes two waves the first wave's chunks let stage B start
      # early (Phi-3-medium: one chunk +3.4), but two chunks beat four: Phi-3-medium
      # -3.9/-4.1 at T=1, -2.3 at T=16, 8B r=2560 -0.3..-1.3 at T=1-16, Yi-34B -0.5/-0.6,
      # Llama-3-70B and Qwen2.5-32B +0.1..+0.6 of 198-208 us (0.3 %); three chunks no faster
      # than two (results/gpu_mlp_decode_trace_splits_h200.json, session 33)
      one_wave = n_rb * stage_a_splits(d, split, t.block_k)[1] <= planner.H200.num_sms
      a_chunks = 1 if one_wave else 2
    warps = t.num_warps if bm <= 32 else 8  # [bm, block_f] x2 f32 accumulators per CTA
    block_f, stages = t.block_f, t.num_stages
    block_rd, sms = t.block_rd, planner.H200.num_sms
    slices = planner.cdiv(f, 128)  # of 128 columns: the stage-B / stage-H rules below
    if bm <= 16 and slices >= 3 * sms // 4:
      # fewer, longer stage-B slices while >= 3/4 of the SMs still get one: 4-18 % faster
      # at D_ff=14336 (gpu_mlp_decode_variants_h200.json); 3 stages fit the wider tiles
      block_f, stages = 128, 3
      if sms < slices <= 2 * sms:
        # more slices than SMs: 128-column U_d chunks and 4 stages take 108 KB, so two
        # CTAs share an SM and every slice is resident at once. 5-15 % faster on five of
        # six such shapes (D_ff 17920-28672), 1-3 % either way on the sixth; 1-12 % slower
        # at D_ff=14336's 112 slices (results/gpu_mlp_decode_slices_h200.json)
        block_rd, stages = 128, 4
    block_k, park = t.block_k, bm > 16
    if park_small and bm <= 16 and (m > 1 or block_f == 128):
      # h parked at T <= 16 too, with 5 pipeline stages: 147 KB of shared memory (139 KB at
      # 64-column slices), so one CTA an SM and the stage-B slices spread over every SM
      # (3-4 stages, 74-110 KB, let 2-3 share one, which was why parking had measured 2-9 %
      # slower here). Against the unparked blocks, 2-16 tokens: 7-12 % faster on Llama-3-8B
      # r=2560 (75.2-78.1 us, 84-88 % of the roofline), 8-9 % on -70B at T=16, 2-7 % on
      # Qwen2.5-7B, 5-7 % on 3.2-1B and 8B r=1024 at T=16; one token: 5 % on 8B r=2560,
      # 1 % on r=1024 (results/gpu_mlp_decode_park_deep_h200.json; 6 stages within 1 % of
      # 5). At one token the 1B's wider slices stay unparked (2-3 % slower parked); where
      # the slices outnumber the SMs parking gains there too with the splits below
      park, stages = True, 5
    elif park:
      # from 17 tokens stage B's partials of S (one [T, r_d] f32 add per slice) cost more
      # than parking h: 1.2-2.1x faster at T=32..128, with 64-row K steps and 4 stages where
      # they fit (4 x ([128, 64] P + [64, 128] V tiles) would need 256 KB at T=128);
      # results/gpu_mlp_decode_park_{h,tune,stages}_h200.json
      block_f, block_k, stages = 128, 64, 4 if bm <= 64 else 3
    h_per_sm = 1
    if park and slices > sms and m <= 64:
      # where D_ff has more 128-wide slices than SMs, about four stage-H tiles an SM: shorter
      # tiles, each ready as soon as its fewer slices are.
      # Against one, at 1-16 tokens (1: parked against unparked): Qwen2.5-7B 6-8 %, Phi-3-
      # medium 8-14 %, Yi-34B 6-9 %, Gemma-7B 3-6 %, Qwen2.5-32B 1-10 % faster, Llama-3-70B
      # 1-2 % (also at 32 and 64 tokens); 6x within 2 % of 4x, 8x slower. Where the slices
      # fit the SMs (8B, 1B) more splits measured 0-5 % slower
      # (results/gpu_mlp_decode_h_splits{,_more}_h200.json)
      h_per_sm = 4
    block_h = t.block_h
    if 16 < bm <= 64 and slices >= 3 * sms // 2:  # (h is parked from 17 tokens)
      # 17-64 tokens where the slices are >= 1.5x the SMs: Pg/Pu in two chunks, 256-column
      # stage-H tiles, and 5 stages at 32 rows (164 KB, one CTA an SM as before) or about
      # one stage-H tile an SM at 64. Same run, distinct weights, T=32 / 64: Llama-3-70B
      # r=3840 222.6 -> 214.5 / 234.1 -> 227.4 us (XLA 220.9 / 231.2), r=3824 227.9 -> 221.8
      # / 242.9 -> 235.6, Qwen2.5-32B 167.6 -> 162.8 / 179.6 -> 176.8 (XLA 161.7 / 178.2);
      # each part alone gained less (results/gpu_mlp_decode_70b_wide{,_confirm}_h200.json,
      # session 46). Measured at 216 and 224 slices only: not applied to fewer (Qwen2.5-7B's
      # 148, Gemma-7B's 192)
      a_chunks, block_h = 2, 256
      if bm <= 32:
        stages = 5
      else:
        h_per_sm = 1
    # p16: stage B reads Pg, Pu in bf16, 1-3 % faster on Llama-3-8B r=2560 and 3.2-1B
    # (results/gpu_decode_p16_h200.json); at 8B r=2560 T=1 still 2.1 us faster (session 33).
    # But where stage A runs in one wave at T <= 16 its tail (each column block's last tile
    # rounding Pg/Pu, then signalling) held stage B back by ~1 us, and reading f32 Pg/Pu
    # there was faster, same weights, two runs: 1B T=1/4/16 -1.1/-1.6, -0.3/-0.7,
    # -0.7/-0.9 us, 8B r=1024 T=1 +0.8/-0.2, T=16 -0.6/-0.8, Qwen2.5-7B T=1 -0.3/-0.4,
    # T=16 -0.3, Gemma-7B T=1 -1.0 (results/gpu_mlp_decode_trace_splits_h200.json)
    p16 = not one_wave
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


# Tuned on the H200 (benchmarks/gpu_lowrank.py); shape class -> blocks.
TUNED: dict[tuple[str, str], BlockSizes] = {
  ("m<=16", "r>=2048"): BlockSizes(16, 64, 128, 8, 64, 256, 128, 64, 4, 4, 4, 4),
  ("m<=16", "r<2048"): BlockSizes(16, 64, 128, 8, 64, 256, 128, 64, 4, 4, 4, 4),
}

MAX_M = MLP_DECODE_MAX_M  # beyond this the prefill kernel serves
COMPOSE_MIN_M = MLP_COMPOSE_MIN_M  # from here: X·U·V decode calls (module docstring)
C_RESIDENT_MAX = 128 * 128  # V_d elements a stage-C CTA may hold with c_resident (64 regs a
# thread at 4 warps)
PERSISTENT_MAX_M = 64  # the persistent schedule serves up to here (f32 tiles in registers)


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
  M,  # rows (runtime: one compile serves every M <= BLOCK_M)
  clear_off,
  clear_n,  # the scratch chain (launch.py): the half of scratch_ptr this call
  # zeroes [clear_n floats]; WORK_OFF: the half it works in
  scratch_ptr,  # f32, zeroed before the launch: Pg [M, R], Pu [M, R], S [M, RD],
  # output accumulator [M, DO], then (i32) A_CHUNKS stage-A counters,
  # the counter stage C waits on (stage-B slices or, PARK_H, stage-H
  # tiles), ceil(DO/BLOCK_N) stage-C semaphores, with P16 one stage-A
  # counter per column block of Pg/Pu, with PARK_H one per stage-H split
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
  PREFETCH: tl.constexpr = 0,
  PREFETCH_H: tl.constexpr = 0,  # BlockSizes.prefetch{,_h,_c}
  PREFETCH_C: tl.constexpr = 0,
  C_RESIDENT: tl.constexpr = 0,  # BlockSizes.c_resident; its chunk padded to RD_PER_P2 rows
  RD_PER_P2: tl.constexpr = 16,
  WORK_OFF: tl.constexpr = 0,  # the scratch chain's offset of this call's half (launch.py)
  PDL: tl.constexpr = 0,  # launched as a programmatic dependent (launch.py, join_chain)
  TRACE: tl.constexpr = 0,  # timing only (output right): each CTA stamps its entry, first
  # and last wait ends, work end and exit into o_in_ptr as int64
  # [grid, 8] (_common.stamp; benchmarks/mlp_trace.py)
):
  pid = tl.program_id(0)
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
  n_cb = (RD + BLOCK_H - 1) // BLOCK_H
  n_h = 0  # stage-H tiles (stage C waits for them all)
  if PARK_H:
    n_h = H_SPLITS * n_cb
  n_h_ctas = 0 if H_INLINE else n_h
  offs_m = tl.arange(0, BLOCK_M)
  m_mask = offs_m < M
  if pid < n_a:
    # ---- stage A: split-K X·Ug and X·Uu, X loaded once per K tile
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


def launch_plan(m, d, r, f, rd, d_out, *, gated, act, bias_mask, bs: BlockSizes) -> dict:
  planner.check_prefetch_rows(bs, "prefetch", "prefetch_h", "prefetch_c")
  for rows, width, name in (
    (bs.prefetch, bs.block_f, "block_f"),
    (bs.prefetch_h, bs.block_h, "block_h"),
    (bs.prefetch_c, bs.block_n, "block_n"),
  ):
    if rows and width < 64:  # prefetch_l2 asks for one address per 64 columns
      raise ValueError(f"{bs}: an L2 prefetch needs tiles of >= 64 columns ({name}={width})")
  cols_f = bs.cols_f or bs.block_f
  if not 0 < cols_f <= bs.block_f:
    raise ValueError(f"{bs.cols_f=} must be in [1, {bs.block_f=}] (0: block_f)")
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
  if bs.c_resident and rd_per_p2 * bs.block_n > C_RESIDENT_MAX:
    raise ValueError(
      f"{bs}: c_resident holds a V_d chunk of {rd_per_p2} x {bs.block_n} "
      f"elements in registers; at most {C_RESIDENT_MAX} (more c_chunks or a "
      "narrower block_n)"
    )
  h_splits, f_per, n_h = 1, cols_f, 0
  if bs.h_inline and not bs.park_h:
    raise ValueError("h_inline=True runs stage H inside stage B: it needs park_h=True")
  if bs.park_h:
    n_cb = planner.cdiv(rd, bs.block_h)
    want = bs.h_splits or bs.h_per_sm * max(1, planner.H200.num_sms // n_cb)
    step = math.lcm(cols_f, bs.block_kr)  # whole stage-B slices, whole K steps
    f_per = planner.part_len(f, want, step)
    if bs.h_inline and not bs.h_splits:  # a split's slices share its n_cb tiles, one each
      f_per = planner.round_up(n_cb * cols_f, step)
    h_splits = planner.cdiv(f, f_per)
    n_h = h_splits * n_cb
    if bs.h_inline and f_per // cols_f > planner.H200.num_sms:
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
    H_INLINE=bs.h_inline,
    PREFETCH=bs.prefetch,
    PREFETCH_H=bs.prefetch_h,
    PREFETCH_C=bs.prefetch_c,
    C_RESIDENT=int(bs.c_resident),
    RD_PER_P2=rd_per_p2 if bs.c_resident else 16,  # read by c_resident alone
    TRACE=0,
  )  # jax-triton passes no constexpr default (a missing one is None)
  scratch = (
    m * (2 * r + rd + d_out)
    + a_chunks
    + 1
    + n_nb
    + (n_rb if bs.p16 else 0)
    + (h_splits if bs.park_h else 0)
  )
  p16 = (2 * m * r if bs.p16 else 0) + (m * f if bs.park_h else 0)
  grid = n_a + n_b + (0 if bs.h_inline else n_h) + n_nb * c_chunks
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


def unpack_mlp_args(x, up, down, gate, act):
  """Validates the MLP kernels' arguments (shared by mlp_decode and mlp_prefill).

  Returns (x2 [M, D], lead dims, (d, r, f, rd, d_out), bias_mask, ops) where ``ops`` are the
  ten kernel operands x2, ug, vg, bg, uu, vu, bu, ud, vd, bd (an absent bias is replaced by
  its v factor, which the kernel never reads).
  """
  if act not in ACT_CODES:
    raise ValueError(f"{act=} is not supported; expected one of {sorted(ACT_CODES)}")
  gated = gate is not None
  projs = ((gate,) if gated else ()) + (up, down)
  for p in projs:
    if not isinstance(p, (tuple, list)) or len(p) not in (2, 3):
      raise ValueError("each projection must be (u, v) or (u, v, bias)")
  uu, vu = up[:2]
  ud, vd = down[:2]
  d, r = uu.shape
  f = vu.shape[1]
  rd, d_out = vd.shape
  if x.shape[-1] != d or vu.shape[0] != r or ud.shape != (f, rd):
    raise ValueError(
      f"{x.shape=}, up {uu.shape}x{vu.shape}, down {ud.shape}x{vd.shape}: "
      "expected x [..., D], up [D, r]x[r, F], down [F, r_d]x[r_d, D_out]"
    )
  if gated and (gate[0].shape != uu.shape or gate[1].shape != vu.shape):
    raise ValueError(
      f"gate factors {gate[0].shape}x{gate[1].shape} must match up's "
      f"{uu.shape}x{vu.shape} (one pass computes both)"
    )
  lead = x.shape[:-1]
  x2 = x.reshape(-1, d)
  bias_mask = tuple(len(p) == 3 for p in projs)
  ug, vg, bg = (tuple(gate) + (None,))[:3] if gated else (uu, vu, None)
  bu = up[2] if len(up) == 3 else None
  bd = down[2] if len(down) == 3 else None
  ops = (
    x2,
    ug,
    vg,
    bg if bg is not None else vg,
    uu,
    vu,
    bu if bu is not None else vu,
    ud,
    vd,
    bd if bd is not None else vd,
  )
  return x2, lead, (d, r, f, rd, d_out), bias_mask, ops


def _composed(x2, up, down, gate, act, out_dtype, out, group=True):
  """The MLP as X·U·V decode calls and XLA's activation fusion (``compose=True``):
  act(X·Ug·Vg + bg) ⊙ (X·Uu·Vu + bu) in f32 from the calls' outputs in the factors' dtype,
  rounded once to it, then ·Ud·Vd + bd (into ``out``, if given). ``group``: X·Ug and X·Uu in
  one grouped launch (``xuv_decode_group(pv="xla")``; on these tiles if a GroupDecodePlan),
  else one call each."""
  from lrjax.custom_calls.triton.xuv_decode import xuv_decode, xuv_decode_group
  from lrjax.lowering.primitives import ACTIVATIONS

  def xuv(a, p, odt, o=None):
    return xuv_decode(a, p[0], p[1], p[2] if len(p) == 3 else None, out_dtype=odt, out=o)

  f32, fn, dt = jnp.float32, ACTIVATIONS[act], up[1].dtype
  if gate is None:
    h = fn(xuv(x2, up, dt).astype(f32))
  else:
    plan = group if isinstance(group, planner.GroupDecodePlan) else None
    yg, yu = (
      xuv_decode_group(x2, [gate, up], out_dtype=dt, pv="xla", plan=plan)
      if group
      else (xuv(x2, gate, dt), xuv(x2, up, dt))
    )
    h = fn(yg.astype(f32)) * yu.astype(f32)
  return xuv(h.astype(down[0].dtype), down, out_dtype, out)


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
  xla_zeroing: bool | None = None,
  persistent: bool | planner.PersistentMlpPlan = False,
  compose: bool | None = None,
  _phases: int = 7,
  _s_flush: str = "atomic",
  _compose_group: bool | planner.GroupDecodePlan = True,
):
  """Low-rank MLP for few tokens; ``up``/``down``/``gate`` are (u, v) or (u, v, bias).

  ``compose``: X·U·V decode calls and an XLA fusion instead of the fused kernel
  (module docstring); default: from COMPOSE_MIN_M rows, unless an argument of the fused
  kernel (``block_sizes``, ``persistent``, ``xla_zeroing``, ``_phases``, ``_s_flush``) is given.
  ``out`` [M, D_out]: optional buffer the kernel writes into (aliased; tests poison it).
  ``xla_zeroing``: zero the scratch with an XLA op aliased into the call instead of
  jax-triton's memset inside the custom call (default as in xuv_decode).
  ``persistent``: one CTA per SM runs its share of each phase
  (``planner.plan_mlp_decode_persistent`` unless a plan is given).
  ``_phases``: benchmarking the persistent schedule only (bits 1, 2, 4 stream phases A, B,
  C; the output is wrong unless all three run).
  ``_s_flush``: benchmarking the tiled schedule only: "store" stores stage B's partial of S
  instead of adding it, "none" masks those stores off by a data test that never holds (the
  dot and the instructions stay, no byte moves); the output is then wrong.
  ``_compose_group``: benchmarking the composed schedule only: False runs X·Ug and X·Uu as
  two calls instead of one grouped launch, a ``planner.GroupDecodePlan`` that launch on its
  tiles.
  """
  gated = gate is not None
  x2, lead, (d, r, f, rd, d_out), bias_mask, ops = unpack_mlp_args(x, up, down, gate, act)
  m = x2.shape[0]
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  fused_asked = (
    block_sizes is not None
    or persistent is not False
    or _phases != 7
    or _s_flush != "atomic"
    or xla_zeroing is not None
  )
  if compose is None:
    compose = m >= COMPOSE_MIN_M and not fused_asked
  if compose:
    if fused_asked:
      raise ValueError(
        "compose=True runs X·U·V decode calls, not the fused kernel: "
        "block_sizes=, persistent=, xla_zeroing=, _phases= and _s_flush= "
        "do not apply"
      )
    if m > MAX_M:
      raise ValueError(f"{m} rows: the decode MLP serves M <= {MAX_M}")
    check_out(out, (m, d_out), out_dtype)
    return _composed(x2, up, down, gate, act, out_dtype, out, _compose_group).reshape(*lead, d_out)
  if persistent:
    if block_sizes is not None:
      raise ValueError(
        "block_sizes= applies to the tiled schedule (persistent=False); "
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
    if _phases not in range(1, 8):
      raise ValueError(f"{_phases=} must be in 1..7")
    if _s_flush != "atomic":
      raise ValueError("_s_flush= applies to the tiled schedule only")
    plan = persistent_launch_plan(
      m, d, r, f, rd, d_out, gated=gated, act=act, bias_mask=bias_mask, p=p, phases=_phases
    )
    kernel, warps, stages = _mlp_decode_persistent_kernel, p.warps, p.stages
  else:
    if _phases != 7:
      raise ValueError("_phases= applies to the persistent schedule only")
    bs = block_sizes or BlockSizes.get_default(m, d, f, r, d_out)
    if bs.block_m < m:
      raise ValueError(f"{bs.block_m=} must cover the {m} rows; use mlp_prefill for large M")
    plan = launch_plan(m, d, r, f, rd, d_out, gated=gated, act=act, bias_mask=bias_mask, bs=bs)
    if _s_flush not in S_FLUSH_CODES:
      raise ValueError(f"{_s_flush=} must be one of {sorted(S_FLUSH_CODES)}")
    if _s_flush != "atomic":
      if bs.park_h:
        raise ValueError(
          "_s_flush= times stage B's own projection into S; with "
          "park_h=True stage H projects h (pass park_h=False blocks)"
        )
      plan["meta"]["S_FLUSH"] = S_FLUSH_CODES[_s_flush]
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


def mlp_decode_reference(x, up, down, gate=None, *, act="silu", out_dtype=None):
  """f32-accumulating low-rank MLP with the kernel's roundings (X·U and h to the factor dtype)."""
  from lrjax.lowering.primitives import ACTIVATIONS

  out_dtype = jnp.dtype(out_dtype or x.dtype)
  f32 = jnp.float32

  def xuv(a, p):
    t = jnp.matmul(a, p[0], preferred_element_type=f32).astype(p[1].dtype)
    y = jnp.matmul(t, p[1], preferred_element_type=f32)
    return y + p[2].astype(f32) if len(p) == 3 else y

  fn = ACTIVATIONS[act]
  h = fn(xuv(x, gate)) * xuv(x, up) if gate is not None else fn(xuv(x, up))
  return xuv(h.astype(down[0].dtype), down).astype(out_dtype)
