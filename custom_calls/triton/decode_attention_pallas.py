"""Decode attention over a dense KV cache on NVIDIA GPUs through jax's Pallas flash-decoding
kernel (``jax.experimental.pallas.ops.gpu.decode_attention.gqa``): the first choice of
``decode_attention``'s CUDA lowering, a well-kept implementation that fits our cache layout.
lrjax's own kernel (decode_attention.py) serves the cache lengths this one declines.

That kernel splits the keys of each (row, KV head) into ``k_splits`` programs; a program loads
the G query heads of its KV head once (padded to 16 rows for the tensor cores), walks its
split in blocks of ``block_k`` keys with an online softmax and stops at the row's last
visible key, so a short sequence in a long cache reads only its own length. The splits'
partial results are merged in f32 by XLA (four fusions after the kernel). It takes the cache
as [B, T, Hkv, D] and transposes it to [B, Hkv, T, D] itself; ours is already in that
layout, and XLA removes the two transposes.

The split count trades parallelism (B·Hkv·k_splits programs against the GPU's SMs) for the
merge's extra traffic; :func:`plan` picks it for the attended ``length`` keys. A cache buffer
longer than ``length`` is passed whole (a slice would be a copy) and split into the same
split size throughout; the splits past a row's last key return at once. Where that would
take more than ``MAX_BUFFER_SPLITS`` splits, the first ``length`` keys are sliced (copied).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from lrjax.custom_calls.triton import policy

# f32 stays on XLA: the kernel's dots run on TF32 tensor cores (4e-4 relative error on an H100)
PALLAS_MODULE = "jax.experimental.pallas.ops.gpu.decode_attention"
BLOCK_K = 128  # keys per inner step (the Pallas kernel's default for gqa)
MIN_SPLIT = 16  # the Pallas kernel needs at least 16 keys per split
TARGET_PROGRAMS = 256  # about two programs per SM on an H100 (132 SMs) or H200 (132)
MAX_SPLITS = 32
MAX_BUFFER_SPLITS = 128  # splits over a whole buffer (most of them past every row's last key)


@dataclasses.dataclass(frozen=True)
class Plan:
  k_splits: int
  block_k: int


def _pow2(n: int) -> bool:
  return n > 0 and not n & (n - 1)


def plan(b: int, hkv: int, t: int, k_splits: int | None = None) -> Plan | str:
  """The split count and key block for a [b, hkv, t, .] cache, or why none fits.

  Default split count: the smallest power of two that gives ``TARGET_PROGRAMS`` programs and
  at most the tuning table's ``decode_attention.max_split_keys`` keys a split (0: no bound),
  at most ``MAX_SPLITS``, among those the kernel accepts (t divisible into splits of >= 16
  keys, a power-of-two block of keys dividing each split)."""
  options = []
  for ks in (k_splits,) if k_splits is not None else [2**i for i in range(6)]:
    if ks > MAX_SPLITS or t % ks:
      continue
    split = t // ks
    bk = min(BLOCK_K, split)
    if split >= MIN_SPLIT and _pow2(bk) and split % bk == 0:
      options.append(Plan(ks, bk))
  if not options:
    why = f"k_splits={k_splits}" if k_splits is not None else "any split count up to 32"
    return (
      f"cache length {t} does not divide into {why} with >= {MIN_SPLIT} keys per split and a "
      "power-of-two key block (the engine's attend buckets, powers of two >= 128, always do)"
    )
  max_keys = policy.values("decode_attention").max_split_keys
  for p in options:
    if b * hkv * p.k_splits >= TARGET_PROGRAMS and (not max_keys or t <= p.k_splits * max_keys):
      return p
  return options[-1]


def buffer_plan(p: Plan, t: int, length: int) -> Plan | None:
  """``p``, planned for the first ``length`` keys, stretched over a whole buffer of ``t`` keys
  in splits of the same size; None where that does not divide or takes too many splits."""
  split = length // p.k_splits
  if t % split or t // split > MAX_BUFFER_SPLITS:
    return None
  return Plan(t // split, p.block_k)


def shape_reason(q_shape, k_shape, dtypes, length: int | None = None) -> str | None:
  """Why the kernel cannot take these operands (None: it can)."""
  from lrjax.custom_calls.triton.lowering import decode_attention_shape_reason

  reason = decode_attention_shape_reason(q_shape, dtypes)  # the same dtypes and head dims
  if reason is not None:
    return reason
  b, hkv, t = q_shape[0], k_shape[1], k_shape[2]
  p = plan(b, hkv, t if length is None else length)
  return p if isinstance(p, str) else None


@functools.partial(jax.jit, static_argnames=("window", "length", "k_splits", "interpret"))
def decode_attention(q, k, v, pos, *, window=None, length=None, k_splits=None, interpret=False):
  """q [B, Hq, D], k/v [B, Hkv, T, D], pos [B] → [B, Hq·D] (the primitive's semantics).
  ``k_splits``: splits of the first ``length`` keys (default: :func:`plan`'s).
  ``interpret``: Pallas's interpreter (any platform; tests)."""
  import importlib
  import warnings

  with warnings.catch_warnings():  # jax 0.11 marks the module deprecated on import
    warnings.simplefilter("ignore", DeprecationWarning)
    pallas_decode = importlib.import_module(PALLAS_MODULE)

  b, hq, d = q.shape
  _, hkv, t, _ = k.shape
  length = t if length is None else length
  p = plan(b, hkv, length, k_splits)
  if isinstance(p, str):
    raise ValueError(p)
  if length < t:
    whole = buffer_plan(p, t, length)
    if whole is None:
      k, v = k[:, :, :length], v[:, :, :length]
    else:
      p = whole
  pos = pos.astype(jnp.int32)
  start = None if window is None else jnp.maximum(pos - (window - 1), 0)
  o = pallas_decode.gqa(
    q,
    k.swapaxes(1, 2),  # gqa swaps back: XLA cancels the pair
    v.swapaxes(1, 2),
    start_idx=start,
    kv_seq_len=pos + 1,
    k_splits=p.k_splits,
    block_k=p.block_k,
    interpret=interpret,
  )
  return o.reshape(b, hq * d).astype(q.dtype)


def decode_attention_reference(q, k, v, pos, *, window=None, length=None):
  """The primitive's XLA reference (lowering/decode_attention.py): the models' attention."""
  from lrjax.lowering.decode_attention import decode_attention_reference as ref

  return ref(q, k, v, pos, window=window, length=length)
