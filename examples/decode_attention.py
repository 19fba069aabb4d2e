"""Decode attention over a KV cache: the primitive every model decode step binds, what serves it
on this machine, and its result against the reference.

  python examples/decode_attention.py

On an NVIDIA GPU the registry lowers it to jax's Pallas flash-decoding kernel (bf16/f16, cache
lengths it can split) or, for other lengths, to lrjax's Triton kernel; elsewhere XLA runs the
reference. docs/kernels.md has the H100 timings.
"""

import jax
import jax.numpy as jnp

from lrjax.lowering import decode_attention, decode_attention_reference, registry


def main():
  b, hq, hkv, t, d = 4, 32, 8, 1024, 128  # Llama-3-8B heads, a 1024-position cache
  dtype = jnp.bfloat16
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (b, hq, d), dtype)
  k = jax.random.normal(kk, (b, hkv, t, d), dtype)  # the cache's layout: [B, Hkv, T, D]
  v = jax.random.normal(kv, (b, hkv, t, d), dtype)
  pos = jnp.asarray([0, 100, 511, t - 1], jnp.int32)  # each row's position (its last key)

  platform = "cuda" if jax.default_backend() == "gpu" else jax.default_backend()
  sel = registry.select("decode_attention", platform, (q, k, v, pos), {"window": None})
  print(f"on {platform}: decode_attention -> {sel.name}")
  for name, why in sel.declined:
    print(f"  {name} declined: {why}")

  out = jax.jit(decode_attention)(q, k, v, pos)
  ref = decode_attention_reference(q, k, v, pos)
  err = jnp.linalg.norm((out - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32))
  print(f"out {out.shape} {out.dtype}; relative difference from the reference: {float(err):.1e}")

  # As a model's decode step does: the whole cache buffer, with every row inside the first
  # ``length`` positions (the engine's attend bucket); the kernel reads the buffer in place.
  pos = jnp.asarray([0, 100, 300, 511], jnp.int32)
  out = jax.jit(lambda *a: decode_attention(*a, length=512))(q, k, v, pos)
  ref = decode_attention_reference(q, k[:, :, :512], v[:, :, :512], pos)
  err = jnp.linalg.norm((out - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32))
  print(f"bounded by length=512 of {t}: relative difference {float(err):.1e}")


if __name__ == "__main__":
  main()
