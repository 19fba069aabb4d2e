"""The corpus: low-rank model code in the styles people write (corpus_models.py). Each
positive case must fuse into the expected matches with results equal to the unfused function;
each negative case must not fuse and must be reported as a near-miss."""

import collections
import json
import os
import random
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lrjax
from conftest import assert_close, primitive_names
from corpus_models import NEGATIVE, POSITIVE

SCRIPT = os.path.join(os.path.dirname(__file__), "shard_map_script.py")
LR_PRIMS = ("lr_xuv", "lr_mlp", "lr_xuv_group", "lr_xuv_batched")


def _lr_prims(fn, *args):
  return [p for p in primitive_names(fn, *args) if p in LR_PRIMS]


def _compare(got, want, case):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    if case.compare == "bitwise":
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    else:
      assert_close(a, b, case.dtype)


@pytest.mark.parametrize("name", sorted(POSITIVE))
def test_corpus_fuses(name):
  case = POSITIVE[name]()
  rep = lrjax.explain(case.fn, *case.args)
  got = collections.Counter(m["pattern"] for m in rep.matches)
  assert dict(got) == case.matches, str(rep)
  assert len(rep.groups) == case.groups, str(rep)
  reasons = [n["reason"] for n in rep.near_misses]
  assert all(any(w in r for w in case.misses) for r in reasons), str(rep)
  assert all(any(w in r for r in reasons) for w in case.misses), str(rep)
  fused = jax.jit(lrjax.fuse(case.fn))(*case.args)
  _compare(fused, jax.jit(case.fn)(*case.args), case)


@pytest.mark.parametrize("name", sorted(NEGATIVE))
def test_corpus_refuses_and_reports(name):
  case = NEGATIVE[name]()
  rep = lrjax.explain(case.fn, *case.args)
  got = collections.Counter(m["pattern"] for m in rep.matches)
  assert dict(got) == case.matches, str(rep)
  reasons = [n["reason"] for n in rep.near_misses]
  for want in case.misses:
    assert any(want in r for r in reasons), (want, reasons)
  n_lr = sum(case.matches.values())
  assert len(_lr_prims(lrjax.fuse(case.fn), *case.args)) == n_lr
  fused = jax.jit(lrjax.fuse(case.fn))(*case.args)
  want = jax.jit(case.fn)(*case.args)
  for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))


def test_model_under_vmap_of_fuse():
  """vmap outside fuse: the pass runs on the per-example jaxpr and vmap batches lr_mlp."""
  case = POSITIVE["vmap_model"]()
  per_example = case.fn.__wrapped__ if hasattr(case.fn, "__wrapped__") else None
  assert per_example is not None
  x = case.args[0]
  got = jax.jit(jax.vmap(lrjax.fuse(per_example)))(x)
  assert "lr_mlp" in _lr_prims(jax.vmap(lrjax.fuse(per_example)), x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(case.fn)(x)))
  assert got.dtype == jnp.float32


def test_model_under_shard_map_on_simulated_devices():
  """shard_map bodies are fused on their per-device shapes (4 simulated CPU devices, in a
  subprocess: the device count is fixed when jax starts); a kernel selected there lowers
  inline; the partitioning wrapper passes a rank-space scale through the sharded layouts."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  seed = random.randrange(1 << 20)
  p = subprocess.run(
    [sys.executable, SCRIPT, str(seed)], capture_output=True, text=True, env=env, timeout=600
  )
  lines = [line for line in p.stdout.splitlines() if line.startswith("JSON")]
  assert p.returncode == 0 and lines, f"seed={seed} rc={p.returncode}\n{p.stderr[-3000:]}"
  out = json.loads(lines[-1][4:])
  assert out["n_devices"] == 4
  # 1. data-parallel block: U·Σ·Vt and the gated MLP fused inside the body, bitwise equal
  assert out["dp_matches"] == {"lr_mlp(gated)": 1, "lr_xuv": 1} and out["dp_paths"] == ["shard_map"]
  assert out["dp_near"] == [] and out["dp_bitwise"]
  # rank-sharded factors: lr_xuv on the local rank 16/4 = 4
  assert out["tp_shapes"] == ["x[5, 64]·u[64,4]·v[4,96] float32"] and out["tp_bitwise"]
  # 2. inside the manual body the kernel is the call itself, on local shapes
  assert out["inline_kernel_in_hlo"] and not out["inline_custom_partitioning"]
  assert out["inline_kernel_shapes"] == [[64, 4]] and out["inline_close"]
  # 3. the scale follows the rank dim: local [16/4] where the kernel runs on rank shards
  lay = out["layouts"]
  assert all(r["err"] < 1e-5 and r["kernel_in_hlo"] for r in lay.values()), lay
  assert [4] in lay["rank"]["kernel_scale_shapes"], lay
  # lr_mlp with scales on every projection, factor pairs split on the rank
  assert out["mlp_scaled_err"] < 1e-5 and [4] in out["mlp_local_xuv_scale_shapes"], out
