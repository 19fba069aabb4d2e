"""`lrjax convert` / `lrjax export`: outputs reload to exactly the in-memory compressed model."""

import json
import os

import numpy as np
import pytest
from flax import nnx

from lrjax import checkpoint, cli
from lrjax.compression import compress
from lrjax.models import from_hf

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")


def _assert_bit_equal(a, b):
  fa, fb = dict(nnx.to_flat_state(nnx.state(a))), dict(nnx.to_flat_state(nnx.state(b)))
  assert set(fa) == set(fb)
  for k in fa:
    x, y = np.asarray(fa[k][...]), np.asarray(fb[k][...])
    assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), k


@pytest.fixture
def calib(tmp_path, rng):
  p = tmp_path / "calib.npy"
  np.save(p, rng.integers(0, 128, (4, 16)).astype(np.int32))
  return p


def test_convert_hf_whiten_matches_in_memory(tmp_path, calib, capsys):
  src = os.path.join(FIXTURES, "llama3")
  rc = cli.main(
    [
      "convert",
      "--hf",
      src,
      "--out",
      str(tmp_path / "lr"),
      "--ratio",
      "0.3",
      "--method",
      "whiten",
      "--calib",
      str(calib),
      "--block",
      "8",
      "--verify",
    ]
  )
  assert rc == 0
  out = capsys.readouterr().out  # the steps, in order
  steps = [f"loading HF checkpoint {src}", "saving ", "wrote ", "verifying ", "verified: "]
  at = [out.find(step) for step in steps]
  assert -1 not in at and at == sorted(at), out
  ref = compress(
    from_hf(src), ratio=0.3, calib_tokens=np.load(calib), method="whiten", block=8, progress=False
  )
  back = checkpoint.load(tmp_path / "lr")
  _assert_bit_equal(ref, back)
  assert back.compression["method"] == "whiten" and back.compression["ratio"] == 0.3
  assert back.compression["source"] == os.path.abspath(src)
  assert back.source_digest == ref.source_digest
  assert all(r % 8 == 0 for layer in back.layer_ranks() for r in layer.values())


def test_convert_orbax_dense_to_low_rank_then_export(tmp_path):
  src = os.path.join(FIXTURES, "qwen3")
  dense = from_hf(src)
  checkpoint.save(dense, tmp_path / "dense")
  rc = cli.main(
    [
      "convert",
      "--orbax",
      str(tmp_path / "dense"),
      "--out",
      str(tmp_path / "lr"),
      "--ratio",
      "0.4",
      "--method",
      "svd",
      "--mlp-only",
      "--block",
      "4",
    ]
  )
  assert rc == 0
  ref = compress(dense, ratio=0.4, method="svd", mlp_only=True, block=4, progress=False)
  back = checkpoint.load(tmp_path / "lr")
  _assert_bit_equal(ref, back)
  assert set(back.layer_ranks()[0]) == {"gate_proj", "up_proj", "down_proj"}
  assert cli.main(["export", "--ckpt", str(tmp_path / "lr"), "--out", str(tmp_path / "hf")]) == 0
  cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert cfg["lrjax_lowrank"]["ranks"] == back.layer_ranks()
  assert cfg["lrjax_compression"]["method"] == "svd"
  _assert_bit_equal(back, from_hf(tmp_path / "hf"))


def test_convert_errors_are_clear(tmp_path, capsys, calib):
  src = os.path.join(FIXTURES, "qwen3")
  assert (
    cli.main(
      ["convert", "--hf", src, "--out", str(tmp_path / "o"), "--ratio", "1.5", "--method", "svd"]
    )
    == 2
  )
  assert "ratio" in capsys.readouterr().err
  assert not (tmp_path / "o").exists()
  (tmp_path / "o").mkdir()
  assert (
    cli.main(
      ["convert", "--hf", src, "--out", str(tmp_path / "o"), "--ratio", "0.2", "--method", "svd"]
    )
    == 2
  )
  assert "--overwrite" in capsys.readouterr().err
  bad = tmp_path / "calib.txt"
  bad.write_text("1 2 3\n4 5\n")
  assert (
    cli.main(
      [
        "convert",
        "--hf",
        src,
        "--out",
        str(tmp_path / "p"),
        "--ratio",
        "0.2",
        "--block",
        "8",
        "--calib",
        str(bad),
      ]
    )
    == 1
  )
  assert "same length" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cli.main(["convert", "--out", str(tmp_path / "q"), "--ratio", "0.2"])  # no source


def test_subcommand_registry():
  names = set(cli.build_parser()._subparsers._group_actions[0].choices)
  assert {"convert", "export"} <= names
  with pytest.raises(ValueError, match="registered twice"):
    cli.subcommand("convert", help="dup")(lambda p: None)


def test_load_tokens_formats(tmp_path, rng):
  t = rng.integers(0, 100, (3, 5))
  np.save(tmp_path / "a.npy", t)
  (tmp_path / "a.txt").write_text("\n".join(" ".join(map(str, r)) for r in t))
  from safetensors.numpy import save_file

  save_file({"tokens": t.astype(np.int32)}, str(tmp_path / "a.safetensors"))
  for f in ("a.npy", "a.txt", "a.safetensors"):
    assert np.array_equal(cli.load_tokens(str(tmp_path / f)), t)
  np.save(tmp_path / "f.npy", t.astype(np.float32))
  with pytest.raises(ValueError, match=r"must be integers \[batch, seq\]"):
    cli.load_tokens(str(tmp_path / "f.npy"))


def test_convert_lora_uses_its_own_tokens(tmp_path, calib, rng):
  src = os.path.join(FIXTURES, "llama3")
  lora = tmp_path / "lora.npy"
  np.save(lora, rng.integers(0, 128, (12, 17)).astype(np.int32))
  args = [
    "convert",
    "--hf",
    src,
    "--ratio",
    "0.3",
    "--method",
    "whiten",
    "--calib",
    str(calib),
    "--block",
    "8",
    "--lora-steps",
    "3",
    "--lora-batch",
    "4",
  ]
  assert cli.main(args + ["--out", str(tmp_path / "a"), "--lora-tokens", str(lora)]) == 0
  ref = compress(
    from_hf(src),
    ratio=0.3,
    calib_tokens=np.load(calib),
    method="whiten",
    block=8,
    lora_steps=3,
    lora_batch=4,
    lora_tokens=np.load(lora),
    progress=False,
  )
  _assert_bit_equal(ref, checkpoint.load(tmp_path / "a"))
  assert checkpoint.load(tmp_path / "a").compression["lora"]["steps"] == 3
