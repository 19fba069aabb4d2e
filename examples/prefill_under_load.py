"""Prefill under load: many requests arriving at once. The serving engine admits them one prompt
a prefill call ("single") or batches the waiting prompts into shared calls ("batched", the
default); this prints each policy's time to first token and checks every output against the
request run alone.

  python examples/prefill_under_load.py [--requests 32]

A tiny random low-rank model in f32 on whatever device jax has. docs/serving.md has the
measured numbers (a 2-core CPU and one H100 at Llama-3-8B shapes).
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lrjax.models import LlamaForCausalLM, ModelConfig
from lrjax.serving import Engine, Request, SamplingParams
from lrjax.sharding.analysis import compressed_ranks


def small_model():
  cfg = ModelConfig.tiny()  # hidden 64, 2 layers, 4 / 2 heads, vocab 256
  ranks = [compressed_ranks(cfg, 0.4, multiple=16)] * cfg.num_layers  # 40 % of params removed
  f32 = jnp.float32
  return LlamaForCausalLM(cfg, ranks=ranks, dtype=f32, param_dtype=f32, rngs=nnx.Rngs(0))


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--requests", type=int, default=32)
  ap.add_argument("--prompt-len", type=int, default=64)
  ap.add_argument("--new-tokens", type=int, default=8)
  a = ap.parse_args()
  for flag in ("requests", "prompt_len", "new_tokens"):
    if getattr(a, flag) < 1:
      ap.error(f"--{flag.replace('_', '-')} must be at least 1")
  model = small_model()
  rng = np.random.default_rng(0)
  prompts = [
    rng.integers(0, model.cfg.vocab_size, a.prompt_len).tolist() for _ in range(a.requests)
  ]
  params = SamplingParams(max_new_tokens=a.new_tokens)
  print(f"{a.requests} requests of {a.prompt_len} tokens at once on {jax.devices()[0].platform}")
  outputs = {}
  for policy in ("single", "batched"):
    engine = Engine(
      model,
      max_slots=a.requests,
      max_len=a.prompt_len + a.new_tokens + 1,
      buckets=(a.prompt_len,),
      prefill=policy,
    )
    engine.warmup()  # every step compiled before the clock starts
    t0 = time.perf_counter()
    ids = [engine.submit(Request(p, params)) for p in prompts]
    done = {}
    while engine.busy:
      done.update((r.id, r) for r in engine.step())
    wall = time.perf_counter() - t0
    results = [done[i] for i in ids]
    ttft = np.array([r.ttft_s for r in results]) * 1e3
    outputs[policy] = [r.tokens for r in results]
    print(
      f"  prefill={policy!r:9}: TTFT p50 {np.percentile(ttft, 50):6.1f} ms, "
      f"p99 {np.percentile(ttft, 99):6.1f} ms; all done in {wall:.2f} s"
    )
  alone = [engine.generate([Request(p, params)])[0].tokens for p in prompts[:4]]
  same = outputs["single"] == outputs["batched"] and outputs["batched"][:4] == alone
  print(f"outputs equal across policies and against requests run alone: {same}")
  if not same:
    raise SystemExit("batched prefill changed a result")


if __name__ == "__main__":
  main()
