"""Shared test helpers: the per-dtype tolerance table and fresh random inputs."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Relative tolerance on ||out - ref|| / ||ref||, per compute dtype.
TOLERANCES = {
    jnp.dtype(jnp.float32): 1e-5,
    jnp.dtype(jnp.float16): 2e-3,
    jnp.dtype(jnp.bfloat16): 1e-2,
}

_seed = itertools.count(int.from_bytes(np.random.SeedSequence().entropy.to_bytes(16, "little")[:4], "little"))


def tolerance(dtype) -> float:
  return TOLERANCES[jnp.dtype(dtype)]


def rel_err(out, ref) -> float:
  out = np.asarray(out).astype(np.float64)
  ref = np.asarray(ref).astype(np.float64)
  assert out.shape == ref.shape, f"shape {out.shape} != {ref.shape}"
  assert np.all(np.isfinite(out)), "output has NaN/Inf"
  return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def assert_close(out, ref, dtype, factor: float = 1.0):
  err = rel_err(out, ref)
  tol = factor * tolerance(dtype)
  assert err <= tol, f"relative error {err:.3g} > {tol:.3g} for {jnp.dtype(dtype)}"


def fresh_key():
  """A new PRNG key per call: every test draws fresh random inputs."""
  return jax.random.key(next(_seed) % (2**31))


def randn(shape, dtype=jnp.float32, scale=1.0, key=None):
  key = fresh_key() if key is None else key
  return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@pytest.fixture
def rng():
  return np.random.default_rng(next(_seed))
