"""Run lr_xuv / lr_mlp kernels on local shards under SPMD partitioning (``custom_partitioning``).

A kernel is a custom call: XLA's partitioner cannot split it and would gather every sharded
operand (whole weights) onto each device. :func:`wrap` gives a selected kernel a partitioning
rule instead. Its ``partition`` callback reads the factor shardings that the params carry
(:mod:`lrjax.sharding` rules) and builds the per-device program:

  u [K,r]     v [r,N]     layout     per device
  ----------  ----------  ---------  ---------------------------------------------------------
  -           -           repl       the primitive on the full operands
  (-, tp)     (tp, -)     rank       the primitive on (u_l, v_l), psum of the [..,N] output
  -           (-, tp)     col        the primitive on (u, v_l); output split on N
  (-, tp)     (-, tp)     lr_col     x·u_l, all-gather in rank space, ·v_l; output split on N
  (tp, -)     -           lr_row     x_l·u_l, psum in rank space, ·v; x must be split on K
  (tp, -)     (-, tp)     split      x_l·u_l, psum in rank space, ·v_l; x split on K, output on N

``lr_mlp`` with gate/up in an lr_col or split layout (or col, where a kernel serves
``lr_mlp_rank`` on the local shapes; else col's local gate/up X·U·V keep their ``lr_xuv``
kernels) and down in lr_row or split runs between its rank-space collectives
``lr_mlp_rank`` (lowering/mlp_rank.py): the gate/up
rank-space inputs x·U are completed by one collective (their partial sums or shards
concatenated), each device applies the SwiGLU on its F/n columns and down's first factor, and
one all-reduce sums the rank-space partials s before ·Vd. Rank-space partial sums are reduced
in f32 and rounded once, as the single-device reference rounds the whole sum once. Other
``lr_mlp`` plans compose the per-pair layouts (the intermediate is all-gathered or sliced when
the down projection needs another layout). Inside the per-device program the primitives are
bound again on local shapes, so kernel selection (``supports``) sees the shard shapes; there
every mesh axis is manual and this wrapper inlines. Any other layout replicates its operands
(logged).

The Shardy rule gives every weight dim its own factor, so that no weight is resharded to make
factors agree; only the batch dims ("...") and the output width (tied to the last v) propagate.

A rank-space scale s [r] is sharded like the rank dim of its pair: split with u's columns in the
rank and lr_col layouts (it multiplies the local x·u_l before any collective), replicated
otherwise (lr_row applies it after the rank-space psum, where the sums are complete).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lrjax.lowering import _jaxpr, registry
from lrjax.lowering.primitives import lr_mlp_p, lr_xuv_p

log = logging.getLogger("lrjax.lowering")


# jax hands device assignments only to lowering rules of primitives marked so, and
# custom_partitioning needs them.
_jaxpr.require_devices_during_lowering(lr_xuv_p, lr_mlp_p)

LAYOUTS = ("repl", "rank", "col", "lr_col", "lr_row", "split")


def _spec(sharding, ndim: int) -> tuple:
  spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
  return spec + (None,) * (ndim - len(spec))


def pair_layout(su: tuple, sv: tuple) -> tuple[str, str | None]:
  """(layout, mesh axis) of one factor pair from the u and v PartitionSpecs."""
  axes = {a for a in su + sv if a is not None}
  if not axes:
    return "repl", None
  if len(axes) > 1 or any(isinstance(a, tuple) for a in axes):
    return "other", None
  ax = axes.pop()
  table = {
    ((None, ax), (ax, None)): "rank",
    ((None, None), (None, ax)): "col",
    ((None, ax), (None, ax)): "lr_col",
    ((ax, None), (None, None)): "lr_row",
    ((ax, None), (None, ax)): "split",
  }
  return table.get((su, sv), "other"), ax


def _out_split(layout: str) -> bool:
  return layout in ("col", "lr_col", "split")


def _k_split(layout: str) -> bool:
  """Whether the pair's input x must be split on K (its u is row-parallel)."""
  return layout in ("lr_row", "split")


def _local_xuv(x, u, v, b, layout, ax, inter_dtype, out_dtype, s=None, scaled_dtype=None):
  """One factor pair on local shards (inside the manual per-device program)."""
  from lrjax.lowering.primitives import apply_scale, lr_xuv_p, rank_space_out, scale_params

  kw = dict(inter_dtype=inter_dtype, out_dtype=out_dtype)
  kw.update(scale_params(s, scaled_dtype if s is not None else None, inter_dtype))
  sc = (s,) if s is not None else ()
  if layout in ("repl", "col"):
    ops = (x, u, v) + ((b,) if b is not None else ()) + sc
    return lr_xuv_p.bind(*ops, has_bias=b is not None, **kw)
  if layout == "rank":
    y = jax.lax.psum(lr_xuv_p.bind(x, u, v, *sc, has_bias=False, **kw), ax)
    return y if b is None else (y + b.astype(out_dtype)).astype(out_dtype)
  # The rank-space collective sits between the two products, so they stay two GEMMs, each
  # rounded once to the dtype it is stored in (as in primitives._xuv_chain).
  xu = jnp.matmul(x, u, preferred_element_type=inter_dtype)
  if layout == "lr_col":  # the local scale columns match the local rank columns
    t = jax.lax.all_gather(apply_scale(xu, s, scaled_dtype), ax, axis=x.ndim - 1, tiled=True)
  elif layout == "split":  # rank-space partial sums, reduced in f32 and rounded once, scaled
    xu = jnp.matmul(x, u, preferred_element_type=jnp.float32)
    t = apply_scale(jax.lax.psum(xu, ax).astype(inter_dtype), s, scaled_dtype)
  else:  # lr_row: rank-space partial sums, reduced in the intermediate dtype, then scaled
    t = apply_scale(jax.lax.psum(xu, ax), s, scaled_dtype)
  return rank_space_out(t, v, b, out_dtype)


def _to_layout(h, split: bool, want_split: bool, ax):
  """Move the MLP intermediate [.., m] between split-on-m and replicated."""
  if split == want_split:
    return h
  if split:
    return jax.lax.all_gather(h, ax, axis=h.ndim - 1, tiled=True)
  n = h.shape[-1] // jax.lax.psum(1, ax)
  return jax.lax.dynamic_slice_in_dim(h, jax.lax.axis_index(ax) * n, n, axis=h.ndim - 1)


def _plan(prim_name: str, shardings, shapes, params):
  """Per-projection layouts, or None when the operands need replicating."""
  from lrjax.lowering.primitives import mlp_operands

  specs = [_spec(s, len(sh)) for s, sh in zip(shardings, shapes)]
  if prim_name == "lr_xuv":
    projs = {"p": (specs[1], specs[2], specs[3] if params["has_bias"] else None)}
  else:
    d = mlp_operands(specs, params["gated"], params["bias_mask"], params.get("scale_mask", ()))
    projs = {k: d[k] for k in ("gate", "up", "down") if d.get(k) is not None}
  out = {}
  for name, (su, sv, _) in projs.items():
    layout, ax = pair_layout(su, sv)
    if layout == "other":
      return None
    out[name] = (layout, ax)
  axes = {ax for _, ax in out.values() if ax is not None}
  if len(axes) > 1:
    return None
  firsts = [out[k][0] for k in ("gate", "up") if k in out]
  if len({_k_split(layout) for layout in firsts}) > 1:
    return None  # gate and up would need x in two layouts
  return out


def _x_spec(x_spec, needs_split_k: bool, ax):
  return P(*x_spec[:-1], ax if needs_split_k else None)


def _bias_spec(layout, ax):
  return P(ax) if _out_split(layout) else P(None)


def _scale_spec(layout, ax):
  return P(ax) if layout in ("rank", "lr_col") else P(None)


def _weights_spec(layout, ax):
  su, sv = {
    "repl": (P(), P()),
    "rank": (P(None, ax), P(ax, None)),
    "col": (P(), P(None, ax)),
    "lr_col": (P(None, ax), P(None, ax)),
    "lr_row": (P(ax, None), P()),
    "split": (P(ax, None), P(None, ax)),
  }[layout]
  return su, sv


def _arg_and_out_specs(prim_name, plan, x_spec, params, nops):
  """PartitionSpecs of every operand and of the output for ``plan``."""
  if prim_name == "lr_xuv":
    layout, ax = plan["p"]
    specs = [_x_spec(x_spec, _k_split(layout), ax), *_weights_spec(layout, ax)]
    if params["has_bias"]:
      specs.append(_bias_spec(layout, ax))
    if params.get("has_scale", False):
      specs.append(_scale_spec(layout, ax))
    out_last = ax if _out_split(layout) else None
    return specs, P(*x_spec[:-1], out_last)
  first = plan.get("gate", plan["up"])
  specs = [_x_spec(x_spec, _k_split(first[0]), first[1])]
  names = ("gate", "up", "down") if params["gated"] else ("up", "down")
  smask = params.get("scale_mask", ()) or (False,) * len(names)
  for name, hb, hs in zip(names, params["bias_mask"], smask):
    layout, ax = plan[name]
    specs += list(_weights_spec(layout, ax))
    if hb:
      specs.append(_bias_spec(layout, ax))
    if hs:
      specs.append(_scale_spec(layout, ax))
  assert len(specs) == nops
  layout, ax = plan["down"]
  return specs, P(*x_spec[:-1], ax if _out_split(layout) else None)


# lr_mlp plans that run lr_mlp_rank between two rank-space collectives: gate/up layouts whose
# v is split on the intermediate's columns, down layouts whose u is split on its rows.
_RANK_IN = ("col", "lr_col", "split")
_RANK_OUT = ("lr_row", "split")


def _mlp_rank_path(*ops, plan, params):
  """Per-device lr_mlp for a (col | lr_col | split) → (lr_row | split) plan: x·U of gate and up
  completed by one collective per kind (all-gather of rank shards, all-reduce of partial sums,
  each over the members concatenated), ``lr_mlp_rank`` on the local columns, one all-reduce of
  its rank-space partial sums, then ·Vd."""
  from lrjax.lowering.mlp_rank import lr_mlp_rank_p
  from lrjax.lowering.primitives import mlp_operands, rank_space_out

  inter, out_dt = params["inter_dtype"], params["out_dtype"]
  gated = params["gated"]
  d = mlp_operands(ops, gated, params["bias_mask"])
  x = d["x"]
  names = ("gate", "up") if gated else ("up",)
  ax = next(a for _, a in plan.values() if a is not None)
  p = {}
  gather = [n for n in names if plan[n][0] == "lr_col"]
  reduce = [n for n in names if plan[n][0] == "split"]
  for n in names:
    if plan[n][0] == "col":  # u replicated: x·u is complete here
      p[n] = jnp.matmul(x, d[n][0], preferred_element_type=inter)
  if gather:  # rank shards [.., r/n] of each member → one all-gather → [.., r] each
    parts = [jnp.matmul(x, d[n][0], preferred_element_type=inter) for n in gather]
    g = jax.lax.all_gather(jnp.concatenate(parts, -1), ax, axis=x.ndim - 1, tiled=False)
    o = 0
    for n, t in zip(gather, parts):
      w = t.shape[-1]
      p[n] = g[..., o : o + w].reshape(*t.shape[:-1], -1)
      o += w
  if reduce:  # partial sums [.., r] of each member → one f32 all-reduce
    parts = [jnp.matmul(x, d[n][0], preferred_element_type=jnp.float32) for n in reduce]
    t = jax.lax.psum(jnp.concatenate(parts, -1) if len(parts) > 1 else parts[0], ax)
    o = 0
    for n, part in zip(reduce, parts):
      p[n] = t[..., o : o + part.shape[-1]].astype(inter)
      o += part.shape[-1]
  rops, mask = [], []
  for n in names:
    _, v, b = d[n]
    rops += [p[n], v] + ([b] if b is not None else [])
    mask.append(b is not None)
  ud, vd, bd = d["down"]
  s = lr_mlp_rank_p.bind(
    *rops,
    ud,
    gated=gated,
    act=params["act"],
    bias_mask=tuple(mask),
    inter_dtype=inter,
    out_dtype=jnp.dtype(jnp.float32),
  )
  s = jax.lax.psum(s, ax).astype(inter)
  return rank_space_out(s, vd, bd, out_dt)


def _registry_platform(mesh) -> str:
  """The kernel registry's platform name of ``mesh``'s devices ("cuda" for NVIDIA GPUs)."""
  d = mesh.devices.flat[0]
  if d.platform == "gpu":
    return "rocm" if "rocm" in str(getattr(d.client, "platform_version", "")).lower() else "cuda"
  return d.platform


def _rank_kernel_serves(ops, params, platform) -> bool:
  """Whether a registered kernel would serve lr_mlp_rank on these local lr_mlp operands (all of
  gate/up with u replicated, so x·U has the whole rank here)."""
  from lrjax.lowering.primitives import mlp_operands

  d = mlp_operands(ops, params["gated"], params["bias_mask"])
  x, inter = d["x"], params["inter_dtype"]
  avals, mask = [], []
  for n in ("gate", "up") if params["gated"] else ("up",):
    u, v, b = d[n]
    avals += [jax.core.ShapedArray(x.shape[:-1] + (u.shape[1],), inter), v.aval]
    avals += [b.aval] if b is not None else []
    mask.append(b is not None)
  avals.append(d["down"][0].aval)
  rparams = dict(
    gated=params["gated"],
    act=params["act"],
    bias_mask=tuple(mask),
    inter_dtype=inter,
    out_dtype=jnp.dtype(jnp.float32),
  )
  return registry.select("lr_mlp_rank", platform, avals, rparams).kernel is not None


def _lower_fn(prim_name, plan, params, platform="cpu"):
  from lrjax.lowering.primitives import mlp_operands

  inter, out_dt = params["inter_dtype"], params["out_dtype"]
  if prim_name == "lr_xuv":
    layout, ax = plan["p"]

    def xuv(*ops):
      from lrjax.lowering.primitives import xuv_operands

      x, u, v, b, s = xuv_operands(ops, params)
      return _local_xuv(x, u, v, b, layout, ax, inter, out_dt, s, params.get("scaled_dtype"))

    return xuv

  from lrjax.lowering.primitives import ACTIVATIONS

  act = ACTIVATIONS[params["act"]]

  names = ("gate", "up") if params["gated"] else ("up",)
  rank_plan = all(plan[n][0] in _RANK_IN for n in names) and plan["down"][0] in _RANK_OUT
  # With u replicated (col) x·U needs no collective, and the gate/up X·U·V are local: their
  # lr_xuv kernels serve unless one serves lr_mlp_rank on these shapes.
  all_col = all(plan[n][0] == "col" for n in names)

  def mlp(*ops):
    d = mlp_operands(ops, params["gated"], params["bias_mask"], params.get("scale_mask", ()))
    sc = d["scales"]
    # lr_mlp_rank takes no rank-space scale: a scaled MLP keeps the per-projection path
    unscaled = all(v is None for v in sc.values())
    if rank_plan and unscaled and (not all_col or _rank_kernel_serves(ops, params, platform)):
      return _mlp_rank_path(*ops, plan=plan, params=params)
    x = d["x"]
    lu, ax = plan["up"]
    h = _local_xuv(x, *d["up"], lu, ax, inter, inter, sc["up"], inter)
    split = _out_split(lu)
    if params["gated"]:
      lg, axg = plan["gate"]
      g = _local_xuv(x, *d["gate"], lg, axg, inter, inter, sc["gate"], inter)
      g = _to_layout(g, _out_split(lg), split, axg or ax)
      h = act(g) * h
    else:
      h = act(h)
    ld, axd = plan["down"]
    h = _to_layout(h, split, _k_split(ld), axd or ax)
    return _local_xuv(h, *d["down"], ld, axd, inter, out_dt, sc["down"], inter)

  return mlp


def _rule_string(prim_name, shapes, params) -> str:
  """Einsum-like Shardy rule: batch dims shared by x and the output, the output width tied to
  the last v's width, every other weight dim its own factor (so no weight gets resharded)."""
  from lrjax.lowering.primitives import mlp_operands

  idx = list(range(len(shapes)))
  if prim_name == "lr_xuv":
    last_v = 2
  else:
    d = mlp_operands(idx, params["gated"], params["bias_mask"], params.get("scale_mask", ()))
    last_v = d["down"][1]
  terms, n = ["... k"], 0
  for i in idx[1:]:
    names = []
    for j in range(len(shapes[i])):
      if i == last_v and j == len(shapes[i]) - 1:
        names.append("n")
      else:
        names.append(f"w{n}")
        n += 1
    terms.append(" ".join(names))
  return ", ".join(terms) + " -> ... n"


@functools.cache
def _wrapped(prim_name: str, kernel_fn, param_items: tuple):
  params = dict(param_items)

  @functools.partial(custom_partitioning)
  def call(*ops):
    return kernel_fn(*ops, **params)

  def plan_and_specs(arg_shapes):
    shardings = [a.sharding for a in arg_shapes]
    shapes = [a.shape for a in arg_shapes]
    plan = _plan(prim_name, shardings, shapes, params)
    x_spec = _spec(shardings[0], len(shapes[0]))
    return plan, x_spec

  def infer(mesh, arg_shapes, result_shape):
    plan, x_spec = plan_and_specs(arg_shapes)
    if plan is None:
      return NamedSharding(mesh, P(*x_spec[:-1], None))
    _, out = _arg_and_out_specs(prim_name, plan, x_spec, params, len(arg_shapes))
    return NamedSharding(mesh, out)

  def partition(mesh, arg_shapes, result_shape):
    plan, x_spec = plan_and_specs(arg_shapes)
    if plan is None:
      log.warning(
        "%s: operand shardings %s fit no local layout; replicating them",
        prim_name,
        [_spec(a.sharding, a.ndim) for a in arg_shapes],
      )
      args = tuple(NamedSharding(mesh, P()) for _ in arg_shapes)
      return mesh, (lambda *ops: kernel_fn(*ops, **params)), NamedSharding(mesh, P()), args
    specs, out = _arg_and_out_specs(prim_name, plan, x_spec, params, len(arg_shapes))
    log.debug("%s: partitioned as %s", prim_name, plan)
    return (
      mesh,
      _lower_fn(prim_name, plan, params, _registry_platform(mesh)),
      NamedSharding(mesh, out),
      tuple(NamedSharding(mesh, s) for s in specs),
    )

  call.def_partition(
    partition=partition,
    infer_sharding_from_operands=infer,
    sharding_rule=lambda mesh, value_types, result_types: _rule_string(
      prim_name, [tuple(t.shape) for t in value_types], params
    ),
  )
  return call


_state = threading.local()


@contextlib.contextmanager
def disabled():
  """Within this context kernels lower as bare custom calls (to show what XLA does then)."""
  prev = getattr(_state, "off", False)
  _state.off = True
  try:
    yield
  finally:
    _state.off = prev


def single_device(ctx) -> bool:
  """Whether this lowering is for one device, unpartitioned."""
  from jax._src import sharding_impls

  ac = ctx.module_context.axis_context
  return isinstance(ac, sharding_impls.ShardingContext) and ac.num_devices == 1


def manual_program(ctx) -> bool:
  """Whether this lowering is inside a per-device program (every mesh axis manual: a
  shard_map body or a custom_partitioning partition), where operands are local shards."""
  from jax._src import sharding_impls

  ac = ctx.module_context.axis_context
  return isinstance(ac, sharding_impls.SPMDAxisContext) and set(ac.manual_axes) == set(
    ac.mesh.axis_names
  )


# Primitives that only a per-device program binds on local shapes (lrjax.sharding): under SPMD
# with sharded operands their reference lowers instead, for XLA to partition.
LOCAL_ONLY = (
  "attention",
  "lr_mlp_rank",
  "decode_attention",
  "decode_attention_append",
  "lr_normed",
  "lr_residual",
)


def wrap(ctx, prim_name: str, kernel_fn, params: dict):
  """``impl(*ops)`` that runs ``kernel_fn(*ops, **params)`` on local shards under SPMD; on
  one device the kernel itself, lowered inline (so its block's Triton decode calls share a
  chained scratch, custom_calls/triton/launch.py)."""
  if getattr(_state, "off", False) or single_device(ctx):
    return functools.partial(kernel_fn, **params)
  if prim_name in LOCAL_ONLY and not manual_program(ctx):
    from lrjax.lowering import primitives

    log.debug("%s: sharded operands outside a per-device program; the reference lowers", prim_name)
    prim = next(p for p in primitives.REFERENCES if p.name == prim_name)
    return functools.partial(primitives.REFERENCES[prim], **params)
  if prim_name not in ("lr_xuv", "lr_mlp"):
    return functools.partial(kernel_fn, **params)
  return _wrapped(prim_name, kernel_fn, tuple(sorted(params.items())))
