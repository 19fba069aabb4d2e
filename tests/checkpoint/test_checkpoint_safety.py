"""Writes never destroy what lrjax did not create, survive crashes at every step, and serialise.

Covers ``atomic_dir`` (through ``save``/``export_hf``) and the ``convert``/``export`` CLI:
``--overwrite`` refusals, the output lock, crash injection at each file-system step (an
exception in-process, and a real SIGKILL in a child process), stale-temporary cleanup, and the
argument checks that run before any model is loaded.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
from ckpt_helpers import TINY, bit_equal, copy_fixture, random_model, unwritable_dir

from lrjax import checkpoint, cli
from lrjax.checkpoint import atomic

ATOMIC_PY = atomic.__file__
# Every file-system step of a write that changes what is on disk or makes it durable.
STEPS = ("_mkdir", "_fsync_tree", "_exchange", "_rename", "_fsync_path", "_rmtree")


def _cli(capsys, *args) -> tuple[int, str]:
  rc = cli.main([str(a) for a in args])
  err = capsys.readouterr().err
  return rc, err


def _one_line_error(err: str):
  lines = [ln for ln in err.strip().splitlines() if ln]
  assert len(lines) == 1 and "Traceback" not in err, err
  return lines[0]


@pytest.fixture
def no_load(monkeypatch):
  """Fail the test if a model is loaded (cheap checks must come first)."""

  def boom(*a, **kw):
    raise AssertionError("a model was loaded before the arguments were checked")

  monkeypatch.setattr(checkpoint, "load_hf", boom)
  monkeypatch.setattr(checkpoint, "load", boom)


@pytest.fixture
def saved(tmp_path):
  """An lrjax checkpoint at tmp_path/ck and the model in it."""
  m = random_model()
  checkpoint.save(m, tmp_path / "ck")
  return tmp_path / "ck", m


def _convert_args(src, out, *extra):
  return [
    "convert",
    "--hf",
    src,
    "--out",
    out,
    "--ratio",
    "0.3",
    "--method",
    "svd",
    "--block",
    "4",
  ] + list(extra)


# ---- --overwrite refuses what lrjax did not write ---------------------------------------------
def test_overwrite_refuses_a_directory_that_is_not_a_checkpoint(tmp_path, capsys):
  src = copy_fixture(tmp_path)
  out = tmp_path / "mine"
  out.mkdir()
  (out / "important.txt").write_text("keep me")
  rc, err = _cli(capsys, *_convert_args(src, out, "--overwrite"))
  assert rc == 2 and "is not an lrjax checkpoint" in _one_line_error(err)
  assert (out / "important.txt").read_text() == "keep me"
  with pytest.raises(FileExistsError, match="is not an lrjax checkpoint"):
    checkpoint.save(random_model(), out, overwrite=True)
  with pytest.raises(FileExistsError, match="is not an lrjax export"):
    checkpoint.export_hf(random_model(), out, overwrite=True)
  assert sorted(os.listdir(out)) == ["important.txt"]
  assert sorted(p for p in os.listdir(tmp_path) if p.startswith(".")) == []


def test_overwrite_refuses_a_file(tmp_path, capsys):
  src = copy_fixture(tmp_path)
  f = tmp_path / "afile"
  f.write_text("data")
  for extra in (["--overwrite"], []):
    rc, err = _cli(capsys, *_convert_args(src, f, *extra))
    assert rc == 2 and "is not a directory" in _one_line_error(err)
  with pytest.raises(FileExistsError, match="never replaces a file"):
    checkpoint.save(random_model(), f, overwrite=True)
  assert f.read_text() == "data"
  assert sorted(os.listdir(tmp_path)) == ["afile", "qwen3"]


def test_overwrite_refuses_the_current_directory(tmp_path, capsys, monkeypatch, saved):
  ck, m = saved
  src = copy_fixture(tmp_path)
  monkeypatch.chdir(ck)
  for out in (".", str(ck), "./", "../ck"):
    rc, err = _cli(capsys, *_convert_args(src, out, "--overwrite"))
    assert rc == 2 and "current directory" in _one_line_error(err), (out, err)
  rc, err = _cli(capsys, *_convert_args(src, "", "--overwrite"))
  assert rc == 2 and "empty" in _one_line_error(err)
  monkeypatch.chdir(ck / "state")  # an ancestor of the working directory is refused too
  with pytest.raises(FileExistsError, match="contains the current directory"):
    checkpoint.save(random_model(), ck, overwrite=True)
  assert bit_equal(checkpoint.load(ck), m)


def test_overwrite_refuses_the_input_and_its_ancestors(tmp_path, capsys, monkeypatch, saved):
  ck, m = saved
  hf = copy_fixture(tmp_path, dest="hf")
  before = sorted(os.listdir(hf))
  rc, err = _cli(capsys, *_convert_args(hf, hf, "--overwrite"))
  assert rc == 2 and "is an input" in _one_line_error(err)
  assert sorted(os.listdir(hf)) == before
  os.symlink(ck, tmp_path / "link")
  monkeypatch.chdir(tmp_path)
  for out in ("ck", "./ck", "link", str(ck) + "/", "link/../ck"):
    rc, err = _cli(capsys, "convert", "--orbax", "ck", "--out", out, "--ratio", "0.3",
                   "--method", "svd", "--block", "4", "--overwrite")  # fmt: skip
    assert rc == 2 and "is an input" in _one_line_error(err), (out, err)
  # An lrjax checkpoint that holds the input inside it is refused as well.
  src = copy_fixture(tmp_path, dest="ck/inner_hf")
  rc, err = _cli(capsys, *_convert_args(src, ck, "--overwrite"))
  assert rc == 2 and "contains an input" in _one_line_error(err)
  ex = tmp_path / "ex"
  checkpoint.export_hf(m, ex)
  rc, err = _cli(capsys, "export", "--ckpt", "ck", "--out", "link", "--overwrite")
  assert rc == 2 and "is an input" in _one_line_error(err)
  assert bit_equal(checkpoint.load(ck), m)


def test_overwrite_replaces_what_lrjax_wrote(tmp_path, capsys):
  m1, m2 = random_model(), random_model()
  checkpoint.save(m1, tmp_path / "ck")
  with pytest.raises(FileExistsError, match="overwrite=True"):
    checkpoint.save(m2, tmp_path / "ck")
  checkpoint.save(m2, tmp_path / "ck", overwrite=True)
  assert bit_equal(checkpoint.load(tmp_path / "ck"), m2)
  checkpoint.export_hf(m1, tmp_path / "ex")
  checkpoint.export_hf(m2, tmp_path / "ex", overwrite=True)
  assert bit_equal(checkpoint.load_hf(tmp_path / "ex", with_digest=False), m2)
  with pytest.raises(FileExistsError, match="not an lrjax checkpoint"):  # an export is not one
    checkpoint.save(m1, tmp_path / "ex", overwrite=True)
  (tmp_path / "empty").mkdir()  # an empty directory holds nothing to lose
  checkpoint.save(m1, tmp_path / "empty", overwrite=True)
  assert sorted(os.listdir(tmp_path)) == ["ck", "empty", "ex"]
  rc, err = _cli(capsys, "export", "--ckpt", tmp_path / "ck", "--out", tmp_path / "ex")
  assert rc == 2 and "--overwrite" in _one_line_error(err)
  rc, _ = _cli(capsys, "export", "--ckpt", tmp_path / "ck", "--out", tmp_path / "ex", "--overwrite")
  assert rc == 0
  assert bit_equal(checkpoint.load_hf(tmp_path / "ex", with_digest=False), m2)


# ---- one writer per output --------------------------------------------------------------------
def test_second_writer_fails_while_the_first_holds_the_lock(tmp_path, capsys, no_load):
  out = tmp_path / "ck"
  holder = subprocess.Popen(
    [sys.executable, "-c", textwrap.dedent(f"""
      import importlib.util, sys, time
      spec = importlib.util.spec_from_file_location("atomic", {ATOMIC_PY!r})
      atomic = importlib.util.module_from_spec(spec); spec.loader.exec_module(atomic)
      with atomic.reserve_output({str(out)!r}):
        print("held", flush=True)
        sys.stdin.readline()
    """)],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
  )  # fmt: skip
  try:
    assert holder.stdout.readline().strip() == "held"
    src = copy_fixture(tmp_path)
    rc, err = _cli(capsys, *_convert_args(src, out))
    assert rc == 2 and "being written by another process" in _one_line_error(err)
    assert f"pid {holder.pid}" in err
    with pytest.raises(checkpoint.OutputBusyError, match="another process"):
      checkpoint.save(random_model(), out)
  finally:
    holder.communicate("\n", timeout=30)
  checkpoint.save(random_model(), out)  # free again; the holder's lock file is gone
  assert sorted(os.listdir(tmp_path)) == ["ck", "qwen3"]


def test_threads_of_one_process_do_not_share_a_write(tmp_path):
  out = tmp_path / "ck"
  seen = []
  with checkpoint.reserve_output(out):
    t = threading.Thread(target=lambda: seen.append(_try_save(out)))
    t.start()
    t.join()
  assert seen == ["busy"]


def _try_save(out):
  try:
    checkpoint.save(random_model(), out)
  except checkpoint.OutputBusyError:
    return "busy"
  return "wrote"


@pytest.mark.slow
def test_two_concurrent_converts_write_once(tmp_path):
  src = copy_fixture(tmp_path)
  out = tmp_path / "ck"
  cmd = [sys.executable, "-m", "lrjax.cli"] + _convert_args(str(src), str(out))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  procs = [
    subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for _ in range(2)
  ]
  res = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
  wrote = [r for r in res if r[2] == 0]
  assert len(wrote) == 1 and "wrote" in wrote[0][0], res
  (_, err, rc) = next(r for r in res if r[2] != 0)
  assert rc == 2 and ("another process" in err or "exists" in err), err
  assert "Traceback" not in err
  checkpoint.load(out)
  assert sorted(os.listdir(tmp_path)) == ["ck", "qwen3"]


# ---- crash at every step ----------------------------------------------------------------------
class Crash(BaseException):
  """An interruption `except Exception` cannot swallow."""


def _crash_at(monkeypatch, k: int) -> list:
  """Make the k-th file-system step of the next write raise Crash; returns the step log."""
  log = []
  for name in STEPS:
    real = getattr(atomic, name)

    def step(*a, _real=real, _name=name, **kw):
      log.append(_name)
      if len(log) == k:
        raise Crash(f"crash at step {k} ({_name})")
      return _real(*a, **kw)

    monkeypatch.setattr(atomic, name, step)
  return log


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_replace_survives_a_crash_at_every_step(tmp_path, monkeypatch, exchange):
  old, new = random_model(), random_model()
  pristine = tmp_path / "pristine" / "ck"
  checkpoint.save(old, pristine)
  tmp_path = tmp_path / "w"
  out = tmp_path / "ck"
  if not exchange:
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
  k, crashed = 1, True
  while crashed:
    if out.exists():
      shutil.rmtree(out)
    shutil.copytree(pristine, out)
    with monkeypatch.context() as mp:
      steps = _crash_at(mp, k)
      try:
        checkpoint.save(new, out, overwrite=True)
        crashed = False
      except Crash:
        pass
    back = checkpoint.load(out)
    assert bit_equal(back, new) or bit_equal(back, old), f"step {k}: {steps}"
    if not crashed:
      assert bit_equal(back, new)
    # What a crash left behind belongs to this (live) process: kept until its owner is gone.
    left = [p for p in os.listdir(tmp_path) if p != "ck"]
    assert all(p.startswith((".ck.tmp-", ".ck.old-")) for p in left), left
    assert checkpoint.clean_stale(tmp_path) == []
    with monkeypatch.context() as mp:
      mp.setattr(atomic, "_owner_gone", lambda owner: True)
      checkpoint.clean_stale(tmp_path)
    assert os.listdir(tmp_path) == ["ck"]
    k += 1
  assert k > 5  # mkdir, fsyncs, the swap (1 or 2 renames), settle: every one was hit


def _child_write(out, k, exchange, kind="tmp"):
  """Run a write of a tiny tree into ``out`` in a child that SIGKILLs itself at step ``k``."""
  code = textwrap.dedent(f"""
    import importlib.util, os, signal
    spec = importlib.util.spec_from_file_location("atomic", {ATOMIC_PY!r})
    atomic = importlib.util.module_from_spec(spec); spec.loader.exec_module(atomic)
    if not {exchange!r}:
      atomic._exchange = lambda a, b: False
    n = [0]
    for name in {STEPS!r}:
      real = getattr(atomic, name)
      def step(*a, _real=real, **kw):
        n[0] += 1
        if n[0] == {k}:
          os.kill(os.getpid(), signal.SIGKILL)
        return _real(*a, **kw)
      setattr(atomic, name, step)
    ok = lambda p: None if (p / "marker").exists() else "has no marker"
    with atomic.atomic_dir({str(out)!r}, overwrite=True, replaceable=ok) as tmp:
      (tmp / "payload").write_bytes(b"new" * 100000)
      (tmp / "marker").write_text("new")
  """)
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_replace_survives_sigkill_at_every_step(tmp_path, exchange):
  out = tmp_path / "ck"
  k = 1
  while True:
    out.mkdir()
    (out / "payload").write_bytes(b"old" * 100000)
    (out / "marker").write_text("old")
    r = _child_write(out, k, exchange)
    killed = r.returncode == -signal.SIGKILL
    assert killed or r.returncode == 0, r.stderr
    if not exchange and killed and not out.exists():
      # Killed between the two renames: the next write in this parent restores the old tree.
      assert f"restored {out}" in checkpoint.clean_stale(tmp_path)
    state = (out / "marker").read_text()
    assert state in ("old", "new") and (out / "payload").read_bytes() == state.encode() * 100000
    checkpoint.clean_stale(tmp_path)  # the child is gone: all its temporaries and its lock go
    assert os.listdir(tmp_path) == ["ck"], (k, os.listdir(tmp_path))
    atomic._rmtree(out)
    if not killed:
      assert state == "new"
      break
    k += 1
  assert k > 5


def test_stale_temporaries_of_live_or_foreign_owners_are_kept(tmp_path):
  me = atomic._owner()
  machine, pid, start = me.split("-")
  live = tmp_path / f".ck.tmp-{me}-0000abcd"
  foreign = tmp_path / f".ck.tmp-{'f' * 8}{machine[8:]}-1-1-0000abcd"
  rebooted = tmp_path / f".ck.old-{machine[:8]}{'0' * 8}-{pid}-{start}-0000abcd"
  reused_pid = tmp_path / f".ck.tmp-{machine}-{pid}-{int(start) + 1}-0000abcd"
  legacy = tmp_path / ".ck.tmp-1a2b3c4d"  # no owner record: never touched
  for d in (live, foreign, rebooted, reused_pid, legacy):
    d.mkdir()
  (tmp_path / "ck").mkdir()  # the target exists, so the .old dir is deleted, not restored
  done = checkpoint.clean_stale(tmp_path)
  assert sorted(done) == sorted([f"removed {rebooted}", f"removed {reused_pid}"])
  assert sorted(os.listdir(tmp_path)) == sorted(["ck", live.name, foreign.name, legacy.name])


def test_crash_between_the_two_renames_keeps_the_old_checkpoint(tmp_path, monkeypatch):
  """Without RENAME_EXCHANGE a replace is two renames; failing the second restores the old."""
  old, new = random_model(), random_model()
  out = tmp_path / "ck"
  checkpoint.save(old, out)
  monkeypatch.setattr(atomic, "_exchange", lambda a, b: False, raising=False)
  real = os.rename

  def rename(src, dst, *a, **kw):
    if os.path.basename(src).startswith(".ck.tmp-") and os.fspath(dst) == str(out):
      raise OSError("crash between the two renames (simulated)")
    return real(src, dst, *a, **kw)

  monkeypatch.setattr(os, "rename", rename)
  with pytest.raises(OSError, match="simulated"):
    checkpoint.save(new, out, overwrite=True)
  monkeypatch.setattr(os, "rename", real)
  assert bit_equal(checkpoint.load(out), old)


def test_next_write_cleans_what_a_killed_run_left(tmp_path):
  code = textwrap.dedent(f"""
    import importlib.util, os, signal
    spec = importlib.util.spec_from_file_location("atomic", {ATOMIC_PY!r})
    atomic = importlib.util.module_from_spec(spec); spec.loader.exec_module(atomic)
    with atomic.atomic_dir({str(tmp_path / "other")!r}) as tmp:
      (tmp / "payload").write_bytes(b"x" * 1000)
      os.kill(os.getpid(), signal.SIGKILL)
  """)
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
  assert r.returncode == -signal.SIGKILL, r.stderr
  assert any(p.startswith(".other.tmp-") for p in os.listdir(tmp_path))
  checkpoint.save(random_model(), tmp_path / "ck")  # a write to another name, same parent
  assert sorted(os.listdir(tmp_path)) == ["ck"]


# ---- cheap checks run before any model is loaded ----------------------------------------------
@pytest.mark.parametrize(
  "extra,match",
  [
    (["--lora-steps", "-1"], "--lora-steps -1 must be >= 0"),
    (["--lora-steps", "2", "--lora-rank", "0"], "--lora-rank 0 must be a positive integer"),
    (["--lora-steps", "2", "--lora-lr", "0"], "--lora-lr 0.0 must be a positive number"),
    (["--lora-steps", "2", "--lora-lr", "nan"], "--lora-lr nan must be a positive number"),
    (["--lora-steps", "2", "--lora-batch", "0"], "--lora-batch 0 must be a positive integer"),
    (["--lora-steps", "2"], "--lora-steps > 0 needs --lora-tokens"),
    (["--block", "0"], "--block 0 must be a positive integer"),
    (["--ratio", "nan"], r"--ratio nan must be in \(0, 1\)"),
    (["--ratio", "0"], r"--ratio 0.0 must be in \(0, 1\)"),
    (["--method", "whiten"], "--method whiten needs calibration tokens"),
  ],
)
def test_convert_argument_errors_come_before_loading(tmp_path, capsys, no_load, extra, match):
  src = copy_fixture(tmp_path)
  rc, err = _cli(capsys, *_convert_args(src, tmp_path / "o"), *extra)
  assert rc == 2 and re.search(match, _one_line_error(err)), err
  assert sorted(os.listdir(tmp_path)) == ["qwen3"]


def test_unwritable_out_fails_before_loading(tmp_path, capsys, no_load):
  src = copy_fixture(tmp_path)
  out = os.path.join(unwritable_dir(tmp_path), "ck")
  rc, err = _cli(capsys, *_convert_args(src, out))
  line = _one_line_error(err)
  assert rc == 2 and "cannot create the output's parent directory" in line, line
  (tmp_path / "afile").write_text("x")
  rc, err = _cli(capsys, *_convert_args(src, tmp_path / "afile" / "ck"))
  assert rc == 2 and "is a file, not a directory" in _one_line_error(err)
  assert sorted(os.listdir(tmp_path)) == ["afile", "qwen3"]


def test_missing_inputs_fail_before_loading(tmp_path, capsys, no_load):
  rc, err = _cli(capsys, *_convert_args(tmp_path / "nope", tmp_path / "o"))
  assert rc == 2 and "--hf" in _one_line_error(err) and "no such directory" in err
  src = copy_fixture(tmp_path)
  rc, err = _cli(capsys, *_convert_args(src, tmp_path / "o", "--calib", tmp_path / "none.npy"))
  assert rc == 2 and "--calib" in _one_line_error(err) and "no such file" in err
  rc, err = _cli(capsys, "export", "--ckpt", src, "--out", tmp_path / "o")
  assert rc == 2 and "not an lrjax checkpoint" in _one_line_error(err)
  assert sorted(os.listdir(tmp_path)) == ["qwen3"]


def test_convert_checks_every_rank_budget_before_loading(tmp_path, capsys, no_load):
  """A --block too large for the model's projections: one error before any weight is loaded,
  naming a block that then converts."""
  src = copy_fixture(tmp_path)
  args = _convert_args(src, tmp_path / "o")
  args[args.index("--block") + 1] = "128"
  rc, err = _cli(capsys, *args)
  line = _one_line_error(err)
  assert rc in (1, 2) and "projections have no rank within the budget" in line, line
  assert re.search(r"block=\d+ fits every one", line), line
  assert sorted(os.listdir(tmp_path)) == ["qwen3"]


def test_convert_refuses_a_compressed_source_before_loading(tmp_path, capsys, no_load):
  """A low-rank orbax checkpoint or hf-lowrank export as the source: refused from its metadata
  or config, naming the fix, before any weight is loaded."""
  m = random_model(ranks=[{"q_proj": 4}] * TINY.num_layers)
  checkpoint.save(m, tmp_path / "lr")
  checkpoint.export_hf(m, tmp_path / "ex")  # hf-lowrank
  for flag, src, what in (("--orbax", "lr", "(low-rank)"), ("--hf", "ex", "low-rank export")):
    rc, err = _cli(capsys, "convert", flag, tmp_path / src, "--out", tmp_path / "o",
                   "--ratio", "0.3", "--method", "svd", "--block", "4")  # fmt: skip
    line = _one_line_error(err)
    assert rc in (1, 2) and "is already compressed" in line and what in line, line
    assert "convert its dense source instead" in line
  assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
  "command, extra, fix",
  [
    ("generate", ["--prompt", "hi"], "lrjax convert --hf"),
    ("serve", [], "lrjax convert --hf"),
    ("export", ["--out", "o"], "lrjax convert --hf"),
    ("bench", ["--out", "r.json"], "pass it as --hf"),
    ("eval", ["--text", "t.txt"], "pass it as --hf"),
  ],
)
def test_every_command_names_the_fix_for_a_wrong_ckpt(
  tmp_path, capsys, monkeypatch, no_load, command, extra, fix
):
  """Each command's --ckpt: an HF directory, a directory without metadata, a file, a missing
  path: a one-line error naming the argument (and, for an HF directory, the fix); nothing
  written."""
  monkeypatch.chdir(tmp_path)
  copy_fixture(tmp_path)
  (tmp_path / "t.txt").write_text("some text")
  (tmp_path / "empty").mkdir()
  cases = {
    "qwen3": ("qwen3 is an HF model directory, not an lrjax checkpoint", fix),
    "empty": ("--ckpt empty is not an lrjax checkpoint: no lrjax_metadata.json", "convert"),
    "t.txt": ("--ckpt t.txt:", "is a file"),
    "nope": ("--ckpt nope: no such directory", ""),
  }
  before = sorted(os.listdir(tmp_path))
  for ckpt, (what, hint) in cases.items():
    rc, err = _cli(capsys, command, "--ckpt", ckpt, *extra)
    line = _one_line_error(err)
    assert rc in (1, 2) and what in line and hint in line, (ckpt, line)
  assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("gb", ["0", "-1", "nan", "inf", "1e-12"])
def test_export_max_shard_gb_must_be_positive(tmp_path, capsys, saved, gb, monkeypatch):
  ck, _ = saved

  def boom(*a, **kw):
    raise AssertionError("a model was loaded before the arguments were checked")

  monkeypatch.setattr(checkpoint, "load", boom)
  rc, err = _cli(capsys, "export", "--ckpt", ck, "--out", tmp_path / "ex", "--max-shard-gb", gb)
  assert rc == 2 and "--max-shard-gb" in _one_line_error(err)
  assert not (tmp_path / "ex").exists()
  with pytest.raises(ValueError, match="max_shard_bytes=0 must be > 0"):
    checkpoint.export_hf(random_model(), tmp_path / "ex", max_shard_bytes=0)


def test_convert_still_converts(tmp_path, capsys):
  """The checks above do not get in the way of a normal convert + overwrite + export."""
  src = copy_fixture(tmp_path)
  out = tmp_path / "ck"
  checkpoint.save(random_model(), out)
  assert cli.main(_convert_args(str(src), str(out), "--overwrite")) == 0
  assert checkpoint.load(out).compression["source"] == str(src)
  assert cli.main(["export", "--ckpt", str(out), "--out", str(tmp_path / "ex")]) == 0
  rec = json.loads((tmp_path / "ex" / checkpoint.EXPORT_NAME).read_text())
  assert rec["format"] == "lrjax-hf-export" and rec["tensors"]
  assert sorted(os.listdir(tmp_path)) == ["ck", "ex", "qwen3"]
