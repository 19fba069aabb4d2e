"""Calibration hooks: projection inputs per layer, and projection get/set by (layer, name)."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from lrjax.models.llama import (
  ATTN_PROJS,
  PROJ_NAMES,
  LlamaForCausalLM,
  _mask,
  get_proj_module,
  rope_inv_freq,
)
from lrjax.nn.linear import Linear, LowRankLinear

# Projection group → projections that read that input.
GROUPS = {
  "qkv": ("q_proj", "k_proj", "v_proj"),
  "o": ("o_proj",),
  "gate_up": ("gate_proj", "up_proj"),
  "down": ("down_proj",),
}
PROJ_GROUP = {p: g for g, ps in GROUPS.items() for p in ps}


@nnx.jit
def _layer_taps(layer, h, pos, inv, mask):
  taps = {}
  layer(h, pos, inv, mask, taps=taps)
  return taps


@nnx.jit
def _layer_out(layer, h, pos, inv, mask):
  return layer(h, pos, inv, mask)[0]


def layer_inputs(model: LlamaForCausalLM, tokens) -> Iterator[tuple[int, dict[str, jax.Array]]]:
  """Run the real forward layer by layer; yield ``(i, {group: X [tokens, K]})`` per layer.

  Groups: ``qkv`` (input of q/k/v, [N, hidden]), ``o`` (attention output, [N, heads·head_dim]),
  ``gate_up`` (MLP input, [N, hidden]), ``down`` (silu(gate)·up, [N, intermediate]), where
  N = batch·seq of ``tokens`` [B, S]. Layer i's output is computed after the consumer resumes
  the generator, so projections replaced in layer i meanwhile feed the inputs of layer i+1
  (sequential calibration).
  """
  tokens = jnp.asarray(tokens)
  if tokens.ndim != 2:
    raise ValueError(f"tokens.shape={tokens.shape} must be [batch, seq]")
  b, s = tokens.shape
  pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  mask = _mask(pos, pos, jnp.ones((b, s), bool), model.cfg.sliding_window)
  inv = jnp.asarray(rope_inv_freq(model.cfg), jnp.float32)
  h = model.embed(tokens)
  for i, layer in enumerate(model.layers):
    taps = _layer_taps(layer, h, pos, inv, mask)
    yield i, {g: x.reshape(-1, x.shape[-1]) for g, x in taps.items()}
    h = _layer_out(layer, h, pos, inv, mask)


def get_proj(model: LlamaForCausalLM, layer: int, name: str) -> Linear | LowRankLinear:
  """The projection module ``name`` (``q_proj`` ... ``down_proj``) of layer ``layer``."""
  _check_layer(model, layer)
  return get_proj_module(model.layers[layer], name)


def set_proj(model: LlamaForCausalLM, layer: int, name: str, module: nnx.Module) -> None:
  """Replace projection ``name`` of layer ``layer`` (e.g. a Linear by a LowRankLinear)."""
  _check_layer(model, layer)
  old = get_proj_module(model.layers[layer], name)
  want = (old.in_features, old.out_features)
  got = (getattr(module, "in_features", None), getattr(module, "out_features", None))
  if got != want:
    raise ValueError(f"layer {layer} {name}: replacement (in, out)={got} must be {want}")
  if (old.bias is None) != (getattr(module, "bias", None) is None):
    raise ValueError(
      f"layer {layer} {name}: replacement must {'' if old.bias is not None else 'not '}"
      "have a bias, like the module it replaces"
    )
  setattr(model.layers[layer].attn if name in ATTN_PROJS else model.layers[layer].mlp, name, module)


def _check_layer(model, layer):
  if not 0 <= layer < len(model.layers):
    raise ValueError(f"{layer=} must be in [0, {len(model.layers)})")


__all__ = ["GROUPS", "PROJ_GROUP", "PROJ_NAMES", "get_proj", "layer_inputs", "set_proj"]
