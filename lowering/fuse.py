"""``lrjax.fuse``: the jaxpr pattern pass.

``fuse(fn)`` returns a function with ``fn``'s signature. Each call traces ``fn``
to a jaxpr, finds X·U·V chains and low-rank MLPs (``lowering/rules.py``) at every
nesting level (jit, closed_call, custom_jvp/vjp, checkpoint, scan, cond, while),
and evaluates the jaxpr with the matches replaced by ``lr_xuv`` / ``lr_mlp``; 2-3
``lr_xuv`` that read the same input are bound as one ``lr_xuv_group``.
Nested jaxprs are re-traced with their rewrites and re-bound with their original
params, so shardings, donation and names of jitted sub-functions are kept.

Use it under a transformation that caches tracing (``jax.jit``, ``nnx.jit``);
eagerly it re-traces on every call.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any
from collections.abc import Callable, Sequence

import jax

from lrjax.lowering import _jaxpr as jx
from lrjax.lowering import rules as rules_lib
from lrjax.lowering.group import MAX_MEMBERS, lr_xuv_group_p
from lrjax.lowering.primitives import lr_xuv_p

log = logging.getLogger("lrjax.lowering")


@dataclasses.dataclass
class Plan:
  """What to rewrite in one jaxpr, and in the jaxprs nested in it."""

  roots: dict  # eqn index -> Match
  absorbed: frozenset  # eqn indices that disappear
  subs: dict  # eqn index -> [(SubJaxpr, Plan)]
  groups: dict = dataclasses.field(default_factory=dict)  # first root -> (Match, ...)
  grouped: frozenset = frozenset()  # the other members' roots (emitted with their group)

  @property
  def empty(self) -> bool:
    return not self.roots and not self.subs


@dataclasses.dataclass
class Analysis:
  matches: list
  near_misses: list
  rules: tuple
  groups: list = dataclasses.field(default_factory=list)  # tuples of lr_xuv matches


def _eqn_label(e) -> str:
  name = e.params.get("name")
  return f"{e.primitive.name}({name})" if isinstance(name, str) else e.primitive.name


def xuv_groups(jaxpr, matches, absorbed) -> list:
  """lr_xuv matches that read the same input var with the same dtypes, in groups of 2-3
  (in eqn order), each placed at its first member's root: every operand of every member
  must exist by then (an input, a literal, or the output of an earlier kept eqn)."""
  produced = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
  by_input: dict = {}
  for m in sorted(matches, key=lambda m: m.root):
    if m.primitive is lr_xuv_p and m.x is not None and not jx.is_literal(m.x):
      key = (m.x, m.params["inter_dtype"], m.params["out_dtype"])
      by_input.setdefault(key, []).append(m)
  groups = []
  for members in by_input.values():
    while len(members) >= 2:
      first, ready = members[0].root, [members[0]]
      for m in members[1:]:
        if len(ready) < MAX_MEMBERS and all(
          jx.is_literal(v)
          or v not in produced
          or (produced[v] < first and produced[v] not in absorbed)
          for v in m.reads
        ):
          ready.append(m)
      if len(ready) >= 2:
        groups.append(tuple(ready))
      members = [m for m in members[1:] if all(m is not r for r in ready)]
  return groups


def build_plan(
  jaxpr,
  consts,
  weight_invars: Sequence[bool],
  rules,
  analysis: Analysis,
  path: str = "",
  group: bool = False,
) -> Plan:
  g = rules_lib.Graph(jaxpr, weight_invars, path or "<top>", consts)
  matches, near = rules_lib.find_matches(g, rules)
  analysis.matches += matches
  analysis.near_misses += near
  roots = {m.root: m for m in matches}
  absorbed = frozenset(i for m in matches for i in m.absorbed if i != m.root)
  subs = {}
  for i, e in enumerate(jaxpr.eqns):
    if i in absorbed or i in roots:
      continue
    if e.primitive.name == "shard_map":
      continue  # bodies see per-device shapes; kernels there are placed by lrjax.sharding
    for s in jx.sub_jaxprs(e):
      carried = jx.carried_invars(e, s)
      flags = [
        om is not None and k not in carried and g.is_weight(e.invars[om])
        for k, om in enumerate(s.operand_map)
      ]
      p = build_plan(
        s.jaxpr,
        s.consts,
        flags,
        rules,
        analysis,
        f"{path}/{_eqn_label(e)}" if path else _eqn_label(e),
        group,
      )
      if not p.empty:
        subs.setdefault(i, []).append((s, p))
  groups = xuv_groups(jaxpr, matches, absorbed) if group else []
  analysis.groups += groups
  return Plan(
    roots,
    absorbed,
    subs,
    {g[0].root: g for g in groups},
    frozenset(m.root for g in groups for m in g[1:]),
  )


def emit_group(jaxpr, members, read, env) -> None:
  """Binds one lr_xuv_group for ``members`` and sets each member's root output."""
  ops, mask = [read(members[0].x)], []
  for m in members:
    ops += m.operands(read)[1:]
    mask.append(m.params["has_bias"])
  p = members[0].params
  outs = lr_xuv_group_p.bind(
    *ops, bias_mask=tuple(mask), inter_dtype=p["inter_dtype"], out_dtype=p["out_dtype"]
  )
  for m, y in zip(members, outs):
    env[jaxpr.eqns[m.root].outvars[0]] = y


def run_plan(jaxpr, consts, plan: Plan, *args):
  """Evaluates ``jaxpr`` with ``plan``'s rewrites under the current trace."""
  env: dict = {}

  def read(a):
    return a.val if jx.is_literal(a) else env[a]

  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for i, e in enumerate(jaxpr.eqns):
    if i in plan.absorbed or i in plan.grouped:
      continue
    if i in plan.groups:
      emit_group(jaxpr, plan.groups[i], read, env)
      continue
    m = plan.roots.get(i)
    if m is not None:
      env[e.outvars[0]] = m.emit(read)
      continue
    invals = [read(a) for a in e.invars]
    params = e.params
    for s, p in plan.subs.get(i, ()):
      new = jx.retrace(
        functools.partial(run_plan, s.jaxpr, s.consts, p), [v.aval for v in s.jaxpr.invars]
      )
      params, extra = jx.replace_sub_jaxpr(e, s, new, params)
      invals = list(extra) + invals
    env.update(zip(e.outvars, jx.bind_eqn(e, invals, params)))
  return [read(a) for a in jaxpr.outvars]


def _split_args(args, kwargs):
  leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
  dyn_idx = [i for i, x in enumerate(leaves) if _is_array(x)]
  return leaves, tree, dyn_idx


def _is_array(x) -> bool:
  return (
    isinstance(x, (jax.Array, jax.core.Tracer))
    or hasattr(x, "__jax_array__")
    or (hasattr(x, "shape") and hasattr(x, "dtype"))
    or isinstance(x, (int, float, complex, bool))
  )


def trace(fn: Callable, args, kwargs):
  """Traces ``fn(*args, **kwargs)``; returns (closed jaxpr, dynamic leaves, out tree)."""
  leaves, tree, dyn_idx = _split_args(args, kwargs)

  def flat(*dyn):
    full = list(leaves)
    for i, x in zip(dyn_idx, dyn):
      full[i] = x
    a, k = jax.tree_util.tree_unflatten(tree, full)
    return fn(*a, **k)

  dyn = [leaves[i] for i in dyn_idx]
  closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*dyn)
  return closed, dyn, jax.tree_util.tree_structure(out_shape)


def analyze(fn: Callable, args, kwargs, rules, group: bool = False) -> tuple:
  closed, dyn, out_tree = trace(fn, args, kwargs)
  analysis = Analysis([], [], tuple(rules))
  # At the top level every input may be a weight: the rules also require the
  # x·u·v shape, the rank condition and single use before anything is rewritten.
  plan = build_plan(
    closed.jaxpr, closed.consts, [True] * len(closed.jaxpr.invars), rules, analysis, group=group
  )
  return closed, dyn, out_tree, plan, analysis


def fuse(
  fn: Callable | None = None,
  *,
  rules: Sequence[Any] | None = None,
  rank_threshold: float | None = None,
  group: bool = True,
) -> Callable:
  """Returns ``fn`` with its X·U·V chains and low-rank MLPs rewritten into lrjax primitives.

  Args:
    fn: any JAX function, or a Flax NNX module (then ``fuse(module)(*args)`` calls it).
    rules: rewrite rules (default ``rules.DEFAULT_RULES``).
    rank_threshold: fuse x·u·v only when r·(K+N) < rank_threshold·K·N (default 1.0).
    group: bind 2-3 X·U·V chains that read the same input (e.g. q/k/v) as one
      ``lr_xuv_group`` (lowering/group.py; default on): one grouped kernel on a single CUDA
      device, the members' own lowerings elsewhere. ``False`` keeps one ``lr_xuv`` each.

  Usable as ``jax.jit(lrjax.fuse(f))``, inside ``nnx.jit`` or Linen ``apply``, and
  under ``jax.grad`` / ``jax.vmap``.
  """
  if fn is None:
    return functools.partial(fuse, rules=rules, rank_threshold=rank_threshold, group=group)
  rules = tuple(rules if rules is not None else rules_lib.DEFAULT_RULES)
  if rank_threshold is not None:
    if not rank_threshold > 0:
      raise ValueError(f"{rank_threshold=} must be > 0")
    rules = tuple(
      dataclasses.replace(r, rank_threshold=rank_threshold)
      if isinstance(r, rules_lib.XUVRule)
      else r
      for r in rules
    )
  if not callable(fn):
    raise TypeError(f"lrjax.fuse expects a callable or an NNX module; got {type(fn).__name__}")
  target = _module_call(fn)

  @functools.wraps(fn if not _is_module(fn) else type(fn).__call__)
  def fused(*args, **kwargs):
    a, k = ((fn,) + args, kwargs) if target is not fn else (args, kwargs)
    closed, dyn, out_tree, plan, analysis = analyze(target, a, k, rules, group)
    for m in analysis.matches:
      log.debug("fuse: %s at %s (%s)", m.pattern, m.location, m.path)
    outs = run_plan(closed.jaxpr, closed.consts, plan, *dyn)
    return jax.tree_util.tree_unflatten(out_tree, outs)

  fused.__lrjax_fused__ = True
  return fused


def _is_module(fn) -> bool:
  try:
    from flax import nnx
  except ImportError:  # pragma: no cover
    return False
  return isinstance(fn, nnx.Module)


def _module_call(fn):
  """For an NNX module, a function of (module, *args) that calls it."""
  if _is_module(fn):
    return lambda module, *a, **k: module(*a, **k)
  return fn
