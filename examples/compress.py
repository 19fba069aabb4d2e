"""Compress a small trained Llama with lrjax.compress and measure what it cost.

The model is the quality harness's (trained on a synthetic Markov source with an exact entropy
floor; cached under ~/.cache/lrjax/quality after the first run, ~2 CPU minutes).

  python examples/compress.py --ratio 0.2 --method whiten --lora-steps 100
"""

from __future__ import annotations

import argparse
import json

from flax import nnx

from lrjax.compression import compress, param_counts
from lrjax.quality.report import evaluate
from lrjax.quality.source import MarkovSource
from lrjax.quality.train import TrainConfig, trained_model


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument(
    "--ratio", type=float, default=0.2, help="fraction of each projection's weights removed"
  )
  ap.add_argument("--method", choices=("whiten", "svd"), default="whiten")
  ap.add_argument("--block", type=int, default=8, help="rank alignment (128 on real models)")
  ap.add_argument("--mlp-only", action="store_true")
  ap.add_argument("--per-head", action="store_true", help="per-head q/k/v (GQA-aware)")
  ap.add_argument("--lora-steps", type=int, default=0)
  ap.add_argument("--cache-dir", default=None)
  args = ap.parse_args()

  src = MarkovSource()
  model, rec = trained_model(src, cache_dir=args.cache_dir)
  seq = TrainConfig().seq_len
  eval_tok = src.sample(256, seq + 1, seed=1)
  calib_tok = src.sample(64, seq, seed=2)
  # One pass of fresh sequences for LoRA: repeating a small set overfits.
  lora_tok = src.sample(max(1, args.lora_steps) * 32, seq + 1, seed=3)
  how = "cached" if rec["cached"] else f"trained in {rec['seconds']} s"
  print(f"model: {how}; entropy floor {src.entropy_rate:.4f} nats/token")
  dense = evaluate(model, src, eval_tok)

  small = compress(
    nnx.clone(model),
    ratio=args.ratio,
    method=args.method,
    calib_tokens=calib_tok,
    block=args.block,
    mlp_only=args.mlp_only,
    per_head=args.per_head,
    lora_steps=args.lora_steps,
    lora_tokens=lora_tok,
    lora_lr=1e-3,
    lora_batch=32,
  )
  after = evaluate(small, src, eval_tok)
  c = small.compression
  print(f"ranks (layer 0): {json.dumps(c['ranks'][0])}")
  print(
    f"projection weights: {param_counts(model)['actual']} -> {param_counts(small)['actual']}"
    f" ({100 * c['params']['removed_fraction']:.1f}% of the compressed ones removed)"
  )
  print(
    f"excess nats over the floor: dense {dense['excess_nats']:.4f}, "
    f"compressed {after['excess_nats']:.4f}"
  )


if __name__ == "__main__":
  main()
