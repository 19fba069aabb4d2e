"""Decode X·U·V (small M): inter-CTA split-K on X·U, then split-r ·V, in one launch (from 33
rows, where V is small, ·V in a second launch: below).

Two schedules of the same dataflow; ``xuv_decode`` picks the persistent one for
M <= PERSISTENT_MAX_M (measured faster there, gpu_notes.md "Session 3" and "Session 6").

**Persistent** (``_xuv_decode_persistent_kernel``): one CTA per SM. Phase 1 splits X·U
into tiles of K_PER rows x COLS_R columns of U (K split across CTAs: inter-CTA split-K),
phase 2 splits ·V into tiles of whole r-chunks x COLS_N columns. Column widths are
multiples of 16 (whole 32-byte sectors), not powers of two, so each phase has about one
tile per SM (``planner.plan_decode_persistent``) and no SM idles while others stream a
second tile. A phase-1 tile adds its [M, COLS_R] partial into an f32 accumulator P with
relaxed atomics and bumps its r-chunk's counter (release); a phase-2 tile waits for its
chunk (acquire). Before waiting, a CTA asks L2 to prefetch the first rows of its V tile,
so its pipeline restarts from L2 when P completes. With one r-chunk the output is stored
directly; with several, the last chunk to arrive for a column block (an acq_rel
semaphore, the split-K paper's single-launch reduction) adds the bias and writes it.
All CTAs are resident at once (grid = SMs), so a waiting CTA never blocks a producer.
Phase-2 tiles whose rows would start mid-line give way to whole-line tiles within
``planner.LINE_ALIGN_TOL`` (N = 14336: 112 tiles of 128 columns, not 128 of 112), and where
that leaves CTAs without a phase-2 tile, they zero the scratch chain's other half
(``CLEAR_MIN_IDLE``) so the CTAs that end the call skip it.
``PersistentDecodePlan.p16`` makes the last phase-1 tile of each column block round it once
to V's dtype for phase 2 (as the SwiGLU kernel's default does); here it measured -3...+5 %
against the f32 reads, so it is off by default (gpu_notes.md, session 9).

**V-resident** (``PersistentDecodePlan.v_resident``, ``planner._v_resident_plan``): for
ranks up to 256 and M <= 32 every tile gets its own CTA, phase-1 tiles first. A phase-2 CTA
loads its whole [r, COLS_N] V tile into registers at entry, then waits for P, so after the
wait only P's L2 read, one dot and the store remain (``_pv_resident_tile``). Where V is small
that wait is the call's time: 2048->256->512 went from 4.5-4.7 to 3.8-4.1 µs at M = 1...16
(results/gpu_xuv_decode_v_resident_h200.json). The phase-1 CTAs, done long before, zero the
scratch chain's other half: 0.08-0.21 µs less a call at 4096->152->4096 (gpu_notes.md,
session 25).

**Stream-K phase 1** (``PersistentDecodePlan.stream_k``, ``_xu_stream``; planner.STREAM_K_*):
U's 128-column blocks x 64-row K steps split evenly over every CTA in one pipelined loop,
each run of a column block adding its partial into P; every CTA signals once and phase 2
waits for all of them. Where K is short, 128-column blocks (whole 128-byte lines) on all SMs
end phase 1 0.5 µs earlier than the tiled plan (results/gpu_xuv_decode_stream_k_h200.json).

**From PV_XLA_MIN_M = 64 rows, where V is too large for the ·V launch below,** the persistent
kernel stops after phase 1 (``pv="xla"``): P's f32 sums stay in the call's half of the scratch
and XLA rounds them as it slices them out (rounding in the kernel, ``p16``, made a tile of each
column block wait for the block's atomics and read them back: sessions 38-39), and phase 1
sends none of the per-tile signals that phase 2 would wait on; then XLA's GEMM applies V, as in
XLA's own lowering. There ·V is a [64-128, r] x [r, N] GEMM near the H200's ridge point, where
one CTA per SM streaming V with 128-row tiles measured 0.69-0.75x cuBLAS, while the skinny X·U
is where XLA is weak (a split-K GEMM and a separate reduction). Phase 1 then takes
``planner.plan_decode_phase1``'s tiles: the fewest split-K partials (f32 atomics into P, M x r
x 4 bytes each) that still give every CTA a tile, in 64-column tiles where its L2 model has
half the partials outweigh reading X twice as often (session 34). Measured
(results/gpu_xuv_decode_pv_h200.json, then the sweep's run 12): M=128 0.96-1.03x XLA where the
fused kernel was 0.69-0.74x; M=64 0.94-1.01x (fused 0.81-1.00x). At M=16 and 32 the split,
timed only on the fused kernel's phase-1 tiles, was 2-10 % slower than the fused kernel. At
exactly 64 rows the fused kernel kept N <= 4096 until phase 1 alone lost its signals and its
in-kernel rounding (session 39): then phase 1 + XLA took 0.0-0.5 us less on all four such
shapes (session 40, results/gpu_xuv_decode_p_handover_h200.json). From 33 rows (the same 64-row
block) phase 1 alone runs where V is a quarter of U or less and K >= 4096 (session 35:
8192->544->1024, 4096->512->1024). Not up to 64 rows where r >= 2048 is not a multiple of 16
(PV_XLA_PAD_*): there XLA's split-K GEMM pads V every call, and the fused kernel keeps it.

**The ·V launch** (``pv="launch"``, ``_pv_launch_kernel``; ``default_pv``: from 33 rows where
V has at most PV_LAUNCH_MAX_V elements, and from 17 where V is small beside U): phase 1 alone
as above, then a second lrjax launch, one [block_m, 32] output tile a CTA
(``planner.plan_pv_launch``), reads P's f32 sums where phase 1 left them, rounds them to V's
dtype as it loads them and applies V over all of r. On a scratch chain P is a slice of the
chain's buffer; the launch reads it there (``launch._read_in_place``), so XLA runs no kernel
between the two (XLA's own GEMM needed a rounding fusion before it and, at these shapes, a
split-K reduction after it). It goes to XLA's Triton call, which may start it as a
programmatic dependent of phase 1. Where V is small that made the trailing M = 64 / 128 points
1.07-1.18x XLA (the f32 hand-over to XLA's GEMM: 0.85-0.995x); from V = 10 MB XLA's GEMM is
faster (results/gpu_xuv_decode_pv_launch_h200.json).

**Tiled** (``_xuv_decode_kernel``): one CTA per tile. Stage-1 CTAs (split_k x
ceil(r/block_r), block_r = 256: 512-byte row segments) come first in the grid, r-block-
major; stage-2 CTAs (chunk-major) start as soon as their chunk of P is complete, so V
streams while the rest of U does. Forward progress relies on CUDA dispatching lower block
indices first: a stage-2 CTA only waits on stage-1 CTAs with lower indices, the
assumption of decoupled look-back scans.

Why one launch: at M <= 16 the op is 10-50 µs of HBM streaming. Two launches leave the
HBM idle during the dependent-launch gap and the stage-1 tail. The accumulators, counters
and semaphores live in one scratch buffer, zeroed by an XLA op aliased into the call, or by
the call before it on a scratch chain (launch.py), or, with ``out=``, by jax-triton's
pre-launch memset; the XLA-side zeroing measured 3-10 µs less per call than the memset.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from lrjax.custom_calls.triton import launch, planner
from lrjax.custom_calls.triton.lowering import GROUP_MAX_M, XUV_DECODE_MAX_M
from lrjax.custom_calls.triton._common import (
  check_out,
  join_chain,
  k_masks,
  last_arrival,
  leave_chain,
  mm_acc,
  num_sms,
  prefetch_l2,
  round_once,
  signal,
  splitr_out_tile,
  stamp,
  store_out,
  unpack_xuv_args,
  wait_at_least,
)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  block_m: int  # token rows, padded (>= 16 for the mma)
  block_k: int  # stage-1 reduction step
  block_r: int  # stage-1 columns of U per CTA
  split_k: int  # stage-1 CTAs per column block (inter-CTA split-K)
  block_n: int  # stage-2 columns of V per CTA
  block_kv: int  # stage-2 reduction step over r
  r_chunks: int  # stage-2 split of r (each chunk a whole number of stage-1 column blocks)
  num_warps: int = 4
  num_stages: int = 4

  @classmethod
  def get_default(cls, m: int, k: int, r: int, n: int) -> BlockSizes:
    key = (_m_class(m), _r_class(r))
    if key in TUNED:
      t = TUNED[key]
    else:
      p = planner.plan_decode(m, k, r, n)
      t = cls(
        p.block_m, p.block_k, p.block_r, p.split_k, p.block_n, p.block_kv, 4, p.warps, p.stages
      )
    # >= 8 pipelined K steps per CTA; narrower column blocks when that leaves SMs idle
    max_split = max(1, k // (8 * t.block_k))
    block_r = t.block_r
    if planner.cdiv(r, block_r) * min(t.split_k, max_split) < planner.H200.num_sms:
      block_r = max(64, block_r // 2)
    n_rb = planner.cdiv(r, block_r)
    split = max(1, min(max_split, planner.cdiv(2 * planner.H200.num_sms, n_rb), 2 * t.split_k))
    chunks = max(1, min(t.r_chunks, n_rb))
    return dataclasses.replace(
      t, block_m=max(16, planner.next_pow2(m)), block_r=block_r, split_k=split, r_chunks=chunks
    )


def _m_class(m: int) -> str:
  return "m<=16" if m <= 16 else ("m<=64" if m <= 64 else "m<=128")


def _r_class(r: int) -> str:
  return "r>=2048" if r >= 2048 else "r<2048"


# Tuned on the H200 (benchmarks/gpu_lowrank.py, gpu_notes.md); shape class -> blocks.
# Other shapes fall back to planner.plan_decode.
TUNED: dict[tuple[str, str], BlockSizes] = {
  ("m<=16", "r>=2048"): BlockSizes(16, 64, 256, 16, 256, 64, 4, 4, 4),
  ("m<=16", "r<2048"): BlockSizes(16, 64, 128, 16, 256, 64, 4, 4, 4),
  ("m<=64", "r>=2048"): BlockSizes(64, 64, 256, 16, 256, 64, 4, 4, 3),
  ("m<=64", "r<2048"): BlockSizes(64, 64, 128, 16, 256, 64, 4, 4, 3),
}

MAX_M = XUV_DECODE_MAX_M  # beyond this the prefill kernel serves
# the persistent schedule is the default up to here: measured faster than the tiled one at
# M <= 64 (gpu_notes.md, session 3) and than the prefill kernel at M=128 (session 6)
PERSISTENT_MAX_M = 128
# From this many rows the persistent kernel stops at P and XLA's GEMM applies V (pv="xla"):
# against the fused kernel it took 23-30 % less time at M=128 (results/gpu_xuv_decode_pv_h200.json,
# run 2) and, since phase 1 alone sends no signals and hands XLA f32 P (session 39), 0.0-0.5 us
# less at M=64 on the four shapes with N <= 4096 where the fused kernel had stayed (session 40,
# same weights, results/gpu_xuv_decode_p_handover_h200.json); at M=16, 32 see the docstring
PV_XLA_MIN_M = 64
# 33-63 rows (the same 64-row block and tiles) take phase 1 alone where V is small beside U
# (N <= K / PV_XLA_K_OVER_N) and K >= PV_XLA_MIN_K: at 64 rows, before session 39, phase 1 on
# its 6-stage plan, then XLA's GEMM, took 1.8 and 1.0 us less than the fused kernel on
# 8192->544->1024 and 4096->512->1024 (session 35, results/gpu_xuv_decode_phase1_deep_h200.json);
# at 48 / 40 rows 1.02-1.06x / 1.005x XLA, the fused kernel 0.98-1.00x (session 36,
# results/gpu_xuv_decode_33_63_rows_h200.json)
PV_XLA_K_OVER_N = 4
PV_XLA_MIN_K = 4096
# ... but not up to PV_XLA_PAD_MAX_M rows where r >= PV_XLA_PAD_MIN_R is not a multiple of
# PV_XLA_R_ALIGN: there XLA's split-K ·V GEMM pads V every call (64 x 8192->2456->8192: to 2464
# rows, a 40 MB copy, 25 us of a 61 us call), which a model step pays (each layer's V used once)
# and the sweep's reused weights hid (the pad ran once a layer). Each call on a layer of its
# own (gpu_lowrank.py --distinct-weights, session 45): phase 1 + XLA's GEMM 61.1 us at M=64,
# the fused kernel 39.8, XLA's chain 61.6 (session 37: 63.5 / 39.7 / 61.0). Whether XLA pads is
# its autotuner's choice (results/gpu_xla_pad_survey_h200.json): at 64 rows it padded r = 2456
# and 2440 at both K = 8192 -> N = 8192 and K = 4096 -> N = 14336 (and 2448, 3824 at K = 8192,
# which this rule misses); at 128 rows only at K = 8192, and the fused kernel, 0.67x XLA at
# 128 rows on reused weights, would lose where XLA does not pad; ranks up to 1032 were never
# padded (at r = 1000 the fused kernel is 0.58-0.69x XLA: session 37)
PV_XLA_R_ALIGN = 16
PV_XLA_PAD_MIN_R = 2048
PV_XLA_PAD_MAX_M = 64
# From PV_LAUNCH_MIN_M rows, where V has at most PV_LAUNCH_MAX_V elements (4 MB in bf16), ·V
# runs in a launch of its own (pv="launch", _pv_launch_kernel) instead of XLA's GEMM or phase 2:
# it reads phase 1's f32 P where phase 1 left it (no rounding fusion, no split-K reduction).
# Same weights: 1.07-1.18x XLA at the five M=64/128 points where the default trailed XLA
# (0.85-0.995x), 1.05-1.26x at seven more of 32-128 rows; at V = 10 MB (4096->1216->4096)
# 0.92-0.96x and at 40 MB 0.56x, where XLA's GEMM stays (session 41,
# results/gpu_xuv_decode_pv_launch_h200.json; the sweep's run 66: 1.03-1.34x XLA at the 12
# points it now serves)
PV_LAUNCH_MIN_M = 33
PV_LAUNCH_MAX_V = 2 << 20
# and from PV_LAUNCH_SMALL_V_MIN_M rows where V is small beside U (N <= K / PV_XLA_K_OVER_N,
# K >= PV_XLA_MIN_K): at 32 rows 0.42 us less than the fused kernel at 8192->544->1024 and a
# tie at 4096->512->1024; at 16 rows 0.45 us more (session 41)
PV_LAUNCH_SMALL_V_MIN_M = 17


@triton.jit
def _xu_tile(
  rb,
  k_start,  # column block of U, first row of K
  x_ptr,
  u_ptr,
  p_ptr,
  flag_ptr,
  offs_m,
  m_mask,
  K: tl.constexpr,
  R: tl.constexpr,
  K_PER: tl.constexpr,
  RB_PER_CHUNK: tl.constexpr,
  BLOCK_K: tl.constexpr,
  BLOCK_R: tl.constexpr,
  COLS_R: tl.constexpr,
  EVEN_K: tl.constexpr,
  STREAM: tl.constexpr,
  P16: tl.constexpr,
  p16_ptr,
  rb_cnt_ptr,
  SPLIT_K: tl.constexpr,
  P_STORE: tl.constexpr = False,
  SIGNAL: tl.constexpr = True,
):
  """One split-K tile of P = X·U: f32 atomics into P, then its r-chunk's counter (release).
  P16: the last of the column block's SPLIT_K tiles (``last_arrival`` on its counter)
  rounds the block once into p16 (V's dtype) and alone signals the chunk. SIGNAL=False (phase
  1 alone: no phase-2 tile waits on the chunk) leaves the counter alone; each release would
  make the CTA wait for its atomics (0.1-1.1 us a call, gpu_xuv_decode_signals_h200.json).
  STREAM=False skips the streaming, P_STORE stores the partial instead of adding it (timing
  only: the output is then wrong)."""
  offs_r = rb * COLS_R + tl.arange(0, BLOCK_R)
  r_mask = offs_r < R
  if COLS_R < BLOCK_R:
    r_mask = r_mask & (tl.arange(0, BLOCK_R) < COLS_R)
  if STREAM:
    acc = tl.zeros([offs_m.shape[0], BLOCK_R], tl.float32)
    acc = mm_acc(
      acc,
      x_ptr,
      u_ptr,
      offs_m,
      offs_r,
      m_mask,
      r_mask,
      k_start,
      k_start + K_PER,
      K,
      K,
      R,
      BLOCK_K,
      EVEN_K,
      False,
    )
    if P_STORE:
      tl.store(
        p_ptr + offs_m[:, None] * R + offs_r[None, :], acc, mask=m_mask[:, None] & r_mask[None, :]
      )
    else:
      tl.atomic_add(
        p_ptr + offs_m[:, None] * R + offs_r[None, :],
        acc,
        mask=m_mask[:, None] & r_mask[None, :],
        sem="relaxed",
      )
  if P16:
    if last_arrival(rb_cnt_ptr + rb, SPLIT_K):
      round_once(
        p_ptr, p16_ptr, offs_m[:, None] * R + offs_r[None, :], m_mask[:, None] & r_mask[None, :]
      )
      if SIGNAL:
        signal(flag_ptr + rb // RB_PER_CHUNK)
  elif SIGNAL:
    signal(flag_ptr + rb // RB_PER_CHUNK)


@triton.jit
def _pv_tile(
  q,
  n_nb,
  n_rb,
  p_ptr,
  v_ptr,
  b_ptr,
  acc_ptr,
  flag_ptr,
  sem_ptr,
  o_ptr,
  M,
  R: tl.constexpr,
  N: tl.constexpr,
  HAS_BIAS: tl.constexpr,
  SPLIT_K: tl.constexpr,
  R_CHUNKS: tl.constexpr,
  RB_PER_CHUNK: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_N: tl.constexpr,
  BLOCK_KV: tl.constexpr,
  EVEN_R: tl.constexpr,
  COLS_R: tl.constexpr,
  COLS_N: tl.constexpr,
  P16: tl.constexpr,
  trace_ptr,
  TRACE: tl.constexpr,
  SIGNALS: tl.constexpr = 0,
):
  """Tile q of Y = P·V (chunk-major): waits until its r-chunk of P is complete (P16: p_ptr
  is the rounded copy, one signal per column block, not one per split-K tile; SIGNALS > 0:
  one chunk, complete after that many signals). TRACE: ``stamp`` slot 2 when the wait ends
  (timing only)."""
  rc = q // n_nb
  n_rb_c = tl.minimum(n_rb - rc * RB_PER_CHUNK, RB_PER_CHUNK)
  if SIGNALS > 0:
    wait_at_least(flag_ptr, SIGNALS)
  elif P16:
    wait_at_least(flag_ptr + rc, n_rb_c)
  else:
    wait_at_least(flag_ptr + rc, n_rb_c * SPLIT_K)
  stamp(trace_ptr, 2, TRACE)
  splitr_out_tile(
    q % n_nb,
    rc,
    p_ptr,
    v_ptr,
    b_ptr,
    acc_ptr,
    sem_ptr,
    o_ptr,
    M,
    R,
    N,
    RB_PER_CHUNK * COLS_R,
    R_CHUNKS,
    HAS_BIAS,
    BLOCK_M,
    BLOCK_N,
    BLOCK_KV,
    EVEN_R,
    COLS_N,
  )


@triton.jit
def _pv_resident_tile(
  q,
  p_ptr,
  v_ptr,
  b_ptr,
  flag_ptr,
  o_ptr,
  M,
  target,
  R: tl.constexpr,
  N: tl.constexpr,
  HAS_BIAS: tl.constexpr,
  BLOCK_M: tl.constexpr,
  R_P2: tl.constexpr,
  BLOCK_N: tl.constexpr,
  COLS_N: tl.constexpr,
  trace_ptr,
  TRACE: tl.constexpr,
):
  """Tile q of Y = P·V for a small r: the CTA loads its whole [r, COLS_N] V tile into
  registers first, then waits for P, so only P's L2 read is left after the wait (TRACE:
  ``stamp`` slot 2 when the wait ends)."""
  offs_r = tl.arange(0, R_P2)
  offs_n = q * COLS_N + tl.arange(0, BLOCK_N)
  n_mask = (offs_n < N) & (tl.arange(0, BLOCK_N) < COLS_N)
  v = tl.load(
    v_ptr + offs_r[:, None] * N + offs_n[None, :],
    mask=(offs_r < R)[:, None] & n_mask[None, :],
    other=0.0,
  )
  wait_at_least(flag_ptr, target)
  stamp(trace_ptr, 2, TRACE)
  offs_m = tl.arange(0, BLOCK_M)
  m_mask = offs_m < M
  p = tl.load(
    p_ptr + offs_m[:, None] * R + offs_r[None, :],
    mask=m_mask[:, None] & (offs_r < R)[None, :],
    other=0.0,
    cache_modifier=".cg",
  )
  store_out(
    tl.dot(p.to(v.dtype), v),
    b_ptr,
    o_ptr,
    offs_m[:, None] * N + offs_n[None, :],
    m_mask[:, None] & n_mask[None, :],
    offs_n,
    n_mask,
    HAS_BIAS,
  )


@triton.jit
def _xu_stream(
  pid,
  x_ptr,
  u_ptr,
  p_ptr,
  offs_m,
  m_mask,
  K: tl.constexpr,
  R: tl.constexpr,
  BLOCK_K: tl.constexpr,
  COLS_R: tl.constexpr,
  EVEN_K: tl.constexpr,
  PROGRAMS: tl.constexpr,
):
  """Phase 1 of the stream-K schedule: the n_rb x KS steps of P = X·U (step s: K rows
  [k0, k0 + BLOCK_K) of U's column block s // KS, k0 = (s % KS) * BLOCK_K) split evenly
  over the CTAs in one pipelined loop. Each run of one column block ends with an f32 atomic
  add of its partial into P."""
  KS: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
  total = ((R + COLS_R - 1) // COLS_R) * KS
  lo = pid * total // PROGRAMS
  hi = (pid + 1) * total // PROGRAMS
  offs_k = tl.arange(0, BLOCK_K)
  acc = tl.zeros([offs_m.shape[0], COLS_R], tl.float32)
  for s in range(lo, hi):
    offs_r = (s // KS) * COLS_R + tl.arange(0, COLS_R)
    kk = (s % KS) * BLOCK_K + offs_k
    r_mask = offs_r < R
    a_m, b_m = k_masks(m_mask, r_mask, kk, K, EVEN_K)
    a = tl.load(x_ptr + offs_m[:, None] * K + kk[None, :], mask=a_m, other=0.0)
    b = tl.load(u_ptr + kk[:, None] * R + offs_r[None, :], mask=b_m, other=0.0)
    acc = tl.dot(a.to(b.dtype), b, acc)
    if ((s + 1) % KS == 0) | (s == hi - 1):
      tl.atomic_add(
        p_ptr + offs_m[:, None] * R + offs_r[None, :],
        acc,
        mask=m_mask[:, None] & r_mask[None, :],
        sem="relaxed",
      )
      acc = tl.zeros([offs_m.shape[0], COLS_R], tl.float32)


@triton.jit
def _xuv_decode_kernel(
  x_ptr,  # [M, K] activations
  u_ptr,  # [K, R] first factor
  v_ptr,  # [R, N] second factor
  b_ptr,  # [N] bias (read only if HAS_BIAS)
  o_in_ptr,  # [M, N] caller's output buffer aliased to o_ptr, or the zeroed scratch aliased
  # to scratch_ptr (xla_zeroing), else x; never read
  M,  # rows (runtime: one compile serves every M <= BLOCK_M)
  clear_off,
  clear_n,  # the scratch chain (launch.py): the half of scratch_ptr this call
  # zeroes [clear_n floats]; WORK_OFF: the half it works in
  scratch_ptr,  # [M*R + M*N + R_CHUNKS + n_nb] f32, zeroed by one memset: the split-K
  # accumulator P [M, R], the output accumulator [M, N], then (as i32) the
  # per-r-chunk counters and per-column-block semaphores
  o_ptr,  # [M, N] output
  p16_ptr,  # unused here (the persistent kernel's rounded P)
  K: tl.constexpr,
  R: tl.constexpr,
  N: tl.constexpr,
  HAS_BIAS: tl.constexpr,
  K_PER: tl.constexpr,  # K-chunk per split (multiple of BLOCK_K; the last may be ragged)
  SPLIT_K: tl.constexpr,
  R_CHUNKS: tl.constexpr,
  RB_PER_CHUNK: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_K: tl.constexpr,
  BLOCK_R: tl.constexpr,
  BLOCK_N: tl.constexpr,
  BLOCK_KV: tl.constexpr,
  EVEN_K: tl.constexpr,
  EVEN_R: tl.constexpr,
  STAGES: tl.constexpr = 3,  # timing only: bit 1 streams U (stage 1), bit 2 streams V
  WORK_OFF: tl.constexpr = 0,  # the scratch chain's offset of this call's half (launch.py)
  PDL: tl.constexpr = 0,  # launched as a programmatic dependent (launch.py, join_chain)
):
  pid = tl.program_id(0)
  chain_ptr = scratch_ptr
  scratch_ptr = join_chain(scratch_ptr, WORK_OFF, PDL)
  p_ptr = scratch_ptr
  acc_ptr = scratch_ptr + M * R
  flag_ptr = (scratch_ptr + M * R + M * N).to(tl.pointer_type(tl.int32))
  sem_ptr = flag_ptr + R_CHUNKS
  n_rb = (R + BLOCK_R - 1) // BLOCK_R
  n1 = n_rb * SPLIT_K
  offs_m = tl.arange(0, BLOCK_M)
  m_mask = offs_m < M
  if pid < n1:
    # stage 1: r-block-major, so the first r-chunks of P complete first
    _xu_tile(
      pid // SPLIT_K,
      (pid % SPLIT_K) * K_PER,
      x_ptr,
      u_ptr,
      p_ptr,
      flag_ptr,
      offs_m,
      m_mask,
      K,
      R,
      K_PER,
      RB_PER_CHUNK,
      BLOCK_K,
      BLOCK_R,
      BLOCK_R,
      EVEN_K,
      (STAGES & 1) != 0,
      False,
      p_ptr,
      flag_ptr,
      SPLIT_K,
    )
  elif STAGES & 2:
    # stage 2: chunk-major; starts when its chunk of P is complete
    _pv_tile(
      pid - n1,
      (N + BLOCK_N - 1) // BLOCK_N,
      n_rb,
      p_ptr,
      v_ptr,
      b_ptr,
      acc_ptr,
      flag_ptr,
      sem_ptr,
      o_ptr,
      M,
      R,
      N,
      HAS_BIAS,
      SPLIT_K,
      R_CHUNKS,
      RB_PER_CHUNK,
      BLOCK_M,
      BLOCK_N,
      BLOCK_KV,
      EVEN_R,
      BLOCK_R,
      BLOCK_N,
      False,
      o_ptr,
      False,
    )
  leave_chain(chain_ptr, clear_off, clear_n)


@triton.jit
def _xuv_decode_persistent_kernel(
  x_ptr,
  u_ptr,
  v_ptr,
  b_ptr,  # as in _xuv_decode_kernel
  o_in_ptr,  # aliased buffer (see _xuv_decode_kernel); never read
  M,
  clear_off,
  clear_n,  # as in _xuv_decode_kernel
  scratch_ptr,  # _xuv_decode_kernel's layout, less the [M, N] accumulator at one r-chunk;
  # with P16, then (i32) one split-K counter per column block of P
  o_ptr,
  p16_ptr,  # [M, R] in V's dtype: P rounded once (P16), which phase 2 reads; else unused
  K: tl.constexpr,
  R: tl.constexpr,
  N: tl.constexpr,
  HAS_BIAS: tl.constexpr,
  K_PER: tl.constexpr,  # phase-1 K rows per tile (a multiple of BLOCK_K)
  SPLIT_K: tl.constexpr,
  R_CHUNKS: tl.constexpr,
  RB_PER_CHUNK: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_K: tl.constexpr,
  BLOCK_R: tl.constexpr,
  BLOCK_N: tl.constexpr,
  BLOCK_KV: tl.constexpr,
  EVEN_K: tl.constexpr,
  EVEN_R: tl.constexpr,
  COLS_R: tl.constexpr,  # phase-1 columns per tile (<= BLOCK_R, a multiple of 16)
  COLS_N: tl.constexpr,  # phase-2 columns per tile (<= BLOCK_N, a multiple of 16)
  PROGRAMS: tl.constexpr,  # the grid; all CTAs resident at once
  PREFETCH: tl.constexpr,  # V rows of its first phase-2 tile a CTA prefetches into L2
  P16: tl.constexpr,  # phase 2 reads P rounded once to V's dtype (half the L2 bytes)
  PV: tl.constexpr = True,  # False: phase 1 only, ending with P in p16 (P16) or in P
  WORK_OFF: tl.constexpr = 0,  # as in _xuv_decode_kernel
  PDL: tl.constexpr = 0,  # as in _xuv_decode_kernel
  PROBE: tl.constexpr = 0,  # timing only (wrong output): bit 1 stores the split-K partials
  # instead of adding them, bit 2 runs phase 2 on P's first row
  # (its reads of P and its output stores); bit 4 (output right)
  # stamps each CTA's entry, phase-1 end, wait end, phase-2 end
  # and exit into o_in_ptr as int64 [PROGRAMS, 8] (_common.stamp)
  V_RES: tl.constexpr = 0,  # phase-2 tiles on their own CTAs (pid >= the phase-1 tiles),
  # V in registers before the wait (_pv_resident_tile); one r-chunk
  R_P2: tl.constexpr = 16,  # next_pow2(R), V_RES's register rows
  STREAM_K: tl.constexpr = 0,  # phase 1 split evenly over the CTAs by K steps (_xu_stream);
  # one r-chunk, whose flag counts the CTAs
  CLEAR_FIRST: tl.constexpr = 0,
  CLEAR_COUNT: tl.constexpr = 0,  # the CTAs that zero the
  # scratch chain's other half (leave_chain; 0: all of them)
):
  pid = tl.program_id(0)
  chain_ptr = scratch_ptr
  scratch_ptr = join_chain(scratch_ptr, WORK_OFF, PDL)
  TRACE: tl.constexpr = (PROBE & 4) != 0
  stamp(o_in_ptr, 0, TRACE)
  p_ptr = scratch_ptr
  acc_ptr = scratch_ptr + M * R  # the output accumulator: only with several r-chunks
  if R_CHUNKS > 1:
    flag_ptr = (scratch_ptr + M * R + M * N).to(tl.pointer_type(tl.int32))
  else:
    flag_ptr = (scratch_ptr + M * R).to(tl.pointer_type(tl.int32))
  sem_ptr = flag_ptr + R_CHUNKS
  n_rb = (R + COLS_R - 1) // COLS_R
  n_nb = (N + COLS_N - 1) // COLS_N
  rb_cnt_ptr = sem_ptr + n_nb
  n1 = n_rb * SPLIT_K
  offs_m = tl.arange(0, BLOCK_M)
  m_mask = offs_m < M
  if STREAM_K:  # phase 1 split evenly by K steps; every CTA runs some, then signals once
    _xu_stream(pid, x_ptr, u_ptr, p_ptr, offs_m, m_mask, K, R, BLOCK_K, COLS_R, EVEN_K, PROGRAMS)
    signal(flag_ptr)
  else:
    # phase 1: tiles t = pid, pid + PROGRAMS, ...; r-block-major, so the first r-chunks of P
    # complete first. No waits here, so every phase-1 tile finishes. (V_RES: n1 < PROGRAMS,
    # so a CTA runs one tile or none.)
    for t in range(pid, n1, PROGRAMS):
      _xu_tile(
        t // SPLIT_K,
        (t % SPLIT_K) * K_PER,
        x_ptr,
        u_ptr,
        p_ptr,
        flag_ptr,
        offs_m,
        m_mask,
        K,
        R,
        K_PER,
        RB_PER_CHUNK,
        BLOCK_K,
        BLOCK_R,
        COLS_R,
        EVEN_K,
        True,
        P16,
        p16_ptr,
        rb_cnt_ptr,
        SPLIT_K,
        (PROBE & 1) != 0,
        PV,
      )
  stamp(o_in_ptr, 1, TRACE)
  if V_RES:  # phase-2 tile q on CTA n1 + q, which ran no phase-1 tile
    if (pid >= n1) & (pid < n1 + n_nb):
      _pv_resident_tile(
        pid - n1,
        p_ptr,
        v_ptr,
        b_ptr,
        flag_ptr,
        o_ptr,
        M,
        n1,
        R,
        N,
        HAS_BIAS,
        BLOCK_M,
        R_P2,
        BLOCK_N,
        COLS_N,
        o_in_ptr,
        TRACE,
      )
  elif PV:
    # phase 2: tiles q = pid, pid + PROGRAMS, ...; chunk-major; each waits for its chunk of P
    # (STREAM_K: one chunk, complete when all PROGRAMS CTAs have signalled)
    if PREFETCH > 0:  # the first rows of this CTA's first V tile load while it waits
      if pid < R_CHUNKS * n_nb:
        prefetch_l2(
          v_ptr,
          (pid // n_nb) * (RB_PER_CHUNK * COLS_R),
          (pid % n_nb) * COLS_N,
          R,
          N,
          N,
          PREFETCH,
          BLOCK_N,
        )
    for q in range(pid, R_CHUNKS * n_nb, PROGRAMS):
      _pv_tile(
        q,
        n_nb,
        n_rb,
        p16_ptr if P16 else p_ptr,
        v_ptr,
        b_ptr,
        acc_ptr,
        flag_ptr,
        sem_ptr,
        o_ptr,
        1 if PROBE & 2 else M,
        R,
        N,
        HAS_BIAS,
        SPLIT_K,
        R_CHUNKS,
        RB_PER_CHUNK,
        BLOCK_M,
        BLOCK_N,
        BLOCK_KV,
        EVEN_R,
        COLS_R,
        COLS_N,
        P16,
        o_in_ptr,
        TRACE,
        PROGRAMS if STREAM_K else 0,
      )
  stamp(o_in_ptr, 3, TRACE)
  leave_chain(chain_ptr, clear_off, clear_n, CLEAR_FIRST, CLEAR_COUNT)
  stamp(o_in_ptr, 4, TRACE)


@triton.jit
def _pv_launch_kernel(
  scratch_ptr,  # f32 P [M, R] at READ_OFF floats: phase 1's scratch (or the chain's buffer)
  v_ptr,  # [R, N] second factor
  b_ptr,  # [N] bias (read only if HAS_BIAS)
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
  """Y = P·V (+ bias) after phase 1 alone (``pv="launch"``): one [BLOCK_M, BLOCK_N] output
  tile a CTA, P's f32 sums rounded to V's dtype as they are loaded (XLA's own lowering rounds
  X·U once too), f32 accumulation over all of r."""
  offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
  offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
  m_mask = offs_m < M
  n_mask = offs_n < N
  if PDL:
    tl.extra.cuda.gdc_wait()
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


def pv_launch_meta(r: int, n: int, has_bias: bool, p: planner.PvLaunchPlan) -> dict:
  """Constexprs of one ·V launch (shared by the wrapper and the tests)."""
  return dict(
    R=r,
    N=n,
    HAS_BIAS=has_bias,
    BLOCK_M=p.block_m,
    BLOCK_N=p.block_n,
    BLOCK_KV=p.block_kv,
    EVEN_R=r % p.block_kv == 0,
  )


def pv_launch(
  p_f32, v, bias, m: int, out_dtype, plan: planner.PvLaunchPlan | None = None, out=None
):
  """y [m, N] = P·V (+ bias) with P the f32 [m·r] sums phase 1 left (``_pv_launch_kernel``);
  ``out``: a buffer of y's shape and dtype the kernel writes into (aliased)."""
  r, n = v.shape
  if p_f32.dtype != jnp.float32 or p_f32.shape != (m * r,):
    raise ValueError(f"P must be phase 1's f32 [{m * r}] sums, got {p_f32.dtype}{p_f32.shape}")
  check_out(out, (m, n), out_dtype)
  p = plan or planner.plan_pv_launch(m, r, n)  # PvLaunchPlan refuses tiles under the mma's
  return launch.triton_call(
    p_f32,
    v,
    bias if bias is not None else v,
    v if out is None else out,
    m,
    kernel=_pv_launch_kernel,
    out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
    grid=(planner.cdiv(n, p.block_n), planner.cdiv(m, p.block_m)),
    num_warps=p.warps,
    num_stages=p.stages,
    input_output_aliases=None if out is None else {3: 0},
    name="lrjax_xuv_pv",
    **pv_launch_meta(r, n, bias is not None, p),
  )


@triton.jit
def _group_phase1(
  t,
  x_ptr,
  u_ptr,
  p_ptr,
  flag_ptr,
  offs_m,
  m_mask,
  K: tl.constexpr,
  R: tl.constexpr,
  K_PER: tl.constexpr,
  SPLIT: tl.constexpr,
  BLOCK_K: tl.constexpr,
  BLOCK_R: tl.constexpr,
  COLS_R: tl.constexpr,
):
  """Phase-1 tile t of one member of the group (its r-blocks form one chunk)."""
  _xu_tile(
    t // SPLIT,
    (t % SPLIT) * K_PER,
    x_ptr,
    u_ptr,
    p_ptr,
    flag_ptr,
    offs_m,
    m_mask,
    K,
    R,
    K_PER,
    (R + COLS_R - 1) // COLS_R,
    BLOCK_K,
    BLOCK_R,
    COLS_R,
    K % K_PER == 0,
    True,
    False,
    p_ptr,
    flag_ptr,
    SPLIT,
  )


@triton.jit
def _group_phase2(
  q,
  p_ptr,
  v_ptr,
  b_ptr,
  flag_ptr,
  o_ptr,
  M,
  R: tl.constexpr,
  N: tl.constexpr,
  HAS_BIAS: tl.constexpr,
  SPLIT: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_N: tl.constexpr,
  BLOCK_KV: tl.constexpr,
  COLS_R: tl.constexpr,
  COLS_N: tl.constexpr,
  EVEN_R: tl.constexpr,
):
  """Phase-2 tile q of one member: waits for its whole X·U, then one column block of ·V."""
  _pv_tile(
    q,
    (N + COLS_N - 1) // COLS_N,
    (R + COLS_R - 1) // COLS_R,
    p_ptr,
    v_ptr,
    b_ptr,
    p_ptr,
    flag_ptr,
    flag_ptr,
    o_ptr,
    M,
    R,
    N,
    HAS_BIAS,
    SPLIT,
    1,
    (R + COLS_R - 1) // COLS_R,
    BLOCK_M,
    BLOCK_N,
    BLOCK_KV,
    EVEN_R,
    COLS_R,
    COLS_N,
    False,
    o_ptr,
    False,
  )


@triton.jit
def _xuv_group_kernel(
  x_ptr,  # [M, K]
  u0_ptr,
  v0_ptr,
  b0_ptr,
  u1_ptr,
  v1_ptr,
  b1_ptr,
  u2_ptr,
  v2_ptr,
  b2_ptr,  # members
  s_in_ptr,  # the zeroed scratch, aliased to scratch_ptr; never read
  o0_in_ptr,
  o1_in_ptr,
  o2_in_ptr,  # callers' output buffers aliased to o*_ptr, or x; never read
  M,
  clear_off,
  clear_n,  # as in _xuv_decode_kernel
  scratch_ptr,  # f32: P_0 [M, R0], P_1 [M, R1], P_2 [M, R2], then (i32) one flag a member
  o0_ptr,
  o1_ptr,
  o2_ptr,  # [M, N_i] outputs (o2 unused with two members)
  K: tl.constexpr,
  R0: tl.constexpr,
  N0: tl.constexpr,
  R1: tl.constexpr,
  N1: tl.constexpr,
  R2: tl.constexpr,
  N2: tl.constexpr,
  HB0: tl.constexpr,
  HB1: tl.constexpr,
  HB2: tl.constexpr,
  KP0: tl.constexpr,
  KP1: tl.constexpr,
  KP2: tl.constexpr,  # phase-1 K rows per tile
  BR0: tl.constexpr,
  BR1: tl.constexpr,
  BR2: tl.constexpr,  # phase-1 register widths
  CR0: tl.constexpr,
  CR1: tl.constexpr,
  CR2: tl.constexpr,  # phase-1 columns per tile
  BN0: tl.constexpr,
  BN1: tl.constexpr,
  BN2: tl.constexpr,  # phase-2 register widths
  CN0: tl.constexpr,
  CN1: tl.constexpr,
  CN2: tl.constexpr,  # phase-2 columns per tile
  S0: tl.constexpr,
  S1: tl.constexpr,
  S2: tl.constexpr,  # split-K tiles a column block
  A0: tl.constexpr,
  A1: tl.constexpr,
  A2: tl.constexpr,  # phase-1 tiles (A2 = 0: 2 members)
  Q0: tl.constexpr,
  Q1: tl.constexpr,
  Q2: tl.constexpr,  # phase-2 tiles
  E0: tl.constexpr,
  E1: tl.constexpr,
  E2: tl.constexpr,  # EVEN_R of each member
  BLOCK_M: tl.constexpr,
  BLOCK_K: tl.constexpr,
  BLOCK_KV: tl.constexpr,
  PROGRAMS: tl.constexpr,
  PREFETCH: tl.constexpr,
  ONE: tl.constexpr,  # every member's phase-1 tiles and rank alike: one phase-1 call site,
  # its U_i chosen at run time (one pipeline in shared memory, not one a
  # member)
  WORK_OFF: tl.constexpr = 0,  # as in _xuv_decode_kernel
  PDL: tl.constexpr = 0,  # as in _xuv_decode_kernel
):
  """Several X·U_i·V_i sharing X, one persistent launch: phase 1 streams every U_i
  (split-K tiles of all members, one after another), phase 2 every V_i (each tile waits
  only for its own member's X·U_i). The persistent kernel's dataflow, per member."""
  pid = tl.program_id(0)
  chain_ptr = scratch_ptr
  scratch_ptr = join_chain(scratch_ptr, WORK_OFF, PDL)
  p0_ptr = scratch_ptr
  p1_ptr = p0_ptr + M * R0
  p2_ptr = p1_ptr + M * R1
  flag_ptr = (p2_ptr + M * R2).to(tl.pointer_type(tl.int32))
  offs_m = tl.arange(0, BLOCK_M)
  m_mask = offs_m < M
  if ONE:  # phase 1, never waiting; member j's tiles are t in [j * A0, (j + 1) * A0)
    for t in range(pid, A0 + A1 + A2, PROGRAMS):
      j = t // A0
      u_ptr = tl.where(j == 0, u0_ptr, tl.where(j == 1, u1_ptr, u2_ptr))
      _group_phase1(
        t - j * A0,
        x_ptr,
        u_ptr,
        p0_ptr + j * (M * R0),
        flag_ptr + j,
        offs_m,
        m_mask,
        K,
        R0,
        KP0,
        S0,
        BLOCK_K,
        BR0,
        CR0,
      )
  else:
    for t in range(pid, A0 + A1 + A2, PROGRAMS):  # phase 1: never waits
      if t < A0:
        _group_phase1(
          t, x_ptr, u0_ptr, p0_ptr, flag_ptr, offs_m, m_mask, K, R0, KP0, S0, BLOCK_K, BR0, CR0
        )
      elif t < A0 + A1:
        _group_phase1(
          t - A0,
          x_ptr,
          u1_ptr,
          p1_ptr,
          flag_ptr + 1,
          offs_m,
          m_mask,
          K,
          R1,
          KP1,
          S1,
          BLOCK_K,
          BR1,
          CR1,
        )
      else:
        _group_phase1(
          t - A0 - A1,
          x_ptr,
          u2_ptr,
          p2_ptr,
          flag_ptr + 2,
          offs_m,
          m_mask,
          K,
          R2,
          KP2,
          S2,
          BLOCK_K,
          BR2,
          CR2,
        )
  if PREFETCH > 0:  # the first V rows of this CTA's first phase-2 tile, while it waits
    if pid < Q0:
      prefetch_l2(v0_ptr, 0, pid * CN0, R0, N0, N0, PREFETCH, BN0)
    elif pid < Q0 + Q1:
      prefetch_l2(v1_ptr, 0, (pid - Q0) * CN1, R1, N1, N1, PREFETCH, BN1)
    elif pid < Q0 + Q1 + Q2:
      prefetch_l2(v2_ptr, 0, (pid - Q0 - Q1) * CN2, R2, N2, N2, PREFETCH, BN2)
  for q in range(pid, Q0 + Q1 + Q2, PROGRAMS):  # phase 2: each waits for its member
    if q < Q0:
      _group_phase2(
        q,
        p0_ptr,
        v0_ptr,
        b0_ptr,
        flag_ptr,
        o0_ptr,
        M,
        R0,
        N0,
        HB0,
        S0,
        BLOCK_M,
        BN0,
        BLOCK_KV,
        CR0,
        CN0,
        E0,
      )
    elif q < Q0 + Q1:
      _group_phase2(
        q - Q0,
        p1_ptr,
        v1_ptr,
        b1_ptr,
        flag_ptr + 1,
        o1_ptr,
        M,
        R1,
        N1,
        HB1,
        S1,
        BLOCK_M,
        BN1,
        BLOCK_KV,
        CR1,
        CN1,
        E1,
      )
    else:
      _group_phase2(
        q - Q0 - Q1,
        p2_ptr,
        v2_ptr,
        b2_ptr,
        flag_ptr + 2,
        o2_ptr,
        M,
        R2,
        N2,
        HB2,
        S2,
        BLOCK_M,
        BN2,
        BLOCK_KV,
        CR2,
        CN2,
        E2,
      )
  leave_chain(chain_ptr, clear_off, clear_n)


def launch_plan(
  m: int, k: int, r: int, n: int, has_bias: bool, bs: BlockSizes, stages: int = 3
) -> dict:
  """Grid size and constexprs of one call (shared by the wrapper and the tests).

  ``stages`` < 3 leaves a stage's streaming out, to time the other one (wrong output)."""
  k_per = planner.part_len(k, bs.split_k, bs.block_k)
  split = planner.cdiv(k, k_per)  # no chunk starts past K
  n_rb = planner.cdiv(r, bs.block_r)
  rb_per_chunk = planner.cdiv(n_rb, bs.r_chunks)
  chunks = planner.cdiv(n_rb, rb_per_chunk)
  n_nb = planner.cdiv(n, bs.block_n)
  r_per = rb_per_chunk * bs.block_r
  meta = dict(
    K=k,
    R=r,
    N=n,
    HAS_BIAS=has_bias,
    K_PER=k_per,
    SPLIT_K=split,
    R_CHUNKS=chunks,
    RB_PER_CHUNK=rb_per_chunk,
    BLOCK_M=bs.block_m,
    BLOCK_K=bs.block_k,
    BLOCK_R=bs.block_r,
    BLOCK_N=bs.block_n,
    BLOCK_KV=bs.block_kv,
    EVEN_K=k % k_per == 0,
    EVEN_R=r % r_per == 0 and r_per % bs.block_kv == 0,
    STAGES=stages,
  )
  return dict(
    grid=n_rb * split + chunks * n_nb,
    chunks=chunks,
    n_nb=n_nb,
    meta=meta,
    scratch=m * r + m * n + chunks + n_nb,
    p16=1,
  )


# The CTAs left without a phase-2 tile zero the scratch chain's other half (instead of every
# CTA at its end) where there are at least this many: the half is the chain's previous call's,
# up to the largest scratch in the chain, so a few CTAs could take longer than phase 2
CLEAR_MIN_IDLE = 8


def persistent_launch_plan(
  m: int,
  k: int,
  r: int,
  n: int,
  has_bias: bool,
  p: planner.PersistentDecodePlan,
  pv: bool = True,
  probe: int = 0,
) -> dict:
  """Grid size and constexprs of one persistent call (shared by the wrapper and the tests).
  ``pv=False``: phase 1 only (one r-chunk), into P rounded once (``p.p16``) or, without
  p16, into the scratch's f32 P, which XLA rounds as it reads it (the scratch is then P
  alone, m·r floats: nothing past it is signalled or counted).
  ``probe``: the kernel's timing-only PROBE bits (0: the real kernel)."""
  if not pv:
    p = dataclasses.replace(p, r_chunks=1, v_resident=False, stream_k=False)
  split = planner.cdiv(k, p.k_per)
  n_rb = planner.cdiv(r, p.cols_r)
  rb_per_chunk = planner.cdiv(n_rb, p.r_chunks)
  chunks = planner.cdiv(n_rb, rb_per_chunk)
  r_per = rb_per_chunk * p.cols_r
  planner.check_prefetch_rows(p, "prefetch")
  if chunks > 1 and r_per % p.block_kv:
    raise ValueError(f"{p}: r-chunks of {r_per} rows are not a multiple of block_kv")
  if p.v_resident:
    n_tiles = n_rb * split + planner.cdiv(n, p.cols_n)
    if not pv or chunks > 1 or p.p16 or n_tiles > p.programs:
      raise ValueError(
        f"{p}: v_resident needs phase 2 in the kernel, one r-chunk, no p16 and "
        f"a CTA for each of its {n_tiles} tiles"
      )
  if p.stream_k:
    steps = n_rb * planner.cdiv(k, p.block_k)
    if not pv or chunks > 1 or p.p16 or p.v_resident or p.cols_r != p.block_r or steps < p.programs:
      raise ValueError(
        f"{p}: stream_k needs phase 2 in the kernel, one r-chunk, no p16 or "
        f"v_resident, cols_r = block_r and a phase-1 step for every CTA "
        f"({steps} steps)"
      )
  meta = dict(
    K=k,
    R=r,
    N=n,
    HAS_BIAS=has_bias,
    K_PER=p.k_per,
    SPLIT_K=split,
    R_CHUNKS=chunks,
    RB_PER_CHUNK=rb_per_chunk,
    BLOCK_M=p.block_m,
    BLOCK_K=p.block_k,
    BLOCK_R=p.block_r,
    BLOCK_N=p.block_n,
    BLOCK_KV=p.block_kv,
    EVEN_K=k % (p.block_k if p.stream_k else p.k_per) == 0,
    EVEN_R=r % r_per == 0 and r_per % p.block_kv == 0,
    COLS_R=p.cols_r,
    COLS_N=p.cols_n,
    PROGRAMS=p.programs,
    PREFETCH=p.prefetch,
    P16=p.p16,
    PV=pv,
    PROBE=int(probe),
    V_RES=int(p.v_resident),
    R_P2=max(16, planner.next_pow2(r)),
    STREAM_K=int(p.stream_k),
  )
  n_nb = planner.cdiv(n, p.cols_n)
  scratch = m * r + (m * n if chunks > 1 else 0) + chunks + n_nb + (n_rb if p.p16 else 0)
  if not pv and not p.p16:  # phase 1 alone signals and counts nothing: its scratch is P alone
    scratch = m * r
  # who zeroes the chain's other half at its end: V_RES's phase-1 CTAs (done long before
  # phase 2), else the CTAs with no phase-2 tile where there are enough, else every CTA
  busy = chunks * n_nb if pv else p.programs
  if p.v_resident:
    meta.update(CLEAR_FIRST=0, CLEAR_COUNT=n_rb * split)
  elif p.programs - busy >= CLEAR_MIN_IDLE:
    meta.update(CLEAR_FIRST=busy, CLEAR_COUNT=p.programs - busy)
  else:
    meta.update(CLEAR_FIRST=0, CLEAR_COUNT=0)
  return dict(
    grid=p.programs, chunks=chunks, n_nb=n_nb, meta=meta, scratch=scratch, p16=m * r if p.p16 else 1
  )


def default_pv(m: int, k: int, r: int, n: int, out_given: bool = False) -> str:
  """Who applies V on the persistent schedule unless the caller says: a launch of its own
  ("launch") where r x N <= PV_LAUNCH_MAX_V from PV_LAUNCH_MIN_M rows, and from
  PV_LAUNCH_SMALL_V_MIN_M where N <= K / PV_XLA_K_OVER_N and K >= PV_XLA_MIN_K; else XLA's GEMM
  ("xla") from PV_XLA_MIN_M rows, and from the rows that share its 64-row block (33) where
  N <= K / PV_XLA_K_OVER_N and K >= PV_XLA_MIN_K, except where XLA's GEMM would pad V every
  call (up to PV_XLA_PAD_MAX_M rows, r >= PV_XLA_PAD_MIN_R not a multiple of
  PV_XLA_R_ALIGN); else the kernel (phase 2 in the same launch). Where the caller passes an
  output buffer, XLA cannot write into it: the kernel then applies V in place of XLA."""
  small_v = k >= max(PV_XLA_MIN_K, PV_XLA_K_OVER_N * n)
  if r * n <= PV_LAUNCH_MAX_V and (
    m >= PV_LAUNCH_MIN_M or (m >= PV_LAUNCH_SMALL_V_MIN_M and small_v)
  ):
    return "launch"
  xla_pads_v = r % PV_XLA_R_ALIGN != 0 and r >= PV_XLA_PAD_MIN_R and m <= PV_XLA_PAD_MAX_M
  if (
    (m >= PV_XLA_MIN_M or (m > PV_XLA_MIN_M // 2 and small_v)) and not out_given and not xla_pads_v
  ):
    return "xla"
  return "kernel"


def plan_persistent(
  m: int, k: int, r: int, n: int, pv: str, programs: int | None
) -> planner.PersistentDecodePlan:
  """The planner's tiles for the persistent schedule on ``programs`` CTAs (None: the H200's
  SMs): phase 1 alone where XLA or a launch of its own applies V (``pv="xla"``, ``"launch"``),
  both phases otherwise."""
  alone = pv in ("xla", "launch")
  plan_fn = planner.plan_decode_phase1 if alone else planner.plan_decode_persistent
  return plan_fn(m, k, r, n, programs=programs)


def default_persistent_launch(
  m: int, k: int, r: int, n: int, has_bias: bool, programs: int | None
) -> tuple[str, planner.PersistentDecodePlan, dict]:
  """(pv, plan, launch) of the wrapper's default persistent call without ``out``:
  ``default_pv``'s choice, ``plan_persistent``'s tiles on ``programs`` CTAs and their
  ``persistent_launch_plan`` (for the benchmarks and tests that ask what a call runs)."""
  pv = default_pv(m, k, r, n)
  p = plan_persistent(m, k, r, n, pv, programs)
  return pv, p, persistent_launch_plan(m, k, r, n, has_bias, p, pv == "kernel")


def xuv_decode(
  x,
  u,
  v,
  bias=None,
  *,
  out_dtype=None,
  block_sizes: BlockSizes | None = None,
  out=None,
  xla_zeroing: bool | None = None,
  _stages: int = 3,
  persistent: bool | planner.PersistentDecodePlan | None = None,
  pv: str | None = None,
  pv_plan: planner.PvLaunchPlan | None = None,
  _probe: int = 0,
):
  """y = (x·u)·v (+ bias) for few tokens. x [..., K], u [K, r], v [r, N], bias [N].

  ``out`` [M, N]: optional buffer the kernel writes into (aliased; the tests poison it).
  ``xla_zeroing``: zero the scratch with an XLA op aliased into the call instead of
  jax-triton's memset inside the custom call (default: yes unless ``out`` is given or
  ``launch.xla_zeroing()`` says no; with the legacy launch it measured 3-10 µs less per call
  at M=1, with the typed-FFI launch the two cost the same in a model, gpu_notes.md).
  ``persistent``: the persistent schedule (True, or a ``planner.PersistentDecodePlan``) or
  the tiled one (False; ``block_sizes`` applies to it); default: persistent for
  M <= PERSISTENT_MAX_M.
  ``pv``: who applies V on the persistent schedule: "kernel" (phase 2 in the same launch),
  "xla" (the kernel ends with P = X·U, rounded once in the kernel or, without the plan's
  p16, by XLA from the f32 sums; then XLA's GEMM multiplies it by V, as XLA's own lowering
  does) or "launch" (phase 1 alone, then ``_pv_launch_kernel`` reads the f32 sums where they
  are and writes y, into ``out`` if given); default: ``default_pv``.
  ``pv_plan``: the ·V launch's tiles (pv="launch"; default ``planner.plan_pv_launch``).
  ``_stages``: benchmarking only (1: stage 1 alone, 2: stage 2 alone; the output is wrong).
  ``_probe``: benchmarking only, the persistent kernel's PROBE bits (the output is wrong).
  """
  x2, lead, (m, k, r, n), out_dtype = unpack_xuv_args(x, u, v, out_dtype)
  if _probe & 4:
    raise ValueError(
      "_probe bit 4 (per-CTA clock stamps) writes into the kernel's o_in_ptr "
      "operand; only benchmarks/decode_trace.py, which passes a trace buffer "
      "there, may set it"
    )
  if pv not in (None, "kernel", "xla", "launch"):
    raise ValueError(f"{pv=} must be 'kernel', 'xla', 'launch' or None (by rows)")
  if pv_plan is not None and pv != "launch":
    raise ValueError("pv_plan= applies to pv='launch'")
  if persistent is None:
    persistent = m <= PERSISTENT_MAX_M and block_sizes is None and _stages == 3 and num_sms() > 0
  if persistent:
    pv = pv or default_pv(m, k, r, n, out is not None)
  pv_out = None
  if pv == "launch":  # the ·V launch writes y (into out=, if given); phase 1 alone writes P
    pv_out, out = out, None
  if xla_zeroing is None:
    xla_zeroing = out is None and launch.xla_zeroing()
  if xla_zeroing and out is not None:
    raise ValueError("out= and xla_zeroing=True cannot be combined")
  check_out(out, (m, n), out_dtype)
  b = bias if bias is not None else v  # never read without HAS_BIAS
  if persistent:
    if block_sizes is not None or _stages != 3:
      raise ValueError(
        "block_sizes= and _stages= apply to the tiled schedule "
        "(persistent=False); pass a planner.PersistentDecodePlan instead"
      )
    if m > MAX_M:
      raise ValueError(f"{m} rows: the persistent decode kernel serves M <= {MAX_M}")
    p = (
      persistent
      if isinstance(persistent, planner.PersistentDecodePlan)
      else plan_persistent(m, k, r, n, pv, num_sms())
    )
    if pv == "xla" and out is not None:
      raise ValueError("out= is the kernel's output buffer; with pv='xla' XLA writes y")
    if pv == "kernel" and not 0 < p.programs <= num_sms():
      raise ValueError(
        f"{p.programs=} must be in [1, {num_sms()}] (the SMs; 0: unknown): "
        "every CTA must be resident, or a waiting CTA could block its producer"
      )
    if p.programs < 1:
      raise ValueError(f"{p.programs=} must be positive")
    if pv == "launch" and p.p16:
      raise ValueError("pv='launch' reads phase 1's f32 P; the plan's p16 must be off")
    if p.block_m < m:
      raise ValueError(f"{p.block_m=} must cover the {m} rows")
    plan = persistent_launch_plan(m, k, r, n, bias is not None, p, pv == "kernel", _probe)
    kernel, warps, stages = _xuv_decode_persistent_kernel, p.warps, p.stages
  else:
    if pv in ("xla", "launch") or _probe:
      raise ValueError("pv='xla', pv='launch' and _probe= apply to the persistent schedule")
    pv = "kernel"
    bs = block_sizes or BlockSizes.get_default(m, k, r, n)
    if bs.block_m < m:
      raise ValueError(f"{bs.block_m=} must cover the {m} rows; use xuv_prefill for large M")
    if _stages not in (1, 2, 3):
      raise ValueError(f"{_stages=} must be 1, 2 or 3")
    plan = launch_plan(m, k, r, n, bias is not None, bs, _stages)
    kernel, warps, stages = _xuv_decode_kernel, bs.num_warps, bs.num_stages
  scratch = plan["scratch"]
  if xla_zeroing:  # the 5th operand is then the zeroed scratch, aliased to output 0
    fifth, aliases, zeroed = jnp.zeros((scratch,), jnp.float32), {4: 0}, ()
  else:
    fifth = x2 if out is None else out
    aliases, zeroed = ({4: 1} if out is not None else None), (0,)
  outs = launch.triton_call(
    x2,
    u,
    v,
    b,
    fifth,
    m,
    *launch.UNCHAINED,
    kernel=kernel,
    out_shape=(
      jax.ShapeDtypeStruct((scratch,), jnp.float32),
      jax.ShapeDtypeStruct((m, n) if pv == "kernel" else (1,), out_dtype),
      jax.ShapeDtypeStruct((plan["p16"],), v.dtype),
    ),  # P16's P; never zeroed
    grid=(plan["grid"],),
    zeroed_outputs=zeroed,
    input_output_aliases=aliases,
    num_warps=warps,
    num_stages=stages,
    name="lrjax_xuv_decode",
    **plan["meta"],
  )
  if pv == "launch":  # ·V in a launch of its own, reading P's f32 sums where phase 1 left them
    return pv_launch(outs[0], v, bias, m, out_dtype, pv_plan, pv_out).reshape(*lead, n)
  if pv == "xla":
    from lrjax.lowering.primitives import rank_space_out

    if p.p16:  # P rounded once in the kernel
      pm = outs[2].reshape(m, r)
    else:  # P's f32 sums: the call's scratch, P alone (chained: the half it worked in),
      # rounded here by XLA in a loop fusion of its own (gpu_xuv_decode_p_handover_h200.json)
      pm = outs[0].reshape(m, r).astype(v.dtype)
    return rank_space_out(pm, v, bias, out_dtype).reshape(*lead, n)
  return outs[1].reshape(*lead, n)


def group_launch_plan(
  m: int, k: int, members, p: planner.GroupDecodePlan, phase2: bool = True
) -> dict:
  """Scratch size and constexprs of one grouped call (shared by the wrapper and the tests).
  ``members``: [(r_i, n_i, has_bias_i)] of 2 or 3; with two, the kernel's third member
  repeats the second's shapes with no tiles. ``phase2=False``: phase 1 alone (no ·V tiles,
  no V prefetch; each P_i is left as f32 sums in the scratch, P_0 first). ``p.one_branch``
  (the kernel's ONE) needs every member's rank and phase-1 tiles alike."""
  g = len(members)
  planner.check_prefetch_rows(p, "prefetch")
  if (
    p.one_branch
    and len({(r, p.block_r[i], p.cols_r[i], p.k_per[i]) for i, (r, *_) in enumerate(members)}) > 1
  ):
    raise ValueError(
      f"one_branch: every member's rank and phase-1 tiles must be alike, got "
      f"ranks {[r for r, *_ in members]}, block_r {p.block_r[:g]}, cols_r "
      f"{p.cols_r[:g]}, k_per {p.k_per[:g]}"
    )
  full = list(members) + [members[-1]] * (3 - g)
  meta = dict(
    K=k,
    BLOCK_M=p.block_m,
    BLOCK_K=64,
    BLOCK_KV=64,
    PROGRAMS=p.programs,
    PREFETCH=p.prefetch if phase2 else 0,
    ONE=int(p.one_branch),
  )
  for i, (r, n, has_bias) in enumerate(full):
    j = min(i, g - 1)
    kp, cr, cn = p.k_per[j], p.cols_r[j], p.cols_n[j]
    split, r_per = planner.cdiv(k, kp), planner.round_up(r, cr)
    meta.update(
      {
        f"R{i}": r,
        f"N{i}": n,
        f"HB{i}": has_bias,
        f"KP{i}": kp,
        f"BR{i}": p.block_r[j],
        f"CR{i}": cr,
        f"BN{i}": p.block_n[j],
        f"CN{i}": cn,
        f"S{i}": split,
        f"A{i}": planner.cdiv(r, cr) * split if i < g else 0,
        f"Q{i}": planner.cdiv(n, cn) if i < g and phase2 else 0,
        f"E{i}": r % r_per == 0 and r_per % 64 == 0,
      }
    )
  return dict(meta=meta, scratch=m * sum(r for r, *_ in full) + 3)


def xuv_decode_group(
  x,
  members,
  *,
  out_dtype=None,
  out=None,
  plan: planner.GroupDecodePlan | None = None,
  pv: str = "kernel",
):
  """[(x·u_i)·v_i (+ bias_i)] for 2 or 3 members sharing x (e.g. q/k/v projections), in one
  launch. x [..., K]; members: [(u_i [K, r_i], v_i [r_i, N_i]) or (u_i, v_i, bias_i [N_i])].
  ``out``: optional [M, N_i] buffers the kernel writes into (aliased; the tests poison them).
  ``pv``: "kernel" (each V_i applied in the same launch, up to GROUP_MAX_M rows) or "xla"
  (phase 1 alone, up to MAX_M rows: every P_i in one launch, then XLA rounds each and its GEMM
  applies V_i, as ``xuv_decode(pv="xla")`` does for one; default plan
  ``planner.plan_decode_group_phase1``). Returns the list of [..., N_i] outputs."""
  if pv not in ("kernel", "xla"):
    raise ValueError(f"{pv=} must be 'kernel' or 'xla'")
  if pv == "xla" and out is not None:
    raise ValueError("out= is the kernel's output buffer; with pv='xla' XLA writes y")
  if not 2 <= len(members) <= 3:
    raise ValueError(f"{len(members)} members: the grouped kernel takes 2 or 3")
  unpacked = []
  for i, mem in enumerate(members):
    if not isinstance(mem, (tuple, list)) or len(mem) not in (2, 3):
      raise ValueError(f"member {i}: expected (u, v) or (u, v, bias)")
    x2, lead, (m, k, r, n), odt = unpack_xuv_args(x, mem[0], mem[1], out_dtype)
    if len(mem) == 3 and tuple(mem[2].shape) != (n,):
      raise ValueError(f"member {i}: bias {mem[2].shape} must be ({n},)")
    unpacked.append((mem[0], mem[1], mem[2] if len(mem) == 3 else None, r, n))
  max_m = GROUP_MAX_M if pv == "kernel" else MAX_M
  if m > max_m:
    raise ValueError(f"{m} rows: the grouped kernel serves M <= {max_m} with {pv=}")
  g = len(unpacked)
  plan_fn = planner.plan_decode_group if pv == "kernel" else planner.plan_decode_group_phase1
  p = plan or plan_fn(m, k, [(r, n) for *_, r, n in unpacked], programs=num_sms())
  if p.block_m < m:
    raise ValueError(f"{p.block_m=} must cover the {m} rows")
  if not 0 < p.programs <= num_sms():
    raise ValueError(
      f"{p.programs=} must be in [1, {num_sms()}] (the SMs; 0: unknown): "
      "every CTA must be resident, or a waiting CTA could block its producer"
    )
  full = unpacked + [unpacked[-1]] * (3 - g)  # a third member's operands when there are two
  ops = [a for u, v, b, *_ in full for a in (u, v, b if b is not None else v)]
  lp = group_launch_plan(
    m, k, [(r, n, b is not None) for *_, b, r, n in unpacked], p, phase2=pv == "kernel"
  )
  meta, scratch = lp["meta"], lp["scratch"]
  aliases, outs_in = {10: 0}, [x2] * 3
  if out is not None:
    if len(out) != g:
      raise ValueError(f"{len(out)} out= buffers for {g} members")
    for i, (o, (*_, n)) in enumerate(zip(out, unpacked)):
      check_out(o, (m, n), odt)
      outs_in[i], aliases[11 + i] = o, 1 + i
  outs = launch.triton_call(
    x2,
    *ops,
    jnp.zeros((scratch,), jnp.float32),
    *outs_in,
    m,
    *launch.UNCHAINED,
    kernel=_xuv_group_kernel,
    out_shape=(
      jax.ShapeDtypeStruct((scratch,), jnp.float32),
      *[jax.ShapeDtypeStruct((m, n) if pv == "kernel" else (1,), odt) for *_, n in full],
    ),
    grid=(p.programs,),
    input_output_aliases=aliases,
    num_warps=p.warps,
    num_stages=p.stages,
    name="lrjax_xuv_decode_group",
    **meta,
  )
  if pv == "xla":  # P_i's f32 sums side by side in the scratch, each rounded by XLA
    from lrjax.lowering.primitives import rank_space_out

    ys, off = [], 0
    for u, v, b, r, n in unpacked:  # noqa: B007
      pm = outs[0][off : off + m * r].reshape(m, r).astype(v.dtype)
      ys.append(rank_space_out(pm, v, b, odt).reshape(*lead, n))
      off += m * r
    return ys
  return [o.reshape(*lead, mem[4]) for o, mem in zip(outs[1 : 1 + g], unpacked)]


def xuv_decode_reference(x, u, v, bias=None, *, out_dtype=None):
  """f32-accumulating (x·u)·v (+ bias); X·U rounded to v's dtype as the kernel does."""
  from lrjax.lowering.primitives import lr_xuv_reference

  return lr_xuv_reference(x, u, v, bias, inter_dtype=v.dtype, out_dtype=out_dtype or x.dtype)


def xuv_decode_group_reference(x, members, *, out_dtype=None):
  """xuv_decode_group's result: each member's ``xuv_decode_reference``."""
  return [xuv_decode_reference(x, *m, out_dtype=out_dtype) for m in members]
