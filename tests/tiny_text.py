"""A tiny BPE tokenizer (vocab under 128, the fixtures' size) and text for it, built in a test.

text = tiny_text(rng, words=400)
write_tokenizer(dir, text)     # tokenizer.json, tokenizer_config.json, generation_config.json
"""

import json
import os

import numpy as np

WORDS = (
  "the a cat dog sat on mat ran to house big small red blue and then it was very old new "
  "tree bird sky sun day night we they saw"
).split()
VOCAB = 120  # below the tiny fixtures' vocab_size of 128
SPECIALS = ("<unk>", "<s>", "</s>")


def tiny_text(rng: np.random.Generator, words: int = 400) -> str:
  """Random sentences over :data:`WORDS`, with punctuation and line breaks."""
  out, line = [], []
  for _ in range(words):
    line.append(str(rng.choice(WORDS)))
    if rng.random() < 0.12:
      out.append(" ".join(line) + rng.choice([".", "!", "?", ","]))
      line = []
  out.append(" ".join(line))
  return "\n".join(out) + "\n"


def write_tokenizer(path, text: str, bos: bool = True) -> None:
  """A Metaspace BPE trained on ``text`` (ids < :data:`VOCAB`), with a BOS-adding
  post-processor, plus tokenizer_config.json and generation_config.json."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Metaspace()
  tok.decoder = decoders.Metaspace()
  trainer = trainers.BpeTrainer(
    vocab_size=VOCAB,
    special_tokens=list(SPECIALS),
    initial_alphabet=["\n"],
    limit_alphabet=60,
    show_progress=False,
  )
  tok.train_from_iterator([text], trainer)
  if bos:
    tok.post_processor = processors.TemplateProcessing(
      single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
  os.makedirs(path, exist_ok=True)
  tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
    json.dump(
      {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "clean_up_tokenization_spaces": False,
      },
      fh,
    )
  with open(os.path.join(path, "generation_config.json"), "w") as fh:
    json.dump({"bos_token_id": tok.token_to_id("<s>"), "eos_token_id": tok.token_to_id("</s>")}, fh)
