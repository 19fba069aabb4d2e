"""The NKI test double itself rejects kernels that break NKI's rules."""

import numpy as np
import pytest

from nki_double import NkiDouble, NkiRuleError


@pytest.fixture
def d():
  return NkiDouble()


def sb(d, shape, dtype=np.float16):
  """A fresh SBUF tile (its own allocation site, so earlier tiles stay valid)."""
  return _fresh(d, shape, dtype, d.nl.sbuf)


def ps(d, shape):
  return _fresh(d, shape, d.nl.float32, d.nl.psum)


def _fresh(d, shape, dtype, buffer):
  # Each call compiles a new code object, i.e. a new allocation site for the double.
  ns = {}
  exec(
    compile(
      "def f(d, s, t, b):\n  return d.nl.ndarray(s, dtype=t, buffer=b)\n",
      f"<tile {next(_n)}>",
      "exec",
    ),
    ns,
  )
  return ns["f"](d, shape, dtype, buffer)


_n = iter(range(10**9))


def test_matmul_rules(d):
  st, mv, acc = sb(d, (128, 128)), sb(d, (128, 512)), ps(d, (128, 512))
  st.arr[...] = np.random.default_rng().standard_normal((128, 128))
  mv.arr[...] = np.random.default_rng().standard_normal((128, 512))
  d.nisa.nc_matmul(dst=acc, stationary=st, moving=mv, accumulate=True)
  np.testing.assert_allclose(
    acc.arr, st.arr.astype(np.float32).T @ mv.arr.astype(np.float32), rtol=1e-5
  )
  assert d.flops == 2 * 128 * 128 * 512
  with pytest.raises(NkiRuleError, match="stationary free size"):
    d.nisa.nc_matmul(dst=ps(d, (128, 8)), stationary=sb(d, (64, 129)), moving=sb(d, (64, 8)))
  with pytest.raises(NkiRuleError, match="moving free size"):
    d.nisa.nc_matmul(dst=acc, stationary=st, moving=sb(d, (128, 513)))
  with pytest.raises(NkiRuleError, match="partition dim"):  # stationary not transposed
    d.nisa.nc_matmul(dst=ps(d, (128, 64)), stationary=sb(d, (64, 128)), moving=sb(d, (128, 64)))
  with pytest.raises(NkiRuleError, match="writes PSUM"):
    d.nisa.nc_matmul(dst=sb(d, (128, 512), np.float32), stationary=st, moving=mv)
  with pytest.raises(NkiRuleError, match="float32"):
    d.nisa.nc_matmul(
      dst=d.nl.ndarray((128, 512), dtype=np.float16, buffer=d.nl.psum), stationary=st, moving=mv
    )


def test_tile_and_capacity_limits(d):
  with pytest.raises(NkiRuleError, match="partition dim 256"):
    sb(d, (256, 4))
  keep = sb(d, (128, 48 * 1024))  # 96 KiB of the 192 KiB per partition
  with pytest.raises(NkiRuleError, match="SBUF over capacity"):
    sb(d, (128, 50 * 1024))
  banks = [ps(d, (128, 512)) for _ in range(8)]  # all 8 PSUM banks
  with pytest.raises(NkiRuleError, match="PSUM over capacity"):
    ps(d, (128, 512))
  assert d.peak_sbuf_bytes == 128 * 96 * 1024 and d.peak_psum_banks == 8 and keep and banks


def test_dma_only_between_hbm_and_sbuf(d):
  run = d.nki.jit(lambda x: x)
  src = d._hbm_input(np.ones((128, 64), np.float16), "x")
  out = d.nl.ndarray((128, 64), dtype=np.float16, buffer=d.nl.shared_hbm)
  acc = ps(d, (128, 64))
  with pytest.raises(NkiRuleError, match="psum->hbm"):
    d.nisa.dma_copy(dst=out, src=acc)
  with pytest.raises(NkiRuleError, match="hbm->psum"):
    d.nisa.dma_copy(dst=acc, src=src)
  with pytest.raises(NkiRuleError, match="sbuf->sbuf"):
    d.nisa.dma_copy(dst=sb(d, (128, 64)), src=sb(d, (128, 64)))
  with pytest.raises(NkiRuleError, match="does not cast"):
    d.nisa.dma_copy(dst=sb(d, (128, 64), np.float32), src=src)
  with pytest.raises(NkiRuleError, match="2-byte"):
    d.nisa.dma_transpose(
      dst=sb(d, (64, 128), np.float32), src=d._hbm_input(np.ones((128, 64), np.float32), "y")
    )
  t = sb(d, (64, 128))
  d.nisa.dma_transpose(dst=t, src=src)
  assert d.hbm_read_bytes == 128 * 64 * 2 and run is not None


def test_engines_do_not_touch_hbm_and_stale_tiles_raise(d):
  hb = d._hbm_input(np.ones((128, 8), np.float16), "x")
  with pytest.raises(NkiRuleError, match="on HBM"):
    d.nisa.tensor_copy(dst=sb(d, (128, 8)), src=hb)

  def alloc():
    return d.nl.ndarray((128, 8), dtype=np.float16, buffer=d.nl.sbuf)  # one site: one buffer

  first = alloc()
  alloc()
  with pytest.raises(NkiRuleError, match="reallocated"):
    d.nisa.memset(dst=first, value=0.0)
