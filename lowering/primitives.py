"""The two primitives that are the contract between the pass and the kernels.

``lr_xuv``  y = ((x·u) ⊙ s)·v (+ bias)                x [..., K], u [K, r], v [r, N], s [r]
``lr_mlp``  gated:     act(x·Ug·Vg + bg) ⊙ (x·Uu·Vu + bu) → ·Ud·Vd + bd
            non-gated: act(x·U1·V1 + b1) → ·U2·V2 + b2
            (each projection may carry its own rank-space scale s, as in lr_xuv)

Each primitive has an abstract eval, a pure-jnp reference (the default lowering on
every platform), a vmap rule and a JVP whose tangent goes through the reference,
so reverse mode (LoRA training through a fused model) works. The primal of a JVP
still binds the primitive, so the kernel serves the forward pass.

Numerics of the reference: every matmul accumulates in f32; the rank-space
intermediate and the MLP's activations are rounded to ``inter_dtype`` (the dtype
the unfused program had there), and the output is cast to ``out_dtype``. The reference
performs the operations of the code the pass matched, in its order and dtypes: the
optional rank-space scale ``s`` (SVD storage U·Σ·Vᵀ, or ``(x @ u * c) @ v``) multiplies the
intermediate in ``s.dtype`` and the product is rounded to ``scaled_dtype``; a bias is added
to the second product after it was rounded to ``out_dtype``, as ``y + b`` does.

The scale is optional: a primitive bound without one carries no ``has_scale`` /
``scaled_dtype`` / ``scale_mask`` params at all, so kernels written before it see the params
they always saw.
"""

from __future__ import annotations

import functools
import logging
from typing import Any
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from lrjax.lowering import _jaxpr, registry

log = logging.getLogger("lrjax.lowering")

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _gelu_exact(x):
  return jax.nn.gelu(x, approximate=False)


def _gelu_tanh(x):
  return jax.nn.gelu(x, approximate=True)


ACTIVATIONS = {
  "silu": jax.nn.silu,
  "gelu_tanh": _gelu_tanh,
  "gelu": _gelu_exact,
  "relu": jax.nn.relu,
}


def _check_float(name, a):
  if jnp.dtype(a.dtype) not in FLOAT_DTYPES:
    raise TypeError(
      f"{name}.dtype={a.dtype} is not supported; expected one of {[str(d) for d in FLOAT_DTYPES]}"
    )


# ----------------------------------------------------------------------------- lr_xuv

lr_xuv_p = Primitive("lr_xuv")


def _xuv_check(x, u, v, bias, scale=None):
  opt = ((("bias", bias),) if bias is not None else ()) + (
    (("scale", scale),) if scale is not None else ()
  )
  for name, a in (("x", x), ("u", u), ("v", v)) + opt:
    _check_float(name, a)
  if x.ndim < 1:
    raise ValueError(f"{x.shape=} must have at least one dim [..., K]")
  if u.ndim != 2 or v.ndim != 2:
    raise ValueError(f"{u.shape=} and {v.shape=} must be 2-D: u [K, r], v [r, N]")
  if x.shape[-1] != u.shape[0]:
    raise ValueError(f"{x.shape=} and {u.shape=} disagree on K: expected x [..., K], u [K, r]")
  if u.shape[1] != v.shape[0]:
    raise ValueError(f"{u.shape=} and {v.shape=} disagree on the rank: expected u [K, r], v [r, N]")
  if bias is not None and bias.shape != (v.shape[1],):
    raise ValueError(f"{bias.shape=} must be ({v.shape[1]},), the output width N")
  if scale is not None and scale.shape != (u.shape[1],):
    raise ValueError(f"{scale.shape=} must be ({u.shape[1]},), the rank r")


def scale_params(scale, scaled_dtype, inter_dtype) -> dict:
  """The optional params of a rank-space scale (empty without one)."""
  if scale is None:
    if scaled_dtype is not None:
      raise ValueError(f"{scaled_dtype=} given without a scale")
    return {}
  return dict(has_scale=True, scaled_dtype=jnp.dtype(scaled_dtype or inter_dtype))


def lr_xuv(x, u, v, bias=None, *, scale=None, out_dtype=None, inter_dtype=None, scaled_dtype=None):
  """y = ((x·u) ⊙ scale)·v (+ bias), accumulated in f32.

  Args:
    x: [..., K] activations (bf16, f16 or f32).
    u: [K, r] first factor.
    v: [r, N] second factor.
    bias: optional [N], added to the product rounded to ``out_dtype``.
    scale: optional [r] rank-space scale (Σ of an SVD, or a scalar broadcast to [r]),
      multiplied into the intermediate in ``scale.dtype``.
    out_dtype: output dtype; defaults to the promoted input dtype.
    inter_dtype: dtype of the rank-space intermediate in the reference;
      defaults to ``out_dtype``. Kernels may keep it in f32.
    scaled_dtype: dtype the scaled intermediate is rounded to before the second product;
      defaults to ``inter_dtype``.
  """
  _xuv_check(x, u, v, bias, scale)
  ops = (x, u, v) + ((bias,) if bias is not None else ()) + ((scale,) if scale is not None else ())
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(*ops))
  inter_dtype = jnp.dtype(inter_dtype or out_dtype)
  return lr_xuv_p.bind(
    *ops,
    has_bias=bias is not None,
    inter_dtype=inter_dtype,
    out_dtype=out_dtype,
    **scale_params(scale, scaled_dtype, inter_dtype),
  )


def xuv_operands(ops: Sequence[Any], params) -> tuple:
  """(x, u, v, bias | None, scale | None) from the bound operands of ``lr_xuv``."""
  x, u, v = ops[:3]
  i = 3
  bias = scale = None
  if params["has_bias"]:
    bias, i = ops[i], i + 1
  if params.get("has_scale", False):
    scale, i = ops[i], i + 1
  if i != len(ops):
    raise ValueError(f"lr_xuv got {len(ops)} operands, expected {i} for params {dict(params)}")
  return x, u, v, bias, scale


def apply_scale(t, scale, scaled_dtype):
  """t ⊙ scale in ``scale.dtype`` (t cast to it first, as jnp promotion does), rounded to
  ``scaled_dtype``: the rank-space scale exactly as ``(x @ u) * s`` computes it."""
  if scale is None:
    return t
  return (t.astype(scale.dtype) * scale).astype(scaled_dtype)


def _xuv_chain(x, u, v, bias, inter_dtype, out_dtype, scale=None, scaled_dtype=None):
  """The shared X·U·V of both references: each product accumulates in f32 (XLA's GEMMs
  do for 16-bit inputs) and is rounded once, to the dtype it is stored in. Asking the dot
  for that dtype directly, not for f32 plus a convert, lets XLA emit the same single GEMM
  it emits for a user's ``(x @ u) @ v``: an f32 product and a separate convert measured
  ~10% slower at prefill on the H200."""
  x, u = _promoted(x, u)
  t = jnp.matmul(x, u, preferred_element_type=inter_dtype)
  return rank_space_out(apply_scale(t, scale, scaled_dtype), v, bias, out_dtype)


def _promoted(a, b):
  """a, b cast to their common dtype, as ``a @ b`` does (a no-op when they agree)."""
  dt = jnp.promote_types(a.dtype, b.dtype)
  return a.astype(dt), b.astype(dt)


def rank_space_out(t, v, bias, out_dtype):
  """t·v (+ bias): the second product of X·U·V from its rank-space intermediate ``t``,
  rounded once to ``out_dtype``; the bias is then added in ``out_dtype``, as ``t @ v + b``
  computes it (kernels may add it in f32 before rounding, within the dtype's tolerance)."""
  t, v = _promoted(t, v)
  y = jnp.matmul(t, v, preferred_element_type=out_dtype)
  if bias is None:
    return y
  return (y + bias.astype(out_dtype)).astype(out_dtype)


def lr_xuv_reference(
  x, u, v, bias=None, *, scale=None, inter_dtype=None, out_dtype=None, scaled_dtype=None
):
  """Pure-jnp reference of :func:`lr_xuv` (also its default lowering)."""
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(x, u, v))
  inter_dtype = jnp.dtype(inter_dtype or out_dtype)
  scaled_dtype = jnp.dtype(scaled_dtype or inter_dtype)
  return _xuv_chain(x, u, v, bias, inter_dtype, out_dtype, scale, scaled_dtype)


def _xuv_ref_ops(*ops, has_bias, inter_dtype, out_dtype, has_scale=False, scaled_dtype=None):
  params = dict(has_bias=has_bias, has_scale=has_scale)
  x, u, v, bias, scale = xuv_operands(ops, params)
  return _xuv_chain(x, u, v, bias, inter_dtype, out_dtype, scale, scaled_dtype)


@lr_xuv_p.def_abstract_eval
def _xuv_abstract(*ops, has_bias, inter_dtype, out_dtype, has_scale=False, scaled_dtype=None):
  x, u, v, bias, scale = xuv_operands(ops, dict(has_bias=has_bias, has_scale=has_scale))
  _xuv_check(x, u, v, bias, scale)
  return _jaxpr.result_aval(x.shape[:-1] + (v.shape[1],), out_dtype, *ops)


# ----------------------------------------------------------------------------- lr_mlp

lr_mlp_p = Primitive("lr_mlp")

# Operand layout: x, [ug, vg, (bg), (sg)], uu, vu, (bu), (su), ud, vd, (bd), (sd). ``bias_mask``
# has one flag per projection in that order: (gate, up, down) if gated else (up, down); the
# optional ``scale_mask`` param (absent when no projection has a scale) likewise flags the
# rank-space scales [r] (multiplied into the intermediate in ``inter_dtype``).


def mlp_operands(
  ops: Sequence[Any], gated: bool, bias_mask: Sequence[bool], scale_mask: Sequence[bool] = ()
) -> dict:
  """Names the flat operands of ``lr_mlp``: {'x', 'gate', 'up', 'down'} -> (u, v, bias|None),
  and 'scales' -> {'gate'|'up'|'down': scale | None}."""
  names = ("gate", "up", "down") if gated else ("up", "down")
  scale_mask = tuple(scale_mask) or (False,) * len(names)
  if len(bias_mask) != len(names) or len(scale_mask) != len(names):
    raise ValueError(f"{bias_mask=} and {scale_mask=} must have {len(names)} flags for {names}")
  out = {"x": ops[0], "gate": None, "scales": {"gate": None}}
  i = 1
  for name, hb, hs in zip(names, bias_mask, scale_mask):
    u, v = ops[i], ops[i + 1]
    i += 2
    b = s = None
    if hb:
      b, i = ops[i], i + 1
    if hs:
      s, i = ops[i], i + 1
    out[name] = (u, v, b)
    out["scales"][name] = s
  if i != len(ops):
    raise ValueError(
      f"lr_mlp got {len(ops)} operands, expected {i} for {gated=} {bias_mask=} {scale_mask=}"
    )
  return out


def _mlp_flatten(projs):
  """Flat operands, bias mask and scale mask from (u, v[, bias[, scale]]) projections."""
  ops, bmask, smask = [], [], []
  for p in projs:
    if not isinstance(p, (tuple, list)) or len(p) not in (2, 3, 4):
      raise ValueError(
        f"each projection must be (u, v), (u, v, bias) or (u, v, bias, scale); got {p!r:.80}"
      )
    b = p[2] if len(p) >= 3 else None
    sc = p[3] if len(p) == 4 else None
    ops += [p[0], p[1]] + ([b] if b is not None else []) + ([sc] if sc is not None else [])
    bmask.append(b is not None)
    smask.append(sc is not None)
  return ops, tuple(bmask), tuple(smask)


def lr_mlp(x, up, down, gate=None, *, act="silu", out_dtype=None, inter_dtype=None):
  """Low-rank MLP. ``up``, ``down`` and ``gate`` are (u, v), (u, v, bias) or
  (u, v, bias | None, scale) tuples (scale: [r], in ``inter_dtype``).

  gated (``gate`` given): act(x·Ug·Vg + bg) ⊙ (x·Uu·Vu + bu) → ·Ud·Vd + bd
  non-gated:              act(x·Uu·Vu + bu) → ·Ud·Vd + bd
  """
  if act not in ACTIVATIONS:
    raise ValueError(f"{act=} is not supported; expected one of {sorted(ACTIVATIONS)}")
  projs = ((gate,) if gate is not None else ()) + (up, down)
  flat, bmask, smask = _mlp_flatten(projs)
  ops = [x] + flat
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(*ops))
  inter_dtype = jnp.dtype(inter_dtype or out_dtype)
  params = dict(
    gated=gate is not None,
    act=act,
    bias_mask=bmask,
    inter_dtype=inter_dtype,
    out_dtype=out_dtype,
  )
  if any(smask):
    params["scale_mask"] = smask
  _mlp_check(ops, **params)
  return lr_mlp_p.bind(*ops, **params)


def _mlp_check(ops, *, gated, act, bias_mask, inter_dtype, out_dtype, scale_mask=()):
  if act not in ACTIVATIONS:
    raise ValueError(f"{act=} is not supported; expected one of {sorted(ACTIVATIONS)}")
  d = mlp_operands(ops, gated, bias_mask, scale_mask)
  sc = d["scales"]
  for name, s in sc.items():
    if s is not None and jnp.dtype(s.dtype) != jnp.dtype(inter_dtype):
      raise ValueError(f"{name} scale dtype {s.dtype} must be the inter_dtype {inter_dtype}")
  x = d["x"]
  up_u, up_v, _ = d["up"]
  _xuv_check(x, up_u, up_v, d["up"][2], sc["up"])
  if gated:
    _xuv_check(x, *d["gate"], sc["gate"])
    if d["gate"][1].shape[1] != up_v.shape[1]:
      raise ValueError(
        f"gate width {d['gate'][1].shape[1]} != up width {up_v.shape[1]}; "
        "the gated MLP multiplies them elementwise"
      )
  du, dv, db = d["down"]
  if du.shape[0] != up_v.shape[1]:
    raise ValueError(
      f"down u.shape={du.shape} must start with the intermediate width {up_v.shape[1]}"
    )
  _xuv_check(jax.ShapeDtypeStruct(x.shape[:-1] + (du.shape[0],), x.dtype), du, dv, db, sc["down"])
  return x.shape[:-1] + (dv.shape[1],)


def _mlp_ref_ops(*ops, gated, act, bias_mask, inter_dtype, out_dtype, scale_mask=()):
  d = mlp_operands(ops, gated, bias_mask, scale_mask)
  sc = d["scales"]
  f = ACTIVATIONS[act]
  h = _xuv_chain(d["x"], *d["up"], inter_dtype, inter_dtype, sc["up"], inter_dtype)
  if gated:
    g = _xuv_chain(d["x"], *d["gate"], inter_dtype, inter_dtype, sc["gate"], inter_dtype)
    h = f(g) * h
  else:
    h = f(h)
  return _xuv_chain(h, *d["down"], inter_dtype, out_dtype, sc["down"], inter_dtype)


def lr_mlp_reference(x, up, down, gate=None, *, act="silu", out_dtype=None, inter_dtype=None):
  """Pure-jnp reference of :func:`lr_mlp` (also its default lowering)."""
  projs = ((gate,) if gate is not None else ()) + (up, down)
  flat, bmask, smask = _mlp_flatten(projs)
  ops = [x] + flat
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(*ops))
  return _mlp_ref_ops(
    *ops,
    gated=gate is not None,
    act=act,
    bias_mask=bmask,
    inter_dtype=jnp.dtype(inter_dtype or out_dtype),
    out_dtype=out_dtype,
    scale_mask=smask if any(smask) else (),
  )


@lr_mlp_p.def_abstract_eval
def _mlp_abstract(*ops, **params):
  return _jaxpr.result_aval(_mlp_check(ops, **params), params["out_dtype"], *ops)


# ------------------------------------------------------------------ shared rules

REFERENCES = {lr_xuv_p: _xuv_ref_ops, lr_mlp_p: _mlp_ref_ops}
# Operand index 0 is the activation; all others are weights (shared across the batch).
_ACT_OPERANDS = 1


def _impl(prim):
  def impl(*ops, **params):
    if jax.config.jax_disable_jit:  # eager: the reference, op by op (no compile per call)
      return REFERENCES[prim](*ops, **params)
    return jax.jit(functools.partial(prim.bind, **params))(*ops)

  return impl


def _jvp(prim):
  ref = REFERENCES[prim]

  def jvp(primals, tangents, **params):
    out = prim.bind(*primals, **params)
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    _, t_out = jax.jvp(functools.partial(ref, **params), tuple(primals), tuple(tangents))
    return out, t_out

  return jvp


def _batch(prim):
  ref = REFERENCES[prim]

  def rule(args, dims, **params):
    if all(d is None for d in dims[_ACT_OPERANDS:]):
      # Only the activation is batched: the batch dim becomes one more leading dim.
      x = jnp.moveaxis(args[0], dims[0], 0)
      return prim.bind(x, *args[1:], **params), 0
    # Batched weights (e.g. vmap over an ensemble): no kernel takes per-example
    # factors, so vmap the reference.
    out = jax.vmap(functools.partial(ref, **params), in_axes=dims)(*args)
    return out, 0

  return rule


def _lowering(prim):
  ref = REFERENCES[prim]

  def rule(ctx, *args, **params):
    platforms = tuple(ctx.module_context.platforms)
    fn = ref
    if len(platforms) == 1:
      sel = registry.select(prim.name, platforms[0], ctx.avals_in, params)
      for name, reason in sel.declined:
        log.debug("%s on %s: %s declined: %s", prim.name, platforms[0], name, reason)
      if sel.kernel is not None:
        log.debug("%s on %s: lowering with %s", prim.name, platforms[0], sel.kernel.name)
        # A kernel is a custom call XLA cannot split: lrjax.sharding runs it on local shards
        # (lowering/partitioning.py; inlined unchanged on a single device).
        from lrjax.lowering import partitioning

        impl = partitioning.wrap(ctx, prim.name, sel.kernel.load(), params)
        return mlir.lower_fun(impl, multiple_results=prim.multiple_results)(ctx, *args)
    else:
      log.debug("%s: multi-platform lowering %s uses the reference", prim.name, platforms)
    impl = functools.partial(fn, **params)
    return mlir.lower_fun(impl, multiple_results=prim.multiple_results)(ctx, *args)

  return rule


def register_lowering(prim, rule) -> None:
  """``mlir.register_lowering`` for an lrjax primitive: lowered inline at each use, not once
  per distinct operand shapes as a cached function, so the Triton decode calls of one block
  see each other and share a chained scratch (custom_calls/triton/launch.py)."""
  mlir.register_lowering(prim, rule, cacheable=False)


for _p in (lr_xuv_p, lr_mlp_p):
  _p.def_impl(_impl(_p))
  ad.primitive_jvps[_p] = _jvp(_p)
  batching.primitive_batchers[_p] = _batch(_p)
  register_lowering(_p, _lowering(_p))

# Kernels run on local shards under SPMD (registers the primitives as needing devices at lowering).
from lrjax.lowering import partitioning as _partitioning  # noqa: E402,F401


def reference_for(prim) -> Any:
  """The reference function ``ref(*operands, **params)`` of an lrjax primitive."""
  return REFERENCES[prim]


def register_reference(prim, ref, batch=None) -> None:
  """Gives another primitive (e.g. a quantized one) the same jvp/vmap/lowering rules: its
  reference's derivative, the registry's kernel or the reference at lowering (one result or
  several, as ``prim.multiple_results`` says), and ``batch`` for vmap (default: the activation
  batched as one more leading dim, else the reference vmapped)."""
  REFERENCES[prim] = ref
  prim.def_impl(_impl(prim))
  ad.primitive_jvps[prim] = _jvp(prim)
  batching.primitive_batchers[prim] = batch or _batch(prim)
  register_lowering(prim, _lowering(prim))
