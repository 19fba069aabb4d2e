"""ModelConfig: HF config.json in and out, presets, validation."""

import dataclasses
import math

import numpy as np
import pytest

from lrjax.models import ModelConfig, rope_inv_freq

PRESETS = [
  "tiny",
  "llama2_7b",
  "llama3_8b",
  "llama3_70b",
  "llama3_2_1b",
  "mistral_7b",
  "qwen2_0_5b",
  "qwen2_5_7b",
  "qwen3_0_6b",
]


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_round_trip_through_hf_and_dict(preset):
  cfg = getattr(ModelConfig, preset)()
  assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg
  assert ModelConfig.from_dict(cfg.to_dict()) == cfg
  hash(cfg)


def test_published_sizes():
  c = ModelConfig.llama3_2_1b()
  assert (c.q_dim, c.kv_dim, c.num_heads // c.num_kv_heads) == (2048, 512, 4)
  assert c.proj_shapes()["down_proj"] == (8192, 2048)
  b = ModelConfig.llama3_70b()
  assert (b.q_dim, b.kv_dim, b.proj_shapes()["gate_proj"]) == (8192, 1024, (8192, 28672))
  w = ModelConfig.qwen2_5_7b()
  assert (w.q_dim, w.kv_dim, w.proj_shapes()["up_proj"]) == (3584, 512, (3584, 18944))
  q = ModelConfig.qwen3_0_6b()
  assert q.q_dim == 2048 != q.hidden_size  # head_dim decoupled from hidden/heads


def test_head_dim_defaults_to_hidden_over_heads():
  cfg = ModelConfig.from_hf_config(
    {
      "model_type": "llama",
      "vocab_size": 10,
      "hidden_size": 96,
      "intermediate_size": 8,
      "num_hidden_layers": 1,
      "num_attention_heads": 6,
    }
  )
  assert cfg.head_dim == 16 and cfg.num_kv_heads == 6


def test_missing_key_and_bad_values():
  with pytest.raises(ValueError, match="lacks required key 'intermediate_size'"):
    ModelConfig.from_hf_config(
      {
        "model_type": "qwen2",
        "vocab_size": 10,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
      }
    )
  with pytest.raises(ValueError, match="num_layers=0 must be a positive int"):
    ModelConfig.tiny(num_layers=0)
  with pytest.raises(ValueError, match="unknown ModelConfig fields"):
    ModelConfig.from_dict({"bogus": 1})
  with pytest.raises(dataclasses.FrozenInstanceError):
    ModelConfig.tiny().vocab_size = 3


def test_rope_llama3_and_linear_frequencies(rng):
  theta = float(rng.uniform(1e3, 1e5))
  base = ModelConfig.tiny(head_dim=32, rope_theta=theta)
  inv = rope_inv_freq(base)
  np.testing.assert_allclose(inv, theta ** (-np.arange(0, 32, 2) / 32))
  lin = base.replace(rope_scaling=(("factor", 4.0), ("rope_type", "linear")))
  np.testing.assert_allclose(rope_inv_freq(lin), inv / 4)
  l3 = base.replace(
    rope_scaling=(
      ("factor", 8.0),
      ("high_freq_factor", 4.0),
      ("low_freq_factor", 1.0),
      ("original_max_position_embeddings", 256),
      ("rope_type", "llama3"),
    )
  )
  got = rope_inv_freq(l3)
  wl = 2 * math.pi / inv
  hi, lo = wl < 256 / 4, wl > 256
  assert hi.any() and lo.any() and (~hi & ~lo).any()  # all three bands exercised
  np.testing.assert_allclose(got[hi], inv[hi])
  np.testing.assert_allclose(got[lo], inv[lo] / 8)
  mid = ~hi & ~lo
  assert np.all(got[mid] < inv[mid]) and np.all(got[mid] > inv[mid] / 8)
