"""Qwen2 / Qwen2.5 (HF ``model_type`` "qwen2"): q/k/v always carry a bias, o does not."""

from lrjax.models.families.base import Family, feature_mismatch, layered_sliding_window


def _from_hf(cfg, num_layers: int) -> dict:
  return {"qkv_bias": True, "sliding_window": layered_sliding_window(cfg, num_layers)}


def _to_hf(c) -> dict:
  return {
    "use_sliding_window": c.sliding_window is not None,
    "sliding_window": c.sliding_window,
    "max_window_layers": 0,
  }


def _expresses(c):
  return feature_mismatch(c, qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)


QWEN2 = Family("qwen2", "Qwen2ForCausalLM", _from_hf, _to_hf, _expresses)
