"""The CPU decode-attention FFI kernel (custom_calls/cpu/decode_attention.cc, and its AVX2 body
decode_attention_x86_avx2.cc) against the primitive's reference on fresh random inputs, each
body the CPU has: awkward head counts and dims, lengths short of the buffer and past the
bodies' blocks, windows, positions before, inside and past the attended keys, scores far
apart and NaN; its registry choice; its refusals; the FFI's shape checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_body_env, cpu_kernel_bodies
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lrjax.custom_calls.cpu import decode_attention as C
from lrjax.custom_calls.cpu import lowering as cpu_lowering
from lrjax.lowering.decode_attention import decode_attention, decode_attention_reference
from lrjax.lowering import registry

pytestmark = pytest.mark.skipif(
  not cpu_lowering.extension_available(),
  reason="the CPU C++ extension is not built (pip install -e .)",
)

# per dtype (rtol, atol): f32 sums in another order than XLA's dots
TOL = {"float32": (2e-5, 2e-6)}

# (B, Hq, Hkv, D, T, length, window): G = 1, 4, 7; D under 8, not a multiple of 8, 128;
# D = 40 (the AVX2 body's 32-wide then 8-wide accumulators) over 290 keys (64-key blocks);
# 2.5 MiB of K and V (past 1 MiB the kernel's tasks run on the thread pool)
SHAPES = [
  (1, 32, 8, 64, 256, 128, None),
  (2, 16, 4, 64, 640, 620, None),
  (2, 14, 2, 40, 300, 290, None),
  (3, 7, 1, 100, 40, 33, None),
  (2, 4, 4, 3, 20, 20, None),
  (2, 8, 2, 128, 64, 64, 5),
  (4, 6, 3, 24, 50, 20, 7),
  (1, 2, 1, 16, 1, 1, None),
]


def _inputs(rng, b, hq, hkv, d, t, pos):
  q = jnp.asarray(rng.standard_normal((b, hq, d)) * 2, jnp.float32)
  k = jnp.asarray(rng.standard_normal((b, hkv, t, d)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((b, hkv, t, d)), jnp.float32)
  return q, k, v, jnp.asarray(pos, jnp.int32)


BODIES = cpu_kernel_bodies(lambda ext: ext.attention_isa(8))


def _check(q, k, v, pos, window, length):
  got = jax.jit(lambda *a: C.decode_attention(*a, window=window, length=length))(q, k, v, pos)
  want = jax.jit(lambda *a: decode_attention_reference(*a, window=window, length=length))(
    q, k, v, pos
  )
  rtol, atol = TOL[str(q.dtype)]
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=atol)


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_the_reference(shape, body, rng):
  from lrjax.custom_calls.cpu import _w4a8

  b, hq, hkv, d, t, length, window = shape
  with cpu_body_env(body):
    assert _w4a8.attention_isa(d) == (body if d % 8 == 0 else "scalar")
    # positions: none visible (-1), the first key, inside, the last attended, past length, T
    for pos in ([-1] * b, [0] * b, rng.integers(0, length, b), [length - 1] * b, [t + 3] * b):
      _check(*_inputs(rng, b, hq, hkv, d, t, pos), window, length)


@pytest.mark.parametrize("body", BODIES)
def test_far_apart_and_nan_scores_as_the_reference(body, rng):
  """Scores hundreds apart (most exps underflow to 0) and a NaN query head: NaN for that
  head only, as jax.nn.softmax gives."""
  b, hq, hkv, d, t = 2, 8, 2, 64, 77
  q, k, v, pos = _inputs(rng, b, hq, hkv, d, t, [76, 40])
  with cpu_body_env(body):
    # scores of size ~100 carry f32 rounding of ~1e-5 into each weight, in either order
    got = jax.jit(lambda *a: C.decode_attention(*a, length=t))(q * 60, k, v, pos)
    want = decode_attention_reference(q * 60, k, v, pos, length=t)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    qn = q.at[1, 3, 5].set(jnp.nan)
    got = np.asarray(jax.jit(lambda *a: C.decode_attention(*a, length=t))(qn, k, v, pos))
    want = np.asarray(decode_attention_reference(qn, k, v, pos, length=t))
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got[1, 3 * d]).all()
    np.testing.assert_allclose(got, want, *TOL["float32"])


@pytest.mark.parametrize("body", BODIES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
  b=st.integers(1, 3),
  hkv=st.integers(1, 3),
  g=st.integers(1, 5),
  d=st.one_of(st.integers(1, 40), st.sampled_from([8, 16, 24, 32, 40, 48, 56, 64, 72, 128])),
  t=st.one_of(st.integers(1, 48), st.integers(60, 140)),
  data=st.data(),
)
def test_kernel_matches_the_reference_on_any_shape(body, b, hkv, g, d, t, data):
  length = data.draw(st.integers(1, t))
  window = data.draw(st.one_of(st.none(), st.integers(1, t + 2)))
  pos = data.draw(st.lists(st.integers(-2, t + 2), min_size=b, max_size=b))
  seed = data.draw(st.integers(0, 2**31 - 1))
  with cpu_body_env(body):
    _check(*_inputs(np.random.default_rng(seed), b, hkv * g, hkv, d, t, pos), window, length)


def test_the_primitive_lowers_to_the_kernel_on_cpu(rng):
  q, k, v, pos = _inputs(rng, 2, 8, 2, 64, 96, [10, 70])
  sel = registry.select("decode_attention", "cpu", [jax.typeof(x) for x in (q, k, v, pos)],
                        {"window": None, "length": 80})  # fmt: skip
  assert sel.kernel is not None and sel.kernel.name == "cpu.decode_attention"
  hlo = jax.jit(lambda *a: decode_attention(*a, length=80)).lower(q, k, v, pos).as_text()
  assert C.TARGET in hlo
  got = jax.jit(lambda *a: decode_attention(*a, length=80))(q, k, v, pos)
  want = decode_attention_reference(q, k, v, pos, length=80)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


def test_refusals_name_why(monkeypatch):
  f32 = jax.ShapeDtypeStruct((1, 4, 2, 8), jnp.float32)
  q32 = jax.ShapeDtypeStruct((1, 4, 8), jnp.float32)
  bf = jax.ShapeDtypeStruct((1, 4, 8), jnp.bfloat16)
  assert C.supports([q32, f32, f32], {"length": None}) is None
  assert "float32" in C.supports([bf, f32, f32], {"length": None})
  big = jax.ShapeDtypeStruct((64, 8, 8192, 128), jnp.float32)
  assert C.supports([q32, big, big], {"length": 8192}) is None  # any size: it streams K, V once
  monkeypatch.setenv(C.ENV, "0")
  assert C.ENV in C.supports([q32, f32, f32], {"length": None})
  with pytest.raises(ValueError, match=C.ENV):
    C.decode_attention(jnp.zeros((1, 4, 8)), jnp.zeros((1, 2, 4, 8)), jnp.zeros((1, 2, 4, 8)),
                       jnp.zeros((1,), jnp.int32))  # fmt: skip


@pytest.mark.parametrize(
  "shapes, match",
  [
    (((1, 4, 8), (1, 3, 4, 8), (1, 3, 4, 8), (1,)), "Hkv dividing Hq"),
    (((1, 4, 8), (1, 2, 4, 8), (1, 2, 5, 8), (1,)), "must equal k's"),
    (((2, 4, 8), (2, 2, 4, 8), (2, 2, 4, 8), (3,)), r"pos \(3,\) must be \[B=2\]"),
  ],
)
def test_the_ffi_call_checks_its_shapes(shapes, match):
  impl = C.load()
  q, k, v, pos = (jnp.zeros(s, jnp.int32 if len(s) == 1 else jnp.float32) for s in shapes)
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(impl(q, k, v, pos, window=None, length=None))


def test_the_ffi_call_checks_length_and_window():
  impl = C.load()
  q, k = jnp.zeros((1, 4, 8)), jnp.zeros((1, 2, 4, 8))
  pos = jnp.zeros((1,), jnp.int32)
  with pytest.raises(Exception, match=r"length=5 must be in \[1, T=4\]"):
    jax.block_until_ready(impl(q, k, k, pos, window=None, length=5))
  with pytest.raises(Exception, match="window=-1"):
    jax.block_until_ready(impl(q, k, k, pos, window=-1, length=4))
