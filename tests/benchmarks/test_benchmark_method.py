"""CPU tests of the GPU benchmark's timing method (benchmarks/gpu_lowrank.py)."""

import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench(load_benchmark):
  return load_benchmark("gpu_lowrank")


def scripted(results):
  it = iter(results)
  return lambda: next(it)


def test_steady_timing_is_taken_at_once(bench):
  assert bench.steadiest(scripted([(50.0, 0.1), (1.0, 0.0)])) == (50.0, 0.1, 1)


def test_noisy_timing_is_repeated_and_the_steadiest_kept(bench):
  got = bench.steadiest(scripted([(26.5, 0.74), (48.3, 0.05), (1.0, 0.0)]))
  assert got == (48.3, 0.05, 2)  # stops once steady
  got = bench.steadiest(scripted([(20.0, 1.1), (30.0, 0.9), (25.0, 0.7)]), tries=3)
  assert got == (25.0, 0.7, 3)  # never steady: the least noisy of the three


def test_per_call_us_goes_through_the_retry(bench, monkeypatch):
  import math
  import jax.numpy as jnp

  seen = []

  def spy(attempt, **kw):  # the real retry, recording every attempt it makes
    def recorded():
      seen.append(attempt())
      return seen[-1]

    return real(recorded, **kw)

  real = bench.steadiest
  monkeypatch.setattr(bench, "steadiest", spy)
  x = jnp.ones((64,), jnp.float32)
  layers = [(jnp.full((64,), float(i)),) for i in range(4)]
  t_us, spread = bench.per_call_us(lambda x, w: x * w + 1.0, x, layers, reps=3)
  assert 1 <= len(seen) <= bench.TRIES
  assert (t_us, spread) == min(seen, key=lambda a: a[1])  # the steadiest attempt is kept
  assert math.isfinite(t_us) and spread >= 0  # spread is a magnitude, even for a noisy median


def test_a_difference_at_or_below_zero_is_noise_and_is_retried(bench, monkeypatch):
  """Host clocks on a loaded CPU can time 3L calls no longer than L: such an attempt is
  never kept over one with a positive median."""
  import math
  import jax.numpy as jnp

  script = iter([[-2e-6, 1e-6, -3e-6], [4e-6, 5e-6, 6e-6]])
  monkeypatch.setattr(bench, "TIMING", "host")
  monkeypatch.setattr(bench, "_host_diffs", lambda *a: next(script))
  x = jnp.ones((8,), jnp.float32)
  t_us, spread = bench.per_call_us(lambda x, w: x + w, x, [(jnp.ones(8),)], reps=3)
  assert t_us == pytest.approx(2.5) and spread == pytest.approx(0.2)
  script = iter([[-2e-6, -1e-6, 3e-6]] * bench.TRIES)
  t_us, spread = bench.per_call_us(lambda x, w: x + w, x, [(jnp.ones(8),)], reps=3)
  assert t_us < 0 and spread == math.inf  # never positive: returned, flagged as all noise


def test_executions_split_at_the_pauses_between_them(bench):
  ev = [
    (0, 10, "a"),
    (12, 30, "b"),
    (25, 28, "c"),  # one execution, overlapping kernels
    (2_000, 2_040, "d"),  # a host stall inside it (shorter than the pause)
    (5_000_000, 5_000_040, "a"),
    (5_000_041, 5_000_050, "b"),
  ]
  assert bench.execution_spans(ev, 2, pause_ns=1_000_000) == [2_040, 50]
  groups = bench.split_executions(list(reversed(ev)), 2, pause_ns=1_000_000)
  assert [[e[2] for e in g] for g in groups] == [["a", "b", "c", "d"], ["a", "b"]]
  assert bench.execution_spans(ev[:1], 1, pause_ns=1_000_000) == [10]


def test_a_trace_that_does_not_split_into_the_executions_run_is_an_error(bench):
  ev = [(0, 10, "a"), (20, 30, "b")]
  with pytest.raises(RuntimeError, match="not split into the 2 executions.*1 pieces"):
    bench.execution_spans(ev, 2, pause_ns=1_000_000)
  # a stray event after the last execution: three pieces for two executions
  ev = [(0, 10, "a"), (2_000_000, 2_000_010, "a"), (4_000_000, 4_000_001, "memcpy")]
  with pytest.raises(RuntimeError, match="not split into the 2 executions.*3 pieces"):
    bench.execution_spans(ev, 2, pause_ns=1_000_000)
  with pytest.raises(RuntimeError, match="1 device events for 2 executions"):
    bench.execution_spans(ev[:1], 2, pause_ns=1_000_000)


def test_device_events_need_a_gpu_plane(bench, tmp_path):
  import jax
  import jax.numpy as jnp

  with jax.profiler.trace(str(tmp_path)):
    x = jnp.ones(8).block_until_ready()
  if next(iter(x.devices())).platform == "gpu":
    assert bench.device_kernel_events(str(tmp_path))
  else:
    with pytest.raises(RuntimeError, match="no device events on a GPU stream"):
      bench.device_kernel_events(str(tmp_path))


def test_host_timing_is_used_off_a_gpu(bench, monkeypatch):
  import math
  import jax.numpy as jnp

  x = jnp.ones((16,), jnp.float32)
  if next(iter(x.devices())).platform == "gpu":
    pytest.skip("checks the CPU fallback")
  monkeypatch.setattr(bench, "_device_diffs", lambda *a: pytest.fail("device timing on CPU"))
  t_us, _ = bench.per_call_us(lambda x, w: x + w, x, [(jnp.ones(16),)], reps=2)
  assert math.isfinite(t_us)


def test_timeline_busy_time_is_the_union_of_kernel_intervals(monkeypatch, load_benchmark):
  monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
  timeline = load_benchmark("gpu_timeline")
  assert timeline.gl.busy_ns([(0, 10, "a"), (5, 15, "b"), (20, 30, "c")]) == 25
  assert timeline.gl.busy_ns([(0, 10, "a"), (2, 3, "b")]) == 10  # one inside another


def test_idle_gaps_are_summed_by_the_kernels_around_them(bench):
  ev = [(20, 30, "c.2"), (0, 10, "a.1"), (2, 4, "b"), (12, 15, "c.1"), (40, 41, "a.2")]
  gaps = bench.idle_gaps_ns(ev, key=lambda n: n.split(".")[0])
  # a ends last before the first gap (b ran inside it); c ends before the other two
  assert gaps == {("a", "c"): (2, 1), ("c", "c"): (5, 1), ("c", "a"): (10, 1)}


def test_overlaps_are_summed_by_the_pairs_of_kernels_that_ran_at_once(bench):
  ev = [(0, 10, "a.1"), (2, 4, "b"), (3, 12, "a.2"), (20, 30, "c")]
  ov = bench.overlaps_ns(ev, key=lambda n: n.split(".")[0])
  assert ov == {("a", "b"): 2 + 1, ("a", "a"): 7}  # a.1 with b, then a.2 with b and a.1


def test_device_diffs_pair_each_short_execution_with_the_next_long_one(bench, monkeypatch):
  """span(3L) - span(L) per alternated pair, from the executions of one trace."""
  groups = [[(0, 10, "a")], [(100, 130, "a")], [(200, 212, "a")], [(300, 340, "a")]]
  monkeypatch.setattr(bench, "profiled_executions", lambda fns, x, layers: groups)
  diffs = bench._device_diffs("f1", "f3", None, None, 2)
  assert [round(1e9 * d) for d in diffs] == [20, 28]


def test_decode_variant_suites_time_each_variant_beside_its_base(bench, monkeypatch):
  import argparse

  calls = []

  def fake(m, k, r, n, bw, peak, kernel="auto", reps=None, baselines=None):
    calls.append((m, k, kernel, baselines is not None))
    return dict(M=m, K=k, variant=kernel)

  monkeypatch.setattr(bench, "xuv_record", fake)
  args = argparse.Namespace(extra=[], chunk_m=[64])
  recs = bench.suite("decode_chunks", 1.0, 1.0, args, [])
  shapes = len(bench.XUV_DECODE_SHAPES)
  assert len(recs) == shapes * 4 and len(calls) == shapes * 4
  assert [c[2:] for c in calls[:4]] == [("auto", False)] + [
    (v, True) for v in bench.decode_chunk_variants(64, *bench.XUV_DECODE_SHAPES[0])
  ]
  calls.clear()
  bench.suite("decode_persistent", 1.0, 1.0, args, [])
  assert calls[0][2:] == ("decode_xz", False)
  assert [c[2] for c in calls[1 : 1 + len(bench.PERSISTENT_VARIANTS)]] == list(
    bench.PERSISTENT_VARIANTS
  )


def test_attention_suite_extends_the_policy_to_its_shapes(bench, monkeypatch):
  """decode_attn times the attention projections at every decode M (--min-m / --max-m
  narrow it), each within the policy's EXTRAPOLATE of the shapes it adds (so the policy
  judges them from these records)."""
  import argparse

  from lrjax.custom_calls.triton import measured

  calls = []
  monkeypatch.setattr(
    bench, "xuv_record", lambda m, k, r, n, *a, **kw: calls.append((m, k, r, n)) or dict(M=m)
  )
  args = argparse.Namespace(extra=[], min_m=2, max_m=64)
  bench.suite("decode_attn", 1.0, 1.0, args, [])
  ms = [m for m in bench.DECODE_M if 2 <= m <= 64]
  assert 1 not in ms and 128 not in ms and 32 in ms
  assert calls == [(m, *s) for s in bench.XUV_ATTN_SHAPES for m in ms]
  fake = tuple(("xuv", m, k, r, n, 10.0, 11.0) for (m, k, r, n) in calls)
  monkeypatch.setattr(measured, "RECORDS", fake)
  monkeypatch.setattr(measured, "MODEL_AB", ())  # the calls alone, not the whole-model A/Bs
  monkeypatch.setattr(measured, "MODEL_OP_AB", ())
  assert all(measured.verdict("xuv", m, k, r, n) is None for (m, k, r, n) in calls)


def decode_rec(op, m, floor_us, ours_us, xla_us, k=4096):
  return dict(
    op=op,
    variant="auto",
    M=m,
    K=k,
    r=1024,
    N=4096,
    floor_us=floor_us,
    ours_us=ours_us,
    xla_lowrank_us=xla_us,
    hbm_roofline_frac=floor_us / ours_us,
    speedup_vs_xla=xla_us / ours_us,
    tflops=1.0,
  )


def test_fixed_cost_fit_recovers_a_line_and_needs_three_floors(bench):
  recs = [decode_rec("xuv", 1, f, 5.0 + 0.9 * f, 9.0 + f) for f in (2.0, 10.0, 30.0, 60.0)]
  fixed, slope, rms = bench.fixed_cost_fit(recs)
  assert abs(fixed - 5.0) < 1e-9 and abs(slope - 0.9) < 1e-9 and rms < 1e-9
  assert bench.fixed_cost_fit(recs[:2]) is None
  assert bench.fixed_cost_fit([decode_rec("xuv", 1, 3.0, t, t) for t in (4, 5, 6)]) is None


def test_missed_decode_targets_say_by_how_much_and_why(bench):
  """A decode miss records its target time and shortfall, and why: the run's fit of time
  against floor leaves too little at small floors (fixed / (1/0.85 - slope)); a point above
  its fit says by how much; one that streams well but trails XLA says so; a met point has
  no reason."""
  recs = [decode_rec("xuv", m, f, 5.0 + f, 8.0 + f) for m, f in ((1, 10.0), (2, 40.0), (4, 80.0))]
  recs.append(decode_rec("xuv", 8, 40.0, 52.0, 60.0))  # 7 us above the others' line: 77 %
  recs.append(decode_rec("xuv", 16, 80.0, 86.0, 85.0))  # 93 % but behind XLA
  fixed, slope, _ = bench.fixed_cost_fit(recs)
  out = {t["M"]: t for t in bench.evaluate_targets(recs)}
  small = out[1]
  assert not small["met"] and small["target_us"] == round(10 / 0.85, 2)
  assert small["short_by_us"] == round(15.0 - 10 / 0.85, 2)
  assert small["why"].startswith("fixed cost")
  assert f"floors under {fixed / (1 / 0.85 - slope):.0f} us" in small["why"]
  assert f"{fixed:.1f} us + {slope:.2f} x floor over the sweep's 5 decode points" in small["why"]
  assert out[2]["met"] and "why" not in out[2] and out[2]["short_by_us"] == 0.0
  assert not out[8]["met"] and out[8]["why"].startswith("this point runs")
  assert not out[16]["met"] and out[16]["why"].startswith("behind XLA")


def test_decode_points_to_128_rows_are_judged_against_xla(bench):
  """The issue's "done when": every decode X·U·V point ahead of XLA; from 17 to 128 rows
  that alone is judged, a trailing point says by how much and which measurements say why."""
  recs = [
    decode_rec("xuv", 32, 5.0, 10.0, 10.5),
    decode_rec("xuv", 64, 5.0, 11.0, 10.0),
    decode_rec("xuv", 128, 5.0, 12.0, 11.5),
    decode_rec("xuv", 256, 5.0, 9.0, 10.0),
  ]
  out = {t["M"]: t for t in bench.evaluate_targets(recs)}
  assert set(out) == {32, 64, 128}  # 256 rows is neither decode nor the prefill sweep
  assert out[32]["met"] and out[32]["short_by_us"] == 0.0 and "why" not in out[32]
  assert not out[64]["met"] and out[64]["short_by_us"] == 1.0
  assert out[64]["why"] == bench.WIDE_M_WHY and "gpu_xla_gemm_config_h200" in out[64]["why"]
  assert not out[128]["met"] and out[128]["short_by_us"] == 0.5
  assert "ahead of XLA" in out[64]["target"] and "M<=128" in out[64]["target"]
  slow32 = bench.evaluate_targets([decode_rec("xuv", 32, 5.0, 11.0, 10.0)])[0]
  assert not slow32["met"] and slow32["why"].startswith("the fused kernel")


def test_swiglu_decode_from_17_tokens_is_judged_against_xla(bench):
  """The "done when" holds for the SwiGLU decode points from 17 to 128 tokens too: a trailing
  one says by how much, and how near each side runs to the roofline, on which weights."""
  recs = [
    decode_rec("mlp_swiglu", 32, 90.0, 100.0, 110.0),
    dict(decode_rec("mlp_swiglu", 64, 90.0, 100.0, 98.0), weights="distinct"),
    decode_rec("mlp_swiglu", 128, 90.0, 100.0, 99.0),
  ]
  out = {t["M"]: t for t in bench.evaluate_targets(recs)}
  assert all("SwiGLU 17<=T<=128 (done when)" in t["target"] for t in out.values())
  assert out[32]["met"] and "why" not in out[32] and out[32]["short_by_us"] == 0.0
  assert not out[64]["met"] and out[64]["short_by_us"] == 2.0
  assert out[64]["why"].startswith(
    "the fused decode kernel at 90% of the HBM roofline, "
    "XLA's unfused chain at 92% (each call on its own layer)"
  )
  assert out[128]["why"].startswith("X·U·V decode calls") and "reused" in out[128]["why"]


def test_missed_prefill_targets_give_the_throughput_against_xla(bench):
  rec = dict(decode_rec("xuv", 1024, 100.0, 110.0, 100.0), tflops=600.0)
  (t,) = bench.evaluate_targets([rec])
  assert not t["met"] and t["why"].startswith("compute-bound: 600 TFLOP/s against XLA's 660")


def test_distinct_weights_time_each_call_on_its_own_layer(bench, monkeypatch):
  """per_call_us(distinct=True): 3L layers, the L-call jit takes the first L and the 3L-call
  jit each once, and the difference is divided by 2L; reused weights: 3 passes over L."""
  import jax.numpy as jnp

  seen = {}

  def diffs(f1, f3, x, layers, reps):
    seen["calls"] = (len(f1(x, layers)), len(f3(x, layers)))
    return [8e-6] * reps

  monkeypatch.setattr(bench, "TIMING", "host")
  monkeypatch.setattr(bench, "_host_diffs", diffs)
  x = jnp.ones((8,), jnp.float32)
  layers = [(jnp.full((8,), float(i)),) for i in range(6)]
  t_us, _ = bench.per_call_us(lambda x, w: x + w, x, layers, reps=3, distinct=True)
  assert seen["calls"] == (2, 6) and t_us == pytest.approx(2.0)  # 8 µs over 2·2 calls
  t_us, _ = bench.per_call_us(lambda x, w: x + w, x, layers, reps=3)
  assert seen["calls"] == (6, 18) and t_us == pytest.approx(8 / 12)
  with pytest.raises(ValueError, match="expected 3L layers"):
    bench.per_call_us(lambda x, w: x + w, x, layers[:5], reps=3, distinct=True)


def test_reused_weights_run_weight_only_work_once_a_layer(bench):
  """Why distinct weights exist: in the 3-pass chain XLA computes a layer's weight-only work
  (here a sine; on the H200, the pad it adds to V for an unaligned rank) once for the three
  calls that use it; with distinct layers, once a call."""
  import jax.numpy as jnp

  fn = lambda x, u: x @ jnp.sin(u)  # noqa: E731
  x = jnp.ones((2, 5), jnp.float32)
  layers = [(jnp.full((5, 4), float(i)),) for i in range(6)]

  def sines(f, ls):  # traced, then in the compiled HLO
    return (
      f.lower(x, ls).as_text().count("stablehlo.sine"),
      f.lower(x, ls).compile().as_text().count(" sine("),
    )

  assert sines(bench.chained(fn, 3), layers[:2]) == (6, 2)  # 3 passes x 2 layers, CSE'd
  assert sines(bench.chained(fn, 1), layers) == (6, 6)  # 6 distinct layers: one a call
  assert sines(bench.chained(fn, 1, first=2), layers) == (2, 2)  # the L-call jit's first L
  out = bench.chained(fn, 3)(x, layers[:2])
  assert len(out) == 6 and jnp.allclose(out[5], fn(x, *layers[1]))


def test_kernel_table_counts_launches_a_call_over_executions(bench):
  """Two executions of two calls each: launches a call averaged over the executions, names
  cut to name_len pooled, most time a call first."""
  ex = [
    [(0, 4000, "gemm_a"), (4000, 5000, "pad"), (5000, 9000, "gemm_b")],
    [(0, 2000, "gemm_a"), (2000, 3000, "pad")],
  ]
  rows = bench.kernel_table(ex, calls=2, name_len=4)
  assert rows == [
    dict(name="gemm", per_call=0.75, median_us=4.0),
    dict(name="pad", per_call=0.5, median_us=1.0),
  ]
