"""Frozen architecture config for the Llama family, read from and written to HF ``config.json``.

What differs between HF model types (biases, q/k norms, sliding windows, names) lives in the
family registry, :mod:`lrjax.models.families`; this file reads the keys they share. Every value
is checked by type and range, and errors name the key.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

from lrjax.files import read_json_object
from lrjax.models.families import FAMILIES, get_family
from lrjax.models.families.base import hf_bool, hf_float, hf_int, is_int, is_number

# HF ``model_type``s lrjax runs (one registered family each).
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
_ROPE_TYPES = ("default", "linear", "llama3")
# Required rope_scaling keys per type, and whether each must be an int (else a positive float).
_ROPE_KEYS = {
  "default": {},
  "linear": {"factor": False},
  "llama3": {
    "factor": False,
    "low_freq_factor": False,
    "high_freq_factor": False,
    "original_max_position_embeddings": True,
  },
}
_INT_FIELDS = (
  "vocab_size",
  "hidden_size",
  "intermediate_size",
  "num_layers",
  "num_heads",
  "num_kv_heads",
  "head_dim",
  "max_position_embeddings",
)
_BOOL_FIELDS = ("tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias", "qk_norm")


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
    if not isinstance(self.model_type, str) or self.model_type not in FAMILIES:
      raise ValueError(
        f"model_type={self.model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
      )
    for name in _INT_FIELDS:
      v = getattr(self, name)
      if not is_int(v) or v <= 0:
        raise ValueError(f"{name}={v!r} must be a positive int")
    for name in ("rms_norm_eps", "rope_theta"):
      v = getattr(self, name)
      if not is_number(v) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name}={v!r} must be a finite number > 0")
      object.__setattr__(self, name, float(v))
    for name in _BOOL_FIELDS:
      v = getattr(self, name)
      if not isinstance(v, bool):
        raise ValueError(f"{name}={v!r} must be a bool")
    sw = self.sliding_window
    if sw is not None and (not is_int(sw) or sw <= 0):
      raise ValueError(f"sliding_window={sw!r} must be a positive int or None")
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
      _check_rope(self.rope_scaling)

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
    """From an HF ``config.json`` dict, a path to the file, or a checkpoint directory.

    Raises ``ValueError`` naming the key (and the file, when given a path) for a missing key,
    a value of the wrong type (``64.9`` or ``true`` for a size) or out of range.
    """
    if not isinstance(cfg, Mapping):
      p = os.path.expanduser(os.fspath(cfg))
      if os.path.isdir(p):
        p = os.path.join(p, "config.json")
      d = read_json_object(p)
      try:
        return cls.from_hf_config(d)
      except ValueError as e:
        raise ValueError(f"{p}: {e}") from None
    mt = cfg.get("model_type")
    if not isinstance(mt, str) or mt not in FAMILIES:
      arch = cfg.get("architectures")
      raise ValueError(
        f"unsupported architecture: model_type={mt!r} (architectures={arch}); "
        f"lrjax supports model_type in {SUPPORTED_MODEL_TYPES}"
      )
    fam = get_family(mt)
    try:
      kw = dict(
        model_type=mt,
        vocab_size=hf_int(cfg, "vocab_size"),
        hidden_size=hf_int(cfg, "hidden_size"),
        intermediate_size=hf_int(cfg, "intermediate_size"),
        num_layers=hf_int(cfg, "num_hidden_layers"),
        num_heads=hf_int(cfg, "num_attention_heads"),
      )
    except ValueError as e:
      if "lacks required key" in str(e):
        raise ValueError(f"{e} for model_type={mt!r}") from None
      raise
    hidden, heads = kw["hidden_size"], kw["num_heads"]
    kw["num_kv_heads"] = hf_int(cfg, "num_key_value_heads", heads)
    kw["head_dim"] = hf_int(cfg, "head_dim", hidden // heads if hidden >= heads else None)
    if kw["head_dim"] is None:
      raise ValueError(
        f"config.json key 'hidden_size'={hidden} is smaller than 'num_attention_heads'={heads}; "
        "give 'head_dim' explicitly"
      )
    kw["rms_norm_eps"] = hf_float(cfg, "rms_norm_eps", 1e-6)
    # transformers 4.x: rope_theta + rope_scaling; 5.x: rope_parameters (theta inside).
    rp = {}
    for key in ("rope_scaling", "rope_parameters"):
      v = cfg.get(key)
      if v is not None and not isinstance(v, Mapping):
        raise ValueError(f"config.json key {key!r}={v!r:.80} must be an object or null")
      rp.update(v or {})
    theta_src = rp if "rope_theta" in rp else cfg
    kw["rope_theta"] = hf_float(theta_src, "rope_theta", 10000.0)
    rp.pop("rope_theta", None)
    rtype = rp.pop("type", None) or rp.pop("rope_type", None) or "default"
    rp.pop("rope_type", None)
    if not isinstance(rtype, str):
      raise ValueError(f"config.json rope type {rtype!r} must be a string")
    if rtype != "default":
      rp["rope_type"] = rtype
      kw["rope_scaling"] = tuple(sorted((str(k), _freeze(v)) for k, v in rp.items()))
    kw["max_position_embeddings"] = hf_int(cfg, "max_position_embeddings", 2048)
    kw["tie_word_embeddings"] = hf_bool(cfg, "tie_word_embeddings", False)
    act = cfg.get("hidden_act", "silu")
    if not isinstance(act, str):
      raise ValueError(f"config.json key 'hidden_act'={act!r} must be a string like 'silu'")
    kw["hidden_act"] = act
    kw.update(fam.from_hf(cfg, kw["num_layers"]))
    return cls(**kw)

  def to_hf_config(self) -> dict:
    """HF ``config.json`` dict that :meth:`from_hf_config` maps back to this config.

    Raises ``ValueError`` for a combination the HF ``model_type`` cannot express.
    """
    fam = get_family(self.model_type)
    why = fam.expresses(self)
    if why:
      raise ValueError(
        f"model_type={self.model_type!r} cannot express qkv_bias={self.qkv_bias} with "
        f"o_bias={self.o_bias}, mlp_bias={self.mlp_bias}, qk_norm={self.qk_norm}, "
        f"sliding_window={self.sliding_window} ({why}); "
        "pick the model_type whose HF architecture has these features"
      )
    d = {
      "architectures": [fam.architecture],
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
    d.update(fam.to_hf(self))
    return d

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["rope_scaling"] = self.rope_scaling_dict or None
    return d

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
    """Inverse of :meth:`to_dict`; errors name the field."""
    if not isinstance(d, Mapping):
      raise ValueError(f"a ModelConfig dict must be an object, got {type(d).__name__}")
    d = dict(d)
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f"unknown ModelConfig fields {sorted(map(str, unknown))}")
    rs = d.get("rope_scaling")
    if rs is not None and not isinstance(rs, Mapping):
      raise ValueError(f"rope_scaling={rs!r:.80} must be an object or null")
    if rs:
      d["rope_scaling"] = tuple(sorted((str(k), _freeze(v)) for k, v in rs.items()))
    else:
      d["rope_scaling"] = None if "rope_scaling" in d else cls.rope_scaling
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


def _check_rope(rs):
  if not isinstance(rs, tuple) or not all(
    isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[0], str) for kv in rs
  ):
    raise ValueError(f"rope_scaling={rs!r:.80} must be (key, value) pairs")
  d = dict(rs)
  rtype = d.get("rope_type", "default")
  if rtype not in _ROPE_TYPES:
    raise ValueError(f"rope_scaling type {rtype!r} is not supported; expected one of {_ROPE_TYPES}")
  for key, integer in _ROPE_KEYS[rtype].items():
    if key not in d:
      raise ValueError(f"rope_scaling lacks {key!r}, which rope_type {rtype!r} needs")
    v = d[key]
    ok = is_int(v) if integer else is_number(v) and math.isfinite(v)
    if not ok or v <= 0:
      kind = "a positive integer" if integer else "a finite number > 0"
      raise ValueError(f"rope_scaling {key}={v!r} must be {kind}")
  if rtype == "llama3" and not d["high_freq_factor"] > d["low_freq_factor"]:
    raise ValueError(
      f"rope_scaling high_freq_factor={d['high_freq_factor']!r} must be greater than "
      f"low_freq_factor={d['low_freq_factor']!r}"
    )


def _freeze(v):
  """JSON value → hashable (lists → tuples, objects → sorted pairs)."""
  if isinstance(v, list):
    return tuple(_freeze(x) for x in v)
  if isinstance(v, dict):
    return tuple(sorted((str(k), _freeze(x)) for k, x in v.items()))
  return v
