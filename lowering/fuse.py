"""``lrjax.fuse``: the jaxpr pattern pass.

``fuse(fn)`` returns a function with ``fn``'s signature. Each call traces ``fn``
to a jaxpr, finds X·U·V chains and low-rank MLPs (``lowering/rules.py``) at every
nesting level (jit, closed_call, custom_jvp/vjp, checkpoint, scan, cond, while),
and evaluates the jaxpr with the matches replaced by ``lr_xuv`` / ``lr_mlp``.
Nested jaxprs are re-traced with their rewrites and re-bound with their original
params, so shardings, donation and names of jitted sub-functions are kept.

Use it under a transformation that caches tracing (``jax.jit``, ``nnx.jit``);
eagerly it re-traces on every call.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Sequence

import jax

from lrjax.lowering import _jaxpr as jx
from lrjax.lowering import rules as rules_lib

log = logging.getLogger("lrjax.lowering")


@dataclasses.dataclass
class Plan:
  """What to rewrite in one jaxpr, and in the jaxprs nested in it."""

  roots: dict  # eqn index -> Match
  absorbed: frozenset  # eqn indices that disappear
  subs: dict  # eqn index -> [(SubJaxpr, Plan)]

  @property
  def empty(self) -> bool:
    return not self.roots and not self.subs


@dataclasses.dataclass
class Analysis:
  matches: list
  near_misses: list
  rules: tuple


def _eqn_label(e) -> str:
  name = e.params.get("name")
  return f"{e.primitive.name}({name})" if isinstance(name, str) else e.primitive.name


def build_plan(jaxpr, consts, weight_invars: Sequence[bool], rules, analysis: Analysis,
               path: str = "") -> Plan:
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
      flags = [om is not None and k not in carried and g.is_weight(e.invars[om])
               for k, om in enumerate(s.operand_map)]
      p = build_plan(s.jaxpr, s.consts, flags, rules, analysis,
                     f"{path}/{_eqn_label(e)}" if path else _eqn_label(e))
      if not p.empty:
        subs.setdefault(i, []).append((s, p))
  return Plan(roots, absorbed, subs)


def run_plan(jaxpr, consts, plan: Plan, *args):
  """Evaluates ``jaxpr`` with ``plan``'s rewrites under the current trace."""
  env: dict = {}

  def read(a):
    return a.val if jx.is_literal(a) else env[a]

  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for i, e in enumerate(jaxpr.eqns):
    if i in plan.absorbed:
      continue
    m = plan.roots.get(i)
    if m is not None:
      env[e.outvars[0]] = m.emit(read)
      continue
    invals = [read(a) for a in e.invars]
    params = e.params
    for s, p in plan.subs.get(i, ()):
      new = jx.retrace(functools.partial(run_plan, s.jaxpr, s.consts, p),
                       [v.aval for v in s.jaxpr.invars])
      params, extra = jx.replace_sub_jaxpr(e, s, new, params)
      invals = list(extra) + invals
    env.update(zip(e.outvars, jx.bind_eqn(e, invals, params)))
  return [read(a) for a in jaxpr.outvars]


def _split_args(args, kwargs):
  leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
  dyn_idx = [i for i, x in enumerate(leaves) if _is_array(x)]
  return leaves, tree, dyn_idx


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, jax.core.Tracer)) or hasattr(x, "__jax_array__") or (
      hasattr(x, "shape") and hasattr(x, "dtype")) or isinstance(x, (int, float, complex, bool))


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


def analyze(fn: Callable, args, kwargs, rules) -> tuple:
  closed, dyn, out_tree = trace(fn, args, kwargs)
  analysis = Analysis([], [], tuple(rules))
  # At the top level every input may be a weight: the rules also require the
  # x·u·v shape, the rank condition and single use before anything is rewritten.
  plan = build_plan(closed.jaxpr, closed.consts, [True] * len(closed.jaxpr.invars), rules,
                    analysis)
  return closed, dyn, out_tree, plan, analysis


def fuse(fn: Callable | None = None, *, rules: Sequence[Any] | None = None,
         rank_threshold: float | None = None) -> Callable:
  """Returns ``fn`` with its X·U·V chains and low-rank MLPs rewritten into lrjax primitives.

  Args:
    fn: any JAX function, or a Flax NNX module (then ``fuse(module)(*args)`` calls it).
    rules: rewrite rules (default ``rules.DEFAULT_RULES``).
    rank_threshold: fuse x·u·v only when r·(K+N) < rank_threshold·K·N (default 1.0).

  Usable as ``jax.jit(lrjax.fuse(f))``, inside ``nnx.jit`` or Linen ``apply``, and
  under ``jax.grad`` / ``jax.vmap``.
  """
  if fn is None:
    return functools.partial(fuse, rules=rules, rank_threshold=rank_threshold)
  rules = tuple(rules if rules is not None else rules_lib.DEFAULT_RULES)
  if rank_threshold is not None:
    if not rank_threshold > 0:
      raise ValueError(f"{rank_threshold=} must be > 0")
    rules = tuple(dataclasses.replace(r, rank_threshold=rank_threshold)
                  if isinstance(r, rules_lib.XUVRule) else r for r in rules)
  if not callable(fn):
    raise TypeError(f"lrjax.fuse expects a callable or an NNX module; got {type(fn).__name__}")
  target = _module_call(fn)

  @functools.wraps(fn if not _is_module(fn) else type(fn).__call__)
  def fused(*args, **kwargs):
    a, k = ((fn,) + args, kwargs) if target is not fn else (args, kwargs)
    closed, dyn, out_tree, plan, analysis = analyze(target, a, k, rules)
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
