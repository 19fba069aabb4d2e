"""Frozen architecture config for the Llama family, read from and written to HF ``config.json``."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any
from collections.abc import Mapping

# HF ``model_type`` → lrjax architecture name. Architectures not listed are rejected.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a Llama-family decoder (Llama 2/3.x, Mistral, Qwen2, Qwen3).

  ``rope_scaling`` is a tuple of sorted ``(key, value)`` pairs so the config stays hashable;
  use :attr:`rope_scaling_dict` to read it.
  """

  model_type: str = "llama"
  vocab_size: int = 256
  hidden_size: int = 64
  intermediate_size: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_scaling: tuple | None = None
  max_position_embeddings: int = 2048
  tie_word_embeddings: bool = False
  qkv_bias: bool = False  # bias on q/k/v (Qwen2; Llama ``attention_bias``)
  o_bias: bool = False  # bias on o (Llama ``attention_bias``)
  mlp_bias: bool = False  # bias on gate/up/down (Llama ``mlp_bias``)
  qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
  sliding_window: int | None = None  # Mistral: keys older than this many positions are masked
  hidden_act: str = "silu"

  def __post_init__(self):
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(
        f"model_type={self.model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
      )
    for name in (
      "vocab_size",
      "hidden_size",
      "intermediate_size",
      "num_layers",
      "num_heads",
      "num_kv_heads",
      "head_dim",
      "max_position_embeddings",
    ):
      v = getattr(self, name)
      if not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name}={v!r} must be a positive int")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"num_heads={self.num_heads} must be a multiple of "
        f"num_kv_heads={self.num_kv_heads} (grouped-query attention)"
      )
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
    if self.hidden_act != "silu":
      raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; expected 'silu'")
    if self.rope_scaling is not None:
      rtype = self.rope_scaling_dict.get("rope_type", "default")
      if rtype not in _ROPE_TYPES:
        raise ValueError(
          f"rope_scaling type {rtype!r} is not supported; expected one of {_ROPE_TYPES}"
        )

  # ---- derived sizes ------------------------------------------------------------------------
  @property
  def q_dim(self) -> int:
    return self.num_heads * self.head_dim

  @property
  def kv_dim(self) -> int:
    return self.num_kv_heads * self.head_dim

  @property
  def rope_scaling_dict(self) -> dict:
    return dict(self.rope_scaling or ())

  def proj_shapes(self) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection, keyed by its module name."""
    h, f = self.hidden_size, self.intermediate_size
    return {
      "q_proj": (h, self.q_dim),
      "k_proj": (h, self.kv_dim),
      "v_proj": (h, self.kv_dim),
      "o_proj": (self.q_dim, h),
      "gate_proj": (h, f),
      "up_proj": (h, f),
      "down_proj": (f, h),
    }

  def replace(self, **kw) -> ModelConfig:
    return dataclasses.replace(self, **kw)

  # ---- HF config.json -----------------------------------------------------------------------
  @classmethod
  def from_hf_config(cls, cfg: Mapping[str, Any] | str | os.PathLike) -> ModelConfig:
    """From an HF ``config.json`` dict, a path to the file, or a checkpoint directory."""
    if not isinstance(cfg, Mapping):
      p = os.fspath(cfg)
      if os.path.isdir(p):
        p = os.path.join(p, "config.json")
      with open(p) as fh:
        cfg = json.load(fh)
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
      arch = cfg.get("architectures")
      raise ValueError(
        f"unsupported architecture: model_type={mt!r} (architectures={arch}); "
        f"lrjax supports model_type in {SUPPORTED_MODEL_TYPES}"
      )
    try:
      hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
      kw = dict(
        model_type=mt,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
      )
    except KeyError as e:
      raise ValueError(f"config.json lacks required key {e.args[0]!r} for model_type={mt!r}")  # noqa: B904
    kw["num_kv_heads"] = int(cfg.get("num_key_value_heads") or heads)
    kw["head_dim"] = int(cfg.get("head_dim") or hidden // heads)
    kw["rms_norm_eps"] = float(cfg.get("rms_norm_eps", 1e-6))
    # transformers 4.x: rope_theta + rope_scaling; 5.x: rope_parameters (theta inside).
    rp = dict(cfg.get("rope_scaling") or {})
    rp.update(cfg.get("rope_parameters") or {})
    kw["rope_theta"] = float(rp.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rtype = rp.pop("type", None) or rp.pop("rope_type", None) or "default"
    if rtype != "default":
      rp["rope_type"] = rtype
      kw["rope_scaling"] = tuple(sorted((k, _freeze(v)) for k, v in rp.items()))
    kw["max_position_embeddings"] = int(cfg.get("max_position_embeddings", 2048))
    kw["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", False))
    kw["hidden_act"] = cfg.get("hidden_act", "silu")
    if mt == "qwen2":
      kw["qkv_bias"] = True
    elif mt in ("llama", "qwen3"):
      kw["qkv_bias"] = kw["o_bias"] = bool(cfg.get("attention_bias", False))
    if mt == "llama":
      kw["mlp_bias"] = bool(cfg.get("mlp_bias", False))
    if mt == "qwen3":
      kw["qk_norm"] = True
    kw["sliding_window"] = _sliding_window(cfg, mt, kw["num_layers"])
    return cls(**kw)

  def to_hf_config(self) -> dict:
    """HF ``config.json`` dict that :meth:`from_hf_config` maps back to this config.

    Raises ``ValueError`` for a combination the HF ``model_type`` cannot express.
    """
    mt = self.model_type
    bias_ok = {
      "llama": self.qkv_bias == self.o_bias,
      "qwen3": self.qkv_bias == self.o_bias,
      "qwen2": self.qkv_bias and not self.o_bias,
      "mistral": not (self.qkv_bias or self.o_bias),
    }[mt]
    if not bias_ok or (self.mlp_bias and mt != "llama") or self.qk_norm != (mt == "qwen3"):
      raise ValueError(
        f"model_type={mt!r} cannot express qkv_bias={self.qkv_bias} with "
        f"o_bias={self.o_bias}, mlp_bias={self.mlp_bias}, qk_norm={self.qk_norm}; "
        "pick the model_type whose HF architecture has these features"
      )
    arch = {
      "llama": "LlamaForCausalLM",
      "mistral": "MistralForCausalLM",
      "qwen2": "Qwen2ForCausalLM",
      "qwen3": "Qwen3ForCausalLM",
    }[self.model_type]
    d = {
      "architectures": [arch],
      "model_type": self.model_type,
      "vocab_size": self.vocab_size,
      "hidden_size": self.hidden_size,
      "intermediate_size": self.intermediate_size,
      "num_hidden_layers": self.num_layers,
      "num_attention_heads": self.num_heads,
      "num_key_value_heads": self.num_kv_heads,
      "head_dim": self.head_dim,
      "rms_norm_eps": self.rms_norm_eps,
      "rope_theta": self.rope_theta,
      "rope_scaling": self.rope_scaling_dict or None,
      "rope_parameters": {
        "rope_theta": self.rope_theta,
        "rope_type": "default",
        **self.rope_scaling_dict,
      },
      "max_position_embeddings": self.max_position_embeddings,
      "tie_word_embeddings": self.tie_word_embeddings,
      "hidden_act": self.hidden_act,
    }
    if self.model_type in ("llama", "qwen3"):
      d["attention_bias"] = self.qkv_bias
    if self.model_type == "llama":
      d["mlp_bias"] = self.mlp_bias
    if self.model_type == "mistral":
      d["sliding_window"] = self.sliding_window
    elif self.model_type in ("qwen2", "qwen3"):
      d["use_sliding_window"] = self.sliding_window is not None
      d["sliding_window"] = self.sliding_window
      d["max_window_layers"] = 0
    return d

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["rope_scaling"] = self.rope_scaling_dict or None
    return d

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
    d = dict(d)
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f"unknown ModelConfig fields {sorted(unknown)}")
    if d.get("rope_scaling"):
      d["rope_scaling"] = tuple(sorted((k, _freeze(v)) for k, v in d["rope_scaling"].items()))
    return cls(**d)

  # ---- presets (published architectures; weights always come from a checkpoint) ------------
  @classmethod
  def tiny(cls, **kw) -> ModelConfig:
    """Test-sized Llama config (hidden 64, 2 layers, GQA 4 heads / 2 kv heads, vocab 256)."""
    return cls(**kw)

  @classmethod
  def llama2_7b(cls) -> ModelConfig:
    return cls(
      vocab_size=32000,
      hidden_size=4096,
      intermediate_size=11008,
      num_layers=32,
      num_heads=32,
      num_kv_heads=32,
      head_dim=128,
      rms_norm_eps=1e-5,
      max_position_embeddings=4096,
    )

  @classmethod
  def llama3_8b(cls) -> ModelConfig:
    return cls(
      vocab_size=128256,
      hidden_size=4096,
      intermediate_size=14336,
      num_layers=32,
      num_heads=32,
      num_kv_heads=8,
      head_dim=128,
      rms_norm_eps=1e-5,
      rope_theta=500000.0,
      max_position_embeddings=8192,
    )

  @classmethod
  def llama3_70b(cls) -> ModelConfig:
    return cls(
      vocab_size=128256,
      hidden_size=8192,
      intermediate_size=28672,
      num_layers=80,
      num_heads=64,
      num_kv_heads=8,
      head_dim=128,
      rms_norm_eps=1e-5,
      rope_theta=500000.0,
      max_position_embeddings=8192,
    )

  @classmethod
  def llama3_2_1b(cls) -> ModelConfig:
    rs = {
      "rope_type": "llama3",
      "factor": 32.0,
      "low_freq_factor": 1.0,
      "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192,
    }
    return cls(
      vocab_size=128256,
      hidden_size=2048,
      intermediate_size=8192,
      num_layers=16,
      num_heads=32,
      num_kv_heads=8,
      head_dim=64,
      rms_norm_eps=1e-5,
      rope_theta=500000.0,
      rope_scaling=tuple(sorted(rs.items())),
      max_position_embeddings=131072,
      tie_word_embeddings=True,
    )

  @classmethod
  def mistral_7b(cls) -> ModelConfig:
    return cls(
      model_type="mistral",
      vocab_size=32000,
      hidden_size=4096,
      intermediate_size=14336,
      num_layers=32,
      num_heads=32,
      num_kv_heads=8,
      head_dim=128,
      rms_norm_eps=1e-5,
      max_position_embeddings=32768,
      sliding_window=4096,
    )

  @classmethod
  def qwen2_0_5b(cls) -> ModelConfig:
    return cls(
      model_type="qwen2",
      vocab_size=151936,
      hidden_size=896,
      intermediate_size=4864,
      num_layers=24,
      num_heads=14,
      num_kv_heads=2,
      head_dim=64,
      rms_norm_eps=1e-6,
      rope_theta=1000000.0,
      max_position_embeddings=32768,
      tie_word_embeddings=True,
      qkv_bias=True,
    )

  @classmethod
  def qwen2_5_7b(cls) -> ModelConfig:
    return cls(
      model_type="qwen2",
      vocab_size=152064,
      hidden_size=3584,
      intermediate_size=18944,
      num_layers=28,
      num_heads=28,
      num_kv_heads=4,
      head_dim=128,
      rms_norm_eps=1e-6,
      rope_theta=1000000.0,
      max_position_embeddings=32768,
      qkv_bias=True,
    )

  @classmethod
  def qwen3_0_6b(cls) -> ModelConfig:
    return cls(
      model_type="qwen3",
      vocab_size=151936,
      hidden_size=1024,
      intermediate_size=3072,
      num_layers=28,
      num_heads=16,
      num_kv_heads=8,
      head_dim=128,
      rms_norm_eps=1e-6,
      rope_theta=1000000.0,
      max_position_embeddings=40960,
      tie_word_embeddings=True,
      qk_norm=True,
    )


def _sliding_window(cfg, mt, n_layers):
  """The window if every layer slides, None if none does; mixed layers are rejected."""
  sw = cfg.get("sliding_window")
  if mt == "mistral" or not sw:
    return int(sw) if sw else None
  types = cfg.get("layer_types")
  if types is None:
    use = bool(cfg.get("use_sliding_window", False))
    mwl = int(cfg.get("max_window_layers", n_layers))
    types = ["sliding_attention" if use and i >= mwl else "full_attention" for i in range(n_layers)]
  kinds = set(types)
  if kinds == {"full_attention"}:
    return None
  if kinds == {"sliding_attention"}:
    return int(sw)
  raise ValueError(
    f"layer_types={types} mixes sliding and full attention; lrjax supports "
    "models where all layers or no layers use a sliding window"
  )


def _freeze(v):
  return tuple(v) if isinstance(v, list) else v
