"""From a checkpoint to tokens on CPU with W4A8: load, quantize, save, reload, generate.

  python examples/cpu_w4a8.py [--group 128]

Makes a small low-rank checkpoint (random weights, so it runs anywhere without downloads),
loads it, quantizes it to W4A8 (int4 weights in groups along K, int8 activations per row),
saves that as a quantized checkpoint, reloads it (bit-exact) and generates greedily with the
serving engine, fused: every low-rank projection of the decode step runs as one
``lrjax_w4a8_xuv`` C++ custom call. Prints the custom calls, the tokens of the float and the
W4A8 model, and the W4A8 error against the float model.
With the CLI on a real checkpoint: ``lrjax convert --hf DIR --out CK --ratio 0.4 --quantize
w4a8``, then ``lrjax generate --ckpt CK ...`` or ``lrjax bench --ckpt CK``.
"""

import argparse
import os
import tempfile

import jax.numpy as jnp
import numpy as np
from flax import nnx

import lrjax
from lrjax import bench, checkpoint
from lrjax.models import LlamaForCausalLM, ModelConfig
from lrjax.serving import Engine, Request, SamplingParams


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--group", type=int, default=128, help="W4A8 weight group: 32, 64 or 128")
  a = ap.parse_args()

  cfg = ModelConfig(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=768,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    tie_word_embeddings=True,
  )
  ranks = [{"q_proj": 128, "o_proj": 128, "gate_proj": 128, "up_proj": 128, "down_proj": 128}]
  model = LlamaForCausalLM(cfg, ranks * cfg.num_layers, rngs=nnx.Rngs(0))

  with tempfile.TemporaryDirectory() as tmp:
    checkpoint.save(model, os.path.join(tmp, "ck"))
    loaded = checkpoint.load(os.path.join(tmp, "ck"))
    print(f"checkpoint: ranks {loaded.layer_ranks()[0]} (layer 0)")
    checkpoint.save(lrjax.quantize(loaded, "w4a8", group=a.group), os.path.join(tmp, "ck_w4a8"))
    q = checkpoint.load(os.path.join(tmp, "ck_w4a8"))
    rec = checkpoint.read_metadata(os.path.join(tmp, "ck_w4a8"))["quantization"]
  print(f"quantized checkpoint: {rec['scheme']} layout {rec['layout']} groups {rec['groups']}")
  print(f"decode-step custom calls (fused): {bench.decode_kernels(q)}")
  _, float_bytes = bench.weight_bytes(loaded)
  _, w4a8_bytes = bench.weight_bytes(q)
  print(f"weights a decode step reads: {float_bytes / 1e6:.1f} MB f32 -> {w4a8_bytes / 1e6:.1f} MB")

  prompt = [int(t) for t in np.random.default_rng(1).integers(0, cfg.vocab_size, 12)]
  sp = SamplingParams(max_new_tokens=12)
  outs = {}
  for name, m in (("f32", loaded), ("w4a8", q)):
    engine = Engine(m, max_slots=1, max_len=64, fuse=True)
    (res,) = engine.generate([Request(prompt, sp)])
    outs[name] = res.tokens
    print(f"{name:5s} tokens: {res.tokens}")
  same = sum(x == y for x, y in zip(outs["f32"], outs["w4a8"]))
  print(f"{same}/{len(outs['f32'])} greedy tokens agree")

  # One projection: the int4 weights' error; the whole model: it compounds over the layers.
  x = jnp.asarray(np.random.default_rng(2).standard_normal((4, cfg.hidden_size)), jnp.float32)
  for name, (f, g) in {
    "layer 0 q_proj": (loaded.layers[0].attn.q_proj, q.layers[0].attn.q_proj),
    "whole model": (loaded, q),
  }.items():
    inp = x if name != "whole model" else jnp.asarray([prompt])
    ref, y = np.asarray(f(inp)), np.asarray(g(inp))
    print(f"{name}: relative error vs f32 {np.linalg.norm(y - ref) / np.linalg.norm(ref):.3f}")
  print(
    "(random weights give near-uniform logits, so small errors flip greedy tokens; on a trained "
    "model see the excess nats in docs/cpu_w4a8.md)"
  )


if __name__ == "__main__":
  main()
