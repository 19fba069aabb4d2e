"""Fused low-rank (Swi)GLU MLP for many tokens: one persistent launch, four phases per
row block, intermediates only in an L2-sized ring (never a [T, D_ff] tensor).

  A  [Pg | Pu] = X·[Ug | Uu]         one pass over X: each tile computes both factors
  B  H = act(Pg·Vg + bg) ⊙ (Pu·Vu + bu)   the activation fused into the dual GEMM
  C  S = H·Ud                         H consumed B_M rows at a time, straight from the ring
  D  Y = S·Vd + bd

Why not FlashSVD-V2's one-tile-does-everything: projecting an [B_M, B_F] tile of H into the
down rank needs an [B_M, r_d] accumulator per CTA (B_M=128, r_d=2560: 1.3 MB, six SMs'
worth of registers), or f32 atomics of size T·r_d·D_ff/B_F (1.2 G adds at T=4096).
The decode kernel (mlp_decode.py) does the atomics because there they are T·r_d·D_ff/B_F
<= 16·2560·112. Here each B_M x D_ff strip of H is written once to a ring slot of
``G·B_M`` rows. The phase-C tiles of those rows read it back from L2, and the slot is
reused ``ring`` super-blocks later. The strips of P and S are ringed the same way. So
scratch memory is ``ring·G·B_M·(2r + D_ff + r_d)`` elements, independent of T, and every
element of H is produced once and consumed once.

Dependencies are per row block, with release/acquire flags as in xuv_prefill.py. Phase
X of row block m waits for phase X-1 of m. It also waits for phase X+1 of row block
m - ring·G before overwriting that row block's slot. Tiles come from a host-built
schedule: step s = [C(s-2), A(s), B(s-1), D(s-3)] over super-blocks. Every
dependency points to an earlier step, so the persistent grid cannot deadlock.

The tuned configs claim tiles in schedule order from an atomic counter (``dynamic``): a
round-robin split by program id piles the long phase-C tiles (K = D_ff) onto a few CTAs,
and claiming them was worth 7-27 % at T=1024-4096. Phase B then runs in 128 x 256 tiles with one
accumulator (``wide_b``): the gate pass parks act(Pg·Vg) in the tile's own place in the H
ring, the up pass reads it back and multiplies. ``split_c`` cuts phase C's reduction into
chunks (f32 atomics; the last chunk writes S and re-zeroes its accumulator).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from lrjax.custom_calls.triton import launch, planner, policy
from lrjax.custom_calls.triton._common import (
  ACT_CODES,
  activation,
  check_out,
  first_tile,
  mm_acc,
  mm_acc2,
  next_tile,
  ring_tile,
  signal,
  swiglu_epilogue,
  tile_codes,
  unpack_mlp_args,
  wait_at_least,
)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  block_m: int
  block_n: int  # output columns per tile of phases A and B (two accumulators each)
  block_k: int  # reduction step (all phases)
  group_m: int  # row blocks per super-block (one ring slot)
  ring: int = 2
  num_warps: int = 8
  num_stages: int = 3
  programs: int = 132
  block_n_cd: int = 0  # output columns per tile of phases C and D (one accumulator); 0: block_n
  # phase B in tiles as wide as C and D's: gate then up, one accumulator, act(gate) parked
  # in the tile's own place in the H ring between the two passes
  wide_b: bool = False
  # tiles claimed in schedule order from an atomic counter (else round-robin by program id)
  dynamic: bool = False
  # phase C's reduction over D_ff cut into this many chunks (shorter tiles; f32 atomics, the
  # last chunk of a tile writes S and re-zeroes its accumulator for the slot's next user)
  split_c: int = 1

  @classmethod
  def get_default(cls, m: int, d: int, f: int, r: int, rd: int, gated: bool) -> BlockSizes:
    """The tuning table's blocks by shape class (``mlp_prefill`` tiles), else
    ``planner.plan_prefill``'s; as many pipeline stages as fit shared memory."""
    key = f"{'m>512' if m > 512 else 'm<=512'},{'r>=2048' if r >= 2048 else 'r<2048'}"
    t = policy.tiles("mlp_prefill").get(key)
    if t is not None:
      t = cls(**t)
    else:
      widths = ((2 * r) if gated else r, f, rd)
      p = planner.plan_prefill(m, r, widths, ring=2)
      t = cls(p.block_m, p.block_n, p.block_k, p.group_m, 2, p.warps, p.stages, p.programs)
    n_mb = planner.cdiv(m, t.block_m)
    stages = max(2, min(t.num_stages, int(0.9 * planner.H200.smem_per_cta // t.stage_bytes())))
    return dataclasses.replace(t, group_m=max(1, min(t.group_m, n_mb)), num_stages=stages)

  def stage_bytes(self) -> int:
    """Shared memory per pipeline stage of the widest phase (eq. 11 per phase): A loads one
    X tile and two factor tiles, the dual-accumulator B two of each, the others one of each."""
    bm, bn, bk = self.block_m, self.block_n, self.block_k
    bw = self.block_n_cd or bn
    one = planner.pipeline_smem_bytes(bm, bw, bk, 1)
    phase_a = 2 * (bm * bk + 2 * bk * bn)
    phase_b = one if self.wide_b else 2 * planner.pipeline_smem_bytes(bm, bn, bk, 1)
    return max(one, phase_a, phase_b)


@triton.jit
def _wait(flag_ptr, target, WAITS: tl.constexpr):
  if WAITS:  # off only when timing some phases alone (the others never signal)
    wait_at_least(flag_ptr, target)


@triton.jit
def _mlp_prefill_kernel(
  x_ptr,  # [M, D] activations
  ug_ptr,
  vg_ptr,
  bg_ptr,  # [D, R], [R, F], [F] gate (unread if not GATED)
  uu_ptr,
  vu_ptr,
  bu_ptr,  # [D, R], [R, F], [F] up
  ud_ptr,
  vd_ptr,
  bd_ptr,  # [F, RD], [RD, DO], [DO] down
  sched_ptr,  # [T] i32 tile codes: phase << 28 | row block << 14 | column block
  o_in_ptr,  # [M, DO] caller's output buffer aliased to o_ptr (else x; never read)
  p_ring,  # [RING*G*BLOCK_M, 2R] (gated) or [.., R]: X·Ug | X·Uu strips
  h_ring,  # [RING*G*BLOCK_M, F] activation strips
  s_ring,  # [RING*G*BLOCK_M, RD] down-rank strips
  sacc_ring,  # [RING*G*BLOCK_M, RD] f32 phase-C partial sums (SPLIT_C > 1), zeroed
  flags_ptr,  # [4 * n_mb + 1 + RING*G*n_s] i32, zeroed: parts done per phase and row
  # block, the tile counter (DYNAMIC), phase-C chunks done per slot tile
  o_ptr,  # [M, DO] output
  M: tl.constexpr,
  D: tl.constexpr,
  R: tl.constexpr,
  F: tl.constexpr,
  RD: tl.constexpr,
  DO: tl.constexpr,
  NMB: tl.constexpr,
  GATED: tl.constexpr,
  ACT: tl.constexpr,
  HAS_BG: tl.constexpr,
  HAS_BU: tl.constexpr,
  HAS_BD: tl.constexpr,
  T: tl.constexpr,
  PROGRAMS: tl.constexpr,
  G: tl.constexpr,
  RING: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_N: tl.constexpr,
  BLOCK_K: tl.constexpr,
  BLOCK_NW: tl.constexpr,  # phases C and D: one accumulator, so wider tiles fit
  WIDE_B: tl.constexpr,  # phase B in BLOCK_NW-wide tiles, gate and up in two passes
  DYNAMIC: tl.constexpr,  # tiles claimed from a counter (else round-robin)
  SPLIT_C: tl.constexpr,
  K_PER_C: tl.constexpr,  # phase-C reduction chunks, their length
  WAITS: tl.constexpr,  # False: timing only, no dependencies honoured (wrong output)
  EVEN_D: tl.constexpr,
  EVEN_R: tl.constexpr,
  EVEN_F: tl.constexpr,
  EVEN_RD: tl.constexpr,
):
  PW: tl.constexpr = 2 * R if GATED else R
  BW_B: tl.constexpr = BLOCK_NW if WIDE_B else BLOCK_N
  n_r = (R + BLOCK_N - 1) // BLOCK_N
  n_f = (F + BW_B - 1) // BW_B
  n_s = (RD + BLOCK_NW - 1) // BLOCK_NW
  n_n = (DO + BLOCK_NW - 1) // BLOCK_NW
  SLOT: tl.constexpr = G * RING
  counter = flags_ptr + 4 * NMB
  chunks_done = counter + 1
  t = first_tile(counter, DYNAMIC)
  while t < T:
    phase, mb, offs_m, m_mask, rows, j = ring_tile(tl.load(sched_ptr + t), M, G, RING, BLOCK_M)
    offs_c = j * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = j * BLOCK_NW + tl.arange(0, BLOCK_NW)
    if phase == 0:
      # A: [Pg | Pu] columns j of row block mb; the slot's last user was B of mb - SLOT
      if mb >= SLOT:
        _wait(flags_ptr + NMB + mb - SLOT, n_f, WAITS)
      c_mask = offs_c < R
      acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
      if GATED:
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_g, acc_u = mm_acc2(
          acc_g,
          acc_u,
          x_ptr,
          x_ptr,
          ug_ptr,
          uu_ptr,
          offs_m,
          offs_c,
          m_mask,
          c_mask,
          0,
          D,
          D,
          D,
          R,
          BLOCK_K,
          EVEN_D,
          False,
          True,
        )
        tl.store(
          p_ring + rows[:, None] * PW + offs_c[None, :],
          acc_g.to(p_ring.dtype.element_ty),
          mask=c_mask[None, :],
        )
        tl.store(
          p_ring + rows[:, None] * PW + R + offs_c[None, :],
          acc_u.to(p_ring.dtype.element_ty),
          mask=c_mask[None, :],
        )
      else:
        acc_u = mm_acc(
          acc_u,
          x_ptr,
          uu_ptr,
          offs_m,
          offs_c,
          m_mask,
          c_mask,
          0,
          D,
          D,
          D,
          R,
          BLOCK_K,
          EVEN_D,
          False,
        )
        tl.store(
          p_ring + rows[:, None] * PW + offs_c[None, :],
          acc_u.to(p_ring.dtype.element_ty),
          mask=c_mask[None, :],
        )
      signal(flags_ptr + mb)
    elif phase == 1:
      # B: H columns j = act(Pg·Vg + bg) ⊙ (Pu·Vu + bu); slot's last user was C of mb - SLOT
      _wait(flags_ptr + mb, n_r, WAITS)
      if mb >= SLOT:
        _wait(flags_ptr + 2 * NMB + mb - SLOT, n_s * SPLIT_C, WAITS)
      if WIDE_B:
        f_mask = offs_w < F
        h_tile = h_ring + rows[:, None] * F + offs_w[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_NW], tl.float32)
        if GATED:  # act(gate) parked in this tile's H, read back (same CTA) after the up pass
          acc = mm_acc(
            acc, p_ring, vg_ptr, rows, offs_w, m_mask, f_mask, 0, R, R, PW, F, BLOCK_K, EVEN_R, True
          )
          if HAS_BG:
            acc += tl.load(bg_ptr + offs_w, mask=f_mask, other=0.0).to(tl.float32)[None, :]
          tl.store(h_tile, activation(acc, ACT).to(h_ring.dtype.element_ty), mask=f_mask[None, :])
          tl.debug_barrier()
          acc = tl.zeros([BLOCK_M, BLOCK_NW], tl.float32)
        acc = mm_acc(
          acc,
          p_ring + (R if GATED else 0),
          vu_ptr,
          rows,
          offs_w,
          m_mask,
          f_mask,
          0,
          R,
          R,
          PW,
          F,
          BLOCK_K,
          EVEN_R,
          True,
        )
        if HAS_BU:
          acc += tl.load(bu_ptr + offs_w, mask=f_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
          h = tl.load(h_tile, mask=f_mask[None, :], other=0.0).to(tl.float32) * acc
        else:
          h = activation(acc, ACT)
        tl.store(h_tile, h.to(h_ring.dtype.element_ty), mask=f_mask[None, :])
      else:
        c_mask = offs_c < F
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # unused unless GATED
        if GATED:
          acc_g, acc_u = mm_acc2(
            acc_g,
            acc_u,
            p_ring,
            p_ring + R,
            vg_ptr,
            vu_ptr,
            rows,
            offs_c,
            m_mask,
            c_mask,
            0,
            R,
            R,
            PW,
            F,
            BLOCK_K,
            EVEN_R,
            True,
            False,
          )
        else:
          acc_u = mm_acc(
            acc_u,
            p_ring,
            vu_ptr,
            rows,
            offs_c,
            m_mask,
            c_mask,
            0,
            R,
            R,
            PW,
            F,
            BLOCK_K,
            EVEN_R,
            True,
          )
        h = swiglu_epilogue(
          acc_g, acc_u, bg_ptr, bu_ptr, offs_c, c_mask, GATED, ACT, HAS_BG, HAS_BU
        )
        tl.store(
          h_ring + rows[:, None] * F + offs_c[None, :],
          h.to(h_ring.dtype.element_ty),
          mask=c_mask[None, :],
        )
      signal(flags_ptr + NMB + mb)
    elif phase == 2:
      # C: S columns j = H·Ud; slot's last user was D of mb - SLOT
      _wait(flags_ptr + NMB + mb, n_f, WAITS)
      if mb >= SLOT:
        _wait(flags_ptr + 3 * NMB + mb - SLOT, n_n, WAITS)
      jc = j // SPLIT_C
      kc = j % SPLIT_C
      offs_s = jc * BLOCK_NW + tl.arange(0, BLOCK_NW)
      s_mask = offs_s < RD  # (a branch-local name: Triton types each name once per if)
      acc = tl.zeros([BLOCK_M, BLOCK_NW], tl.float32)
      acc = mm_acc(
        acc,
        h_ring,
        ud_ptr,
        rows,
        offs_s,
        m_mask,
        s_mask,
        kc * K_PER_C,
        tl.minimum(kc * K_PER_C + K_PER_C, F),
        F,
        F,
        RD,
        BLOCK_K,
        EVEN_F,
        True,
      )
      s_off = rows[:, None] * RD + offs_s[None, :]
      if SPLIT_C == 1:
        tl.store(s_ring + s_off, acc.to(s_ring.dtype.element_ty), mask=s_mask[None, :])
      else:
        tl.atomic_add(sacc_ring + s_off, acc, mask=s_mask[None, :], sem="relaxed")
        tl.debug_barrier()
        sem = chunks_done + (mb % SLOT) * n_s + jc
        if tl.atomic_add(sem, 1, sem="acq_rel", scope="gpu") == SPLIT_C - 1:
          tot = tl.load(sacc_ring + s_off, mask=s_mask[None, :], other=0.0, cache_modifier=".cg")
          tl.store(s_ring + s_off, tot.to(s_ring.dtype.element_ty), mask=s_mask[None, :])
          tl.store(sacc_ring + s_off, tl.zeros_like(tot), mask=s_mask[None, :])
          tl.atomic_xchg(sem, 0, sem="relaxed")
      signal(flags_ptr + 2 * NMB + mb)
    else:
      # D: Y columns j = S·Vd + bd
      _wait(flags_ptr + 2 * NMB + mb, n_s * SPLIT_C, WAITS)
      w_mask = offs_w < DO
      acc = tl.zeros([BLOCK_M, BLOCK_NW], tl.float32)
      acc = mm_acc(
        acc, s_ring, vd_ptr, rows, offs_w, m_mask, w_mask, 0, RD, RD, RD, DO, BLOCK_K, EVEN_RD, True
      )
      if HAS_BD:
        acc += tl.load(bd_ptr + offs_w, mask=w_mask, other=0.0).to(tl.float32)[None, :]
      tl.store(
        o_ptr + offs_m[:, None] * DO + offs_w[None, :],
        acc.to(o_ptr.dtype.element_ty),
        mask=m_mask[:, None] & w_mask[None, :],
      )
      signal(flags_ptr + 3 * NMB + mb)
    t = next_tile(counter, t, PROGRAMS, DYNAMIC)


def schedule(m: int, r: int, f: int, rd: int, d_out: int, bs: BlockSizes, xp=np, phases: int = 15):
  """Tile codes in dependency order: step s = [C(s-2), A(s), B(s-1), D(s-3)].

  The long-K phase-C tiles (K = D_ff) go first in each step, so they do not trail it.
  ``phases`` (timing only): bits 1, 2, 4, 8 keep phases A, B, C, D.
  """
  n_mb = planner.cdiv(m, bs.block_m)
  bw = bs.block_n_cd or bs.block_n
  widths = [
    planner.cdiv(r, bs.block_n),
    planner.cdiv(f, bw if bs.wide_b else bs.block_n),
    planner.cdiv(rd, bw) * bs.split_c,
    planner.cdiv(d_out, bw),
  ]
  if n_mb >= 1 << 14 or max(widths) >= 1 << 14:
    raise ValueError(f"{m=}, {r=}, {f=}, {rd=}, {d_out=} exceed the 14-bit tile code fields")
  n_sb = planner.cdiv(n_mb, bs.group_m)
  pieces = []
  for s in range(n_sb + 3):
    for phase in (2, 0, 1, 3):
      sb = s - phase
      if 0 <= sb < n_sb and (phases >> phase) & 1:
        g = min(bs.group_m, n_mb - sb * bs.group_m)
        pieces.append(tile_codes(xp, phase, sb * bs.group_m, g, widths[phase], True))
  return xp.concatenate(pieces)


def launch_plan(
  m,
  d,
  r,
  f,
  rd,
  d_out,
  *,
  gated,
  act,
  bias_mask,
  bs: BlockSizes,
  xp=np,
  phases: int = 15,
  waits: bool = True,
) -> dict:
  if bs.split_c < 1:
    raise ValueError(f"split_c={bs.split_c}: expected >= 1 chunks of phase C's reduction")
  if phases not in range(1, 16):
    raise ValueError(f"{phases=} must be in 1..15 (bits 1, 2, 4, 8: phases A, B, C, D)")
  sched = schedule(m, r, f, rd, d_out, bs, xp, phases)
  n_mb = planner.cdiv(m, bs.block_m)
  ring = min(bs.ring, planner.cdiv(n_mb, bs.group_m))
  n_s = planner.cdiv(rd, bs.block_n_cd or bs.block_n)
  k_per_c = planner.part_len(f, bs.split_c, bs.block_k)
  has = dict(zip(("bg", "bu", "bd") if gated else ("bu", "bd"), bias_mask))
  programs = min(bs.programs, len(sched))
  meta = dict(
    M=m,
    D=d,
    R=r,
    F=f,
    RD=rd,
    DO=d_out,
    NMB=n_mb,
    GATED=gated,
    ACT=ACT_CODES[act],
    HAS_BG=has.get("bg", False),
    HAS_BU=has["bu"],
    HAS_BD=has["bd"],
    T=len(sched),
    PROGRAMS=programs,
    G=bs.group_m,
    RING=ring,
    BLOCK_M=bs.block_m,
    BLOCK_N=bs.block_n,
    BLOCK_K=bs.block_k,
    BLOCK_NW=bs.block_n_cd or bs.block_n,
    WIDE_B=bool(bs.wide_b),
    DYNAMIC=bool(bs.dynamic),
    SPLIT_C=bs.split_c,
    K_PER_C=k_per_c,
    WAITS=waits and phases == 15,
    EVEN_D=d % bs.block_k == 0,
    EVEN_R=r % bs.block_k == 0,
    EVEN_F=f % bs.block_k == 0,
    EVEN_RD=rd % bs.block_k == 0,
  )
  ring_rows = ring * bs.group_m * bs.block_m
  return dict(
    sched=sched,
    n_mb=n_mb,
    ring_rows=ring_rows,
    programs=programs,
    meta=meta,
    sacc_shape=(ring_rows, rd) if bs.split_c > 1 else (1, 1),
    n_flags=4 * n_mb + 1 + ring * bs.group_m * n_s,
  )


def _mlp_prefill(
  x,
  up,
  down,
  gate=None,
  *,
  act="silu",
  out_dtype=None,
  block_sizes: BlockSizes | None = None,
  out=None,
  phases: int = 15,
  waits: bool = True,
):
  """``mlp_prefill`` with its timing probes (benchmarks/kernel_variants.py): ``phases``, bits
  1, 2, 4, 8 run phases A, B, C, D; with fewer than all four, or ``waits=False``, no tile
  waits for another and the output is wrong."""
  gated = gate is not None
  x2, lead, (d, r, f, rd, d_out), bias_mask, ops = unpack_mlp_args(x, up, down, gate, act)
  m = x2.shape[0]
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  bs = block_sizes or BlockSizes.get_default(m, d, f, r, rd, gated)
  plan = launch_plan(
    m,
    d,
    r,
    f,
    rd,
    d_out,
    gated=gated,
    act=act,
    bias_mask=bias_mask,
    bs=bs,
    xp=jnp,
    phases=phases,
    waits=waits,
  )
  ops = ops + (plan["sched"],)
  rr = plan["ring_rows"]
  dt = ops[5].dtype  # vu
  check_out(out, (m, d_out), out_dtype)
  outs = launch.triton_call(
    *ops,
    x2 if out is None else out,
    kernel=_mlp_prefill_kernel,
    out_shape=(
      jax.ShapeDtypeStruct((rr, 2 * r if gated else r), dt),
      jax.ShapeDtypeStruct((rr, f), dt),
      jax.ShapeDtypeStruct((rr, rd), dt),
      jax.ShapeDtypeStruct(plan["sacc_shape"], jnp.float32),
      jax.ShapeDtypeStruct((plan["n_flags"],), jnp.int32),
      jax.ShapeDtypeStruct((m, d_out), out_dtype),
    ),
    grid=(plan["programs"],),
    zeroed_outputs=(3, 4),
    input_output_aliases={11: 5} if out is not None else None,
    num_warps=bs.num_warps,
    num_stages=bs.num_stages,
    name="lrjax_mlp_prefill",
    **plan["meta"],
  )
  return outs[-1].reshape(*lead, d_out)


def mlp_prefill(
  x,
  up,
  down,
  gate=None,
  *,
  act="silu",
  out_dtype=None,
  block_sizes: BlockSizes | None = None,
  out=None,
):
  """Low-rank (Swi)GLU MLP for many tokens; ``up``/``down``/``gate`` are (u, v) or (u, v,
  bias), as in ``mlp_decode``. ``out`` [M, D_out]: optional buffer the kernel writes into
  (aliased)."""
  return _mlp_prefill(
    x, up, down, gate, act=act, out_dtype=out_dtype, block_sizes=block_sizes, out=out
  )


def mlp_prefill_reference(x, up, down, gate=None, *, act="silu", out_dtype=None):
  """Same function as the decode kernel's reference (the roundings are the same)."""
  from lrjax.custom_calls.triton.mlp_decode import mlp_decode_reference

  return mlp_decode_reference(x, up, down, gate, act=act, out_dtype=out_dtype)
