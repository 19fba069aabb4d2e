"""The main job (`make demo`): the shortest real end-to-end path through lrjax.

1. Build a small low-rank Llama-architecture model (Flax NNX).
2. Run it through ``jax.jit(lrjax.fuse(model))``.
3. Print what the pass rewrote and the agreement with the unfused model.
"""
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import lrjax
from lrjax.models import LlamaForCausalLM, ModelConfig


def timed(fn, *args, iters=20):
  jax.block_until_ready(fn(*args))  # compile + warm up
  t0 = time.perf_counter()
  for _ in range(iters):
    out = fn(*args)
  jax.block_until_ready(out)
  return out, (time.perf_counter() - t0) / iters


def main():
  cfg = ModelConfig.tiny(hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8,
                         num_kv_heads=2, head_dim=32, vocab_size=512)
  # 40% of each projection's parameters removed: r·(K+N) = 0.6·K·N.
  ranks = [{name: int(0.6 * k * n / (k + n)) for name, (k, n) in cfg.proj_shapes().items()}
           for _ in range(cfg.num_layers)]
  model = LlamaForCausalLM(cfg, ranks=ranks, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 64), 0, cfg.vocab_size)

  print(f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, ranks {ranks[0]}")
  print(lrjax.explain(model, tokens))

  unfused = nnx.jit(lambda m, t: m(t))
  fused = nnx.jit(lambda m, t: lrjax.fuse(m)(t))
  ref, t_ref = timed(unfused, model, tokens)
  out, t_fused = timed(fused, model, tokens)
  err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
  print(f"max |Δlogit| / max |logit| fused vs unfused: {err:.2e}")
  print(f"forward time on {jax.devices()[0].platform}: unfused {t_ref * 1e3:.2f} ms, "
        f"fused {t_fused * 1e3:.2f} ms (CPU uses the XLA reference lowering)")
  if not (np.isfinite(err) and err < 1e-4):
    raise SystemExit(f"fused model disagrees with the unfused one: {err:.3g}")


if __name__ == "__main__":
  main()
