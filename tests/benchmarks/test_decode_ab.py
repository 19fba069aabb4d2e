"""CPU tests of benchmarks/decode_ab.py: its case syntax and that every variant of a case is
timed on the same layers, with its environment set only while it is timed."""

import os

import pytest


@pytest.fixture(scope="module")
def ab(load_benchmark):
  return load_benchmark("decode_ab")


def test_cases_and_variants_parse(ab):
  assert ab.parse_case("2,4096,152,4096|xla,,auto,,persistent:programs=64,k_per=128") == (
    (2, 4096, 152, 4096),
    ["xla", "auto", "persistent:programs=64,k_per=128"],
  )
  assert ab.parse_variant("auto") == ({}, "auto")
  assert ab.parse_variant("env:A=1&B=x+persistent:stages=3") == (
    {"A": "1", "B": "x"},
    "persistent:stages=3",
  )
  assert ab.parse_variant("env:LRJAX_TRITON_LAUNCH=jaxlib") == (
    {"LRJAX_TRITON_LAUNCH": "jaxlib"},
    "auto",
  )


@pytest.mark.parametrize(
  "case", ["2,4096,152|xla", "2,4096,152,4096", "2,4096,152,4096|", "a,b,c,d|xla"]
)
def test_a_bad_case_names_the_syntax(ab, case):
  with pytest.raises(ValueError, match="M,K,r,N"):
    ab.parse_case(case)


def test_a_bad_environment_names_the_syntax(ab):
  with pytest.raises(ValueError, match="NAME=VALUE"):
    ab.parse_variant("env:A+auto")


def test_every_variant_is_timed_on_the_same_layers_with_its_environment(ab, monkeypatch):
  seen = []

  def fake_time(fn, x, layers, distinct=False):
    assert not distinct
    seen.append((id(x), tuple(id(u) for u, _ in layers), os.environ.get("LRJAX_AB_PROBE")))
    return 1.0 + len(seen), 0.0

  monkeypatch.setattr(ab.g, "per_call_us", fake_time)
  monkeypatch.setattr(ab, "_fn", lambda variant, *dims: variant)
  monkeypatch.delenv("LRJAX_AB_PROBE", raising=False)
  times = ab.time_case((2, 64, 16, 32), ["xla", "env:LRJAX_AB_PROBE=1+auto"], rounds=2)
  assert times == {"xla": [2.0, 4.0], "env:LRJAX_AB_PROBE=1+auto": [3.0, 5.0]}
  assert len({s[:2] for s in seen}) == 1  # one set of layers for all four timings
  assert [s[2] for s in seen] == [None, "1", None, "1"]
  assert "LRJAX_AB_PROBE" not in os.environ  # restored after its variant


def test_the_script_writes_its_records_for_xla_alone(ab, monkeypatch, tmp_path):
  """End to end on the CPU (host timing; the kernel variants need a GPU): one case, XLA's
  lowering only, a JSON with the rounds and the ratio to XLA."""
  import json
  import math
  import statistics

  monkeypatch.setattr(ab.g, "REPS", 3)
  out = tmp_path / "ab.json"
  ab.main(["--rounds", "2", "--out", str(out), "2,64,16,32|xla"])
  got = json.loads(out.read_text())
  (rec,) = got["records"]
  assert (rec["M"], rec["K"], rec["r"], rec["N"], rec["variant"]) == (2, 64, 16, 32, "xla")
  # host-clock times of a tiny case can be noise around zero (CI's loaded 2 cores): the
  # record's shape and arithmetic are what is checked here, not their sign
  assert len(rec["rounds_us"]) == 2 and all(map(math.isfinite, rec["rounds_us"]))
  assert rec["us"] == statistics.median(rec["rounds_us"]) and rec["speedup_vs_xla"] == 1.0
  assert got["meta"]["rounds"] == 2
  assert rec["correct"] and 0 < rec["rel_err"] <= got["meta"]["rel_tol"]  # bf16 rounding


def test_a_variant_with_a_wrong_output_is_marked(ab, monkeypatch, tmp_path, capsys):
  """Each variant's output is checked against the f32 reference before it is timed: a wrong
  one is recorded with its error and printed as WRONG, the right one beside it is not."""
  import json

  real = ab._fn
  monkeypatch.setattr(
    ab,
    "_fn",
    lambda variant, *dims: (
      (lambda x, u, v: 1.05 * ((x @ u) @ v)) if variant == "off" else real(variant, *dims)
    ),
  )
  monkeypatch.setattr(ab.g, "REPS", 2)
  out = tmp_path / "ab.json"
  ab.main(["--rounds", "1", "--out", str(out), "1,48,8,24|xla,,off"])
  xla, off = json.loads(out.read_text())["records"]
  assert xla["correct"] and not off["correct"]
  assert off["rel_err"] == pytest.approx(0.05, abs=0.01)
  lines = capsys.readouterr().out.splitlines()
  assert "WRONG" not in lines[0] and "WRONG (rel err" in lines[1]


def test_a_variant_that_fails_is_recorded_and_the_rest_go_on(ab, monkeypatch, tmp_path):
  import json

  real = ab._fn

  def fn(variant, *dims):
    if variant == "broken":

      def f(x, u, v):
        raise ValueError("asks for 300000 bytes of shared memory\nsecond line")

      return f
    return real(variant, *dims)

  monkeypatch.setattr(ab, "_fn", fn)
  monkeypatch.setattr(ab.g, "REPS", 2)
  out = tmp_path / "ab.json"
  ab.main(["--rounds", "1", "--out", str(out), "1,48,8,24|broken,,xla", "2,48,8,24|xla"])
  broken, xla1, xla2 = json.loads(out.read_text())["records"]
  assert broken["variant"] == "broken" and broken["us"] is None
  assert broken["error"] == "ValueError: asks for 300000 bytes of shared memory"
  assert xla1["correct"] and xla2["correct"] and xla2["M"] == 2


def test_triton_call_forces_xla_tritons_call_for_the_persistent_kernel(ab, monkeypatch):
  """triton_call+variant: launch mode xla_triton and the persistent X·U·V kernel handed to
  XLA's Triton call on any plan (here phase-1 tiles of 160 of 256 columns, which the rule
  keeps on the PTX call); the rule and the environment come back after."""
  pytest.importorskip("triton")
  planner, xuv_decode = ab._kernel_modules()
  name = xuv_decode._xuv_decode_persistent_kernel.__name__
  meta = dict(PV=0, COLS_R=160, BLOCK_R=256, V_RES=0)
  monkeypatch.setenv("LRJAX_TRITON_LAUNCH", "xla")
  rule = planner.xla_triton_serves
  assert not rule(name, meta)
  with ab.variant_setup("env:LRJAX_AB_PROBE=1+triton_call+pv_xla") as variant:
    assert variant == "pv_xla"
    assert os.environ["LRJAX_TRITON_LAUNCH"] == "xla_triton"
    assert os.environ["LRJAX_AB_PROBE"] == "1"
    assert planner.xla_triton_serves(name, meta)
    assert not planner.xla_triton_serves("_mlp_decode_kernel", meta)
  assert planner.xla_triton_serves is rule and os.environ["LRJAX_TRITON_LAUNCH"] == "xla"
  assert "LRJAX_AB_PROBE" not in os.environ
  with ab.variant_setup("triton_call+") as variant:
    assert variant == "auto"


def test_bad_input_stops_before_any_timing(ab, capsys):
  with pytest.raises(SystemExit):
    ab.main(["--out", "unused.json", "2,64,16|xla"])
  assert "M,K,r,N" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    ab.main(["--out", "unused.json", "2,64,16,32|env:BAD+auto"])
  assert "NAME=VALUE" in capsys.readouterr().err


def test_points_come_from_a_sweep_and_split_into_shards(ab, tmp_path, capsys):
  """--points: each decode X·U·V point (M <= --max-m) of a results file, once, with
  --variants; --shard i/n: contiguous slices that together hold every case once."""
  import json

  recs = [
    dict(op="xuv", M=m, K=k, r=r, N=n)
    for m, k, r, n in (
      (4, 64, 16, 32),
      (1, 64, 16, 32),
      (4, 64, 16, 32),
      (64, 64, 16, 32),
      (2, 32, 8, 16),
      (1024, 64, 16, 32),
    )
  ] + [dict(op="mlp_swiglu", M=1, K=1, r=1, N=1)]
  path = tmp_path / "sweep.json"
  path.write_text(json.dumps(dict(records=recs)))
  assert ab.sweep_points(str(path), 32) == [(2, 32, 8, 16), (1, 64, 16, 32), (4, 64, 16, 32)]
  assert ab.sweep_points(str(path), 64)[-1] == (64, 64, 16, 32)
  cases = list(range(7))
  slices = [ab.shard(cases, i, 3) for i in (1, 2, 3)]
  assert sum(slices, []) == cases and max(map(len, slices)) - min(map(len, slices)) <= 1
  assert ab.parse_shard("2/3") == (2, 3)
  for bad in ("0/2", "3/2", "x"):
    with pytest.raises(ValueError, match="i/n"):
      ab.parse_shard(bad)
  for argv, msg in (
    (["--points", str(tmp_path / "none.json")], "results JSON"),
    ([], "no cases"),
    (["--points", str(path), "--shard", "3/2"], "i/n"),
  ):
    with pytest.raises(SystemExit):
      ab.main(["--out", "unused.json"] + argv)
    assert msg in capsys.readouterr().err


def test_the_points_of_a_sweep_are_timed_with_the_given_variants(ab, monkeypatch, tmp_path):
  import json

  path = tmp_path / "sweep.json"
  path.write_text(
    json.dumps(dict(records=[dict(op="xuv", M=m, K=64, r=16, N=32) for m in (1, 2, 4)]))
  )
  timed = []
  monkeypatch.setattr(
    ab,
    "time_case",
    lambda dims, variants, rounds, inputs, distinct: (
      timed.append((dims, variants)) or {v: [1.0] for v in variants}
    ),
  )
  monkeypatch.setattr(ab, "check_case", lambda dims, variants, inputs: {v: 0.0 for v in variants})
  out = tmp_path / "ab.json"
  ab.main(["--out", str(out), "--points", str(path), "--variants", "xla,,auto", "--shard", "2/2"])
  assert timed == [((2, 64, 16, 32), ["xla", "auto"]), ((4, 64, 16, 32), ["xla", "auto"])]
  got = json.loads(out.read_text())
  assert got["meta"]["shard"] == "2/2" and len(got["records"]) == 4


def _shard_file(path, shard, recs, **meta):
  import json

  base = dict(
    machine="NVIDIA H200",
    jax="0.11.2",
    triton="3.6.0",
    rounds=2,
    shard=shard,
    date="2026-11-27T23:00:56+00:00",
    default_launch="xla",
  )
  path.write_text(json.dumps(dict(meta=dict(base, **meta), records=recs)))
  return str(path)


def test_merge_joins_the_shards_of_one_run_and_names_xla_tritons_plans(ab, tmp_path):
  """--merge: the shards of one run in shard order, each record with whether launch mode
  xla_triton hands its point's plan to XLA's Triton call (the planner's rule, on the H200's
  132 SMs where a file predates the SM count in meta)."""
  pytest.importorskip("triton")
  import json

  rec = lambda m, k, r, n: dict(M=m, K=k, r=r, N=n, variant="auto", us=1.0)  # noqa: E731
  b = _shard_file(
    tmp_path / "b.json", "2/2", [rec(8, 8192, 2456, 8192), rec(64, 4096, 2560, 14336)]
  )
  a = _shard_file(tmp_path / "a.json", "1/2", [rec(2, 4096, 2560, 14336), rec(4, 4096, 152, 4096)])
  out = tmp_path / "ab.json"
  ab.main(["--merge", b, a, "--out", str(out), "--note", "two GPUs"])
  got = json.loads(out.read_text())
  assert [(r["M"], r["shard"], r["xla_triton_serves"]) for r in got["records"]] == [
    (2, "1/2", True),
    (4, "1/2", True),
    (8, "2/2", False),
    (64, "2/2", True),
  ]
  assert got["meta"]["sms"] == 132 and got["meta"]["note"] == "two GPUs"
  assert [s["file"] for s in got["meta"]["shards"]] == ["a.json", "b.json"]
  assert "shard" not in got["meta"] and "date" not in got["meta"]


def test_merge_refuses_shards_that_are_not_one_run(ab, tmp_path, capsys):
  rec = [dict(M=2, K=64, r=16, N=32, variant="xla", us=1.0)]
  a = _shard_file(tmp_path / "a.json", "1/2", rec)
  for argv, msg in (
    ([a], "1/2 ... 2/2 once each"),
    ([a, _shard_file(tmp_path / "b.json", "1/2", rec)], "once each"),
    ([a, _shard_file(tmp_path / "c.json", "2/2", rec, rounds=3)], "rounds 3 differs"),
    (
      [a, _shard_file(tmp_path / "d.json", "2/2", rec, machine="NVIDIA H100", sms=132)],
      "machine 'NVIDIA H100' differs",
    ),
    ([_shard_file(tmp_path / "e.json", "1/1", rec, machine="cpu", sms=None)], "no SM count"),
    ([str(tmp_path / "missing.json")], "decode_ab.py results file"),
  ):
    with pytest.raises(SystemExit):
      ab.main(["--merge", *argv, "--out", str(tmp_path / "out.json")])
    assert msg in capsys.readouterr().err
  assert not (tmp_path / "out.json").exists()
  with pytest.raises(SystemExit):
    ab.main(["--merge", a, "--points", a, "--out", str(tmp_path / "out.json")])
  assert "no cases or --points" in capsys.readouterr().err


def test_distinct_weights_draw_three_times_the_layers_and_say_so(ab, monkeypatch, tmp_path):
  """--distinct-weights: each case's inputs hold 3L layers, every timing gets distinct=True,
  and the file's meta says which weights were timed."""
  import json

  calls = []

  def fake_time(fn, x, layers, distinct=False):
    calls.append((len(layers), distinct))
    return 1.0, 0.0

  monkeypatch.setattr(ab.g, "per_call_us", fake_time)
  out = tmp_path / "ab.json"
  ab.main(["--rounds", "1", "--out", str(out), "--distinct-weights", "2,64,16,32|xla"])
  nl = ab.g.n_layers(2 * (64 * 16 + 16 * 32), 2)
  assert calls == [(3 * nl, True)]
  assert json.loads(out.read_text())["meta"]["weights"] == "distinct"
  ab.main(["--rounds", "1", "--out", str(out), "2,64,16,32|xla"])
  assert calls[-1] == (nl, False) and json.loads(out.read_text())["meta"]["weights"] == "reused"


def test_xla_split_is_the_chain_with_v_split_at_an_aligned_row(ab):
  """``xla_split:A``: (x@u)@v with ·V's contraction split at r rounded down to A; the same
  product (f32 on the CPU), the plain chain where r is aligned, a bad A refused by name."""
  import jax
  import numpy as np

  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  x, u, v = (jax.random.normal(kk, s) for kk, s in zip(keys, ((3, 40), (40, 44), (44, 24))))
  want = np.asarray((x @ u) @ v)
  split = ab._fn("xla_split:32", 3, 40, 44, 24)
  jaxpr = str(jax.make_jaxpr(split)(x, u, v))
  assert jaxpr.count("dot_general") == 3 and "slice" in jaxpr  # x·u, then two ·V halves
  np.testing.assert_allclose(np.asarray(split(x, u, v)), want, rtol=1e-5, atol=1e-5)
  aligned = ab._fn("xla_split:4", 3, 40, 44, 24)  # 44 % 4 = 0: the plain chain
  assert str(jax.make_jaxpr(aligned)(x, u, v)).count("dot_general") == 2
  with pytest.raises(ValueError, match="positive alignment"):
    ab._fn("xla_split:0", 3, 40, 44, 24)


def test_kernel_table_counts_launches_a_call_and_takes_medians(ab, monkeypatch):
  """--kernels: one profiled execution of the one-pass chain over L layers, kernels by total
  time, launches divided by L."""
  seen = []

  def fake_profile(fns, x, layers):
    seen.append(len(fns))
    # two layers: a GEMM twice a call, a pad once a layer
    return [
      [
        (0, 3000, "gemm"),
        (3000, 5000, "gemm"),
        (5000, 17000, "pad"),
        (17000, 21000, "gemm"),
        (21000, 22000, "gemm"),
      ]
    ]

  monkeypatch.setattr(ab.g, "profiled_executions", fake_profile)
  table = ab.kernel_table(lambda x, u, v: x, None, [(1, 2), (3, 4)])
  assert seen == [1]
  assert table == {"pad": [0.5, 12.0], "gemm": [2.0, 2.5]}
  assert list(table) == ["pad", "gemm"]  # by total time


def test_check_after_times_first_and_records_the_kernels(ab, monkeypatch, tmp_path):
  import json

  order = []
  monkeypatch.setattr(
    ab,
    "time_case",
    lambda dims, variants, *a: (order.append("time"), {v: [1.0] for v in variants})[1],
  )
  monkeypatch.setattr(
    ab,
    "check_case",
    lambda dims, variants, inputs=None: (order.append("check"), {v: 1e-3 for v in variants})[1],
  )
  monkeypatch.setattr(ab, "kernel_table", lambda fn, x, layers: {"k": [1.0, 2.0]})
  out = tmp_path / "ab.json"
  ab.main(["--rounds", "1", "--out", str(out), "--check-after", "--kernels", "1,48,8,24|xla"])
  got = json.loads(out.read_text())
  assert order == ["time", "check"] and got["meta"]["checked"] == "after timing"
  (rec,) = got["records"]
  assert rec["kernels"] == {"k": [1.0, 2.0]} and rec["correct"]
  order.clear()
  ab.main(["--rounds", "1", "--out", str(out), "1,48,8,24|xla"])
  got = json.loads(out.read_text())
  assert order == ["check", "time"] and "kernels" not in got["records"][0]
