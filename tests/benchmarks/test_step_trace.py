"""CPU tests of benchmarks/step_trace.py: a decode step's layer blocks from a kernel trace."""

import gzip
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def trace(load_benchmark):
  with pytest.MonkeyPatch.context() as mp:
    mp.syspath_prepend(os.path.join(REPO, "benchmarks"))  # its sibling gpu_lowrank
    return load_benchmark("step_trace")


def fake_step(t0, attn_us, mlp_us, layers=2):
  """One decode step of ``layers`` layers: norm, q/k/v GEMM, attention, norm, MLP kernel,
  then the final norm, the LM head GEMM and a sampling kernel (times in ns)."""
  ev, t = [], t0
  for _ in range(layers):
    ev += [
      (t, t + 1000, "fusion_7"),
      (t + 1000, t + 5000, "gemm_fusion_dot.3"),
      (t + 5000, t + attn_us * 1000, "loop_add_fusion"),
    ]
    t += attn_us * 1000
    ev += [(t, t + 1000, "fusion_7"), (t + 1000, t + mlp_us * 1000, "_mlp_decode_kernel")]
    t += mlp_us * 1000
  ev += [
    (t, t + 1000, "fusion_9"),
    (t + 1000, t + 40_000, "gemm_fusion_dot.12"),
    (t + 40_000, t + 41_000, "input_reduce_fusion"),
  ]
  return ev, t + 41_000


def test_blocks_are_cut_at_the_norms_before_projections(trace, tmp_path):
  ev, t = fake_step(0, 10, 30)
  ev2, t = fake_step(t + 2000, 12, 30)
  path = tmp_path / "ev.json.gz"
  with gzip.open(path, "wt") as fh:
    json.dump({"events": ev2 + ev}, fh)  # any order: the events are sorted
  rec = trace.summarize(trace.load(str(path)), layers=2)
  assert rec["steps"] == 2
  assert rec["attention_block_us"] == 11 and rec["mlp_block_us"] == 30
  assert rec["triton_kernels_median_us"] == {"_mlp_decode_kernel": 29.0}
  assert rec["triton_launches_per_step"] == {"_mlp_decode_kernel": 2.0}
  # the step's span less its layers: the LM head block and the gap between the steps
  assert rec["span_us_per_step"] == pytest.approx((t / 1e3) / 2)
  assert rec["rest_of_step_us"] == pytest.approx(rec["span_us_per_step"] - 2 * 41)


def test_a_wrong_layer_count_is_an_error(trace):
  ev, _ = fake_step(0, 10, 30)
  with pytest.raises(ValueError, match="3 layers"):
    trace.summarize(sorted(ev), layers=3)


def test_a_file_without_events_is_an_error(trace, tmp_path):
  path = tmp_path / "x.json"
  path.write_text(json.dumps({"records": []}))
  with pytest.raises(ValueError, match="--events-out"):
    trace.load(str(path))


def test_the_committed_70b_summary_is_what_the_committed_traces_give(trace):
  """benchmarks/results/model_70b_blocks_h200.json was written by this script from the
  traces beside it."""
  with open(os.path.join(REPO, "benchmarks/results/model_70b_blocks_h200.json")) as fh:
    committed = json.load(fh)["traces"]
  for name, rec in committed.items():
    got = trace.summarize(
      trace.load(os.path.join(REPO, "benchmarks/results/traces", name)), rec["layers"]
    )
    for key, value in rec.items():
      assert got[key] == (
        pytest.approx(value)
        if not isinstance(value, dict)
        else {k: pytest.approx(v) for k, v in value.items()}
      ), (name, key)


def test_kernel_totals_a_step(trace):
  ev, t = fake_step(0, 10, 30)
  ev2, t2 = fake_step(t, 10, 30)
  tot = trace.kernel_totals(sorted(ev + ev2), steps=2)
  assert tot["kernels"]["_mlp_decode_kernel"] == {"us_per_step": 58.0, "launches_per_step": 2.0}
  # longest first: the MLP's 2 x 29 us a step, then q/k/v's 2 x 4 us and the LM head's 39
  assert list(tot["kernels"])[:2] == ["_mlp_decode_kernel", "gemm_fusion_dot"]
  assert tot["kernels"]["gemm_fusion_dot"] == {"us_per_step": 47.0, "launches_per_step": 3.0}
  assert tot["span_us_per_step"] == pytest.approx(t2 / 1e3 / 2)
  assert tot["busy_us_per_step"] == pytest.approx(t2 / 1e3 / 2)  # no idle gaps here


def test_a_zero_fill_between_a_norm_and_its_projection_still_opens_a_block(trace):
  ev, _ = fake_step(0, 10, 30)
  ev = sorted(ev)
  s, e, _ = ev[0]  # the first norm; a scratch's zeroing before the q/k/v GEMM
  ev = [(s, e - 300, "fusion_7"), (e - 300, e, "loop_broadcast_fusion")] + ev[1:]
  rec = trace.summarize(sorted(ev), layers=2)
  assert rec["steps"] == 1 and rec["attention_block_us"] == 10


def test_kernel_names_lose_layer_numbers_and_specialization_hashes(trace):
  """A kernel's trailing fusion and layer numbers, and the hash launch.xla_kernel gives each
  specialization of a Triton kernel (the scratch chain's two halves are two), are dropped."""
  assert trace.base_name("gemm_fusion_dot.1.2") == "gemm_fusion_dot"
  assert trace.base_name("loop_broadcast_fusion_3") == "loop_broadcast_fusion"
  for h in ("3fa9b2c1d0e4", "0123456789ab"):
    assert trace.base_name(f"_xuv_decode_persistent_kernel_{h}") == "_xuv_decode_persistent_kernel"
  assert trace.base_name("_mlp_decode_kernel") == "_mlp_decode_kernel"
  assert trace.base_name("input_reduce_fusion") == "input_reduce_fusion"
