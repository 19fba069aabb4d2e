"""benchmarks/tp_gpu.py on simulated CPU devices (--smoke): records, ratios, --append."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(out, *args):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  cmd = [
    sys.executable,
    os.path.join(REPO, "benchmarks", "tp_gpu.py"),
    "--smoke",
    "--batch",
    "2",
    "--steps",
    "2",
    "--reps",
    "1",
    "--ctx",
    "32",
    "--no-serving",
    "--out",
    out,
    *args,
  ]
  r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  with open(out) as fh:
    return json.load(fh)


def test_models_ratios_and_append(tmp_path):
  out = str(tmp_path / "tp.json")
  d = _run(
    out,
    "--model",
    "8b",
    "70b",
    "--tp",
    "2",
    "8",
    "--ratio",
    "0.4",
    "0.6",
    "--strategies",
    "naive_tp",
    "lowrank_tp",
  )
  # TP 8 is skipped on 4 devices; 2 models x 2 ratios x 2 strategies at TP 2
  recs = d["records"]
  assert len(recs) == 8 and {r["tp"] for r in recs} == {2}
  assert {(r["model"], r["ratio"]) for r in recs} == {
    (m, q) for m in ("8b", "70b") for q in (0.4, 0.6)
  }
  assert set(d["ranks"]) == {"8b@0.4", "8b@0.6", "70b@0.4", "70b@0.6"}
  assert all(r["step_ms"] > 0 and r["run"] == 0 and r["fuse"] is False for r in recs)
  assert set(d["lowrank_over_naive_decode_speedup"]) == {
    f"{m}_r{q}_tp2_b2" for m in ("8b", "70b") for q in (0.4, 0.6)
  }

  again = _run(
    out,
    "--append",
    "--model",
    "8b",
    "--tp",
    "2",
    "--ratio",
    "0.4",
    "--strategies",
    "dense",
    "lowrank_tp",
  )
  assert [r["index"] for r in again["runs"]] == [0, 1]
  recs = again["records"]
  assert len(recs) == 9  # dense added; 8b lowrank_tp at 0.4 replaced, not duplicated
  mine = [
    r for r in recs if r["model"] == "8b" and r["strategy"] == "lowrank_tp" and r["ratio"] == 0.4
  ]
  assert len(mine) == 1 and mine[0]["run"] == 1
  # the replaced record's step time stays in its run's steps
  (first,) = [
    st
    for st in again["runs"][0]["steps"]
    if st["model"] == "8b" and st["strategy"] == "lowrank_tp" and st["ratio"] == 0.4
  ]
  assert first["step_ms"] > 0 and len(again["runs"][0]["steps"]) == 8
  assert [st["strategy"] for st in again["runs"][1]["steps"]] == ["dense", "lowrank_tp"]
  assert [r["ratio"] for r in recs if r["strategy"] == "dense"] == [None]


def test_grouped_fuse_runs_on_one_and_several_devices(tmp_path):
  """--fuse: q/k/v as one lr_xuv_group per layer, also under TP (where the group lowers as its
  members); --no-group keeps three lr_xuv and is a record of its own; --no-group without
  --fuse is refused."""
  out = str(tmp_path / "g.json")
  d = _run(out, "--model", "8b", "--tp", "1", "2", "--strategies", "lowrank_tp", "--fuse")
  recs = d["records"]
  assert len(recs) == 2 and all(r["group"] and r["fuse"] and r["step_ms"] > 0 for r in recs)
  ops = recs[0]["fused_ops_in_jaxpr"]
  assert ops["lr_xuv_group"] >= 1 and ops["lr_xuv"] == ops["lr_xuv_group"]  # o_proj alone
  d = _run(
    out,
    "--append",
    "--model",
    "8b",
    "--tp",
    "1",
    "--strategies",
    "lowrank_tp",
    "--fuse",
    "--no-group",
  )
  alone = [r for r in d["records"] if r["group"] is False]
  assert len(d["records"]) == 3 and len(alone) == 1
  assert alone[0]["fused_ops_in_jaxpr"]["lr_xuv_group"] == 0
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run(
    [
      sys.executable,
      os.path.join(REPO, "benchmarks", "tp_gpu.py"),
      "--smoke",
      "--no-group",
      "--out",
      str(tmp_path / "x.json"),
    ],
    capture_output=True,
    text=True,
    env=env,
    timeout=300,
  )
  assert r.returncode != 0 and "needs --fuse" in r.stderr


def test_kernels_runs_are_kept_apart_and_need_fuse(tmp_path):
  """--kernels serves only some ops' kernels: its records are their own kind (--append keeps
  the plain fused one) and carry the ops; without --fuse it is refused."""
  out = str(tmp_path / "k.json")
  _run(out, "--model", "8b", "--tp", "1", "--strategies", "lowrank_tp", "--fuse")
  d = _run(
    out,
    "--append",
    "--model",
    "8b",
    "--tp",
    "1",
    "--strategies",
    "lowrank_tp",
    "--fuse",
    "--kernels",
    "xuv_group",
    "xuv",
  )
  assert sorted(r.get("kernels") is None for r in d["records"]) == [False, True]
  assert [r["kernels"] for r in d["records"] if r.get("kernels")] == [["xuv", "xuv_group"]]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  for bad, needs in (
    (["--kernels", "xuv"], "--fuse"),
    (["--whole-policy"], "--fuse"),
    (["--events-out", "x.json"], "--profile"),
  ):
    r = subprocess.run(
      [
        sys.executable,
        os.path.join(REPO, "benchmarks", "tp_gpu.py"),
        "--smoke",
        *bad,
        "--out",
        str(tmp_path / "n.json"),
      ],
      capture_output=True,
      text=True,
      env=env,
      timeout=300,
    )
    assert r.returncode != 0 and bad[0] in r.stderr and needs in r.stderr, (bad, r.stderr)


def test_only_kernels_declines_the_other_ops(load_benchmark, monkeypatch):
  monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))  # its sibling modules
  tp = load_benchmark("tp_gpu")
  from lrjax.custom_calls.triton import policy

  monkeypatch.setattr(policy, "verdict", lambda op, *a: None)  # every kernel served
  with tp.only_kernels(["xuv_group"]):
    assert policy.verdict("xuv_group", 4, 8192, 3584, 10240) is None
    why = policy.verdict("mlp_swiglu", 4, 8192, 3840, 28672)
    assert why is not None and "--kernels xuv_group" in why
  assert policy.verdict("mlp_swiglu", 4, 8192, 3840, 28672) is None  # restored


def test_a_kernels_runs_partner_is_kept_and_chain_off_runs_are_their_own_kind(tmp_path):
  """A re-measured step replaces the earlier one of its kind, except the all-kernels step that
  followed a --kernels run (a model_op_ab pair); LRJAX_TRITON_SCRATCH_CHAIN=0 runs
  are recorded as scratch_chain False, a kind of their own, with the env in their run."""
  out = str(tmp_path / "k.json")
  one = ("--model", "8b", "--tp", "1", "--strategies", "lowrank_tp", "--fuse")
  _run(out, *one, "--kernels", "xuv", "xuv_group")
  _run(out, "--append", *one)
  d = _run(out, "--append", *one)
  runs = sorted(r["run"] for r in d["records"] if not r.get("kernels"))
  assert runs == [1, 2]  # run 1, the partner of run 0, stays beside the newer run 2
  os.environ["LRJAX_TRITON_SCRATCH_CHAIN"] = "0"
  try:
    d = _run(out, "--append", *one)
  finally:
    del os.environ["LRJAX_TRITON_SCRATCH_CHAIN"]
  off = [r for r in d["records"] if r.get("scratch_chain") is False]
  assert len(off) == 1 and off[0]["run"] == 3 and len(d["records"]) == 4
  assert d["runs"][3]["env"] == {"LRJAX_TRITON_SCRATCH_CHAIN": "0"} and d["runs"][2]["env"] == {}
