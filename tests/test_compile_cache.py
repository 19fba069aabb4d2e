"""The commands' on-disk compilation cache (lrjax.compile_cache): where it lives, how it is
switched off, and that a second run of a command reads it and prints the same tokens."""

import os
import subprocess
import sys

import pytest
from conftest import CHAT

from lrjax import checkpoint, compile_cache
from lrjax.text import carried_files


def test_the_directory_from_the_environment(tmp_path):
  assert compile_cache.cache_dir({"HOME": "/h"}) == os.path.join(
    os.path.expanduser("~"), ".cache", "lrjax", "xla"
  )
  assert compile_cache.cache_dir({"XDG_CACHE_HOME": "/x"}) == "/x/lrjax/xla"
  assert compile_cache.cache_dir({"LRJAX_COMPILE_CACHE": str(tmp_path)}) == str(tmp_path)
  for off in ("off", "OFF", "0", "none", "false", "no"):
    assert compile_cache.cache_dir({"LRJAX_COMPILE_CACHE": off}) is None
  assert compile_cache.cache_bytes({}) == 2_000_000_000
  assert compile_cache.cache_bytes({"LRJAX_COMPILE_CACHE_GB": "0.5"}) == 500_000_000
  for bad in ("0", "-1", "lots", "inf", "nan"):
    with pytest.raises(ValueError, match="LRJAX_COMPILE_CACHE_GB=.* must be a positive number"):
      compile_cache.cache_bytes({"LRJAX_COMPILE_CACHE_GB": bad})


def test_enable_sets_jax_config_or_warns(tmp_path, monkeypatch, caplog):
  import jax

  seen = {}
  monkeypatch.setattr(jax.config, "update", lambda k, v: seen.__setitem__(k, v))
  d = tmp_path / "c"
  assert compile_cache.enable({"LRJAX_COMPILE_CACHE": str(d)}) == str(d) and d.is_dir()
  assert seen["jax_compilation_cache_dir"] == str(d)
  assert seen["jax_persistent_cache_min_compile_time_secs"] == compile_cache.MIN_COMPILE_S
  assert seen["jax_compilation_cache_max_size"] in (2_000_000_000, -1)
  seen.clear()
  assert compile_cache.enable({"LRJAX_COMPILE_CACHE": "off"}) is None and not seen
  afile = tmp_path / "afile"
  afile.write_text("mine")
  assert compile_cache.enable({"LRJAX_COMPILE_CACHE": str(afile / "c")}) is None and not seen
  assert "no compilation cache" in caplog.text and "LRJAX_COMPILE_CACHE" in caplog.text
  assert afile.read_text() == "mine"
  # jax's own variables the user set win, and the directory returned is the one in effect
  seen.clear()
  mine = {"LRJAX_COMPILE_CACHE": str(d), "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "j")}
  assert compile_cache.enable(mine) == str(tmp_path / "j")
  assert "jax_compilation_cache_dir" not in seen
  assert seen["jax_persistent_cache_min_compile_time_secs"] == compile_cache.MIN_COMPILE_S


def test_before_jax_is_imported_it_sets_jax_environment_variables(tmp_path):
  code = (
    "import os, sys; from lrjax import compile_cache; "
    "p = compile_cache.enable(); assert 'jax' not in sys.modules; "
    "import jax; print(p, jax.config.jax_compilation_cache_dir, "
    "jax.config.jax_persistent_cache_min_compile_time_secs)"
  )
  env = {**os.environ, "LRJAX_COMPILE_CACHE": str(tmp_path / "c")}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == [str(tmp_path / "c"), str(tmp_path / "c"), "0.2"]
  env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "j")  # the user's own setting wins
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == [str(tmp_path / "j"), str(tmp_path / "j"), "0.2"]


def test_a_second_run_reads_the_cache_and_prints_the_same(tmp_path, chat_model):
  ck = tmp_path / "ck"
  with carried_files(CHAT) as extra:
    checkpoint.save(chat_model, ck, extra_files=extra)
  cache = tmp_path / "cache"
  argv = [sys.executable, "-m", "lrjax", "generate", "--ckpt", str(ck), "--prompt-ids",
          "5,6,7", "--max-new-tokens", "6", "--max-len", "32", "--slots", "1"]  # fmt: skip

  def run(setting):
    env = {**os.environ, "LRJAX_COMPILE_CACHE": setting, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return [ln.split(" (")[0] for ln in out.stdout.splitlines() if ln.startswith("[0]")]

  first = run(str(cache))
  entries = sorted(os.listdir(cache))
  assert first and entries  # the compiled steps were stored
  assert run(str(cache)) == first
  assert sorted(os.listdir(cache)) == entries  # read, not compiled and stored anew
  assert run("off") == first
