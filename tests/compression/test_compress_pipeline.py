"""Model-level compression: ranks, parameter counts, whitening, per-head GQA, LoRA, errors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from flax import nnx

from lrjax.compression import (
  ALL_PROJS,
  HeadwiseLowRankLinear,
  MLP_PROJS,
  compress,
  param_counts,
  plan_ranks,
  reconstruct,
)
from lrjax.compression.lora import (
  adapter_model,
  apply_adapters,
  init_adapters,
  lora_recover,
  module_paths,
  next_token_loss,
)
from lrjax.models import LlamaForCausalLM, ModelConfig, get_proj, layer_inputs
from lrjax.nn import Linear, LowRankLinear
from lrjax.quality.source import MarkovSource, SourceConfig

CFG = ModelConfig.tiny()  # hidden 64, MLP 128, 2 layers, 4 heads / 2 KV heads of 16, vocab 256
CFG1 = CFG.replace(num_layers=1)  # for the LoRA tests (compile time)


def _model(seed, cfg=CFG):
  return LlamaForCausalLM(cfg, rngs=nnx.Rngs(seed))


def _tokens(rng, n=8, s=24, vocab=CFG.vocab_size):
  return rng.integers(0, vocab, (n, s)).astype(np.int32)


@pytest.mark.parametrize("method", ["svd", "whiten"])
@pytest.mark.parametrize("ratio,block", [(0.2, 8), (0.35, 4)])
def test_ranks_block_aligned_and_param_counts_match_ratio(method, ratio, block, rng):
  m = _model(int(rng.integers(1 << 30)))
  before = param_counts(m)
  compress(m, ratio=ratio, calib_tokens=_tokens(rng), method=method, block=block, progress=False)
  rec = m.compression
  shapes = CFG.proj_shapes()
  total = 0
  for i, ranks in enumerate(rec["ranks"]):
    assert set(ranks) == set(ALL_PROJS)
    for p, r in ranks.items():
      k, n = shapes[p]
      mod = get_proj(m, i, p)
      assert isinstance(mod, LowRankLinear) and mod.rank == r and r % block == 0
      assert r * (k + n) <= (1 - ratio) * k * n < (r + block) * (k + n)
      total += r * (k + n)
  assert m.layer_ranks() == rec["ranks"]
  assert rec["params"]["compressed"] == total == param_counts(m)["actual"]
  assert rec["params"]["dense"] == before["actual"]
  assert rec["params"]["removed_fraction"] >= ratio
  assert np.isclose(rec["params"]["removed_fraction"], 1 - total / before["actual"])


def test_mlp_only_keeps_attention_dense(rng):
  m = _model(int(rng.integers(1 << 30)))
  compress(m, ratio=0.3, calib_tokens=_tokens(rng), block=8, mlp_only=True, progress=False)
  for i in range(CFG.num_layers):
    for p in ALL_PROJS:
      assert isinstance(get_proj(m, i, p), LowRankLinear if p in MLP_PROJS else Linear)
  assert all(set(r) == set(MLP_PROJS) for r in m.compression["ranks"])


def test_whitening_reduces_output_error_on_calibration_data(rng):
  seed = int(rng.integers(1 << 30))
  tok = _tokens(rng, n=16, s=32)
  dense = _model(seed)
  xs = next(layer_inputs(dense, tok))[1]  # layer-0 inputs of the dense model
  group = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "o_proj": "o",
    "gate_proj": "gate_up",
    "up_proj": "gate_up",
    "down_proj": "down",
  }
  errs = {}
  for method in ("svd", "whiten"):
    m = _model(seed)
    compress(m, ratio=0.4, calib_tokens=tok, method=method, block=8, progress=False)
    errs[method] = {}
    for p in ALL_PROJS:
      x = xs[group[p]]
      ref = get_proj(dense, 0, p)(x)
      errs[method][p] = float(jnp.linalg.norm(get_proj(m, 0, p)(x) - ref) / jnp.linalg.norm(ref))
  for p in ALL_PROJS:
    assert errs["whiten"][p] < errs["svd"][p], (p, errs)


def test_per_head_gqa(rng):
  m = _model(int(rng.integers(1 << 30)))
  dense_k = np.asarray(get_proj(m, 0, "k_proj").kernel[...])
  compress(m, ratio=0.3, calib_tokens=_tokens(rng), block=8, per_head=True, progress=False)
  q, k = get_proj(m, 0, "q_proj"), get_proj(m, 0, "k_proj")
  assert isinstance(q, HeadwiseLowRankLinear) and q.heads == CFG.num_heads
  assert isinstance(k, HeadwiseLowRankLinear) and k.heads == CFG.num_kv_heads
  assert k.v[...].shape == (CFG.num_kv_heads, k.rank // CFG.num_kv_heads, CFG.head_dim)
  assert m.compression["heads"][0] == {"q_proj": 4, "k_proj": 2, "v_proj": 2}
  # Per-head budget: H·r_h·(K + d) ≤ (1 − ratio)·K·N.
  assert k.rank * (CFG.hidden_size + CFG.head_dim) <= 0.7 * dense_k.size
  w = reconstruct(np.asarray(k.u[...]), np.asarray(k.v[...]))
  assert np.linalg.norm(w - dense_k) < np.linalg.norm(dense_k)
  logits = m(_tokens(rng, n=2, s=8))
  assert logits.shape == (2, 8, CFG.vocab_size) and bool(jnp.all(jnp.isfinite(logits)))


def _source_tokens(n, s, seed):
  return MarkovSource(SourceConfig(vocab=CFG.vocab_size, seed=1)).sample(n, s, seed)


def test_lora_reduces_loss_and_keeps_ranks(rng):
  m = _model(int(rng.integers(1 << 30)), CFG1)
  tok = _source_tokens(32, 24, int(rng.integers(1 << 30)))
  compress(m, ratio=0.5, calib_tokens=tok, block=8, progress=False)
  ranks = m.layer_ranks()
  before = float(next_token_loss(m, jnp.asarray(tok)))
  targets = [(i, p) for i in range(CFG1.num_layers) for p in ALL_PROJS]
  rec = lora_recover(m, targets, tok, steps=40, rank=4, lr=1e-2, batch=8, progress=False)
  after = float(next_token_loss(m, jnp.asarray(tok)))
  assert after < before - 0.05, (before, after)
  assert rec["loss_last"] < rec["loss_first"]
  assert m.layer_ranks() == ranks


def test_merged_model_equals_adapter_model(rng):
  m = _model(int(rng.integers(1 << 30)), CFG1)
  tok = _tokens(rng, n=4, s=16)
  compress(m, ratio=0.3, calib_tokens=tok, block=8, per_head=True, progress=False)
  targets = [(i, p) for i in range(CFG1.num_layers) for p in ALL_PROJS]
  ad = init_adapters(m, targets, 4, jax.random.key(int(rng.integers(1 << 30))))
  # Non-zero B so the adapters change the model.
  ad = [
    {
      k: (v if k.startswith("a") else 0.05 * jax.random.normal(jax.random.key(j), v.shape))
      for k, v in a.items()
    }
    for j, a in enumerate(ad)
  ]
  graphdef, state = nnx.split(m)
  with_adapters = adapter_model(graphdef, state, module_paths(m, targets), ad)(tok)
  plain = m(tok)
  apply_adapters(m, targets, ad)
  merged = m(tok)
  assert float(jnp.max(jnp.abs(with_adapters - plain))) > 1e-3
  assert_close(merged, with_adapters, jnp.float32, factor=10)


def test_compress_with_lora_records_settings(rng):
  m = _model(int(rng.integers(1 << 30)), CFG1)
  tok = _source_tokens(16, 24, int(rng.integers(1 << 30)))
  compress(
    m,
    ratio=0.4,
    calib_tokens=tok,
    block=8,
    mlp_only=True,
    lora_steps=5,
    lora_rank=2,
    lora_lr=1e-3,
    progress=False,
  )
  rec = m.compression
  assert rec["lora"]["steps"] == 5 and rec["lora"]["rank"] == 2 and rec["lora"]["merged"]
  assert rec["calibration"]["tokens"] == tok.size


@pytest.mark.parametrize("ratio", [0.0, 1.0, -0.2, 2.0])
def test_bad_ratio(ratio, rng):
  with pytest.raises(ValueError, match=r"\(0, 1\)"):
    compress(_model(0), ratio=ratio, calib_tokens=_tokens(rng), block=8, progress=False)


def test_rank_above_min_dims_in_model(rng):
  with pytest.raises(ValueError, match=r"layer 0 k_proj: rank=48 > min\(K, N\)=32"):
    compress(_model(0), ratio=0.2, method="svd", ranks={"k_proj": 48}, block=8, progress=False)


def test_block_too_large_for_tiny_model(rng):
  with pytest.raises(ValueError, match="pass a smaller block"):
    compress(_model(0), ratio=0.2, calib_tokens=_tokens(rng), progress=False)  # block=128


@pytest.mark.parametrize("per_head", [False, True])
def test_a_block_too_large_for_some_projections_is_one_error_naming_a_block_that_fits_all(
  per_head,
):
  """Every projection whose budget the block misses is counted in one error, and the block it
  names fits every projection (the plan with it succeeds)."""
  seen = 0
  for ratio in (0.1, 0.3, 0.5, 0.8, 0.95):
    for block in (8, 16, 32, 64, 128):
      try:
        plan_ranks(CFG, ratio=ratio, block=block, mlp_only=False, per_head=per_head)
        continue
      except ValueError as e:
        msg = str(e)
      m = re.search(r"block=(\d+) fits every one", msg)
      if m is None:
        assert "pass a smaller ratio" in msg, msg
        continue
      assert re.match(r"\d+ projections have no rank within the budget; layer ", msg), msg
      fit = int(m.group(1))
      assert fit < block
      plan = plan_ranks(CFG, ratio=ratio, block=fit, mlp_only=False, per_head=per_head)
      assert all(r > 0 for layer in plan for r, _ in layer.values())
      seen += 1
  assert seen >= 3  # the cases above do reach the combined error


def test_nan_inf_calibration_activations(rng):
  m = _model(1)
  m.embed.embedding[5] = jnp.full((CFG.hidden_size,), jnp.inf)
  tok = _tokens(rng)
  tok[0, 3] = 5
  with pytest.raises(ValueError, match="layer 0 qkv input: [0-9]+ NaN/Inf calibration activations"):
    compress(m, ratio=0.2, calib_tokens=tok, block=8, progress=False)


def test_calibration_tokens_out_of_vocab(rng):
  tok = _tokens(rng)
  tok[1, 2] = CFG.vocab_size
  with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 256\)"):
    compress(_model(0), ratio=0.2, calib_tokens=tok, block=8, progress=False)
  with pytest.raises(ValueError, match=r"must be \[batch, seq\] integers"):
    compress(_model(0), ratio=0.2, calib_tokens=tok.astype(np.float32), block=8, progress=False)


def test_whiten_needs_calibration_and_dense_model(rng):
  with pytest.raises(ValueError, match="needs calib_tokens"):
    compress(_model(0), ratio=0.2, block=8, progress=False)
  m = _model(0)
  compress(m, ratio=0.2, method="svd", block=8, progress=False)
  with pytest.raises(ValueError, match="already compressed"):
    compress(m, ratio=0.2, method="svd", block=8, progress=False)


def test_sequential_calibration_uses_compressed_prefix(rng):
  seed, tok = int(rng.integers(1 << 30)), _tokens(rng, n=12)
  seq, joint = _model(seed), _model(seed)
  compress(seq, ratio=0.4, calib_tokens=tok, block=8, calib_batch=5, progress=False)
  compress(
    joint, ratio=0.4, calib_tokens=tok, block=8, calib_batch=5, sequential=False, progress=False
  )
  # Layer 0 sees the same (dense) inputs either way; layer 1 sees a compressed layer 0 only
  # in sequential mode.
  u = lambda m, i: np.asarray(get_proj(m, i, "gate_proj").u[...])
  np.testing.assert_allclose(u(seq, 0), u(joint, 0), rtol=1e-4, atol=1e-5)
  assert np.abs(u(seq, 1) - u(joint, 1)).max() > 1e-3


def test_bad_options(rng):
  tok = _tokens(rng)
  for kw, msg in [
    (dict(method="asvd"), "method='asvd' must be one of"),
    (dict(calib_batch=0), "calib_batch=0 must be a positive int"),
    (dict(lora_steps=-1), "lora_steps=-1 must be a non-negative int"),
    (dict(block=0), "block=0 must be a positive int"),
  ]:
    with pytest.raises(ValueError, match=msg):
      compress(_model(0), ratio=0.2, calib_tokens=tok, **{"block": 8, **kw}, progress=False)
  with pytest.raises(ValueError, match="lora_rank=0 must be a positive int"):
    compress(
      _model(0), ratio=0.2, calib_tokens=tok, block=8, lora_steps=1, lora_rank=0, progress=False
    )


@pytest.mark.parametrize(
  "arch",
  [
    dict(model_type="qwen2", qkv_bias=True, tie_word_embeddings=True),
    dict(model_type="qwen3", qk_norm=True),
    dict(model_type="mistral", sliding_window=8),
    dict(model_type="llama", qkv_bias=True, o_bias=True, mlp_bias=True),
  ],
)
def test_architectures_keep_biases(arch, rng):
  cfg = CFG1.replace(**arch)
  m = _model(int(rng.integers(1 << 30)), cfg)
  biases = {
    p: np.asarray(get_proj(m, 0, p).bias[...])
    for p in ALL_PROJS
    if get_proj(m, 0, p).bias is not None
  }
  for p in biases:  # non-zero biases, so "kept" can fail
    get_proj(m, 0, p).bias[...] = jnp.asarray(rng.standard_normal(biases[p].shape), jnp.float32)
    biases[p] = np.asarray(get_proj(m, 0, p).bias[...])
  tok = _tokens(rng, n=4, s=12)
  compress(m, ratio=0.3, calib_tokens=tok, block=8, per_head=True, progress=False)
  for p, b in biases.items():
    np.testing.assert_array_equal(np.asarray(get_proj(m, 0, p).bias[...]), b)
  assert bool(jnp.all(jnp.isfinite(m(tok))))
