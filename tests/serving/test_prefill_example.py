"""examples/prefill_under_load.py runs: both admission policies, every output equal."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_prefill_example_runs_and_outputs_agree():
  cmd = [sys.executable, os.path.join(REPO, "examples", "prefill_under_load.py")]
  cmd += ["--requests", "6", "--prompt-len", "16", "--new-tokens", "3"]
  p = subprocess.run(
    cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu")
  )
  assert p.returncode == 0, p.stderr[-3000:]
  lines = p.stdout.splitlines()
  assert sum("TTFT p50" in line for line in lines) == 2
  assert lines[-1].endswith("against requests run alone: True")


def test_prefill_example_refuses_no_requests():
  cmd = [sys.executable, os.path.join(REPO, "examples", "prefill_under_load.py"), "--requests", "0"]
  p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  assert p.returncode == 2 and "--requests must be at least 1" in p.stderr
