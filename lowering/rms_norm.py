"""``rms_norm``, and ``lr_normed``: an RMSNorm folded into the low-rank op that reads it.

  rms_norm(x, weight, eps)   x [..., K], weight [K]
    y = weight · x / rms(x) over the last axis: statistics in f32, the normalised x rounded
    to the output dtype, then scaled by the weight in that dtype (as Hugging Face's Llama).

lrjax's models bind ``rms_norm`` for every norm (its reference is their former ops, so a
program lowers to the same XLA ops). ``lrjax.fuse`` folds a norm whose output only feeds
one ``lr_xuv_group`` or ``lr_mlp`` into that op: it binds ``lr_normed`` with the norm's
input, its weight and the op's other operands. Its reference is the norm followed by the op
(which keeps its own kernel choice); on NVIDIA GPUs the decode kernels apply the norm as
they load X (custom_calls/triton: the grouped q/k/v and SwiGLU kernels), so the norm costs
no launch of its own. A norm written as plain jnp ops is left to XLA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive

from lrjax.lowering import _jaxpr, primitives

rms_norm_p = Primitive("rms_norm")
lr_normed_p = Primitive("lr_normed")
lr_normed_p.multiple_results = True


def _check(x, weight, eps):
  if not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim < 1:
    raise ValueError(f"x {x.shape} {x.dtype}: expected a floating array [..., K]")
  if weight.shape != (x.shape[-1],) or not jnp.issubdtype(weight.dtype, jnp.floating):
    raise ValueError(
      f"weight {weight.shape} {weight.dtype}: expected a floating [{x.shape[-1]}] (x's last axis)"
    )
  if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
    raise ValueError(f"{eps=}: expected a float >= 0")


def rms_norm(x, weight, *, eps: float, dtype=None):
  """weight · x / sqrt(mean(x², -1) + eps), in ``dtype`` (default x's); see the module
  docstring."""
  _check(x, weight, eps)
  return rms_norm_p.bind(x, weight, eps=float(eps), dtype=np.dtype(dtype or x.dtype))


def rms_norm_reference(x, weight, *, eps, dtype):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight.astype(dtype) * y.astype(dtype)


@rms_norm_p.def_abstract_eval
def _abstract(x, weight, *, eps, dtype):
  _check(x, weight, eps)
  return jax.core.ShapedArray(x.shape, dtype)


primitives.register_reference(rms_norm_p, rms_norm_reference)


# ------------------------------------------------------------------ lr_normed


def inner_primitive(name: str):
  """The primitive ``lr_normed`` folds the norm into."""
  from lrjax.lowering.group import lr_xuv_group_p

  prims = {"lr_xuv_group": lr_xuv_group_p, "lr_mlp": primitives.lr_mlp_p}
  if name not in prims:
    raise ValueError(f"inner={name!r}: expected one of {sorted(prims)}")
  return prims[name]


def lr_normed(x, weight, *ops, eps: float, inner: str, inner_params: dict):
  """``inner``(rms_norm(x, weight, eps), *ops, **inner_params) as one primitive (list of the
  inner op's results); the norm's dtype is x's."""
  _check(x, weight, eps)
  inner_primitive(inner)
  params = tuple(sorted(inner_params.items()))
  return lr_normed_p.bind(x, weight, *ops, eps=float(eps), inner=inner, inner_params=params)


def lr_normed_reference(x, weight, *ops, eps, inner, inner_params):
  prim = inner_primitive(inner)
  y = rms_norm_p.bind(x, weight, eps=eps, dtype=np.dtype(x.dtype))
  out = prim.bind(y, *ops, **dict(inner_params))
  return list(out) if prim.multiple_results else [out]


@lr_normed_p.def_abstract_eval
def _normed_abstract(x, weight, *ops, eps, inner, inner_params):
  _check(x, weight, eps)
  y = jax.core.ShapedArray(x.shape, x.dtype)
  prim = inner_primitive(inner)
  out, _ = prim.abstract_eval(y, *ops, **dict(inner_params))  # (avals, effects)
  return list(out) if prim.multiple_results else [out]


def _normed_batch(args, dims, **params):
  """vmap runs the reference (the norm, then the inner op's own batching rule)."""
  outs = jax.vmap(lambda *a: lr_normed_reference(*a, **params), in_axes=dims)(*args)
  return outs, [0] * len(outs)


# a kernel serves on one device or on a per-device program's local shards, else the reference
# (partitioning.LOCAL_ONLY), whose inner op may be a kernel run on local shards: it needs the
# device assignment at lowering
primitives.register_reference(lr_normed_p, lr_normed_reference, batch=_normed_batch)
_jaxpr.require_devices_during_lowering(lr_normed_p)
