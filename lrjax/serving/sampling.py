"""Per-request sampling parameters and the on-device sampler (greedy / temperature / top-k / top-p)."""  # noqa: E501

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """temperature 0 is greedy; top_k 0 and top_p 1.0 disable those filters.

  ``max_new_tokens`` bounds the generated tokens; generation also stops at any of
  ``stop_tokens`` (included in the output) or when the cache row is full.
  """

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  max_new_tokens: int = 16
  stop_tokens: tuple[int, ...] = ()
  seed: int = 0

  def __post_init__(self):
    t, k, p, m, seed = self.temperature, self.top_k, self.top_p, self.max_new_tokens, self.seed
    _check("temperature", t, _is_number, lambda: 0 <= t < float("inf"), "a finite number >= 0")
    _check("top_k", k, _is_int, lambda: k >= 0, "an int >= 0 (0 disables top-k)")
    _check("top_p", p, _is_number, lambda: 0 < p <= 1, "a number in (0, 1] (1 disables top-p)")
    _check("max_new_tokens", m, _is_int, lambda: m >= 1, "an int >= 1")
    _check("seed", seed, _is_int, lambda: 0 <= seed < 2**64, "an int in [0, 2**64)")
    stops = self.stop_tokens
    is_seq = not isinstance(stops, (str, bytes)) and hasattr(stops, "__iter__")
    stops = tuple(stops) if is_seq else stops
    _check(
      "stop_tokens",
      stops,
      lambda v: is_seq and all(_is_int(s) for s in v),
      lambda: all(s >= 0 for s in stops),
      "a sequence of non-negative token ids",
    )
    object.__setattr__(self, "stop_tokens", tuple(int(s) for s in stops))
    object.__setattr__(self, "temperature", float(t))
    object.__setattr__(self, "top_p", float(p))
    object.__setattr__(self, "top_k", int(k))
    object.__setattr__(self, "max_new_tokens", int(m))
    object.__setattr__(self, "seed", int(seed))


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_number(x) -> bool:
  return _is_int(x) or isinstance(x, (float, np.floating))


def _check(name: str, value, type_ok, range_ok, want: str):
  """TypeError for a value of the wrong type, ValueError for one out of range."""
  if not type_ok(value):
    raise TypeError(f"{name}={value!r} ({type(value).__name__}) must be {want}")
  if not range_ok():
    raise ValueError(f"{name}={value!r} must be {want}")


def sample(logits, key, temperature, top_k, top_p):
  """Next token per row. logits [B, V]; temperature/top_p [B] f32; top_k [B] int32 → [B] int32.

  ``key`` is one PRNG key or one per row ([B]). Rows with temperature 0 take the argmax. The
  sorted top-k/top-p path runs only when some row samples.
  """
  logits = logits.astype(jnp.float32)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def sampled(_):
    v = logits.shape[-1]
    order = jnp.argsort(-logits, axis=-1)
    srt = jnp.take_along_axis(logits, order, axis=-1)
    rank = jnp.arange(v)[None, :]
    k = jnp.where(top_k > 0, top_k, v)[:, None]
    keep = rank < k
    t = jnp.maximum(temperature, 1e-6)[:, None]
    probs = jax.nn.softmax(jnp.where(keep, srt / t, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly better tokens
    keep = keep & ((before < top_p[:, None]) | (rank == 0))
    masked = jnp.where(keep, srt / t, -jnp.inf)
    if key.ndim == 1:
      choice = jax.vmap(lambda k, row: jax.random.categorical(k, row))(key, masked)
    else:
      choice = jax.random.categorical(key, masked, axis=-1)
    tok = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, tok, greedy)

  return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda _: greedy, None)
