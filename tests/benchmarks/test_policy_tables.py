"""CPU tests of benchmarks/policy_tables.py: the committed tuning table is what
``gpu_lowrank.py --emit-policy`` writes from the committed results, and how it reads them."""

import json
import os

import pytest

from lrjax.custom_calls.triton import launch_modes, policy

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def pt(load_benchmark):
  return load_benchmark("policy_tables")


def test_the_h200_table_is_what_emit_policy_writes_from_the_committed_results(pt):
  """The table's measured parts must be regenerated (gpu_lowrank.py --emit-policy) whenever
  the results they come from change; its thresholds and tiles are kept as they are."""
  table = policy.for_device("NVIDIA H200")[0]
  with open(table.path) as fh:
    text = fh.read()
  results = os.path.join(REPO, table.sources["kernels"])
  assert pt.render(pt.build(results, base=json.loads(text))) == text
  assert pt.table_path(pt.card_of(results)) == table.path
  on, recs = pt.policy_records(results)
  assert (on, recs) == (table.measured_on, table.records)
  models = {("8b", 4096), ("70b", 8192), ("qwen2.5-7b", 3584), ("1b", 2048)}
  assert {(a[0], a[1]) for a in table.model_ab} == models
  assert all(1 in [a[2] for a in table.model_ab if a[0] == name] for name, _ in models)
  assert {"mlp_swiglu", "xuv_group"} <= {a[3] for a in table.model_op_ab}
  assert {a[3] for a in table.model_op_ab} <= set(policy.OPS)
  assert min(r[1] for r in recs) == 1 and max(r[1] for r in recs) >= 4096


def test_emit_rewrites_a_stale_table_and_starts_a_new_card_from_the_nearest(
  pt, tmp_path, monkeypatch
):
  """--emit-policy: a table whose records went stale is rewritten whole (thresholds and tiles
  kept); a card without a table gets one with the nearest table's thresholds and tiles."""
  h200 = policy.for_device("NVIDIA H200")[0]
  text = open(h200.path).read()
  stale = json.loads(text)
  stale["records"][0][5] = 999.0
  monkeypatch.setattr(policy, "TUNING_DIR", str(tmp_path))
  (tmp_path / "policy_h200.json").write_text(pt.render(stale))
  results = os.path.join(REPO, h200.sources["kernels"])
  assert pt.emit(results) == str(tmp_path / "policy_h200.json")
  assert (tmp_path / "policy_h200.json").read_text() == text
  # a new card: its own results, named like the H200's (gpu_lowrank_<card>.json)
  data = json.load(open(results))
  data["meta"]["machine"] = "NVIDIA H100 80GB HBM3 (16 CPU cores, x86_64)"
  new = tmp_path / "gpu_lowrank_h100.json"
  new.write_text(json.dumps(data))
  group = os.path.join(REPO, h200.sources["group"])
  (tmp_path / "gpu_xuv_group_h100.json").write_text(open(group).read())
  out = pt.emit(str(new))
  assert out == str(tmp_path / "policy_h100.json")
  t = policy.load(out)
  assert t.device == "NVIDIA H100 80GB HBM3" and t.thresholds == h200.thresholds
  assert t.tiles == h200.tiles and t.model_ab == ()  # no model steps of this card
  assert t.records == pt.policy_records(str(new))[1] == h200.records  # the same results


def test_op_ab_pairs_only_adjacent_runs(pt, tmp_path):
  """A ``--kernels`` step is compared only with the all-kernels step of the next run (one
  device call); lone runs and runs serving two ops fewer are left out."""
  base = dict(strategy="lowrank_tp", tp=1, fuse=True, group=True)
  recs = [
    dict(base, model="m", batch=4, run=1, step_ms=4.0, kernels=["xuv", "xuv_group"]),
    dict(base, model="m", batch=4, run=2, step_ms=4.1),
    dict(base, model="m", batch=8, run=3, step_ms=5.0, kernels=["xuv", "xuv_group"]),
    dict(base, model="m", batch=8, run=5, step_ms=5.2),
    dict(base, model="m", batch=4, run=6, step_ms=3.0, kernels=["xuv"]),
    dict(base, model="m", batch=4, run=7, step_ms=3.1),
    dict(base, model="m", batch=4, run=8, step_ms=3.9, fuse=False),
  ]
  path = tmp_path / "steps.json"
  path.write_text(json.dumps(dict(records=recs, models={"m": {"hidden_size": 1024}})))
  assert pt.model_op_ab_from_results(str(path)) == (("m", 1024, 4, "mlp_swiglu", 4.1, 4.0),)


def test_model_ab_leaves_out_runs_with_only_some_kernels(pt, tmp_path):
  """tp_gpu.py --kernels records (some ops kept on XLA) are not a whole-model A/B."""
  rec = dict(strategy="lowrank_tp", tp=1, model="70b", batch=4, group=True)
  data = {
    "models": {"70b": {"hidden_size": 8192}},
    "records": [
      dict(rec, fuse=False, step_ms=3.0),
      dict(rec, fuse=True, step_ms=2.9),
      dict(rec, fuse=True, step_ms=3.3, kernels=["mlp_swiglu"]),
    ],
  }
  path = tmp_path / "ab.json"
  path.write_text(json.dumps(data))
  assert pt.model_ab_from_results(str(path)) == (("70b", 8192, 4, 2.9, 3.0),)


def test_model_ab_leaves_out_steps_with_the_scratch_chain_off(pt, tmp_path):
  """Steps timed with LRJAX_TRITON_SCRATCH_CHAIN=0 (scratch_chain False) are not the default
  lowering: neither model_ab nor model_op_ab reads them."""
  base = dict(strategy="lowrank_tp", tp=1, group=True, model="m", batch=4)
  recs = [
    dict(base, run=1, step_ms=4.0, fuse=False),
    dict(base, run=2, step_ms=3.0, fuse=True, kernels=["xuv", "xuv_group"]),
    dict(base, run=3, step_ms=3.5, fuse=True, scratch_chain=False),
    dict(base, run=4, step_ms=3.9, fuse=True),
  ]
  path = tmp_path / "steps.json"
  path.write_text(json.dumps(dict(records=recs, models={"m": {"hidden_size": 1024}})))
  assert pt.model_ab_from_results(str(path)) == (("m", 1024, 4, 3.9, 4.0),)
  assert pt.model_op_ab_from_results(str(path)) == ()
  recs[2]["run"], recs[3]["run"] = 5, 3  # the chained step follows the --kernels run: a pair
  path.write_text(json.dumps(dict(records=recs, models={"m": {"hidden_size": 1024}})))
  assert pt.model_op_ab_from_results(str(path)) == (("m", 1024, 4, "mlp_swiglu", 3.9, 3.0),)


def test_model_ab_reads_only_steps_under_the_default_launchers(pt, tmp_path):
  """A step timed under lrjax's own launcher (``lrjax``, ``pdl``) is an A/B of the launch, not
  of the kernels: model_ab reads steps under MODEL_AB_LAUNCHES alone, XLA's Triton call
  (the default), its PTX call and jaxlib's (defaults before; a record without
  ``triton_launch`` ran under jaxlib's)."""
  assert launch_modes.DEFAULT_LAUNCH in pt.MODEL_AB_LAUNCHES
  base = dict(strategy="lowrank_tp", tp=1, group=True, model="m", batch=4)
  recs = [
    dict(base, run=1, step_ms=4.0, fuse=False),
    dict(base, run=2, step_ms=3.9, fuse=True),
    dict(base, run=3, step_ms=3.5, fuse=True, triton_launch="pdl"),
  ]
  path = tmp_path / "steps.json"
  path.write_text(json.dumps(dict(records=recs, models={"m": {"hidden_size": 1024}})))
  assert pt.model_ab_from_results(str(path)) == (("m", 1024, 4, 3.9, 4.0),)
  recs[2]["triton_launch"] = "xla"  # the last of the repeated runs
  path.write_text(json.dumps(dict(records=recs, models={"m": {"hidden_size": 1024}})))
  assert pt.model_ab_from_results(str(path)) == (("m", 1024, 4, 3.5, 4.0),)


def test_emit_refuses_a_sweep_missing_what_the_table_has_measured(pt, tmp_path, monkeypatch):
  """A sweep stopped part-way (records up to 16 rows) would make a table that serves prefill
  from decode records: --emit-policy refuses it and names the command that completes it."""
  h200 = policy.for_device("NVIDIA H200")[0]
  monkeypatch.setattr(policy, "TUNING_DIR", str(tmp_path))
  data = json.load(open(os.path.join(REPO, h200.sources["kernels"])))
  data["meta"]["machine"] = "NVIDIA H100 80GB HBM3 (16 CPU cores, x86_64)"
  data["records"] = [r for r in data["records"] if r["M"] <= 16]
  part = tmp_path / "gpu_lowrank_h100.json"
  part.write_text(json.dumps(data))
  with pytest.raises(ValueError, match=r"no record of .*M=32.*--suite all --resume"):
    pt.emit(str(part))
  assert not (tmp_path / "policy_h100.json").exists()


def test_the_choice_report_counts_the_points_where_the_table_picked_the_slower(pt, tmp_path):
  """Each record's pick (the table's verdict) is set against the faster of its two timings:
  a pick made slower than 3 % by the timings is listed with its lowering and, for XLA, the
  table's reason; the others are counted as within."""
  h200 = policy.for_device("NVIDIA H200")[0]
  data = json.load(open(os.path.join(REPO, h200.sources["kernels"])))
  picks = {}  # whether the table leaves each record's shape to XLA
  for r in data["records"]:
    if r["variant"] == "auto" and r["op"] in ("xuv", "mlp_swiglu"):
      why = policy.verdict(r["op"], r["M"], r["K"], r["r"], r["N"], h200)
      picks.setdefault(bool(why), r)
  kernel_pick, xla_pick = picks[False], picks[True]
  kernel_pick.update(ours_us=20.0, xla_lowrank_us=10.0)  # the kernel picked, 100 % slower
  xla_pick.update(ours_us=10.0, xla_lowrank_us=10.2)  # XLA picked, 2 % slower: within
  fair = dict(xla_pick, variant="auto", ours_us=10.0, xla_lowrank_us=15.0)  # 50 % slower
  other = dict(kernel_pick, variant="unrolled")  # a variant record: not counted
  data["records"] = [kernel_pick, xla_pick, fair, other]
  path = tmp_path / "gpu_lowrank_h200.json"
  path.write_text(json.dumps(data))
  lines = pt.choice_report(str(path)).splitlines()
  assert "table policy_h200.json)" in lines[0] and "within 3% of the faster" in lines[0]
  assert lines[0].endswith("at 1 of 3 points")
  assert "the kernel picked, kernel 20.0 us, XLA 10.0 us (100.0% slower)" in lines[1]
  assert "XLA picked [1], kernel 10.0 us, XLA 15.0 us (50.0% slower)" in lines[2]
  assert lines[3].startswith("  [1] ") and len(lines) == 4
