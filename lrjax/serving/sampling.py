"""Per-request sampling parameters and the on-device sampler (greedy / temperature / top-k / top-p)."""  # noqa: E501

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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
    t, k, p, m = self.temperature, self.top_k, self.top_p, self.max_new_tokens
    if not isinstance(t, (int, float)) or not t >= 0.0 or t != t or t == float("inf"):
      raise ValueError(f"temperature={t!r} must be a finite number >= 0 (0 means greedy)")
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
      raise ValueError(f"top_k={k!r} must be an int >= 0 (0 disables top-k)")
    if not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
      raise ValueError(f"top_p={p!r} must be in (0, 1] (1 disables top-p)")
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
      raise ValueError(f"max_new_tokens={m!r} must be an int >= 1")
    stops = tuple(self.stop_tokens)
    if any(not isinstance(s, int) or s < 0 for s in stops):
      raise ValueError(f"stop_tokens={stops!r} must be non-negative ints")
    object.__setattr__(self, "stop_tokens", stops)


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
