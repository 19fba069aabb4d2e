"""What a model family tells lrjax: its HF names, its config.json keys and its tensor names.

A family is one :class:`Family` value in its own file under ``lrjax/models/families/``, listed
once in ``families/__init__.py``. The shared Llama-style keys (sizes, heads, RoPE, norms) are
read by :meth:`lrjax.models.ModelConfig.from_hf_config`; a family maps only what differs:
biases, q/k norms, sliding windows, the exported ``architectures`` name and tensor-name quirks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

_MISSING = object()
_SECTION = {"attn": "self_attn", "mlp": "mlp"}


# ---- typed config.json readers (errors name the key) ------------------------------------------
def is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def hf_int(cfg: Mapping[str, Any], key: str, default: Any = _MISSING, minimum: int = 1) -> Any:
  """``cfg[key]`` as an int >= ``minimum``; ``default`` when absent or null."""
  v = cfg.get(key)
  if v is None:
    if default is _MISSING:
      raise ValueError(f"config.json lacks required key {key!r}")
    return default
  if not is_int(v) or v < minimum:
    raise ValueError(f"config.json key {key!r}={v!r} must be an integer >= {minimum}")
  return v


def hf_float(cfg: Mapping[str, Any], key: str, default: Any = _MISSING) -> Any:
  """``cfg[key]`` as a finite float > 0; ``default`` when absent or null."""
  v = cfg.get(key)
  if v is None:
    if default is _MISSING:
      raise ValueError(f"config.json lacks required key {key!r}")
    return default
  if not is_number(v) or not math.isfinite(v) or v <= 0:
    raise ValueError(f"config.json key {key!r}={v!r} must be a finite number > 0")
  return float(v)


def hf_bool(cfg: Mapping[str, Any], key: str, default: bool = False) -> bool:
  """``cfg[key]`` as a JSON boolean; ``default`` when absent or null."""
  v = cfg.get(key)
  if v is None:
    return default
  if not isinstance(v, bool):
    raise ValueError(f"config.json key {key!r}={v!r} must be true or false")
  return v


def plain_sliding_window(cfg: Mapping[str, Any], num_layers: int) -> int | None:
  """Mistral style: ``sliding_window`` (null or 0 = none) applies to every layer."""
  return hf_int(cfg, "sliding_window", None) if cfg.get("sliding_window") != 0 else None


def layered_sliding_window(cfg: Mapping[str, Any], num_layers: int) -> int | None:
  """Qwen style: ``layer_types`` or ``use_sliding_window`` + ``max_window_layers`` choose the
  sliding layers. The window if every layer slides, None if none does; mixed is rejected."""
  if not cfg.get("sliding_window"):
    return None
  sw = hf_int(cfg, "sliding_window")
  types = cfg.get("layer_types")
  if types is None:
    use = hf_bool(cfg, "use_sliding_window", False)
    mwl = hf_int(cfg, "max_window_layers", num_layers, minimum=0)
    types = [
      "sliding_attention" if use and i >= mwl else "full_attention" for i in range(num_layers)
    ]
  if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
    raise ValueError(f"config.json key 'layer_types'={types!r:.80} must be a list of strings")
  kinds = set(types)
  if kinds <= {"full_attention"}:
    return None
  if kinds == {"sliding_attention"}:
    return sw
  raise ValueError(
    f"layer_types={types} mixes sliding and full attention; lrjax supports "
    "models where all layers or no layers use a sliding window"
  )


# ---- tensor names -----------------------------------------------------------------------------
def llama_tensor_name(path: tuple) -> tuple[str, bool]:
  """(HF tensor name, stored transposed?) of the NNX param at ``path``, transformers' Llama
  naming: ``model.layers.{i}.self_attn.q_proj.weight`` [out, in], low-rank ``q_u_proj`` /
  ``q_v_proj``."""
  p = tuple(str(x) for x in path)
  if p == ("embed", "embedding"):
    return "model.embed_tokens.weight", False
  if p == ("norm", "weight"):
    return "model.norm.weight", False
  if p == ("lm_head", "kernel"):
    return "lm_head.weight", True
  if len(p) >= 4 and p[0] == "layers":
    pre = f"model.layers.{p[1]}."
    if p[2] in ("input_layernorm", "post_attention_layernorm"):
      return pre + f"{p[2]}.weight", False
    if p[2] in _SECTION:
      sec = pre + _SECTION[p[2]] + "."
      if p[3] in ("q_norm", "k_norm"):
        return sec + f"{p[3]}.weight", False
      if len(p) == 5:
        proj, leaf = p[3], p[4]
        short = proj[: -len("_proj")]
        if leaf == "kernel":
          return sec + f"{proj}.weight", True
        if leaf == "u":
          return sec + f"{short}_u_proj.weight", True
        if leaf == "v":
          return sec + f"{short}_v_proj.weight", True
        if leaf == "bias":
          return sec + f"{proj}.bias", False
  raise ValueError(f"no HF tensor name for param {'.'.join(p)}")


# ---- the family -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Family:
  """One HF ``model_type`` that lrjax's Llama-style decoder runs.

  Attributes:
    model_type: HF ``config.json`` ``model_type``.
    architecture: the ``architectures`` entry an export writes (a transformers class name).
    from_hf: ``(config.json dict, num_layers) → {ModelConfig field: value}`` for the fields that
      differ between families (qkv_bias, o_bias, mlp_bias, qk_norm, sliding_window).
    to_hf: ``ModelConfig → {config.json key: value}``, the inverse of ``from_hf``.
    expresses: ``ModelConfig → None`` if the HF architecture can hold that config, else why not.
    tensor_name: ``NNX param path → (HF tensor name, stored transposed?)``.
    ignored_tensors: suffixes of checkpoint tensors that the model does not use.
  """

  model_type: str
  architecture: str
  from_hf: Callable[[Mapping[str, Any], int], dict]
  to_hf: Callable[[Any], dict]
  expresses: Callable[[Any], str | None]
  tensor_name: Callable[[tuple], tuple[str, bool]] = llama_tensor_name
  ignored_tensors: tuple[str, ...] = ("rotary_emb.inv_freq",)


def feature_mismatch(cfg, **allowed) -> str | None:
  """None if each named ModelConfig field of ``cfg`` has the allowed value, else a reason."""
  bad = {k: getattr(cfg, k) for k, v in allowed.items() if getattr(cfg, k) != v}
  if not bad:
    return None
  return ", ".join(f"{k}={v}" for k, v in bad.items()) + " is not expressible"
