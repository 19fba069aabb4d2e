"""Decode attention over a KV cache: the primitives a model's decode step binds, what serves
them on this machine, and their results against the references.

  python examples/decode_attention.py

``decode_attention``: on an NVIDIA GPU the registry lowers it to jax's Pallas flash-decoding
kernel (bf16/f16, cache lengths it can split) or, for other lengths, to lrjax's Triton kernel;
on a CPU (f32) to lrjax's C++ kernel, which reads the cache in place (an AVX2 body on x86 with
AVX2 and FMA, else a portable one); elsewhere XLA runs the reference.
``decode_attention_append`` (what a model's decode step binds): the new token's RoPE and cache
writes, then ``decode_attention``; its CUDA kernel does all three in the attention's launches.
docs/kernels.md and docs/cpu_w4a8.md have the timings.
"""

import jax
import jax.numpy as jnp

from lrjax.lowering import (
  decode_attention,
  decode_attention_append,
  decode_attention_append_reference,
  decode_attention_reference,
  registry,
)
from lrjax.lowering.decode_attention import rope_tables


def main():
  b, hq, hkv, t, d = 4, 32, 8, 1024, 128  # Llama-3-8B heads, a 1024-position cache
  # bf16 on a GPU; f32 on a CPU, the dtype its kernel takes
  dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
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
  if sel.kernel is not None and sel.kernel.name == "cpu.decode_attention":
    from lrjax.custom_calls.cpu import _w4a8

    print(f"  its body for head dim {d}: {_w4a8.attention_isa(d)}")

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

  # A decode step's whole attention: q and the new key before RoPE, the new value, the cache
  # without them; back come the output and the cache with the new rows written.
  kn, vn = (jax.random.normal(key, (b, hkv, d), dtype) for key in jax.random.split(kq, 2))
  inv_freq = 1.0 / (500000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  cos, sin = rope_tables(pos, inv_freq, dtype)
  ops = (q, kn, vn, k, v, pos, cos, sin)
  sel = registry.select("decode_attention_append", platform, ops, {"window": None})
  print(f"on {platform}: decode_attention_append -> {sel.name}")
  for name, why in sel.declined:
    print(f"  {name} declined: {why}")
  out, k2, _ = jax.jit(lambda *a: decode_attention_append(*a, length=512))(*ops)
  ref, kr, _ = decode_attention_append_reference(*ops, length=512)
  err = jnp.linalg.norm((out - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32))
  rows = int(jnp.sum(jnp.any(k2 != k, axis=-1)))
  print(f"append: relative difference {float(err):.1e}; {rows} key rows written (a row a KV head)")


if __name__ == "__main__":
  main()
