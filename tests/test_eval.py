"""`lrjax eval`: strided sliding-window perplexity against transformers on the same text,
tokens and windows; several models side by side; arguments, paths and the --out rules."""

import json
import math
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it

import jax.numpy as jnp
import numpy as np
import pytest
from tiny_text import tiny_text, write_tokenizer

import lrjax
from lrjax import checkpoint, cli
from lrjax.evaluate import strided_windows

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
TOL = 1e-4  # relative, float32
SEQ_LEN, STRIDE = 40, 16


def _seed() -> int:
  return int.from_bytes(os.urandom(4), "little")


@pytest.mark.parametrize("n", [2, 3, 17, 64, 65, 200])
@pytest.mark.parametrize(("seq_len", "stride"), [(2, 1), (8, 8), (8, 3), (16, 7), (64, 32)])
def test_windows_score_every_token_once_with_stride_context(n, seq_len, stride):
  wins = strided_windows(n, seq_len, stride)
  scored = [t for w in wins for t in range(w.first, w.end)]
  if stride < seq_len:
    assert scored == list(range(1, n))  # each token once, in order; token 0 never
  else:  # non-overlapping windows: a window's first token has no context
    assert scored == [t for t in range(1, n) if t % seq_len]
  for w in wins:
    assert 0 <= w.begin < w.first < w.end <= n and w.end - w.begin <= seq_len
    assert w.first - w.begin >= min(w.first, seq_len - stride)  # context of its first token


def test_windows_reject_a_stride_that_skips_tokens():
  with pytest.raises(ValueError, match="stride=9 > seq_len=8 would skip tokens"):
    strided_windows(100, 8, 9)
  with pytest.raises(ValueError, match="needs at least 2 tokens"):
    strided_windows(1, 8, 4)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """HF fixture copies with a tokenizer, a low-rank and a per-head lrjax checkpoint carrying
  it, their hf-lowrank exports, and a text."""
  root = tmp_path_factory.mktemp("eval")
  rng = np.random.default_rng(_seed())
  for name in ("llama3", "mistral_f16", "qwen3"):
    shutil.copytree(os.path.join(FIXTURES, name), root / name)
    write_tokenizer(root / name, tiny_text(np.random.default_rng(0), 2000))  # one tokenizer
  for name, kw in (("llama3", {}), ("qwen3", dict(per_head=True))):
    m = checkpoint.load_hf(root / name, dtype=jnp.float32)
    lrjax.compress(m, ratio=0.3, method="svd", block=4, progress=False, **kw)
    ck = root / f"ck_{name}"
    checkpoint.save(m, ck)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
      shutil.copy(root / name / f, ck / f)  # what convert carries from an HF directory
    checkpoint.export_hf(m, root / f"ex_{name}", format="hf-lowrank")
  (root / "text.txt").write_text(tiny_text(rng, 450), encoding="utf-8")
  return root


def _eval(capsys, *args):
  rc = cli.main(["eval", *map(str, args)])
  out, err = capsys.readouterr()
  return rc, out, err


def _hf_nats(path, ids, seq_len, stride, remote=False):
  """transformers' strided perplexity loop (its perplexity guide), with exact per-token sums:
  labels before the last trg_len positions are -100, the model shifts them by one."""
  import torch
  import transformers

  hm = transformers.AutoModelForCausalLM.from_pretrained(
    path, dtype=torch.float32, trust_remote_code=remote
  ).eval()
  ids = torch.as_tensor(ids)[None]
  n = ids.shape[1]
  nll, count, prev_end = 0.0, 0, 0
  for begin in range(0, n, stride):
    end = min(begin + seq_len, n)
    trg_len = end - prev_end
    inp = ids[:, begin:end]
    labels = inp.clone()
    labels[:, :-trg_len] = -100
    with torch.no_grad():
      logits = hm(inp).logits
    loss = torch.nn.functional.cross_entropy(
      logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum"
    )
    nll += float(loss)
    count += int((labels[0, 1:] != -100).sum())
    prev_end = end
    if end == n:
      break
  return nll / count, count


def test_eval_matches_transformers_on_the_same_windows(setup, capsys, tmp_path):
  pytest.importorskip("transformers", reason="the [test] extra installs it")
  from tokenizers import Tokenizer

  root = setup
  ids = (
    Tokenizer.from_file(str(root / "llama3" / "tokenizer.json"))
    .encode((root / "text.txt").read_text())
    .ids
  )
  out = tmp_path / "res.json"
  rc, stdout, err = _eval(
    capsys, "--hf", root / "llama3", "--ckpt", root / "ck_llama3", "--ckpt", root / "ck_qwen3",
    "--hf", root / "mistral_f16", "--dtype", "float32", "--text", root / "text.txt",
    "--seq-len", SEQ_LEN, "--stride", STRIDE, "--batch", 3, "--out", out,
  )  # fmt: skip
  assert rc == 0, err
  res = json.loads(out.read_text())
  assert res["format"] == "lrjax-eval" and res["tokens"] == len(ids)
  rows = res["results"]
  assert [r["source"] for r in rows] == [
    str(root / n) for n in ("llama3", "ck_llama3", "ck_qwen3", "mistral_f16")
  ]
  refs = [
    _hf_nats(root / "llama3", ids, SEQ_LEN, STRIDE),
    _hf_nats(root / "ex_llama3", ids, SEQ_LEN, STRIDE, remote=True),
    _hf_nats(root / "ex_qwen3", ids, SEQ_LEN, STRIDE, remote=True),
    _hf_nats(root / "mistral_f16", ids, SEQ_LEN, STRIDE),  # sliding window 5 < SEQ_LEN
  ]
  for r, (want, count) in zip(rows, refs):
    assert r["scored_tokens"] == count == len(ids) - 1
    assert abs(r["nats_per_token"] - want) <= TOL * want, (r["source"], r["nats_per_token"], want)
    assert math.isclose(r["perplexity"], math.exp(r["nats_per_token"]), rel_tol=1e-12)
  assert rows[0]["low_rank_projections"] == 0 and rows[1]["low_rank_projections"] == 14
  assert rows[1]["compression"]["ratio"] == 0.3 and rows[1]["params"] < rows[0]["params"]
  # the table: one row per model, in order, with Δ nats against the first
  lines = stdout.splitlines()
  i = next(k for k, line in enumerate(lines) if line.startswith("model"))
  table = lines[i + 2 : i + 6]
  assert [line.split()[0] for line in table] == [r["source"] for r in rows]
  assert "+0.00000" in table[0] and "low-rank svd ratio 0.3" in table[1]


def test_fused_forward_scores_the_same(setup, capsys, tmp_path):
  root = setup
  got = []
  for extra in ([], ["--fuse"]):
    out = tmp_path / f"r{len(extra)}.json"
    args = ["--ckpt", root / "ck_llama3", "--text", root / "text.txt", "--seq-len", SEQ_LEN]
    rc, _, err = _eval(capsys, *args, "--out", out, *extra)
    assert rc == 0, err
    got.append(json.loads(out.read_text())["results"][0])
  assert got[0]["stride"] == SEQ_LEN // 2  # the default
  assert abs(got[1]["nats_per_token"] - got[0]["nats_per_token"]) <= 1e-5 * got[0]["nats_per_token"]


def _bad(root, tmp_path, case):
  """(args, expected error) of one refused invocation."""
  text = root / "text.txt"
  ck = root / "ck_llama3"
  base = ["--ckpt", ck, "--text", text]
  if case == "no model":
    return ["--text", text], "give at least one model"
  if case == "stride":
    return [*base, "--seq-len", 8, "--stride", 9], "--stride 9 > --seq-len 8 would skip tokens"
  if case == "seq_len too long":
    return [*base, "--seq-len", 257], "exceeds .*max_position_embeddings 256"
  if case == "no tokenizer":
    return ["--hf", os.path.join(FIXTURES, "llama3"), "--text", text], "pass --tokenizer DIR"
  if case == "not a checkpoint":
    return ["--ckpt", root / "llama3", "--text", text], "HF model directory.*pass it as --hf"
  if case == "empty text":
    (tmp_path / "e.txt").write_text("  \n")
    return ["--ckpt", ck, "--text", tmp_path / "e.txt"], "the file is empty"
  if case == "not utf-8":
    (tmp_path / "b.txt").write_bytes(b"caf\xe9 latin-1")
    return ["--ckpt", ck, "--text", tmp_path / "b.txt"], "not UTF-8 text"
  if case == "two tokenizers":
    other = tmp_path / "other"
    shutil.copytree(ck, other)
    write_tokenizer(other, tiny_text(np.random.default_rng(1), 300))
    return [*base, "--ckpt", other], "tokenize the text differently"
  if case == "ids beyond vocab":
    big = tmp_path / "big"
    big.mkdir()
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(set((root / "text.txt").read_text().split()))
    vocab = {w: 200 + i for i, w in enumerate(words)} | {"<unk>": 0}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(big / "tokenizer.json"))
    return [*base, "--tokenizer", big], "vocab_size is 128; tokenize with the model's own"
  if case == "out is the text":
    return [*base, "--out", text, "--overwrite"], "is an input of this command"
  if case == "out inside a checkpoint":
    return [*base, "--out", ck / "eval.json"], "is inside an input of this command"
  if case == "out not ours":
    (tmp_path / "mine.json").write_text('{"mine": 1}')
    return [*base, "--out", tmp_path / "mine.json", "--overwrite"], "is not an lrjax eval result"
  raise AssertionError(case)


BAD = [
  "no model",
  "stride",
  "seq_len too long",
  "no tokenizer",
  "not a checkpoint",
  "empty text",
  "not utf-8",
  "two tokenizers",
  "ids beyond vocab",
  "out is the text",
  "out inside a checkpoint",
  "out not ours",
]


@pytest.mark.parametrize("case", BAD)
def test_bad_arguments_fail_with_one_line(setup, capsys, tmp_path, case):
  import re

  args, match = _bad(setup, tmp_path, case)
  before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
  rc, _, err = _eval(capsys, *args)
  assert rc == 2, err
  assert len(err.strip().splitlines()) == 1 and err.startswith("lrjax eval: error: "), err
  assert re.search(match, err), err
  assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
  assert not list(setup.rglob("eval.json"))


def test_paths_and_overwrite_from_another_directory(setup, capsys, tmp_path, monkeypatch):
  root = setup
  home, work = tmp_path / "home", tmp_path / "work" / "sub"
  home.mkdir()
  work.mkdir(parents=True)
  monkeypatch.setenv("HOME", str(home))
  shutil.copytree(root / "ck_llama3", tmp_path / "work" / "ck")
  os.symlink(root / "text.txt", tmp_path / "work" / "text_link.txt")
  monkeypatch.chdir(work)
  args = ["--ckpt", "../ck", "--text", "../text_link.txt", "--seq-len", SEQ_LEN]
  rc, _, err = _eval(capsys, *args, "--out", "~/res.json")
  assert rc == 0, err
  first = json.loads((home / "res.json").read_text())
  assert first["results"][0]["path"] == str(tmp_path / "work" / "ck")
  assert first["text"]["path"] == str(root / "text.txt")
  rc, _, err = _eval(capsys, *args, "--out", "~/res.json")
  assert rc == 2 and "exists; pass --overwrite" in err
  rc, _, err = _eval(capsys, *args, "--out", "~/res.json", "--overwrite", "--stride", 8)
  assert rc == 0, err
  again = json.loads((home / "res.json").read_text())
  assert again["results"][0]["stride"] == 8 and first["results"][0]["stride"] == SEQ_LEN // 2
  assert not [p for p in home.iterdir() if p.name.startswith(".")]  # no temp left behind


def test_an_export_scores_like_its_checkpoint(setup, capsys, tmp_path):
  """`--hf` reads an hf-lowrank export (tokenizer given with --tokenizer): same weights, same
  nats/token as the checkpoint it came from."""
  root = setup
  out = tmp_path / "r.json"
  rc, _, err = _eval(
    capsys, "--ckpt", root / "ck_llama3", "--hf", root / "ex_llama3", "--text", root / "text.txt",
    "--tokenizer", root / "llama3", "--seq-len", SEQ_LEN, "--out", out,
  )  # fmt: skip
  assert rc == 0, err
  a, b = json.loads(out.read_text())["results"]
  assert b["low_rank_projections"] == a["low_rank_projections"] == 14
  assert abs(a["nats_per_token"] - b["nats_per_token"]) <= 1e-6 * a["nats_per_token"]
