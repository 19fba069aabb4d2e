"""Llama 2/3.x (HF ``model_type`` "llama"): optional attention and MLP biases."""

from lrjax.models.families.base import Family, feature_mismatch, hf_bool, layered_sliding_window


def _from_hf(cfg, num_layers: int) -> dict:
  bias = hf_bool(cfg, "attention_bias")
  return {
    "qkv_bias": bias,
    "o_bias": bias,
    "mlp_bias": hf_bool(cfg, "mlp_bias"),
    "sliding_window": layered_sliding_window(cfg, num_layers),
  }


def _to_hf(c) -> dict:
  return {"attention_bias": c.qkv_bias, "mlp_bias": c.mlp_bias}


def _expresses(c):
  if c.qkv_bias != c.o_bias:
    return f"qkv_bias={c.qkv_bias} with o_bias={c.o_bias} is not expressible"
  return feature_mismatch(c, qk_norm=False, sliding_window=None)


LLAMA = Family("llama", "LlamaForCausalLM", _from_hf, _to_hf, _expresses)
