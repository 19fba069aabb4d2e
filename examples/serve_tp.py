"""Serve a low-rank Llama with low-rank tensor parallelism on simulated CPU devices.

  python examples/serve_tp.py [--tp 4] [--strategy auto|lowrank_split|lowrank_megatron|...]

Builds a small random low-rank model, saves it as an lrjax orbax checkpoint, loads it straight
into the tensor-parallel shardings (``auto``: the strategy the cost model predicts fastest, and
why), prints the collectives of one layer, and generates for a few concurrent requests
(continuous batching) — once with the dense KV cache and once with the low-rank (rank-space)
KV cache.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from lrjax import checkpoint, sharding  # noqa: E402
from lrjax.models import LlamaForCausalLM, ModelConfig  # noqa: E402
from lrjax.serving import Request, SamplingParams, load_model  # noqa: E402
from lrjax.serving import Engine  # noqa: E402
from lrjax.sharding.analysis import compressed_ranks, layer_hlo  # noqa: E402


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--tp", type=int, default=4)
  ap.add_argument("--strategy", default="auto", choices=(sharding.AUTO,) + sharding.STRATEGIES[1:])
  args = ap.parse_args()
  cfg = ModelConfig.tiny(
    hidden_size=128,
    intermediate_size=384,
    num_heads=8,
    num_kv_heads=4,
    head_dim=16,
    num_layers=2,
    vocab_size=512,
  )
  ranks = compressed_ranks(cfg, ratio=0.4, multiple=8)
  model = LlamaForCausalLM(cfg, ranks=[ranks] * cfg.num_layers, rngs=nnx.Rngs(0))
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "ckpt")
    checkpoint.save(model, path)
    model = load_model(path, tp=args.tp, strategy=args.strategy)
  print(f"{jax.device_count()} devices; ranks {ranks}")
  print(model.tp_plan)  # the strategy (and, for auto, every strategy's predicted step)
  u = model.layers[0].attn.q_proj.u[...]
  print(
    f"q_proj.u {u.shape} sharded {u.sharding.spec}: local shard "
    f"{u.addressable_shards[0].data.shape}"
  )

  h = jax.random.normal(jax.random.key(0), (1, 8, cfg.hidden_size), jnp.float32)
  if model.tp_plan.strategy == "lowrank_split":  # its layers take the hidden state split
    h = jax.device_put(h, NamedSharding(model.tp_plan.mesh, P(None, None, "tp")))
  colls = sharding.collectives(layer_hlo(model.layers[0], cfg, h))
  print("collectives of one decoder layer (8 tokens):")
  for c in colls:
    print(f"  {c.kind:11s} {c.shapes} {c.nbytes} B")

  reqs = [
    Request([1, 2, 3, 4], SamplingParams(max_new_tokens=12)),
    Request([7, 8], SamplingParams(max_new_tokens=8, temperature=0.8, top_k=20, seed=1)),
    Request([9] * 10, SamplingParams(max_new_tokens=10, top_p=0.9, temperature=1.0)),
    Request([5, 6, 7], SamplingParams(max_new_tokens=6, stop_tokens=(0,))),
  ]
  for lowrank_kv in (False, True):
    eng = Engine(model, max_slots=2, max_len=64, buckets=(16,), lowrank_kv=lowrank_kv)
    t0 = time.perf_counter()
    res = eng.generate(reqs)
    dt = time.perf_counter() - t0
    print(f"\nKV cache: {'low-rank (x·U_k, x·U_v)' if lowrank_kv else 'dense K, V'}")
    for r in res:
      print(f"  [{r.id}] {r.prompt} -> {r.tokens} ({r.finish_reason})")
    print(f"  {sum(len(r.tokens) for r in res) / dt:.1f} tokens/s including compilation")


if __name__ == "__main__":
  main()
