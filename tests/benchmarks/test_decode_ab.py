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
  from lrjax.custom_calls.triton import launch_modes

  name = "_xuv_decode_persistent_kernel"
  meta = dict(PV=0, COLS_R=160, BLOCK_R=256, V_RES=0)
  monkeypatch.setenv("LRJAX_TRITON_LAUNCH", "xla")
  rule = launch_modes.xla_triton_serves
  assert not rule(name, meta)
  with ab.variant_setup("env:LRJAX_AB_PROBE=1+triton_call+pv_xla") as variant:
    assert variant == "pv_xla"
    assert os.environ["LRJAX_TRITON_LAUNCH"] == "xla_triton"
    assert os.environ["LRJAX_AB_PROBE"] == "1"
    assert launch_modes.xla_triton_serves(name, meta)
    assert not launch_modes.xla_triton_serves("_mlp_decode_kernel", meta)
  assert launch_modes.xla_triton_serves is rule and os.environ["LRJAX_TRITON_LAUNCH"] == "xla"
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
