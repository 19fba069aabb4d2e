"""Llama-family models (Llama 2/3/3.1/3.2/3.3, Mistral, Qwen2, Qwen3) in Flax NNX.

API note (for ``lrjax.compress`` and other consumers; kept stable)::

  cfg   = ModelConfig.from_hf_config("ckpt/config.json")      # or ModelConfig.tiny(), presets
  model = LlamaForCausalLM(cfg, ranks=None, heads=None,       # random init; ranks: per layer
                           rngs=nnx.Rngs(0))                   # {proj: rank} → LowRankLinear;
                                                               # heads: {proj: h} → per-head
                                                               # HeadwiseLowRankLinear
  model = from_hf("ckpt_dir", dtype=jnp.float32)               # real weights from safetensors
  logits = model(tokens)                                       # [B, S] int → [B, S, vocab]

  for i, xs in layer_inputs(model, tokens):                    # calibration, layer by layer
      xs["qkv"], xs["o"], xs["gate_up"], xs["down"]            # each [B·S, K] projection input
      w = get_proj(model, i, "q_proj")                         # Linear: w.kernel [in, out]
      set_proj(model, i, "q_proj", LowRankLinear(...))         # or model.layers[i].attn.q_proj = m
  model.layer_ranks(), model.layer_heads()                     # [{proj: rank}], [{proj: h}]
  model.compression = {"method": ..., "ratio": ...}            # recorded in saved metadata

Projection names: PROJ_NAMES = q_proj k_proj v_proj o_proj (``model.layers[i].attn``) and
gate_proj up_proj down_proj (``model.layers[i].mlp``). Kernels are [in, out] (HF weights
transposed). Replacing layer i inside the ``layer_inputs`` loop before advancing it changes
the inputs that later layers see (sequential calibration).

Decoding: ``cache = KVCache.init(cfg, batch, max_len)``; ``logits, cache = prefill_step(model,
tokens, cache, lengths)``; ``logits, cache = decode_step(model, next_tokens, cache)`` (jitted,
cache donated). ``model.prefill``/``model.decode`` are the un-jitted methods. The cache holds
one buffer per layer (``cache.k[i]`` [batch, kv_heads, max_len, head_dim]) and keeps all
``max_len`` positions; a sliding window (Mistral) is applied as a mask, not a ring buffer.

Logical axis names on params (a rules table maps them to mesh axes for tensor parallelism):

  ========== ===============================================================
  embed      hidden size (residual stream); norms' weights
  heads      flattened query heads · head_dim (q_proj out, o_proj in)
  kv_heads   flattened kv heads · head_dim (k_proj, v_proj out)
  mlp        intermediate size (gate/up out, down in)
  vocab      vocabulary (embedding rows, lm_head out)
  rank       inner dim of a LowRankLinear (u out, v in)
  None       replicated: Qwen3 q_norm/k_norm weights [head_dim]
  ========== ===============================================================
"""

from lrjax.models.calib import GROUPS, PROJ_GROUP, get_proj, layer_inputs, set_proj
from lrjax.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from lrjax.models.llama import (
  ATTN_PROJS,
  MLP_PROJS,
  PROJ_NAMES,
  DecoderLayer,
  KVCache,
  LlamaForCausalLM,
  decode_step,
  prefill_step,
  proj_axes,
  rope_inv_freq,
)


def from_hf(path, dtype=None, **kw) -> LlamaForCausalLM:
  """Load an HF checkpoint directory (config.json + safetensors) as an NNX model.

  ``dtype`` is the param and compute dtype (default: the checkpoint's ``torch_dtype``,
  else float32). See :func:`lrjax.checkpoint.load_hf` for the other options.
  """
  from lrjax.checkpoint.hf import load_hf

  return load_hf(path, dtype=dtype, **kw)


__all__ = [
  "ATTN_PROJS",
  "DecoderLayer",
  "GROUPS",
  "KVCache",
  "LlamaForCausalLM",
  "MLP_PROJS",
  "ModelConfig",
  "PROJ_GROUP",
  "PROJ_NAMES",
  "SUPPORTED_MODEL_TYPES",
  "decode_step",
  "from_hf",
  "get_proj",
  "layer_inputs",
  "prefill_step",
  "proj_axes",
  "rope_inv_freq",
  "set_proj",
]
