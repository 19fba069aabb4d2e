"""``attention``: the models' softmax attention with GQA and a boolean mask, as a primitive, for
prefill (a prompt's queries against its own keys, or a chunk's against the cache).

  q    [B, S, Hq, D]     the queries, RoPE already applied
  k, v [B, T, Hkv, D]    the keys and values (``heads_first``: [B, Hkv, T, D], the cache's
                         layout)
  mask [B, S, T] bool    key t is visible to query s of row b iff mask[b, s, t]
  → [B, S, Hq·D] in q's dtype; query head j attends with KV head j // (Hq / Hkv).

The reference is :func:`lrjax.lowering.decode_attention.attend` (scores in f32 over every key,
masked ones set to the f32 minimum, softmax, then p·V): a query that sees no key gets the mean
of v over all T. XLA lowers it as written, materializing the [B, Hkv, G, S, T] scores. On CPUs a
C++ kernel serves f32 calls (custom_calls/cpu/attention.py): each query's scores over its
visible keys only, a block of queries reading each key and value row once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive

from lrjax.lowering import primitives
from lrjax.lowering.decode_attention import attend

attention_p = Primitive("attention")


def _check(q, k, v, mask, heads_first):
  if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
    raise ValueError(
      f"attention: q {q.shape} must be [B, S, Hq, D] and k {k.shape}, v {v.shape} one "
      f"[B, {'Hkv, T' if heads_first else 'T, Hkv'}, D] shape"
    )
  b, s, hq, d = q.shape
  kb, t, hkv, kd = (k.shape[0], k.shape[2], k.shape[1], k.shape[3]) if heads_first else k.shape
  if kb != b or kd != d or hq % hkv:
    raise ValueError(
      f"attention: k {k.shape} must have B={b}, D={d} and a KV head count dividing Hq={hq}"
    )
  if mask.shape != (b, s, t) or mask.dtype != jnp.bool_:
    raise ValueError(f"attention: mask {mask.shape} {mask.dtype}: expected bool [{b}, {s}, {t}]")


def attention(q, k, v, mask, *, heads_first: bool = False):
  """Softmax attention of q [B,S,Hq,D] over k, v [B,T,Hkv,D] (``heads_first``: [B,Hkv,T,D])
  where mask [B,S,T] is true → [B, S, Hq·D]; the registry picks its kernel per platform."""
  q, k, v, mask = (jnp.asarray(a) for a in (q, k, v, mask))
  _check(q, k, v, mask, heads_first)
  return attention_p.bind(q, k, v, mask, heads_first=bool(heads_first))


def attention_reference(q, k, v, mask, *, heads_first: bool = False):
  """Pure-jnp reference of :func:`attention` (also its default lowering)."""
  _check(q, k, v, mask, heads_first)
  return attend(q, k, v, mask, heads_first=heads_first)


def _reference(q, k, v, mask, *, heads_first):
  return attend(q, k, v, mask, heads_first=heads_first)


@attention_p.def_abstract_eval
def _abstract(q, k, v, mask, *, heads_first):
  _check(q, k, v, mask, heads_first)
  b, s, hq, d = q.shape
  return jax.core.ShapedArray((b, s, hq * d), q.dtype)


def _batch(args, dims, **params):
  """vmap runs the reference."""
  return jax.vmap(lambda *a: _reference(*a, **params), in_axes=dims)(*args), 0


primitives.register_reference(attention_p, _reference, batch=_batch)
