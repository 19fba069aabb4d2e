"""CPU tests of the GPU benchmark's timing method (benchmarks/gpu_lowrank.py)."""

import json
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


def test_timeline_busy_time_is_the_union_of_kernel_intervals(bench):
  assert bench.busy_ns([(0, 10, "a"), (5, 15, "b"), (20, 30, "c")]) == 25
  assert bench.busy_ns([(0, 10, "a"), (2, 3, "b")]) == 10  # one inside another


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


def test_variants_are_timed_beside_each_default_record(bench, monkeypatch):
  """--variants SPEC,,SPEC: each default record of the suite, then each variant with the
  default's XLA times (baselines)."""
  import argparse

  calls = []

  def fake(m, k, r, n, bw, peak, kernel="auto", reps=None, baselines=None):
    calls.append((m, k, kernel, baselines is not None))
    return dict(M=m, K=k, variant=kernel)

  monkeypatch.setattr(bench, "xuv_record", fake)
  args = argparse.Namespace(extra=[], variants="persistent,,pv_xla", min_m=64, max_m=64)
  recs = bench.suite("decode", 1.0, 1.0, args, [])
  shapes = len(bench.XUV_DECODE_SHAPES)
  assert len(recs) == shapes * 3 and len(calls) == shapes * 3
  assert [c[2:] for c in calls[:3]] == [("auto", False), ("persistent", True), ("pv_xla", True)]
  assert {c[0] for c in calls} == {64}


def test_resume_skips_the_points_already_measured(bench, monkeypatch):
  """--resume: a point whose default and variant records are all in --out is not timed again;
  a point missing one of them is timed whole."""
  import argparse

  calls = []

  def fake(m, k, r, n, bw, peak, kernel="auto", reps=None, baselines=None):
    calls.append((m, k, r, n, kernel))
    return dict(op="xuv", variant=kernel, M=m, K=k, r=r, N=n)

  monkeypatch.setattr(bench, "xuv_record", fake)
  args = argparse.Namespace(extra=[], variants="persistent", min_m=1, max_m=2)
  (k, r, n), (k2, r2, n2) = bench.XUV_ATTN_SHAPES[:2]
  done = {("xuv", v, 1, k, r, n) for v in ("auto", "persistent")}
  done.add(("xuv", "auto", 2, k, r, n))  # its variant is missing: M = 2 is timed again
  recs = bench.suite("decode_attn", 1.0, 1.0, args, [], frozenset(done))
  assert (1, k, r, n, "auto") not in calls and (1, k, r, n, "persistent") not in calls
  assert calls[:2] == [(2, k, r, n, "auto"), (2, k, r, n, "persistent")]
  assert (1, k2, r2, n2, "auto") in calls
  assert len(recs) == len(calls) == 2 * (2 * len(bench.XUV_ATTN_SHAPES) - 1)
  assert {bench.record_key(rec) for rec in recs}.isdisjoint(done - {("xuv", "auto", 2, k, r, n)})


def test_a_run_adds_only_to_its_own_cards_results(bench, tmp_path):
  out = tmp_path / "gpu_lowrank_h200.json"
  assert bench.earlier_runs(str(out), "NVIDIA H100 80GB HBM3 (16 CPU cores, x86_64)") == (
    [],
    [],
    None,
  )
  recs = [dict(op="xuv", variant="auto", M=1, K=8, r=2, N=8)]
  meta = dict(machine="NVIDIA H200 (16 CPU cores, x86_64)", runs=[dict(index=0)], note="n")
  out.write_text(json.dumps(dict(meta=meta, records=recs)))
  assert bench.earlier_runs(str(out), "NVIDIA H200 (32 CPU cores, x86_64)") == (
    recs,
    [dict(index=0)],
    "n",
  )
  with pytest.raises(SystemExit, match="holds records of NVIDIA H200; this is NVIDIA H100"):
    bench.earlier_runs(str(out), "NVIDIA H100 80GB HBM3 (16 CPU cores, x86_64)")


def test_resume_covers_every_suites_points(bench, monkeypatch):
  """Every suite's points are skipped when --out holds them: a complete sweep times nothing."""
  import argparse

  timed = []

  def fake(op):
    def record(*a, kernel=None, **kw):
      timed.append(op)
      raise AssertionError(f"{op} timed again")

    return record

  for fn in ("xuv_record", "mlp_record", "group_record", "kv_attention_record"):
    monkeypatch.setattr(bench, fn, fake(fn))
  args = argparse.Namespace(extra=[], variants=None, min_m=1, max_m=16, mlp_models=None)
  ms = [m for m in bench.DECODE_M if m <= 16]
  done = {("xuv", "auto", m, *s) for s in bench.XUV_ATTN_SHAPES for m in ms}
  for label, tokens in bench.MLP_TOKENS:
    d, f, r = bench.MLP_SHAPES[label]
    done |= {("mlp_swiglu", "auto", m, d, r, f) for m in tokens}
  for k, members in bench.GROUP_SHAPES:
    rs, ns = sum(r for r, _ in members), sum(n for _, n in members)
    done |= {("xuv_group", v, m, k, rs, ns) for v in ("group", "separate") for m in ms}
  done |= {("kv_attention", "auto", b, t, r, 32 * 128) for b, t, r in bench.KV_ATTENTION_SHAPES}
  for suite in ("decode_attn", "mlp", "decode_group", "kv_attention"):
    assert bench.suite(suite, 1.0, 1.0, args, [], frozenset(done)) == []
  assert timed == []


def test_attention_suite_extends_the_policy_to_its_shapes(bench, monkeypatch):
  """decode_attn times the attention projections at every decode M (--min-m / --max-m
  narrow it), each within the policy's ``extrapolate`` of the shapes it adds (so the policy
  judges them from these records)."""
  import argparse

  from lrjax.custom_calls.triton import policy

  calls = []
  monkeypatch.setattr(
    bench, "xuv_record", lambda m, k, r, n, *a, **kw: calls.append((m, k, r, n)) or dict(M=m)
  )
  args = argparse.Namespace(extra=[], variants=None, min_m=2, max_m=64)
  bench.suite("decode_attn", 1.0, 1.0, args, [])
  ms = [m for m in bench.DECODE_M if 2 <= m <= 64]
  assert 1 not in ms and 128 not in ms and 32 in ms
  assert calls == [(m, *s) for s in bench.XUV_ATTN_SHAPES for m in ms]
  fake = tuple(("xuv", m, k, r, n, 10.0, 11.0) for (m, k, r, n) in calls)
  table = policy.current().replace(records=fake, model_ab=(), model_op_ab=())  # calls alone
  assert all(policy.verdict("xuv", m, k, r, n, table) is None for (m, k, r, n) in calls)


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
