"""``lr_kv_attention``: one decode step of attention over a low-rank KV cache.

The cache (lrjax.serving.lowrank_kv) holds the rank-space activations zk = x·u_k and
zv = x·u_v of every past token, not K and V. V is never rebuilt, in the
reference or the kernels: softmax(s)·(zv·v_v) = (softmax(s)·zv)·v_v, and because the weights
sum to 1, b_v is added once at the end. The reference rebuilds K = rope(zk·v_k + b_k) for the
whole cache (RoPE does not commute with ·v_k); a kernel can instead rebuild K block by block on
chip, FlashSVD-style.

  q        [B, Hq, D]   the new token's queries, RoPE already applied
  zk, zv   [B, T, r_k], [B, T, r_v]   the cache (T = its static length)
  vk, vv   [r_k, Hkv·D], [r_v, Hkv·D]   the second factors of k_proj / v_proj
  pos      [B] int32    key t is visible to row b iff t <= pos[b] (and pos[b] - t < window)
  inv_freq [D/2] f32    RoPE inverse frequencies (rotate-half)
  bk, bv   optional [Hkv·D]
  → [B, Hq·D] in q's dtype; query head j attends with KV head j // (Hq / Hkv).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching

from lrjax.lowering import primitives

lr_kv_attention_p = Primitive("lr_kv_attention")


def _check(q, zk, zv, vk, vv, pos, inv_freq, bk, bv):
  if q.ndim != 3 or zk.ndim != 3 or zv.ndim != 3 or vk.ndim != 2 or vv.ndim != 2:
    raise ValueError(
      f"{q.shape=} {zk.shape=} {zv.shape=} {vk.shape=} {vv.shape=}: expected "
      "q [B, Hq, D], zk [B, T, r_k], zv [B, T, r_v], vk [r_k, Hkv·D], "
      "vv [r_v, Hkv·D]"
    )
  b, hq, d = q.shape
  if zk.shape[0] != b or zv.shape[:2] != zk.shape[:2]:
    raise ValueError(
      f"{q.shape=} {zk.shape=} {zv.shape=}: the batch B and cache length T must agree"
    )
  if vk.shape[0] != zk.shape[2] or vv.shape[0] != zv.shape[2]:
    raise ValueError(
      f"{zk.shape=} {vk.shape=} {zv.shape=} {vv.shape=}: vk must be [r_k, ...] and vv [r_v, ...]"
    )
  if vk.shape[1] != vv.shape[1] or d % 2 or vk.shape[1] % d or hq % (vk.shape[1] // d):
    raise ValueError(
      f"{q.shape=} {vk.shape=} {vv.shape=}: expected vk and vv [., Hkv·D] with "
      "an even head dim D and Hq a multiple of Hkv"
    )
  if pos.shape != (b,) or not jnp.issubdtype(pos.dtype, jnp.integer):
    raise ValueError(f"{pos.shape=} {pos.dtype=}: expected [{b}] integer positions")
  if inv_freq.shape != (d // 2,):
    raise ValueError(f"{inv_freq.shape=}: expected [{d // 2}] (head dim / 2)")
  for name, a in (("bk", bk), ("bv", bv)):
    if a is not None and a.shape != (vk.shape[1],):
      raise ValueError(f"{name}.shape={a.shape}: expected [{vk.shape[1]}]")


def lr_kv_attention(q, zk, zv, vk, vv, pos, inv_freq, bk=None, bv=None, *, window=None):
  """Decode attention over a low-rank KV cache (see the module docstring)."""
  _check(q, zk, zv, vk, vv, pos, inv_freq, bk, bv)
  if window is not None and int(window) < 1:
    raise ValueError(f"{window=}: expected a sliding window of >= 1 keys, or None")
  return lr_kv_attention_p.bind(
    *_operands(q, zk, zv, vk, vv, pos, inv_freq, bk, bv),
    has_bk=bk is not None,
    has_bv=bv is not None,
    window=None if window is None else int(window),
  )


def _operands(q, zk, zv, vk, vv, pos, inv_freq, bk, bv):
  """The bound operand tuple: positions as int32, frequencies as f32, biases only if given."""
  ops = (q, zk, zv, vk, vv, jnp.asarray(pos, jnp.int32), jnp.asarray(inv_freq, jnp.float32))
  return ops + tuple(a for a in (bk, bv) if a is not None)


def split_operands(ops, has_bk, has_bv):
  """(q, zk, zv, vk, vv, pos, inv_freq, bk | None, bv | None) from the bound operands."""
  rest = list(ops[7:])
  bk = rest.pop(0) if has_bk else None
  bv = rest.pop(0) if has_bv else None
  return (*ops[:7], bk, bv)


def _reference(*ops, has_bk, has_bv, window):
  """Rebuild K for the whole cache (in the factors' dtype), RoPE it, masked softmax, then
  fold V: (p·zv)·v_v + b_v, never V = zv·v_v itself."""
  from lrjax.models.llama import _mask, apply_rope

  q, zk, zv, vk, vv, pos, inv, bk, bv = split_operands(ops, has_bk, has_bv)
  b, t = zk.shape[:2]
  _, hq, d = q.shape
  hkv = vk.shape[1] // d
  dt, f32 = vk.dtype, jnp.float32
  k = jnp.matmul(zk.astype(dt), vk)
  if bk is not None:
    k = k + bk.astype(dt)
  kpos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  k = apply_rope(k.reshape(b, t, hkv, d), kpos, inv).astype(q.dtype)
  mask = _mask(pos[:, None], kpos, kpos <= pos[:, None], window)[:, 0]  # [B, T]
  # the query as a length-1 sequence: XLA:CPU ran "bkgd,btkd->bkgt" 2.5x slower in a decode loop
  qg = q.reshape(b, 1, hkv, hq // hkv, d)
  s = jnp.einsum("bskgd,btkd->bkgst", qg, k, preferred_element_type=f32)[:, :, :, 0]
  s = jnp.where(mask[:, None, None], s / math.sqrt(d), jnp.finfo(f32).min)
  p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
  pz = jnp.einsum("bkgt,btr->bkgr", p, zv.astype(q.dtype), preferred_element_type=f32)
  return fold_values(pz, vv, bv, q.dtype)


def fold_values(pz, vv, bv, dtype):
  """The attention output from the softmax-weighted rank-space values pz [B, Hkv, G, r_v]:
  pz·v_v[:, head] + b_v (the weights of every row sum to 1) → [B, Hkv·G·D] in ``dtype``.
  Shared by the reference and the kernels' split merge."""
  b, hkv, g, rv = pz.shape
  d = vv.shape[1] // hkv
  o = jnp.einsum(
    "bkgr,rkd->bkgd",
    pz.astype(vv.dtype),
    vv.reshape(rv, hkv, d),
    preferred_element_type=jnp.float32,
  )
  if bv is not None:
    o = o + bv.astype(jnp.float32).reshape(hkv, 1, d)
  return o.reshape(b, hkv * g * d).astype(dtype)


def lr_kv_attention_reference(q, zk, zv, vk, vv, pos, inv_freq, bk=None, bv=None, *, window=None):
  """Pure-jnp reference of :func:`lr_kv_attention` (also its default lowering)."""
  return _reference(
    *_operands(q, zk, zv, vk, vv, pos, inv_freq, bk, bv),
    has_bk=bk is not None,
    has_bv=bv is not None,
    window=window,
  )


@lr_kv_attention_p.def_abstract_eval
def _abstract(*ops, has_bk, has_bv, window):
  q, zk, zv, vk, vv, pos, inv, bk, bv = split_operands(ops, has_bk, has_bv)
  _check(q, zk, zv, vk, vv, pos, inv, bk, bv)
  return jax.core.ShapedArray((q.shape[0], q.shape[1] * q.shape[2]), q.dtype)


primitives.register_reference(lr_kv_attention_p, _reference)


def _batch(args, dims, **params):
  """Every operand but the weights is per sequence, so vmap runs the reference."""
  return jax.vmap(lambda *a: _reference(*a, **params), in_axes=dims)(*args), 0


batching.primitive_batchers[lr_kv_attention_p] = _batch
