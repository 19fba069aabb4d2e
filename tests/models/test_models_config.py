"""ModelConfig: HF config.json in and out, presets, validation."""

import dataclasses
import json
import math
import os

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


# ---- typed validation: every value checked by type and range, errors name the key ------------
BASE = {
  "model_type": "llama",
  "vocab_size": 32,
  "hidden_size": 64,
  "intermediate_size": 128,
  "num_hidden_layers": 2,
  "num_attention_heads": 4,
}


@pytest.mark.parametrize(
  "change,match",
  [
    ({"hidden_size": 64.9}, "'hidden_size'=64.9 must be an integer >= 1"),
    ({"hidden_size": 64.0}, "'hidden_size'=64.0 must be an integer >= 1"),
    ({"hidden_size": "64"}, "'hidden_size'='64' must be an integer >= 1"),
    ({"num_hidden_layers": True}, "'num_hidden_layers'=True must be an integer"),
    ({"vocab_size": -1}, "'vocab_size'=-1 must be an integer >= 1"),
    ({"num_key_value_heads": 0}, "'num_key_value_heads'=0 must be an integer >= 1"),
    ({"head_dim": 0}, "'head_dim'=0 must be an integer >= 1"),
    ({"max_position_embeddings": 1.5}, "'max_position_embeddings'=1.5 must be an integer"),
    ({"rms_norm_eps": -1e-5}, "'rms_norm_eps'=-1e-05 must be a finite number > 0"),
    ({"rms_norm_eps": 0}, "'rms_norm_eps'=0 must be a finite number > 0"),
    ({"rms_norm_eps": float("nan")}, "'rms_norm_eps'=nan must be a finite number > 0"),
    ({"rms_norm_eps": float("inf")}, "'rms_norm_eps'=inf must be a finite number > 0"),
    ({"rms_norm_eps": "1e-5"}, "'rms_norm_eps'='1e-5' must be a finite number > 0"),
    ({"rms_norm_eps": True}, "'rms_norm_eps'=True must be a finite number > 0"),
    ({"rope_theta": -10000.0}, "'rope_theta'=-10000.0 must be a finite number > 0"),
    ({"tie_word_embeddings": "false"}, "'tie_word_embeddings'='false' must be true or false"),
    ({"attention_bias": 1}, "'attention_bias'=1 must be true or false"),
    ({"mlp_bias": "yes"}, "'mlp_bias'='yes' must be true or false"),
    ({"hidden_act": 3}, "'hidden_act'=3 must be a string"),
    ({"rope_scaling": [1]}, "'rope_scaling'=\\[1\\] must be an object or null"),
    (
      {"rope_scaling": {"rope_type": "linear", "factor": 0}},
      "rope_scaling factor=0 must be a finite number > 0",
    ),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling lacks 'factor'"),
    (
      {
        "rope_scaling": {
          "rope_type": "llama3",
          "factor": 8.0,
          "low_freq_factor": 4.0,
          "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192,
        }
      },
      "high_freq_factor=4.0 must be greater than low_freq_factor=4.0",
    ),
    (
      {
        "rope_scaling": {
          "rope_type": "llama3",
          "factor": 8.0,
          "low_freq_factor": 1.0,
          "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192.5,
        }
      },
      "original_max_position_embeddings=8192.5 must be a positive integer",
    ),
    ({"rope_parameters": {"rope_type": 5}}, "rope type 5 must be a string"),
    ({"model_type": "mistral", "sliding_window": 2.5}, "'sliding_window'=2.5 must be an integer"),
    (
      {"model_type": "qwen2", "sliding_window": 4, "use_sliding_window": "no"},
      "'use_sliding_window'='no' must be true or false",
    ),
  ],
)
def test_hf_config_values_are_typed_and_ranged(change, match):
  with pytest.raises(ValueError, match=match):
    ModelConfig.from_hf_config({**BASE, **change})


def test_hf_config_integral_values_load():
  cfg = ModelConfig.from_hf_config({**BASE, "rms_norm_eps": 1, "rope_theta": 500000})
  assert cfg.rms_norm_eps == 1.0 and isinstance(cfg.rms_norm_eps, float)
  assert cfg.rope_theta == 500000.0 and isinstance(cfg.rope_theta, float)
  assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_hf_config_errors_from_a_file_name_it(tmp_path):
  p = tmp_path / "config.json"
  p.write_text(json.dumps({**BASE, "hidden_size": 64.9}))
  with pytest.raises(ValueError, match=rf"{p}: config.json key 'hidden_size'=64.9"):
    ModelConfig.from_hf_config(tmp_path)
  p.write_text("{")
  with pytest.raises(ValueError, match=rf"{p}: not valid JSON"):
    ModelConfig.from_hf_config(p)


@pytest.mark.parametrize(
  "change,match",
  [
    ({"hidden_size": 64.9}, "hidden_size=64.9 must be a positive int"),
    ({"num_layers": True}, "num_layers=True must be a positive int"),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps=-1e-05 must be a finite number > 0"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps='1e-5' must be a finite number > 0"),
    ({"rope_theta": float("inf")}, "rope_theta=inf must be a finite number > 0"),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings=1 must be a bool"),
    ({"qk_norm": "true"}, "qk_norm='true' must be a bool"),
    ({"sliding_window": 0}, "sliding_window=0 must be a positive int or None"),
    ({"model_type": ["llama"]}, r"model_type=\['llama'\] is not supported"),
    ({"rope_scaling": "linear"}, "rope_scaling='linear' must be an object or null"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling lacks"),
  ],
)
def test_from_dict_values_are_typed_and_ranged(change, match):
  with pytest.raises(ValueError, match=match):
    ModelConfig.from_dict({**ModelConfig.tiny().to_dict(), **change})
  with pytest.raises(ValueError, match="must be an object"):
    ModelConfig.from_dict([("hidden_size", 64)])


def test_negative_eps_checkpoint_is_rejected_not_converted(tmp_path):
  """An HF dir with rms_norm_eps < 0 used to load into a model with NaN logits."""
  import shutil

  from lrjax.models import from_hf

  src = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf", "qwen3")
  d = tmp_path / "qwen3"
  shutil.copytree(src, d)
  cfg = json.loads((d / "config.json").read_text())
  cfg["rms_norm_eps"] = -1e-5
  (d / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match=r"config.json: config.json key 'rms_norm_eps'=-1e-05"):
    from_hf(d)
