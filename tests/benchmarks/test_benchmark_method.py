"""CPU tests of the GPU benchmark's timing method (benchmarks/gpu_lowrank.py)."""
import importlib.util
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench():
  spec = importlib.util.spec_from_file_location(
      "gpu_lowrank", os.path.join(REPO, "benchmarks", "gpu_lowrank.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def scripted(results):
  it = iter(results)
  return lambda: next(it)


def test_steady_timing_is_taken_at_once(bench):
  assert bench.steadiest(scripted([(50.0, 0.1), (1.0, 0.0)])) == (50.0, 0.1, 1)


def test_noisy_timing_is_repeated_and_the_steadiest_kept(bench):
  got = bench.steadiest(scripted([(26.5, 0.74), (48.3, 0.05), (1.0, 0.0)]))
  assert got == (48.3, 0.05, 2)  # stops once steady
  got = bench.steadiest(scripted([(20.0, 1.1), (30.0, 0.9), (25.0, 0.7)]), tries=3)
  assert got == (25.0, 0.7, 3)  # never steady: the least noisy of the three


def test_per_call_us_goes_through_the_retry(bench, monkeypatch):
  import math
  import jax.numpy as jnp
  seen = []

  def spy(attempt, **kw):  # the real retry, recording every attempt it makes
    def recorded():
      seen.append(attempt())
      return seen[-1]
    return real(recorded, **kw)
  real = bench.steadiest
  monkeypatch.setattr(bench, "steadiest", spy)
  x = jnp.ones((64,), jnp.float32)
  layers = [(jnp.full((64,), float(i)),) for i in range(4)]
  t_us, spread = bench.per_call_us(lambda x, w: x * w + 1.0, x, layers, reps=3)
  assert 1 <= len(seen) <= bench.TRIES
  assert (t_us, spread) == min(seen, key=lambda a: a[1])  # the steadiest attempt is kept
  assert math.isfinite(t_us) and spread >= 0  # spread is a magnitude, even for a noisy median
