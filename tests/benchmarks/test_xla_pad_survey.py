"""CPU tests of benchmarks/xla_pad_survey.py's HLO reading (its GPU run is the survey)."""

import pytest

# Lines as jax 0.11.2 wrote them on an H200 for 64 x 8192->2456->8192 (shortened): P padded
# to 2464 columns, V to 2464 rows, and one unrelated fusion.
HLO = """
  %loop_pad_fusion = bf16[64,2464]{1,0} fusion(%gemm_fusion_dot), kind=kLoop, calls=%fused_pad
  %loop_pad_fusion.1 = bf16[2464,8192]{1,0} fusion(%v.1), kind=kLoop, calls=%fused_pad.1, metadata={}
  ROOT %pad.1.1 = bf16[2464,8192]{1,0} pad(%param_0.8, %constant_1_2), padding=0_8x0_0
  %loop_convert_fusion = bf16[2480,8192]{1,0} fusion(%a), kind=kLoop, calls=%fused_convert
"""  # noqa: E501


def test_v_pads_finds_the_padded_copy_of_v_only(load_benchmark):
  mod = load_benchmark("xla_pad_survey")
  assert mod.v_pads(HLO, 2456, 8192) == [2464]
  assert mod.v_pads(HLO, 2464, 8192) == []  # not more rows than r: no pad of V
  assert mod.v_pads(HLO, 2456, 4096) == []  # another N
  assert mod.v_pads("", 2456, 8192) == []


def test_contexts_are_three_positive_integers(load_benchmark):
  mod = load_benchmark("xla_pad_survey")
  assert mod.parse_context("64,8192,8192") == (64, 8192, 8192)
  for bad in ("64,8192", "64,8192,x", "0,8192,8192", "64,8192,8192,1", "-1,2,3"):
    with pytest.raises(ValueError, match="M,K,N"):
      mod.parse_context(bad)
