"""The rank-space scale operand (lr_xuv, lr_mlp, lr_xuv_group) and lr_xuv_batched: references,
abstract eval, vmap, gradients, validation, and what explain shows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import lrjax
from conftest import assert_close, randn
from lrjax.lowering import (
  lr_mlp,
  lr_mlp_reference,
  lr_xuv,
  lr_xuv_group,
  lr_xuv_reference,
)
from lrjax.lowering.batched import lr_xuv_batched, lr_xuv_batched_reference

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _f64(a):
  return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("xshape,r,n", [((3, 33), 7, 45), ((2, 5, 64), 16, 24)])
def test_xuv_scale_matches_f64(dtype, xshape, r, n):
  k = xshape[-1]
  x, u, v = randn(xshape, dtype), randn((k, r), dtype, k**-0.5), randn((r, n), dtype, r**-0.5)
  s, b = randn((r,), dtype, 2.0), randn((n,), dtype)
  y = jax.jit(lambda *a: lr_xuv(*a[:4], scale=a[4]))(x, u, v, b, s)
  assert y.shape == xshape[:-1] + (n,) and y.dtype == dtype
  want = (_f64(x) @ _f64(u)) * _f64(s) @ _f64(v) + _f64(b)
  assert_close(y, want, dtype, factor=2.0)
  # the reference performs the user's operations: bitwise equal to them
  ref = jax.jit(lambda x: ((x @ u) * s) @ v + b)(x)
  np.testing.assert_array_equal(
    np.asarray(jax.jit(lambda x: lr_xuv_reference(x, u, v, b, scale=s))(x), np.float32),
    np.asarray(ref, np.float32),
  )


def test_xuv_scale_params_only_with_a_scale():
  x, u, v = randn((2, 16)), randn((16, 4)), randn((4, 8))
  (e,) = jax.make_jaxpr(lambda x: lr_xuv(x, u, v))(x).jaxpr.eqns
  assert set(e.params) == {"has_bias", "inter_dtype", "out_dtype"}
  (e,) = jax.make_jaxpr(lambda x: lr_xuv(x, u, v, scale=jnp.ones(4)))(x).jaxpr.eqns[-1:]
  assert e.params["has_scale"] and e.params["scaled_dtype"] == jnp.float32


def test_xuv_scale_validation():
  x, u, v = randn((2, 16)), randn((16, 4)), randn((4, 8))
  with pytest.raises(ValueError, match=r"scale.shape=\(5,\) must be \(4,\)"):
    lr_xuv(x, u, v, scale=jnp.ones(5))
  with pytest.raises(TypeError, match="scale.dtype=int32"):
    lr_xuv(x, u, v, scale=jnp.ones(4, jnp.int32))
  with pytest.raises(ValueError, match="without a scale"):
    lr_xuv(x, u, v, scaled_dtype=jnp.float32)


def test_xuv_scale_vmap_and_grads():
  x, u, v, s = randn((3, 5, 16)), randn((16, 4), scale=0.3), randn((4, 8)), randn((4,))
  f = lambda x, u, v, s: lr_xuv(x, u, v, scale=s)  # noqa: E731
  got = jax.vmap(f, in_axes=(0, None, None, None))(x, u, v, s)
  assert_close(got, jax.vmap(lambda x: lr_xuv_reference(x, u, v, scale=s))(x), jnp.float32)
  ss = randn((3, 4))  # per-example scales: vmapped reference
  got = jax.vmap(f, in_axes=(0, None, None, 0))(x, u, v, ss)
  want = jax.vmap(lambda x, s: lr_xuv_reference(x, u, v, scale=s))(x, ss)
  assert_close(got, want, jnp.float32)
  check_grads(f, (x[0], u, v, s), order=1, modes=("rev",), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("gated", [True, False])
def test_mlp_and_group_with_scales(gated):
  d, f, r = 32, 48, 6
  x = randn((2, 3, d))

  def proj(k, n, scaled):
    p = (randn((k, r), scale=k**-0.5), randn((r, n), scale=r**-0.5), None)
    return p + ((randn((r,)),) if scaled else ())

  up, down = proj(d, f, True), proj(f, d, True)
  gate = proj(d, f, False) if gated else None
  y = jax.jit(lambda x: lr_mlp(x, up, down, gate, act="silu"))(x)
  h = (_f64(x) @ _f64(up[0])) * _f64(up[3]) @ _f64(up[1])
  silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
  h = silu(_f64(x) @ _f64(gate[0]) @ _f64(gate[1])) * h if gated else silu(h)
  want = (h @ _f64(down[0])) * _f64(down[3]) @ _f64(down[1])
  assert_close(y, want, jnp.float32)
  assert_close(y, lr_mlp_reference(x, up, down, gate, act="silu"), jnp.float32)
  s0 = randn((r,))
  a, b = lr_xuv_group(x, [up[:2] + (None, s0), (up[0], up[1])])
  assert_close(a, lr_xuv_reference(x, up[0], up[1], scale=s0), jnp.float32)
  assert_close(b, lr_xuv_reference(x, up[0], up[1]), jnp.float32)


def test_fused_scale_reaches_mlp_and_group_and_explain():
  d, f, r = 32, 64, 4
  p = [randn((d, r), scale=d**-0.5), randn((r, f), scale=r**-0.5)]
  p += [randn((d, r), scale=d**-0.5), randn((r, f), scale=r**-0.5)]
  p += [randn((f, r), scale=f**-0.5), randn((r, d), scale=r**-0.5)]
  sg, sd = randn((r,)), randn((r,))

  def mlp(x):
    return (jax.nn.silu((x @ p[0] * sg) @ p[1]) * (x @ p[2] @ p[3])) @ p[4] * sd @ p[5]

  x = randn((3, d))
  (e,) = [e for e in jax.make_jaxpr(lrjax.fuse(mlp))(x).jaxpr.eqns if e.primitive.name == "lr_mlp"]
  assert e.params["scale_mask"] == (True, False, True)
  np.testing.assert_array_equal(jax.jit(lrjax.fuse(mlp))(x), jax.jit(mlp)(x))
  text = str(lrjax.explain(mlp, x))
  assert "lr_mlp(gated)" in text and "scaled" in text

  def qk(x):
    return (x @ p[0] * sg) @ p[1], x @ p[2] @ p[3]

  rep = lrjax.explain(qk, x)
  assert len(rep.groups) == 1 and "·s[4]·" in rep.groups[0]["shapes"][0]
  for a, b in zip(jax.jit(lrjax.fuse(qk))(x), jax.jit(qk)(x)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("x_heads", [True, False])
def test_batched_matches_f64(dtype, x_heads):
  h, k, r, n = 3, 16, 4, 8
  x = randn((2, 5, h, k) if x_heads else (2, 5, k), dtype)
  u, v, s = randn((h, k, r), dtype, k**-0.5), randn((h, r, n), dtype, r**-0.5), randn((h, r), dtype)
  y = jax.jit(lambda x: lr_xuv_batched(x, u, v, scale=s, x_heads=x_heads))(x)
  assert y.shape == (2, 5, h, n) and y.dtype == dtype
  xe = _f64(x) if x_heads else np.repeat(_f64(x)[..., None, :], h, axis=-2)
  want = np.einsum(
    "...hr,hrn->...hn", np.einsum("...hk,hkr->...hr", xe, _f64(u)) * _f64(s), _f64(v)
  )
  assert_close(y, want, dtype, factor=2.0)


def test_batched_vmap_grad_and_validation():
  h, k, r, n = 2, 8, 3, 5
  x, u, v = randn((4, 6, h, k)), randn((h, k, r), scale=0.3), randn((h, r, n))
  f = lambda x, u, v: lr_xuv_batched(x, u, v)  # noqa: E731
  got = jax.vmap(f, in_axes=(0, None, None))(x, u, v)
  assert_close(got, lr_xuv_batched_reference(x, u, v), jnp.float32)
  check_grads(f, (x[0], u, v), order=1, modes=("rev",), atol=2e-2, rtol=2e-2)
  with pytest.raises(ValueError, match=r"must end with \(2, 8\)"):
    lr_xuv_batched(randn((3, 8)), u, v)
  with pytest.raises(ValueError, match="disagree"):
    lr_xuv_batched(x, u, randn((h, r + 1, n)))


def test_headwise_module_fuses_and_explain_names_the_batched_form():
  from flax import nnx

  from lrjax.compression import HeadwiseLowRankLinear

  m = HeadwiseLowRankLinear(64, 4, 16, 6, use_bias=True, rngs=nnx.Rngs(0))
  m.bias[...] = randn(m.bias[...].shape)
  x = randn((2, 5, 64))
  rep = lrjax.explain(m, x)
  assert [d["pattern"] for d in rep.matches] == ["lr_xuv(batched)"]
  assert "x shared by the heads" in rep.matches[0]["shapes"]
  assert rep.matches[0]["kernels"]["cuda"]["kernel"] == "reference"
  assert_close(nnx.jit(lambda m, x: lrjax.fuse(m)(x))(m, x), m(x), jnp.float32)
