"""`lrjax generate` with text: --prompt / --chat stream text, stop at eos ids and stop strings;
--prompt-ids stays."""

import os

import pytest

from lrjax import checkpoint, cli
from lrjax.serving import Engine, Request, SamplingParams
from lrjax.text import TextStream, carried_files

CHAT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf", "llama_chat")
FLAGS = ["--max-len", "64", "--slots", "2", "--temperature", "0"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, chat_model):
  d = tmp_path_factory.mktemp("gen") / "ck"
  with carried_files(CHAT) as extra:
    checkpoint.save(chat_model, d, extra_files=extra)
  return str(d)


def _alone(model, ids, n, eos):
  eng = Engine(model, max_slots=2, max_len=64)
  [r] = eng.generate([Request(ids, SamplingParams(max_new_tokens=n, stop_tokens=tuple(eos)))])
  return r.tokens


def test_prompt_streams_text(ckpt, chat_model, chat_text, capsys):
  tok, gen = chat_text
  rc = cli.main(
    ["generate", "--ckpt", ckpt, "--prompt", "The river runs", "--max-new-tokens", "12"] + FLAGS
  )
  out, err = capsys.readouterr()
  assert rc == 0, err
  ids = tok.encode("The river runs")
  toks = _alone(chat_model, ids, 12, gen.eos_ids)
  ts = TextStream(tok, ids, eos_ids=gen.eos_ids)
  want = "".join(ts.push(t) for t in toks) + ts.finish()
  assert out == want + "\n"
  assert "lrjax.fuse in the decode step" in err and "tokens/s" in err


def test_chat_and_stop_string(ckpt, chat_model, chat_text, capsys):
  tok, gen = chat_text
  msgs = [{"role": "user", "content": "What is the capital of France?"}]
  ids = tok.encode_chat(msgs)
  toks = _alone(chat_model, ids, 16, gen.eos_ids)
  ts = TextStream(tok, ids, eos_ids=gen.eos_ids)
  full = "".join(ts.push(t) for t in toks) + ts.finish()
  rc = cli.main(
    ["generate", "--ckpt", ckpt, "--chat", msgs[0]["content"], "--max-new-tokens", "16"] + FLAGS
  )
  out, err = capsys.readouterr()
  assert rc == 0 and out == full + "\n", err
  stop = full[3:6]
  rc = cli.main(
    ["generate", "--ckpt", ckpt, "--chat", msgs[0]["content"], "--max-new-tokens", "16"]
    + FLAGS
    + ["--stop", stop]
  )
  out, err = capsys.readouterr()
  assert rc == 0 and out == full[: full.index(stop)] + "\n"
  assert "(stop," in err


def test_several_prompts_and_ids(ckpt, chat_model, chat_text, capsys):
  tok, gen = chat_text
  rc = cli.main(
    ["generate", "--ckpt", ckpt, "--prompt", "Once upon", "--prompt", "To make tea"]
    + ["--prompt-ids", "5,6,7", "--max-new-tokens", "6"]
    + FLAGS
  )
  out, err = capsys.readouterr()
  assert rc == 0, err
  ids = [5, 6, 7]
  toks = _alone(chat_model, ids, 6, gen.eos_ids)
  assert f"prompt={ids} -> {','.join(map(str, toks))}" in out
  for i, p in enumerate(("Once upon", "To make tea")):
    pids = tok.encode(p)
    ts = TextStream(tok, pids, eos_ids=gen.eos_ids)
    want = "".join(ts.push(t) for t in _alone(chat_model, pids, 6, gen.eos_ids)) + ts.finish()
    assert f"[{i}] {want}\n" in out


def test_generate_errors(tmp_path, ckpt, chat_model, capsys):
  assert cli.main(["generate", "--ckpt", ckpt] + FLAGS) == 1
  assert "at least one --prompt" in capsys.readouterr().err
  bare = tmp_path / "bare"
  checkpoint.save(chat_model, bare)  # no tokenizer carried
  assert cli.main(["generate", "--ckpt", str(bare), "--prompt", "hi"] + FLAGS) == 1
  assert "no tokenizer.json" in capsys.readouterr().err
  assert (
    cli.main(
      ["generate", "--ckpt", str(bare), "--prompt-ids", "1,2", "--max-new-tokens", "2"] + FLAGS
    )
    == 0
  )
  assert cli.main(["generate", "--ckpt", ckpt, "--prompt", "hi", "--max-len", "1"]) == 1
  assert "--max-len" in capsys.readouterr().err


@pytest.mark.parametrize(
  "flag, value, want",
  [
    ("--max-new-tokens", "0", "--max-new-tokens 0 must be an int >= 1"),
    ("--temperature", "-1", "--temperature -1.0 must be a finite number >= 0"),
    ("--top-p", "0", "--top-p 0.0 must be a number in (0, 1]"),
    ("--top-k", "-2", "--top-k -2 must be an int >= 0"),
    ("--seed", "-1", "--seed -1 must be an int in [0, 2**64)"),
  ],
)
def test_generate_names_a_bad_sampling_flag_before_loading(
  ckpt, capsys, monkeypatch, flag, value, want
):
  from lrjax.serving import cli as serving_cli

  def no_load(*a, **kw):
    raise AssertionError("the model was loaded before the flags were checked")

  monkeypatch.setattr(serving_cli, "_load", no_load)
  assert cli.main(["generate", "--ckpt", ckpt, "--prompt", "hi"] + FLAGS + [flag, value]) == 1
  err = capsys.readouterr().err
  assert err.strip().startswith(f"lrjax generate: error: {want}"), err
  assert len(err.strip().splitlines()) == 1, err


def test_generate_says_when_the_cache_caps_max_new_tokens(ckpt, capsys):
  argv = ["generate", "--ckpt", ckpt, "--prompt-ids", "1,2,3,4"] + FLAGS
  assert cli.main(argv + ["--max-new-tokens", "100"]) == 0
  err = capsys.readouterr().err
  assert "at most 60 new tokens fit after the longest prompt in the 64-token cache" in err, err
  assert "(asked for 100); raise --max-len for more" in err
  assert cli.main(argv + ["--max-new-tokens", "3"]) == 0
  assert "at most" not in capsys.readouterr().err
