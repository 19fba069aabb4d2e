"""lrjax.fuse on code lrjax never saw: plain jax, Flax NNX, Flax Linen, scan, remat,
custom_jvp/custom_vjp, cond/while, grad, vmap; and the cases it must refuse."""

import flax.linen as linen
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax import lax

import lrjax
from conftest import assert_close, randn, primitive_names as prims
from lrjax.nn import LowRankLinear, LowRankMLP


def lr_params(k=64, r=8, n=96, dtype=jnp.float32):
  return randn((k, r), dtype, k**-0.5), randn((r, n), dtype, r**-0.5)


def mlp_params(d=64, f=160, r=8, dtype=jnp.float32):
  return (*lr_params(d, r, f, dtype), *lr_params(d, r, f, dtype), *lr_params(f, r, d, dtype))


def swiglu(x, p):
  return (jax.nn.silu(x @ p[0] @ p[1]) * (x @ p[2] @ p[3])) @ p[4] @ p[5]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_xuv_with_bias_plain_jax(dtype):
  u, v = lr_params(dtype=dtype)
  b = randn((96,), dtype)
  x = randn((2, 7, 64), dtype)
  f = lambda x, u, v, b: jnp.dot(jnp.dot(x, u), v) + b
  p = prims(lrjax.fuse(f), x, u, v, b)
  assert p.count("lr_xuv") == 1 and "dot_general" not in p and "add" not in p
  assert_close(jax.jit(lrjax.fuse(f))(x, u, v, b), f(x, u, v, b), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gated_mlp(dtype):
  p, x = mlp_params(dtype=dtype), randn((3, 64), dtype)
  names = prims(lrjax.fuse(swiglu), x, p)
  assert names.count("lr_mlp") == 1 and "dot_general" not in names
  assert_close(jax.jit(lrjax.fuse(swiglu))(x, p), swiglu(x, p), dtype, factor=2.0)


@pytest.mark.parametrize(
  "act,fn",
  [
    ("gelu_tanh", lambda h: jax.nn.gelu(h, approximate=True)),
    ("gelu", lambda h: jax.nn.gelu(h, approximate=False)),
    ("silu", lambda h: h * jax.nn.sigmoid(h)),  # written by hand, not jax.nn.silu
    ("relu", jax.nn.relu),
  ],
)
def test_non_gated_mlp_with_biases(act, fn):
  u1, v1 = lr_params(64, 8, 160)
  u2, v2 = lr_params(160, 8, 64)
  b1, b2 = randn((160,)), randn((64,))
  f = lambda x: fn(x @ u1 @ v1 + b1) @ u2 @ v2 + b2
  x = randn((5, 64))
  jaxpr = jax.make_jaxpr(lrjax.fuse(f))(x)
  eq = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "lr_mlp"]
  assert len(eq) == 1 and eq[0].params["act"] == act and eq[0].params["bias_mask"] == (True, True)
  assert_close(jax.jit(lrjax.fuse(f))(x), f(x), jnp.float32)


def test_nnx_model_under_nnx_jit():
  class Block(nnx.Module):
    def __init__(self, rngs):
      self.attn_out = LowRankLinear(64, 64, 8, rngs=rngs)
      self.mlp = LowRankMLP(64, 160, (8, 8, 8), rngs=rngs)

    def __call__(self, x):
      x = x + self.attn_out(x)
      return x + self.mlp(x)

  model = Block(nnx.Rngs(0))
  x = randn((2, 4, 64))
  names = prims(lambda x: lrjax.fuse(model)(x), x)
  assert names.count("lr_mlp") == 1 and names.count("lr_xuv") == 1
  y = nnx.jit(lambda m, x: lrjax.fuse(m)(x))(model, x)
  assert_close(y, model(x), jnp.float32)


def test_linen_consecutive_dense_apply():
  class Net(linen.Module):
    @linen.compact
    def __call__(self, x):
      h = linen.Dense(8, use_bias=False)(x)
      return linen.Dense(96, use_bias=False)(h)

  net = Net()
  x = randn((3, 64))
  params = net.init(jax.random.key(0), x)
  f = lambda params, x: net.apply(params, x)
  assert prims(lrjax.fuse(f), params, x).count("lr_xuv") == 1
  assert_close(jax.jit(lrjax.fuse(f))(params, x), f(params, x), jnp.float32)


def test_scan_over_stacked_layers_and_grad():
  layers = [mlp_params() for _ in range(3)]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
  f = lambda x, s: lax.scan(lambda h, p: (h + swiglu(h, p), None), x, s)[0]
  x = randn((2, 5, 64), scale=0.5)
  assert prims(lrjax.fuse(f), x, stacked).count("lr_mlp") == 1
  assert_close(jax.jit(lrjax.fuse(f))(x, stacked), f(x, stacked), jnp.float32)
  g = jax.jit(jax.grad(lambda s: lrjax.fuse(f)(x, s).sum()))(stacked)
  g_ref = jax.grad(lambda s: f(x, s).sum())(stacked)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    assert_close(a, b, jnp.float32, factor=10.0)


def test_remat_custom_jvp_and_nested_jit():
  u, v = lr_params()

  @jax.custom_jvp
  def act(h):
    return jnp.tanh(h @ u @ v)

  act.defjvp(lambda p, t: (act(p[0]), (1 - act(p[0]) ** 2) * (t[0] @ u @ v)))
  inner = jax.jit(lambda x: x @ u @ v, donate_argnums=())
  f = jax.checkpoint(lambda x: act(x) + inner(x))
  x = randn((4, 64))
  names = prims(lrjax.fuse(f), x)
  assert names.count("lr_xuv") == 2 and "remat2" in names and "custom_jvp_call" in names
  assert_close(jax.jit(lrjax.fuse(f))(x), f(x), jnp.float32)
  gx = jax.grad(lambda x: lrjax.fuse(f)(x).sum())(x)
  assert_close(gx, jax.grad(lambda x: f(x).sum())(x), jnp.float32, factor=10.0)


def test_custom_vjp_cond_and_while():
  u, v = lr_params()

  @jax.custom_vjp
  def g(x):
    return x @ u @ v

  g.defvjp(lambda x: (g(x), None), lambda _, ct: (ct @ v.T @ u.T,))

  def f(x):
    y = lax.cond(x.sum() > 0, lambda x: x @ u @ v, lambda x: -(x @ u @ v), x)
    z = lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] @ u @ v[:, :64]), (0, x))[1]
    return y + g(x) + z.sum()

  x = randn((3, 64))
  assert prims(lrjax.fuse(f), x).count("lr_xuv") == 4
  assert_close(jax.jit(lrjax.fuse(f))(x), f(x), jnp.float32)


def test_vmap_and_grad_of_fused():
  p, x = mlp_params(), randn((6, 3, 64))
  y = jax.vmap(lrjax.fuse(swiglu), in_axes=(0, None))(x, p)
  assert_close(y, jax.vmap(swiglu, in_axes=(0, None))(x, p), jnp.float32)
  gp = jax.grad(lambda p: lrjax.fuse(swiglu)(x, p).sum())(p)
  gr = jax.grad(lambda p: swiglu(x, p).sum())(p)
  for a, b in zip(gp, gr):
    assert_close(a, b, jnp.float32, factor=10.0)


def test_jit_sub_function_keeps_donation_and_name():
  u, v = lr_params()
  inner = jax.jit(lambda x, u, v: x @ u @ v, donate_argnums=(0,))
  f = lambda x: inner(x * 2.0, u, v)
  jaxpr = jax.make_jaxpr(lrjax.fuse(f))(randn((3, 64)))
  (e,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
  assert e.params["donated_invars"] == (True, False, False)
  assert [x.primitive.name for x in e.params["jaxpr"].jaxpr.eqns] == ["lr_xuv"]


def test_transposed_weight_dot_general():
  ut, v = randn((8, 64)), randn((8, 96))  # stored [r, K] and [N, r]^T-style
  f = lambda x: lax.dot_general(
    lax.dot_general(x, ut, (((1,), (1,)), ((), ()))), v, (((1,), (0,)), ((), ()))
  )
  x = randn((4, 64))
  assert prims(lrjax.fuse(f), x).count("lr_xuv") == 1
  assert_close(lrjax.fuse(f)(x), f(x), jnp.float32)


# ---------------------------------------------------------------- refusals


def test_refuses_rank_too_large():
  u, v = lr_params(64, 60, 64)  # 60·128 > 64·64
  f = lambda x: x @ u @ v
  assert "lr_xuv" not in prims(lrjax.fuse(f), randn((2, 64)))
  rep = lrjax.explain(f, randn((2, 64)))
  assert any("not low-rank" in n["reason"] for n in rep.near_misses)
  # A looser threshold accepts it.
  assert "lr_xuv" in prims(lrjax.fuse(f, rank_threshold=2.0), randn((2, 64)))


def test_refuses_reused_intermediate():
  u, v = lr_params()
  f = lambda x: ((t := x @ u) @ v, t.sum())
  assert "lr_xuv" not in prims(lrjax.fuse(f), randn((2, 64)))
  g = lambda x: (x @ u, (x @ u) @ v)  # separate products: only the chain fuses
  assert prims(lrjax.fuse(g), randn((2, 64))).count("lr_xuv") == 1
  rep = lrjax.explain(f, randn((2, 64)))
  assert any("used elsewhere" in n["reason"] for n in rep.near_misses)


def test_refuses_activation_times_activation():
  v = randn((8, 96))
  f = lambda x, y: x @ jnp.tanh(y) @ v  # the "u" is computed from an activation
  x, y = randn((2, 64)), randn((64, 8))
  assert "lr_xuv" not in prims(lrjax.fuse(f), x, y)
  assert_close(lrjax.fuse(f)(x, y), f(x, y), jnp.float32)
  rep = lrjax.explain(f, x, y)
  assert any("activation × activation" in n["reason"] for n in rep.near_misses)


def _xuv_calls(fn, *args) -> list[tuple[dict, bool]]:
  """(params, inside an lr_residual) of each lr_xuv that fuse(fn) binds at the top level."""
  out = []
  for e in jax.make_jaxpr(lrjax.fuse(fn))(*args).jaxpr.eqns:
    if e.primitive.name == "lr_xuv":
      out.append((e.params, False))
    elif e.primitive.name == "lr_residual" and e.params["inner"] == "lr_xuv":
      out.append((dict(e.params["inner_params"]), True))
  return out


def test_refuses_integer_and_residual_bias():
  u, v = lr_params()
  x = randn((2, 5, 64))
  res = randn((2, 5, 96))
  f = lambda x: x @ u @ v + res  # a residual, not a bias: the add folds as one (lr_residual)
  ((params, residual),) = _xuv_calls(f, x)
  assert params["has_bias"] is False and residual
  assert_close(lrjax.fuse(f)(x), f(x), jnp.float32)
  ui, vi = jnp.ones((64, 8), jnp.int32), jnp.ones((8, 96), jnp.int32)
  g = lambda x: x @ ui @ vi
  assert "lr_xuv" not in prims(lrjax.fuse(g), jnp.ones((2, 64), jnp.int32))


def test_one_token_residual_is_not_taken_for_a_bias():
  """At one token the residual stream [1, 1, N] has a bias's broadcast shape; it is computed
  from activations, so the add stays outside lr_xuv (the chain's own rounding is kept)."""
  u, v = lr_params()
  w = randn((64, 96))
  x = randn((1, 1, 64))
  f = lambda x: jnp.tanh(x @ w) + x @ u @ v  # noqa: E731
  ((params, residual),) = _xuv_calls(f, x)
  assert params["has_bias"] is False and residual  # a residual add (lr_residual)
  assert_close(lrjax.fuse(f)(x), f(x), jnp.float32)
  b = randn((1, 96))  # a weight of the same shape is still a bias
  g = lambda x: x @ u @ v + b  # noqa: E731
  ((params, residual),) = _xuv_calls(g, x)
  assert params["has_bias"] is True and not residual


def test_embedding_rows_at_one_token_are_not_taken_for_a_bias():
  """Layer 0's residual is the embedding row of the token: gathered from a weight by token
  ids (top-level inputs count as weights), yet an activation, not a bias. Factors taken out of
  a stack by a traced index (matrices) stay weights, so that chain still fuses."""
  u, v = lr_params()
  emb = randn((10, 96))
  toks = jnp.array([[3]], jnp.int32)
  x = randn((1, 1, 64))
  f = lambda x, toks: emb[toks] + x @ u @ v  # a gather of one row  # noqa: E731
  ((params, residual),) = _xuv_calls(f, x, toks)
  assert params["has_bias"] is False and residual
  assert_close(lrjax.fuse(f)(x, toks), f(x, toks), jnp.float32)
  us, vs = jnp.stack([u, 2 * u]), jnp.stack([v, v / 2])
  g = lambda x, i: x @ us[jnp.array([i])][0] @ vs[jnp.array([i])][0]  # gathers  # noqa: E731
  i = jnp.int32(1)
  assert "lr_xuv" in prims(lrjax.fuse(g), x, i)
  assert_close(lrjax.fuse(g)(x, i), g(x, i), jnp.float32)


def test_refuses_unrecognised_activation_but_keeps_xuv():
  p = mlp_params()
  f = lambda x: (jnp.sin(x @ p[0] @ p[1]) * (x @ p[2] @ p[3])) @ p[4] @ p[5]
  names = prims(lrjax.fuse(f), randn((2, 64)))
  # gate and up share x: one lr_xuv_group (lowering/group.py), then the down chain
  assert "lr_mlp" not in names and names.count("lr_xuv_group") == 1
  assert names.count("lr_xuv") == 1
  assert prims(lrjax.fuse(f, group=False), randn((2, 64))).count("lr_xuv") == 3
  rep = lrjax.explain(f, randn((2, 64)))
  assert any("not recognised" in n["reason"] for n in rep.near_misses)


def test_fuse_rejects_non_callable():
  with pytest.raises(TypeError, match="expects a callable"):
    lrjax.fuse(3)
  with pytest.raises(ValueError, match="rank_threshold"):
    lrjax.fuse(lambda x: x, rank_threshold=0.0)


def test_w4a8_chain_fuses_into_one_quantized_xuv():
  from lrjax.quant import quantize

  class M(nnx.Module):
    def __init__(self):
      self.proj = LowRankLinear(96, 80, 16, use_bias=True, rngs=nnx.Rngs(0))

    def __call__(self, x):
      return self.proj(x)

  q = quantize(M(), "w4a8", group=32)
  x = randn((3, 96))
  names = prims(lrjax.fuse(q), x)
  assert names.count("lr_xuv_w4a8") == 1 and "w4a8_matmul" not in names
  assert_close(jax.jit(lrjax.fuse(q))(x), jax.jit(lambda x: q(x))(x), jnp.float32, factor=10)


def test_mlp_refused_when_activation_is_also_returned():
  p = mlp_params()

  def f(x):
    a = jax.nn.silu(x @ p[0] @ p[1])
    return (a * (x @ p[2] @ p[3])) @ p[4] @ p[5], a

  x = randn((2, 64))
  names = prims(lrjax.fuse(f), x)
  assert "lr_mlp" not in names and names.count("lr_xuv_group") == 1  # gate, up
  assert names.count("lr_xuv") == 1
  for got, want in zip(jax.jit(lrjax.fuse(f))(x), f(x)):
    assert_close(got, want, jnp.float32)


def test_closed_call():
  from jax.extend.core import primitives as core_prims

  u, v = lr_params()
  inner = jax.make_jaxpr(lambda x: jnp.tanh(x @ u @ v))(randn((3, 64)))
  params = core_prims.closed_call_p.get_bind_params({"call_jaxpr": inner})
  f = lambda x: core_prims.closed_call_p.bind(x, **params)[0]
  x = randn((3, 64))
  if "closed_call" not in prims(f, x):
    pytest.skip(f"jax {jax.__version__} inlines closed_call when tracing: nothing to rewrite")
  names = prims(lrjax.fuse(f), x)
  assert "closed_call" in names and names.count("lr_xuv") == 1
  assert_close(jax.jit(lrjax.fuse(f))(x), f(x), jnp.float32)
