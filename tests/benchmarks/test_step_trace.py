"""CPU tests of benchmarks/step_trace.py: a decode step's layer blocks from a kernel trace."""
import gzip
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def trace(load_benchmark):
  return load_benchmark("step_trace")


def fake_step(t0, attn_us, mlp_us, layers=2):
  """One decode step of ``layers`` layers: norm, q/k/v GEMM, attention, norm, MLP kernel,
  then the final norm, the LM head GEMM and a sampling kernel (times in ns)."""
  ev, t = [], t0
  for _ in range(layers):
    ev += [(t, t + 1000, "fusion_7"), (t + 1000, t + 5000, "gemm_fusion_dot.3"),
           (t + 5000, t + attn_us * 1000, "loop_add_fusion")]
    t += attn_us * 1000
    ev += [(t, t + 1000, "fusion_7"), (t + 1000, t + mlp_us * 1000, "_mlp_decode_kernel")]
    t += mlp_us * 1000
  ev += [(t, t + 1000, "fusion_9"), (t + 1000, t + 40_000, "gemm_fusion_dot.12"),
         (t + 40_000, t + 41_000, "input_reduce_fusion")]
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
    got = trace.summarize(trace.load(os.path.join(REPO, "benchmarks/results/traces", name)),
                          rec["layers"])
    for key, value in rec.items():
      assert got[key] == (pytest.approx(value) if not isinstance(value, dict)
                          else {k: pytest.approx(v) for k, v in value.items()}), (name, key)
