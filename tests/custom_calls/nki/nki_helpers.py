"""Shared helpers of the NKI tests: kernel modules instantiated on a fresh test double."""

import jax.numpy as jnp
import numpy as np

from lrjax.custom_calls.nki import _api
from nki_double import NkiDouble


def on_double(*names, execute=True):
  """(double, module copies of lrjax.custom_calls.nki.<name> bound to that double)."""
  d = NkiDouble(execute=execute)
  mods = [
    _api.instantiate(f"lrjax.custom_calls.nki.{n}", nki=d.nki, nl=d.nl, nisa=d.nisa) for n in names
  ]
  return d, mods


_rng = np.random.default_rng()  # seeded from OS entropy: fresh inputs on every run


def rand(shape, dtype, scale=1.0):
  """Fresh standard-normal numpy array in ``dtype`` (bf16 via ml_dtypes); numpy, so no jit per shape."""  # noqa: E501
  return (scale * _rng.standard_normal(shape)).astype(jnp.dtype(dtype))


def j(a):
  return None if a is None else jnp.asarray(a)


def hbm_total(d):
  return d.hbm_read_bytes + d.hbm_write_bytes
