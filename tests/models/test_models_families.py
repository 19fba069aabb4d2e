"""The model-family registry: a new family is one ``Family`` value plus one registry entry.

The test family below renames every tensor and adds a config flag; the checkpoint loader and
exporter pick both up from the registry with no edits of their own.
"""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from lrjax import checkpoint
from lrjax.models import LlamaForCausalLM, ModelConfig
from lrjax.models.families import FAMILIES, Family, get_family
from lrjax.models.families.base import hf_bool, llama_tensor_name


def _from_hf(cfg, num_layers):
  return {"mlp_bias": hf_bool(cfg, "ffn_bias")}


def _to_hf(c):
  return {"ffn_bias": c.mlp_bias}


def _name(path):
  name, transposed = llama_tensor_name(path)
  return name.replace("model.", "transformer.").replace("self_attn.", "attention."), transposed


TOY = Family(
  model_type="toy",
  architecture="ToyForCausalLM",
  from_hf=_from_hf,
  to_hf=_to_hf,
  expresses=lambda c: None if not (c.qkv_bias or c.qk_norm) else "only mlp biases",
  tensor_name=_name,
  ignored_tensors=("attention.masked_bias",),
)


@pytest.fixture
def toy(monkeypatch):
  monkeypatch.setitem(FAMILIES, "toy", TOY)
  return TOY


def test_registered_families():
  assert set(FAMILIES) == {"llama", "mistral", "qwen2", "qwen3"}
  for mt, fam in FAMILIES.items():
    assert fam.model_type == mt and fam.architecture.endswith("ForCausalLM")
  with pytest.raises(ValueError, match=r"model_type='gpt2' is not supported.*families"):
    get_family("gpt2")


def test_a_new_family_loads_and_exports_through_the_registry(tmp_path, toy, rng):
  cfg = ModelConfig.tiny(model_type="toy", mlp_bias=True, num_layers=1)
  hf = cfg.to_hf_config()
  assert hf["architectures"] == ["ToyForCausalLM"] and hf["ffn_bias"] is True
  assert ModelConfig.from_hf_config(hf) == cfg
  from flax import nnx

  m = LlamaForCausalLM(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
  checkpoint.export_hf(m, tmp_path / "ex")
  f = str(tmp_path / "ex" / "model.safetensors")
  tensors = load_file(f)
  assert "transformer.layers.0.attention.q_proj.weight" in tensors
  assert "transformer.layers.0.mlp.up_proj.bias" in tensors
  assert not any(n.startswith("model.") for n in tensors)
  tensors["transformer.layers.0.attention.masked_bias"] = np.ones(3, np.float32)
  save_file(tensors, f, metadata={"format": "pt"})
  back = checkpoint.load_hf(tmp_path / "ex", verify=False)  # the added tensor is ignored
  a, b = nnx.to_flat_state(nnx.state(m)), dict(nnx.to_flat_state(nnx.state(back)))
  for k, v in a:
    assert np.asarray(v[...]).tobytes() == np.asarray(b[k][...]).tobytes(), k
  checkpoint.save(back, tmp_path / "ck")
  assert checkpoint.read_metadata(tmp_path / "ck")["config"]["model_type"] == "toy"
  with pytest.raises(ValueError, match="model_type='toy' cannot express .*only mlp biases"):
    ModelConfig.tiny(model_type="toy", qk_norm=True).to_hf_config()


def test_a_family_missing_from_the_registry_is_refused(tmp_path):
  cfg = json.loads(json.dumps({**ModelConfig.tiny().to_hf_config(), "model_type": "toy"}))
  with pytest.raises(ValueError, match="unsupported architecture: model_type='toy'"):
    ModelConfig.from_hf_config(cfg)
