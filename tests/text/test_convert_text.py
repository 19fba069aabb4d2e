"""`lrjax convert --calib-text`: text calibration with the model's tokenizer, and the tokenizer,
chat template and generation config carried into the checkpoint."""

import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")

import filecmp  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import lrjax  # noqa: E402
from lrjax import checkpoint, cli, text  # noqa: E402
from lrjax.models import from_hf  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
CHAT = os.path.join(FIXTURES, "hf", "llama_chat")
CORPUS = os.path.join(FIXTURES, "text", "corpus.txt")


def _convert(*extra):
  return cli.main(["convert", "--ratio", "0.3", "--block", "8", *extra])


def test_convert_with_calib_text_carries_text_files(tmp_path, capsys):
  out = tmp_path / "lr"
  rc = _convert("--hf", CHAT, "--out", str(out), "--calib-text", CORPUS, "--calib-seq-len", "32")
  assert rc == 0, capsys.readouterr().err
  for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    assert filecmp.cmp(os.path.join(CHAT, f), out / f, shallow=False), f
  # the checkpoint serves text on its own, with the source's settings
  tok, gen = text.load_text(out)
  src_tok, src_gen = text.load_text(CHAT)
  assert tok.encode_chat([{"role": "user", "content": "Hi"}]) == src_tok.encode_chat(
    [{"role": "user", "content": "Hi"}]
  )
  assert gen == src_gen
  # calibration = the corpus tokenized and packed, exactly
  calib = text.calib_tokens_from_text([CORPUS], src_tok, 32)
  ref = lrjax.compress(from_hf(CHAT), ratio=0.3, calib_tokens=calib, block=8, progress=False)
  back = checkpoint.load(out)
  assert back.layer_ranks() == ref.layer_ranks()
  a = np.asarray(back.layers[0].mlp.up_proj.u[...])
  b = np.asarray(ref.layers[0].mlp.up_proj.u[...])
  assert a.tobytes() == b.tobytes()


def test_generation_ids_from_config_json_are_carried(tmp_path):
  """A source without generation_config.json: its config.json eos ids still reach the ckpt."""
  src = tmp_path / "src"
  shutil.copytree(CHAT, src)
  os.remove(src / "generation_config.json")
  out = tmp_path / "lr"
  assert _convert("--hf", str(src), "--out", str(out), "--method", "svd") == 0
  assert json.loads((out / "generation_config.json").read_text()) == {
    "bos_token_id": 0,
    "eos_token_id": [1, 4],
  }
  assert text.load_text(out)[1].eos_ids == (1, 4)


def test_calib_text_errors_come_before_loading(tmp_path, capsys):
  ids_only = tmp_path / "ids_only"
  shutil.copytree(os.path.join(FIXTURES, "hf", "qwen3"), ids_only)
  out = str(tmp_path / "o")
  assert _convert("--hf", str(ids_only), "--out", out, "--calib-text", CORPUS) == 1
  err = capsys.readouterr().err
  assert "no tokenizer.json" in err and "--calib" in err and not os.path.exists(out)
  np.save(tmp_path / "c.npy", np.zeros((2, 8), np.int32))
  args = ("--hf", CHAT, "--out", out, "--calib", str(tmp_path / "c.npy"), "--calib-text", CORPUS)
  assert _convert(*args) == 1
  assert "not both" in capsys.readouterr().err
  assert (
    _convert("--hf", CHAT, "--out", out, "--calib-text", CORPUS, "--calib-seq-len", "99999") == 1
  )
  assert "fewer than one 99999-token window" in capsys.readouterr().err
  assert not os.path.exists(out)


def test_save_extra_files(tmp_path):
  model = from_hf(CHAT)
  f = tmp_path / "note.txt"
  f.write_text("hello")
  checkpoint.save(model, tmp_path / "ck", extra_files=[f])
  assert (tmp_path / "ck" / "note.txt").read_text() == "hello"
  for bad in ([tmp_path / "missing.txt"], [f, f], [tmp_path / "lrjax_metadata.json"]):
    if bad[0].name == "lrjax_metadata.json":
      bad[0].write_text("{}")
    with pytest.raises(ValueError, match="extra_files"):
      checkpoint.save(model, tmp_path / "ck2", extra_files=bad)
    assert not (tmp_path / "ck2").exists()
