"""Fuse a low-rank model on a GPU, show the Triton custom calls, and time it against XLA.

  python examples/gpu_lowrank.py            # needs an NVIDIA GPU and `pip install 'lrjax[cuda]'`

The model is a stack of low-rank SwiGLU MLP blocks plus a low-rank output projection, written
in plain jnp (lrjax.nn). ``lrjax.fuse`` rewrites each x·U·V chain into ``lr_xuv`` and each
low-rank MLP into ``lr_mlp``; on CUDA those lower to the Triton kernels of
``lrjax.custom_calls.triton`` where the GPU's tuning table (measured on an H200; other cards
use the nearest table) has them at least as fast as XLA; elsewhere XLA's GEMMs run.
``lrjax.explain`` prints which kernel serves each call, why others declined and which table
decided; ``lrjax.lowering.prefer_kernels()`` around the first call forces the kernels. Without
``fuse`` XLA runs the unfused chains. ``LRJAX_TRITON_LAUNCH`` picks how the kernels launch
(docs/kernels.md): XLA's own calls by default, ``jaxlib`` for jaxlib's Triton handler,
``pdl`` for lrjax's handler with programmatic dependent launches.
"""

import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

import lrjax
from lrjax.nn import LowRankLinear, LowRankMLP


class LowRankStack(nnx.Module):
  def __init__(self, hidden, intermediate, rank, layers, *, rngs):
    kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs)
    seq = nnx.List if hasattr(nnx, "List") else list
    self.mlps = seq([LowRankMLP(hidden, intermediate, (rank,) * 3, **kw) for _ in range(layers)])
    self.out = LowRankLinear(hidden, 4 * hidden, rank, **kw)

  def __call__(self, x):
    for mlp in self.mlps:
      x = x + mlp(x)
    return self.out(x)


def timed(f, x, reps=20):
  f(x).block_until_ready()
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    f(x).block_until_ready()
    ts.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(ts)


def main():
  if jax.default_backend() != "gpu":
    raise SystemExit(f"this example needs a GPU; jax backend is {jax.default_backend()!r}")
  from lrjax.custom_calls.triton import launch_modes

  model = LowRankStack(4096, 14336, 1024, layers=4, rngs=nnx.Rngs(0))
  fused = jax.jit(lrjax.fuse(model))
  plain = jax.jit(lambda x: model(x))
  for tokens in (1, 16, 2048):
    x = jax.random.normal(jax.random.key(tokens), (tokens, 4096), jnp.float32).astype(jnp.bfloat16)
    hlo = fused.lower(x).compile().as_text()
    calls = [
      line.split("kernel_name")[0].strip()[:60]
      for line in hlo.splitlines()
      if launch_modes.count_calls(line)
    ]
    err = float(
      jnp.linalg.norm((fused(x) - plain(x)).astype(jnp.float32))
      / jnp.linalg.norm(plain(x).astype(jnp.float32))
    )
    print(
      f"tokens={tokens}: {len(calls)} Triton custom calls in the compiled HLO, "
      f"rel. diff vs XLA {err:.2e}"
    )
    for c in calls:
      print("   ", c)
    print(
      f"   lrjax.fuse + Triton {timed(fused, x):.3f} ms   XLA unfused {timed(plain, x):.3f} ms "
      "(host-timed whole forward, median)"
    )
  print(lrjax.explain(model, x))


if __name__ == "__main__":
  main()
