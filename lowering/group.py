"""``lr_xuv_group``: two or three X·U_i·V_i chains that share their input X (e.g. the q, k and
v projections of one attention layer), as one primitive.

XLA merges dots that share an operand, so in a model its q/k/v X·U is one GEMM; three
separate kernel calls pay a launch and a phase hand-off each. On a single CUDA device the
group lowers to one grouped decode kernel (custom_calls/triton/xuv_decode.py,
``xuv_decode_group``: 1.55-1.9x XLA's merged dots at 2-16 rows on Llama-3-8B and 3.2-1B
q/k/v, 1.3-1.7x at 32-64, results/gpu_xuv_group_h200.json). Where that kernel declines (above
64 rows, or where the policy measured it slower), the
group lowers as XLA's reference, whose dot merger batches the members' X·U: one kernel per
member measured slower than that in the whole Llama-3-8B decode step at batch 32 and 64
(results/model_1gpu_h200.json); ``prefer_kernels()`` lowers the members instead. Under SPMD
and on platforms without a grouped kernel, the group lowers as its members: one ``lr_xuv``
each, so every member keeps its own kernel choice and its own partitioning rule.

Operands: x, then per member u_i, v_i, (if ``bias_mask[i]``) bias_i and (if ``scale_mask[i]``)
scale_i [r_i]. Params: ``bias_mask``, ``inter_dtype``, ``out_dtype`` (shared), and ``scale_mask``
only when a member has a rank-space scale (applied in ``inter_dtype``, as lr_xuv does).
Results: one [..., N_i] array per member.
``lrjax.fuse(f, group=True)`` forms groups from ``lr_xuv`` matches with the same input.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from lrjax.lowering import _jaxpr, partitioning, primitives, registry
from lrjax.lowering.primitives import _xuv_check, lr_xuv_p, lr_xuv_reference

log = logging.getLogger("lrjax.lowering")

lr_xuv_group_p = Primitive("lr_xuv_group")
lr_xuv_group_p.multiple_results = True
MAX_MEMBERS = 3


def members_of(ops, bias_mask, scale_mask=()):
  """[(u, v, bias | None)] of each member from the bound operands (after x)."""
  return [m[:3] for m in members_with_scales(ops, bias_mask, scale_mask)]


def members_with_scales(ops, bias_mask, scale_mask=()):
  """[(u, v, bias | None, scale | None)] of each member from the bound operands (after x)."""
  scale_mask = tuple(scale_mask) or (False,) * len(bias_mask)
  if len(scale_mask) != len(bias_mask):
    raise ValueError(f"{bias_mask=} and {scale_mask=} must have one flag per member")
  out, i = [], 1
  for has_bias, has_scale in zip(bias_mask, scale_mask):
    u, v = ops[i], ops[i + 1]
    i += 2
    b = s = None
    if has_bias:
      b, i = ops[i], i + 1
    if has_scale:
      s, i = ops[i], i + 1
    out.append((u, v, b, s))
  if i != len(ops):
    raise ValueError(f"lr_xuv_group got {len(ops)} operands, expected {i}")
  return out


def lr_xuv_group(x, members, *, out_dtype=None, inter_dtype=None):
  """[((x·u_i) ⊙ s_i)·v_i (+ bias_i)] for 2 or 3 members sharing x, each (u_i, v_i),
  (u_i, v_i, bias_i) or (u_i, v_i, bias_i | None, scale_i); dtypes as in
  :func:`lrjax.lowering.lr_xuv`, shared by the members (scales in ``inter_dtype``)."""
  if not 2 <= len(members) <= MAX_MEMBERS:
    raise ValueError(f"{len(members)} members: a group has 2 to {MAX_MEMBERS}")
  ops, mask, smask = [x], [], []
  for i, m in enumerate(members):
    if not isinstance(m, (tuple, list)) or len(m) not in (2, 3, 4):
      raise ValueError(f"member {i}: expected (u, v), (u, v, bias) or (u, v, bias, scale)")
    b = m[2] if len(m) >= 3 else None
    s = m[3] if len(m) == 4 else None
    _xuv_check(x, m[0], m[1], b, s)
    ops += [m[0], m[1]] + ([b] if b is not None else []) + ([s] if s is not None else [])
    mask.append(b is not None)
    smask.append(s is not None)
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(*ops))
  params = dict(
    bias_mask=tuple(mask), out_dtype=out_dtype, inter_dtype=jnp.dtype(inter_dtype or out_dtype)
  )
  if any(smask):
    params["scale_mask"] = tuple(smask)
  return lr_xuv_group_p.bind(*ops, **params)


def _member_scale(s, inter_dtype) -> dict:
  return {} if s is None else dict(has_scale=True, scaled_dtype=inter_dtype)


def _as_members(*ops, bias_mask, inter_dtype, out_dtype, scale_mask=()):
  """The group as its members: one lr_xuv each (under SPMD and without a grouped kernel)."""
  return [
    lr_xuv_p.bind(
      ops[0],
      u,
      v,
      *(() if b is None else (b,)),
      *(() if s is None else (s,)),
      has_bias=b is not None,
      inter_dtype=inter_dtype,
      out_dtype=out_dtype,
      **_member_scale(s, inter_dtype),
    )
    for u, v, b, s in members_with_scales(ops, bias_mask, scale_mask)
  ]


def _reference(*ops, bias_mask, inter_dtype, out_dtype, scale_mask=()):
  """The group as XLA's reference: every member's X·U·V in jnp (XLA merges the X·U dots)."""
  return [
    lr_xuv_reference(ops[0], u, v, b, scale=s, inter_dtype=inter_dtype, out_dtype=out_dtype)
    for u, v, b, s in members_with_scales(ops, bias_mask, scale_mask)
  ]


@lr_xuv_group_p.def_abstract_eval
def _abstract(*ops, bias_mask, inter_dtype, out_dtype, scale_mask=()):
  x = ops[0]
  outs = []
  for u, v, b, s in members_with_scales(ops, bias_mask, scale_mask):
    _xuv_check(x, u, v, b, s)
    if s is not None and jnp.dtype(s.dtype) != jnp.dtype(inter_dtype):
      raise ValueError(f"a member's scale dtype {s.dtype} must be the inter_dtype {inter_dtype}")
    outs.append(_jaxpr.result_aval(x.shape[:-1] + (v.shape[1],), out_dtype, *ops))
  return outs


def _impl(*ops, **params):
  if jax.config.jax_disable_jit:  # eager: the reference, op by op
    return _reference(*ops, **params)
  return jax.jit(functools.partial(lr_xuv_group_p.bind, **params))(*ops)


def _jvp(primals, tangents, **params):
  tangents = [ad.instantiate_zeros(t) for t in tangents]
  out = lr_xuv_group_p.bind(*primals, **params)
  _, t_out = jax.jvp(functools.partial(_as_members, **params), tuple(primals), tuple(tangents))
  return out, t_out


def _batch(args, dims, **params):
  if all(d is None for d in dims[1:]):  # only x batched: one more leading dim
    x = jnp.moveaxis(args[0], dims[0], 0)
    outs = lr_xuv_group_p.bind(x, *args[1:], **params)
  else:
    outs = jax.vmap(functools.partial(_as_members, **params), in_axes=dims)(*args)
  return outs, [0] * len(outs)


def _lowering(ctx, *args, **params):
  platforms = tuple(ctx.module_context.platforms)
  if len(platforms) == 1 and partitioning.single_device(ctx):
    sel = registry.select(lr_xuv_group_p.name, platforms[0], ctx.avals_in, params)
    for name, reason in sel.declined:
      log.debug("lr_xuv_group on %s: %s declined: %s", platforms[0], name, reason)
    if sel.kernel is not None:
      log.debug("lr_xuv_group on %s: lowering with %s", platforms[0], sel.kernel.name)
      return mlir.lower_fun(functools.partial(sel.kernel.load(), **params), multiple_results=True)(
        ctx, *args
      )
    if sel.declined and not registry.kernels_preferred():  # a grouped kernel declined
      return mlir.lower_fun(functools.partial(_reference, **params), multiple_results=True)(
        ctx, *args
      )
  return mlir.lower_fun(functools.partial(_as_members, **params), multiple_results=True)(ctx, *args)


# its members' kernels lower through custom_partitioning, which needs the device assignment
_jaxpr.require_devices_during_lowering(lr_xuv_group_p)
lr_xuv_group_p.def_impl(_impl)
ad.primitive_jvps[lr_xuv_group_p] = _jvp
batching.primitive_batchers[lr_xuv_group_p] = _batch
primitives.register_lowering(lr_xuv_group_p, _lowering)
