"""HF dir → lrjax convert → lrjax export (hf-lowrank and hf-dense) → transformers → lrjax eval.

Runs on a committed tiny fixture (no downloads; torch and transformers from the [test] extra):

  python examples/export_and_eval.py [--hf tests/fixtures/hf/llama3] [--ratio 0.3] [--out DIR]

The fixture has no tokenizer, so the example trains a tiny one on a generated text first. The
same steps from the shell::

  lrjax convert --hf DIR --out ck --ratio 0.3 --method svd
  lrjax export --ckpt ck --out ex_lowrank                      # --format hf-lowrank
  lrjax export --ckpt ck --out ex_dense --format hf-dense
  lrjax eval --hf DIR --ckpt ck --text test.txt --out eval.json
"""

import argparse
import json
import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax.numpy as jnp
import numpy as np

from lrjax import checkpoint, cli

HERE = os.path.dirname(os.path.abspath(__file__))
WORDS = "the a cat dog sat on mat ran to house big small red and then it was old new tree".split()


def sentences(rng, n_words: int) -> str:
  words = [str(w) for w in rng.choice(WORDS, n_words)]
  lines = [" ".join(words[i : i + 9]) + "." for i in range(0, n_words, 9)]
  return "\n".join(lines) + "\n"


def tiny_tokenizer(path: str, text: str, vocab: int) -> None:
  """A BPE with fewer than ``vocab`` tokens, a BOS, and its generation_config.json."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
  tok.train_from_iterator(
    [text],
    trainers.BpeTrainer(
      vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=["\n"]
    ),
  )
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
  tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
    json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, fh)
  with open(os.path.join(path, "generation_config.json"), "w") as fh:
    json.dump({"bos_token_id": 1, "eos_token_id": 2}, fh)


def run(*argv) -> None:
  print("$ lrjax", " ".join(map(str, argv)))
  rc = cli.main([str(a) for a in argv])
  if rc:
    raise SystemExit(rc)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--hf", default=os.path.join(HERE, "..", "tests", "fixtures", "hf", "llama3"))
  ap.add_argument("--ratio", type=float, default=0.3)
  ap.add_argument("--out", default=None, help="output root (default: a temp dir)")
  args = ap.parse_args()
  out = args.out or tempfile.mkdtemp(prefix="lrjax_export_eval_")
  rng = np.random.default_rng(0)

  # an HF directory with a tokenizer (real models ship one)
  hf = os.path.join(out, "hf")
  shutil.copytree(args.hf, hf, dirs_exist_ok=True)
  vocab = checkpoint.read_hf_config(hf)[1]["vocab_size"]
  tiny_tokenizer(hf, sentences(rng, 3000), min(vocab, 100))
  with open(os.path.join(out, "test.txt"), "w") as fh:
    fh.write(sentences(rng, 500))

  ck, lowrank, dense = (os.path.join(out, d) for d in ("ck", "ex_lowrank", "ex_dense"))
  run("convert", "--hf", hf, "--out", ck, "--ratio", args.ratio, "--method", "svd",
      "--block", "4", "--overwrite")  # fmt: skip
  # convert carries the tokenizer when lrjax.text is installed; --tokenizer-from works either way
  run("export", "--ckpt", ck, "--out", lowrank, "--tokenizer-from", hf, "--overwrite")
  run("export", "--ckpt", ck, "--out", dense, "--format", "hf-dense", "--tokenizer-from", hf,
      "--overwrite")  # fmt: skip

  try:
    import torch
    import transformers
  except ImportError:
    print("torch/transformers are not installed (pip install -e .[test]); skipping that step")
  else:
    model = checkpoint.load(ck)
    tok = transformers.AutoTokenizer.from_pretrained(lowrank, trust_remote_code=True)
    prompt = tok("the cat sat on", return_tensors="pt")["input_ids"]
    want = np.asarray(model(jnp.asarray(prompt.numpy())))
    for path, remote in ((lowrank, True), (dense, False)):
      hm = transformers.AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=remote, dtype=torch.float32
      )
      with torch.no_grad():
        got = hm(prompt).logits.numpy()
        gen = hm.generate(prompt, max_new_tokens=8, do_sample=False)
      err = np.linalg.norm(got - want) / np.linalg.norm(want)
      print(
        f"{os.path.basename(path)}: transformers {type(hm).__name__}, logits vs lrjax "
        f"{err:.1e} relative; greedy: {tok.decode(gen[0], skip_special_tokens=True)!r}"
      )

  run("eval", "--hf", hf, "--ckpt", ck, "--text", os.path.join(out, "test.txt"),
      "--seq-len", "64", "--stride", "32", "--out", os.path.join(out, "eval.json"),
      "--overwrite")  # fmt: skip
  print(f"outputs in {out}")


if __name__ == "__main__":
  main()
