"""Generate the tiny HF checkpoints and reference logits under tests/fixtures/hf/.

Needs torch and transformers (not lrjax's test suite):

  python3 -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch transformers safetensors numpy
  /tmp/hfvenv/bin/python scripts/make_hf_fixtures.py

Each fixture is ``<name>/`` with config.json, safetensors weights (``llama3`` sharded with an
index) and ``reference.safetensors`` holding ``tokens`` [2, 12] int32 and the transformers
``logits`` [2, 12, vocab] float32, computed in float32 from the stored (possibly bf16/f16)
weights with eager attention.

``--random N --out DIR`` instead writes N fixtures with randomly drawn configs (model type, sizes,
GQA ratio, head_dim, RoPE type, biases, tying, sliding window, stored dtype, sharding) for a
parity check on configs the committed tests have not seen:

  /tmp/hfvenv/bin/python scripts/make_hf_fixtures.py --random 30 --out /tmp/hf_random
  LRJAX_EXTRA_HF_FIXTURES=/tmp/hf_random pytest tests/models/test_models_hf_logits.py
"""

import argparse
import json
import os
import shutil

import numpy as np
import torch
import transformers as T
from safetensors.numpy import save_file

COMMON = dict(
  vocab_size=128,
  hidden_size=64,
  intermediate_size=128,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  rms_norm_eps=1e-5,
  max_position_embeddings=256,
)
LLAMA3_ROPE = {
  "rope_type": "llama3",
  "factor": 8.0,
  "low_freq_factor": 1.0,
  "high_freq_factor": 4.0,
  "original_max_position_embeddings": 64,
  "rope_theta": 10000.0,
}

# name: (config class, model class, config kwargs, stored dtype, max shard size or None)
FIXTURES = {
  "llama3": (
    T.LlamaConfig,
    T.LlamaForCausalLM,
    dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False),
    torch.float32,
    "150KB",
  ),
  "llama2_bias_tied": (
    T.LlamaConfig,
    T.LlamaForCausalLM,
    dict(
      num_key_value_heads=4,
      attention_bias=True,
      mlp_bias=True,
      tie_word_embeddings=True,
      rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    ),
    torch.float32,
    None,
  ),
  "qwen3": (
    T.Qwen3Config,
    T.Qwen3ForCausalLM,
    dict(
      tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}
    ),
    torch.float32,
    None,
  ),
  "qwen2_bf16": (
    T.Qwen2Config,
    T.Qwen2ForCausalLM,
    dict(
      num_key_value_heads=1,
      tie_word_embeddings=False,
      rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    torch.bfloat16,
    None,
  ),
  "mistral_f16": (
    T.MistralConfig,
    T.MistralForCausalLM,
    dict(
      sliding_window=5,
      tie_word_embeddings=False,
      rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    torch.float16,
    None,
  ),
}


def randomize(model: torch.nn.Module, gen: torch.Generator):
  """Weights with O(1) activations: W ~ N(0, 1/in), norms ~ 1 ± 0.2, biases ~ N(0, 0.1²)."""
  with torch.no_grad():
    for name, p in model.named_parameters():
      if p.ndim == 2:
        std = 1.0 if "embed_tokens" in name else p.shape[1] ** -0.5
        p.copy_(torch.randn(p.shape, generator=gen) * std)
      elif name.endswith("bias"):
        p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
      else:
        p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))


CLASSES = {
  "llama": (T.LlamaConfig, T.LlamaForCausalLM),
  "mistral": (T.MistralConfig, T.MistralForCausalLM),
  "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
  "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM),
}


def random_fixture(rng: np.random.Generator):
  """(config class, model class, kwargs, stored dtype, shard size) for a random config."""
  mt = str(rng.choice(list(CLASSES)))
  heads = int(rng.choice([2, 3, 4, 6, 8]))
  kv = int(rng.choice([d for d in range(1, heads + 1) if heads % d == 0]))
  kw = dict(
    vocab_size=int(rng.choice([50, 97, 128])),
    hidden_size=heads * int(rng.choice([8, 12, 16])),
    intermediate_size=int(rng.choice([40, 64, 100])),
    num_hidden_layers=int(rng.integers(1, 4)),
    num_attention_heads=heads,
    num_key_value_heads=kv,
    head_dim=int(rng.choice([8, 16, 24])),
    rms_norm_eps=float(rng.choice([1e-5, 1e-6])),
    max_position_embeddings=256,
    tie_word_embeddings=bool(rng.integers(2)),
  )
  rope = {"rope_type": "default", "rope_theta": float(rng.choice([500.0, 1e4, 1e6]))}
  kind = rng.choice(["default", "linear", "llama3"])
  if kind == "linear":
    rope.update(rope_type="linear", factor=float(rng.choice([2.0, 4.0])))
  elif kind == "llama3":
    rope.update(
      rope_type="llama3",
      factor=float(rng.choice([8.0, 32.0])),
      low_freq_factor=1.0,
      high_freq_factor=4.0,
      original_max_position_embeddings=int(rng.choice([32, 64])),
    )
  kw["rope_parameters"] = rope
  if mt == "llama":
    kw.update(attention_bias=bool(rng.integers(2)), mlp_bias=bool(rng.integers(2)))
  elif mt == "qwen3":
    kw.update(attention_bias=bool(rng.integers(2)))
  if mt == "mistral":
    kw["sliding_window"] = int(rng.integers(3, 9)) if rng.integers(2) else None
  elif mt in ("qwen2", "qwen3") and rng.integers(2):
    kw.update(use_sliding_window=True, sliding_window=int(rng.integers(3, 9)), max_window_layers=0)
  dtype = [torch.float32, torch.bfloat16, torch.float16][int(rng.integers(3))]
  shard = "40KB" if rng.integers(2) else None
  return (*CLASSES[mt], kw, dtype, shard)


def make(name: str, out_root: str, seed: int, spec=None):
  cfg_cls, model_cls, kw, dtype, shard = spec or FIXTURES[name]
  cfg = cfg_cls(**{**COMMON, **kw})
  cfg._attn_implementation = "eager"
  gen = torch.Generator().manual_seed(seed)
  model = model_cls(cfg).eval()
  randomize(model, gen)
  with torch.no_grad():  # round weights to the stored dtype, compute in f32
    for p in model.parameters():
      p.copy_(p.to(dtype).to(torch.float32))
  tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=gen)
  with torch.no_grad():
    logits = model(tokens).logits
  out = os.path.join(out_root, name)
  shutil.rmtree(out, ignore_errors=True)
  # Only params are cast for saving (casting the whole module would also round RoPE buffers).
  model.to(dtype).save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
  for extra in ("generation_config.json",):
    if os.path.exists(os.path.join(out, extra)):
      os.remove(os.path.join(out, extra))
  save_file(
    {"tokens": tokens.numpy().astype(np.int32), "logits": logits.numpy()},
    os.path.join(out, "reference.safetensors"),
  )
  size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
  print(
    f"{name}: {sorted(os.listdir(out))} {size / 1024:.0f} KiB, max|logit|={logits.abs().max():.3f}"
  )


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument(
    "--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "hf")
  )
  ap.add_argument("--seed", type=int, default=1234)
  ap.add_argument(
    "--random",
    type=int,
    default=0,
    metavar="N",
    help="write N random-config fixtures instead of the committed set",
  )
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  if args.random:
    rng = np.random.default_rng(args.seed)
    for i in range(args.random):
      make(f"random_{i:03d}", args.out, args.seed + i, random_fixture(rng))
    return
  for i, name in enumerate(FIXTURES):
    make(name, args.out, args.seed + i)
  with open(os.path.join(args.out, "VERSIONS.json"), "w") as fh:
    json.dump({"torch": torch.__version__, "transformers": T.__version__}, fh, indent=1)


if __name__ == "__main__":
  main()
