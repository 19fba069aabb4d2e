"""Several decode X·U_i·V_i sharing X (q/k/v projections), in one persistent launch.

The persistent X·U·V decode kernel's dataflow (xuv_decode.py), per member: phase 1 streams
every U_i, each member's split-K tiles one after another over all CTAs (f32 atomics into its
P_i, then its counter); phase 2 streams every V_i, each tile waiting only for its own
member's X·U_i. One launch reads X once and keeps the HBM busy across the three projections,
where XLA runs one merged GEMM for X·[U_q | U_k | U_v] and then one small GEMM per member.

``pv="xla"`` runs phase 1 alone (up to 128 rows): every P_i is left as f32 sums side by side
in the scratch and XLA rounds each and applies V_i with its GEMM, as ``xuv_decode`` does for
one member from 64 rows. The composed MLP (mlp_decode.py) runs its gate and up projections so.
Members of one rank and tiles go through one phase-1 call site (``GroupDecodePlan.one_branch``):
one pipeline in shared memory instead of one a member.
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
  join_chain,
  leave_chain,
  norm_operands,
  normed_reference,
  num_sms,
  prefetch_splitk_tile,
  prefetch_l2,
  row_scale,
  splitr_out_tile,
  unpack_xuv_args,
  wait_at_least,
  xu_tile,
)
from lrjax.custom_calls.triton.lowering import GROUP_MAX_M, XUV_DECODE_MAX_M

MAX_M = XUV_DECODE_MAX_M  # rows phase 1 alone serves (pv="xla"); with phase 2: GROUP_MAX_M


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Who applies the V_i ("kernel": phase 2 in the same launch; "xla": phase 1 alone, then
  XLA's GEMMs) and the grouped kernel's tiles."""

  pv: str
  plan: planner.GroupDecodePlan

  @classmethod
  def get_default(
    cls, m: int, k: int, members, *, pv: str = "kernel", programs: int | None = None
  ) -> BlockSizes:
    """``members``: [(r_i, N_i)]; ``programs``: the CTAs (None: this GPU's SMs)."""
    plan_fn = planner.plan_decode_group if pv == "kernel" else planner.plan_decode_group_phase1
    return cls(pv, plan_fn(m, k, list(members), programs=programs or num_sms()))


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
  NORM: tl.constexpr,
  g_ptr,
  sq_ptr,
):
  """Phase-1 tile t of one member of the group (its r-blocks form one chunk); with NORM,
  X·g streamed, and r-block 0's tiles add X's squares to the member's sq_ptr."""
  xu_tile(
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
    False,
    True,
    NORM,
    g_ptr,
    sq_ptr,
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
  NORM: tl.constexpr,
  sq_ptr,
  K: tl.constexpr,
  EPS: tl.constexpr,
):
  """Phase-2 tile q (a column block of ·V) of one member, once its whole X·U is in (every
  split-K tile of its r-blocks signalled); with NORM, each row times rms_norm's scale."""
  n_rb = (R + COLS_R - 1) // COLS_R
  wait_at_least(flag_ptr, n_rb * SPLIT)
  offs_m = tl.arange(0, BLOCK_M)
  rs = tl.zeros([BLOCK_M], tl.float32)
  if NORM:
    rs = row_scale(sq_ptr, offs_m, offs_m < M, K, EPS)
  splitr_out_tile(
    q,
    0,
    p_ptr,
    v_ptr,
    b_ptr,
    p_ptr,
    flag_ptr,
    o_ptr,
    M,
    R,
    N,
    n_rb * COLS_R,
    1,
    HAS_BIAS,
    BLOCK_M,
    BLOCK_N,
    BLOCK_KV,
    EVEN_R,
    COLS_N,
    NORM,
    rs,
  )


@triton.jit
def _xuv_decode_group_kernel(
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
  g_ptr,  # [K] the norm's weight with NORM (else x, never read)
  s_in_ptr,  # the zeroed scratch, aliased to scratch_ptr; never read
  o0_in_ptr,
  o1_in_ptr,
  o2_in_ptr,  # callers' output buffers aliased to o*_ptr, or x; never read
  M,
  clear_off,
  clear_n,  # as in _xuv_decode_kernel
  scratch_ptr,  # f32: P_0 [M, R0], P_1 [M, R1], P_2 [M, R2], then (i32) one flag a member,
  # then (f32, NORM) each member's sums of X's squares [3, M]
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
  # its U_i chosen at run time (one pipeline in shared memory, not one a member)
  NORM: tl.constexpr,  # X is rms-normalised (weight g, epsilon EPS) as phase 1 loads it
  EPS: tl.constexpr,
  WORK_OFF: tl.constexpr = 0,  # as in _xuv_decode_kernel
  PDL: tl.constexpr = 0,  # as in _xuv_decode_kernel
):
  """Several X·U_i·V_i sharing X, one persistent launch: phase 1 streams every U_i
  (split-K tiles of all members, one after another), phase 2 every V_i (each tile waits
  only for its own member's X·U_i). The persistent kernel's dataflow, per member. With NORM
  phase 1 streams X·g and its r-block-0 tiles sum X's squares in the same loads; phase 2
  scales each row of P_i·V_i by rms_norm's 1/rms once its member is in."""
  pid = tl.program_id(0)
  if PDL >= 2:  # before the wait: the first rows of this CTA's first phase-1 tile
    if pid < A0:
      prefetch_splitk_tile(u0_ptr, pid, K, R0, KP0, S0, CR0, True)
    elif pid < A0 + A1:
      prefetch_splitk_tile(u1_ptr, pid - A0, K, R1, KP1, S1, CR1, True)
    elif pid < A0 + A1 + A2:
      prefetch_splitk_tile(u2_ptr, pid - A0 - A1, K, R2, KP2, S2, CR2, True)
  chain_ptr = scratch_ptr
  scratch_ptr = join_chain(scratch_ptr, WORK_OFF, PDL)
  p0_ptr = scratch_ptr
  p1_ptr = p0_ptr + M * R0
  p2_ptr = p1_ptr + M * R1
  flag_ptr = (p2_ptr + M * R2).to(tl.pointer_type(tl.int32))
  sq_ptr = (flag_ptr + 3).to(tl.pointer_type(tl.float32))  # NORM: [3, M] X's squares, summed
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
        NORM,
        g_ptr,
        sq_ptr + j * M,
      )
  else:
    for t in range(pid, A0 + A1 + A2, PROGRAMS):  # phase 1: never waits
      if t < A0:
        _group_phase1(
          t,
          x_ptr,
          u0_ptr,
          p0_ptr,
          flag_ptr,
          offs_m,
          m_mask,
          K,
          R0,
          KP0,
          S0,
          BLOCK_K,
          BR0,
          CR0,
          NORM,
          g_ptr,
          sq_ptr,
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
          NORM,
          g_ptr,
          sq_ptr + M,
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
          NORM,
          g_ptr,
          sq_ptr + 2 * M,
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
        NORM,
        sq_ptr,
        K,
        EPS,
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
        NORM,
        sq_ptr + M,
        K,
        EPS,
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
        NORM,
        sq_ptr + 2 * M,
        K,
        EPS,
      )
  leave_chain(chain_ptr, clear_off, clear_n)


def launch_plan(m: int, k: int, members, p: planner.GroupDecodePlan, phase2: bool = True) -> dict:
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
    NORM=0,  # the wrapper's norm= sets NORM and EPS
    EPS=0.0,
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
  return dict(meta=meta, scratch=m * sum(r for r, *_ in full) + 3 + 3 * m)


def _xuv_decode_group(
  x,
  members,
  *,
  out_dtype=None,
  out=None,
  plan: planner.GroupDecodePlan | None = None,
  pv: str = "kernel",
  norm=None,
):
  """``xuv_decode_group`` on a given plan and ``pv``: "kernel" (each V_i applied in the same
  launch, up to GROUP_MAX_M rows) or "xla" (phase 1 alone, up to MAX_M rows: every P_i in one
  launch, then XLA rounds each and its GEMM applies V_i; default plan
  ``planner.plan_decode_group_phase1``). ``norm``: (weight [K], eps), rms_norm of X (as
  xuv_decode_group)."""
  if pv not in ("kernel", "xla"):
    raise ValueError(f"{pv=} must be 'kernel' or 'xla'")
  if pv == "xla" and out is not None:
    raise ValueError("out= is the kernel's output buffer; with pv='xla' XLA writes y")
  if not 2 <= len(members) <= 3:
    raise ValueError(f"{len(members)} members: the grouped kernel takes 2 or 3")
  unpacked, scales = [], []
  for i, mem in enumerate(members):
    if not isinstance(mem, (tuple, list)) or len(mem) not in (2, 3, 4):
      raise ValueError(f"member {i}: expected (u, v), (u, v, bias) or (u, v, bias, scale)")
    x2, lead, (m, k, r, n), odt = unpack_xuv_args(x, mem[0], mem[1], out_dtype)
    b = mem[2] if len(mem) >= 3 else None
    if b is not None and tuple(b.shape) != (n,):
      raise ValueError(f"member {i}: bias {b.shape} must be ({n},)")
    s = mem[3] if len(mem) == 4 else None
    if s is not None and tuple(s.shape) != (r,):
      raise ValueError(f"member {i}: scale {s.shape} must be ({r},), the rank")
    unpacked.append((mem[0], mem[1], b, r, n))
    scales.append(s)
  if any(s is not None for s in scales) and pv != "xla":
    raise ValueError("rank-space scales are applied by XLA after phase 1: pv='xla' only")
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
  lp = launch_plan(
    m, k, [(r, n, b is not None) for *_, b, r, n in unpacked], p, phase2=pv == "kernel"
  )
  meta, scratch = lp["meta"], lp["scratch"]
  w, eps = norm_operands(norm, k)
  meta.update(NORM=int(w is not None), EPS=eps)
  aliases, outs_in = {11: 0}, [x2] * 3
  if out is not None:
    if len(out) != g:
      raise ValueError(f"{len(out)} out= buffers for {g} members")
    for i, (o, (*_, n)) in enumerate(zip(out, unpacked)):
      check_out(o, (m, n), odt)
      outs_in[i], aliases[12 + i] = o, 1 + i
  outs = launch.triton_call(
    x2,
    *ops,
    w if w is not None else x2,
    jnp.zeros((scratch,), jnp.float32),
    *outs_in,
    m,
    *launch.UNCHAINED,
    kernel=_xuv_decode_group_kernel,
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
    from lrjax.lowering.primitives import apply_scale, rank_space_out

    ys, off = [], 0
    sq_off = m * sum(r for *_, r, _ in full) + 3  # NORM: each member's sums of squares
    for i, ((u, v, b, r, n), s) in enumerate(zip(unpacked, scales)):  # noqa: B007
      pm = outs[0][off : off + m * r].reshape(m, r)
      if w is not None:  # rms_norm's row scale, as phase 2 applies it
        ss = outs[0][sq_off + i * m : sq_off + (i + 1) * m]
        pm = pm * jax.lax.rsqrt(ss / k + eps)[:, None]
      pm = pm.astype(v.dtype)
      pm = apply_scale(pm, s, v.dtype)  # scales are in the factors' dtype (lr_xuv_group)
      ys.append(rank_space_out(pm, v, b, odt).reshape(*lead, n))
      off += m * r
    return ys
  return [o.reshape(*lead, mem[4]) for o, mem in zip(outs[1 : 1 + g], unpacked)]


def xuv_decode_group(
  x, members, *, out_dtype=None, block_sizes: BlockSizes | None = None, out=None, norm=None
):
  """[((x·u_i) ⊙ scale_i)·v_i (+ bias_i)] for 2 or 3 members sharing x (e.g. q/k/v
  projections), in one launch. x [..., K]; members: [(u_i [K, r_i], v_i [r_i, N_i]),
  (u_i, v_i, bias_i [N_i] | None) or (u_i, v_i, bias_i | None, scale_i [r_i])].
  ``out``: optional [M, N_i] buffers the kernel writes into (aliased). ``norm``: (weight
  [K], eps): x is rms_norm(x, weight, eps) (lowering/rms_norm.py): phase 1 streams x·g and
  sums x's squares, P_i's rows are scaled after. Returns the list of [..., N_i] outputs.
  Default blocks: phase 2 in the kernel, up to GROUP_MAX_M rows; with a scale, phase 1 alone
  (pv="xla") and the scales and ·V_i by XLA."""
  if any(len(mem) == 4 and mem[3] is not None for mem in members):
    if block_sizes is not None or out is not None:
      raise ValueError("block_sizes= and out= do not apply with scales (pv='xla')")
    return _xuv_decode_group(x, members, out_dtype=out_dtype, pv="xla", norm=norm)
  if block_sizes is None:
    return _xuv_decode_group(x, members, out_dtype=out_dtype, out=out, norm=norm)
  return _xuv_decode_group(
    x, members, out_dtype=out_dtype, out=out, plan=block_sizes.plan, pv=block_sizes.pv, norm=norm
  )


def xuv_decode_group_reference(x, members, *, out_dtype=None, norm=None):
  """xuv_decode_group's result: each member's ``xuv_decode_reference`` (of the normalised
  x with ``norm``)."""
  from lrjax.custom_calls.triton.xuv_decode import xuv_decode_reference

  x = normed_reference(x, norm)
  return [
    xuv_decode_reference(x, *m[:3], out_dtype=out_dtype, scale=m[3] if len(m) == 4 else None)
    for m in members
  ]
