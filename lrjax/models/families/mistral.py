"""Mistral (HF ``model_type`` "mistral"): no biases, one sliding window for every layer."""

from lrjax.models.families.base import Family, feature_mismatch, plain_sliding_window


def _from_hf(cfg, num_layers: int) -> dict:
  return {"sliding_window": plain_sliding_window(cfg, num_layers)}


def _to_hf(c) -> dict:
  return {"sliding_window": c.sliding_window}


def _expresses(c):
  return feature_mismatch(c, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)


MISTRAL = Family("mistral", "MistralForCausalLM", _from_hf, _to_hf, _expresses)
