"""lrjax.nn: LowRankLinear / LowRankMLP construction, from_dense, logical axes, errors."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import assert_close, randn
from lrjax.nn import LowRankLinear, LowRankMLP, svd_factors


def test_from_dense_full_rank_is_exact_and_truncation_is_optimal():
  w = np.asarray(randn((24, 40)), np.float64)
  m = LowRankLinear.from_dense(w, 24, param_dtype=jnp.float32)
  assert_close(m.u[...] @ m.v[...], w, jnp.float32, factor=10)
  u, v = svd_factors(w, 5)
  s = np.linalg.svd(w, compute_uv=False)
  # Eckart–Young: the rank-5 error is exactly the tail of the spectrum.
  assert np.isclose(np.linalg.norm(w - u @ v), np.sqrt((s[5:] ** 2).sum()), rtol=1e-10)
  # √Σ split: both factors carry the same singular values.
  assert np.allclose(np.linalg.norm(u, axis=0), np.linalg.norm(v, axis=1))


def test_forward_and_logical_axes():
  m = LowRankLinear(16, 32, 4, use_bias=True, axes=("embed", "mlp"), rngs=nnx.Rngs(0))
  x = randn((3, 16))
  assert_close(m(x), x @ m.u[...] @ m.v[...] + m.bias[...], jnp.float32)
  specs = nnx.get_partition_spec(nnx.state(m))
  assert tuple(specs["u"].get_value()) == ("embed", "rank")
  assert tuple(specs["v"].get_value()) == ("rank", "mlp")
  assert m.num_params == 4 * (16 + 32) + 32


@pytest.mark.parametrize("gated", [True, False])
def test_mlp_shapes(gated):
  mlp = LowRankMLP(
    16, 40, (4, 4, 4) if gated else (4, 4), gated=gated, act="gelu", rngs=nnx.Rngs(1)
  )
  assert mlp(randn((2, 5, 16))).shape == (2, 5, 16)


def test_errors():
  with pytest.raises(ValueError, match="rank=20 must be <="):
    LowRankLinear(16, 8, 20, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="rank=0"):
    svd_factors(np.ones((4, 4)), 0)
  with pytest.raises(ValueError, match="must be 2-D"):
    svd_factors(np.ones((4, 4, 4)), 2)
  with pytest.raises(ValueError, match="ranks="):
    LowRankMLP(16, 40, (4, 4), gated=True, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="act="):
    LowRankMLP(16, 40, (4, 4, 4), act="tanhh", rngs=nnx.Rngs(0))
