"""Low-rank KV cache (DeInfer §4.2, Palu): cache x·U_k and x·U_v, not K and V.

For a layer whose k_proj / v_proj are ``LowRankLinear`` (u [hidden, r], v [r, kv_heads·head_dim])
the cache holds the rank-space activations z_k = x·u_k [T, r_k] and z_v = x·u_v [T, r_v] instead
of K and V [T, kv_heads·head_dim]. It pays off in memory when r_k + r_v < 2·kv_heads·head_dim.
Under ``lowrank_tp`` z is the all-gathered rank-space activation (replicated over "tp"), and
the column-parallel v_k / v_v yield each device's own KV heads.

A decode step (one new token, no q/k norm) binds ``lr_kv_attention``. Its reference rebuilds
K = rope(z_k·v_k) for the whole (static-length) cache, 2·T·r_k·kv_heads·head_dim flops per
sequence and layer, but never V: it forms p·z_v and applies v_v once
(2·heads·r_v·(T + head_dim) flops). Its opt-in CUDA lowering also rebuilds K on chip, block by
block (custom_calls/triton/kv_attention.py). A multi-token prefill (or a q/k-norm layer)
rebuilds K and V for the whole cache and attends as usual.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lrjax.lowering.kv_attention import lr_kv_attention
from lrjax.lowering.attention import attention
from lrjax.models.llama import _mask, apply_rope, decode_mask, rope_inv_freq, write_kv
from lrjax.nn.linear import LowRankLinear


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LowRankKVCache:
  """One buffer per layer (as ``KVCache``): ``zk[i]`` [batch, max_len, r_k], ``zv[i]`` [batch,
  max_len, r_v] (tuples of num_layers arrays); pos [batch] int32."""

  zk: tuple
  zv: tuple
  pos: jax.Array

  @classmethod
  def init(cls, model, batch: int, max_len: int, dtype=jnp.float32) -> LowRankKVCache:
    ranks = kv_ranks(model)
    return cls(
      tuple(jnp.zeros((batch, max_len, rk), dtype) for rk, _ in ranks),
      tuple(jnp.zeros((batch, max_len, rv), dtype) for _, rv in ranks),
      jnp.zeros((batch,), jnp.int32),
    )

  @property
  def max_len(self) -> int:
    return self.zk[0].shape[1]


def kv_ranks(model) -> list[tuple[int, int]]:
  """(r_k, r_v) of each layer; ValueError if a k/v projection is not ``LowRankLinear``."""
  ranks = []
  for i, layer in enumerate(model.layers):
    for name in ("k_proj", "v_proj"):
      m = getattr(layer.attn, name)
      if type(m) is not LowRankLinear:
        raise ValueError(
          f"layer {i} {name} is {type(m).__name__}; the low-rank KV cache needs "
          "LowRankLinear k_proj and v_proj in every layer (use the dense cache)"
        )
    ranks.append((int(layer.attn.k_proj.rank), int(layer.attn.v_proj.rank)))
  return ranks


def _rebuild(proj: LowRankLinear, z, dt):
  y = jnp.matmul(z.astype(dt), proj.v[...].astype(dt))
  return y if proj.bias is None else y + proj.bias[...].astype(dt)


def _layer(layer, cfg, h, positions, inv, mask, zk_c, zv_c, write_pos):
  x = layer.input_layernorm(h)
  attn = layer.attn
  b, s, _ = x.shape
  kp, vp = attn.k_proj, attn.v_proj
  dt = kp.dtype or x.dtype
  q = attn.q_proj(x).reshape(b, s, cfg.num_heads, cfg.head_dim)
  zk = jnp.matmul(x.astype(dt), kp.u[...].astype(dt))
  zv = jnp.matmul(x.astype(dt), vp.u[...].astype(dt))
  zk_c, zv_c = write_kv(zk_c, zk, write_pos), write_kv(zv_c, zv, write_pos)
  t = mask.shape[-1]  # attended positions: all, or decode's attend_len
  zk_t, zv_t = zk_c[:, :t], zv_c[:, :t]
  if s == 1 and attn.q_norm is None:  # decode: one primitive; V is never rebuilt
    q = apply_rope(q, positions, inv)
    bias = lambda p: None if p.bias is None else p.bias[...].astype(dt)
    a = lr_kv_attention(
      q[:, 0].astype(dt),
      zk_t.astype(dt),
      zv_t.astype(dt),
      kp.v[...].astype(dt),
      vp.v[...].astype(dt),
      positions[:, 0],
      inv,
      bias(kp),
      bias(vp),
      window=cfg.sliding_window,
    )[:, None].astype(q.dtype)
    h = h + attn.o_proj(a)
    return h + layer.mlp(layer.post_attention_layernorm(h)), zk_c, zv_c
  k = _rebuild(kp, zk_t, dt).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
  v = _rebuild(vp, zv_t, dt).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
  if attn.q_norm is not None:
    q, k = attn.q_norm(q), attn.k_norm(k)
  kpos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  q, k = apply_rope(q, positions, inv), apply_rope(k, kpos, inv)
  a = attention(q, k.astype(q.dtype), v.astype(q.dtype), mask)
  h = h + attn.o_proj(a)
  return h + layer.mlp(layer.post_attention_layernorm(h)), zk_c, zv_c


def _run(model, h, positions, mask, cache, write_pos):
  inv = jnp.asarray(rope_inv_freq(model.cfg), jnp.float32)
  zks, zvs = [], []
  for i, layer in enumerate(model.layers):
    h, zk, zv = _layer(
      layer, model.cfg, h, positions, inv, mask, cache.zk[i], cache.zv[i], write_pos
    )
    zks.append(zk), zvs.append(zv)
  return h, tuple(zks), tuple(zvs)


def prefill(model, tokens, cache: LowRankKVCache, lengths=None):
  """Like ``LlamaForCausalLM.prefill`` with a :class:`LowRankKVCache`."""
  b, s = tokens.shape
  if s > cache.max_len:
    raise ValueError(f"{s=} tokens do not fit in cache max_len={cache.max_len}")
  lengths = jnp.full((b,), s, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  t = jnp.broadcast_to(jnp.arange(cache.max_len, dtype=jnp.int32), (b, cache.max_len))
  mask = _mask(pos, t, t < s, model.cfg.sliding_window)
  h, zk, zv = _run(model, model.embed(tokens), pos, mask, cache, jnp.zeros((b,), jnp.int32))
  return model._logits(h), LowRankKVCache(zk, zv, lengths)


def decode(model, tokens, cache: LowRankKVCache, attend_len: int | None = None):
  """Like ``LlamaForCausalLM.decode`` (``attend_len`` too) with a :class:`LowRankKVCache`."""
  pos = cache.pos[:, None]
  mask = decode_mask(cache.pos, cache.max_len, attend_len, model.cfg.sliding_window)
  h, zk, zv = _run(model, model.embed(tokens[:, None]), pos, mask, cache, cache.pos)
  return model._logits(h)[:, 0], LowRankKVCache(zk, zv, cache.pos + 1)


def bytes_per_token(model, dtype_bytes: int, lowrank: bool) -> int:
  """KV cache bytes per token (all layers)."""
  cfg = model.cfg
  if lowrank:
    return sum(rk + rv for rk, rv in kv_ranks(model)) * dtype_bytes
  return 2 * cfg.num_kv_heads * cfg.head_dim * cfg.num_layers * dtype_bytes
