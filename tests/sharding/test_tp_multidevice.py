"""Sharded numerics and collectives on 8 simulated CPU devices (in a subprocess: the flag must be
set before jax starts, and the rest of the suite shares this process)."""

import json
import os
import random
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "tp_multidevice_script.py")
F32_TOL = 1e-5


def run_part(part: str) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  seed = random.randrange(1 << 20)
  p = subprocess.run(
    [sys.executable, SCRIPT, part, str(seed)], capture_output=True, text=True, env=env, timeout=300
  )
  lines = [l for l in p.stdout.splitlines() if l.startswith("JSON")]
  assert p.returncode == 0 and lines, f"seed={seed} rc={p.returncode}\n{p.stderr[-3000:]}"
  out = json.loads(lines[-1][4:])
  assert out["n_devices"] == 8
  return out


@pytest.mark.slow
def test_logits_equal_single_device_and_lowrank_moves_fewer_bytes():
  recs = {(r["strategy"], r["tp"]): r for r in run_part("logits")["records"]}
  for key, r in recs.items():
    assert r["max_rel_logit_err"] < F32_TOL, (key, r)
    assert r["whole_weight_all_gathers"] == 0, (key, r)
  naive, low = recs[("naive_tp", 8)], recs[("lowrank_tp", 8)]
  # naive: only full-width all-reduces; lowrank: rank-space all-gathers + 2 all-reduces.
  assert set(naive["by_kind"]) == {"all-reduce"}
  assert set(low["by_kind"]) == {"all-gather", "all-reduce"}
  assert low["by_kind"]["all-reduce"]["n"] == 2
  assert low["bytes_per_token"] <= 0.25 * naive["bytes_per_token"], (low, naive)
  # Bytes per token do not depend on the TP degree in this cost model.
  assert recs[("lowrank_tp", 2)]["bytes_per_token"] == low["bytes_per_token"]


@pytest.mark.slow
def test_fused_kernels_run_on_local_shards():
  fused = run_part("fused")["fused"]
  for strategy, r in fused.items():
    assert r["rel_err"] < F32_TOL, (strategy, r)
    assert r["whole_weight_gathers"] == 0, (strategy, r)
    # The same kernels without the partitioning rule make XLA gather whole weights.
    assert r["whole_weight_gathers_unpartitioned"] > 0, (strategy, r)
  # naive_tp and repl_u_tp keep every factor pair local: one kernel call per projection.
  assert fused["naive_tp"]["custom_calls"] == 7
  assert fused["repl_u_tp"]["custom_calls"] == 7
  assert fused["lowrank_tp"]["bytes"] < fused["naive_tp"]["bytes"]


@pytest.mark.slow
def test_lr_mlp_partitioned_layouts():
  mlp = run_part("mlp")["mlp"]
  for name, r in mlp.items():
    assert r["rel_err"] < F32_TOL, (name, r)
    assert r["whole_weight_gathers"] == 0, (name, r)
  assert mlp["naive"]["kinds"] == ["all-reduce"]
  assert mlp["lowrank"]["kinds"] == ["all-gather", "all-reduce"]
  assert mlp["repl_u"]["kinds"] == ["all-gather"]
