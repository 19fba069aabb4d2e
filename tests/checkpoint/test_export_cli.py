"""`lrjax export --format/--tokenizer-from`: formats, carried tokenizer and generation files,
paths (relative, ~, symlinks, another working directory) and the overwrite rules."""

import json
import os
import re
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it

import jax.numpy as jnp
import numpy as np
import pytest
from tiny_text import tiny_text, write_tokenizer

import lrjax
from lrjax import checkpoint, cli

FIXTURES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf"))
TEXT = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  """A low-rank lrjax checkpoint of the llama3 fixture carrying a tokenizer (as convert writes
  one from an HF directory that has it), and a second tokenizer directory."""
  root = tmp_path_factory.mktemp("export_cli")
  m = checkpoint.load_hf(os.path.join(FIXTURES, "llama3"), dtype=jnp.float32)
  lrjax.compress(m, ratio=0.3, method="svd", block=4, progress=False)
  checkpoint.save(m, root / "ck")
  rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
  write_tokenizer(root / "ck", tiny_text(rng))
  write_tokenizer(root / "tok2", tiny_text(rng), bos=False)
  return root, m


def _cli(capsys, *args):
  rc = cli.main([str(a) for a in args])
  out, err = capsys.readouterr()
  return rc, out, err


def _same_bytes(a, b):
  return open(a, "rb").read() == open(b, "rb").read()


def test_bare_export_is_hf_lowrank_and_carries_the_checkpoints_text_files(ckpt, capsys, tmp_path):
  root, m = ckpt
  rc, out, err = _cli(capsys, "export", "--ckpt", root / "ck", "--out", tmp_path / "ex")
  assert rc == 0, err
  assert "LowRankLlamaForCausalLM" in out and "trust_remote_code=True" in out
  cfg = json.loads((tmp_path / "ex" / "config.json").read_text())
  assert cfg["model_type"] == "lrjax_lowrank_llama" and cfg["lrjax_lowrank"]["ranks"]
  assert (tmp_path / "ex" / "modeling_lrjax_lowrank.py").is_file()
  rec = checkpoint.read_export_record(tmp_path / "ex")
  assert rec["layout"] == "hf-lowrank" and set(rec["files"]) == set(TEXT)
  for f in TEXT:
    assert _same_bytes(root / "ck" / f, tmp_path / "ex" / f), f
  back = checkpoint.load_hf(tmp_path / "ex")
  assert back.layer_ranks() == m.layer_ranks()

  rc, out, err = _cli(
    capsys, "export", "--ckpt", root / "ck", "--out", tmp_path / "dn", "--format", "hf-dense"
  )
  assert rc == 0, err
  cfg = json.loads((tmp_path / "dn" / "config.json").read_text())
  assert cfg["architectures"] == ["LlamaForCausalLM"] and "auto_map" not in cfg
  assert not (tmp_path / "dn" / "modeling_lrjax_lowrank.py").exists()
  assert checkpoint.read_export_record(tmp_path / "dn")["layout"] == "hf-dense"
  for f in TEXT:
    assert _same_bytes(root / "ck" / f, tmp_path / "dn" / f), f


@pytest.mark.parametrize("fmt", ["hf-lowrank", "hf-dense"])
def test_carried_tokenizer_loads_in_transformers(ckpt, capsys, tmp_path, fmt):
  transformers = pytest.importorskip("transformers", reason="the [test] extra installs it")
  from tokenizers import Tokenizer

  root, _ = ckpt
  out = tmp_path / f"ex_{fmt}"
  rc, _, err = _cli(capsys, "export", "--ckpt", root / "ck", "--out", out, "--format", fmt)
  assert rc == 0, err
  text = tiny_text(np.random.default_rng(int.from_bytes(os.urandom(4), "little")), 60)
  # AutoTokenizer reads config.json first: the low-rank model type needs the remote code too
  kw = dict(trust_remote_code=True) if fmt == "hf-lowrank" else {}
  tok = transformers.AutoTokenizer.from_pretrained(out, **kw)
  want = Tokenizer.from_file(str(root / "ck" / "tokenizer.json")).encode(text).ids
  assert tok(text)["input_ids"] == want and want[0] == tok.bos_token_id
  gen = transformers.GenerationConfig.from_pretrained(out)
  assert gen.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("</s>")


def test_tokenizer_from_replaces_the_checkpoints_files(ckpt, capsys, tmp_path):
  root, _ = ckpt
  rc, out, err = _cli(
    capsys, "export", "--ckpt", root / "ck", "--out", tmp_path / "ex", "--tokenizer-from",
    root / "tok2",
  )  # fmt: skip
  assert rc == 0, err
  for f in TEXT:
    assert _same_bytes(root / "tok2" / f, tmp_path / "ex" / f), f
  assert not _same_bytes(root / "ck" / "tokenizer.json", tmp_path / "ex" / "tokenizer.json")


@pytest.mark.parametrize(
  ("setup", "match"),
  [
    ("empty", "--tokenizer-from .*: no tokenizer or generation files there"),
    ("missing", "--tokenizer-from .*: no such directory"),
    ("big", "the tokenizer has .* tokens but the model's vocab_size is 128"),
    ("broken", "tokenizer.json: not a tokenizers file"),
    ("self", "is an input of this command"),
  ],
)
def test_bad_tokenizer_source_fails_before_writing(ckpt, capsys, tmp_path, setup, match):
  root, _ = ckpt
  src = tmp_path / "tok"
  out = tmp_path / "ex"
  if setup != "missing":
    src.mkdir()
  if setup == "big":
    text = " ".join(f"w{i}" for i in range(400))
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(text.split())}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(src / "tokenizer.json"))
  elif setup == "broken":
    (src / "tokenizer.json").write_text('{"version": "1.0", "model": 3}')
  elif setup == "self":
    shutil.copy(root / "ck" / "tokenizer.json", src)
    out = src
  rc, _, err = _cli(capsys, "export", "--ckpt", root / "ck", "--out", out, "--tokenizer-from", src)
  assert rc == 2
  assert len(err.strip().splitlines()) == 1 and err.startswith("lrjax export: error: "), err
  assert re.search(match, err), err
  if setup != "self":
    assert not out.exists()


def test_paths_relative_home_and_links_from_another_directory(ckpt, capsys, tmp_path, monkeypatch):
  root, _ = ckpt
  home = tmp_path / "home"
  work = tmp_path / "work" / "sub"
  work.mkdir(parents=True)
  home.mkdir()
  monkeypatch.setenv("HOME", str(home))
  shutil.copytree(root / "ck", tmp_path / "work" / "ck")
  os.symlink(root / "tok2", tmp_path / "work" / "tok_link")
  monkeypatch.chdir(work)
  rc, _, err = _cli(
    capsys, "export", "--ckpt", "../ck", "--out", "~/exports/ex", "--tokenizer-from",
    "../tok_link", "--format", "hf-dense",
  )  # fmt: skip
  assert rc == 0, err
  assert _same_bytes(root / "tok2" / "tokenizer.json", home / "exports" / "ex" / "tokenizer.json")
  os.symlink(home / "exports" / "ex", work / "ex_link")
  # an export through a link replaces the target and keeps the link
  rc, _, err = _cli(capsys, "export", "--ckpt", "../ck", "--out", "ex_link", "--overwrite")
  assert rc == 0, err
  assert os.path.islink(work / "ex_link")
  assert (home / "exports" / "ex" / "modeling_lrjax_lowrank.py").is_file()
  assert (
    checkpoint.load_hf("ex_link").layer_ranks() == checkpoint.load_hf("~/exports/ex").layer_ranks()
  )


def test_overwrite_replaces_only_an_earlier_export(ckpt, capsys, tmp_path):
  root, _ = ckpt
  keep = tmp_path / "mine"
  keep.mkdir()
  (keep / "notes.txt").write_text("not lrjax's")
  for extra in ([], ["--overwrite"]):
    rc, _, err = _cli(capsys, "export", "--ckpt", root / "ck", "--out", keep, *extra)
    assert rc == 2 and (keep / "notes.txt").read_text() == "not lrjax's", err
  rc, _, err = _cli(capsys, "export", "--ckpt", root / "ck", "--out", tmp_path / "ex")
  assert rc == 0, err
  rc, _, err = _cli(
    capsys, "export", "--ckpt", root / "ck", "--out", tmp_path / "ex", "--format", "hf-dense"
  )
  assert rc == 2 and "exists; pass overwrite=True (CLI: --overwrite)" in err
  rc, _, err = _cli(
    capsys, "export", "--ckpt", root / "ck", "--out", tmp_path / "ex", "--format", "hf-dense",
    "--overwrite",
  )  # fmt: skip
  assert rc == 0, err
  assert not (tmp_path / "ex" / "modeling_lrjax_lowrank.py").exists()
  assert checkpoint.read_export_record(tmp_path / "ex")["layout"] == "hf-dense"
  rc, _, err = _cli(capsys, "export", "--ckpt", root / "ck", "--out", root / "ck", "--overwrite")
  assert rc == 2 and "is an input of this command" in err
  assert checkpoint.is_checkpoint(root / "ck") is None


def test_extra_files_cannot_replace_what_the_export_writes(ckpt, tmp_path):
  root, m = ckpt
  for name in ("config.json", "model.safetensors", "lrjax_export.json"):
    f = tmp_path / "src" / name
    f.parent.mkdir(exist_ok=True)
    f.write_text("{}")
    with pytest.raises(ValueError, match=f"an export writes its own {name}"):
      checkpoint.export_hf(m, tmp_path / "ex", extra_files=[f])
  with pytest.raises(FileNotFoundError, match="no such file"):
    checkpoint.export_hf(m, tmp_path / "ex", extra_files=[tmp_path / "nope.json"])
  assert not (tmp_path / "ex").exists()


def test_params_without_an_hf_layout_are_refused_by_name(tmp_path):
  """A model holding arrays HF has no layout for (e.g. packed int4 factors) is not exported."""
  from flax import nnx

  from lrjax.models import LlamaForCausalLM, ModelConfig

  m = LlamaForCausalLM(ModelConfig.tiny(), rngs=nnx.Rngs(0))
  m.layers[1].mlp.up_proj.kernel_packed = nnx.Param(jnp.ones((4, 8), jnp.uint8))
  with pytest.raises(ValueError, match=r"layers\.1\.mlp\.up_proj\.kernel_packed: .*quantized"):
    checkpoint.export_hf(m, tmp_path / "ex")
  assert not (tmp_path / "ex").exists()


def test_load_hf_reads_the_earlier_low_rank_layout(ckpt, tmp_path):
  """Exports written before hf-lowrank had a model type of its own (the plain model_type with
  an lrjax_lowrank key) still load as the low-rank model."""
  root, m = ckpt
  checkpoint.export_hf(m, tmp_path / "ex")
  p = tmp_path / "ex" / "config.json"
  cfg = json.loads(p.read_text())
  cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
  for k in ("auto_map",):
    del cfg[k]
  for k in ("base_model_type", "base_architecture"):
    del cfg["lrjax_lowrank"][k]
  p.write_text(json.dumps(cfg))
  (tmp_path / "ex" / "modeling_lrjax_lowrank.py").unlink()
  back = checkpoint.load_hf(tmp_path / "ex")
  assert back.layer_ranks() == m.layer_ranks()
  cfg["model_type"] = "lrjax_lowrank_qwen2"  # a low-rank type must name its base
  p.write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match="needs lrjax_lowrank.base_model_type='qwen2', got None"):
    checkpoint.load_hf(tmp_path / "ex")
