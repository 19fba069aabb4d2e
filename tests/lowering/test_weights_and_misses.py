"""What is a weight (fuse(weights=...), provenance through nested jaxprs), every unfused
low-rank chain reported with its reason, and activations matched op for op."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lrjax
from conftest import assert_close, randn
from lrjax.lowering import rules

from test_fuse import lr_params, prims


def _reasons(fn, *args, **kw):
  return [n["reason"] for n in lrjax.explain(fn, *args, **kw).near_misses]


# ---------------------------------------------------------------- weights


def test_weights_argnums_and_predicate():
  u, v = lr_params()
  f = lambda x, u, v: x @ u @ v  # noqa: E731
  x = randn((2, 64))
  assert prims(lrjax.fuse(f, weights=(1, 2)), x, u, v).count("lr_xuv") == 1
  assert (
    prims(lrjax.fuse(f, weights=lambda path, leaf: path[0].idx > 0), x, u, v).count("lr_xuv") == 1
  )
  # u not declared: not a weight, and explain says so
  assert "lr_xuv" not in prims(lrjax.fuse(f, weights=2), x, u, v)
  assert any("activation × activation" in r for r in _reasons(f, x, u, v, weights=2))
  np.testing.assert_array_equal(lrjax.fuse(f, weights=(1, 2))(x, u, v), jax.jit(f)(x, u, v))
  with pytest.raises(TypeError, match="argnums"):
    lrjax.fuse(f, weights="u")
  with pytest.raises(ValueError, match="out of range"):
    lrjax.fuse(f, weights=(5,))(x, u, v)


def test_weights_with_keyword_args_and_modules():
  u, v = lr_params()
  f = lambda x, *, p: x @ p["u"] @ p["v"]  # noqa: E731
  x = randn((2, 64))
  pred = lambda path, leaf: isinstance(path[0], jax.tree_util.DictKey) and path[0].key == "p"  # noqa: E731
  assert prims(lambda x: lrjax.fuse(f, weights=pred)(x, p={"u": u, "v": v}), x).count("lr_xuv") == 1

  class M(nnx.Module):
    def __init__(self):
      self.u, self.v = nnx.Param(u), nnx.Param(v)

    def __call__(self, x):
      return x @ self.u[...] @ self.v[...]

  m = M()
  assert prims(lambda x: lrjax.fuse(m, weights=())(x), x).count("lr_xuv") == 1  # module state


def test_tied_factor_refused_by_default_fused_when_declared():
  """One weight used as the factor of two unrolled layers (ALBERT-style): the second layer's
  input depends on it, so by default it is refused, with the fix; weights= accepts it."""
  u, v = lr_params(64, 8, 64)

  def f(x, u, v):
    return (x @ u @ v) @ u @ v

  x = randn((2, 64))
  assert prims(lrjax.fuse(f), x, u, v).count("lr_xuv") == 1
  assert any("weights=" in r for r in _reasons(f, x, u, v))
  assert prims(lrjax.fuse(f, weights=(1, 2)), x, u, v).count("lr_xuv") == 2
  np.testing.assert_array_equal(
    jax.jit(lrjax.fuse(f, weights=(1, 2)))(x, u, v), jax.jit(f)(x, u, v)
  )


def test_input_derived_factor_refused_inside_a_nested_jit():
  """The inner jit's invars are weights by position only; provenance crosses the boundary."""
  inner = jax.jit(lambda x, u, v: (x @ u) @ v)
  f = lambda x, v: inner(x, x[:8].T, v)  # noqa: E731
  x, v = randn((16, 64)), randn((8, 96))
  assert "lr_xuv" not in prims(lrjax.fuse(f), x, v)
  assert any("derived from the chain's input" in r for r in _reasons(f, x, v))


# ---------------------------------------------------------------- every miss is reported

U, V = lr_params(64, 8, 96)
S = randn((8,))
X = randn((3, 64))
XB = X.astype(jnp.bfloat16)
MISSES = {
  "div": (lambda x: ((x @ U) / S) @ V, "op 'div'"),
  "tanh": (lambda x: jnp.tanh(x @ U) @ V, "op 'tanh'"),
  "add_activation": (lambda x: ((x @ U) + (x @ U[:, ::-1])) @ V, "op 'add'"),
  "mul_activation": (lambda x: ((x @ U) * jnp.sum(x)) @ V, "computed from activations"),
  "two_scales": (lambda x: ((x @ U) * S * S) @ V, "second rank-space multiplication"),
  "row_varying_scale": (lambda x: ((x @ U) * x[:, :8]) @ V, "derived from the chain's input"),
  "reused": (lambda x: ((t := x @ U) @ V, t), "used elsewhere"),
  "highest_precision": (
    lambda x: jnp.matmul(x @ U, V, precision=jax.lax.Precision.HIGHEST),
    "precision",
  ),
  "bf16_to_f16": (
    lambda x: (x @ U.astype(jnp.bfloat16)).astype(jnp.float16) @ V.astype(jnp.float16),
    "between bfloat16 and float16",
  ),
  "two_casts": (
    lambda x: (x @ U).astype(jnp.bfloat16).astype(jnp.float16).astype(jnp.float32) @ V,
    "cast",
  ),
  "merged_rows": (
    lambda x: (x.reshape(3, 1, 64) @ U)[:, 0].reshape(1, 24).reshape(3, 8) @ V,
    "merges",
  ),
  "not_low_rank": (lambda x: x @ W1 @ W2, "not low-rank"),
}
W1, W2 = randn((64, 48)), randn((48, 64))


@pytest.mark.parametrize("name", sorted(MISSES))
def test_every_unfused_chain_is_reported(name):
  f, want = MISSES[name]
  x = XB if name == "bf16_to_f16" else X
  reasons = _reasons(f, x)
  assert any(want in r for r in reasons), reasons
  for a, b in zip(jax.tree.leaves(jax.jit(lrjax.fuse(f))(x)), jax.tree.leaves(jax.jit(f)(x))):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_chain_candidates_only_through_a_bottleneck():
  """Dense layers and wide intermediates are no low-rank chains: nothing to report."""
  w1, w2 = randn((64, 256)), randn((256, 64))
  assert _reasons(lambda x: jax.nn.relu(x @ w1) @ w2, X) == []
  w3 = randn((256, 512))
  assert _reasons(lambda x: (x @ w1) @ w3, X) == []


# ---------------------------------------------------------------- activations, op for op


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
  "act,fn",
  [
    ("silu", jax.nn.silu),
    ("silu", lambda h: jax.nn.sigmoid(h) * h),
    ("gelu", lambda h: jax.nn.gelu(h, approximate=False)),
    ("gelu_tanh", jax.nn.gelu),
    ("relu", lambda h: jnp.maximum(h, 0.0)),
  ],
)
def test_known_activations_fuse_and_stay_bitwise_at_extremes(dtype, act, fn):
  u1, v1 = lr_params(64, 8, 96, dtype)
  u2, v2 = lr_params(96, 8, 64, dtype)
  f = lambda x: fn(x @ u1 @ v1) @ u2 @ v2  # noqa: E731
  x = randn((4, 64), dtype, scale=1e4)  # pre-activations far outside [-9, 9]
  (e,) = [e for e in jax.make_jaxpr(lrjax.fuse(f))(x).jaxpr.eqns if e.primitive.name == "lr_mlp"]
  assert e.params["act"] == act
  np.testing.assert_array_equal(
    np.asarray(jax.jit(lrjax.fuse(f))(x), np.float32), np.asarray(jax.jit(f)(x), np.float32)
  )


def test_activation_in_another_dtype_is_refused():
  """silu applied in f32 to a bf16 projection is not lr_mlp's silu in bf16."""
  bf = jnp.bfloat16
  u1, v1 = lr_params(64, 8, 96, bf)
  u2, v2 = lr_params(96, 8, 64, bf)
  f = lambda x: jax.nn.silu((x @ u1 @ v1).astype(jnp.float32)).astype(bf) @ u2 @ v2  # noqa: E731
  x = randn((4, 64), bf)
  assert "lr_mlp" not in prims(lrjax.fuse(f), x)
  assert any("not recognised" in r for r in _reasons(f, x))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_probe_covers_the_dtype(dtype):
  pts = rules._probe_values(dtype)
  a = np.asarray(pts)
  if jnp.dtype(dtype).itemsize == 2:
    assert a.size == 1 << 16 and len(np.unique(a.view(np.uint16))) == 1 << 16  # every value
  else:
    fin = a[np.isfinite(a)]
    assert np.isinf(a).sum() == 2 and np.isnan(a).any()
    assert fin.max() == np.finfo(np.float32).max and fin.min() == -np.finfo(np.float32).max
    pos = np.sort(fin[fin >= np.finfo(np.float32).tiny])  # every binade, 16 points each
    assert pos[0] == np.finfo(np.float32).tiny and np.max(pos[1:] / pos[:-1]) <= 1.07


# ---------------------------------------------------------------- W4A8 chains


def _q(k, n):
  from lrjax.quant.modules import quantize_weight

  return quantize_weight(np.asarray(randn((k, n), scale=k**-0.5)), group=32)


def _w4a8(x, qw, out_dtype=jnp.float32):
  from lrjax.lowering.quantized import w4a8_matmul

  return w4a8_matmul(
    x, qw.packed, qw.scales, n=qw.n, group=qw.group, layout=qw.layout, out_dtype=out_dtype
  )


def test_w4a8_chain_with_a_scale_fuses_exactly():
  """A rank-space Σ between the quantized factors (a weight [r] in f32 or bf16, [1, r], or a
  literal scalar) becomes lr_xuv_w4a8's scale operand: the kernel multiplies the f32
  intermediate before re-quantizing it, as the unfused second matmul quantizes the same f32
  product (results within f32 rounding of the chain's, as without a scale)."""
  from lrjax.custom_calls.cpu import lowering as cpu_lowering

  qu, qv = _q(96, 16), _q(16, 80)
  x = randn((3, 96))
  s32 = randn((16,)) + 2.0
  for s in (s32, s32.astype(jnp.bfloat16), s32[None, :], 0.5):
    f = lambda x, s=s: _w4a8(_w4a8(x, qu) * s, qv)  # noqa: E731
    names = prims(lrjax.fuse(f), x)
    assert names.count("lr_xuv_w4a8") == 1 and "w4a8_matmul" not in names, names
    if cpu_lowering.extension_available():  # the C++ kernel applies the scale
      hlo = jax.jit(lrjax.fuse(f)).lower(x).compile().as_text()
      assert "lrjax_w4a8_xuv" in hlo and "lrjax_w4a8_matmul" not in hlo
    assert_close(jax.jit(lrjax.fuse(f))(x), jax.jit(f)(x), jnp.float32)
    with lrjax.lowering.force_reference():
      assert_close(jax.jit(lrjax.fuse(f))(x), jax.jit(f)(x), jnp.float32)


def test_w4a8_chain_with_another_op_or_rounded_intermediate_is_refused_and_reported():
  """lr_xuv_w4a8 keeps the intermediate in f32 and multiplies it by at most one scale [r]:
  a first product rounded to bf16, another op, a scale that varies along the rows or one
  read from the activation stay unfused, each reported."""
  qu, qv = _q(96, 16), _q(16, 80)
  x = randn((3, 96))
  plain = lambda x: _w4a8(_w4a8(x, qu), qv)  # noqa: E731
  assert prims(lrjax.fuse(plain), x).count("lr_xuv_w4a8") == 1
  rows = randn((3, 16))
  cases = (
    (lambda x: _w4a8(jnp.tanh(_w4a8(x, qu)), qv), "op 'tanh' between the quantized factors"),
    (lambda x: _w4a8(_w4a8(x, qu, jnp.bfloat16), qv), "rounded to"),
    (lambda x: _w4a8(_w4a8(x, qu) * rows, qv), "op 'mul' between the quantized factors"),
    (lambda x: _w4a8(_w4a8(x, qu) * x[0, :16], qv), "derived from the chain's input"),
  )
  for f, why in cases:
    assert "lr_xuv_w4a8" not in prims(lrjax.fuse(f), x)
    assert any(why in r for r in _reasons(f, x)), _reasons(f, x)
    np.testing.assert_array_equal(jax.jit(lrjax.fuse(f))(x), jax.jit(f)(x))


def test_w4a8_swiglu_fuses_each_projection_and_reports_no_near_miss():
  """A quantized low-rank SwiGLU MLP: the down projection's x·U reads act(gate) * up, the up
  projection's output, so it is a U, not a V with a 'mul' before it. Its three projections
  fuse and nothing is reported; a real op between one projection's factors still is."""
  gu, gv, uu, uv, du, dv = _q(96, 16), _q(16, 64), _q(96, 16), _q(16, 64), _q(64, 8), _q(8, 96)
  x = randn((3, 96))

  def mlp(x, mid=lambda t: t):
    gate, up = _w4a8(_w4a8(x, gu), gv), _w4a8(mid(_w4a8(x, uu)), uv)
    return _w4a8(_w4a8(jax.nn.silu(gate) * up, du), dv)

  assert prims(lrjax.fuse(mlp), x).count("lr_xuv_w4a8") == 3
  assert _reasons(mlp, x) == []
  assert_close(jax.jit(lrjax.fuse(mlp))(x), jax.jit(mlp)(x), jnp.float32)
  tanh_mid = lambda x: mlp(x, jnp.tanh)  # noqa: E731
  assert prims(lrjax.fuse(tanh_mid), x).count("lr_xuv_w4a8") == 2
  assert [r for r in _reasons(tanh_mid, x) if "op 'tanh'" in r], _reasons(tanh_mid, x)
  # what `lrjax generate` / `serve` print of it (with -v, each reason)
  from lrjax.serving.engine import fusion_line, summarize_explain

  summary = summarize_explain(lrjax.explain(tanh_mid, x), "cpu")
  assert "1 near-miss(es) left unfused (lrjax -v" in fusion_line(summary)
  assert [r for r in summary["near_miss_reasons"] if r.startswith("lr_xuv_w4a8: rank-space op")]
