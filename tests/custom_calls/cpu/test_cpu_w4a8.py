"""The C++ W4A8 XLA FFI kernels against their jnp references and exact products."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, randn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lrjax
from lrjax.custom_calls.cpu import lowering as cpu_lowering
from lrjax.lowering import quantized as Q
from lrjax.quant import pack

pytestmark = pytest.mark.skipif(
  not cpu_lowering.extension_available(),
  reason="the W4A8 C++ extension is not built (pip install -e .)",
)

LAYOUTS = ("x86_vnni", "arm_sdot4", "arm_smmla8")
# (M, K, N, group): M=1, K not a multiple of the group or of 8, N not a multiple of the tile.
# The last flag: with a bias.
SHAPES = [
  (1, 256, 64, 32, False),
  (1, 300, 70, 64, True),
  (3, 200, 45, 128, False),
  (17, 136, 33, 0, True),
  (6, 64, 130, 32, True),
  (40, 520, 96, 128, False),
]


def _weights(rng, k, n, group, layout):
  w = rng.standard_normal((k, n)).astype(np.float32)
  q, s = pack.quantize_int4(w, group)
  return q, s, jnp.asarray(pack.pack_int4(q, layout)), jnp.asarray(pack.pad_scales(s, layout))


def _kernel_and_reference(f, *args):
  assert "lrjax_w4a8" in jax.jit(f).lower(*args).compile().as_text()
  y = jax.jit(f)(*args)
  with lrjax.lowering.force_reference():
    ref = jax.jit(f)(*args)
  return np.asarray(y.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_matmul_matches_reference(rng, layout, shape):
  m, k, n, group, with_bias = shape
  _, _, w, s = _weights(rng, k, n, group, layout)
  x = randn((m, k))
  b = randn((n,)) if with_bias else None
  f = lambda x: Q.w4a8_matmul(x, w, s, b, n=n, group=group, layout=layout)
  y, ref = _kernel_and_reference(f, x)
  assert_close(y, ref, jnp.float32)


@pytest.mark.parametrize(
  "x_dtype,out_dtype",
  [(jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16)],
)
def test_matmul_bf16(rng, x_dtype, out_dtype):
  _, _, w, s = _weights(rng, 192, 80, 64, "x86_vnni")
  x = randn((2, 5, 192), x_dtype)
  f = lambda x: Q.w4a8_matmul(x, w, s, n=80, group=64, layout="x86_vnni", out_dtype=out_dtype)
  y, ref = _kernel_and_reference(f, x)
  assert y.shape == (2, 5, 80)
  assert_close(y, ref, out_dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_integer_part_is_exact(rng, layout):
  # Integer x with row abs-max 127 quantizes exactly (sa = 1); unit per-channel scales
  # make y the exact int product.
  m, k, n = 7, 1000, 37
  q = rng.integers(-8, 8, size=(k, n)).astype(np.int8)
  w = jnp.asarray(pack.pack_int4(q, layout))
  s = jnp.asarray(pack.pad_scales(np.ones((1, n), np.float32), layout))
  x = rng.integers(-127, 128, size=(m, k)).astype(np.float32)
  x[np.arange(m), rng.integers(0, k, size=m)] = 127
  y = jax.jit(lambda x: Q.w4a8_matmul(x, w, s, n=n, group=0, layout=layout))(jnp.asarray(x))
  exact = x.astype(np.int64) @ q.astype(np.int64)
  np.testing.assert_array_equal(np.asarray(y), exact.astype(np.float32))


@pytest.mark.parametrize("group", [0, 32, 64, 128])
def test_accuracy_vs_f64_dequantized(rng, group):
  # NMSE of W4A8 vs the f64 product with the same (dequantized) int4 weights.
  m, k, n = 16, 1000, 200
  q, s, w, sp = _weights(rng, k, n, group, pack.default_layout())
  x = rng.standard_normal((m, k))
  y = jax.jit(lambda x: Q.w4a8_matmul(x, w, sp, n=n, group=group, layout=pack.default_layout()))(
    jnp.asarray(x, jnp.float32)
  )
  ref = x @ pack.dequantize_int4(q, s, group)
  nmse = np.mean((np.asarray(y, np.float64) - ref) ** 2) / np.mean(ref**2)
  assert nmse <= 5e-4, nmse


def _isas():
  return cpu_lowering.extension().cpu_isas()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_isa_path_matches_scalar(rng, monkeypatch, layout):
  m, k, n, group = 9, 264, 100, 32
  _, _, w, s = _weights(rng, k, n, group, layout)
  x = randn((m, k))
  b = randn((n,))
  f = jax.jit(lambda x: Q.w4a8_matmul(x, w, s, b, n=n, group=group, layout=layout))
  monkeypatch.setenv("LRJAX_W4A8_ISA", "scalar")
  ref = np.asarray(f(x))
  ran = []
  for isa in _isas():
    monkeypatch.setenv("LRJAX_W4A8_ISA", isa)
    ran.append(cpu_lowering.extension().selected_isa(Q.LAYOUTS[layout]))
    np.testing.assert_array_equal(np.asarray(f(x)), ref, err_msg=f"{isa=}")
  assert "scalar" in ran


def test_xuv_fused_equals_chain(rng):
  m, k, r, n = 5, 300, 48, 90
  layout = pack.default_layout()
  _, _, wu, su = _weights(rng, k, r, 64, layout)
  _, _, wv, sv = _weights(rng, r, n, 0, layout)
  x, b = randn((m, k)), randn((n,))
  fused = lambda x: Q.lr_xuv_w4a8(
    x, wu, su, wv, sv, b, r=r, n=n, group_u=64, group_v=0, layout=layout
  )
  chain = lambda x: Q.w4a8_matmul(
    Q.w4a8_matmul(x, wu, su, n=r, group=64, layout=layout, out_dtype=jnp.float32),
    wv,
    sv,
    b,
    n=n,
    group=0,
    layout=layout,
  )
  y, ref = _kernel_and_reference(fused, x)
  assert_close(y, ref, jnp.float32)
  hlo = jax.jit(fused).lower(x).compile().as_text()
  assert hlo.count("lrjax_w4a8_xuv") >= 1 and "lrjax_w4a8_matmul" not in hlo
  assert_close(y, np.asarray(jax.jit(chain)(x)), jnp.float32)


def test_vmap_batches_activations(rng):
  _, _, w, s = _weights(rng, 96, 40, 32, "x86_vnni")
  x = randn((3, 4, 96))
  f = lambda x: Q.w4a8_matmul(x, w, s, n=40, group=32, layout="x86_vnni")
  y = jax.jit(jax.vmap(f))(x)
  assert_close(y, jax.jit(f)(x), jnp.float32)


def test_bad_shapes_raise_not_crash(rng):
  _, _, w, s = _weights(rng, 100, 30, 32, "x86_vnni")
  ext = cpu_lowering.extension()
  assert ext is not None
  call = lambda x, w, s, b: jax.ffi.ffi_call(
    "lrjax_w4a8_matmul", jax.ShapeDtypeStruct((2, 30), jnp.float32), vmap_method="broadcast_all"
  )(x, w, s, b, k=np.int64(100), n=np.int64(30), group=np.int64(32), layout=np.int64(0))
  x = randn((2, 100))
  ok = call(x, w, s, jnp.zeros((0,), jnp.float32))
  assert ok.shape == (2, 30)
  with pytest.raises(Exception, match="packed weight shape"):
    call(x, w[:, :5], s, jnp.zeros((0,), jnp.float32)).block_until_ready()
  with pytest.raises(Exception, match="scales shape"):
    call(x, w, s[:2], jnp.zeros((0,), jnp.float32)).block_until_ready()
  with pytest.raises(Exception, match="bias shape"):
    call(x, w, s, jnp.zeros((7,), jnp.float32)).block_until_ready()
  with pytest.raises(Exception, match="x shape"):
    call(randn((2, 99)), w, s, jnp.zeros((0,), jnp.float32)).block_until_ready()
  # The Python wrapper names the expected shapes before anything is lowered.
  with pytest.raises(ValueError, match="packed weight"):
    Q.w4a8_matmul(x, w[:1], s, n=30, group=32, layout="x86_vnni")
  with pytest.raises(ValueError, match="group"):
    Q.w4a8_matmul(x, w, s, n=30, group=12, layout="x86_vnni")


def test_unsupported_dtype_falls_back_with_reason(rng):
  _, _, w, s = _weights(rng, 64, 16, 32, "x86_vnni")
  x = randn((2, 64), jnp.float16)
  f = lambda x: Q.w4a8_matmul(x, w, s, n=16, group=32, layout="x86_vnni")
  assert "lrjax_w4a8" not in jax.jit(f).lower(x).compile().as_text()
  reason = cpu_lowering.KERNELS[0].supports(
    [jax.ShapeDtypeStruct(x.shape, x.dtype)], {"out_dtype": jnp.float16, "layout": "x86_vnni"}
  )
  assert "float16" in reason
  with lrjax.lowering.force_reference():
    ref = jax.jit(f)(x)
  assert_close(jax.jit(f)(x), ref, jnp.float16)


# ---- property tests: shapes, groups, dtypes and layouts drawn by hypothesis ----------------

FUZZ = settings(
  max_examples=25,
  derandomize=True,  # the same cases on every run and machine
  deadline=None,  # each case compiles
  suppress_health_check=[HealthCheck.too_slow],
)
FUZZ_DTYPES = (jnp.float32, jnp.bfloat16)


def _fuzz_x(data, rng, m, k, x_dtype):
  """[m, k] activations at a drawn scale; row 0 sometimes all zeros or below the quantized range
  (2^-96: computed in f32 over the dequantized weights)."""
  scale = data.draw(st.sampled_from((1e-3, 1.0, 1e3)), label="x scale")
  x = scale * rng.standard_normal((m, k)).astype(np.float32)
  row0 = data.draw(st.sampled_from(("plain", "zero", "tiny")), label="row 0")
  if row0 != "plain":
    x[0] = 0.0 if row0 == "zero" else 1e-31 * np.sign(x[0] + 1e-9)
  return jnp.asarray(x, x_dtype), row0


def _check_rows(y, ref, dtype, row0):
  assert_close(y, ref, dtype)
  if row0 != "plain":  # the special row on its own: the whole array's error would hide it
    assert_close(y[:1], ref[:1], dtype)


def _draw_case(data, dims):
  """(rng, layout, sizes of ``dims`` {name: max}, x dtype, out dtype, bias-or-None draw)."""
  rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1), label="seed"))
  layout = data.draw(st.sampled_from(LAYOUTS), label="layout")
  sizes = [data.draw(st.integers(1, hi), label=nm) for nm, hi in dims.items()]
  x_dtype, out_dtype = (data.draw(st.sampled_from(FUZZ_DTYPES), label=nm) for nm in ("x", "out"))

  def bias(n):
    with_bias = data.draw(st.booleans(), label="bias")
    return jnp.asarray(rng.standard_normal(n), jnp.float32) if with_bias else None

  return rng, layout, sizes, x_dtype, out_dtype, bias


@FUZZ
@given(data=st.data())
def test_matmul_matches_reference_on_drawn_shapes(data):
  rng, layout, (m, k, n), x_dtype, out_dtype, bias = _draw_case(data, {"M": 33, "K": 300, "N": 150})
  group = data.draw(st.sampled_from((0, 32, 64, 128)), label="group")
  _, _, w, s = _weights(rng, k, n, group, layout)
  b = bias(n)
  x, row0 = _fuzz_x(data, rng, m, k, x_dtype)
  f = lambda x: Q.w4a8_matmul(x, w, s, b, n=n, group=group, layout=layout, out_dtype=out_dtype)
  y, ref = _kernel_and_reference(f, x)
  _check_rows(y, ref, out_dtype, row0)


@FUZZ
@given(data=st.data())
def test_xuv_matches_reference_on_drawn_shapes(data):
  dims = {"M": 33, "K": 300, "r": 64, "N": 150}
  rng, layout, (m, k, r, n), x_dtype, out_dtype, bias = _draw_case(data, dims)
  gu, gv = (data.draw(st.sampled_from((0, 32, 64)), label=nm) for nm in ("group_u", "group_v"))
  _, _, wu, su = _weights(rng, k, r, gu, layout)
  _, _, wv, sv = _weights(rng, r, n, gv, layout)
  b = bias(n)
  scale = None
  if data.draw(st.booleans(), label="rank-space scale"):
    scale = jnp.asarray(rng.uniform(0.5, 2.0, r), jnp.float32)
  x, row0 = _fuzz_x(data, rng, m, k, x_dtype)
  f = lambda x: Q.lr_xuv_w4a8(
    x, wu, su, wv, sv, b, r=r, n=n, group_u=gu, group_v=gv, layout=layout, out_dtype=out_dtype,
    scale=scale,
  )  # fmt: skip
  y, ref = _kernel_and_reference(f, x)
  _check_rows(y, ref, out_dtype, row0)
