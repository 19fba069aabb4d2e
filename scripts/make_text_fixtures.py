"""Generate the tiny text-serving fixture tests/fixtures/hf/llama_chat/.

A byte-level BPE tokenizer (``tokenizers``) trained on tests/fixtures/text/corpus.txt, and a
tiny Llama (vocab = the tokenizer's) briefly trained on the same text so that greedy output is
corpus-like rather than one repeated token. The directory is a complete HF model directory:

  config.json, model.safetensors   the model (transformers ``save_pretrained``)
  tokenizer.json                   byte-level BPE; the post-processor prepends <|begin_of_text|>
  tokenizer_config.json            bos/eos tokens and a Llama-3-style chat template
  generation_config.json           eos ids [<|end_of_text|>, <|eot_id|>], sampling defaults
  reference.safetensors            tokens [2, 12] and the transformers logits

Needs torch and transformers (the test extras):

  .venv/bin/python scripts/make_text_fixtures.py
"""

import argparse
import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers as T
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_hf_fixtures import COMMON, randomize  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"]
SPECIAL += ["<|eot_id|>"]
VOCAB = 384

CHAT_TEMPLATE = (
  "{{- bos_token }}\n"
  "{%- for message in messages %}\n"
  "{%- if message['role'] not in ['system', 'user', 'assistant'] %}\n"
  "{{- raise_exception('Unknown role ' + message['role'] + '; expected system, user or assistant') }}\n"  # noqa: E501
  "{%- endif %}\n"
  "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
  "{{- message['content'] | trim }}{{- '<|eot_id|>' }}\n"
  "{%- endfor %}\n"
  "{%- if add_generation_prompt %}\n"
  "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
  "{%- endif %}\n"
)


def train_tokenizer(corpus: str) -> Tokenizer:
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=VOCAB,
    special_tokens=SPECIAL,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train([corpus], trainer)
  bos = tok.token_to_id(SPECIAL[0])
  tok.post_processor = processors.Sequence(
    [
      processors.ByteLevel(trim_offsets=False),
      processors.TemplateProcessing(
        single=f"{SPECIAL[0]}:0 $A:0",
        pair=f"{SPECIAL[0]}:0 $A:0 {SPECIAL[0]}:1 $B:1",
        special_tokens=[(SPECIAL[0], bos)],
      ),
    ]
  )
  return tok


def train_model(model, ids: np.ndarray, steps: int, seq: int, gen: torch.Generator):
  opt = torch.optim.Adam(model.parameters(), lr=3e-3)
  data = torch.as_tensor(ids, dtype=torch.long)
  for step in range(steps):
    starts = torch.randint(0, len(data) - seq - 1, (16,), generator=gen)
    batch = torch.stack([data[s : s + seq + 1] for s in starts])
    out = model(batch, labels=batch)  # the model shifts the labels by one
    opt.zero_grad()
    out.loss.backward()
    opt.step()
    if step % 100 == 0 or step == steps - 1:
      print(f"  step {step}: loss {out.loss.item():.3f}")


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=os.path.join(ROOT, "hf", "llama_chat"))
  ap.add_argument("--corpus", default=os.path.join(ROOT, "text", "corpus.txt"))
  ap.add_argument("--seed", type=int, default=4321)
  ap.add_argument("--steps", type=int, default=400)
  args = ap.parse_args()
  torch.manual_seed(args.seed)
  tok = train_tokenizer(args.corpus)
  ids = np.asarray(tok.encode(open(args.corpus, encoding="utf-8").read()).ids, np.int64)
  cfg = T.LlamaConfig(
    **{
      **COMMON,
      "vocab_size": tok.get_vocab_size(),
      "tie_word_embeddings": False,
      "bos_token_id": tok.token_to_id(SPECIAL[0]),
      "eos_token_id": [tok.token_to_id(SPECIAL[1]), tok.token_to_id(SPECIAL[4])],
      "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
  )
  cfg._attn_implementation = "eager"
  gen = torch.Generator().manual_seed(args.seed)
  model = T.LlamaForCausalLM(cfg)
  randomize(model, gen)
  print(f"tokenizer: {tok.get_vocab_size()} tokens; corpus: {len(ids)} tokens")
  model.train()
  train_model(model, ids, args.steps, 48, gen)
  model.eval()
  tokens = torch.as_tensor(ids[None, :24].reshape(2, 12).copy())
  with torch.no_grad():
    logits = model(tokens).logits
  out = args.out
  shutil.rmtree(out, ignore_errors=True)
  model.save_pretrained(out)
  tok.save(os.path.join(out, "tokenizer.json"))
  eos, eot = tok.token_to_id(SPECIAL[1]), tok.token_to_id(SPECIAL[4])
  with open(os.path.join(out, "tokenizer_config.json"), "w") as fh:
    json.dump(
      {
        "bos_token": SPECIAL[0],
        "eos_token": SPECIAL[4],
        "clean_up_tokenization_spaces": False,
        "model_max_length": COMMON["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
      },
      fh,
      indent=1,
    )
  with open(os.path.join(out, "generation_config.json"), "w") as fh:
    json.dump(
      {
        "bos_token_id": tok.token_to_id(SPECIAL[0]),
        "eos_token_id": [eos, eot],
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.9,
      },
      fh,
      indent=1,
    )
  save_file(
    {"tokens": tokens.numpy().astype(np.int32), "logits": logits.numpy()},
    os.path.join(out, "reference.safetensors"),
  )
  size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
  print(f"wrote {out}: {sorted(os.listdir(out))} {size / 1024:.0f} KiB")


if __name__ == "__main__":
  main()
