"""``lr_residual``: the residual stream's add folded into the low-rank op whose output it adds.

  lr_residual(r, *ops, inner, inner_params) = r + inner(*ops, **inner_params)

``inner`` is ``lr_xuv``, ``lr_mlp`` or ``lr_normed`` (an MLP with its norm folded in); r has
the op's output shape and dtype. ``lrjax.fuse`` binds it where the op's output is read only by
an ``add`` with an operand of that shape and dtype (a pre-norm block's ``h + o_proj(a)`` and
``h + mlp(norm(h))``). Its reference is the op (which keeps its own kernel choice) followed
by XLA's add; on NVIDIA GPUs the decode kernels add r as they store each output tile (the
rounded output plus r in f32, rounded: what XLA's add computes), so the add costs no launch of
its own.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.extend.core import Primitive

from lrjax.lowering import _jaxpr, primitives

lr_residual_p = Primitive("lr_residual")


def inner_primitive(name: str):
  """The primitive whose output ``lr_residual`` adds the residual to."""
  from lrjax.lowering.rms_norm import lr_normed_p

  prims = {"lr_xuv": primitives.lr_xuv_p, "lr_mlp": primitives.lr_mlp_p, "lr_normed": lr_normed_p}
  if name not in prims:
    raise ValueError(f"inner={name!r}: expected one of {sorted(prims)}")
  return prims[name]


def _inner_out(ops, inner, inner_params):
  """The inner op's one result's aval."""
  prim = inner_primitive(inner)
  out, _ = prim.abstract_eval(*ops, **dict(inner_params))  # (avals, effects)
  if prim.multiple_results:
    if len(out) != 1:
      raise ValueError(f"{inner} has {len(out)} results; lr_residual adds to an op of one")
    out = out[0]
  return out


def _check(r, out):
  if tuple(r.shape) != tuple(out.shape) or np.dtype(r.dtype) != np.dtype(out.dtype):
    raise ValueError(
      f"residual {tuple(r.shape)} {np.dtype(r.dtype)}: expected the op's output "
      f"{tuple(out.shape)} {np.dtype(out.dtype)}"
    )


def lr_residual(r, *ops, inner: str, inner_params: dict):
  """r + ``inner``(*ops, **inner_params) as one primitive; r has the op's output shape and
  dtype."""
  params = tuple(sorted(inner_params.items()))
  avals = [jax.typeof(a) for a in ops]
  _check(jax.typeof(r), _inner_out(avals, inner, params))
  return lr_residual_p.bind(r, *ops, inner=inner, inner_params=params)


def lr_residual_reference(r, *ops, inner, inner_params):
  prim = inner_primitive(inner)
  y = prim.bind(*ops, **dict(inner_params))
  return r + (y[0] if prim.multiple_results else y)


@lr_residual_p.def_abstract_eval
def _abstract(r, *ops, inner, inner_params):
  out = _inner_out(ops, inner, inner_params)
  _check(r, out)
  return jax.core.ShapedArray(out.shape, out.dtype)


def _batch(args, dims, **params):
  """vmap runs the reference (the inner op's own batching rule, then the add)."""
  out = jax.vmap(lambda *a: lr_residual_reference(*a, **params), in_axes=dims)(*args)
  return out, 0


# a kernel serves on one device or on a per-device program's local shards, else the reference
# (partitioning.LOCAL_ONLY), whose inner op may be a kernel run on local shards: it needs the
# device assignment at lowering
primitives.register_reference(lr_residual_p, lr_residual_reference, batch=_batch)
_jaxpr.require_devices_during_lowering(lr_residual_p)
