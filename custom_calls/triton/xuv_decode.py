"""Decode X·U·V (few tokens): y = (x·u)·v (+ bias), X·U streamed by split-K over all SMs.

At decode a linear layer's X·U·V is 10-60 µs of streaming U and V from HBM. XLA runs it as
two GEMMs with an HBM round trip of X·U between them (and at one row as a multiply and a
reduction). This kernel keeps the HBM busy from the first byte of U to the last of V:

**Persistent** (``_xuv_decode_persistent_kernel``, the default): one CTA per SM, every CTA
resident at once. Phase 1 splits X·U into tiles of ``k_per`` rows x ``cols_r`` columns of U
(K split across CTAs); each tile adds its [M, cols_r] partial into an f32 accumulator P
with relaxed atomics and bumps its r-chunk's counter (release). Phase 2 splits ·V into tiles
of whole r-chunks x ``cols_n`` columns; a tile waits for its chunk (acquire), having asked L2
to prefetch the first rows of its V tile, so its pipeline restarts from L2 when P completes.
With one r-chunk the output is stored directly; with several, the last chunk to arrive for a
column block (an acq_rel semaphore: a single-launch split-K reduction) adds the bias and
writes it. Column widths are multiples of 16, not powers of two, so each phase has about one
tile per SM (``planner.plan_decode_persistent``). Variants of the plan, each where the
tuning table measured it faster: V resident in registers before the wait for small ranks
(``v_resident``), phase 1 as stream-K over 128-column blocks (``stream_k``), 128-row phase-2
steps (``block_kv``), P rounded once for phase 2 (``p16``, off by default).

**Who applies V** (``default_pv``): from 64 rows ·V is a GEMM near the ridge point, where one
CTA per SM streaming V is slower than XLA's GEMM, while the skinny X·U is where XLA is weak.
There the kernel stops after phase 1 (``pv="xla"``): P's f32 sums stay in the scratch and XLA
rounds them and applies V with its GEMM, as its own lowering does. Where V is small, ·V runs
in a launch of its own that reads P in place (``pv="launch"``, xuv_decode_pv.py). Where XLA's
GEMM would pad V every call (ranks >= 2048 not a multiple of 16), phase 2 stays in the kernel.

**Tiled** (``_xuv_decode_kernel``): one CTA per tile, stage-1 CTAs first in the grid; a
stage-2 CTA waits only on CTAs with lower indices (the forward-progress assumption of
decoupled look-back scans). The fallback where the SM count is unknown.

The accumulators, counters and semaphores live in one scratch buffer, zeroed by an XLA op
aliased into the call, or by the call before it on a scratch chain (launch.py), or, with
``out=``, by jax-triton's memset.
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from lrjax.custom_calls.triton import launch, planner, policy
from lrjax.custom_calls.triton._common import (
  check_out,
  join_chain,
  k_masks,
  leave_chain,
  num_sms,
  prefetch_ahead,
  prefetch_splitk_tile,
  prefetch_l2,
  pv_tile,
  residual_operand,
  residual_reference,
  signal,
  stamp,
  store_out,
  unpack_xuv_args,
  wait_at_least,
  xu_tile,
)
from lrjax.custom_calls.triton.lowering import XUV_DECODE_MAX_M
from lrjax.custom_calls.triton.xuv_decode_pv import xuv_decode_pv

MAX_M = XUV_DECODE_MAX_M  # beyond this the prefill kernel serves


def _t() -> types.SimpleNamespace:
  """This device's ``xuv_decode`` thresholds (policy.py)."""
  return policy.values("xuv_decode")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """One call's schedule: who applies V (``pv``: "kernel", "xla" or "launch"), the persistent
  kernel's tiles (``plan``) and, with pv="launch", the ·V launch's (``pv_plan``)."""

  pv: str
  plan: planner.PersistentDecodePlan
  pv_plan: planner.PvLaunchPlan | None = None

  @classmethod
  def get_default(
    cls, m: int, k: int, r: int, n: int, *, out_given: bool = False, programs: int | None = None
  ) -> BlockSizes:
    """The table's choice for M rows of K -> r -> N; ``out_given``: the caller passes an output
    buffer; ``programs``: the CTAs (None: this GPU's SMs)."""
    pv = default_pv(m, k, r, n, out_given)
    plan = plan_persistent(m, k, r, n, pv, programs or num_sms())
    return cls(pv, plan, planner.plan_pv_launch(m, r, n) if pv == "launch" else None)


@dataclasses.dataclass(frozen=True)
class TiledBlockSizes:
  """Blocks of the tiled schedule (``_xuv_decode_kernel``), the fallback where the GPU's SM
  count is unknown; tuned by shape class (the table's ``xuv_decode_tiled`` tiles), else
  ``planner.plan_decode``'s."""

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
  def get_default(cls, m: int, k: int, r: int, n: int) -> TiledBlockSizes:
    t = policy.tiles("xuv_decode_tiled").get(f"{_m_class(m)},{_r_class(r)}")
    if t is not None:
      t = cls(**t)
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
def _prefetch_first(
  pid,
  u_ptr,
  v_ptr,
  K: tl.constexpr,
  R: tl.constexpr,
  N: tl.constexpr,
  K_PER: tl.constexpr,
  SPLIT_K: tl.constexpr,
  BLOCK_K: tl.constexpr,
  COLS_R: tl.constexpr,
  COLS_N: tl.constexpr,
  PROGRAMS: tl.constexpr,
  V_RES: tl.constexpr,
  STREAM_K: tl.constexpr,
):
  """The persistent kernel's L2 prefetch before its PDL wait (_common.prefetch_ahead): the
  first rows of the CTA's first phase-1 tile of U; a V-resident phase-2 CTA, its V tile."""
  n1 = ((R + COLS_R - 1) // COLS_R) * SPLIT_K
  if STREAM_K:  # the CTA's first step s of _xu_stream's even split
    KS: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    s = pid * (((R + COLS_R - 1) // COLS_R) * KS) // PROGRAMS
    c0 = (s // KS) * COLS_R
    prefetch_ahead(u_ptr, (s % KS) * BLOCK_K, c0, K, tl.minimum(c0 + COLS_R, R), R, True)
  elif pid < n1:
    prefetch_splitk_tile(u_ptr, pid, K, R, K_PER, SPLIT_K, COLS_R, True)
  elif V_RES:
    c0 = (pid - n1) * COLS_N
    prefetch_ahead(v_ptr, 0, c0, R, tl.minimum(c0 + COLS_N, N), N, True)


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
    xu_tile(
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
    pv_tile(
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
  if PDL >= 2:  # before the wait: this CTA's first U tile (V's, for a V-resident CTA)
    _prefetch_first(
      pid, u_ptr, v_ptr, K, R, N, K_PER, SPLIT_K, BLOCK_K, COLS_R, COLS_N, PROGRAMS, V_RES, STREAM_K
    )
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
      xu_tile(
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
      pv_tile(
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


def launch_plan(
  m: int, k: int, r: int, n: int, has_bias: bool, bs: TiledBlockSizes, stages: int = 3
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
  elif p.programs - busy >= _t().clear_min_idle:
    meta.update(CLEAR_FIRST=busy, CLEAR_COUNT=p.programs - busy)
  else:
    meta.update(CLEAR_FIRST=0, CLEAR_COUNT=0)
  return dict(
    grid=p.programs, chunks=chunks, n_nb=n_nb, meta=meta, scratch=scratch, p16=m * r if p.p16 else 1
  )


def default_pv(m: int, k: int, r: int, n: int, out_given: bool = False) -> str:
  """Who applies V on the persistent schedule (the table's ``xuv_decode`` thresholds): a
  launch of its own ("launch") where r x N <= pv_launch_max_v from pv_launch_min_m rows, and
  from pv_launch_small_v_min_m where V is small beside U (N <= K / pv_xla_k_over_n, K >=
  pv_xla_min_k); else XLA's GEMM ("xla") from pv_xla_min_m rows, and from the rows that share
  its 64-row block where V is small beside U, except where XLA's GEMM would pad V every call
  (up to pv_xla_pad_max_m rows, r >= pv_xla_pad_min_r not a multiple of pv_xla_r_align);
  else the kernel (phase 2 in the same launch). Where the caller passes an output buffer,
  XLA cannot write into it: the kernel then applies V in place of XLA."""
  T = _t()
  small_v = k >= max(T.pv_xla_min_k, T.pv_xla_k_over_n * n)
  if r * n <= T.pv_launch_max_v and (
    m >= T.pv_launch_min_m or (m >= T.pv_launch_small_v_min_m and small_v)
  ):
    return "launch"
  xla_pads_v = r % T.pv_xla_r_align != 0 and r >= T.pv_xla_pad_min_r and m <= T.pv_xla_pad_max_m
  if (
    (m >= T.pv_xla_min_m or (m > T.pv_xla_min_m // 2 and small_v))
    and not out_given
    and not xla_pads_v
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


def _xuv_decode(
  x,
  u,
  v,
  bias=None,
  *,
  out_dtype=None,
  block_sizes: TiledBlockSizes | None = None,
  out=None,
  xla_zeroing: bool | None = None,
  stages: int = 3,
  persistent: bool | planner.PersistentDecodePlan | None = None,
  pv: str | None = None,
  pv_plan: planner.PvLaunchPlan | None = None,
  probe: int = 0,
  scale=None,
  scaled_dtype=None,
  residual=None,
):
  """``xuv_decode`` with every schedule option (tests, and the benchmarks through
  benchmarks/kernel_variants.py).

  ``xla_zeroing``: zero the scratch with an XLA op aliased into the call instead of
  jax-triton's memset inside the custom call (default: yes unless ``out`` is given or
  ``launch.xla_zeroing()`` says no).
  ``persistent``: the persistent schedule (True, or a ``planner.PersistentDecodePlan``) or
  the tiled one (False; ``block_sizes``, a TiledBlockSizes, applies to it); default:
  persistent up to the table's ``persistent_max_m`` rows where the SM count is known.
  ``pv``: who applies V on the persistent schedule: "kernel" (phase 2 in the same launch),
  "xla" (the kernel ends with P = X·U, rounded once in the kernel or, without the plan's
  p16, by XLA from the f32 sums; then XLA's GEMM multiplies it by V, as XLA's own lowering
  does) or "launch" (phase 1 alone, then the ·V launch, xuv_decode_pv.py, reads the f32
  sums where they are and writes y, into ``out`` if given); default: ``default_pv``.
  ``pv_plan``: the ·V launch's tiles (pv="launch"; default ``planner.plan_pv_launch``).
  Timing probes (the output is then wrong): ``stages`` (tiled: 1 streams stage 1 alone, 2
  stage 2 alone) and ``probe``, the persistent kernel's PROBE bits.
  ``scale`` [r] (rank-space, as ``lr_xuv``'s): only with ``pv="xla"`` on the persistent
  schedule (the default then): the kernel writes P = X·U and XLA applies the scale, rounds to
  ``scaled_dtype`` (default v's dtype) and multiplies by V, as the reference does.
  ``residual`` [..., N] (out_dtype; no bias): y + residual, added where y is stored.
  """
  x2, lead, (m, k, r, n), out_dtype = unpack_xuv_args(x, u, v, out_dtype)
  b, has_b = residual_operand(residual, bias, lead, n, out_dtype)
  if scale is not None:
    if tuple(scale.shape) != (r,):
      raise ValueError(f"scale {scale.shape} must be ({r},), the rank")
    if pv not in (None, "xla") or persistent is False:
      raise ValueError("a rank-space scale is applied by XLA after phase 1: pv='xla' only")
    if m > _t().persistent_max_m or num_sms() <= 0:
      raise ValueError(
        f"a rank-space scale needs the persistent schedule (M={m} <= "
        f"{_t().persistent_max_m} rows and a known SM count)"
      )
    persistent, pv = persistent or True, "xla"
  if probe & 4:
    raise ValueError(
      "probe bit 4 (per-CTA clock stamps) writes into the kernel's o_in_ptr "
      "operand; only a launch that passes a trace buffer there may set it"
    )
  if pv not in (None, "kernel", "xla", "launch"):
    raise ValueError(f"{pv=} must be 'kernel', 'xla', 'launch' or None (by rows)")
  if pv_plan is not None and pv != "launch":
    raise ValueError("pv_plan= applies to pv='launch'")
  if persistent is None:
    persistent = (
      m <= _t().persistent_max_m and block_sizes is None and stages == 3 and num_sms() > 0
    )
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
  b = b if has_b else v  # never read without HAS_BIAS
  if persistent:
    if block_sizes is not None or stages != 3:
      raise ValueError(
        "block_sizes= and stages= apply to the tiled schedule "
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
    plan = persistent_launch_plan(m, k, r, n, has_b, p, pv == "kernel", probe)
    kernel, warps, num_stages = _xuv_decode_persistent_kernel, p.warps, p.stages
  else:
    if pv in ("xla", "launch") or probe:
      raise ValueError("pv='xla', pv='launch' and probe= apply to the persistent schedule")
    pv = "kernel"
    bs = block_sizes or TiledBlockSizes.get_default(m, k, r, n)
    if bs.block_m < m:
      raise ValueError(f"{bs.block_m=} must cover the {m} rows; use xuv_prefill for large M")
    if stages not in (1, 2, 3):
      raise ValueError(f"{stages=} must be 1, 2 or 3")
    plan = launch_plan(m, k, r, n, has_b, bs, stages)
    kernel, warps, num_stages = _xuv_decode_kernel, bs.num_warps, bs.num_stages
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
    num_stages=num_stages,
    name="lrjax_xuv_decode",
    **plan["meta"],
  )
  if pv == "launch":  # ·V in a launch of its own, reading P's f32 sums where phase 1 left them
    y = xuv_decode_pv(
      outs[0],
      v,
      bias,
      m=m,
      out_dtype=out_dtype,
      block_sizes=pv_plan,
      out=pv_out,
      residual=None if residual is None else b,  # [M, N]
    )
    return y.reshape(*lead, n)
  if pv == "xla":
    from lrjax.lowering.primitives import apply_scale, rank_space_out

    if p.p16:  # P rounded once in the kernel
      pm = outs[2].reshape(m, r)
    else:  # P's f32 sums: the call's scratch, P alone (chained: the half it worked in),
      # rounded here by XLA in a loop fusion of its own
      pm = outs[0].reshape(m, r).astype(v.dtype)
    pm = apply_scale(pm, scale, jnp.dtype(scaled_dtype or v.dtype))
    y = rank_space_out(pm, v, bias, out_dtype).reshape(*lead, n)
    return residual_reference(y, residual)
  return outs[1].reshape(*lead, n)


def xuv_decode(
  x,
  u,
  v,
  bias=None,
  *,
  out_dtype=None,
  block_sizes: BlockSizes | None = None,
  out=None,
  scale=None,
  scaled_dtype=None,
  residual=None,
):
  """y = ((x·u) ⊙ scale)·v (+ bias) (+ residual) for few tokens. x [..., K], u [K, r],
  v [r, N], bias [N], scale [r] (optional; up to the persistent schedule's rows, phase 1 in
  the kernel and the scale and ·V by XLA), residual [..., N] in the output dtype (optional, no
  bias with it; added as each output tile is stored: y rounded, then residual + y as XLA
  adds them).

  ``block_sizes``: the schedule (default ``BlockSizes.get_default``, the tuning table's).
  ``out`` [M, N]: optional buffer the kernel writes into (aliased).
  """
  kw = dict(out_dtype=out_dtype, residual=residual)
  if scale is not None:
    if block_sizes is not None or out is not None:
      raise ValueError("block_sizes= and out= do not apply with a scale (pv='xla')")
    return _xuv_decode(x, u, v, bias, scale=scale, scaled_dtype=scaled_dtype, **kw)
  if block_sizes is None:
    return _xuv_decode(x, u, v, bias, out=out, **kw)
  return _xuv_decode(
    x,
    u,
    v,
    bias,
    out=out,
    persistent=block_sizes.plan,
    pv=block_sizes.pv,
    pv_plan=block_sizes.pv_plan,
    **kw,
  )


def xuv_decode_reference(
  x, u, v, bias=None, *, out_dtype=None, scale=None, scaled_dtype=None, residual=None
):
  """f32-accumulating ((x·u) ⊙ scale)·v (+ bias) (+ residual); X·U rounded to v's dtype as
  the kernel does, the scaled product to ``scaled_dtype`` (default v's dtype)."""
  from lrjax.lowering.primitives import lr_xuv_reference

  y = lr_xuv_reference(
    x,
    u,
    v,
    bias,
    scale=scale,
    inter_dtype=v.dtype,
    out_dtype=out_dtype or x.dtype,
    scaled_dtype=None if scale is None else (scaled_dtype or v.dtype),
  )
  return residual_reference(y, residual)
