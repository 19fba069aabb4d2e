"""Rewrite rules of the fusion pass: find X·U·V chains and low-rank MLPs in a jaxpr.

Each rule is a frozen dataclass. Rules see one jaxpr level at a time through a
:class:`Graph` and return matches (what to rewrite) and near-misses (what looked
like a match but was refused, and why). The pass (``lowering/fuse.py``) descends
into nested jaxprs and applies the matches.

Chains. Every ``dot_general`` whose operand comes from another ``dot_general`` through
elementwise and layout ops, over an intermediate smaller than both the first product's
contraction and the second product's output (a rank-sized bottleneck), is a candidate. Each
candidate either becomes a match or a near-miss that says why: nothing is dropped silently.
A match is one of

* ``lr_xuv``: x [..., K] · u [K, r] (⊙ scale) · v [r, N] (+ bias), in any operand order and
  with x's contraction dim anywhere (the user's layout is restored with transposes);
* ``lr_xuv_batched``: a batch (head/expert) dim on both factors, x [..., H, K] · U [H, K, r]
  · V [H, r, N], or x · U [K, H·r] reshaped to heads then · V [H, r, N];
* ``lr_mlp``: low-rank MLPs built from 2-D chains around an activation that is, op for op, one
  of ``primitives.ACTIVATIONS``.

Between the factors only casts, layout ops (transpose; for heads, the reshape that splits the
rank dim) and one multiplication by a rank-space scale are absorbed: a scalar, a vector [r] (Σ
of an SVD) or any array constant along the rows. The reference then performs exactly the
user's operations, so the fused program computes the same values.

What counts as a weight: a function input or constant, possibly through casts, reshapes,
transposes or slices (e.g. one layer of stacked params inside a ``scan``), never a value
computed from activations. By default every top-level input may be a weight, except that a
factor which shares its source with the chain's input (``(x @ x[:8].T) @ v``) is not;
``lrjax.fuse(f, weights=...)`` states the weights instead.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import math
from typing import Any
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from lrjax.lowering import _jaxpr as jx
from lrjax.lowering.primitives import ACTIVATIONS, FLOAT_DTYPES, lr_mlp_p, lr_xuv_p

# Ops through which a weight stays a weight (operand 0 is the weight). A gather is one only
# where it takes matrices (a layer's factors from a stack) or its indices are constants: rows
# of an embedding picked by token ids are activations (at one token they have a bias's
# [1, 1, N] shape), though every top-level input counts as a weight.
VIEW_OPS = frozenset(
  {
    "convert_element_type",
    "reshape",
    "transpose",
    "squeeze",
    "expand_dims",
    "slice",
    "dynamic_slice",
    "copy",
    "copy_p",
    "sharding_constraint",
    "device_put",
    "reduce_precision",
    "mesh_cast",
    "pvary",
    "optimization_barrier",
    "broadcast_in_dim",
  }
)
# Ops that build a weight from several weights (e.g. jnp.stack of per-layer params).
COMBINE_OPS = frozenset({"concatenate", "stack"})

ELEMENTWISE = frozenset(
  {
    "add",
    "sub",
    "mul",
    "div",
    "neg",
    "exp",
    "exp2",
    "log",
    "log1p",
    "expm1",
    "logistic",
    "tanh",
    "sin",
    "cos",
    "erf",
    "erfc",
    "erf_inv",
    "sqrt",
    "rsqrt",
    "cbrt",
    "pow",
    "integer_pow",
    "square",
    "max",
    "min",
    "abs",
    "sign",
    "select_n",
    "convert_element_type",
    "copy",
    "copy_p",
    "gt",
    "ge",
    "lt",
    "le",
    "eq",
    "ne",
    "and",
    "or",
    "not",
    "clamp",
    "stop_gradient",
    "reduce_precision",
    "sharding_constraint",
  }
)
CALL_PRIMS = frozenset(
  {
    "jit",
    "pjit",
    "closed_call",
    "custom_jvp_call",
    "custom_vjp_call",
    "remat",
    "remat2",
    "checkpoint",
  }
)
# Ops the chain finder follows from a product back to the product feeding it.
WALK_OPS = ELEMENTWISE | VIEW_OPS | COMBINE_OPS | {"pad", "rev", "cumsum", "reduce_sum"}
MAX_WALK = 12
COMMUTATIVE = frozenset({"add", "mul", "max", "min", "and", "or", "eq", "ne"})
_IDENTITY_OPS = frozenset({"copy", "copy_p"})


class Graph:
  """Def-use view of one jaxpr level: which vars are weights, and where every var comes from.

  ``anc[v]`` is the set of sources (top-level inputs and constants) ``v`` was computed from;
  ``roots[w]`` of a weight ``w`` is the set of sources it is a view of. ``invar_sources`` gives
  (roots, anc) per invar of a nested jaxpr (from the enclosing level); ``names`` maps sources
  to readable names; with ``trust_weights`` the weight flags were stated by the user.
  """

  def __init__(
    self,
    jaxpr,
    weight_invars,
    path: str,
    consts=(),
    invar_sources=None,
    names: dict | None = None,
    trust_weights: bool = False,
  ):
    self.jaxpr, self.path = jaxpr, path
    self.names = names if names is not None else {}
    self.trust_weights = trust_weights
    self.const_values = dict(zip(jaxpr.constvars, consts))
    self.eqns = jaxpr.eqns
    self.producer = {}
    for i, e in enumerate(self.eqns):
      for o in e.outvars:
        self.producer[o] = i
    self.uses = jx.last_uses(jaxpr)
    self.weights: set = set()
    self.roots: dict = {}
    self.anc: dict = {}
    for k, v in enumerate(jaxpr.invars):
      if invar_sources is None:
        src = frozenset({("in", k)})
        roots, anc = src, src
      else:
        roots, anc = invar_sources[k]
      self.anc[v] = anc
      if weight_invars[k]:
        self.weights.add(v)
        self.roots[v] = roots if roots else frozenset({("in", path, k)})
    for k, v in enumerate(jaxpr.constvars):
      src = frozenset({("const", path, k)})
      self.weights.add(v)
      self.roots[v], self.anc[v] = src, src
      self.names.setdefault(("const", path, k), "a constant")
    for e in self.eqns:
      anc = frozenset().union(*(self.anc.get(a, frozenset()) for a in e.invars if _is_var(a)))
      for o in e.outvars:
        self.anc[o] = anc
      name = e.primitive.name
      if name in VIEW_OPS or name == "gather":
        srcs = e.invars[:1]
      elif name in COMBINE_OPS:
        srcs = e.invars
      else:
        continue
      if (
        (name in VIEW_OPS and e.invars and self.is_weight(e.invars[0]))
        or (
          name == "gather"
          and self.is_weight(e.invars[0])
          and (
            len(e.params["dimension_numbers"].offset_dims) >= 2
            or jx.is_literal(e.invars[1])
            or e.invars[1] in self.const_values
          )
        )
        or (name in COMBINE_OPS and all(self.is_weight(a) for a in e.invars))
      ):
        roots = frozenset().union(*(self.roots.get(a, frozenset()) for a in srcs if _is_var(a)))
        self.weights.update(e.outvars)
        for o in e.outvars:
          self.roots[o] = roots

  def is_weight(self, a) -> bool:
    return jx.is_literal(a) or a in self.weights

  def source_name(self, src) -> str:
    return self.names.get(src, f"input {src[-1]}" if src[0] == "in" else "a constant")

  def factor_reason(self, f, x, role: str) -> str | None:
    """Why ``f`` cannot be the weight ``role`` of a chain reading ``x`` (None: it can)."""
    if jx.is_literal(f):
      return None
    if f not in self.weights:
      _, e = self.producer_eqn(f)
      how = f"computed by '{e.primitive.name}'" if e is not None else "a loop-carried value"
      return f"{role} is {how} from activations, not a weight (activation × activation product)"
    if self.trust_weights:
      return None
    shared = self.roots.get(f, frozenset()) & (
      self.anc.get(x, frozenset()) if _is_var(x) else frozenset()
    )
    if shared:
      names = ", ".join(sorted(self.source_name(s) for s in shared))
      return (
        f"{role} is derived from the chain's input (both come from {names}), so it is not a "
        "weight; if it is one, say so with lrjax.fuse(f, weights=...)"
      )
    return None

  def single_use(self, v, by: int | None = None) -> bool:
    if jx.is_literal(v):
      return False
    u = self.uses.get(v, [])
    return len(u) == 1 and u[0][0] != "out" and (by is None or u[0][0] == by)

  def producer_eqn(self, v):
    i = self.producer.get(v) if not jx.is_literal(v) else None
    return (i, self.eqns[i]) if i is not None else (None, None)

  def location(self, i: int) -> str:
    return jx.location(self.eqns[i])

  def scope(self, i: int) -> str:
    return jx.scope(self.eqns[i])


def _is_var(a) -> bool:
  return not jx.is_literal(a)


@dataclasses.dataclass
class NearMiss:
  pattern: str
  path: str
  location: str
  reason: str
  scope: str = ""  # the jax.named_scope / module name stack of the eqn


@dataclasses.dataclass
class Match:
  """A rewrite: eqns ``absorbed`` disappear; eqn ``root``'s output becomes ``emit(read)``."""

  pattern: str
  root: int
  absorbed: frozenset
  emit: Callable[[Callable], Any]
  path: str
  location: str
  primitive: Any
  avals_in: tuple
  params: dict
  shapes: str
  # lr_xuv matches that may be grouped, and lr_mlp matches: the input var, the vars
  # ``operands`` reads, and ``operands(read)``, the bound operands (fuse(group=True) groups
  # lr_xuv matches that share ``x``; an rms_norm that computes ``x`` may fold into them)
  x: Any = None
  reads: tuple = ()
  operands: Callable[[Callable], list] | None = None
  rule: str = ""  # label of the rule that made it
  scope: str = ""  # the jax.named_scope / module name stack of the root eqn


# ------------------------------------------------------------------ chain candidates


def _dot_dims(e):
  """((lhs contract, rhs contract), (lhs batch, rhs batch), (lhs free, rhs free))."""
  (lc, rc), (lb, rb) = e.params["dimension_numbers"]
  lhs, rhs = e.invars[0].aval, e.invars[1].aval
  lf = tuple(d for d in range(lhs.ndim) if d not in lc and d not in lb)
  rf = tuple(d for d in range(rhs.ndim) if d not in rc and d not in rb)
  return (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)), (lf, rf)


def _walkable(e) -> bool:
  return e.primitive.name in WALK_OPS or _is_elementwise_eqn(e)


def _walk_back(g: Graph, var):
  """(product eqn index, path eqn indices in data order) for every dot_general that feeds
  ``var`` through walkable ops on non-weight operands: breadth first, each eqn visited once
  (its shortest path), so residual streams cost one visit per op."""
  out, queue, seen = [], collections.deque([(var, ())]), set()
  while queue:
    v, path = queue.popleft()
    i, e = g.producer_eqn(v)
    if e is None or i in seen:
      continue
    seen.add(i)
    if e.primitive.name == "dot_general":
      out.append((i, path))
    elif _walkable(e) and len(path) < MAX_WALK:
      for a in e.invars:
        if _is_var(a) and not g.is_weight(a):
          queue.append((a, (i, *path)))
  return out


def _size(shape, dims) -> int:
  return math.prod(shape[d] for d in dims)


@dataclasses.dataclass(frozen=True)
class Candidate:
  """dot ``e1`` → ``path`` → operand ``side`` of dot ``e2``, through a rank-sized intermediate."""

  e1: int
  e2: int
  side: int
  path: tuple


def chain_candidates(g: Graph) -> list[Candidate]:
  """Every dot → ... → dot chain at this level whose intermediate is a bottleneck: the dims the
  second product contracts are fewer than both the first product's contraction and the
  second product's output columns."""
  out = []
  for j, e2 in enumerate(g.eqns):
    if e2.primitive.name != "dot_general":
      continue
    (c2, _, f2) = _dot_dims(e2)
    for side in (0, 1):
      c = _size(e2.invars[side].aval.shape, c2[side])
      n2 = _size(e2.invars[1 - side].aval.shape, f2[1 - side])
      for i, path in _walk_back(g, e2.invars[side]):
        e1 = g.eqns[i]
        k1 = _size(e1.invars[0].aval.shape, _dot_dims(e1)[0][0])
        if c < k1 and c < n2:
          out.append(Candidate(i, j, side, path))
  return out


# ------------------------------------------------------------------ chain analysis


@dataclasses.dataclass
class _Xuv:
  """One analysed chain (2-D ``lr_xuv`` or batched), in canonical operands."""

  form: str  # "2d" | "heads" (x [..., H, K]) | "shared" (x [..., K], U [K, H·r] split)
  x: Any
  u: Any
  v: Any
  eqns: set
  root: int
  out: Any
  inter_dtype: Any
  out_dtype: Any
  K: int
  r: int
  N: int
  H: int = 0
  x_fn: Callable | None = None  # x's value -> canonical [..., (H), K] (None: identity)
  u_fn: Callable | None = None  # user's u value -> canonical u
  v_fn: Callable | None = None
  out_fn: Callable | None = None  # canonical output -> the user's layout (None: identity)
  scale: Any = None  # the var (or literal) the user multiplied by
  scale_fn: Callable | None = None  # its value -> canonical [r] / [H, r]
  scaled_dtype: Any = None
  bias: Any = None
  bias_reshape: bool = False

  @property
  def plain(self) -> bool:
    """A 2-D chain in the canonical layout (what lr_mlp and lr_xuv_group take)."""
    return self.form == "2d" and self.x_fn is None and self.out_fn is None

  @property
  def simple_scale(self) -> bool:
    """No scale, or one applied in the intermediate dtype with no cast around it."""
    if self.scale is None:
      return True
    sd = jnp.dtype(_aval(self.scale).dtype)
    return sd == self.inter_dtype == self.scaled_dtype


def _aval(a):
  return a.aval


_WIDTH = {jnp.dtype(jnp.float32): 3, jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float16): 2}


def _narrower(a, b) -> bool | None:
  """Whether float dtype ``b`` loses precision against ``a`` (None: bf16 <-> f16, both lose)."""
  a, b = jnp.dtype(a), jnp.dtype(b)
  if a == b:
    return False
  if {a, b} == {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}:
    return None
  return _WIDTH[b] < _WIDTH[a]


ONE = ("1",)  # the label of a size-1 dim with no origin


def _reshape_labels(labels, in_shape, out_shape):
  """Labels of a reshape's output, or None. Dims are aligned left to right: equal sizes keep
  their label, size-1 dims may vanish or appear (ONE), and one dim may split in two, giving
  ("S", label, part, size). Merges, and splits of a split, are refused (None)."""
  res, i, j = [], 0, 0
  while i < len(in_shape) or j < len(out_shape):
    n = in_shape[i] if i < len(in_shape) else None
    m = out_shape[j] if j < len(out_shape) else None
    if n is not None and n == m:
      res.append(labels[i])
      i, j = i + 1, j + 1
    elif n == 1:
      i += 1
    elif m == 1:
      res.append(ONE)
      j += 1
    elif (
      n is not None and j + 1 < len(out_shape) and m * out_shape[j + 1] == n and labels[i][0] != "S"
    ):
      res += [("S", labels[i], 0, m), ("S", labels[i], 1, out_shape[j + 1])]
      i, j = i + 1, j + 2
    else:
      return None
  return res


def _relayout(y, src, dst, sizes):
  """``y`` with dims labelled ``src`` as dims labelled ``dst``: the same labels up to size-1
  dims (ONE or of size 1), in any order."""
  keep = [k for k, lab in enumerate(src) if lab in dst and lab != ONE]
  y = jnp.reshape(y, [y.shape[k] for k in keep])
  labs = [src[k] for k in keep]
  order = [labs.index(lab) for lab in dst if lab in labs]
  if order != list(range(len(order))):
    y = jnp.transpose(y, order)
  return jnp.reshape(y, [1 if lab == ONE else sizes[lab] for lab in dst])


def _canon(val, labels, target, sizes):
  """Array ``val`` whose dims carry ``labels`` (ONE for size-1 dims) as an array over the
  ``target`` labels (dims it lacks are broadcast)."""
  val = _relayout(val, list(labels), [t for t in target if t in labels] or [], sizes)
  present = [t for t in target if t in labels]
  shape = [sizes[t] if t in present else 1 for t in target]
  return jnp.broadcast_to(jnp.reshape(val, shape), [sizes[t] for t in target])


class _Refuse(Exception):
  pass


def _check_precision(e):
  prec = e.params.get("precision")
  if prec is None:
    return
  precs = prec if isinstance(prec, (tuple, list)) else (prec,)
  if any(p not in (None, jax.lax.Precision.DEFAULT) for p in precs):
    raise _Refuse(f"dot_general precision={prec}: the fused op computes at the default precision")


def analyse(g: Graph, cand: Candidate, rank_threshold: float) -> _Xuv:
  """The chain of ``cand`` in canonical operands; raises _Refuse(reason) if it cannot fuse."""
  e1, e2 = g.eqns[cand.e1], g.eqns[cand.e2]
  if not any(g.is_weight(a) for a in e1.invars):
    raise _Refuse("neither operand of the first product is a weight (activation × activation)")
  if not g.is_weight(e2.invars[1 - cand.side]):
    raise _Refuse(g.factor_reason(e2.invars[1 - cand.side], e1.invars[0], "v"))
  _check_precision(e1)
  _check_precision(e2)
  c1, b1, f1 = _dot_dims(e1)
  out1 = e1.outvars[0]
  labels = [("B", k) for k in range(len(b1[0]))]
  labels += [("L", d) for d in f1[0]] + [("R", d) for d in f1[1]]
  sizes = dict(zip(labels, out1.aval.shape))
  # -------------------------------------------------------- the path between the products
  cur = out1
  pre, post = [jnp.dtype(out1.aval.dtype)], []  # dtypes before / after the scale
  scale = scale_labels = None
  eqns = {cand.e1, cand.e2}
  for k, i in enumerate(cand.path):
    e = g.eqns[i]
    name = e.primitive.name
    if not g.single_use(cur, i):
      raise _Refuse(_used_elsewhere(k, g, cand))
    pos = [p for p, a in enumerate(e.invars) if a is cur]
    if len(pos) != 1:
      raise _Refuse(f"rank-space op '{name}' reads the intermediate twice")
    others = [a for p, a in enumerate(e.invars) if p != pos[0]]
    shape, new = cur.aval.shape, e.outvars[0]
    if name in _IDENTITY_OPS:
      pass
    elif name == "convert_element_type":
      dt = jnp.dtype(new.aval.dtype)
      if dt not in FLOAT_DTYPES:
        raise _Refuse(f"cast of the intermediate to {dt}")
      (post if scale is not None else pre).append(dt)
    elif name == "transpose":
      labels = [labels[p] for p in e.params["permutation"]]
    elif name in ("reshape", "squeeze", "expand_dims"):
      labels = _reshape_labels(labels, shape, new.aval.shape)
      if labels is None:
        raise _Refuse(f"reshape of the intermediate {shape} -> {new.aval.shape} merges dims")
      sizes.update((lab, n) for lab, n in zip(labels, new.aval.shape) if lab != ONE)
    elif name == "mul" and len(others) == 1 and g.is_weight(others[0]):
      if scale is not None:
        raise _Refuse("a second rank-space multiplication between the factors")
      if new.aval.shape != shape:
        raise _Refuse(f"rank-space 'mul' broadcasts the intermediate {shape} to {new.aval.shape}")
      scale = others[0]
      scale, scale_labels = _scale_layout(g, scale, labels)
    elif name == "mul":
      raise _Refuse("rank-space 'mul' by a value computed from activations between the factors")
    else:
      raise _Refuse(
        f"rank-space op '{_op_label(e)}' between the factors (casts and one multiplication by a "
        "rank-space scale fuse)"
      )
    eqns.add(i)
    cur = new
  if not g.single_use(cur, cand.e2):
    raise _Refuse(_used_elsewhere(len(cand.path), g, cand))
  # -------------------------------------------------------- roles: x, u, v
  c2, b2, f2 = _dot_dims(e2)
  ts, vs = cand.side, 1 - cand.side
  t_contract = [labels[d] for d in c2[ts]]
  t_batch = [labels[d] for d in b2[ts]]
  t_free = [labels[d] for d in f2[ts]]
  if len(t_contract) != 1:
    raise _Refuse(f"the second product contracts {len(t_contract)} dims of the intermediate")
  rank = t_contract[0]
  base = rank[1] if rank[0] == "S" else rank
  if base[0] not in ("L", "R"):
    raise _Refuse("the second product contracts the intermediate's batch dim")
  u_side = 0 if base[0] == "L" else 1
  x_side = 1 - u_side
  x, u, v = e1.invars[x_side], e1.invars[u_side], e2.invars[vs]
  for f, role in ((u, "u"), (v, "v")) + (
    ((scale, "the rank-space scale"),) if scale is not None else ()
  ):
    if (reason := g.factor_reason(f, x, role)) is not None:
      raise _Refuse(reason)
  for a, role in ((x, "x"), (u, "u"), (v, "v"), (cur, "the intermediate")):
    if jnp.dtype(a.aval.dtype) not in FLOAT_DTYPES:
      raise _Refuse(f"{role} dtype {a.aval.dtype} is not bf16/f16/f32")
  for a, b in ((x, u), (cur, v)):
    da, db = jnp.dtype(a.aval.dtype), jnp.dtype(b.aval.dtype)
    if jnp.promote_types(da, db) not in (da, db):  # bf16 · f16: no exact common dtype
      raise _Refuse(f"a product of {da} and {db} operands")
  u_free = f1[u_side]
  if len(u_free) != 1:
    raise _Refuse(f"u {u.aval.shape} must have one rank dim besides the contracted ones")
  u_lab = ("L" if u_side == 0 else "R", u_free[0])
  x_labs = [("L" if x_side == 0 else "R", d) for d in f1[x_side]]
  n_labs = [("N", d) for d in f2[vs]]  # v's output dims (DenseGeneral: several)
  N = _size(v.aval.shape, f2[vs])
  K = _size(x.aval.shape, c1[x_side])
  # -------------------------------------------------------- the form
  n_b1 = len(b1[0])
  if n_b1 == 0 and not t_batch and rank == u_lab:
    form, hlab = "2d", None
  elif n_b1 == 1 and t_batch == [("B", 0)] and rank == u_lab:
    form, hlab = "heads", ("B", 0)
  elif (
    n_b1 == 0
    and len(t_batch) == 1
    and rank[0] == "S"
    and t_batch[0][0] == "S"
    and rank[1] == u_lab == t_batch[0][1]
  ):
    form, hlab = "shared", t_batch[0]
  else:
    raise _Refuse(
      "the factors' batch dims do not form per-head factors x[..., H, K]·U[H, K, r]·V[H, r, N]"
    )
  r = sizes[rank]
  H = sizes[hlab] if hlab is not None else 0
  t_rows = [lab for lab in t_free if lab != ONE]
  if (
    len(set(t_rows)) != len(t_rows)
    or not set(t_rows) <= set(x_labs)
    or any(sizes[lab] != 1 for lab in set(x_labs) - set(t_rows))
  ):
    raise _Refuse("the intermediate's other dims are not x's dims (reshaped or broadcast)")
  if form == "2d" and b2[vs]:
    raise _Refuse(f"v {v.aval.shape} has a batch dim the intermediate lacks")
  if form != "2d" and len(b2[vs]) != 1:
    raise _Refuse(f"v {v.aval.shape} must be [H, r, N...] with a batch dim")
  if not r * (K + N) < rank_threshold * K * N:
    raise _Refuse(
      f"not low-rank: r·(K+N) = {r * (K + N)} >= "
      f"{rank_threshold:g}·K·N = {rank_threshold * K * N:g} (K={K}, r={r}, N={N})"
    )
  # -------------------------------------------------------- dtypes (one cast each side of Σ)
  pre = _collapse(pre)
  post = _collapse([pre[-1]] + post) if scale is not None else []
  narrow_up = len(pre) == 3 and _narrower(pre[0], pre[1]) and _narrower(pre[2], pre[1])
  if (len(pre) > 2 and not narrow_up) or len(post) > 2:
    chain = " -> ".join(str(d) for d in pre + post[1:])
    raise _Refuse(f"more than one cast between the factors ({chain})")
  inter = pre[0]
  steps = [_narrower(a, b) for a, b in zip(pre, pre[1:])]
  if None in steps:
    raise _Refuse(f"cast of the intermediate between {pre[0]} and {pre[1]}")
  if len(pre) == 2:
    inter = pre[1] if steps[0] else pre[0]  # a widening cast is done by the promotion at ·v
  elif len(pre) == 3 and steps == [True, False]:
    inter = pre[1]  # rounded, then widened exactly: the promotion at ·v (or at Σ) widens it
  scaled_dtype = None
  if scale is not None:
    if jnp.dtype(_aval(scale).dtype) != pre[-1]:  # a weak-typed literal already has it
      raise _Refuse(f"scale dtype {_aval(scale).dtype} != the intermediate's {pre[-1]}")
    scaled_dtype = post[-1]
  # -------------------------------------------------------- canonical operands
  # x [free..., (H), K...] -> [free..., (H), K]; u -> [K, r] / [H, K, r]; v -> [r, N] / [H, r, N]
  xb = (b1[x_side][0],) if form == "heads" else ()
  x_fn = _permute_merge(
    tuple(d for d in range(x.aval.ndim) if d in f1[x_side]) + xb + c1[x_side],
    x.aval.shape,
    len(c1[x_side]),
  )
  ub = (b1[u_side][0],) if form == "heads" else ()
  u_fn = _permute_merge(ub + c1[u_side] + u_free, u.aval.shape, len(c1[u_side]), last=1)
  if form == "shared":
    part = {lab[2]: lab[3] for lab in (rank, hlab)}
    u2d = u_fn

    def u_fn(a, p0=part[0], p1=part[1], h_first=hlab[2] == 0):
      a = u2d(a) if u2d is not None else a  # [K, H·r]
      a = jnp.reshape(a, (a.shape[0], p0, p1))
      return jnp.transpose(a, (1, 0, 2) if h_first else (2, 0, 1))

  vb = (b2[vs][0],) if form != "2d" else ()
  v_fn = _permute_merge(vb + c2[vs] + f2[vs], v.aval.shape, len(f2[vs]))
  # the output: canonical [x's free dims (x order)..., (H), N] -> the second product's layout
  e2_labels = ["H"] * len(b2[0]) + (t_free + n_labs if ts == 0 else n_labs + t_free)
  canon = x_labs + (["H"] if form != "2d" else []) + n_labs
  sizes["H"] = H
  sizes.update((lab, v.aval.shape[lab[1]]) for lab in n_labs)
  out_fn = None
  if e2_labels != canon or len(n_labs) != 1:
    split_n = tuple(v.aval.shape[d] for d in f2[vs])
    out_fn = functools.partial(
      _unmerge_relayout, split_n=split_n, src=canon, dst=e2_labels, sizes=dict(sizes)
    )
  # the scale over the canonical rank labels
  scale_fn = None
  if scale is not None:
    target = [rank] if form == "2d" else [hlab, rank]
    present = {lab for lab in scale_labels if lab != ONE}
    pre_split = form == "shared" and u_lab in present
    if not present <= ({u_lab} if pre_split else set(target)):
      raise _Refuse("the rank-space scale varies along the rows, not only along the rank")
    scale_fn = functools.partial(
      _scale_canonical,
      labels=tuple(scale_labels),
      target=tuple(target),
      sizes=dict(sizes),
      split=(u_lab, hlab, rank) if pre_split else None,
    )
  m = _Xuv(
    form,
    x,
    u,
    v,
    eqns,
    cand.e2,
    e2.outvars[0],
    jnp.dtype(inter),
    jnp.dtype(e2.outvars[0].aval.dtype),
    K,
    r,
    N,
    H,
    x_fn,
    u_fn,
    v_fn,
    out_fn,
    scale,
    scale_fn,
    jnp.dtype(scaled_dtype) if scaled_dtype is not None else None,
  )
  return m


def _permute_merge(perm, shape, n_merge, last=None):
  """fn(a) transposing ``a`` by ``perm`` and merging its trailing ``n_merge`` dims into one
  (or, with ``last=1``, the ``n_merge`` dims before the last one); None when that is a no-op."""
  perm = tuple(perm)
  dims = [shape[p] for p in perm]
  if last:
    lead, mid, tail = dims[: -n_merge - last], dims[-n_merge - last : -last], dims[-last:]
  else:
    lead, mid, tail = dims[:-n_merge], dims[-n_merge:], []
  new = tuple(lead) + (math.prod(mid),) + tuple(tail)
  if perm == tuple(range(len(shape))) and n_merge == 1:
    return None

  def fn(a):
    if perm != tuple(range(len(shape))):
      a = jnp.transpose(a, perm)
    return jnp.reshape(a, new)

  return fn


def _unmerge_relayout(y, *, split_n, src, dst, sizes):
  """Canonical [..., N] output, N split back into v's output dims, in the user's layout."""
  y = jnp.reshape(y, y.shape[:-1] + tuple(split_n))
  return _relayout(y, src, dst, sizes)


def _scale_canonical(val, *, labels, target, sizes, split):
  """A scale's value in its user layout -> canonical [r] or [H, r]."""
  if split is None:
    return _canon(val, list(labels), list(target), sizes)
  u_lab, hlab, rank = split  # Σ over the unsplit H·r columns: split it as the intermediate is
  flat = _canon(val, list(labels), [u_lab], sizes)
  h_first = hlab[2] == 0
  t = jnp.reshape(flat, (sizes[hlab], sizes[rank]) if h_first else (sizes[rank], sizes[hlab]))
  return t if h_first else jnp.transpose(t)


def _collapse(dts):
  out = []
  for d in dts:
    d = jnp.dtype(d)
    if not out or out[-1] != d:
      out.append(d)
  return out


def _used_elsewhere(k, g, cand) -> str:
  what = "x·u" if k == 0 else f"x·u after '{_op_label(g.eqns[cand.path[k - 1]])}'"
  return f"the intermediate {what} is used elsewhere or is an output"


def _op_label(e) -> str:
  name = e.params.get("name")
  if e.primitive.name in CALL_PRIMS and isinstance(name, str):
    return name
  return e.primitive.name


def _scale_layout(g: Graph, s, labels):
  """(the var to read, the intermediate's label of each of its dims) for a scale multiplied
  into an intermediate with ``labels``; a broadcast_in_dim of a weight is read at its source."""
  if jx.is_literal(s) or s.aval.ndim == 0:
    return s, []
  _, e = g.producer_eqn(s)
  nd = len(labels)
  if e is not None and e.primitive.name == "broadcast_in_dim" and g.is_weight(e.invars[0]):
    src = e.invars[0]
    bd = e.params["broadcast_dimensions"]
    off = nd - s.aval.ndim
    shape = getattr(src.aval, "shape", ())
    return src, [ONE if n == 1 else labels[bd[k] + off] for k, n in enumerate(shape)]
  shape = s.aval.shape
  off = nd - len(shape)
  return s, [ONE if n == 1 else labels[k + off] for k, n in enumerate(shape)]


# ------------------------------------------------------------------ X·U·V rule


@dataclasses.dataclass(frozen=True)
class XUVRule:
  """X·U·V chains (2-D -> ``lr_xuv``, per-head -> ``lr_xuv_batched``) with u, v weights and
  r·(K+N) < rank_threshold·K·N (per head)."""

  name: str = "lr_xuv"
  rank_threshold: float = 1.0
  absorb_bias: bool = True

  def candidates(self, g: Graph, near: list) -> dict:
    """Every analysed chain at this level, keyed by its output var; refusals go to ``near``."""
    found, reported = {}, set()
    for cand in chain_candidates(g):
      try:
        m = analyse(g, cand, self.rank_threshold)
      except _Refuse as r:
        key = (cand.e1, cand.e2, str(r))
        if key not in reported:
          reported.add(key)
          near.append(NearMiss(self.name, g.path, g.location(cand.e2), str(r), g.scope(cand.e2)))
        continue
      if m.out in found:
        continue
      if self.absorb_bias and m.form == "2d" and m.out_fn is None:
        self._absorb_bias(g, m)
      found[m.out] = m
    return found

  def _absorb_bias(self, g: Graph, m: _Xuv) -> None:
    uses = g.uses.get(m.out, [])
    if len(uses) != 1 or uses[0][0] == "out":
      return
    k = uses[0][0]
    e = g.eqns[k]
    if e.primitive.name != "add":
      return
    other = e.invars[1 - uses[0][1]]
    oshape, yshape = getattr(other.aval, "shape", None), m.out.aval.shape
    if jx.is_literal(other) or oshape is None or len(oshape) != len(yshape):
      return
    if oshape[-1] != m.N or any(d != 1 for d in oshape[:-1]) and oshape != yshape:
      return
    if jnp.dtype(other.aval.dtype) != m.out_dtype or e.outvars[0].aval.shape != yshape:
      return
    bi, be = g.producer_eqn(other)
    lead = len(oshape) - 1
    if (
      be is not None
      and be.primitive.name == "broadcast_in_dim"
      and be.invars[0].aval.shape == (m.N,)
      and tuple(be.params["broadcast_dimensions"]) == (lead,)
    ):
      src, extra, reshape = be.invars[0], ({bi} if g.single_use(other, k) else set()), False
    elif all(d == 1 for d in oshape[:-1]):
      src, extra, reshape = other, set(), oshape != (m.N,)
    else:
      return  # a residual or other activation, not a bias
    # e.g. a [1, 1, N] residual at one token: broadcastable, but not a bias
    if g.factor_reason(src, m.x, "bias") is not None:
      return
    m.bias, m.bias_reshape = src, reshape
    m.eqns |= {k} | extra
    m.root, m.out = k, e.outvars[0]

  @staticmethod
  def xuv_operands(m: _Xuv):
    """operands(read) -> the bound operands of the match, canonical."""

    factors = XUVRule.factor_operands(m)

    def operands(read):
      x = read(m.x)
      if m.x_fn is not None:
        x = m.x_fn(x)
      return [x] + factors(read)

    return operands

  @staticmethod
  def factor_operands(m: _Xuv):
    """operands(read) -> the match's bound operands after x: u, v, (bias), (scale)."""

    def operands(read):
      u, v = read(m.u), read(m.v)
      ops = [m.u_fn(u) if m.u_fn else u, m.v_fn(v) if m.v_fn else v]
      if m.bias is not None:
        b = read(m.bias)
        ops.append(jnp.reshape(b, (m.N,)) if m.bias_reshape else b)
      if m.scale is not None:
        ops.append(m.scale_fn(jnp.asarray(read(m.scale), _aval(m.scale).dtype)))
      return ops

    return operands

  def _params(self, m: _Xuv) -> dict:
    p = dict(inter_dtype=m.inter_dtype, out_dtype=m.out_dtype)
    if m.form == "2d":
      p = dict(has_bias=m.bias is not None, **p)
    else:
      p = dict(x_heads=m.form == "heads", **p)
    if m.scale is not None:
      p.update(has_scale=True, scaled_dtype=m.scaled_dtype)
    return p

  def emit_xuv(self, m: _Xuv):
    from lrjax.lowering.batched import lr_xuv_batched_p

    operands = self.xuv_operands(m)
    prim = lr_xuv_p if m.form == "2d" else lr_xuv_batched_p
    params = self._params(m)

    def emit(read):
      y = prim.bind(*operands(read), **params)
      return y if m.out_fn is None else m.out_fn(y)

    return emit

  def to_match(self, g: Graph, m: _Xuv) -> Match:
    from lrjax.lowering.batched import lr_xuv_batched_p

    params = self._params(m)
    xd = m.x.aval.dtype
    xs = list(m.x.aval.shape)
    if m.x_fn is not None:
      xs = list(jax.eval_shape(m.x_fn, jax.ShapeDtypeStruct(tuple(xs), m.x.aval.dtype)).shape)
    sc = m.scale is not None
    if m.form == "2d":
      avals = (
        jax.core.ShapedArray(tuple(xs), xd),
        jax.core.ShapedArray((m.K, m.r), m.u.aval.dtype),
        jax.core.ShapedArray((m.r, m.N), m.v.aval.dtype),
      )
      if m.bias is not None:
        avals += (jax.core.ShapedArray((m.N,), m.bias.aval.dtype),)
      if sc:
        avals += (jax.core.ShapedArray((m.r,), _aval(m.scale).dtype),)
      shapes = (
        f"x{xs}·u[{m.K},{m.r}]{'·s[' + str(m.r) + ']' if sc else ''}·v[{m.r},{m.N}]"
        f"{' + bias' if m.bias is not None else ''} {xd}"
      )
      prim, pattern = lr_xuv_p, self.name
    else:
      avals = (
        jax.core.ShapedArray(tuple(xs), xd),
        jax.core.ShapedArray((m.H, m.K, m.r), m.u.aval.dtype),
        jax.core.ShapedArray((m.H, m.r, m.N), m.v.aval.dtype),
      )
      if sc:
        avals += (jax.core.ShapedArray((m.H, m.r), _aval(m.scale).dtype),)
      shapes = (
        f"x{xs}·u[{m.H},{m.K},{m.r}]{'·s[' + str(m.H) + ',' + str(m.r) + ']' if sc else ''}"
        f"·v[{m.H},{m.r},{m.N}] {xd}{' (x shared by the heads)' if m.form == 'shared' else ''}"
      )
      prim, pattern = lr_xuv_batched_p, f"{self.name}(batched)"
    if m.scaled_dtype is not None and m.scaled_dtype != m.inter_dtype:
      shapes += f" scaled in {_aval(m.scale).dtype} -> {m.scaled_dtype}"
    groupable = m.plain and m.simple_scale
    reads = (m.x, m.u, m.v) + ((m.bias,) if m.bias is not None else ())
    reads += (m.scale,) if sc and _is_var(m.scale) else ()
    return Match(
      pattern,
      m.root,
      frozenset(m.eqns),
      self.emit_xuv(m),
      g.path,
      g.location(m.root),
      prim,
      avals,
      params,
      shapes,
      m.x if groupable else None,
      reads,
      self.xuv_operands(m),
      self.name,
      g.scope(m.root),
    )


# ------------------------------------------------------------------ activations


def _is_elementwise_eqn(e) -> bool:
  name = e.primitive.name
  if name in ELEMENTWISE:
    return True
  if name in CALL_PRIMS:
    subs = jx.sub_jaxprs(e)
    return bool(subs) and all(_is_elementwise_eqn(x) for s in subs[:1] for x in s.jaxpr.eqns)
  return False


def _eval_elementwise(jaxpr_eqns, env):
  """Evaluates elementwise eqns (recursing into calls) on the values in ``env``."""

  def read(a):
    return a.val if jx.is_literal(a) else env[a]

  for e in jaxpr_eqns:
    if e.primitive.name in CALL_PRIMS:
      s = jx.sub_jaxprs(e)[0]
      inner = dict(zip(s.jaxpr.constvars, s.consts))
      inner.update(zip(s.jaxpr.invars, [read(a) for a in e.invars]))
      _eval_elementwise(s.jaxpr.eqns, inner)
      outs = [inner[o] if not jx.is_literal(o) else o.val for o in s.jaxpr.outvars]
    else:
      outs = jx.bind_eqn(e, [read(a) for a in e.invars])
    env.update(zip(e.outvars, outs))


def _param_key(v):
  if isinstance(v, np.dtype):
    return str(v)
  if isinstance(v, (tuple, list)):
    return tuple(_param_key(a) for a in v)
  if isinstance(v, np.ndarray):
    return ("arr", v.dtype.str, v.shape, v.tobytes())
  return repr(v)


def _const_key(val):
  a = np.asarray(val)
  return ("const", a.dtype.str, a.shape, a.tobytes())


def _expr_keys(eqns, env: dict) -> dict:
  """Structural keys of every var the elementwise ``eqns`` define, given keys of their inputs
  in ``env``: the op, its params and its operands' keys (sorted for commutative ops), with
  calls inlined and copies dropped, so two regions have equal keys iff they perform the same
  operations on the same constants."""

  def key(a):
    if jx.is_literal(a):
      return ("lit",) + _const_key(a.val)[1:]
    return env[a]

  for e in eqns:
    name = e.primitive.name
    if name in CALL_PRIMS:
      s = jx.sub_jaxprs(e)[0]
      inner = {v: _const_key(c) for v, c in zip(s.jaxpr.constvars, s.consts)}
      inner.update(zip(s.jaxpr.invars, [key(a) for a in e.invars]))
      inner = _expr_keys(s.jaxpr.eqns, inner)
      outs = [
        ("lit",) + _const_key(o.val)[1:] if jx.is_literal(o) else inner[o] for o in s.jaxpr.outvars
      ]
    elif name in _IDENTITY_OPS:
      outs = [key(e.invars[0])]
    else:
      ops = [key(a) for a in e.invars]
      if name in COMMUTATIVE:
        ops = sorted(ops, key=repr)
      params = tuple(sorted((k, _param_key(v)) for k, v in e.params.items()))
      outs = [(name, params, tuple(ops), i) for i in range(len(e.outvars))]
    env.update(zip(e.outvars, outs))
  return env


@functools.lru_cache(maxsize=256)
def _activation_key(name: str, shape: tuple, dtype: str):
  closed = jax.make_jaxpr(ACTIVATIONS[name])(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)))
  env = {v: _const_key(c) for v, c in zip(closed.jaxpr.constvars, closed.consts)}
  env[closed.jaxpr.invars[0]] = ("in",)
  env = _expr_keys(closed.jaxpr.eqns, env)
  out = closed.jaxpr.outvars[0]
  return ("lit",) + _const_key(out.val)[1:] if jx.is_literal(out) else env[out]


_NOT_ELEMENTWISE = "no one-input activation between the projections"


def identify_activation(g: Graph, a, h):
  """(act name, region eqn indices) if ``a`` = act(h) performs exactly the operations of one
  of ``primitives.ACTIVATIONS`` in h's dtype, else (None, the reason)."""
  region, stack, touches_h = set(), [a], False
  while stack:
    var = stack.pop()
    if var is h:
      touches_h = True
      continue
    i, e = g.producer_eqn(var)
    if e is None:
      if var in g.const_values:
        continue  # a constant: part of the activation's structure
      return None, "the activation reads a runtime value besides its input"
    if i in region:
      continue
    if e.primitive.name == "dot_general":
      return None, _NOT_ELEMENTWISE  # another projection: not a one-input activation
    if not _is_elementwise_eqn(e):
      return None, f"non-elementwise op '{e.primitive.name}' between the projections"
    region.add(i)
    for inv in e.invars:
      if jx.is_literal(inv):
        continue
      if inv is h:
        touches_h = True
      else:
        stack.append(inv)
  if not region or not touches_h:
    return None, _NOT_ELEMENTWISE  # consecutive projections with nothing between them
  inside = {o for i in region for o in g.eqns[i].outvars}
  for var in inside | {h}:
    if var is a:
      continue
    for use, _ in g.uses.get(var, []):
      if use == "out" or use not in region:
        return None, "an activation intermediate is used elsewhere"
  env = {v: _const_key(c) for v, c in g.const_values.items()}
  env[h] = ("in",)
  env = _expr_keys([g.eqns[i] for i in sorted(region)], env)
  got = env[a]
  shape, dtype = tuple(h.aval.shape), str(jnp.dtype(h.aval.dtype))
  if jnp.dtype(a.aval.dtype) != jnp.dtype(h.aval.dtype) or a.aval.shape != h.aval.shape:
    return None, f"the activation changes {h.aval.str_short()} to {a.aval.str_short()}"
  for name in ACTIVATIONS:
    if _activation_key(name, shape, dtype) == got:
      return name, region
  key = (got, dtype)
  if key not in _MISMATCH:
    if len(_MISMATCH) > 256:
      _MISMATCH.clear()
    _MISMATCH[key] = _mismatch_reason(g, region, a, h)
  return None, _MISMATCH[key]


_MISMATCH: dict = {}  # structural key, dtype -> reason (the probe is the costly part)


def _probe_values(dtype) -> np.ndarray:
  """Every value of a 16-bit float dtype, or a dense log-spaced sweep of f32 (±2^e·(1+j/16)
  for every exponent, with ±0, ±inf, NaN and the extremes)."""
  dt = np.dtype(jnp.dtype(dtype))
  if dt.itemsize == 2:
    return np.arange(1 << 16, dtype=np.uint16).view(dt)
  mant = 1.0 + np.arange(16) / 16.0
  exps = np.arange(-126, 128, dtype=np.float64)
  pos = (mant[None, :] * np.exp2(exps)[:, None]).ravel()
  fi = np.finfo(np.float32)
  special = np.array([0.0, np.inf, np.nan, fi.max, fi.tiny, fi.smallest_subnormal, 1e4, 20.0])
  vals = np.concatenate([pos, -pos, special, -special])
  return vals.astype(np.float32)


def _bits_equal(a, b) -> np.ndarray:
  a, b = np.asarray(a), np.asarray(b)
  nan = np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32))
  ai = a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)
  bi = b.view(np.uint16 if b.dtype.itemsize == 2 else np.uint32)
  return nan | (ai == bi)


def _mismatch_reason(g: Graph, region, a, h) -> str:
  """Why a region is not a known activation, with the closest one by value over the probe
  (every value of a 16-bit dtype, a dense sweep of f32) and the first input where it differs."""
  try:
    best = _probe_in_fresh_thread(g, region, a, h)
  except Exception as ex:  # the structural verdict stands; the diagnosis is best effort
    return f"activation not recognised: its ops are none of {sorted(ACTIVATIONS)}'s ({ex!r:.60})"
  name, frac, where, got, want = best
  return (
    f"activation not recognised: its ops are none of {sorted(ACTIVATIONS)}'s; closest by value "
    f"is {name} (bit-equal on {100 * frac:.1f}% of the probed {h.aval.dtype} inputs; at "
    f"h={where:.6g} it gives {got:.6g}, {name} gives {want:.6g})"
  )


def _probe_in_fresh_thread(g: Graph, region, a, h):
  """Evaluates the region on the probe points in h's dtype and compares it bit by bit with
  every known activation evaluated the same way.

  Runs in a new thread: jax's trace state is thread-local, so the probe runs eagerly
  whatever transformation (jit, vmap, grad) is tracing the caller.
  """
  eqns = [g.eqns[i] for i in sorted(region)]

  n = math.prod(h.aval.shape) or 1
  if n > 1 << 20:
    raise ValueError(f"not probed: the activation's input has {n} elements")

  def probe():
    dt = jnp.dtype(h.aval.dtype)
    pts = _probe_values(dt)
    reps = -(-pts.size // n)
    vals = np.resize(pts, reps * n).reshape((reps,) + tuple(h.aval.shape))

    def region_fn(hv):
      env = dict(g.const_values)
      env[h] = hv
      _eval_elementwise(eqns, env)
      return env[a]

    flat = jnp.asarray(pts)
    try:  # elementwise ops only: evaluate on the flat probe (one compile per op, any model)
      got = np.asarray(region_fn(flat)).reshape(-1)
    except Exception:  # an op tied to h's shape: the probe in batches of that shape
      got = np.asarray(jax.vmap(region_fn)(jnp.asarray(vals))).reshape(-1)[: pts.size]
    best = None
    for name, f in ACTIVATIONS.items():
      want = np.asarray(f(flat))
      eq = _bits_equal(got, want)
      frac = float(eq.mean())
      if best is None or frac > best[1]:
        k = int(np.argmin(eq)) if not eq.all() else 0
        best = (name, frac, float(pts[k]), float(got[k]), float(want[k]))
    return best

  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return pool.submit(probe).result()


# ------------------------------------------------------------------ MLP


@dataclasses.dataclass(frozen=True)
class MLPRule:
  """Low-rank MLP -> lr_mlp.

  gated:     act(x·Ug·Vg (+bg)) ⊙ (x·Uu·Vu (+bu)) → ·Ud·Vd (+bd)
  non-gated: act(x·U1·V1 (+b1)) → ·U2·V2 (+b2)
  """

  name: str = "lr_mlp"
  gated: bool = True

  def find(self, g: Graph, xuvs: dict, taken: set, near: list) -> list:
    out = []
    for down in list(xuvs.values()):
      if down.eqns & taken or not down.plain:
        continue
      res = self._match_one(g, down, xuvs, taken)
      if res is None:
        continue
      if isinstance(res, str):
        near.append(NearMiss(self.label, g.path, g.location(down.root), res, g.scope(down.root)))
        continue
      out.append(res)
      taken |= res.absorbed
    return out

  @property
  def label(self) -> str:
    return f"{self.name}({'gated' if self.gated else 'non-gated'})"

  def _match_one(self, g, down, xuvs, taken):
    p = down.x
    if jx.is_literal(p) or not g.single_use(p):
      return None
    pi, pe = g.producer_eqn(p)
    if pe is None:
      return None
    plain = {k: m for k, m in xuvs.items() if m.plain}
    if self.gated:
      if pe.primitive.name != "mul":
        return None
      a_, b_ = pe.invars
      for a, hu in ((a_, b_), (b_, a_)):  # noqa: B007
        up = None if jx.is_literal(hu) else plain.get(hu)
        if up is not None and not (up.eqns & taken):
          break
      else:
        return None
      if self._feeds(g, up.out, a):
        return None  # act(h) * h, e.g. quick_gelu: one projection, the non-gated rule's case
      if not g.single_use(up.out, pi):
        return "the up projection's output is used elsewhere"
      if a is hu or not g.single_use(a, pi):
        return "the activation output is used elsewhere"
      # a = act(h_gate): find the gate chain feeding the activation region.
      gate = next(
        (
          m
          for m in plain.values()
          if m is not up and m is not down and not (m.eqns & taken) and self._feeds(g, m.out, a)
        ),
        None,
      )
      if gate is None:
        return "no low-rank gate projection feeds the activation"
      if gate.x is not up.x:
        return "gate and up projections read different inputs"
      act, region = identify_activation(g, a, gate.out)
      if act is None:
        return None if region == _NOT_ELEMENTWISE else region
      projs = (gate, up, down)
      extra = set(region) | {pi}
    else:
      up = next(
        (
          m
          for m in plain.values()
          if m is not down and not (m.eqns & taken) and self._feeds(g, m.out, p)
        ),
        None,
      )
      if up is None:
        return None
      act, region = identify_activation(g, p, up.out)
      if act is None:
        return None if region == _NOT_ELEMENTWISE else region
      projs = (up, down)
      extra = set(region)
    inter = {m.inter_dtype for m in projs} | {m.out_dtype for m in projs[:-1]}
    if len(inter) != 1:
      return f"mixed intermediate dtypes {sorted(str(d) for d in inter)}"
    if not all(m.simple_scale for m in projs):
      return "a projection's rank-space scale is applied in another dtype than the MLP's"
    if self.gated and gate.N != up.N:
      return f"gate width {gate.N} != up width {up.N}"
    return self._to_match(g, projs, extra, act, inter.pop())

  @staticmethod
  def _feeds(g, src, dst) -> bool:
    """True if ``src`` reaches ``dst`` through elementwise eqns only."""
    stack, seen = [dst], set()
    while stack:
      v = stack.pop()
      if v is src:
        return True
      i, e = g.producer_eqn(v)
      if e is None or i in seen or not _is_elementwise_eqn(e):
        continue
      seen.add(i)
      stack.extend(x for x in e.invars if not jx.is_literal(x))
    return False

  def _to_match(self, g, projs, extra, act, inter_dtype) -> Match:
    down = projs[-1]
    eqns = set(extra)
    for m in projs:
      eqns |= m.eqns
    mask = tuple(m.bias is not None for m in projs)
    smask = tuple(m.scale is not None for m in projs)
    params = dict(
      gated=self.gated, act=act, bias_mask=mask, inter_dtype=inter_dtype, out_dtype=down.out_dtype
    )
    if any(smask):
      params["scale_mask"] = smask
    x = projs[0].x
    avals = [x.aval]
    for m in projs:
      avals += [
        jax.core.ShapedArray((m.K, m.r), m.u.aval.dtype),
        jax.core.ShapedArray((m.r, m.N), m.v.aval.dtype),
      ]
      if m.bias is not None:
        avals.append(jax.core.ShapedArray((m.N,), m.bias.aval.dtype))
      if m.scale is not None:
        avals.append(jax.core.ShapedArray((m.r,), _aval(m.scale).dtype))
    operands = [XUVRule.factor_operands(m) for m in projs]

    def bound_operands(read):
      ops = [read(x)]
      for fn in operands:
        ops += fn(read)
      return ops

    def emit(read):
      return lr_mlp_p.bind(*bound_operands(read), **params)

    ranks = "/".join(str(m.r) for m in projs)
    shapes = (
      f"x{list(x.aval.shape)} {projs[0].K}→{projs[-2].N}→{down.N} ranks {ranks} "
      f"{act}{' scaled' if any(smask) else ''} {x.aval.dtype}"
    )
    reads = tuple(
      a for m in projs for a in (m.u, m.v, m.bias, m.scale) if a is not None and _is_var(a)
    )
    return Match(
      self.label,
      down.root,
      frozenset(eqns),
      emit,
      g.path,
      g.location(down.root),
      lr_mlp_p,
      tuple(avals),
      params,
      shapes,
      x=x,
      reads=(x,) + reads,
      operands=bound_operands,
      rule=self.label,
      scope=g.scope(down.root),
    )


# ------------------------------------------------------------------ W4A8


@dataclasses.dataclass(frozen=True)
class W4A8XUVRule:
  """w4a8_matmul(w4a8_matmul(x, U), V) (+ bias)  ->  lr_xuv_w4a8.

  The rank-r intermediate is then re-quantized inside one kernel instead of making a
  round trip through memory (see lowering/quantized.py for the operand layout). The kernel
  keeps the intermediate in f32 and can multiply it by a rank-space scale (``t * s``, s a
  weight [r], [1.., r] or a scalar, the product in f32): that is bound as its ``scale``
  operand. Chains whose first product is rounded to another dtype, or with any other op or
  cast on the intermediate, are refused.
  """

  name: str = "lr_xuv_w4a8"

  def find(self, g: Graph, taken: set) -> tuple[list, list]:
    from lrjax.lowering import quantized as q

    matches, near = [], []
    firsts: set[int] = set()  # the U of each match
    op_between: list[tuple[int, NearMiss]] = []  # (V candidate, its near-miss)
    for j, e2 in enumerate(g.eqns):
      if e2.primitive is not q.w4a8_matmul_p or j in taken:
        continue
      t = e2.invars[0]
      i, e1 = g.producer_eqn(t)
      loc, scope = g.location(j), g.scope(j)
      scaled = _w4a8_scale(g, e1, q.w4a8_matmul_p) if e1 is not None else None
      if scaled is not None and not g.single_use(t, j):
        near.append(
          NearMiss(self.name, g.path, loc, "the scaled intermediate is used elsewhere", scope)
        )
        continue
      mul_idx, scale_src = (i, scaled[1]) if scaled is not None else (None, None)
      if scaled is not None:
        t = scaled[0]
        i, e1 = g.producer_eqn(t)
        mul_use = mul_idx
      else:
        mul_use = j
      if e1 is not None and e1.primitive is not q.w4a8_matmul_p and _walkable(e1):
        for k, _ in _walk_back_w4a8(g, t, q.w4a8_matmul_p):
          if k not in taken:
            op_between.append(
              (
                j,
                NearMiss(
                  self.name,
                  g.path,
                  loc,
                  f"rank-space op '{_op_label(e1)}' between the quantized factors: "
                  "lr_xuv_w4a8 takes only one multiplication by a scale [r] or a scalar, "
                  "in f32",
                  scope,
                ),
              )
            )
            break
        continue
      if e1 is None or e1.primitive is not q.w4a8_matmul_p or i in taken:
        continue
      if e1.params["has_bias"]:
        near.append(NearMiss(self.name, g.path, loc, "the first factor has a bias", scope))
        continue
      if not g.single_use(t, mul_use):
        near.append(
          NearMiss(self.name, g.path, loc, "the intermediate x·U is used elsewhere", scope)
        )
        continue
      if e1.params["layout"] != e2.params["layout"]:
        near.append(
          NearMiss(self.name, g.path, loc, "U and V are packed in different layouts", scope)
        )
        continue
      if jnp.dtype(e1.params["out_dtype"]) != jnp.dtype(jnp.float32):
        near.append(
          NearMiss(
            self.name,
            g.path,
            loc,
            f"the first product is rounded to {jnp.dtype(e1.params['out_dtype'])}; "
            "lr_xuv_w4a8 keeps the intermediate in f32",
            scope,
          )
        )
        continue
      x = e1.invars[0]
      reason = next(
        (
          r
          for a in e1.invars[1:] + e2.invars[1:]
          if (r := g.factor_reason(a, x, "a packed factor"))
        ),
        None,
      )
      if reason is None and scale_src is not None:
        reason = g.factor_reason(scale_src, x, "a rank-space scale")
      if reason is not None:
        near.append(NearMiss(self.name, g.path, loc, reason, scope))
        continue
      has_bias = e2.params["has_bias"]
      params = q.fused_xuv_params(e1.params, e2.params, has_bias)
      ops = (e1.invars[0], *e1.invars[1:3], *e2.invars[1:])

      def emit(read, ops=ops, params=params, scale_src=scale_src):
        vals = [read(a) for a in ops]
        if scale_src is None:
          return q.lr_xuv_w4a8_p.bind(*vals, **params)
        s = jnp.asarray(read(scale_src), jnp.float32)  # as the f32 product converts it
        s = jnp.broadcast_to(jnp.reshape(s, (-1,)) if s.ndim else s, (params["r"],))
        return q.lr_xuv_w4a8_p.bind(*vals, s, **params, has_scale=True)

      k = e1.invars[0].aval.shape[-1]
      shapes = (
        f"x{list(e1.invars[0].aval.shape)} int4 U[{k},{params['r']}] "
        f"int4 V[{params['r']},{params['n']}] {params['layout']}"
      )
      if scale_src is not None:
        shapes = shapes.replace(" int4 V", f" ·s[{params['r']}] int4 V")
      firsts.add(i)
      matches.append(
        Match(
          self.name,
          j,
          frozenset({i, j} | ({mul_idx} if mul_idx is not None else set())),
          emit,
          g.path,
          loc,
          q.lr_xuv_w4a8_p,
          tuple(a.aval for a in ops),
          params,
          shapes,
          rule=self.name,
          scope=scope,
        )
      )
    # A candidate V that is the U of a match is no near miss: e.g. a SwiGLU's down projection,
    # whose x·U reads act(gate) * up, the up projection's output, not a rank-space value.
    near += [m for j, m in op_between if j not in firsts]
    return matches, near


def _w4a8_scale(g: Graph, e, prim):
  """(t, s) when ``e`` is ``t * s`` in f32 with t a w4a8_matmul's output and s a rank-space
  scale: a weight or literal of shape (), [r] or [1.., r], read through the broadcast and the
  f32 convert that ``t * s`` inserts; else None."""
  if e.primitive.name != "mul" or jnp.dtype(e.outvars[0].aval.dtype) != jnp.float32:
    return None
  for t, s in (e.invars, e.invars[::-1]):
    _, et = g.producer_eqn(t)
    if et is None or et.primitive is not prim:
      continue
    r = t.aval.shape[-1]
    while True:  # through broadcast_in_dim (keeping the rank dim last) and convert to f32
      _, es = g.producer_eqn(s)
      if es is None:
        break
      if es.primitive.name == "convert_element_type" and jnp.issubdtype(
        es.invars[0].aval.dtype, jnp.floating
      ):
        s = es.invars[0]
      elif es.primitive.name == "broadcast_in_dim":
        src = es.invars[0]
        dims = es.params["broadcast_dimensions"]
        nd = len(es.outvars[0].aval.shape)
        if src.aval.ndim and (dims[-1] != nd - 1 or src.aval.shape[-1] not in (1, r)):
          return None
        s = src
      else:
        break
    shape = () if jx.is_literal(s) else tuple(s.aval.shape)
    if not jx.is_literal(s) and not g.is_weight(s):
      return None
    if shape and (shape[-1] != r or any(n != 1 for n in shape[:-1])):
      return None
    return t, s
  return None


def _walk_back_w4a8(g: Graph, var, prim):
  out, stack, seen = [], [(var, 0)], set()
  while stack:
    v, depth = stack.pop()
    i, e = g.producer_eqn(v)
    if e is None or i in seen:
      continue
    seen.add(i)
    if e.primitive is prim:
      out.append((i, depth))
    elif _walkable(e) and depth < MAX_WALK:
      stack.extend((a, depth + 1) for a in e.invars if _is_var(a) and not g.is_weight(a))
  return out


DEFAULT_RULES = (MLPRule(gated=True), MLPRule(name="lr_mlp", gated=False), XUVRule(), W4A8XUVRule())


def rule_label(rule) -> str:
  if isinstance(rule, MLPRule):
    return rule.label
  return rule.name


def find_matches(g: Graph, rules) -> tuple[list, list]:
  """Applies ``rules`` to one jaxpr level: MLP rules first, then X·U·V on what is left."""
  near: list = []
  xuv_rules = [r for r in rules if isinstance(r, XUVRule)]
  xuv_rule = xuv_rules[0] if xuv_rules else XUVRule()
  xuvs = xuv_rule.candidates(g, near)
  matches, taken = [], set()
  for rule in rules:
    if isinstance(rule, MLPRule):
      matches += rule.find(g, xuvs, taken, near)
  in_mlp = set(taken)
  for m in xuvs.values():
    if m.eqns <= in_mlp:
      continue  # a projection of a fused MLP
    if m.eqns & taken:
      near.append(
        NearMiss(
          xuv_rule.name,
          g.path,
          g.location(m.root),
          "shares a product with another fused chain (a dot feeding two bottlenecks)",
          g.scope(m.root),
        )
      )
      continue
    if not xuv_rules:
      near.append(
        NearMiss(
          xuv_rule.name,
          g.path,
          g.location(m.root),
          "the lr_xuv rule is not enabled",
          g.scope(m.root),
        )
      )
      continue
    matches.append(xuv_rule.to_match(g, m))
    taken |= m.eqns
  for rule in rules:
    if not isinstance(rule, (XUVRule, MLPRule)):
      found, miss = rule.find(g, taken)
      matches += found
      near += miss
      for m in found:
        taken |= m.absorbed
  return matches, near
