"""Bad HF checkpoints fail with errors that name the tensor and what was expected."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from lrjax.checkpoint import SafetensorsDir, read_header
from lrjax.models import ModelConfig, from_hf

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")


def _copy(tmp_path, name):
  d = tmp_path / name
  shutil.copytree(os.path.join(FIXTURES, name), d)
  return d


def _edit_config(d, **kw):
  cfg = json.loads((d / "config.json").read_text())
  cfg.update(kw)
  (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("cut", [0.5, 0.999])
def test_truncated_file_names_the_cut_tensor(tmp_path, cut):
  d = _copy(tmp_path, "qwen3")
  f = d / "model.safetensors"
  data = f.read_bytes()
  header = read_header(str(f))
  f.write_bytes(data[: int(len(data) * cut)])
  data_len = len(data) * cut - 8 - int.from_bytes(data[:8], "little")
  cut_names = [n for n, i in header.items() if i["data_offsets"][1] > data_len]
  with pytest.raises(ValueError, match="truncated") as e:
    from_hf(d)
  assert any(repr(n) in str(e.value) for n in cut_names)
  assert "data bytes" in str(e.value)


def test_truncated_header(tmp_path):
  d = _copy(tmp_path, "qwen3")
  (d / "model.safetensors").write_bytes(b"\x10\x00\x00")
  with pytest.raises(ValueError, match="too short.*truncated"):
    from_hf(d)
  (d / "model.safetensors").write_bytes((10**6).to_bytes(8, "little") + b"{}")
  with pytest.raises(ValueError, match="header claims 1000000 bytes"):
    from_hf(d)


def test_truncated_shard_of_sharded_checkpoint(tmp_path):
  d = _copy(tmp_path, "llama3")
  shard = sorted(p for p in os.listdir(d) if p.startswith("model-"))[1]
  data = (d / shard).read_bytes()
  (d / shard).write_bytes(data[:-100])
  with pytest.raises(ValueError, match=f"{shard}: tensor '.*' .* truncated"):
    from_hf(d)


def test_mis_shaped_tensor_from_config_mismatch(tmp_path):
  d = _copy(tmp_path, "llama3")
  _edit_config(d, intermediate_size=96)
  with pytest.raises(
    ValueError,
    match=r"tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' has "
    r"shape \[(128, 64|64, 128)\], expected \[(96, 64|64, 96)\] from config",
  ):
    from_hf(d)


def test_more_layers_in_config_than_tensors(tmp_path):
  d = _copy(tmp_path, "qwen3")
  _edit_config(d, num_hidden_layers=3)
  with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.2\..*expected shape"):
    from_hf(d)


def test_fewer_layers_in_config_than_tensors(tmp_path):
  d = _copy(tmp_path, "qwen3")
  _edit_config(d, num_hidden_layers=1)
  with pytest.raises(ValueError, match=r"does not describe, e\.g\. \['model\.layers\.1\."):
    from_hf(d)


def test_missing_tensor(tmp_path):
  d = _copy(tmp_path, "mistral_f16")
  tensors = load_file(str(d / "model.safetensors"))
  del tensors["model.layers.1.self_attn.v_proj.weight"]
  save_file(tensors, str(d / "model.safetensors"))
  with pytest.raises(
    ValueError,
    match=r"missing tensor 'model\.layers\.1\.self_attn\.v_proj"
    r"\.weight': expected shape \[32, 64\]",
  ):
    from_hf(d)


def test_integer_tensor_rejected(tmp_path):
  d = _copy(tmp_path, "qwen3")
  tensors = load_file(str(d / "model.safetensors"))
  tensors["model.norm.weight"] = np.ones(64, np.int8)
  save_file(tensors, str(d / "model.safetensors"))
  with pytest.raises(ValueError, match="'model.norm.weight' has dtype I8"):
    from_hf(d)


def test_unsupported_architecture(tmp_path):
  d = _copy(tmp_path, "qwen3")
  _edit_config(d, model_type="gpt2", architectures=["GPT2LMHeadModel"])
  with pytest.raises(
    ValueError,
    match=r"unsupported architecture: model_type='gpt2'.*"
    r"GPT2LMHeadModel.*supports model_type in",
  ):
    from_hf(d)


@pytest.mark.parametrize(
  "change,match",
  [
    (
      {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
      "rope_scaling type 'yarn' is not supported",
    ),
    ({"num_key_value_heads": 3}, "must be a multiple of num_kv_heads=3"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    (
      {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
      "mixes sliding and full attention",
    ),
  ],
)
def test_unsupported_config_features(change, match):
  cfg = json.load(open(os.path.join(FIXTURES, "qwen3", "config.json")))
  cfg.update(change)
  with pytest.raises(ValueError, match=match):
    ModelConfig.from_hf_config(cfg)


def test_missing_shard_and_missing_weights(tmp_path):
  d = _copy(tmp_path, "llama3")
  shard = sorted(p for p in os.listdir(d) if p.startswith("model-"))[0]
  os.remove(d / shard)
  with pytest.raises(FileNotFoundError, match=f"{shard}: shard listed in"):
    from_hf(d)
  e = tmp_path / "empty"
  e.mkdir()
  (e / "config.json").write_text(open(os.path.join(FIXTURES, "qwen3", "config.json")).read())
  with pytest.raises(FileNotFoundError, match="no model.safetensors"):
    from_hf(e)


def test_index_pointing_at_wrong_shard(tmp_path):
  d = _copy(tmp_path, "llama3")
  idx = json.loads((d / "model.safetensors.index.json").read_text())
  files = sorted(set(idx["weight_map"].values()))
  name = next(n for n, f in idx["weight_map"].items() if f == files[0])
  idx["weight_map"][name] = files[1]
  (d / "model.safetensors.index.json").write_text(json.dumps(idx))
  with pytest.raises(ValueError, match=f"'{name}' is in {files[0]} but .* maps it to"):
    SafetensorsDir(d)
