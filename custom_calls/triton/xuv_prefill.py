"""Prefill X·U·V (M >= ~64): NeuronMM's strip dataflow on a GPU, in one persistent launch.

For each row block of B_M tokens the kernel computes the B_M x r strip P = X·U exactly once
(phase A tiles, one per B_M x B_N column block of the strip) and reuses it for every
N block of the output (phase D tiles: O = P·V + bias). No X·U is recomputed.

Where the strip lives (see planner.py for the model): at LLM ranks (r >= 1024) a
B_M x r strip plus the pipeline buffers does not fit one CTA's 227 KB of shared memory.
A CTA that owned a whole strip would also have to produce all N/B_N output blocks of
its rows, so M=1024 would run on 8-16 of 132 SMs. Instead the strip is written
to a ring of L2-sized slots: one slot holds a super-block of G row blocks. G comes
from eq. 10, so that V, streamed from HBM once per super-block, stays above the H200
ridge. The phase-D tiles of a super-block read the strip back while it is
cached. Dependencies are per row block: a phase-A tile bumps ``flag_a[m]`` (release)
when its part of the strip is stored. A phase-D tile waits (acquire) until all
ceil(r/B_N) parts of row block m are in. Before a phase-A tile overwrites a ring slot, it waits
until the slot's previous row block has finished phase D (``flag_d``).

Tiles come from a host-built schedule (int32 codes). Step s holds phase A of
super-block s, then phase D of super-block s-1 (N outer, rows inner, so
concurrent CTAs share V tiles through L2). A tile depends only on tiles earlier in
the table, and each persistent CTA walks its tiles in table order, so the earliest
unfinished tile can always run: no deadlock with a grid of at most one resident wave.
With ``dynamic`` the CTAs claim tiles in table order from an atomic counter instead of
taking every PROGRAMS-th one; the same argument holds.
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
  check_out,
  first_tile,
  mm_acc,
  next_tile,
  ring_tile,
  signal,
  tile_codes,
  unpack_xuv_args,
  wait_at_least,
)

PHASE_A, PHASE_D = 0, 3


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  block_m: int
  block_n: int  # output columns per tile (both phases)
  block_k: int  # reduction step (both phases)
  group_m: int  # row blocks per super-block (one ring slot)
  ring: int = 3  # slots; 3 lets A(s) skip waiting on D(s-2), which runs just before it
  num_warps: int = 8
  num_stages: int = 3
  programs: int = 132  # persistent CTAs (one per SM at these tile sizes)
  dynamic: bool = False  # tiles claimed in schedule order from a counter (else round-robin)

  @classmethod
  def get_default(cls, m: int, k: int, r: int, n: int) -> BlockSizes:
    """The tuning table's blocks by shape class (``xuv_prefill`` tiles), else
    ``planner.plan_prefill``'s."""
    t = policy.tiles("xuv_prefill").get(",".join(_shape_class(m, r)))
    if t is not None:
      t = cls(**t)
    else:
      p = planner.plan_prefill(m, r, (r,))
      t = cls(p.block_m, p.block_n, p.block_k, p.group_m, 3, p.warps, p.stages, p.programs)
    # the ring never needs more rows than M has
    n_mb = planner.cdiv(m, t.block_m)
    return dataclasses.replace(t, group_m=max(1, min(t.group_m, n_mb)))


def _shape_class(m: int, r: int) -> tuple[str, str]:
  return ("m<=512" if m <= 512 else "m>512", "r>=2048" if r >= 2048 else "r<2048")


@triton.jit
def _xuv_prefill_kernel(
  x_ptr,  # [M, K] activations
  u_ptr,  # [K, R]
  v_ptr,  # [R, N]
  b_ptr,  # [N] bias (read only if HAS_BIAS)
  sched_ptr,  # [T] i32 tile codes: phase << 28 | row block << 14 | column block
  o_in_ptr,  # [M, N] caller's output buffer aliased to o_ptr (else x; never read)
  ring_ptr,  # [RING * G * BLOCK_M, R] strip ring (V's dtype)
  flag_a_ptr,  # [n_mb + 1] i32 strip parts stored per row block, then the tile counter
  flag_d_ptr,  # [n_mb] i32 output tiles done per row block, zeroed
  o_ptr,  # [M, N] output
  M: tl.constexpr,
  K: tl.constexpr,
  R: tl.constexpr,
  N: tl.constexpr,
  NMB: tl.constexpr,
  HAS_BIAS: tl.constexpr,
  T: tl.constexpr,
  PROGRAMS: tl.constexpr,
  G: tl.constexpr,
  RING: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_N: tl.constexpr,
  BLOCK_K: tl.constexpr,
  EVEN_K: tl.constexpr,
  EVEN_R: tl.constexpr,
  DYNAMIC: tl.constexpr,
):
  n_r = (R + BLOCK_N - 1) // BLOCK_N
  n_n = (N + BLOCK_N - 1) // BLOCK_N
  counter = flag_a_ptr + NMB
  t = first_tile(counter, DYNAMIC)
  while t < T:
    phase, mb, offs_m, m_mask, ring_rows, j = ring_tile(tl.load(sched_ptr + t), M, G, RING, BLOCK_M)
    offs_c = j * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if phase == 0:
      if mb >= G * RING:  # slot reuse: the previous occupant must be fully consumed
        wait_at_least(flag_d_ptr + mb - G * RING, n_n)
      c_mask = offs_c < R
      acc = mm_acc(
        acc, x_ptr, u_ptr, offs_m, offs_c, m_mask, c_mask, 0, K, K, K, R, BLOCK_K, EVEN_K, False
      )
      tl.store(
        ring_ptr + ring_rows[:, None] * R + offs_c[None, :],
        acc.to(ring_ptr.dtype.element_ty),
        mask=c_mask[None, :],
      )
      signal(flag_a_ptr + mb)
    else:
      wait_at_least(flag_a_ptr + mb, n_r)
      c_mask = offs_c < N
      acc = mm_acc(
        acc,
        ring_ptr,
        v_ptr,
        ring_rows,
        offs_c,
        m_mask,
        c_mask,
        0,
        R,
        R,
        R,
        N,
        BLOCK_K,
        EVEN_R,
        True,
      )
      if HAS_BIAS:
        acc += tl.load(b_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
      tl.store(
        o_ptr + offs_m[:, None] * N + offs_c[None, :],
        acc.to(o_ptr.dtype.element_ty),
        mask=m_mask[:, None] & c_mask[None, :],
      )
      signal(flag_d_ptr + mb)
    t = next_tile(counter, t, PROGRAMS, DYNAMIC)


def schedule(m: int, r: int, n: int, bs: BlockSizes, xp=np):
  """Tile codes in dependency order: step s = [A(super-block s), D(super-block s-1)]."""
  n_mb = planner.cdiv(m, bs.block_m)
  n_r = planner.cdiv(r, bs.block_n)
  n_n = planner.cdiv(n, bs.block_n)
  if n_mb >= 1 << 14 or max(n_r, n_n) >= 1 << 14:
    raise ValueError(f"{m=}, {r=}, {n=} exceed the 14-bit tile code fields")
  n_sb = planner.cdiv(n_mb, bs.group_m)
  g = lambda sb: min(bs.group_m, n_mb - sb * bs.group_m)
  pieces = []
  for s in range(n_sb + 1):
    if s < n_sb:
      pieces.append(tile_codes(xp, PHASE_A, s * bs.group_m, g(s), n_r, False))
    if s >= 1:
      pieces.append(tile_codes(xp, PHASE_D, (s - 1) * bs.group_m, g(s - 1), n_n, True))
  return xp.concatenate(pieces)


def launch_plan(m: int, k: int, r: int, n: int, has_bias: bool, bs: BlockSizes, xp=np) -> dict:
  sched = schedule(m, r, n, bs, xp)
  n_mb = planner.cdiv(m, bs.block_m)
  ring = min(bs.ring, planner.cdiv(n_mb, bs.group_m))  # fewer slots when all rows fit
  programs = min(bs.programs, len(sched))
  meta = dict(
    M=m,
    K=k,
    R=r,
    N=n,
    HAS_BIAS=has_bias,
    T=len(sched),
    PROGRAMS=programs,
    G=bs.group_m,
    RING=ring,
    BLOCK_M=bs.block_m,
    BLOCK_N=bs.block_n,
    BLOCK_K=bs.block_k,
    EVEN_K=k % bs.block_k == 0,
    EVEN_R=r % bs.block_k == 0,
    NMB=n_mb,
    DYNAMIC=bool(bs.dynamic),
  )
  return dict(
    sched=sched, n_mb=n_mb, ring_rows=ring * bs.group_m * bs.block_m, programs=programs, meta=meta
  )


def xuv_prefill(
  x, u, v, bias=None, *, out_dtype=None, block_sizes: BlockSizes | None = None, out=None
):
  """y = (x·u)·v (+ bias) for many tokens. x [..., K], u [K, r], v [r, N], bias [N].

  ``out`` [M, N]: optional buffer the kernel writes into (aliased).
  """
  x2, lead, (m, k, r, n), out_dtype = unpack_xuv_args(x, u, v, out_dtype)
  check_out(out, (m, n), out_dtype)
  bs = block_sizes or BlockSizes.get_default(m, k, r, n)
  plan = launch_plan(m, k, r, n, bias is not None, bs, jnp)
  b = bias if bias is not None else v  # never read without HAS_BIAS
  sched = plan["sched"]
  _, _, _, o = launch.triton_call(
    x2,
    u,
    v,
    b,
    sched,
    x2 if out is None else out,
    kernel=_xuv_prefill_kernel,
    input_output_aliases={5: 3} if out is not None else None,
    out_shape=(
      jax.ShapeDtypeStruct((plan["ring_rows"], r), v.dtype),
      jax.ShapeDtypeStruct((plan["n_mb"] + 1,), jnp.int32),
      jax.ShapeDtypeStruct((plan["n_mb"],), jnp.int32),
      jax.ShapeDtypeStruct((m, n), out_dtype),
    ),
    grid=(plan["programs"],),
    zeroed_outputs=(1, 2),
    num_warps=bs.num_warps,
    num_stages=bs.num_stages,
    name="lrjax_xuv_prefill",
    **plan["meta"],
  )
  return o.reshape(*lead, n)


def xuv_prefill_reference(x, u, v, bias=None, *, out_dtype=None):
  """f32-accumulating (x·u)·v (+ bias); the strip rounded to v's dtype as the kernel does."""
  from lrjax.lowering.primitives import lr_xuv_reference

  return lr_xuv_reference(x, u, v, bias, inter_dtype=v.dtype, out_dtype=out_dtype or x.dtype)
