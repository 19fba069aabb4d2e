"""The engine on 1 and N simulated CPU devices from one orbax checkpoint (subprocess: the device
count must be set before jax starts)."""

import json
import os
import random
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "serving_tp_script.py")


@pytest.mark.slow
def test_engine_and_cli_on_n_devices_match_one_device(tmp_path):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  seed = random.randrange(1 << 20)
  p = subprocess.run(
    [sys.executable, SCRIPT, str(tmp_path), str(seed)],
    capture_output=True,
    text=True,
    env=env,
    timeout=300,
  )
  lines = [l for l in p.stdout.splitlines() if l.startswith("JSON")]
  assert p.returncode == 0 and lines, f"seed={seed}\n{p.stderr[-3000:]}"
  out = json.loads(lines[-1][4:])
  single = out["single"]
  assert all(len(t) == 5 for t in single)
  for key in (
    "lowrank_tp_4_False",
    "naive_tp_2_False",
    "lowrank_tp_4_True",
    "fused_lowrank_tp_4",
    "fused_naive_tp_2",
  ):
    assert out[key] == single, (key, seed)
  for key in ("lowrank_tp_4_False", "naive_tp_2_False", "lowrank_tp_4_True"):
    assert out[f"compiled_after_warmup_{key}"] == [0, 0], key  # warmup() compiled every step
  assert out["strategy"] == "lowrank_tp"
  assert out["q_u_spec"] == ["None", "tp"]
  assert out["q_u_shard_shape"] == [64, out["q_rank"] // 4]  # restored as local shards
  assert out["cli_rc"] == 0
  cli = out["cli_out"]
  assert "strategy=lowrank_tp tp=4" in cli and "tokens/s" in cli
  assert ",".join(map(str, single[0])) in cli and ",".join(map(str, single[1])) in cli
