"""lrjax.quant: packing round trips, quantize(model) and the custom call in the HLO."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, randn
from flax import nnx

import lrjax
from lrjax.custom_calls.cpu import lowering as cpu_lowering
from lrjax.lowering import quantized as Q
from lrjax.nn import Linear, LowRankLinear, LowRankMLP
from lrjax.quant import (
  QuantizedLinear,
  QuantizedLowRankLinear,
  fused_xuv_params,
  pack,
  quantize,
  quantize_weight,
)

needs_ext = pytest.mark.skipif(
  not cpu_lowering.extension_available(),
  reason="the W4A8 C++ extension is not built (pip install -e .)",
)


@pytest.mark.parametrize("layout", sorted(Q.LAYOUTS))
@pytest.mark.parametrize("k,n", [(8, 4), (13, 5), (100, 37), (64, 128)])
def test_pack_unpack_round_trip(rng, layout, k, n):
  q = rng.integers(-8, 8, size=(k, n)).astype(np.int8)
  packed = pack.pack_int4(q, layout)
  assert packed.shape == Q.packed_shape(k, n, layout) and packed.dtype == np.uint8
  np.testing.assert_array_equal(np.asarray(Q.unpack_int4(jnp.asarray(packed), k, n, layout)), q)


@pytest.mark.parametrize("group", [0, 32, 64, 128])
def test_quantize_int4_error_bound(rng, group):
  k, n = 200, 48
  w = rng.standard_t(4, (k, n)).astype(np.float32)
  q, s = pack.quantize_int4(w, group)
  assert q.min() >= -8 and q.max() <= 7 and q.dtype == np.int8
  deq = pack.dequantize_int4(q, s, group)
  grp = k if group == 0 else group
  step = np.abs(np.repeat(s, grp, axis=0)[:k])
  inside = (q > -8) & (q < 7)  # not clipped: round to nearest, half a step
  assert np.all(np.abs(deq - w)[inside] <= step[inside] / 2 * (1 + 1e-6) + 1e-7)
  # Per group, never worse than plain abs-max / 7 (one of the candidates), and better overall.
  amax = np.abs(np.pad(w, ((0, -k % grp), (0, 0))).reshape(-1, grp, n)).max(axis=1)
  s7 = np.repeat(np.where(amax > 0, amax / 7, 1), grp, axis=0)[:k]
  deq7 = np.clip(np.rint(w / s7), -8, 7) * s7
  per_group = lambda e: np.pad(e, ((0, -k % grp), (0, 0))).reshape(-1, grp, n).sum(axis=1)
  e, e7 = per_group((deq - w) ** 2), per_group((deq7 - w) ** 2)
  assert np.all(e <= e7 * (1 + 1e-5) + 1e-12)
  assert e.sum() < 0.9 * e7.sum()


def test_quantize_int4_beats_q4_0_on_gaussian_weights(rng):
  # llama.cpp Q4_0 (group 32, scale = signed max / -8) is one of the candidates.
  w = rng.standard_normal((512, 256)).astype(np.float32)
  q, s = pack.quantize_int4(w, 32)
  b = w.reshape(16, 32, 256)
  mx = np.take_along_axis(b, np.abs(b).argmax(axis=1)[:, None], axis=1)
  d = mx / -8
  q40 = (np.clip(np.rint(b / d), -8, 7) * d).reshape(512, 256)
  err = np.linalg.norm(pack.dequantize_int4(q, s, 32) - w)
  assert err < 0.97 * np.linalg.norm(q40 - w)


def test_quantize_int4_zero_and_wide_weights(rng):
  w = np.zeros((64, 40), np.float32)
  w[:, 3] = rng.standard_normal(64)
  q, s = pack.quantize_int4(w, 32)
  assert not q[:, np.arange(40) != 3].any()
  np.testing.assert_array_equal(pack.dequantize_int4(q, s, 32)[:, 4:], 0)
  wide = rng.standard_normal((16, 5000)).astype(np.float32)  # over one column chunk
  qw, sw = pack.quantize_int4(wide, 8)
  parts = [pack.quantize_int4(wide[:, j : j + 1000], 8) for j in range(0, 5000, 1000)]
  np.testing.assert_array_equal(qw, np.concatenate([p[0] for p in parts], axis=1))
  np.testing.assert_array_equal(sw, np.concatenate([p[1] for p in parts], axis=1))


class _Net(nnx.Module):
  def __init__(self, *, rngs):
    self.proj = LowRankLinear(96, 80, 24, use_bias=True, rngs=rngs)
    self.mlp = LowRankMLP(80, 160, (32, 32, 40), gated=True, rngs=rngs)
    self.head = Linear(80, 50, use_bias=True, rngs=rngs)

  def __call__(self, x):
    return self.head(self.mlp(self.proj(x)))


def _jit(model):
  graphdef, state = nnx.split(model)
  return jax.jit(lambda state, x: nnx.merge(graphdef, state)(x)), state


@needs_ext
def test_quantize_model_emits_custom_calls_and_stays_close():
  model = _Net(rngs=nnx.Rngs(int(np.random.default_rng().integers(1 << 30))))
  for m in (model.proj, model.head):
    m.bias[...] = randn(m.bias.shape)
  qmodel = quantize(model, "w4a8", group=32)
  assert isinstance(qmodel.proj, QuantizedLowRankLinear)
  assert isinstance(qmodel.mlp.down_proj, QuantizedLowRankLinear)
  assert isinstance(qmodel.head, QuantizedLinear)
  assert isinstance(model.proj, LowRankLinear), "quantize must not modify its input"
  x = randn((3, 5, 96))
  f, state = _jit(qmodel)
  hlo = f.lower(state, x).compile().as_text()
  # 4 low-rank layers x 2 matmuls + 1 dense, each one W4A8 custom call, no fusion pass.
  assert hlo.count('custom_call_target="lrjax_w4a8_matmul"') == 9, hlo.count("lrjax_w4a8")
  y = f(state, x)
  ref = model(x)
  assert y.shape == ref.shape == (3, 5, 50)
  err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
  # Symmetric int4 (7 levels, group 32) costs ~0.09 relative error per matmul; 9 in series.
  assert err < 0.4, err
  with lrjax.lowering.force_reference():
    fr, _ = _jit(qmodel)
    yr = fr(state, x)
  # Kernel and reference agree to f32 rounding per matmul (tests/custom_calls/cpu), but each
  # of the 9 chained layers re-quantizes its input to int8: an f32-level difference can move
  # an activation across a rounding boundary, one int8 step (1/127 of the row's max), which
  # later layers carry on. Measured over 150 seeds: up to 2.2e-3 relative (4 seeds above
  # the old 1e-4 bound); a wrong scale, group or layout costs O(0.1).
  assert_close(y, yr, jnp.float32, factor=1000)


@needs_ext
@pytest.mark.parametrize("group", [0, 64])
def test_quantized_low_rank_nmse_vs_f64(group):
  m = LowRankLinear(256, 192, 64, rngs=nnx.Rngs(int(np.random.default_rng().integers(1 << 30))))
  ql = QuantizedLowRankLinear.from_low_rank(m, group)
  u = ql_weight(ql, "u")
  v = ql_weight(ql, "v")
  x = np.asarray(randn((8, 256)), np.float64)
  ref = (x @ u) @ v
  y = np.asarray(jax.jit(lambda x: ql(x))(jnp.asarray(x, jnp.float32)), np.float64)
  nmse = np.mean((y - ref) ** 2) / np.mean(ref**2)
  assert nmse <= 5e-4, nmse


def ql_weight(ql, name):
  k, n, group, layout = getattr(ql, f"{name}_meta")
  q = np.asarray(Q.unpack_int4(getattr(ql, f"{name}_packed")[...], k, n, layout))
  return pack.dequantize_int4(q, np.asarray(getattr(ql, f"{name}_scales")[...]), group)


def test_quantize_rejects_bad_input():
  with pytest.raises(ValueError, match="scheme"):
    quantize(Linear(8, 8, rngs=nnx.Rngs(0)), "w8a8")
  with pytest.raises(ValueError, match="group"):
    quantize(Linear(8, 8, rngs=nnx.Rngs(0)), group=12)

  class Empty(nnx.Module):
    def __init__(self):
      self.scale = nnx.Param(jnp.ones(3))

  with pytest.raises(ValueError, match="no Linear"):
    quantize(Empty())


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quantize_rejects_non_finite_weights(rng, bad):
  w = rng.standard_normal((40, 12)).astype(np.float32)
  w[17, 5] = bad
  with pytest.raises(ValueError, match=r"1 NaN/inf values \(first at \[17, 5\]\)"):
    quantize_weight(w, 32)


def test_quantized_weight_dequantize(rng):
  w = rng.standard_normal((70, 30)).astype(np.float32)
  qw = quantize_weight(w, 32, "arm_smmla8")
  rel = np.linalg.norm(qw.dequantize() - w) / np.linalg.norm(w)
  assert rel < 0.12, rel


def test_fused_xuv_params_from_chain(rng):
  # The jaxpr of a quantized low-rank layer is the documented two-eqn pattern.
  m = LowRankLinear(64, 40, 16, use_bias=True, rngs=nnx.Rngs(0))
  ql = QuantizedLowRankLinear.from_low_rank(m, 32)
  x = randn((2, 64))
  closed = jax.make_jaxpr(lambda x: ql(x))(x)
  jaxpr = closed.jaxpr
  eqns = [e for e in jaxpr.eqns if e.primitive is Q.w4a8_matmul_p]
  assert len(eqns) == 2 and eqns[0].outvars[0] is eqns[1].invars[0]
  params = fused_xuv_params(eqns[0].params, eqns[1].params, has_bias=True)
  consts = dict(zip(jaxpr.constvars, closed.consts))
  val = lambda v: consts[v] if v in consts else v.val  # closed-over consts or literals
  wu, su = (val(v) for v in eqns[0].invars[1:])
  wv, sv, b = (val(v) for v in eqns[1].invars[1:])
  fused = Q.lr_xuv_w4a8(
    x, wu, su, wv, sv, b, **{k: v for k, v in params.items() if k != "has_bias"}
  )
  assert_close(fused, ql(x), jnp.float32)
  with pytest.raises(ValueError, match="bias"):
    fused_xuv_params(dict(eqns[0].params, has_bias=True), eqns[1].params, has_bias=True)


@needs_ext
def test_fuse_turns_quantized_low_rank_into_one_xuv_call():
  m = LowRankLinear(256, 128, 64, use_bias=True, rngs=nnx.Rngs(0))
  m.bias[...] = randn((128,))
  q = quantize(m, group=64)
  x = randn((3, 256))
  hlo = jax.jit(lrjax.fuse(q)).lower(x).compile().as_text()
  assert hlo.count('custom_call_target="lrjax_w4a8_xuv"') == 1
  assert 'custom_call_target="lrjax_w4a8_matmul"' not in hlo
  assert_close(jax.jit(lrjax.fuse(q))(x), q(x), jnp.float32)


@needs_ext
@pytest.mark.parametrize("tied_head", [True, False])
def test_quantize_tied_lm_head(tied_head):
  from lrjax.models import LlamaForCausalLM, ModelConfig

  cfg = ModelConfig.tiny(tie_word_embeddings=True, vocab_size=200)
  model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(int(np.random.default_rng().integers(1 << 30))))
  q = quantize(model, "w4a8", group=32, tied_head=tied_head)
  assert model.lm_head is None  # the original is untouched
  assert (q.lm_head is not None) == tied_head
  if tied_head:
    assert isinstance(q.lm_head, QuantizedLinear) and q.lm_head.meta[:2] == (64, 200)
    np.testing.assert_array_equal(q.embed.embedding[...], model.embed.embedding[...])
    h = randn((5, 64))
    head, ref = np.asarray(q.lm_head(h)), np.asarray(model.embed.attend(h))
    assert np.linalg.norm(head - ref) / np.linalg.norm(ref) < 0.12
  tokens = jnp.asarray(np.random.default_rng().integers(0, 200, (2, 9)), jnp.int32)
  q.scan_layers = False
  f, state = _jit(q)
  hlo = f.lower(state, tokens).compile().as_text()
  # 7 projections per layer, 2 layers, (+ the head)
  assert hlo.count('custom_call_target="lrjax_w4a8_matmul"') == 14 + tied_head
  y, ref = np.asarray(f(state, tokens)), np.asarray(model(tokens))
  assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.5  # 14-15 int4 layers in series
