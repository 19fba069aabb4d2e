"""``lr_mlp_rank``: the middle of a low-rank MLP, from the rank-space inputs of gate and up to the
rank-space output of down's first factor.

  gated:     s = act(pg·Vg + bg) ⊙ (pu·Vu + bu) · Ud
  non-gated: s = act(pu·Vu + bu) · Ud

  pg [..., r_g], pu [..., r_u]    rank-space inputs (x·Ug and x·Uu, complete sums)
  vg [r_g, F], vu [r_u, F]        second factors of gate / up, bg, bu optional [F]
  ud [F, r_d]                     first factor of down
  → s [..., r_d]                  down's rank-space intermediate (before ·Vd)

It is what a device computes between the two rank-space collectives of a tensor-parallel
low-rank MLP (lrjax.sharding): after the all-gather (``lowrank_tp``) or all-reduce
(``lowrank_split``) of x·U, on its own F/n columns of the intermediate, and before the
all-reduce of the partial sums s. Bound on those local shapes, a platform kernel registered for
``lr_mlp_rank`` (the registry's usual ``supports``/``faster`` checks) serves it; elsewhere it
lowers to the reference below. Under SPMD with sharded operands (not inside a per-device
program) it always lowers to the reference, which XLA partitions itself.

Operands: (pg, vg, (bg),) pu, vu, (bu), ud. Params: ``gated``, ``act``, ``bias_mask`` (one
flag per projection: (gate, up) if gated else (up,)), ``inter_dtype`` (the dtype the
intermediate is rounded to, as in ``lr_mlp``), ``out_dtype``.

Numerics as ``lr_mlp``'s reference: every product accumulates in f32; gate and up outputs are
rounded to ``inter_dtype`` (biases added in f32 before that rounding), the activation product is
in ``inter_dtype``, and s is rounded once to ``out_dtype`` (f32 when partial sums are reduced
across devices before rounding).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching

from lrjax.lowering import primitives
from lrjax.lowering.primitives import ACTIVATIONS, _check_float, rank_space_out

lr_mlp_rank_p = Primitive("lr_mlp_rank")


def rank_operands(ops: Sequence[Any], gated: bool, bias_mask: Sequence[bool]) -> dict:
  """Names the flat operands: {'gate': (p, v, b|None) | None, 'up': (p, v, b|None), 'ud'}."""
  names = ("gate", "up") if gated else ("up",)
  if len(bias_mask) != len(names):
    raise ValueError(f"{bias_mask=} must have {len(names)} flags for {names}")
  out, i = {"gate": None}, 0
  for name, hb in zip(names, bias_mask):
    out[name] = (ops[i], ops[i + 1], ops[i + 2] if hb else None)
    i += 3 if hb else 2
  if i + 1 != len(ops):
    raise ValueError(
      f"lr_mlp_rank got {len(ops)} operands, expected {i + 1} for {gated=} {bias_mask=}"
    )
  out["ud"] = ops[i]
  return out


def _check(ops, *, gated, act, bias_mask, inter_dtype, out_dtype):
  if act not in ACTIVATIONS:
    raise ValueError(f"{act=} is not supported; expected one of {sorted(ACTIVATIONS)}")
  d = rank_operands(ops, gated, bias_mask)
  pu, vu, bu = d["up"]
  ud = d["ud"]
  for name, a in (("pu", pu), ("vu", vu), ("ud", ud)):
    _check_float(name, a)
  if pu.ndim < 1 or vu.ndim != 2 or ud.ndim != 2:
    raise ValueError(
      f"{pu.shape=} {vu.shape=} {ud.shape=}: expected pu [..., r], vu [r, F], ud [F, r_d]"
    )
  if pu.shape[-1] != vu.shape[0]:
    raise ValueError(
      f"{pu.shape=} and {vu.shape=} disagree on the rank: expected pu [..., r], vu [r, F]"
    )
  f = vu.shape[1]
  if ud.shape[0] != f:
    raise ValueError(f"{ud.shape=} must start with the intermediate width F={f} of {vu.shape=}")
  if bu is not None and bu.shape != (f,):
    raise ValueError(f"{bu.shape=} must be ({f},), the intermediate width")
  if gated:
    pg, vg, bg = d["gate"]
    for name, a in (("pg", pg), ("vg", vg)):
      _check_float(name, a)
    if vg.ndim != 2 or pg.shape[-1] != vg.shape[0] or vg.shape[1] != f:
      raise ValueError(f"{pg.shape=} {vg.shape=}: expected pg [..., r_g], vg [r_g, {f}]")
    if pg.shape[:-1] != pu.shape[:-1]:
      raise ValueError(f"{pg.shape=} and {pu.shape=} must share their leading (token) dims")
    if bg is not None and bg.shape != (f,):
      raise ValueError(f"{bg.shape=} must be ({f},), the intermediate width")
  return pu.shape[:-1] + (ud.shape[1],)


def lr_mlp_rank(pu, up, ud, pg=None, gate=None, *, act="silu", inter_dtype=None, out_dtype=None):
  """s = act(pg·Vg + bg) ⊙ (pu·Vu + bu) · Ud (gated) or act(pu·Vu + bu) · Ud.

  ``up`` and ``gate`` are (v,) or (v, bias); ``pg`` and ``gate`` come together.
  """
  if (pg is None) != (gate is None):
    raise ValueError("pg and gate must be given together (a gated MLP) or both omitted")
  ops, mask = [], []
  for p, vb in ((pg, gate), (pu, up)):
    if p is None:
      continue
    if not isinstance(vb, (tuple, list)) or len(vb) not in (1, 2):
      raise ValueError(f"each projection must be (v,) or (v, bias); got {type(vb).__name__}")
    ops += [p, vb[0]] + ([vb[1]] if len(vb) == 2 else [])
    mask.append(len(vb) == 2)
  ops.append(ud)
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(*ops))
  params = dict(
    gated=pg is not None,
    act=act,
    bias_mask=tuple(mask),
    inter_dtype=jnp.dtype(inter_dtype or out_dtype),
    out_dtype=out_dtype,
  )
  _check(ops, **params)
  return lr_mlp_rank_p.bind(*ops, **params)


def _reference(*ops, gated, act, bias_mask, inter_dtype, out_dtype):
  d = rank_operands(ops, gated, bias_mask)
  f = ACTIVATIONS[act]
  h = rank_space_out(d["up"][0].astype(inter_dtype), d["up"][1], d["up"][2], inter_dtype)
  if gated:
    g = rank_space_out(d["gate"][0].astype(inter_dtype), d["gate"][1], d["gate"][2], inter_dtype)
    h = f(g) * h
  else:
    h = f(h)
  return jnp.matmul(h.astype(inter_dtype), d["ud"], preferred_element_type=out_dtype)


def lr_mlp_rank_reference(
  pu, up, ud, pg=None, gate=None, *, act="silu", inter_dtype=None, out_dtype=None
):
  """Pure-jnp reference of :func:`lr_mlp_rank` (also its default lowering)."""
  ops, mask = [], []
  for p, vb in ((pg, gate), (pu, up)):
    if p is not None:
      ops += [p, *vb]
      mask.append(len(vb) == 2)
  ops.append(ud)
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(*ops))
  return _reference(
    *ops,
    gated=pg is not None,
    act=act,
    bias_mask=tuple(mask),
    inter_dtype=jnp.dtype(inter_dtype or out_dtype),
    out_dtype=out_dtype,
  )


@lr_mlp_rank_p.def_abstract_eval
def _abstract(*ops, **params):
  return jax.core.ShapedArray(_check(ops, **params), params["out_dtype"])


def _activation_operands(gated: bool, bias_mask: Sequence[bool]) -> tuple[int, ...]:
  """Positions of pg and pu among the operands."""
  if not gated:
    return (0,)
  return (0, 3 if bias_mask[0] else 2)


# jvp, impl and the registry lowering (kernel on local shapes, else the reference).
primitives.register_reference(lr_mlp_rank_p, _reference)


def _batch(args, dims, **params):
  acts = _activation_operands(params["gated"], params["bias_mask"])
  if any(d is not None for i, d in enumerate(dims) if i not in acts):
    # Batched weights: no kernel takes per-example factors, so vmap the reference.
    return jax.vmap(functools.partial(_reference, **params), in_axes=dims)(*args), 0
  # Only pg / pu are batched: the batch dim becomes one more leading token dim.
  n = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  args = list(args)
  for i in acts:
    a, d = args[i], dims[i]
    args[i] = jnp.moveaxis(a, d, 0) if d is not None else jnp.broadcast_to(a, (n,) + a.shape)
  return lr_mlp_rank_p.bind(*args, **params), 0


batching.primitive_batchers[lr_mlp_rank_p] = _batch
