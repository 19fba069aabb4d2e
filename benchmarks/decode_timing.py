"""A greedy decode loop inside one jit, timed on the host (shared by tp_gpu.py, lowrank_kv.py;
model_step_peer.py uses the loop).

``steps`` decode steps run in a ``fori_loop``, so one dispatch and one host sync cover them all;
the cache is donated. The first two calls compile (the second for the committed sharding of the
tokens the first returned) and are not timed.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def greedy_loop(gdef, decode, steps, cache_shardings=None, compiler_options=None):
  """jit(state, cache, tokens) -> (cache, tokens) running ``decode(model, tokens, cache)``
  ``steps`` times with argmax sampling; the cache comes out with ``cache_shardings`` where
  given, and XLA compiles it with ``compiler_options``."""

  def run(state, cache, tokens):
    model = nnx.merge(gdef, state)

    def body(_, carry):
      cache, tok = carry
      logits, cache = decode(model, tok, cache)
      return cache, jnp.argmax(logits, -1).astype(jnp.int32)

    return jax.lax.fori_loop(0, steps, body, (cache, tokens))

  kw = {} if cache_shardings is None else {"out_shardings": (cache_shardings, None)}
  return jax.jit(run, donate_argnums=(1,), compiler_options=compiler_options, **kw)


def time_loop(fn, state, cache, tokens, reset, reps):
  """(per-call seconds of ``reps`` timed calls, compile seconds, cache, tokens); ``reset(cache)``
  gives each call the same starting cache (e.g. half full)."""
  t0 = time.perf_counter()
  for _ in range(2):
    cache, tokens = fn(state, reset(cache), tokens)
  tokens.block_until_ready()
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(reps):
    c = reset(cache)
    t0 = time.perf_counter()
    cache, tokens = fn(state, c, tokens)
    tokens.block_until_ready()
    times.append(time.perf_counter() - t0)
  return times, compile_s, cache, tokens


def median_step(times, steps) -> float:
  return float(np.median(times)) / steps
