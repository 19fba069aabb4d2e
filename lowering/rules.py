"""Rewrite rules of the fusion pass: find X·U·V chains and low-rank MLPs in a jaxpr.

Each rule is a frozen dataclass. Rules see one jaxpr level at a time through a
:class:`Graph` and return matches (what to rewrite) and near-misses (what looked
like a match but was refused, and why). The pass (``lowering/fuse.py``) descends
into nested jaxprs and applies the matches.

What counts as a weight: a function input or constant, possibly through casts,
reshapes, transposes or slices (e.g. one layer of stacked params inside a
``scan``), never a value computed from activations.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
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


class Graph:
  """Def-use view of one jaxpr level, with which vars are weights."""

  def __init__(self, jaxpr, weight_invars, path: str, consts=()):
    self.jaxpr, self.path = jaxpr, path
    self.const_values = dict(zip(jaxpr.constvars, consts))
    self.eqns = jaxpr.eqns
    self.producer = {}
    for i, e in enumerate(self.eqns):
      for o in e.outvars:
        self.producer[o] = i
    self.uses = jx.last_uses(jaxpr)
    self.weights = set(jaxpr.constvars)
    self.weights.update(v for v, w in zip(jaxpr.invars, weight_invars) if w)
    for e in self.eqns:
      name = e.primitive.name
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
        self.weights.update(e.outvars)

  def is_weight(self, a) -> bool:
    return jx.is_literal(a) or a in self.weights

  def single_use(self, v, by: int | None = None) -> bool:
    u = self.uses.get(v, [])
    return len(u) == 1 and u[0][0] != "out" and (by is None or u[0][0] == by)

  def producer_eqn(self, v):
    i = self.producer.get(v) if not jx.is_literal(v) else None
    return (i, self.eqns[i]) if i is not None else (None, None)

  def location(self, i: int) -> str:
    return jx.location(self.eqns[i])


@dataclasses.dataclass
class NearMiss:
  pattern: str
  path: str
  location: str
  reason: str


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
  x: Any = None  # lr_xuv matches: the input var, the vars ``operands`` reads, and
  reads: tuple = ()  # ``operands(read)``, the bound operands (fuse(group=True) groups
  operands: Callable[[Callable], list] | None = None  # matches that share ``x``)


# ------------------------------------------------------------------ X·U·V


def _matmul_dims(e):
  """For dot_general(lhs [...,K], rhs 2-D) returns rhs_contract (0 or 1), else None."""
  (lc, rc), (lb, rb) = e.params["dimension_numbers"]
  lhs, rhs = e.invars[0].aval, e.invars[1].aval
  if lb or rb or rhs.ndim != 2 or lhs.ndim < 1:
    return None
  if tuple(lc) != (lhs.ndim - 1,) or len(rc) != 1:
    return None
  return rc[0]


@dataclasses.dataclass
class _Xuv:
  x: Any
  u: Any
  v: Any
  bias: Any
  bias_reshape: bool
  u_t: bool
  v_t: bool
  eqns: set
  root: int
  out: Any
  inter_dtype: Any
  out_dtype: Any
  K: int
  r: int
  N: int


def _operand(read, var, transpose):
  val = read(var)
  return jnp.transpose(val) if transpose else val


@dataclasses.dataclass(frozen=True)
class XUVRule:
  """(x·u)·v (+ bias) with u, v weights and r·(K+N) < rank_threshold·K·N  ->  lr_xuv."""

  name: str = "lr_xuv"
  rank_threshold: float = 1.0
  absorb_bias: bool = True

  def candidates(self, g: Graph, near: list) -> dict:
    """All X·U·V chains at this level, keyed by their output var."""
    found = {}
    for j, e2 in enumerate(g.eqns):
      if e2.primitive.name != "dot_general":
        continue
      rc2 = _matmul_dims(e2)
      if rc2 is None:
        continue
      t, v = e2.invars
      chain = {j}
      i, e1 = g.producer_eqn(t)
      conv = None
      if e1 is not None and e1.primitive.name == "convert_element_type":
        conv, (i, e1) = i, g.producer_eqn(e1.invars[0])
      if e1 is None or e1.primitive.name != "dot_general" or _matmul_dims(e1) is None:
        continue
      rc1 = _matmul_dims(e1)
      x, u = e1.invars
      loc = g.location(j)
      if not (g.is_weight(u) and g.is_weight(v)):
        which = "u" if not g.is_weight(u) else "v"
        near.append(
          NearMiss(
            self.name,
            g.path,
            loc,
            f"{which} is computed from activations (activation × activation product), not a weight",
          )
        )
        continue
      t1 = e1.outvars[0]
      if conv is not None:
        ok = g.single_use(t1, conv) and g.single_use(g.eqns[conv].outvars[0], j)
      else:
        ok = g.single_use(t1, j)
      if not ok:
        near.append(
          NearMiss(self.name, g.path, loc, "the intermediate x·u is used elsewhere or is an output")
        )
        continue
      xa, ua, va = x.aval, u.aval, v.aval
      if any(jnp.dtype(a.dtype) not in FLOAT_DTYPES for a in (xa, ua, va)):
        near.append(
          NearMiss(
            self.name, g.path, loc, f"dtypes {xa.dtype}/{ua.dtype}/{va.dtype} are not bf16/f16/f32"
          )
        )
        continue
      K, r = ua.shape if rc1 == 0 else ua.shape[::-1]
      r2, N = va.shape if rc2 == 0 else va.shape[::-1]
      if r2 != r:
        continue
      if not r * (K + N) < self.rank_threshold * K * N:
        near.append(
          NearMiss(
            self.name,
            g.path,
            loc,
            f"not low-rank: r·(K+N) = {r * (K + N)} >= "
            f"{self.rank_threshold:g}·K·N = {self.rank_threshold * K * N:g} "
            f"(K={K}, r={r}, N={N})",
          )
        )
        continue
      chain.add(i)
      if conv is not None:
        chain.add(conv)
      y = e2.outvars[0]
      m = _Xuv(
        x,
        u,
        v,
        None,
        False,
        rc1 == 1,
        rc2 == 1,
        chain,
        j,
        y,
        jnp.dtype(t.aval.dtype),
        jnp.dtype(y.aval.dtype),
        K,
        r,
        N,
      )
      if self.absorb_bias:
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
    if not g.is_weight(src):  # e.g. a [1, 1, N] residual at one token: broadcastable, not a bias
      return
    m.bias, m.bias_reshape = src, reshape
    m.eqns |= {k} | extra
    m.root, m.out = k, e.outvars[0]

  @staticmethod
  def xuv_operands(m: _Xuv):
    def operands(read):
      ops = [read(m.x), _operand(read, m.u, m.u_t), _operand(read, m.v, m.v_t)]
      if m.bias is not None:
        b = read(m.bias)
        ops.append(jnp.reshape(b, (m.N,)) if m.bias_reshape else b)
      return ops

    return operands

  def emit_xuv(self, m: _Xuv):
    operands = self.xuv_operands(m)

    def emit(read):
      return lr_xuv_p.bind(
        *operands(read),
        has_bias=m.bias is not None,
        inter_dtype=m.inter_dtype,
        out_dtype=m.out_dtype,
      )

    return emit

  def to_match(self, g: Graph, m: _Xuv) -> Match:
    params = dict(has_bias=m.bias is not None, inter_dtype=m.inter_dtype, out_dtype=m.out_dtype)
    avals = (
      m.x.aval,
      jax.core.ShapedArray((m.K, m.r), m.u.aval.dtype),
      jax.core.ShapedArray((m.r, m.N), m.v.aval.dtype),
    )
    if m.bias is not None:
      avals += (jax.core.ShapedArray((m.N,), m.bias.aval.dtype),)
    shapes = (
      f"x{list(m.x.aval.shape)}·u[{m.K},{m.r}]·v[{m.r},{m.N}]"
      f"{' + bias' if m.bias is not None else ''} {m.x.aval.dtype}"
    )
    reads = (m.x, m.u, m.v) + ((m.bias,) if m.bias is not None else ())
    return Match(
      self.name,
      m.root,
      frozenset(m.eqns),
      self.emit_xuv(m),
      g.path,
      g.location(m.root),
      lr_xuv_p,
      avals,
      params,
      shapes,
      m.x,
      reads,
      self.xuv_operands(m),
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
  """Evaluates elementwise eqns (recursing into calls) on whatever shape ``env`` holds."""

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


_PROBE = np.concatenate(
  [np.linspace(-8.0, 8.0, 161), np.random.default_rng(1234).normal(0.0, 2.5, 256)]
).astype(np.float32)
_ACT_TOL = {
  jnp.dtype(jnp.float32): 2e-5,
  jnp.dtype(jnp.float16): 4e-3,
  jnp.dtype(jnp.bfloat16): 3e-2,
}


def identify_activation(g: Graph, a, h):
  """Returns (act name, region eqn indices) if ``a`` = act(h) elementwise, else (None, reason)."""
  region, stack, touches_h = set(), [a], False
  while stack:
    var = stack.pop()
    if var is h:
      touches_h = True
      continue
    i, e = g.producer_eqn(var)
    if e is None:
      return None, "activation input does not come from the projection"
    if i in region:
      continue
    if not _is_elementwise_eqn(e):
      return None, f"non-elementwise op '{e.primitive.name}' between the projections"
    region.add(i)
    for inv in e.invars:
      if jx.is_literal(inv):
        continue
      if inv is h:
        touches_h = True
      elif inv.aval.ndim == 0 and g.producer.get(inv) is None:
        continue  # scalar constant
      else:
        stack.append(inv)
  if not region or not touches_h:
    return None, "no activation between the projections"
  inside = {o for i in region for o in g.eqns[i].outvars}
  for var in inside | {h}:
    if var is a:
      continue
    for use, _ in g.uses.get(var, []):
      if use == "out" or use not in region:
        return None, "an activation intermediate is used elsewhere"
  try:
    best, best_err = _probe_in_fresh_thread(g, region, a, h)
  except Exception as ex:  # a region we cannot evaluate eagerly is simply not fused
    return None, f"activation could not be probed ({type(ex).__name__})"
  tol = _ACT_TOL.get(jnp.dtype(a.aval.dtype), 3e-2)
  if best_err > tol:
    return None, f"activation not recognised (closest: {best}, max rel. error {best_err:.2g})"
  return best, region


def _probe_in_fresh_thread(g: Graph, region, a, h):
  """Evaluates the region on probe points and returns the closest known activation.

  Runs in a new thread: jax's trace state is thread-local, so the probe runs
  eagerly whatever transformation (jit, vmap, grad) is tracing the caller.
  """

  def probe():
    env = dict(g.const_values)
    env[h] = _PROBE.astype(np.dtype(h.aval.dtype))
    _eval_elementwise([g.eqns[i] for i in sorted(region)], env)
    got = np.asarray(env[a], dtype=np.float32)
    xin = jnp.asarray(env[h])
    best, best_err = None, np.inf
    for name, f in ACTIVATIONS.items():
      ref = np.asarray(f(xin), dtype=np.float32)
      err = float(np.max(np.abs(got - ref) / (1.0 + np.abs(ref))))
      if err < best_err:
        best, best_err = name, err
    return best, best_err

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
      if down.eqns & taken:
        continue
      res = self._match_one(g, down, xuvs, taken)
      if res is None:
        continue
      if isinstance(res, str):
        near.append(NearMiss(self.name, g.path, g.location(down.root), res))
        continue
      out.append(res)
      taken |= res.absorbed
    return out

  def _match_one(self, g, down, xuvs, taken):
    p = down.x
    if jx.is_literal(p) or not g.single_use(p):
      return None
    pi, pe = g.producer_eqn(p)
    if pe is None:
      return None
    if self.gated:
      if pe.primitive.name != "mul":
        return None
      a_, b_ = pe.invars
      for a, hu in ((a_, b_), (b_, a_)):  # noqa: B007
        up = xuvs.get(hu)
        if up is not None and not (up.eqns & taken):
          break
      else:
        return None
      if not g.single_use(up.out, pi):
        return "the up projection's output is used elsewhere"
      if a is hu or not g.single_use(a, pi):
        return "the activation output is used elsewhere"
      # a = act(h_gate): find the gate chain feeding the activation region.
      gate = next(
        (
          m
          for m in xuvs.values()
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
        return region
      projs = (gate, up, down)
      extra = set(region) | {pi}
    else:
      up = next(
        (
          m
          for m in xuvs.values()
          if m is not down and not (m.eqns & taken) and self._feeds(g, m.out, p)
        ),
        None,
      )
      if up is None:
        return None
      act, region = identify_activation(g, p, up.out)
      if act is None:
        return region
      projs = (up, down)
      extra = set(region)
    inter = {m.inter_dtype for m in projs} | {m.out_dtype for m in projs[:-1]}
    if len(inter) != 1:
      return f"mixed intermediate dtypes {sorted(str(d) for d in inter)}"
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
    params = dict(
      gated=self.gated, act=act, bias_mask=mask, inter_dtype=inter_dtype, out_dtype=down.out_dtype
    )
    x = projs[0].x
    avals = [x.aval]
    for m in projs:
      avals += [
        jax.core.ShapedArray((m.K, m.r), m.u.aval.dtype),
        jax.core.ShapedArray((m.r, m.N), m.v.aval.dtype),
      ]
      if m.bias is not None:
        avals.append(jax.core.ShapedArray((m.N,), m.bias.aval.dtype))

    def emit(read):
      ops = [read(x)]
      for m in projs:
        ops += [_operand(read, m.u, m.u_t), _operand(read, m.v, m.v_t)]
        if m.bias is not None:
          b = read(m.bias)
          ops.append(jnp.reshape(b, (m.N,)) if m.bias_reshape else b)
      return lr_mlp_p.bind(*ops, **params)

    ranks = "/".join(str(m.r) for m in projs)
    shapes = (
      f"x{list(x.aval.shape)} {projs[0].K}→{projs[-2].N}→{down.N} ranks {ranks} "
      f"{act} {x.aval.dtype}"
    )
    pattern = f"{self.name}({'gated' if self.gated else 'non-gated'})"
    return Match(
      pattern,
      down.root,
      frozenset(eqns),
      emit,
      g.path,
      g.location(down.root),
      lr_mlp_p,
      tuple(avals),
      params,
      shapes,
    )


# ------------------------------------------------------------------ W4A8


@dataclasses.dataclass(frozen=True)
class W4A8XUVRule:
  """w4a8_matmul(w4a8_matmul(x, U), V) (+ bias)  ->  lr_xuv_w4a8.

  The rank-r intermediate is then re-quantized inside one kernel instead of making a
  round trip through memory (see lowering/quantized.py for the operand layout).
  """

  name: str = "lr_xuv_w4a8"

  def find(self, g: Graph, taken: set) -> tuple[list, list]:
    from lrjax.lowering import quantized as q

    matches, near = [], []
    for j, e2 in enumerate(g.eqns):
      if e2.primitive is not q.w4a8_matmul_p or j in taken:
        continue
      t = e2.invars[0]
      i, e1 = g.producer_eqn(t)
      if e1 is None or e1.primitive is not q.w4a8_matmul_p or i in taken:
        continue
      loc = g.location(j)
      if e1.params["has_bias"]:
        near.append(NearMiss(self.name, g.path, loc, "the first factor has a bias"))
        continue
      if not g.single_use(t, j):
        near.append(NearMiss(self.name, g.path, loc, "the intermediate x·U is used elsewhere"))
        continue
      if e1.params["layout"] != e2.params["layout"]:
        near.append(NearMiss(self.name, g.path, loc, "U and V are packed in different layouts"))
        continue
      if not all(g.is_weight(a) for a in e1.invars[1:] + e2.invars[1:]):
        near.append(NearMiss(self.name, g.path, loc, "packed factors are not weights"))
        continue
      has_bias = e2.params["has_bias"]
      params = q.fused_xuv_params(e1.params, e2.params, has_bias)
      ops = (e1.invars[0], *e1.invars[1:3], *e2.invars[1:])

      def emit(read, ops=ops, params=params):
        return q.lr_xuv_w4a8_p.bind(*[read(a) for a in ops], **params)

      k = e1.invars[0].aval.shape[-1]
      shapes = (
        f"x{list(e1.invars[0].aval.shape)} int4 U[{k},{params['r']}] "
        f"int4 V[{params['r']},{params['n']}] {params['layout']}"
      )
      matches.append(
        Match(
          self.name,
          j,
          frozenset({i, j}),
          emit,
          g.path,
          loc,
          q.lr_xuv_w4a8_p,
          tuple(a.aval for a in ops),
          params,
          shapes,
        )
      )
    return matches, near


DEFAULT_RULES = (MLPRule(gated=True), MLPRule(name="lr_mlp", gated=False), XUVRule(), W4A8XUVRule())


def rule_label(rule) -> str:
  if isinstance(rule, MLPRule):
    return f"{rule.name}({'gated' if rule.gated else 'non-gated'})"
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
  if xuv_rules:
    for m in xuvs.values():
      if not (m.eqns & taken):
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
