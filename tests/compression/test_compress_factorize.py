"""Matrix-level compression: block-aligned ranks, whitening, PD repair, per-head factors, errors."""

import logging
import math

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, randn
from flax import nnx

from lrjax.compression import (
  HeadwiseLowRankLinear,
  budget_rank,
  check_rank,
  cholesky_factor,
  factorize,
  lowrank_params,
  reconstruct,
)
from lrjax.nn import svd_factors


@pytest.mark.parametrize(
  "k,n,heads",
  [(128, 128, 1), (256, 96, 1), (96, 512, 1), (128, 256, 8), (128, 64, 2), (100, 300, 1)],
)
@pytest.mark.parametrize("ratio", [0.1, 0.2, 0.4, 0.75])
@pytest.mark.parametrize("block", [8, 16])
def test_budget_rank_block_aligned_and_maximal(k, n, heads, ratio, block):
  step = block * heads // math.gcd(block, heads)
  try:
    r = budget_rank(k, n, ratio, block, heads=heads)
  except ValueError as e:  # only when not even one step fits
    assert "smaller" in str(e)
    assert step * (k + n // heads) > (1 - ratio) * k * n
    return
  assert r % block == 0 and r % heads == 0
  budget = (1 - ratio) * k * n
  assert lowrank_params(k, n, r, heads) <= budget
  # One more aligned step would break the budget or the max rank.
  assert lowrank_params(k, n, r + step, heads) > budget or (r + step) // heads > min(k, n // heads)


def _anisotropic(t, k, rng):
  """Calibration-like activations: correlated, with a few large-variance features."""
  mix = rng.standard_normal((k, k)) / np.sqrt(k)
  scale = np.exp(rng.standard_normal(k) * 1.5)
  return (rng.standard_normal((t, k)) * scale) @ (np.eye(k) + mix)


def test_plain_factors_match_svd_with_sqrt_sigma_split(rng):
  w = rng.standard_normal((48, 80))
  u, v = factorize(w, 16)
  _, s, _ = np.linalg.svd(w)
  # √Σ split: uᵀu = v vᵀ = Σ_r
  np.testing.assert_allclose(u.T @ u, np.diag(s[:16]), atol=1e-9)
  np.testing.assert_allclose(v @ v.T, np.diag(s[:16]), atol=1e-9)
  uu, vv = svd_factors(w, 16)
  np.testing.assert_allclose(u @ v, uu @ vv, atol=1e-9)


@pytest.mark.parametrize("k,n,r", [(64, 96, 16), (96, 48, 8), (33, 70, 5)])
def test_whitening_reduces_output_error_and_is_optimal(k, n, r, rng):
  x = _anisotropic(4 * k, k, rng)
  w = rng.standard_normal((k, n))
  l, how = cholesky_factor(x.T @ x)
  assert how == "cholesky"
  uw, vw = factorize(w, r, l)
  up, vp = factorize(w, r)
  err_w = np.linalg.norm(x @ (w - uw @ vw))
  err_p = np.linalg.norm(x @ (w - up @ vp))
  assert err_w < 0.9 * err_p
  # Eckart–Young in the whitened space: the error is the tail of the singular values of Lᵀw.
  s = np.linalg.svd(l.T @ w, compute_uv=False)
  np.testing.assert_allclose(err_w, np.sqrt(np.sum(s[r:] ** 2)), rtol=1e-8)


def test_pd_repair_on_singular_gram_uses_jitter(rng, caplog):
  k = 32
  x = rng.standard_normal((12, k))  # 12 tokens < 32 features: rank-12 XᵀX
  x[:, 5] = 0.0  # and a dead feature
  g = x.T @ x
  try:  # plain Cholesky fails or has a ~0 pivot
    plain_ok = np.min(np.diag(np.linalg.cholesky(g))) ** 2 > 1e-12 * np.mean(np.diag(g))
  except np.linalg.LinAlgError:
    plain_ok = False
  assert not plain_ok
  with caplog.at_level(logging.WARNING, logger="lrjax.compression"):
    l, how = cholesky_factor(g, name="unit")
  assert how.startswith("jitter=")
  assert "not positive definite" in caplog.text and "unit" in caplog.text
  np.testing.assert_allclose(np.tril(l), l)
  assert np.all(np.diag(l) > 0)
  w = rng.standard_normal((k, 40))
  u, v = factorize(w, 8, l)
  assert np.all(np.isfinite(u)) and np.all(np.isfinite(v))
  # Still activation-aware: on the calibration inputs it beats plain SVD.
  up, vp = factorize(w, 8)
  assert np.linalg.norm(x @ (w - u @ v)) < np.linalg.norm(x @ (w - up @ vp))


def test_pd_repair_falls_back_to_eigenvalue_clipping(rng, caplog):
  k = 16
  q, _ = np.linalg.qr(rng.standard_normal((k, k)))
  ev = np.abs(rng.standard_normal(k)) + 1.0
  ev[0] = -0.5 * ev.sum()  # strongly indefinite: no small jitter fixes it
  g = (q * ev) @ q.T
  with caplog.at_level(logging.WARNING, logger="lrjax.compression"):
    l, how = cholesky_factor(g, name="indef")
  assert how == "eigclip"
  assert "clipped 1 of 16 eigenvalues" in caplog.text
  rep = l @ l.T
  w_rep = np.linalg.eigvalsh(rep)
  assert w_rep.min() > 0
  # Positive eigen-directions are kept.
  np.testing.assert_allclose(np.sort(w_rep)[1:], np.sort(ev[1:]), rtol=1e-8)


def test_cholesky_rejects_nan_gram(rng):
  g = np.eye(4)
  g[1, 2] = np.nan
  with pytest.raises(ValueError, match="NaN/Inf"):
    cholesky_factor(g, name="bad")


@pytest.mark.parametrize("heads,d,r_h", [(4, 16, 5), (2, 32, 32), (8, 8, 3)])
def test_per_head_factors(heads, d, r_h, rng):
  k = 64
  w = rng.standard_normal((k, heads * d))
  x = _anisotropic(256, k, rng)
  l, _ = cholesky_factor(x.T @ x)
  u, v = factorize(w, heads * r_h, l, heads=heads)
  assert u.shape == (k, heads * r_h) and v.shape == (heads, r_h, d)
  full = reconstruct(u, v)
  for h in range(heads):  # each head is its own whitened truncated SVD
    uh, vh = factorize(w[:, h * d : (h + 1) * d], r_h, l)
    np.testing.assert_allclose(full[:, h * d : (h + 1) * d], uh @ vh, atol=1e-8)
  if r_h == min(k, d):  # full per-head rank reproduces w exactly
    np.testing.assert_allclose(full, w, atol=1e-8)


def test_headwise_module_matches_reconstruction(rng):
  heads, d, r_h, k = 2, 32, 12, 64  # a GQA k/v projection: 2 KV heads
  m = HeadwiseLowRankLinear(k, heads, d, r_h, use_bias=True, rngs=nnx.Rngs(0))
  m.bias[...] = randn((heads * d,))
  x = randn((3, 5, k))
  ref = (
    jnp.asarray(
      np.asarray(x) @ reconstruct(np.asarray(m.u[...]), np.asarray(m.v[...])), jnp.float32
    )
    + m.bias[...]
  )
  assert_close(m(x), ref, jnp.float32, factor=10)
  assert m.num_params == heads * r_h * (k + d) + heads * d


@pytest.mark.parametrize("ratio", [0.0, 1.0, -0.1, 1.5, float("nan"), float("inf")])
def test_ratio_outside_open_interval(ratio):
  with pytest.raises(ValueError, match=r"ratio=.*\(0, 1\)"):
    budget_rank(64, 64, ratio, 8)


def test_ratio_wrong_type():
  with pytest.raises(TypeError, match="ratio"):
    budget_rank(64, 64, "0.2", 8)


def test_rank_above_min_dims(rng):
  with pytest.raises(ValueError, match=r"rank=40 > min\(K, N\)=32"):
    factorize(rng.standard_normal((32, 48)), 40)
  with pytest.raises(ValueError, match="per-head rank 20 > min"):
    check_rank(64, 64, 80, heads=4)


def test_block_larger_than_budget_names_the_fix():
  with pytest.raises(
    ValueError, match=r"block=128 exceeds .* pass a smaller block \(block=16 fits\)"
  ):
    budget_rank(64, 64, 0.5, 128, name="layer 0 q_proj")
