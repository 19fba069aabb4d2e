"""``lr_xuv_batched``: X·U·V with per-head (batched) factors, as per-head q/k/v projections or
grouped experts write it.

  x  [..., H, K]  (``x_heads=True``: every head reads its own slice of x)
     [..., K]     (``x_heads=False``: every head reads all of x, e.g. a shared x·U[K, H·r]
                   split into heads, as ``lrjax.compression.HeadwiseLowRankLinear`` does)
  u  [H, K, r]    v [H, r, N]    scale (optional) [H, r]
  -> [..., H, N]: y[..., h, :] = ((x_h·u[h]) ⊙ scale[h])·v[h]

``lrjax.fuse`` binds it for chains of ``dot_general``s with a batch dimension on both factors
(``einsum('bhsd,hdr->bhsr')`` then ``('bhsr,hrn->bhsn')``, or x·U reshaped to heads then
``einsum('...hr,hrn->...hn')``); the user's own layout is restored around it with transposes.

No platform has a kernel for it yet: it lowers to its reference everywhere (XLA's batched
GEMMs), which is the declined-kernel path of the other primitives. It has an abstract eval, a
vmap rule and a JVP (through the reference), like lr_xuv. Numerics as lr_xuv: each product
accumulates in f32 and is rounded to ``inter_dtype`` / ``out_dtype``; the scale multiplies the
intermediate in ``scale.dtype`` and the product is rounded to ``scaled_dtype``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.extend.core import Primitive

from lrjax.lowering import _jaxpr, primitives
from lrjax.lowering.primitives import _check_float, apply_scale, scale_params

lr_xuv_batched_p = Primitive("lr_xuv_batched")


def _split(ops, has_scale):
  if len(ops) != 3 + int(has_scale):
    raise ValueError(f"lr_xuv_batched got {len(ops)} operands, expected {3 + int(has_scale)}")
  return ops[0], ops[1], ops[2], (ops[3] if has_scale else None)


def _check(x, u, v, scale, x_heads):
  for name, a in (("x", x), ("u", u), ("v", v)) + (
    (("scale", scale),) if scale is not None else ()
  ):
    _check_float(name, a)
  if u.ndim != 3 or v.ndim != 3:
    raise ValueError(f"{u.shape=} and {v.shape=} must be 3-D: u [H, K, r], v [H, r, N]")
  h, k, r = u.shape
  if v.shape[:2] != (h, r):
    raise ValueError(f"{u.shape=} and {v.shape=} disagree: expected u [H, K, r], v [H, r, N]")
  want = (h, k) if x_heads else (k,)
  if x.ndim < len(want) or tuple(x.shape[x.ndim - len(want) :]) != want:
    raise ValueError(
      f"{x.shape=} must end with {want} ({'[..., H, K]' if x_heads else '[..., K]'})"
    )
  if scale is not None and scale.shape != (h, r):
    raise ValueError(f"{scale.shape=} must be ({h}, {r}), [H, r]")
  lead = x.shape[: x.ndim - len(want)]
  return lead + (h, v.shape[2])


def lr_xuv_batched(x, u, v, *, scale=None, x_heads=True, out_dtype=None, inter_dtype=None):
  """y[..., h, :] = ((x_h·u[h]) ⊙ scale[h])·v[h]; see the module docstring for the shapes."""
  _check(x, u, v, scale, x_heads)
  ops = (x, u, v) + ((scale,) if scale is not None else ())
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(*ops))
  inter_dtype = jnp.dtype(inter_dtype or out_dtype)
  return lr_xuv_batched_p.bind(
    *ops,
    x_heads=bool(x_heads),
    inter_dtype=inter_dtype,
    out_dtype=out_dtype,
    **scale_params(scale, None, inter_dtype),
  )


def _reference(*ops, x_heads, inter_dtype, out_dtype, has_scale=False, scaled_dtype=None):
  x, u, v, scale = _split(ops, has_scale)
  h, k, r = u.shape
  if x_heads:
    t = jnp.einsum("...hk,hkr->...hr", x, u, preferred_element_type=inter_dtype)
  else:  # one GEMM against all heads' columns, as x·U[K, H·r] computes it
    u2 = jnp.transpose(u, (1, 0, 2)).reshape(k, h * r)
    t = jnp.matmul(x, u2, preferred_element_type=inter_dtype).reshape(*x.shape[:-1], h, r)
  t = apply_scale(t, scale, scaled_dtype)
  return jnp.einsum("...hr,hrn->...hn", t, v, preferred_element_type=out_dtype)


def lr_xuv_batched_reference(
  x, u, v, *, scale=None, x_heads=True, out_dtype=None, inter_dtype=None
):
  """Pure-jnp reference of :func:`lr_xuv_batched` (its lowering on every platform)."""
  ops = (x, u, v) + ((scale,) if scale is not None else ())
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(*ops))
  inter_dtype = jnp.dtype(inter_dtype or out_dtype)
  return _reference(
    *ops,
    x_heads=x_heads,
    inter_dtype=inter_dtype,
    out_dtype=out_dtype,
    **scale_params(scale, None, inter_dtype),
  )


@lr_xuv_batched_p.def_abstract_eval
def _abstract(*ops, x_heads, inter_dtype, out_dtype, has_scale=False, scaled_dtype=None):
  x, u, v, scale = _split(ops, has_scale)
  return _jaxpr.result_aval(_check(x, u, v, scale, x_heads), out_dtype, *ops)


# impl, JVP (through the reference), vmap (x's batch dim leads) and the registry lowering
# (no kernel is registered: the reference serves)
primitives.register_reference(lr_xuv_batched_p, _reference)
