"""HF checkpoint → low-rank orbax checkpoint → reload → HF-style export → greedy decode.

Runs on a committed tiny fixture by default (no downloads):

  python examples/convert_hf.py [--hf tests/fixtures/hf/llama3] [--ratio 0.3] [--out /tmp/lr]

The same conversion from the shell: ``lrjax convert --hf DIR --out DIR --ratio 0.3 --calib
tokens.npy`` and ``lrjax export --ckpt DIR --out DIR``.
"""

import argparse
import os
import tempfile

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file

from lrjax import checkpoint
from lrjax.compression import compress, param_counts
from lrjax.models import KVCache, decode_step, from_hf, prefill_step

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--hf", default=os.path.join(HERE, "..", "tests", "fixtures", "hf", "llama3"))
  ap.add_argument("--ratio", type=float, default=0.3)
  ap.add_argument("--block", type=int, default=8, help="rank alignment (128 for real models)")
  ap.add_argument("--out", default=None, help="output root (default: a temp dir)")
  args = ap.parse_args()
  out = args.out or tempfile.mkdtemp(prefix="lrjax_convert_")
  fwd = nnx.jit(lambda m, t: m(t))

  dense = from_hf(args.hf, dtype=jnp.float32)
  cfg = dense.cfg
  print(
    f"loaded {args.hf}: {cfg.model_type}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
    f"heads {cfg.num_heads}/{cfg.num_kv_heads}, digest {dense.source_digest[:19]}…"
  )
  ref_path = os.path.join(args.hf, "reference.safetensors")
  if os.path.exists(ref_path):
    ref = load_file(ref_path)
    err = np.max(np.abs(np.asarray(fwd(dense, ref["tokens"])) - ref["logits"]))
    print(
      f"max |Δlogit| vs transformers: {err:.2e} (max |logit| {np.abs(ref['logits']).max():.2f})"
    )

  rng = np.random.default_rng(0)
  calib = rng.integers(0, cfg.vocab_size, (8, 32))
  probe = rng.integers(0, cfg.vocab_size, (2, 16))
  dense_logits = np.asarray(fwd(dense, probe))
  model = compress(dense, ratio=args.ratio, calib_tokens=calib, method="whiten", block=args.block)
  pc = param_counts(model)
  print(
    f"compressed: projection weights {pc['dense_equiv']} → {pc['actual']} "
    f"({1 - pc['actual'] / pc['dense_equiv']:.1%} removed); layer-0 ranks "
    f"{model.layer_ranks()[0]}"
  )
  lr_logits = np.asarray(fwd(model, probe))
  print(
    f"relative logit change from compression: "
    f"{np.linalg.norm(lr_logits - dense_logits) / np.linalg.norm(dense_logits):.3f}"
  )

  ck = os.path.join(out, "lowrank_orbax")
  checkpoint.save(model, ck, overwrite=True)
  back = checkpoint.load(ck)
  same = np.asarray(fwd(back, probe)).tobytes() == lr_logits.tobytes()
  print(f"saved {ck}; reload gives identical logits: {same}")

  ex = os.path.join(out, "lowrank_hf")
  checkpoint.export_hf(back, ex, overwrite=True)
  again = from_hf(ex)
  same = np.asarray(fwd(again, probe)).tobytes() == lr_logits.tobytes()
  print(f"exported {ex} ({sorted(os.listdir(ex))}); reload identical: {same}")

  cache = KVCache.init(cfg, probe.shape[0], probe.shape[1] + 8)
  logits, cache = prefill_step(again, jnp.asarray(probe), cache)
  nxt = jnp.argmax(logits[:, -1], axis=-1)
  gen = [nxt]
  step = nnx.cached_partial(decode_step, again)  # walks the model's graph once, not per token
  for _ in range(7):
    logits, cache = step(nxt, cache)
    nxt = jnp.argmax(logits, axis=-1)
    gen.append(nxt)
  print("greedy continuation:", np.stack(gen, 1).tolist())


if __name__ == "__main__":
  main()
