"""``decode_attention``: one decode step of softmax attention over a (dense) KV cache.

  q    [B, Hq, D]        the new token's queries, RoPE already applied
  k, v [B, Hkv, T, D]    the cache buffers in their own layout (lrjax.models.llama.KVCache),
                         the new key and value already written
  pos  [B] int32         key t is visible to row b iff t <= pos[b] (and pos[b] - t < window)
  length (static)        keys at or past ``length`` (default T) are never visible: every
                         pos[b] < length. The model's ``attend_len``.
  → [B, Hq·D] in q's dtype; query head j attends with KV head j // (Hq / Hkv).

The reference is the model's own attention (XLA's reduce and select fusions over the first
``length`` keys). On NVIDIA GPUs a flash-decoding kernel serves it
(custom_calls/triton/decode_attention.py): the cache is split along T over many programs,
each reads only the filled part of its split, and the splits' partial softmaxes are merged.
The kernel reads the whole buffers in place; slicing them to ``length`` first would copy
them (XLA cannot pass a strided slice to a custom call).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive

from lrjax.lowering import primitives

decode_attention_p = Primitive("decode_attention")


def _check(q, k, v, pos):
  if q.ndim != 3 or k.ndim != 4 or v.shape != k.shape:
    raise ValueError(
      f"{q.shape=} {k.shape=} {v.shape=}: expected q [B, Hq, D] and k, v [B, Hkv, T, D]"
    )
  b, hq, d = q.shape
  if k.shape[0] != b or k.shape[3] != d or hq % k.shape[1]:
    raise ValueError(
      f"{q.shape=} {k.shape=}: batch and head dim must agree and Hq must be a multiple of Hkv"
    )
  for name, a in (("q", q), ("k", k), ("v", v)):
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise ValueError(f"{name}.dtype={a.dtype}: expected a floating dtype")
  if pos.shape != (b,) or not jnp.issubdtype(pos.dtype, jnp.integer):
    raise ValueError(f"{pos.shape=} {pos.dtype=}: expected [{b}] integer positions")


def _check_length(length, t: int) -> int | None:
  if length is None:
    return None
  if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= t:
    raise ValueError(f"{length=}: expected a Python int in [1, {t}] (the cache length), or None")
  return None if length == t else length


def decode_attention(q, k, v, pos, *, window=None, length=None):
  """Decode attention over a KV cache (see the module docstring)."""
  _check(q, k, v, pos)
  if window is not None and (isinstance(window, bool) or int(window) < 1):
    raise ValueError(f"{window=}: expected a sliding window of >= 1 keys, or None")
  return decode_attention_p.bind(
    q,
    k,
    v,
    jnp.asarray(pos, jnp.int32),
    window=None if window is None else int(window),
    length=_check_length(length, k.shape[2]),
  )


def visible(pos, t: int, window):
  """[B, T] bool: key t is visible to the row at ``pos`` (causal, inside the window)."""
  kpos = jnp.arange(t, dtype=jnp.int32)[None]
  m = kpos <= pos[:, None]
  if window is not None:
    m = m & (pos[:, None] - kpos < window)
  return m


def attend(q, k, v, mask, heads_first: bool = False):
  """Softmax attention with GQA (the models' attention). q [B,S,H,D], k/v [B,T,KV,D] (or
  [B,KV,T,D] with ``heads_first``, the cache's layout), mask [B,S,T] bool → [B,S,H·D]."""
  b, s, h, d = q.shape
  kvh = k.shape[1 if heads_first else 2]
  kv = "bktd" if heads_first else "btkd"
  q = q.reshape(b, s, kvh, h // kvh, d)
  scores = jnp.einsum(f"bskgd,{kv}->bkgst", q, k).astype(jnp.float32) / math.sqrt(d)
  scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
  p = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  o = jnp.einsum(f"bkgst,{kv}->bskgd", p, v)
  return o.reshape(b, s, h * d)


def _reference(q, k, v, pos, *, window, length=None):
  """The models' attention of the one query over the first ``length`` keys, masked."""
  if length is not None:
    k, v = k[:, :, :length], v[:, :, :length]
  mask = visible(pos, k.shape[2], window)[:, None]
  dt = q.dtype
  return attend(q[:, None], k.astype(dt), v.astype(dt), mask, heads_first=True)[:, 0]


def decode_attention_reference(q, k, v, pos, *, window=None, length=None):
  """Pure-jnp reference of :func:`decode_attention` (also its default lowering)."""
  _check(q, k, v, pos)
  length = _check_length(length, k.shape[2])
  return _reference(q, k, v, jnp.asarray(pos, jnp.int32), window=window, length=length)


@decode_attention_p.def_abstract_eval
def _abstract(q, k, v, pos, *, window, length):
  _check(q, k, v, pos)
  _check_length(length, k.shape[2])
  return jax.core.ShapedArray((q.shape[0], q.shape[1] * q.shape[2]), q.dtype)


def _batch(args, dims, **params):
  """Every operand is per sequence: vmap runs the reference."""
  return jax.vmap(lambda *a: _reference(*a, **params), in_axes=dims)(*args), 0


primitives.register_reference(decode_attention_p, _reference, batch=_batch)


# ----------------------------------------------------------------- decode_attention_append

decode_attention_append_p = Primitive("decode_attention_append")
decode_attention_append_p.multiple_results = True


def rope_tables(pos, inv_freq, dtype):
  """cos, sin [B, D] at positions ``pos`` [B] for ``inv_freq`` [D/2], in ``dtype``: the models'
  rotate-half tables (lrjax.models.llama.apply_rope) for one token a row."""
  ang = jnp.asarray(pos).astype(jnp.float32)[:, None] * inv_freq
  ang = jnp.concatenate([ang, ang], axis=-1)
  return jnp.cos(ang).astype(dtype), jnp.sin(ang).astype(dtype)


def rope(x, cos, sin):
  """Rotate-half RoPE of x [..., D] with cos, sin broadcast to it, in x's dtype."""
  x1, x2 = jnp.split(x, 2, axis=-1)
  return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def _append_check(q, k_new, v_new, k_cache, v_cache, pos, cos, sin):
  _check(q, k_cache, v_cache, pos)
  b, _, d = q.shape
  want = (b, k_cache.shape[1], d)
  if k_new.shape != want or v_new.shape != want:
    raise ValueError(f"{k_new.shape=} {v_new.shape=}: expected [B, Hkv, D] = {list(want)}")
  if cos.shape != (b, d) or sin.shape != (b, d) or d % 2:
    raise ValueError(f"{cos.shape=} {sin.shape=}: expected [B, D] = [{b}, {d}] with D even")


def decode_attention_append(
  q, k_new, v_new, k_cache, v_cache, pos, cos, sin, *, window=None, length=None
):
  """One decode step's attention with the new token's RoPE and cache write:

    q [B, Hq, D] and k_new, v_new [B, Hkv, D]   the new token's, before RoPE
    k_cache, v_cache [B, Hkv, T, D]             the cache buffers, the new row not yet written
    pos [B] int32; cos, sin [B, D]              its positions and RoPE's tables there, in q's
                                                dtype (:func:`rope_tables`)
    → (out [B, Hq·D], k_cache with rope(k_new) at pos, v_cache with v_new at pos)

  Its reference is the models' ops one after another (:func:`decode_attention_append_reference`);
  on NVIDIA GPUs a kernel may do the RoPE and the writes inside the attention's own launch
  (custom_calls/triton/decode_attention_append.py)."""
  _append_check(q, k_new, v_new, k_cache, v_cache, pos, cos, sin)
  if window is not None and (isinstance(window, bool) or int(window) < 1):
    raise ValueError(f"{window=}: expected a sliding window of >= 1 keys, or None")
  return tuple(
    decode_attention_append_p.bind(
      q,
      k_new,
      v_new,
      k_cache,
      v_cache,
      jnp.asarray(pos, jnp.int32),
      cos,
      sin,
      window=None if window is None else int(window),
      length=_check_length(length, k_cache.shape[2]),
    )
  )


def decode_attention_append_reference(
  q, k_new, v_new, k_cache, v_cache, pos, cos, sin, *, window=None, length=None
):
  """What a model's decode step runs without the fused op: RoPE of q and k_new, the cache
  writes (positions past T dropped), the ``decode_attention`` primitive."""
  _append_check(q, k_new, v_new, k_cache, v_cache, pos, cos, sin)
  pos = jnp.asarray(pos, jnp.int32)
  length = _check_length(length, k_cache.shape[2])
  return _append_reference(
    q, k_new, v_new, k_cache, v_cache, pos, cos, sin, window=window, length=length
  )


def _append_reference(q, k_new, v_new, k_cache, v_cache, pos, cos, sin, *, window, length):
  q = rope(q, cos[:, None], sin[:, None])
  k_new = rope(k_new, cos[:, None], sin[:, None])
  rows = jnp.arange(q.shape[0])
  k_cache = k_cache.at[rows, :, pos].set(k_new.astype(k_cache.dtype), mode="drop")
  v_cache = v_cache.at[rows, :, pos].set(v_new.astype(v_cache.dtype), mode="drop")
  out = decode_attention(q, k_cache, v_cache, pos, window=window, length=length)
  return out, k_cache, v_cache


@decode_attention_append_p.def_abstract_eval
def _append_abstract(q, k_new, v_new, k_cache, v_cache, pos, cos, sin, *, window, length):
  _append_check(q, k_new, v_new, k_cache, v_cache, pos, cos, sin)
  out = jax.core.ShapedArray((q.shape[0], q.shape[1] * q.shape[2]), q.dtype)
  return (
    out,
    jax.core.ShapedArray(k_cache.shape, k_cache.dtype),
    jax.core.ShapedArray(v_cache.shape, v_cache.dtype),
  )


def _append_batch(args, dims, **params):
  """Every operand is per sequence: vmap runs the reference."""
  outs = jax.vmap(lambda *a: _append_reference(*a, **params), in_axes=dims)(*args)
  return outs, [0, 0, 0]


# a kernel runs on one device or on a per-device program's local shards, else the reference
# (partitioning.LOCAL_ONLY)
primitives.register_reference(decode_attention_append_p, _append_reference, batch=_append_batch)
