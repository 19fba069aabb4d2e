"""The pass never changes a result and misses nothing silently: one test per reported finding.

Each uses only ``lrjax.fuse`` / ``lrjax.explain`` as a user would: a wrong activation taken for
a known one, a rank-space scale or per-head factors left as plain dots with no report, and a
factor computed from the chain's own input taken for a weight.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lrjax
from conftest import randn, primitive_names as _prims


def _factors(k, r, n, dtype=jnp.float32):
  return randn((k, r), dtype, k**-0.5), randn((r, n), dtype, r**-0.5)


def _bits(a):
  return np.asarray(jnp.asarray(a, jnp.float32))


def _assert_same(fused, ref):
  np.testing.assert_array_equal(_bits(fused), _bits(ref))


# ------------------------------------------------------------ activations (exact or refused)


def test_clipped_silu_is_not_fused_as_silu():
  """silu(clip(h, -20, 20)) differs from silu wherever |h| > 20: it must not become lr_mlp."""
  ug, vg = _factors(64, 8, 160)
  uu, vu = _factors(64, 8, 160)
  ud, vd = _factors(160, 8, 64)
  f = lambda x: (jax.nn.silu(jnp.clip(x @ ug @ vg, -20, 20)) * (x @ uu @ vu)) @ ud @ vd  # noqa: E731
  x = randn((4, 64), scale=60.0)  # gate pre-activations well beyond ±20
  assert "lr_mlp" not in _prims(lrjax.fuse(f), x)
  _assert_same(jax.jit(lrjax.fuse(f))(x), jax.jit(f)(x))
  rep = lrjax.explain(f, x)
  assert any("activation not recognised" in n["reason"] for n in rep.near_misses)


def test_capped_relu_is_not_fused_as_relu():
  """min(relu(h), 10) is relu only below 10."""
  u1, v1 = _factors(64, 8, 160)
  u2, v2 = _factors(160, 8, 64)
  f = lambda x: jnp.minimum(jax.nn.relu(x @ u1 @ v1), 10.0) @ u2 @ v2  # noqa: E731
  x = randn((4, 64), scale=100.0)
  assert "lr_mlp" not in _prims(lrjax.fuse(f), x)
  _assert_same(jax.jit(lrjax.fuse(f))(x), jax.jit(f)(x))
  reasons = [n["reason"] for n in lrjax.explain(f, x).near_misses]
  assert any("closest by value is relu" in r for r in reasons), reasons


def test_bf16_quick_gelu_is_not_fused_as_gelu():
  """x·sigmoid(1.702x) is within bf16 rounding of gelu on [-9, 9], but it is not gelu."""
  dt = jnp.bfloat16
  u1, v1 = _factors(64, 8, 160, dt)
  u2, v2 = _factors(160, 8, 64, dt)
  f = lambda x: (lambda h: h * jax.nn.sigmoid(1.702 * h))(x @ u1 @ v1) @ u2 @ v2  # noqa: E731
  x = randn((4, 64), dt, scale=3.0)
  assert "lr_mlp" not in _prims(lrjax.fuse(f), x)
  _assert_same(jax.jit(lrjax.fuse(f))(x), jax.jit(f)(x))


# ------------------------------------------------------------ silent misses


@pytest.mark.parametrize(
  "form",
  ["scalar", "sigma", "sigma_row"],
)
def test_rank_space_scale_fuses(form):
  """(x @ u * 0.5) @ v and the SVD storage ((x @ U) * S) @ Vt fuse, with the same result."""
  u, v = _factors(64, 8, 96)
  s = randn((8,))
  fns = {
    "scalar": lambda x: (x @ u * 0.5) @ v,
    "sigma": lambda x: ((x @ u) * s) @ v,
    "sigma_row": lambda x: ((x @ u) * s[None, None, :]) @ v,
  }
  f = fns[form]
  x = randn((2, 5, 64))
  rep = lrjax.explain(f, x)
  assert len(rep.matches) == 1 and rep.matches[0]["pattern"] == "lr_xuv", str(rep)
  assert "dot_general" not in _prims(lrjax.fuse(f), x)
  _assert_same(jax.jit(lrjax.fuse(f))(x), jax.jit(f)(x))


def test_per_head_einsum_factors_fuse():
  """einsum('bhsd,hdr->bhsr') then einsum('bhsr,hrn->bhsn'): per-head factors."""
  uh, vh = randn((4, 16, 3), scale=0.25), randn((4, 3, 16), scale=0.5)
  f = lambda x: jnp.einsum("bhsr,hrn->bhsn", jnp.einsum("bhsd,hdr->bhsr", x, uh), vh)  # noqa: E731
  x = randn((2, 4, 5, 16))
  rep = lrjax.explain(f, x)
  assert len(rep.matches) == 1, str(rep)
  assert "dot_general" not in _prims(lrjax.fuse(f), x)
  np.testing.assert_allclose(jax.jit(lrjax.fuse(f))(x), f(x), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------ false match


def test_factor_derived_from_the_input_is_not_a_weight():
  """In (x @ x[:8].T) @ v the 'u' is the activation itself: refused, and said so."""
  f = lambda x, v: (x @ x[:8].T) @ v  # noqa: E731
  x, v = randn((16, 64)), randn((8, 96))
  assert "lr_xuv" not in _prims(lrjax.fuse(f), x, v)
  rep = lrjax.explain(f, x, v)
  assert not rep.matches
  assert any("derived from the chain's input" in n["reason"] for n in rep.near_misses), str(rep)
