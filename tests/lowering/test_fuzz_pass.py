"""A hypothesis fuzz of ``lrjax.fuse`` on random small programs.

Programs come from a small grammar: chains of layers (low-rank X·U·V with random rank-space
ops between the factors: casts, scales of every kind, nonlinearities, reuse of the
intermediate; biases; residual adds; transposed and einsum layouts), low-rank MLPs with exact,
clipped and rescaled activations, per-head factors, dense layers, high-rank chains and factors
taken from the activation itself, in f32 or bf16, optionally under ``jax.vmap``.

Properties, per program:
* the fused function's outputs equal the unfused function's: bitwise where the primitives'
  reference performs the user's operations (2-D chains, MLPs), within the per-dtype tolerance
  table where it computes them in another layout (per-head factors, einsum operand orders);
* every dot → … → dot chain the program contains is fused, or reported as a near-miss at its
  own scope (each chain is built under its own ``jax.named_scope``).

Deterministic (``derandomize``), 1,000 programs, evaluated eagerly (``jax.disable_jit``: no
compile per program; the primitives then run their references op by op). A few programs are
also compared under ``jax.jit``. The case and crash counts are recorded for the run summary.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lrjax
from conftest import assert_close
from lrjax.lowering import rules as rules_lib

fuse_lib = importlib.import_module("lrjax.lowering.fuse")  # the module (the package exports fuse())

N_CASES = int(os.environ.get("LRJAX_FUZZ_CASES", 1000))
JIT_EVERY = 125  # also compare under jax.jit every this many programs
FUSE_EVERY = 10  # and call lrjax.fuse itself (the same trace, analysis and rewrite) this often

RANK_OPS = (
  "cast_other",  # to the other float dtype
  "scale_scalar",  # * 0.5
  "scale_vec",  # * s [r] in the model dtype
  "scale_vec32",  # * s [r] in f32 (promotes the intermediate)
  "scale_row",  # * s[None, :] (constant along rows)
  "tanh",  # not fusable
  "div",  # not fusable
  "add_act",  # + a slice of the layer input: not fusable
  "clip",  # not fusable
)
ACTS = (
  "silu",
  "silu_hand",
  "gelu",
  "gelu_tanh",
  "relu",
  "relu_max",
  "quick_gelu",  # x·sigmoid(1.702x): not fusable
  "silu_clip",  # not fusable
  "relu_cap",  # min(relu(x), 1): not fusable
  "relu_scaled",  # 2·relu: not fusable
  "silu_f32",  # silu in f32 on a bf16 model: not fusable
)
KINDS = ("xuv", "xuv", "mlp", "heads", "dense", "high_rank", "self_factor")


@dataclasses.dataclass(frozen=True)
class Layer:
  kind: str
  r: int
  n: int
  rank_ops: tuple
  bias: bool
  reuse: bool
  storage: str  # "plain" | "transposed" | "einsum_rhs"
  act: str
  gated: bool
  residual: bool


@dataclasses.dataclass(frozen=True)
class Program:
  dtype: str
  rows: int
  lead3: bool
  vmap: bool
  layers: tuple
  seed: int


layers_st = st.builds(
  Layer,
  kind=st.sampled_from(KINDS),
  r=st.sampled_from((2, 4)),
  n=st.just(16),
  rank_ops=st.lists(st.sampled_from(RANK_OPS), max_size=2).map(tuple),
  bias=st.booleans(),
  reuse=st.integers(0, 7).map(lambda k: k == 0),
  storage=st.sampled_from(("plain", "plain", "transposed", "einsum_rhs")),
  act=st.sampled_from(ACTS),
  gated=st.booleans(),
  residual=st.booleans(),
)
programs_st = st.builds(
  Program,
  dtype=st.sampled_from(("float32", "bfloat16")),
  rows=st.just(3),
  lead3=st.booleans(),
  vmap=st.integers(0, 5).map(lambda k: k == 0),
  layers=st.lists(layers_st, min_size=1, max_size=3).map(tuple),
  seed=st.integers(0, 2**16),
)


class Builder:
  """Turns a Program into (function, args, chains, compare mode)."""

  def __init__(self, prog: Program):
    self.prog = prog
    self.dt = jnp.dtype(prog.dtype)
    self.other = jnp.dtype(jnp.float32 if self.dt == jnp.bfloat16 else jnp.bfloat16)
    self.rng = np.random.default_rng(prog.seed)
    self.params = []
    self.chains = []  # (scope, group) per dot -> ... -> dot chain in the program
    self.exact = True

  def w(self, *shape, dtype=None, scale=None):
    scale = shape[0] ** -0.5 if scale is None else scale
    a = (scale * self.rng.standard_normal(shape)).astype(np.float32)
    self.params.append(jnp.asarray(a, dtype or self.dt))
    return len(self.params) - 1

  def chain(self, group=None):
    name = f"c{len(self.chains)}"
    self.chains.append((name, group))
    return name

  def build(self):
    plans, k = [], 16
    for lay in self.prog.layers:
      plans.append(self.plan_layer(lay, k))
      k = plans[-1][1]

    def f(x, params):
      h = x
      for fn, _ in plans:
        h = fn(h, params)
      return h

    return f

  # each plan_layer returns (fn(h, params) -> h', width)
  def plan_layer(self, lay: Layer, k):
    if lay.kind == "dense":
      wi = self.w(k, lay.n)
      return (lambda h, p: jnp.tanh(h @ p[wi])), lay.n
    if lay.kind == "high_rank":
      r = 12
      u, v = self.w(k, r), self.w(r, 16)
      name = self.chain()

      def high(h, p):
        with jax.named_scope(name):
          return (h @ p[u]) @ p[v]

      return high, 16
    if lay.kind == "self_factor":  # the activation's own rows as the first factor
      if self.prog.lead3:
        return (lambda h, p: h), k
      rows = self.prog.rows
      v = self.w(rows, k)
      name = self.chain()

      def self_factor(h, p):
        with jax.named_scope(name):
          return (h @ h[:rows].T) @ p[v]

      return self_factor, k
    if lay.kind == "heads":
      hh, r = 2, lay.r
      u, v = self.w(hh, k // hh, r), self.w(hh, r, lay.n // hh)
      name = self.chain()
      self.exact = False

      def heads(h, p):
        with jax.named_scope(name):
          x4 = h.reshape(*h.shape[:-1], hh, k // hh)
          t = jnp.einsum("...hd,hdr->...hr", x4, p[u])
          y = jnp.einsum("...hr,hrn->...hn", t, p[v])
          return y.reshape(*h.shape[:-1], lay.n)

      return heads, lay.n
    if lay.kind == "mlp":
      return self.plan_mlp(lay, k)
    return self.plan_xuv(lay, k)

  def factors(self, lay, k, n):
    """(u index, v index, apply(h, p) -> (x·u, ·v fn)) in the layer's storage layout."""
    r = lay.r
    if lay.storage == "transposed":
      ut, vt = self.w(r, k, scale=k**-0.5), self.w(n, r, scale=r**-0.5)
      return (lambda h, p: h @ p[ut].T), (lambda t, p: t @ p[vt].T)
    u, v = self.w(k, r), self.w(r, n)
    if lay.storage == "einsum_rhs":
      self.exact = False
      return (
        (lambda h, p: jnp.einsum("kr,...k->...r", p[u], h)),
        (lambda t, p: jnp.einsum("rn,...r->...n", p[v], t)),
      )
    return (lambda h, p: h @ p[u]), (lambda t, p: t @ p[v])

  def rank_op(self, op, r):
    dt, other = self.dt, self.other
    if op == "cast_other":
      return lambda t, h, p: t.astype(other)
    if op == "scale_scalar":
      return lambda t, h, p: t * 0.5
    if op in ("scale_vec", "scale_vec32", "scale_row", "div"):
      s = self.w(r, dtype=jnp.float32 if op == "scale_vec32" else dt, scale=1.0)
      if op == "scale_row":
        return lambda t, h, p: t * p[s][None, :]
      if op == "div":
        return lambda t, h, p: t / (1.5 + p[s].astype(t.dtype))
      return lambda t, h, p: t * p[s]
    if op == "tanh":
      return lambda t, h, p: jnp.tanh(t)
    if op == "clip":
      return lambda t, h, p: jnp.clip(t, -1.0, 1.0)
    if op == "add_act":
      return lambda t, h, p: t + h[..., : t.shape[-1]].astype(t.dtype)
    raise ValueError(op)

  def plan_xuv(self, lay, k):
    xu, tv = self.factors(lay, k, lay.n)
    ops = [self.rank_op(op, lay.r) for op in lay.rank_ops]
    b = self.w(lay.n, scale=1.0) if lay.bias else None
    name = self.chain()
    dt = self.dt

    def xuv(h, p):
      # the residual taken before the chain, as a block's stream is (lrjax.fuse may then fold
      # the add into the op: lr_residual)
      res = h[..., : lay.n] if lay.residual and h.shape[-1] >= lay.n else None
      with jax.named_scope(name):
        t = xu(h, p)
        for op in ops:
          t = op(t, h, p)
        y = tv(t, p)
        if y.dtype != dt:
          y = y.astype(dt)
        if b is not None:
          y = y + p[b]
        if lay.reuse:  # the intermediate is also used elsewhere
          y = y + jnp.sum(t).astype(dt)
      return y if res is None else res + y

    return xuv, lay.n

  def plan_mlp(self, lay, k):
    f = 24
    group = f"m{len(self.chains)}"
    g = self.plan_xuv(dataclasses.replace(lay, n=f, rank_ops=(), reuse=False, residual=False), k)[0]
    self.chains[-1] = (self.chains[-1][0], group)
    u = None
    if lay.gated:
      u = self.plan_xuv(dataclasses.replace(lay, n=f, rank_ops=(), reuse=False, residual=False), k)[
        0
      ]
      self.chains[-1] = (self.chains[-1][0], group)
    d = self.plan_xuv(dataclasses.replace(lay, n=k, reuse=False, residual=False, bias=False), f)[0]
    self.chains[-1] = (self.chains[-1][0], group)
    act = ACT_FNS[lay.act]
    dt = self.dt

    def mlp(h, p):
      a = act(g(h, p), dt)
      if u is not None:
        a = a * u(h, p)
      return h + d(a, p)

    return mlp, k


ACT_FNS = {
  "silu": lambda h, dt: jax.nn.silu(h),
  "silu_hand": lambda h, dt: h * jax.nn.sigmoid(h),
  "gelu": lambda h, dt: jax.nn.gelu(h, approximate=False),
  "gelu_tanh": lambda h, dt: jax.nn.gelu(h, approximate=True),
  "relu": lambda h, dt: jax.nn.relu(h),
  "relu_max": lambda h, dt: jnp.maximum(h, 0.0),
  "quick_gelu": lambda h, dt: h * jax.nn.sigmoid(1.702 * h),
  "silu_clip": lambda h, dt: jax.nn.silu(jnp.clip(h, -1.0, 1.0)),
  "relu_cap": lambda h, dt: jnp.minimum(jax.nn.relu(h), 1.0),
  "relu_scaled": lambda h, dt: 2.0 * jax.nn.relu(h),
  "silu_f32": lambda h, dt: jax.nn.silu(h.astype(jnp.float32)).astype(h.dtype),
}

_COUNTS = {"cases": 0, "crashes": 0, "jit": 0}


def _in_scope(scope: str, name: str) -> bool:
  return re.search(rf"(^|[/(]){re.escape(name)}($|[/)])", scope) is not None


def _bits(a):
  return np.asarray(jnp.asarray(a, jnp.float32))


_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr"}
_CALLS.update(custom_jvp_call="call_jaxpr", custom_vjp_call="call_jaxpr")


def eval_inline(jaxpr, consts, args):
  """core.eval_jaxpr with jit-like calls inlined: every primitive runs on its own, eagerly, so
  a program traced anew costs no compile beyond the (cached) per-op ones."""
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda a: a.val if isinstance(a, jax.extend.core.Literal) else env[a]  # noqa: E731
  for e in jaxpr.eqns:
    invals = [read(a) for a in e.invars]
    key = _CALLS.get(e.primitive.name)
    sub = e.params.get(key) if key else None
    if isinstance(sub, jax.extend.core.ClosedJaxpr):
      outs = eval_inline(sub.jaxpr, sub.consts, invals)
    else:
      outs = e.primitive.bind(*invals, **e.params)
      outs = outs if e.primitive.multiple_results else [outs]
    env.update(zip(e.outvars, outs))
  return [read(a) for a in jaxpr.outvars]


def check_program(prog: Program) -> None:
  b = Builder(prog)
  f = b.build()
  shape = ((2,) if prog.lead3 else ()) + (prog.rows, 16)
  x = jnp.asarray(np.random.default_rng(prog.seed + 1).standard_normal(shape) * 2, b.dt)
  params = tuple(b.params)
  if prog.vmap:
    f = jax.vmap(f, in_axes=(0, None))
    x = jnp.stack([x, -x])
  closed, dyn, _, plan, analysis = fuse_lib.analyze(
    f, (x, params), {}, rules_lib.DEFAULT_RULES, True
  )
  # every chain: fused at its scope (an MLP covers its projections) or reported there
  for name, group in b.chains:
    fused = any(_in_scope(m.scope, name) for m in analysis.matches)
    in_mlp = group is not None and any(
      m.pattern.startswith("lr_mlp")
      and any(_in_scope(m.scope, c) for c, g in b.chains if g == group)
      for m in analysis.matches
    )
    missed = any(_in_scope(n.scope, name) for n in analysis.near_misses)
    assert fused or in_mlp or missed, (name, prog, analysis.matches, analysis.near_misses)
  fused = jax.make_jaxpr(lambda *a: fuse_lib.run_plan(closed.jaxpr, closed.consts, plan, *a))(*dyn)
  with jax.disable_jit():  # the traced program and its rewrite, evaluated op by op
    (want,) = eval_inline(closed.jaxpr, closed.consts, dyn)
    (got,) = eval_inline(fused.jaxpr, fused.consts, dyn)
    if _COUNTS["cases"] % FUSE_EVERY == 0:  # and through the public entry point
      np.testing.assert_array_equal(_bits(lrjax.fuse(f)(x, params)), _bits(got))
  if b.exact:
    np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=str(prog))
  else:
    assert_close(got, want, b.dt, factor=4.0)
  _COUNTS["cases"] += 1
  if _COUNTS["cases"] % JIT_EVERY == 0:
    _COUNTS["jit"] += 1
    assert_close(jax.jit(lrjax.fuse(f))(x, params), jax.jit(f)(x, params), b.dt, factor=4.0)


@settings(
  max_examples=N_CASES,
  derandomize=True,
  deadline=None,
  database=None,
  suppress_health_check=list(HealthCheck),
)
@given(programs_st)
def _fuzz(prog):
  try:
    check_program(prog)
  except AssertionError:
    raise
  except Exception:
    _COUNTS["crashes"] += 1
    raise


def test_fuzz_fuse(record_property):
  _COUNTS.update(cases=0, crashes=0, jit=0)
  try:
    _fuzz()
  finally:
    record_property(
      "fuzz",
      f"lrjax.fuse: {_COUNTS['cases']} programs checked ({_COUNTS['jit']} also under jit), "
      f"{_COUNTS['crashes']} crashes",
    )
  assert _COUNTS["cases"] >= N_CASES and _COUNTS["crashes"] == 0
