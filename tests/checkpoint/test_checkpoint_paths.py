"""Relative paths, ``~`` and symlinks work for every checkpoint function and CLI command.

orbax wants absolute paths; lrjax resolves them at its boundary. The CLI is run from a working
directory other than the repository's, with relative ``--hf``/``--out``/``--ckpt``.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
from ckpt_helpers import FIXTURES, bit_equal, random_model

from lrjax import checkpoint, cli
from lrjax.checkpoint import SafetensorsDir


@pytest.fixture
def work(tmp_path, monkeypatch):
  """cwd = tmp_path/work, HOME = tmp_path, a copy of the qwen3 fixture at tmp_path/src."""
  import shutil

  (tmp_path / "work").mkdir()
  shutil.copytree(os.path.join(FIXTURES, "qwen3"), tmp_path / "src" / "qwen3")
  monkeypatch.chdir(tmp_path / "work")
  monkeypatch.setenv("HOME", str(tmp_path))
  return tmp_path / "work"


def test_library_functions_take_relative_home_and_linked_paths(work):
  m1, m2 = random_model(), random_model()
  checkpoint.save(m1, "rel/ck")
  assert (work / "rel" / "ck" / checkpoint.METADATA_NAME).is_file()
  for p in ("rel/ck", "./rel/../rel/ck", "~/work/rel/ck"):
    assert bit_equal(checkpoint.load(p), m1), p
    assert checkpoint.read_metadata(p)["format"] == "lrjax-orbax"
  os.symlink("rel/ck", "lnk")
  assert bit_equal(checkpoint.load("lnk"), m1)
  checkpoint.save(m2, "lnk", overwrite=True)  # writes through the link to its target
  assert os.path.islink("lnk") and bit_equal(checkpoint.load("rel/ck"), m2)
  checkpoint.export_hf(m2, "~/exported")
  assert (work.parent / "exported" / "config.json").is_file()
  os.symlink(work.parent / "exported", "ex_link")
  for p in ("../exported", "~/exported", "ex_link"):
    assert bit_equal(checkpoint.load_hf(p), m2), p
    assert checkpoint.digest(p).startswith("sha256:")
    assert len(SafetensorsDir(p).names) > 0
  assert bit_equal(checkpoint.load_hf("../src/qwen3"), checkpoint.load_hf("~/src/qwen3"))


def test_cli_from_another_working_directory(work, capsys):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run(
    [sys.executable, "-m", "lrjax.cli", "convert", "--hf", "../src/qwen3", "--out", "out/ck_w",
     "--ratio", "0.3", "--method", "svd", "--block", "4", "--verify"],
    capture_output=True, text=True, timeout=300, env=env,
  )  # fmt: skip
  assert r.returncode == 0, r.stderr[-3000:]
  assert "verified" in r.stdout
  assert checkpoint.load(work / "out" / "ck_w").compression["source"] == str(
    work.parent / "src" / "qwen3"
  )
  assert cli.main(["export", "--ckpt", "out/ck_w", "--out", "~/ex_w"]) == 0
  assert bit_equal(checkpoint.load_hf(work.parent / "ex_w"), checkpoint.load("out/ck_w"))
  np.save(work.parent / "calib.npy", np.arange(32).reshape(2, 16) % 7)
  assert cli.main(["convert", "--orbax", "~/work/out/ck_w", "--out", "ck2", "--ratio", "0.3",
                   "--calib", "~/calib.npy", "--block", "4"]) == 1  # fmt: skip
  # Got as far as the source's metadata (a low-rank input): the checkpoint and tokens were found.
  assert "--orbax ~/work/out/ck_w is already compressed" in capsys.readouterr().err
  # generate loads the relative checkpoint, then rejects a prompt longer than its cache with
  # the engine's one-line error (the warm-up used to die with StopIteration).
  long = ",".join(["1"] * 40)
  rc = cli.main(["generate", "--ckpt", "out/ck_w", "--prompt-ids", long, "--max-len", "16"])
  err = capsys.readouterr().err
  assert rc == 1 and "prompt has 40 tokens; this engine takes at most 15" in err, err
  # one error line (after the start-up notices), no traceback
  assert "Traceback" not in err and [ln for ln in err.splitlines() if "error:" in ln] == [
    err.strip().splitlines()[-1]
  ]
  assert sorted(os.listdir(work)) == ["out"] and sorted(os.listdir(work / "out")) == ["ck_w"]


def test_generate_rejects_a_prompt_longer_than_its_cache(tmp_path, capsys):
  """The warm-up used to die with StopIteration before the engine could say what is wrong."""
  checkpoint.save(random_model(), tmp_path / "ck")
  long = ",".join(["1"] * 40)
  args = ["generate", "--ckpt", str(tmp_path / "ck"), "--prompt-ids", "1,2", "--prompt-ids"]
  rc = cli.main(args + [long, "--max-len", "16"])
  err = capsys.readouterr().err
  assert rc == 1 and "prompt has 40 tokens; this engine takes at most 15" in err, err
  # one error line (after the start-up notices), no traceback
  assert "Traceback" not in err and [ln for ln in err.splitlines() if "error:" in ln] == [
    err.strip().splitlines()[-1]
  ]
