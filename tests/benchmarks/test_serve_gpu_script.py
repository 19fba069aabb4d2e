"""benchmarks/serve_gpu.py end to end on CPU with the tiny preset: records for each model and
client count, with TTFT, ITL, tokens/s and the device step from the same run."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_serve_gpu_script_tiny(tmp_path):
  out = tmp_path / "serve_gpu.json"
  cmd = [sys.executable, os.path.join(REPO, "benchmarks", "serve_gpu.py"), "--preset", "tiny"]
  cmd += ["--layers", "1", "--clients", "2", "--rounds", "1", "--prompt-len", "8"]
  cmd += ["--new-tokens", "4", "--transport", "inproc", "--no-plot", "--out", str(out)]
  env = dict(os.environ, JAX_PLATFORMS="cpu", RAYON_NUM_THREADS="1")
  p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  rec = json.loads(out.read_text())
  assert rec["config"]["transport"] == "inproc" and rec["machine"]["device"]
  assert [(r["model"], r["clients"]) for r in rec["records"]] == [("dense", 2), ("lowrank", 2)]
  for r in rec["records"]:
    assert r["client"]["ok"] == 2 and r["client"]["output_tokens"] == 8
    assert r["step_ms"] > 0 and r["engine"]["itl_p50_ms"] > 0 and r["tokens_per_s"] > 0
  assert "lr_xuv" in rec["records"][1]["fusion"]  # the low-rank engine runs fused
  assert set(rec["lowrank_over_dense_tokens_per_s"]) == {"2/batched"}  # the default policy
  assert rec["ranks"] and rec["command"].startswith("python benchmarks/serve_gpu.py")
