"""Decode attention over a low-rank KV cache with ``lr_kv_attention``.

  python examples/lowrank_kv_attention.py        # any platform; on a GPU it also runs the kernel

A low-rank KV cache (lrjax.serving.lowrank_kv) stores zk = x·u_k and zv = x·u_v per token
instead of K and V. ``lrjax.lowering.lr_kv_attention`` is one decode step of attention over it.
Its reference (the default lowering everywhere) rebuilds K = rope(zk·v_k) for the whole
cache and never rebuilds V: it attends with (p·zv)·v_v. On CUDA, the Triton kernel
(custom_calls/triton/kv_attention.py) also rebuilds K block by block on chip. It is opt-in
(``prefer_kernels()``): on the H200 it measured 0.50-0.63x the reference's speed, with
4-270x less temporary memory.
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from lrjax.lowering import force_reference, lr_kv_attention, prefer_kernels
from lrjax.lowering.explain import kernels_for


def main():
  b, hq, hkv, d, t, r = 4, 32, 8, 128, 4096, 512  # Llama-3-8B heads, rank-512 K and V
  ks = jax.random.split(jax.random.key(0), 5)
  dt = jnp.bfloat16
  q = jax.random.normal(ks[0], (b, hq, d), dt)
  zk, zv = (jax.random.normal(k, (b, t, r), dt) for k in ks[1:3])
  vk, vv = (jax.random.normal(k, (r, hkv * d), dt) * r**-0.5 for k in ks[3:5])
  pos = jnp.array([t - 1, 2000, 100, 0], jnp.int32)  # last visible key of each sequence
  inv = jnp.asarray(1.0 / (500000.0 ** (np.arange(0, d, 2) / d)), jnp.float32)
  ops = (q, zk, zv, vk, vv, pos, inv)

  avals = [jax.core.ShapedArray(a.shape, a.dtype) for a in ops]
  params = dict(has_bk=False, has_bv=False, window=None)
  for plat, choice in kernels_for("lr_kv_attention", avals, params).items():
    why = "; ".join(f"{n}: {reason}" for n, reason in choice["declined"]) or "-"
    print(f"{plat:>6}: {choice['kernel']:<24} declined: {why}")

  with force_reference():
    ref = jax.jit(lambda *a: lr_kv_attention(*a)).lower(*ops).compile()
  out = ref(*ops)
  print(
    f"output {out.shape} {out.dtype}; XLA temporaries "
    f"{ref.memory_analysis().temp_size_in_bytes / 1e6:.0f} MB"
  )
  if jax.default_backend() != "gpu":
    return
  with prefer_kernels():
    kern = jax.jit(lambda *a: lr_kv_attention(*a)).lower(*ops).compile()
  err = float(
    jnp.linalg.norm((kern(*ops) - out).astype(jnp.float32))
    / jnp.linalg.norm(out.astype(jnp.float32))
  )
  print(
    f"Triton kernel: relative difference {err:.2e}, temporaries "
    f"{kern.memory_analysis().temp_size_in_bytes / 1e6:.0f} MB"
  )
  for name, f in (("XLA reference", ref), ("Triton kernel", kern)):
    f(*ops).block_until_ready()
    ts = []
    for _ in range(20):
      t0 = time.perf_counter()
      f(*ops).block_until_ready()
      ts.append(time.perf_counter() - t0)
    print(f"{name}: {1e6 * statistics.median(ts):.0f} us per call (host-timed, one call)")


if __name__ == "__main__":
  main()
