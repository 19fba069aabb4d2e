"""Qwen3 (HF ``model_type`` "qwen3"): per-head RMSNorm on q and k, optional attention bias."""

from lrjax.models.families.base import Family, feature_mismatch, hf_bool, layered_sliding_window


def _from_hf(cfg, num_layers: int) -> dict:
  bias = hf_bool(cfg, "attention_bias")
  return {
    "qkv_bias": bias,
    "o_bias": bias,
    "qk_norm": True,
    "sliding_window": layered_sliding_window(cfg, num_layers),
  }


def _to_hf(c) -> dict:
  return {
    "attention_bias": c.qkv_bias,
    "use_sliding_window": c.sliding_window is not None,
    "sliding_window": c.sliding_window,
    "max_window_layers": 0,
  }


def _expresses(c):
  if c.qkv_bias != c.o_bias:
    return f"qkv_bias={c.qkv_bias} with o_bias={c.o_bias} is not expressible"
  return feature_mismatch(c, mlp_bias=False, qk_norm=True)


QWEN3 = Family("qwen3", "Qwen3ForCausalLM", _from_hf, _to_hf, _expresses)
