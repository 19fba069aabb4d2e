"""Fused low-rank MLP (NeuronMM Algorithm 3): UpGateProjection then DownProjection.

    Y^T = UpGateProjection(X, Ug, Vg, Uu, Vu)                 (mlp_up_gate.py, Algorithm 2)
    Z   = XUV_Kernel(Y^T, Ud, Vd, is_XT=True, req_OT=False)   (xuv.py)

The first kernel writes Y^T, exactly the layout the second one loads with plain
DMAs as its pre-transposed input, and the second writes Z in the normal layout the
model expects: no transpose anywhere between the two. Y^T stays padded to
multiples of 128 between the kernels (its padded rows are act(0)·0 = 0 and meet
zero rows of the padded Ud, so the result is exact).

Operands follow ``lr_mlp``: x [..., K], up/gate/down as (u, v, bias|None).
"""

from __future__ import annotations

import dataclasses

from lrjax.custom_calls.nki import planner


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  up_gate: tuple[int, int, int, int]  # (B_M, B_K, B_r, B_N) of UpGateProjection
  down: tuple[int, int, int, int]  # (B_M, B_K, B_r, B_N) of DownProjection

  @classmethod
  def get_default(
    cls, M, K, r_up, d_ff, r_down, N, dtype, *, gated=True, up_bias=0, down_bias=False
  ) -> BlockSizes:
    p = planner.plan_mlp(
      M, K, r_up, d_ff, r_down, N, dtype, gated=gated, up_bias=up_bias, down_bias=down_bias
    )
    return cls(p.up_gate.blocks.as_tuple(), p.down.blocks.as_tuple())


def fused_mlp(x, up, down, gate=None, *, act="silu", xp, up_gate_mod, xuv_mod):
  """Runs Algorithm 3 with the given kernel modules (real NKI, or a test double's copies).

  x: [M, K]; up, gate: (u [K, r], v [r, D_ff], bias [D_ff] | None[, scale [r]]); down:
  (u [D_ff, r2], v [r2, N], bias [N] | None[, scale [r2]]). ``xp`` is numpy or jax.numpy.
  Returns Z [M, N].
  """
  M = x.shape[0]
  name, args, kwargs, _ = up_gate_mod.prepare(x, up, gate, xp=xp, act=act)
  yt = getattr(up_gate_mod, name)(*args, **kwargs)  # [D_ff padded, M padded]
  ud, vd, bd, sd = tuple(down) + (None,) * (4 - len(down))
  Dp = yt.shape[0]
  if ud.shape[0] != up[1].shape[1]:
    raise ValueError(f"down u.shape={ud.shape} must start with D_ff={up[1].shape[1]}")
  ud = ud if ud.shape[0] == Dp else xp.pad(ud, ((0, Dp - ud.shape[0]), (0, 0)))
  d_args, d_kwargs, (_, N) = xuv_mod.prepare(
    yt, ud, vd, bd, sd, xp=xp, out_t=False, x_transposed=True
  )
  kern = xuv_mod.kernel_for(bd is not None, sd is not None)
  z = kern(*d_args, **d_kwargs)  # [M padded, N padded]
  return z[:M, :N]


def mlp(x, up, down, gate=None, *, act="silu", up_gate_mod=None, xuv_mod=None):
  """JAX entry point for the NKI fused MLP: x [..., K] -> [..., N].

  The kernel modules default to the real ones; tests pass copies bound to the double.
  """
  import jax.numpy as jnp

  if up_gate_mod is None or xuv_mod is None:
    from lrjax.custom_calls.nki import mlp_up_gate, xuv

    up_gate_mod, xuv_mod = up_gate_mod or mlp_up_gate, xuv_mod or xuv
  lead = x.shape[:-1]
  z = fused_mlp(
    x.reshape(-1, x.shape[-1]),
    up,
    down,
    gate,
    act=act,
    xp=jnp,
    up_gate_mod=up_gate_mod,
    xuv_mod=xuv_mod,
  )
  return z.reshape(lead + (z.shape[-1],))


def mlp_reference(x, up, down, gate=None, *, act="silu"):
  """The lrjax reference (lr_mlp_reference) with this module's argument order."""
  from lrjax.lowering import lr_mlp_reference

  return lr_mlp_reference(x, up, down, gate, act=act)
