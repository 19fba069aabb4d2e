"""Edges of the C++ W4A8 kernels: non-finite and tiny activations, the FFI attributes'
ranges and the thread count from LRJAX_W4A8_THREADS."""

import os
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close

import lrjax
from lrjax.custom_calls.cpu import lowering as cpu_lowering
from lrjax.lowering import quantized as Q
from lrjax.quant import pack

pytestmark = pytest.mark.skipif(
  not cpu_lowering.extension_available(),
  reason="the W4A8 C++ extension is not built (pip install -e .)",
)

LAYOUTS = ("x86_vnni", "arm_sdot4", "arm_smmla8")


def _weights(rng, k, n, group, layout, scale=1.0):
  w = (scale * rng.standard_normal((k, n))).astype(np.float32)
  q, s = pack.quantize_int4(w, group)
  return q, s, jnp.asarray(pack.pack_int4(q, layout)), jnp.asarray(pack.pad_scales(s, layout))


def _kernel_and_reference(f, *args):
  assert "lrjax_w4a8" in jax.jit(f).lower(*args).compile().as_text()
  y = jax.jit(f)(*args)
  with lrjax.lowering.force_reference():
    ref = jax.jit(f)(*args)
  return np.asarray(y.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))


def _f32_math(x, q, s, group, bias=None):
  """x · (q s) (+ bias) in numpy f32 (IEEE NaN/inf rules; the order of the sum cannot
  change a NaN or an inf of a row with a non-finite value)."""
  k = q.shape[0]
  grp = k if group == 0 else group
  wd = (q.astype(np.float32) * s[np.arange(k) // grp]).astype(np.float32)
  with np.errstate(all="ignore"):
    y = np.asarray(x, np.float32) @ wd
    return y if bias is None else y + np.asarray(bias, np.float32)


def _nonfinite_rows(rng, m, k):
  x = rng.standard_normal((m, k)).astype(np.float32)
  x[0, 3] = np.nan  # NaN: the whole row is NaN
  x[1, k // 2] = np.inf  # one +inf: +-inf by the weight's sign, NaN at zero weights
  x[2, 1] = -np.inf
  x[3, 0], x[3, k - 1] = np.inf, -np.inf  # both signs: NaN where both weights are non-zero
  return x  # rows 4.. stay finite


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("group", [0, 32])
def test_nonfinite_activations_propagate_like_f32(rng, layout, group):
  m, k, n = 7, 96, 40
  q, s, w, sp = _weights(rng, k, n, group, layout)
  q[k // 2, ::3] = 0  # an inf meets zero weights: inf * 0 = NaN in f32
  w = jnp.asarray(pack.pack_int4(q, layout))
  b = rng.standard_normal(n).astype(np.float32)
  x = _nonfinite_rows(rng, m, k)
  f = lambda x: Q.w4a8_matmul(x, w, sp, b, n=n, group=group, layout=layout)
  y, ref = _kernel_and_reference(f, jnp.asarray(x))
  np.testing.assert_array_equal(y, ref)  # kernel == reference, NaN for NaN
  want = _f32_math(x[:4], q, s, group, b)
  assert np.isnan(y[0]).all()
  np.testing.assert_array_equal(np.isnan(y[:4]), np.isnan(want))
  np.testing.assert_array_equal(y[:4][~np.isnan(want)], want[~np.isnan(want)])  # +-inf, signed
  assert np.isinf(y[1]).sum() > 0 and np.isnan(y[1, ::3]).all()
  # The finite rows are what they are without the non-finite ones beside them.
  alone = np.asarray(jax.jit(f)(jnp.asarray(x[4:])))
  np.testing.assert_array_equal(y[4:], alone)
  assert np.isfinite(alone).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_nonfinite_activations_in_fused_xuv(rng, dtype):
  m, k, r, n = 6, 72, 24, 33
  layout = pack.default_layout()
  qu, su, wu, spu = _weights(rng, k, r, 32, layout)
  qv, sv, wv, spv = _weights(rng, r, n, 0, layout)
  x = jnp.asarray(_nonfinite_rows(rng, m, k)).astype(dtype)
  fused = lambda x: Q.lr_xuv_w4a8(
    x, wu, spu, wv, spv, r=r, n=n, group_u=32, group_v=0, layout=layout
  )
  y, ref = _kernel_and_reference(fused, x)
  np.testing.assert_array_equal(y, ref)
  chain = lambda x: Q.w4a8_matmul(
    Q.w4a8_matmul(x, wu, spu, n=r, group=32, layout=layout, out_dtype=jnp.float32),
    wv,
    spv,
    n=n,
    group=0,
    layout=layout,
    out_dtype=dtype,
  )
  np.testing.assert_array_equal(y, np.asarray(jax.jit(chain)(x).astype(jnp.float32)))
  t = _f32_math(np.asarray(x.astype(jnp.float32))[:4], qu, su, 32)
  want = _f32_math(t, qv, sv, 0)
  np.testing.assert_array_equal(np.isnan(y[:4]), np.isnan(want))
  assert not np.isfinite(y[:4]).any() and np.isfinite(y[4:]).all()


@pytest.mark.parametrize("amax", [3e-37, 1e-33, 1e-20])
def test_tiny_activation_rows_keep_their_precision(rng, amax):
  # 127/amax overflows f32 below amax ~ 3.7e-37: such rows (and any below 2^-96) are computed
  # in f32 over the dequantized weights; rows above 2^-96 are quantized as usual. Both keep
  # W4A8 accuracy. Entries stay normal floats (XLA flushes denormals to zero).
  m, k, n, group = 3, 256, 48, 64
  layout = pack.default_layout()
  q, s, w, sp = _weights(rng, k, n, group, layout)
  mag = rng.uniform(amax / 3, amax, (m, k))
  x = (np.sign(rng.standard_normal((m, k))) * mag).astype(np.float32)
  f = lambda x: Q.w4a8_matmul(x, w, sp, n=n, group=group, layout=layout)
  y, ref = _kernel_and_reference(f, jnp.asarray(x))
  want = x.astype(np.float64) @ pack.dequantize_int4(q, s, group)
  nmse = np.mean((y - want) ** 2) / np.mean(want**2)
  assert nmse < 1e-3, nmse
  assert_close(y, ref, jnp.float32, factor=100)


@pytest.mark.parametrize(
  "attr,value,match",
  [
    ("layout", 2**40, "attribute layout=1099511627776 is outside"),
    ("layout", -1, "attribute layout=-1 is outside"),
    ("layout", 3, "attribute layout=3 is outside"),
    ("group", 2**40, "attribute group=1099511627776 is outside"),
    ("group", -8, "attribute group=-8 is outside"),
    ("k", 2**40, "attribute k=1099511627776 is outside"),
    ("n", -30, "attribute n=-30 is outside"),
  ],
)
def test_ffi_attributes_are_range_checked(rng, attr, value, match):
  _, _, w, s = _weights(rng, 100, 30, 32, "x86_vnni")
  cpu_lowering.extension()
  attrs = dict(k=np.int64(100), n=np.int64(30), group=np.int64(32), layout=np.int64(0))
  attrs[attr] = np.int64(value)
  call = jax.ffi.ffi_call(
    "lrjax_w4a8_matmul", jax.ShapeDtypeStruct((2, 30), jnp.float32), vmap_method="broadcast_all"
  )
  x = jnp.asarray(rng.standard_normal((2, 100)), jnp.float32)
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(call(x, w, s, jnp.zeros((0,), jnp.float32), **attrs))


@pytest.mark.parametrize(
  "attr,value", [("r", 2**33), ("group_u", 2**40), ("group_v", -16), ("layout", 2**40)]
)
def test_ffi_xuv_attributes_are_range_checked(rng, attr, value):
  layout = "x86_vnni"
  _, _, wu, su = _weights(rng, 64, 16, 32, layout)
  _, _, wv, sv = _weights(rng, 16, 24, 0, layout)
  cpu_lowering.extension()
  attrs = dict(k=64, r=16, n=24, group_u=32, group_v=0, layout=0)
  attrs[attr] = value
  call = jax.ffi.ffi_call(
    "lrjax_w4a8_xuv", jax.ShapeDtypeStruct((3, 24), jnp.float32), vmap_method="broadcast_all"
  )
  x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
  ok = dict(k=64, r=16, n=24, group_u=32, group_v=0, layout=0)
  b = jnp.zeros((0,), jnp.float32)  # no bias, no scale
  ok = {a: np.int64(v) for a, v in ok.items()}
  assert call(x, wu, su, wv, sv, b, b, **ok).shape == (3, 24)
  with pytest.raises(Exception, match=f"attribute {attr}={value} is outside"):
    jax.block_until_ready(
      call(x, wu, su, wv, sv, b, b, **{a: np.int64(v) for a, v in attrs.items()})
    )
  with pytest.raises(Exception, match=r"rank-space scale shape \(15,\) must be \(16,\)"):
    jax.block_until_ready(call(x, wu, su, wv, sv, b, jnp.ones((15,), jnp.float32), **ok))


_THREADS_SCRIPT = textwrap.dedent(
  """
  import time, jax, jax.numpy as jnp, numpy as np
  from lrjax.custom_calls.cpu import lowering
  from lrjax.lowering import quantized as Q
  from lrjax.quant import pack
  q, s = pack.quantize_int4(np.ones((64, 16), np.float32), 32)
  w, sp = jnp.asarray(pack.pack_int4(q, "x86_vnni")), jnp.asarray(pack.pad_scales(s, "x86_vnni"))
  t = time.perf_counter()
  y = jax.jit(lambda x: Q.w4a8_matmul(x, w, sp, n=16, group=32, layout="x86_vnni"))(
    jnp.ones((64, 64), jnp.float32))
  y.block_until_ready()
  print(lowering.extension().num_threads(), time.perf_counter() - t)
  """
)


def _run_with_threads(value: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, LRJAX_W4A8_THREADS=value, JAX_PLATFORMS="cpu")
  return subprocess.run(
    [sys.executable, "-c", _THREADS_SCRIPT], env=env, capture_output=True, text=True, timeout=300
  )


def test_huge_thread_count_is_capped_at_the_hardware_threads():
  t0 = time.perf_counter()
  p = _run_with_threads("100000")
  assert p.returncode == 0, p.stderr[-2000:]
  threads, _ = p.stdout.split()
  assert 1 <= int(threads) <= (os.cpu_count() or 1)
  assert "exceeds" in p.stderr
  assert time.perf_counter() - t0 < 60


@pytest.mark.parametrize("value", ["abc", "0", "-2", "4 threads", "1.5"])
def test_malformed_thread_count_is_a_clear_error(monkeypatch, value):
  monkeypatch.setenv("LRJAX_W4A8_THREADS", value)
  with pytest.raises(ValueError, match="LRJAX_W4A8_THREADS=.* is not a positive integer"):
    cpu_lowering.extension()
  n, warning = _raw_extension().threads_for(value, 8)
  assert n == 8 and "not a positive integer" in warning


def _raw_extension():
  from lrjax.custom_calls.cpu import _w4a8

  return _w4a8


def test_thread_count_within_the_hardware_is_honoured(monkeypatch):
  monkeypatch.setenv("LRJAX_W4A8_THREADS", "1")
  assert cpu_lowering.check_threads_env() == 1
  assert _raw_extension().threads_for("1", 2) == (1, "")
  assert _raw_extension().threads_for(None, 2) == (2, "")


@pytest.mark.parametrize("value", ["abc", "-1", "+5", "1.5", "1000001"])
def test_malformed_spin_is_a_clear_error(monkeypatch, value):
  monkeypatch.setenv("LRJAX_W4A8_SPIN_US", value)
  with pytest.raises(ValueError, match="LRJAX_W4A8_SPIN_US=.* is not an integer from 0 to"):
    cpu_lowering.extension()
  us, warning = _raw_extension().spin_us_for(value)
  assert us == 200 and "not an integer" in warning


def test_spin_setting_is_honoured(monkeypatch):
  monkeypatch.setenv("LRJAX_W4A8_SPIN_US", "0")
  assert cpu_lowering.check_spin_env() == 0
  assert _raw_extension().spin_us_for("0") == (0, "")
  assert _raw_extension().spin_us_for(None) == (200, "")


_SPIN_SCRIPT = textwrap.dedent(
  """
  import sys, jax, jax.numpy as jnp, numpy as np
  from lrjax.lowering import quantized as Q
  from lrjax.quant import pack
  rng = np.random.default_rng(0)
  ws = []
  for k, n in ((256, 96), (96, 1000)):
    q, s = pack.quantize_int4(rng.standard_normal((k, n)).astype(np.float32), 32)
    ws += [jnp.asarray(pack.pack_int4(q, "x86_vnni")), jnp.asarray(pack.pad_scales(s, "x86_vnni"))]
  x = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)

  def chain(x):  # calls one after another, each its own parallel GEMMs
    for _ in range(20):
      y = Q.lr_xuv_w4a8(x, *ws, r=96, n=1000, group_u=32, group_v=32, layout="x86_vnni")
      x = x + y[:, :256] * 1e-3
    return x

  sys.stdout.write(np.asarray(jax.jit(chain)(x)).tobytes().hex())
  """
)


def test_results_do_not_depend_on_the_pools_spin():
  """The pool's threads spinning for the next task (the default) or sleeping at once
  (LRJAX_W4A8_SPIN_US=0), two threads or one: the same bits from a chain of fused calls."""
  outs = []
  for spin, threads in (("0", "2"), ("200", "2"), ("100000", "2"), ("0", "1")):
    env = dict(os.environ, LRJAX_W4A8_SPIN_US=spin, LRJAX_W4A8_THREADS=threads, JAX_PLATFORMS="cpu")
    p = subprocess.run(
      [sys.executable, "-c", _SPIN_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-2000:]
    outs.append(p.stdout)
  assert len(outs[0]) == 3 * 256 * 8 and len(set(outs)) == 1
