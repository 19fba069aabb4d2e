"""``lrjax.fuse``: the jaxpr pattern pass.

``fuse(fn)`` returns a function with ``fn``'s signature. Each call traces ``fn``
to a jaxpr, finds X·U·V chains and low-rank MLPs (``lowering/rules.py``) at every
nesting level (jit, closed_call, custom_jvp/vjp, checkpoint, scan, cond, while, and
``shard_map`` bodies on their per-device shapes), and evaluates the jaxpr with the matches
replaced by ``lr_xuv`` / ``lr_xuv_batched`` / ``lr_mlp``; 2-3 ``lr_xuv`` that read the same
input are bound as one ``lr_xuv_group``. An ``rms_norm`` (lowering/rms_norm.py) whose output
only an ``lr_xuv_group`` or ``lr_mlp`` reads is folded into it (``lr_normed``), and so is the
``add`` of a residual to the output of an ``lr_xuv`` or ``lr_mlp`` (the output's one reader, a
residual of its shape and dtype: ``lr_residual``, lowering/residual.py). Nested jaxprs
are re-traced with their rewrites and re-bound with their original params, so shardings,
donation and names of jitted sub-functions are kept.

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
from lrjax.lowering.primitives import lr_mlp_p, lr_xuv_p
from lrjax.lowering.residual import lr_residual_p
from lrjax.lowering.rms_norm import lr_normed_p, rms_norm_p

log = logging.getLogger("lrjax.lowering")


@dataclasses.dataclass
class Plan:
  """What to rewrite in one jaxpr, and in the jaxprs nested in it."""

  roots: dict  # eqn index -> Match
  absorbed: frozenset  # eqn indices that disappear
  subs: dict  # eqn index -> [(SubJaxpr, Plan)]
  # first root -> ((Match, ...), weight-view eqns to evaluate before the group)
  groups: dict = dataclasses.field(default_factory=dict)
  grouped: frozenset = frozenset()  # the other members' roots (emitted with their group)
  normed: dict = dataclasses.field(default_factory=dict)  # root -> rms_norm eqn folded into it
  # root -> (add eqn folded into it, the residual var it adds)
  residual: dict = dataclasses.field(default_factory=dict)

  @property
  def empty(self) -> bool:
    return not self.roots and not self.subs


@dataclasses.dataclass
class Analysis:
  matches: list
  near_misses: list
  rules: tuple
  groups: list = dataclasses.field(default_factory=list)  # tuples of lr_xuv matches
  norms: list = dataclasses.field(default_factory=list)  # (rms_norm eqn, Match, its group)
  residuals: list = dataclasses.field(default_factory=list)  # (add eqn, Match, its norm eqn)


def _eqn_label(e) -> str:
  name = e.params.get("name")
  return f"{e.primitive.name}({name})" if isinstance(name, str) else e.primitive.name


def _weight_closure(g, v, produced, absorbed, first) -> set | None:
  """Eqn indices that compute the weight ``v`` from inputs, constants and values that exist
  before eqn ``first`` (views of weights, e.g. a bias reshaped after an earlier projection),
  so they can be evaluated early; None when ``v`` is not such a weight."""
  out, stack = set(), [v]
  while stack:
    a = stack.pop()
    if jx.is_literal(a) or a not in produced:
      continue
    i = produced[a]
    if i in absorbed:
      return None
    if i < first or i in out:
      continue
    if g is None or not g.is_weight(a):
      return None
    out.add(i)
    stack.extend(_eqn_inputs(g, i))
  return out


def _eqn_inputs(g, i):
  return [a for a in g.eqns[i].invars if not jx.is_literal(a)]


def xuv_groups(jaxpr, matches, absorbed, g=None) -> list:
  """lr_xuv matches that read the same input var with the same dtypes, in groups of 2-3
  (in eqn order), each placed at its first member's root: every operand of every member
  must exist by then (an input, a literal, the output of an earlier kept eqn, or a weight
  view whose eqns can be evaluated there). Returns (members, eqns to evaluate first)."""
  produced = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
  by_input: dict = {}
  for m in sorted(matches, key=lambda m: m.root):
    if m.primitive is lr_xuv_p and m.x is not None and not jx.is_literal(m.x):
      key = (m.x, m.params["inter_dtype"], m.params["out_dtype"])
      by_input.setdefault(key, []).append(m)
  groups = []
  for members in by_input.values():
    while len(members) >= 2:
      first, ready, hoist = members[0].root, [members[0]], set()
      for m in members[1:]:
        if len(ready) >= MAX_MEMBERS:
          break
        need = set()
        for v in m.reads:
          c = _weight_closure(g, v, produced, absorbed, first)
          if c is None:
            break
          need |= c
        else:
          ready.append(m)
          hoist |= need
      if len(ready) >= 2:
        groups.append((tuple(ready), tuple(sorted(hoist))))
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
  invar_sources=None,
  names: dict | None = None,
  trust_weights: bool = False,
) -> Plan:
  g = rules_lib.Graph(
    jaxpr, weight_invars, path or "<top>", consts, invar_sources, names, trust_weights
  )
  matches, near = rules_lib.find_matches(g, rules)
  analysis.matches += matches
  analysis.near_misses += near
  roots = {m.root: m for m in matches}
  absorbed = frozenset(i for m in matches for i in m.absorbed if i != m.root)
  subs = {}
  for i, e in enumerate(jaxpr.eqns):
    if i in absorbed or i in roots:
      continue
    for s in jx.sub_jaxprs(e):
      carried = jx.carried_invars(e, s)
      sub_path = f"{path}/{_eqn_label(e)}" if path else _eqn_label(e)
      flags, sources = [], []
      for k, om in enumerate(s.operand_map):
        outer = e.invars[om] if om is not None else None
        fresh = frozenset({("in", sub_path, k)})
        if outer is None:
          flags.append(False)
          sources.append((None, fresh))
          continue
        anc = g.anc.get(outer, frozenset()) if not jx.is_literal(outer) else frozenset()
        if k in carried:  # its value changes across iterations: not a weight
          flags.append(False)
          sources.append((None, anc | fresh))
        else:
          flags.append(g.is_weight(outer))
          sources.append((None if jx.is_literal(outer) else g.roots.get(outer), anc))
      p = build_plan(
        s.jaxpr,
        s.consts,
        flags,
        rules,
        analysis,
        sub_path,
        group,
        sources,
        g.names,
        trust_weights,
      )
      if not p.empty:
        subs.setdefault(i, []).append((s, p))
  groups = xuv_groups(jaxpr, matches, absorbed, g) if group else []
  analysis.groups += [members for members, _ in groups]
  normed = {}
  for members in [ms for ms, _ in groups] + [(m,) for m in matches if m.primitive is lr_mlp_p]:
    i, why = foldable_norm(g, members[0].x, members)
    if i is not None:
      normed[members[0].root] = i
      analysis.norms.append((g.eqns[i], members[0], members if len(members) > 1 else None))
    elif why is not None:
      j = g.producer_eqn(members[0].x)[0]
      analysis.near_misses.append(
        rules_lib.NearMiss("rms_norm", g.path, g.location(j), why, g.scope(j))
      )
  residual = {}
  in_group = {m.root for members, _ in groups for m in members}
  skipped = absorbed | frozenset(normed.values())
  for i, m in sorted(roots.items()):
    add = None if i in in_group else foldable_residual(g, m, skipped)
    if add is not None:
      residual[i] = add
      norm = g.eqns[normed[i]] if i in normed else None
      analysis.residuals.append((g.eqns[add[0]], m, norm))
  return Plan(
    roots,
    absorbed,
    subs,
    {members[0].root: (members, hoist) for members, hoist in groups},
    frozenset(m.root for members, _ in groups for m in members[1:]),
    normed,
    residual,
  )


def foldable_residual(g, m, skipped) -> tuple[int, Any] | None:
  """(the index of the ``add`` eqn, the residual var) where the match ``m`` (an lr_xuv or
  lr_mlp in the canonical layout) folds that add: it is the op's output's one reader, its
  other operand has the output's shape and dtype and exists before the op's root (so the
  rewritten op can read it); else None."""
  if m.primitive not in (lr_xuv_p, lr_mlp_p) or m.x is None:
    return None
  y = g.eqns[m.root].outvars[0]
  uses = g.uses.get(y, [])
  if len(uses) != 1 or uses[0][0] == "out":
    return None
  k, pos = uses[0]
  e = g.eqns[k]
  if e.primitive.name != "add":
    return None
  r = e.invars[1 - pos]
  if jx.is_literal(r) or r is y or e.outvars[0].aval.dtype != y.aval.dtype:
    return None
  if r.aval.shape != y.aval.shape or r.aval.dtype != y.aval.dtype:
    return None
  j, _ = g.producer_eqn(r)
  if j is not None and (j >= m.root or j in skipped):
    return None
  return k, r


def foldable_norm(g, x, consumers) -> tuple[int | None, str | None]:
  """(the index of the ``rms_norm`` eqn that computes ``x``, None) where it folds into the
  matches ``consumers`` (one group or one MLP): only they read x, in its input's dtype; else
  (None, why it does not fold), or (None, None) where no rms_norm computes x."""
  if x is None or jx.is_literal(x):
    return None, None
  i, e = g.producer_eqn(x)
  if e is None or e.primitive is not rms_norm_p:
    return None, None
  if e.invars[0].aval.dtype != x.aval.dtype:
    return None, (
      f"the norm casts {e.invars[0].aval.dtype} to {x.aval.dtype}; the kernels normalise in "
      "their input's dtype, so XLA keeps it"
    )
  mine = set().union(*({m.root} | set(m.absorbed) for m in consumers))
  others = [u for u, _ in g.uses.get(x, []) if u not in mine]
  if others:
    u = others[0]
    where = (
      "a function output" if u == "out" else f"'{g.eqns[u].primitive.name}' at {g.location(u)}"
    )
    return None, f"its output is also read by {where}; a norm folds only into its one reader"
  return i, None


def emit_group(jaxpr, members, read, env, norm=None) -> None:
  """Binds one lr_xuv_group for ``members`` (with the rms_norm eqn ``norm`` folded in: one
  lr_normed) and sets each member's root output."""
  if norm is not None:  # the norm's output is never computed
    read = skipping(read, norm.outvars[0])
  ops, mask, smask = [read(members[0].x)], [], []
  for m in members:
    ops += m.operands(read)[1:]
    mask.append(m.params["has_bias"])
    smask.append(m.params.get("has_scale", False))
  p = members[0].params
  params = dict(bias_mask=tuple(mask), inter_dtype=p["inter_dtype"], out_dtype=p["out_dtype"])
  if any(smask):
    params["scale_mask"] = tuple(smask)
  prim = lr_xuv_group_p
  if norm is not None:  # lr_normed around the group
    prim, ops, params = normed_call(norm, read, prim, ops, params)
  outs = prim.bind(*ops, **params)
  for m, y in zip(members, outs):
    env[jaxpr.eqns[m.root].outvars[0]] = y


def skipping(read, var):
  """``read`` that gives None for ``var`` (the output of a norm folded into its reader)."""
  return lambda a: None if a is var else read(a)


def normed_call(norm, read, prim, ops, params) -> tuple:
  """(lr_normed, operands, params): ``prim``(*ops, **params) with the rms_norm eqn ``norm``
  (whose output ops[0] stands for) folded in."""
  x, w = (read(a) for a in norm.invars)
  inner = dict(eps=norm.params["eps"], inner=prim.name, inner_params=tuple(sorted(params.items())))
  return lr_normed_p, [x, w, *ops[1:]], inner


def emit_root(jaxpr, m, read, env, norm=None, residual=None) -> None:
  """Binds the match ``m`` (with the rms_norm eqn ``norm`` folded in: lr_normed; with the
  (add eqn, residual var) ``residual`` folded in: lr_residual) and sets its output."""
  if norm is None and residual is None:
    env[jaxpr.eqns[m.root].outvars[0]] = m.emit(read)
    return
  if norm is None:
    prim, ops, params = m.primitive, m.operands(read), m.params
  else:  # an lr_mlp whose input norm folds into it
    ops = m.operands(skipping(read, norm.outvars[0]))
    prim, ops, params = normed_call(norm, read, m.primitive, ops, m.params)
  if residual is None:
    (env[jaxpr.eqns[m.root].outvars[0]],) = prim.bind(*ops, **params)
    return
  add, r = jaxpr.eqns[residual[0]], residual[1]
  env[add.outvars[0]] = lr_residual_p.bind(
    read(r), *ops, inner=prim.name, inner_params=tuple(sorted(params.items()))
  )


def run_plan(jaxpr, consts, plan: Plan, *args):
  """Evaluates ``jaxpr`` with ``plan``'s rewrites under the current trace."""
  env: dict = {}

  def read(a):
    return a.val if jx.is_literal(a) else env[a]

  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  folded = frozenset(plan.normed.values()) | {k for k, _ in plan.residual.values()}
  for i, e in enumerate(jaxpr.eqns):
    if i in plan.absorbed or i in plan.grouped or i in folded:
      continue
    norm = jaxpr.eqns[plan.normed[i]] if i in plan.normed else None
    if i in plan.groups:
      members, hoist = plan.groups[i]
      for k in hoist:  # weight views the later members read, evaluated early
        h = jaxpr.eqns[k]
        if not all(o in env for o in h.outvars):
          env.update(zip(h.outvars, jx.bind_eqn(h, [read(a) for a in h.invars])))
      emit_group(jaxpr, members, read, env, norm)
      continue
    m = plan.roots.get(i)
    if m is not None:
      emit_root(jaxpr, m, read, env, norm, plan.residual.get(i))
      continue
    invals = [read(a) for a in e.invars]
    params = e.params
    if jx.is_shard_map(e) and i in plan.subs:
      ((s, p),) = plan.subs[i]
      body = functools.partial(run_plan, s.jaxpr, s.consts, p)
      env.update(zip(e.outvars, jx.rebind_shard_map(e, body, invals)))
      continue
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


WeightsSpec = int | Sequence[int] | Callable[[tuple, Any], bool] | None


def _check_weights(weights: WeightsSpec) -> None:
  if weights is None or callable(weights):
    return
  nums = (weights,) if isinstance(weights, int) else weights
  if not isinstance(nums, (tuple, list)) or not all(
    isinstance(n, int) and not isinstance(n, bool) for n in nums
  ):
    raise TypeError(
      f"weights={weights!r}: expected argnums (an int or a tuple of ints) or a predicate "
      "weights(path, leaf) -> bool over the arguments' pytree leaves"
    )


def leaf_flags(args, kwargs, weights: WeightsSpec, module: bool) -> tuple[list, list]:
  """(is-a-weight flag, readable name) per array leaf of ``(args, kwargs)``, in the order
  :func:`trace` passes them. ``weights=None`` flags every leaf (the default heuristics then
  decide); argnums flag the leaves of those positional args; a predicate is asked for each
  leaf with its key path (starting at the positional index or the keyword's name). With
  ``module``, args[0] is an NNX module whose state always counts as weights."""
  _check_weights(weights)
  with_path, _ = jax.tree_util.tree_flatten_with_path((args, kwargs))
  nums = None
  if weights is not None and not callable(weights):
    nums = {weights} if isinstance(weights, int) else set(weights)
    n_pos = len(args) - int(module)
    bad = [n for n in nums if not -n_pos <= n < n_pos]
    if bad:
      raise ValueError(f"weights argnums {sorted(bad)} out of range for {n_pos} positional args")
    nums = {n % n_pos for n in nums}
  flags, names = [], []
  for path, leaf in with_path:
    if not _is_array(leaf):
      continue
    where, rest = path[0].idx, path[1:]  # 0: positional args, 1: keyword args
    if where == 0:
      pos = rest[0].idx - int(module)
      inner = rest[1:]
      is_module = module and pos < 0
      name = "the module's state" if is_module else f"argument {pos}{jax.tree_util.keystr(inner)}"
      user_path = (jax.tree_util.SequenceKey(pos),) + tuple(inner)
    else:
      is_module = False
      name = f"keyword argument {jax.tree_util.keystr(rest)}"
      user_path = tuple(rest)
    if weights is None or is_module:
      flag = True
    elif callable(weights):
      flag = bool(weights(user_path, leaf))
    else:
      flag = where == 0 and pos in nums
    flags.append(flag)
    names.append(name)
  return flags, names


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


def analyze(
  fn: Callable,
  args,
  kwargs,
  rules,
  group: bool = False,
  weights: WeightsSpec = None,
  module: bool = False,
) -> tuple:
  closed, dyn, out_tree = trace(fn, args, kwargs)
  analysis = Analysis([], [], tuple(rules))
  # By default every top-level input may be a weight: the rules also require the x·u·v
  # shape, the rank condition, single use and factors not derived from the chain's input.
  flags, leaf_names = leaf_flags(args, kwargs, weights, module)
  names = {("in", k): n for k, n in enumerate(leaf_names)}
  plan = build_plan(
    closed.jaxpr,
    closed.consts,
    flags,
    rules,
    analysis,
    group=group,
    names=names,
    trust_weights=weights is not None,
  )
  return closed, dyn, out_tree, plan, analysis


def fuse(
  fn: Callable | None = None,
  *,
  rules: Sequence[Any] | None = None,
  rank_threshold: float | None = None,
  group: bool = True,
  weights: WeightsSpec = None,
) -> Callable:
  """Returns ``fn`` with its X·U·V chains and low-rank MLPs rewritten into lrjax primitives.

  Args:
    fn: any JAX function, or a Flax NNX module (then ``fuse(module)(*args)`` calls it).
    rules: rewrite rules (default ``rules.DEFAULT_RULES``).
    rank_threshold: fuse x·u·v only when r·(K+N) < rank_threshold·K·N (default 1.0).
    group: bind 2-3 X·U·V chains that read the same input (e.g. q/k/v) as one
      ``lr_xuv_group`` (lowering/group.py; default on): one grouped kernel on a single CUDA
      device, the members' own lowerings elsewhere. ``False`` keeps one ``lr_xuv`` each.
    weights: which inputs are weights. ``None`` (default): any input may be, except that a
      factor derived from the chain's own input (``(x @ x[:8].T) @ v``) never is. Argnums
      (``1`` or ``(1, 2)``): only those positional args' leaves (and constants). A predicate
      ``weights(path, leaf) -> bool`` over every array leaf of the call's arguments, ``path``
      being its jax key path (positional index or keyword name first). An NNX module's own
      state always counts as weights.

  Usable as ``jax.jit(lrjax.fuse(f))``, inside ``nnx.jit`` or Linen ``apply``, and
  under ``jax.grad`` / ``jax.vmap``.
  """
  if fn is None:
    return functools.partial(
      fuse, rules=rules, rank_threshold=rank_threshold, group=group, weights=weights
    )
  _check_weights(weights)
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
    module = target is not fn
    a, k = ((fn,) + args, kwargs) if module else (args, kwargs)
    closed, dyn, out_tree, plan, analysis = analyze(target, a, k, rules, group, weights, module)
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
