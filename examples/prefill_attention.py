"""Prefill attention: the ``attention`` primitive a model binds for a prompt (its queries
against its own keys, or a chunk's against the cache), what serves it on this machine, and its
result and time against the reference.

  python examples/prefill_attention.py

On a CPU (f32) the registry lowers it to lrjax's C++ kernel, which computes each query's
scores over its visible keys only; elsewhere XLA runs the reference (every query against every
key, then the mask). docs/cpu_w4a8.md has the timings.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from lrjax.lowering import attention, attention_reference, registry


def timed_ms(fn, *args) -> float:
  jax.block_until_ready(fn(*args))
  t = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return (time.perf_counter() - t) * 1e3


def main():
  s, hq, hkv, d = 512, 32, 8, 64  # a 512-token prompt, Llama-3.2-1B heads
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (1, s, hq, d))  # [B, S, Hq, D], RoPE applied
  k = jax.random.normal(kk, (1, s, hkv, d))  # [B, T, Hkv, D]
  v = jax.random.normal(kv, (1, s, hkv, d))
  mask = jnp.asarray(np.tril(np.ones((s, s), bool))[None])  # causal: query i sees keys <= i

  platform = "cuda" if jax.default_backend() == "gpu" else jax.default_backend()
  sel = registry.select("attention", platform, (q, k, v, mask), {"heads_first": False})
  print(f"on {platform}: attention -> {sel.name}")
  for name, why in sel.declined:
    print(f"  {name} declined: {why}")

  fused, ref = jax.jit(attention), jax.jit(attention_reference)
  out, want = fused(q, k, v, mask), ref(q, k, v, mask)
  err = float(jnp.linalg.norm(out - want) / jnp.linalg.norm(want))
  print(f"out {out.shape} {out.dtype}; relative difference from the reference: {err:.1e}")
  print(f"{timed_ms(fused, q, k, v, mask):.1f} ms against {timed_ms(ref, q, k, v, mask):.1f} ms")


if __name__ == "__main__":
  main()
