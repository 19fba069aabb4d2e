"""Prefill + decode with the static KV cache equals the full forward; structure and hooks."""

import collections
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_key
from flax import nnx

from lrjax.models import (
  GROUPS,
  KVCache,
  LlamaForCausalLM,
  ModelConfig,
  decode_step,
  get_proj,
  layer_inputs,
  prefill_step,
  set_proj,
)
from lrjax.nn import Linear, LowRankLinear


def _model(cfg, ranks=None, scan=True):
  m = LlamaForCausalLM(
    cfg, ranks, rngs=nnx.Rngs(int(jax.random.randint(fresh_key(), (), 0, 2**30)))
  )
  # O(1) norm weights and biases so every param matters.
  for path, var in nnx.to_flat_state(nnx.state(m)):
    if path[-1] in ("weight", "bias"):
      var[...] = 1.0 + 0.3 * jax.random.normal(fresh_key(), var.shape)
  m.scan_layers = scan
  return m


_fwd = nnx.jit(lambda m, t: m(t))


def _tokens(b, s, vocab):
  return jax.random.randint(fresh_key(), (b, s), 0, vocab)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.max(np.abs(a - b)) / np.max(np.abs(b))


CONFIGS = {
  "gqa": ModelConfig.tiny(),
  "window_qknorm_bias": ModelConfig.tiny(
    model_type="qwen3", qk_norm=True, qkv_bias=True, sliding_window=3, tie_word_embeddings=True
  ),
  "mha_llama3_rope": ModelConfig.tiny(
    num_kv_heads=4,
    rope_scaling=(
      ("factor", 8.0),
      ("high_freq_factor", 4.0),
      ("low_freq_factor", 1.0),
      ("original_max_position_embeddings", 16),
      ("rope_type", "llama3"),
    ),
  ),
}


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_prefill_then_decode_equals_full_forward(cfg_name, scan):
  cfg = CONFIGS[cfg_name]
  m = _model(cfg, scan=scan)
  b, s, p = 2, 9, 4
  tok = _tokens(b, s, cfg.vocab_size)
  full = _fwd(m, tok)
  cache = KVCache.init(cfg, b, 12)
  logits, cache = prefill_step(m, tok[:, :p], cache)
  assert _rel(logits, full[:, :p]) <= 1e-5
  assert np.array_equal(np.asarray(cache.pos), [p, p])
  for t in range(p, s):
    step, cache = decode_step(m, tok[:, t], cache)
    assert _rel(step, full[:, t]) <= 1e-5, t


def test_cached_partial_decode_loop_matches():
  """The README's token loop: ``nnx.cached_partial(decode_step, model)`` walks the graph once."""
  from flax import nnx

  cfg = CONFIGS["gqa"]
  m = _model(cfg, scan=False)
  tok = _tokens(2, 8, cfg.vocab_size)
  full = _fwd(m, tok)
  _, cache = prefill_step(m, tok[:, :3], KVCache.init(cfg, 2, 10))
  step = nnx.cached_partial(decode_step, m)
  for t in range(3, 8):
    logits, cache = step(tok[:, t], cache)
    assert _rel(logits, full[:, t]) <= 1e-5, t


def test_decode_over_the_first_attend_len_positions_matches():
  """attend_len reads a prefix of the cache: same logits and cache as the whole cache; a row
  past it, or a bad attend_len, is an error (checked when pos is concrete)."""
  from lrjax.models.llama import KVCache as KV
  from lrjax.serving import lowrank_kv
  from lrjax.sharding.analysis import compressed_ranks

  cfg = CONFIGS["gqa"]
  m = _model(cfg, [compressed_ranks(cfg, 0.4, 8)] * cfg.num_layers, scan=False)
  tok = _tokens(2, 6, cfg.vocab_size)
  _, cache = prefill_step(m, tok[:, :4], KV.init(cfg, 2, 32))
  full, c_full = m.decode(tok[:, 4], cache)
  part, c_part = m.decode(tok[:, 4], cache, attend_len=8)
  assert _rel(part, full) <= 1e-5
  assert np.array_equal(np.asarray(c_part.k), np.asarray(c_full.k))
  with pytest.raises(ValueError, match="past attend_len=4"):
    m.decode(tok[:, 4], cache, attend_len=4)
  for bad in (0, 33, 8.0, True):
    with pytest.raises(ValueError, match="must be a Python int"):
      m.decode(tok[:, 4], cache, attend_len=bad)
  lr = lowrank_kv.LowRankKVCache.init(m, 2, 32, jnp.float32)
  _, lr = lowrank_kv.prefill(m, tok[:, :4], lr)
  full, _ = lowrank_kv.decode(m, tok[:, 4], lr)
  part, _ = lowrank_kv.decode(m, tok[:, 4], lr, attend_len=8)
  assert _rel(part, full) <= 1e-5


def test_ragged_prefill_rows_continue_independently():
  cfg = CONFIGS["gqa"]
  m = _model(cfg)
  tok = _tokens(2, 8, cfg.vocab_size)
  lengths = jnp.array([5, 3], jnp.int32)
  cache = KVCache.init(cfg, 2, 10)
  _, cache = prefill_step(m, tok[:, :5], cache, lengths)
  # Row 0 continues with tok[0, 5], row 1 with tok[1, 3]: each equals its own full forward.
  step, cache = decode_step(m, jnp.stack([tok[0, 5], tok[1, 3]]), cache)
  assert _rel(step[0], _fwd(m, tok[:1, :6])[0, -1]) <= 1e-5
  assert _rel(step[1], _fwd(m, tok[1:, :4])[0, -1]) <= 1e-5
  assert np.array_equal(np.asarray(cache.pos), [6, 4])


def test_decode_donates_cache():
  cfg = CONFIGS["gqa"]
  m = _model(cfg)
  cache = KVCache.init(cfg, 1, 6)
  old = cache.k + cache.v
  _, cache = prefill_step(m, _tokens(1, 2, cfg.vocab_size), cache)
  assert all(a.is_deleted() for a in old)
  old = cache.k + cache.v
  _, cache = decode_step(m, _tokens(1, 1, cfg.vocab_size)[:, 0], cache)
  assert all(a.is_deleted() for a in old)


def test_heterogeneous_low_rank_model_decodes_and_loops():
  cfg = CONFIGS["gqa"]
  ranks = [{"q_proj": 8, "down_proj": 16}, {"gate_proj": 24, "v_proj": 4}]
  m = _model(cfg, ranks)
  assert m.layer_ranks() == ranks and not m.homogeneous()
  assert isinstance(m.layers[0].attn.q_proj, LowRankLinear)
  assert isinstance(m.layers[1].attn.q_proj, Linear)
  tok = _tokens(2, 6, cfg.vocab_size)
  full = _fwd(m, tok)
  cache = KVCache.init(cfg, 2, 6)
  _, cache = prefill_step(m, tok[:, :5], cache)
  step, _ = decode_step(m, tok[:, 5], cache)
  assert _rel(step, full[:, 5]) <= 1e-5


def test_layer_inputs_are_the_projection_inputs():
  cfg = CONFIGS["window_qknorm_bias"]
  m = _model(cfg, scan=False)
  tok = _tokens(2, 5, cfg.vocab_size)
  seen = []
  for i, xs in layer_inputs(m, tok):
    seen.append(i)
    assert set(xs) == set(GROUPS)
    want = {
      "qkv": cfg.hidden_size,
      "o": cfg.q_dim,
      "gate_up": cfg.hidden_size,
      "down": cfg.intermediate_size,
    }
    assert {g: x.shape for g, x in xs.items()} == {g: (10, k) for g, k in want.items()}
    if i == 0:
      x0 = m.layers[0].input_layernorm(m.embed(tok)).reshape(10, -1)
      assert _rel(xs["qkv"], x0) <= 1e-6
    mlp = m.layers[i].mlp
    down_in = jax.nn.silu(mlp.gate_proj(xs["gate_up"])) * mlp.up_proj(xs["gate_up"])
    assert _rel(xs["down"], down_in) <= 1e-5
  assert seen == [0, 1]


def test_layer_inputs_see_replacements_sequentially():
  cfg = CONFIGS["gqa"]
  m = _model(cfg)
  tok = _tokens(1, 6, cfg.vocab_size)
  base = [xs["qkv"] for _, xs in layer_inputs(m, tok)]
  gen = layer_inputs(m, tok)
  _, first = next(gen)
  old = get_proj(m, 0, "down_proj")
  set_proj(m, 0, "down_proj", LowRankLinear.from_dense(old.kernel[...], 4, axes=old.axes))
  _, second = next(gen)
  assert _rel(first["qkv"], base[0]) == 0
  assert _rel(second["qkv"], base[1]) > 1e-3


def test_set_proj_rejects_wrong_shape_and_bias():
  cfg = ModelConfig.tiny(qkv_bias=True)
  m = _model(cfg)
  with pytest.raises(ValueError, match=r"\(in, out\)=\(64, 64\) must be \(64, 32\)"):
    set_proj(m, 0, "k_proj", LowRankLinear(64, 64, 8, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="bias"):
    set_proj(m, 0, "k_proj", LowRankLinear(64, 32, 8, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="not a projection"):
    get_proj(m, 0, "w_proj")
  with pytest.raises(ValueError, match="layer=2"):
    get_proj(m, 2, "q_proj")


def test_bad_tokens_and_cache_are_rejected():
  cfg = CONFIGS["gqa"]
  m = _model(cfg)
  with pytest.raises(ValueError, match=r"\[batch, seq\] integers"):
    m(jnp.ones((2, 3, 1), jnp.int32))
  with pytest.raises(ValueError, match="do not fit"):
    m.prefill(_tokens(1, 7, cfg.vocab_size), KVCache.init(cfg, 1, 4))
  with pytest.raises(ValueError, match="KVCache.init"):
    m.decode(_tokens(2, 1, cfg.vocab_size)[:, 0], KVCache.init(cfg, 1, 4))


def test_logical_axes_on_every_param():
  cfg = ModelConfig.tiny(qk_norm=True, model_type="qwen3")
  m = LlamaForCausalLM(cfg, [{"o_proj": 8}, {}], rngs=nnx.Rngs(0))
  allowed = {"embed", "heads", "kv_heads", "mlp", "vocab", "rank", None}
  for path, var in nnx.to_flat_state(nnx.state(m)):
    axes = var.get_metadata()["out_sharding"]
    assert len(axes) == var.ndim and set(axes) <= allowed, path
  assert m.layers[0].attn.o_proj.u.get_metadata()["out_sharding"] == ("heads", "rank")
  assert m.layers[0].attn.k_proj.kernel.get_metadata()["out_sharding"] == ("embed", "kv_heads")


def test_compression_record_keeps_graphdef_hashable():
  m = _model(CONFIGS["gqa"])
  m.compression = {"method": "svd", "ranks": [{"q_proj": 8}]}
  m.compression["lora"] = {"steps": 2}
  graphdef, state = nnx.split(m)
  hash(graphdef)
  back = nnx.merge(graphdef, state)
  assert back.compression == {"method": "svd", "ranks": [{"q_proj": 8}], "lora": {"steps": 2}}


@pytest.mark.parametrize("attend_len", [None, 8])
def test_decode_reads_each_layer_cache_where_it_lies(attend_len):
  """One buffer per layer: a decode step hands each layer's k and v buffers to one
  decode_attention_append (RoPE, the writes in place, attention), whose reference writes them
  with a scatter each and reads them with one decode_attention; a stacked [layers, ...] cache
  was sliced per layer, and XLA:GPU copied every slice (two memcpys a layer). An
  ``attend_len`` shorter than the cache bounds the keys without slicing the buffers."""
  cfg = CONFIGS["gqa"]
  m = _model(cfg)
  cache = KVCache.init(cfg, 2, 16)
  assert len(cache.k) == len(cache.v) == cfg.num_layers
  assert all(a.shape == (2, cfg.num_kv_heads, 16, cfg.head_dim) for a in cache.k + cache.v)
  jaxpr = jax.make_jaxpr(lambda c: m.decode(jnp.zeros((2,), jnp.int32), c, attend_len))(cache)
  buf = cache.k[0].shape
  readers = collections.Counter(
    str(e.primitive)
    for e in jaxpr.jaxpr.eqns
    if any(getattr(v, "aval", None) is not None and v.aval.shape == buf for v in e.invars)
  )
  assert readers == {"decode_attention_append": cfg.num_layers}
  from lrjax.lowering.decode_attention import decode_attention_append_reference

  q = jnp.zeros((2, cfg.num_heads, cfg.head_dim))
  new = jnp.zeros((2, cfg.num_kv_heads, cfg.head_dim))
  tab = jnp.zeros((2, cfg.head_dim))
  ref = jax.make_jaxpr(lambda *a: decode_attention_append_reference(*a, length=attend_len))(
    q, new, new, cache.k[0], cache.v[0], cache.pos, tab, tab
  )
  inner = collections.Counter(
    str(e.primitive)
    for e in ref.jaxpr.eqns
    if any(getattr(v, "aval", None) is not None and v.aval.shape == buf for v in e.invars)
  )
  assert inner == {"scatter": 2, "decode_attention": 1}
