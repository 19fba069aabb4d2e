"""lr_xuv / lr_mlp: abstract eval, reference, vmap, JVP/VJP and input validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from conftest import assert_close, randn
from lrjax.lowering import lr_mlp, lr_mlp_reference, lr_xuv, lr_xuv_reference

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
SHAPES = [((1, 33), 7, 45), ((3, 5, 64), 16, 96), ((130,), 3, 17)]


def _f64_xuv(x, u, v, b=None):
  x, u, v = (np.asarray(a, np.float64) for a in (x, u, v))
  y = x @ u @ v
  return y + np.asarray(b, np.float64) if b is not None else y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("xshape,r,n", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_xuv_matches_f64(dtype, xshape, r, n, bias):
  k = xshape[-1]
  x, u, v = randn(xshape, dtype), randn((k, r), dtype, k**-0.5), randn((r, n), dtype, r**-0.5)
  b = randn((n,), dtype) if bias else None
  y = jax.jit(lr_xuv)(x, u, v, b)
  assert y.shape == xshape[:-1] + (n,) and y.dtype == dtype
  assert_close(y, _f64_xuv(x, u, v, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
  "gated,act", [(True, "silu"), (True, "gelu_tanh"), (False, "gelu"), (False, "relu")]
)
@pytest.mark.parametrize("bias", [False, True])
def test_mlp_matches_f64(dtype, gated, act, bias):
  d, f, r = 48, 80, 12
  x = randn((2, 3, d), dtype)

  def proj(k, n):
    p = (randn((k, r), dtype, k**-0.5), randn((r, n), dtype, r**-0.5))
    return p + ((randn((n,), dtype, 0.1),) if bias else ())

  gate, up, down = (proj(d, f) if gated else None), proj(d, f), proj(f, d)
  y = jax.jit(lambda x: lr_mlp(x, up, down, gate, act=act))(x)
  acts = {
    "silu": lambda h: h / (1 + np.exp(-h)),
    "relu": lambda h: np.maximum(h, 0),
    "gelu_tanh": lambda h: 0.5 * h * (1 + np.tanh(0.7978845608 * (h + 0.044715 * h**3))),
    "gelu": lambda h: np.asarray(
      jax.nn.gelu(jnp.asarray(h, jnp.float32), approximate=False), np.float64
    ),
  }
  h = _f64_xuv(x, *up)
  h = acts[act](_f64_xuv(x, *gate)) * h if gated else acts[act](h)
  assert_close(y, _f64_xuv(h, *down), dtype, factor=2.0)


def test_vmap_activation_and_weights():
  x, u, v = randn((4, 6, 32)), randn((32, 5)), randn((5, 24))
  y = jax.vmap(lambda x: lr_xuv(x, u, v), in_axes=1, out_axes=1)(x)
  assert_close(y, lr_xuv_reference(x, u, v), jnp.float32)
  us = jnp.stack([u, 2 * u, -u])
  y = jax.vmap(lambda u: lr_xuv(x, u, v))(us)
  assert_close(y, jnp.stack([lr_xuv_reference(x, w, v) for w in us]), jnp.float32)


def test_xuv_gradients():
  x, u, v, b = randn((3, 16)), randn((16, 4), scale=0.25), randn((4, 10), scale=0.5), randn((10,))
  check_grads(
    lambda x, u, v, b: lr_xuv(x, u, v, b),
    (x, u, v, b),
    order=1,
    modes=("fwd", "rev"),
    atol=1e-2,
    rtol=1e-2,
  )


def test_mlp_gradients():
  # factors scaled 1/sqrt(fan-in): O(1) activations keep f32 finite differences accurate
  # (unscaled, the third product reaches ~1e2 and the numerical VJP drifts past 1 %)
  f = lambda a, b: randn((a, b), jnp.float32, a**-0.5)
  x = randn((2, 16))
  g, up, dn = (f(16, 4), f(4, 24)), (f(16, 4), f(4, 24)), (f(24, 4), f(4, 16))
  check_grads(
    lambda x, a, b: lr_mlp(x, up, (a, b), g),
    (x, *dn),
    order=1,
    modes=("rev",),
    atol=1e-2,
    rtol=1e-2,
  )
  gx = jax.grad(lambda x: lr_mlp(x, up, dn, g).sum())(x)
  gr = jax.grad(lambda x: lr_mlp_reference(x, up, dn, g).sum())(x)
  assert_close(gx, gr, jnp.float32)


@pytest.mark.parametrize(
  "args,match",
  [
    (((2, 8), (9, 4), (4, 5)), "disagree on K"),
    (((2, 8), (8, 4), (3, 5)), "disagree on the rank"),
    (((2, 8), (8, 4, 1), (4, 5)), "must be 2-D"),
  ],
)
def test_xuv_shape_errors(args, match):
  xs, us, vs = args
  with pytest.raises(ValueError, match=match):
    lr_xuv(randn(xs), randn(us), randn(vs))


def test_xuv_bad_bias_and_dtype():
  x, u, v = randn((2, 8)), randn((8, 4)), randn((4, 5))
  with pytest.raises(ValueError, match="bias.shape"):
    lr_xuv(x, u, v, randn((4,)))
  with pytest.raises(TypeError, match="x.dtype=int32"):
    lr_xuv(jnp.ones((2, 8), jnp.int32), u, v)


def test_mlp_bad_act():
  x = randn((2, 8))
  p = (randn((8, 2)), randn((2, 8)))
  with pytest.raises(ValueError, match="act='swish'"):
    lr_mlp(x, p, p, act="swish")
