"""benchmarks/serve_prefill.py: its variant specs, baselines read from git or from files saved
for a machine without the history, and a whole run on CPU."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import serve_prefill  # noqa: E402


def test_parse_variant():
  assert serve_prefill.parse_variant("big:prefill_tokens=8192,prefill_call_tokens=1024") == (
    "big",
    {"prefill_tokens": 8192, "prefill_call_tokens": 1024},
  )
  assert serve_prefill.parse_variant("one:prefill=single") == ("one", {"prefill": "single"})
  for bad, says in [
    ("big", "NAME:KEY=VALUE"),
    (":prefill_tokens=1", "NAME:KEY=VALUE"),
    ("big:prefill_tokens", "is not KEY=VALUE"),
    ("big:prefill_tokens=lots", "must be a whole number"),
  ]:
    with pytest.raises(SystemExit, match=says):
      serve_prefill.parse_variant(bad)


def _git(*args):
  return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)


@pytest.mark.skipif(_git("rev-parse", "HEAD").returncode != 0, reason="needs the git history")
def test_saved_baseline_is_the_commits_engine(tmp_path):
  head = _git("rev-parse", "--short", "HEAD").stdout.strip()
  assert serve_prefill.main(["--baseline-commit", head, "--save-baseline", str(tmp_path)]) == 0
  saved = (tmp_path / f"engine_{head}.py").read_text()
  assert saved == _git("show", f"{head}:lrjax/serving/engine.py").stdout
  assert serve_prefill.baseline_source(head, str(tmp_path)) == saved
  engine = serve_prefill.baseline_engine(head, str(tmp_path))
  assert engine.__name__ == "Engine" and engine.__module__ == f"lrjax.serving._engine_{head}"


def test_variant_names_must_differ_from_the_policies():
  with pytest.raises(SystemExit, match="must differ"):
    serve_prefill.main(["--policy", "batched", "--variant", "batched:prefill_tokens=8192"])


def test_missing_baseline_file_names_the_fix(tmp_path):
  with pytest.raises(SystemExit, match="--save-baseline"):
    serve_prefill.baseline_source("abc1234", str(tmp_path))
  with pytest.raises(SystemExit, match="--baseline-dir"):
    serve_prefill.baseline_source("0000000000000000000000000000000000000000")


def test_run_on_cpu_records_every_variant(tmp_path):
  out = tmp_path / "ttft.json"
  cmd = [sys.executable, os.path.join(REPO, "benchmarks", "serve_prefill.py")]
  cmd += ["--concurrency", "3", "--prompt-len", "8", "--new-tokens", "2", "--reps", "1"]
  cmd += ["--policy", "batched", "--variant", "tight:prefill_tokens=8,prefill_call_tokens=8"]
  cmd += ["--out", str(out)]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  run = json.loads(out.read_text())["runs"][-1]
  assert run["dtype"] == "float32" and run["config"]["prompt_len"] == 8
  recs = {r["policy"]: r for r in run["records"]}
  assert set(recs) == {"batched", "tight"}
  assert recs["tight"]["engine_settings"] == {"prefill_tokens": 8, "prefill_call_tokens": 8}
  for r in recs.values():  # f32: the exact check, and it held
    assert r["mismatches_vs_alone"] == 0 and r["first_token_mismatches_vs_alone"] == 0
    assert r["concurrency"] == 3 and r["ttft_p50_ms"] > 0 and len(r["reps"]) == 1
