"""CPU tests of the Triton kernels' tuning tables (policy.py): the dispatch verdict, the
tables' shape, and the choice of a table by device name."""

import contextlib
import json
import os
import statistics

import jax
import jax.numpy as jnp
import pytest

import lrjax
from lrjax.custom_calls.triton import lowering, policy

H200 = policy.for_device("NVIDIA H200")[0]
D = H200.values("dispatch")  # the dispatch rule's thresholds in the H200's table


@pytest.fixture(autouse=True)
def _h200_table():
  """These expectations were written for the H200's tuning table, whatever GPU the host has."""
  with policy.use(H200):
    yield


@pytest.fixture
def use_table():
  """use_table(field, value): the current table with ``field`` (records, model_ab,
  model_op_ab) replaced, for the rest of the test."""
  with contextlib.ExitStack() as stack:
    state = {"table": policy.current()}

    def set_field(field, value):
      state["table"] = state["table"].replace(**{field: tuple(value)})
      stack.enter_context(policy.use(state["table"]))

    yield set_field


def test_nearest_record_and_verdict(use_table):
  use_table("model_ab", ())
  use_table("model_op_ab", ())
  use_table(
    "records",
    (
      ("xuv", 1, 4096, 1024, 4096, 10.0, 12.0),  # faster than XLA
      ("xuv", 2, 4096, 1024, 4096, 10.0, 9.0),  # one slow point between fast ones
      ("xuv", 4, 4096, 1024, 4096, 10.0, 11.0),
      ("xuv", 16, 4096, 1024, 4096, 10.0, 10.0),  # at parity: serves
      ("xuv", 1024, 4096, 1024, 4096, 100.0, 80.0),  # slower: 0.80x
      ("xuv", 1, 8192, 2048, 16384, 10.0, 11.0),
      ("xuv", 2, 8192, 2048, 16384, 10.0, 11.0),
      ("xuv", 4, 8192, 2048, 16384, 10.0, 8.5),  # 0.85x: clearly slower, though the median
      ("xuv", 8, 8192, 2048, 16384, 10.0, 11.0),  # of M=2, 4, 8 is 1.1x
      ("mlp_swiglu", 1, 4096, 1024, 14336, 50.0, 40.0),
    ),
  )
  assert policy.verdict("xuv", 1, 4096, 1024, 4096) is None
  assert policy.verdict("xuv", 3, 4096, 1024, 4096) is None  # median of M=2, 4, 16: 1.0x
  why = policy.verdict("xuv", 2, 4096, 1024, 4096)  # at M=2 itself its own 0.90x decides
  assert why is not None and "this very shape" in why and "0.90x" in why
  assert policy.verdict("xuv", 2, 8192, 2048, 16384) is None
  why = policy.verdict("xuv", 4, 8192, 2048, 16384)
  assert why is not None and "clearly" in why and "0.85x" in why and "M=4" in why
  assert policy.verdict("xuv", 3, 3000, 1000, 4000) is None
  assert policy.verdict("xuv", 16, 4096, 1024, 4096) is None
  why = policy.verdict("xuv", 600, 4096, 1024, 4096)
  assert why is not None and "0.80x" in why and "M=1024" in why and "prefer_kernels" in why
  assert policy.nearest("xuv", 600, 4096, 1024, 4096)[1] == 1024
  assert "D_ff=14336" in policy.verdict("mlp_swiglu", 1, 4096, 1024, 14336)
  use_table("records", ())
  assert policy.verdict("xuv", 600, 4096, 1024, 4096) is None  # nothing measured
  # a kernel 2 % behind XLA gains nothing: parity is XLA's own speed (such a SwiGLU call cost
  # the Llama-3-70B step 2.6 % at batch 8)
  use_table("records", (("mlp_swiglu", 8, 8192, 3840, 28672, 215.0, 211.0),))
  why = policy.verdict("mlp_swiglu", 8, 8192, 3840, 28672)
  assert why is not None and "0.98x" in why


def test_the_nearest_shape_decides_before_the_nearest_token_count(use_table):
  """Two SwiGLU shapes of one factor size (Qwen2.5-7B's and Llama-3-8B's): at a token count
  only the other one measured, the records of the shape nearest the call's decide (its own,
  or the Qwen model's rank 1792 near the 2048 benchmarked), M = 1 kept apart."""
  use_table("model_ab", ())
  use_table("model_op_ab", ())
  use_table(
    "records",
    (
      ("mlp_swiglu", 1, 3584, 2048, 18944, 81.5, 134.4),  # 1.65x
      ("mlp_swiglu", 4, 3584, 2048, 18944, 84.7, 79.3),  # 0.94x
      ("mlp_swiglu", 16, 3584, 2048, 18944, 92.2, 83.8),  # 0.91x
      ("mlp_swiglu", 8, 4096, 2560, 14336, 85.7, 93.3),
    ),
  )  # 1.09x
  assert policy.nearest("mlp_swiglu", 8, 3584, 2048, 18944)[1:3] == (4, 3584)
  why = policy.verdict("mlp_swiglu", 8, 3584, 2048, 18944)
  assert why is not None and "D=3584" in why and "M=4, 16" in why
  assert policy.nearest("mlp_swiglu", 2, 3584, 2048, 18944)[1] == 4  # not its M=1
  assert policy.verdict("mlp_swiglu", 1, 3584, 2048, 18944) is None
  assert policy.verdict("mlp_swiglu", 8, 4096, 2560, 14336) is None
  assert policy.nearest("mlp_swiglu", 8, 3584, 1792, 18944)[1:3] == (4, 3584)
  assert "M=4, 16" in policy.verdict("mlp_swiglu", 8, 3584, 1792, 18944)
  assert policy.nearest("mlp_swiglu", 8, 4096, 1920, 14336)[1:3] == (8, 4096)


def test_calls_far_from_every_benchmarked_size_go_to_xla(use_table):
  """No extrapolation beyond EXTRAPOLATE x in factor size (e.g. a TP-8 shard of q_proj)."""
  use_table(
    "records",
    (
      ("xuv", 1, 4096, 1024, 14336, 14.7, 26.1),  # 1.78x, 18.9M factor elements
      ("mlp_swiglu", 1, 2048, 1280, 8192, 35.1, 57.4),
    ),
  )
  assert D.extrapolate == 4.0
  assert policy.verdict("xuv", 1, 4096, 1216, 4096) is None  # 1.9x smaller: judged
  assert policy.verdict("xuv", 1, 4096, 608, 4096) is None  # 3.8x: still judged
  why = policy.verdict("xuv", 1, 4096, 152, 4096)  # 15.2x smaller
  assert why is not None and "within 4x" in why and "15.2x" in why and "prefer_kernels" in why
  assert policy.verdict("xuv", 1, 16384, 8192, 65536) is not None  # 32x larger
  why = policy.verdict("mlp_swiglu", 1, 896, 300, 4864)  # a 0.5B model's MLP: 7.6x
  assert why is not None and "D_ff=4864" in why


def test_one_row_is_judged_apart_from_wider_calls(use_table):
  """XLA lowers M=1 with a multiply and a reduce, not a GEMM: no pooling across it."""
  use_table("model_ab", ())
  use_table("model_op_ab", ())
  use_table(
    "records",
    (
      ("xuv", 1, 4096, 1024, 14336, 14.7, 26.1),  # 1.78x
      ("xuv", 2, 4096, 1024, 14336, 15.0, 14.0),  # 0.93x
      ("xuv", 4, 4096, 1024, 14336, 15.0, 14.1),  # 0.94x
      ("xuv", 8, 4096, 1024, 14336, 10.0, 9.6),
    ),
  )
  assert policy.verdict("xuv", 1, 4096, 1024, 14336) is None
  why = policy.verdict("xuv", 3, 4096, 1024, 14336)
  assert why is not None and "M=2, 4, 8" in why  # M=1 is not in M=4's window


def test_wide_xuv_records_pool_only_with_each_other(use_table):
  """X·U·V from WIDE_M + 1 rows runs other tiles (64/128-row blocks, ·V by XLA's GEMM from 64
  rows): its records there are pooled, and a call there judged, only with each other; 4096->
  512->1024's 1.13 / 1.11x at 16 / 32 rows once kept it served at 65-90 rows, where its own
  records said 0.93 / 0.96x. Below WIDE_M + 1 rows, nothing changes. The MLP's records from
  MLP_COMPOSE_MIN_M rows (X·U·V decode calls, not the fused kernel) pool only with each
  other too: 80 rows follows 128's alone."""
  use_table("model_ab", ())
  use_table("model_op_ab", ())
  recs = (
    ("xuv", 16, 4096, 512, 1024, 10.0, 11.3),
    ("xuv", 32, 4096, 512, 1024, 10.0, 11.1),
    ("xuv", 64, 4096, 512, 1024, 10.0, 9.3),
    ("xuv", 128, 4096, 512, 1024, 10.0, 9.6),
  )
  use_table("records", recs + tuple(("mlp_swiglu",) + q[1:] for q in recs))
  for m in (8, 16, 24, 32):
    assert policy.verdict("xuv", m, 4096, 512, 1024) is None, m
  for m in (33, 40, 48, 80, 100, 128, 200):
    why = policy.verdict("xuv", m, 4096, 512, 1024)
    assert why is not None and ("M=64, 128" in why or "this very shape" in why), (m, why)
  assert policy.verdict("mlp_swiglu", 48, 4096, 512, 1024) is None  # pooled over 16-64
  why = policy.verdict("mlp_swiglu", 80, 4096, 512, 1024)
  assert why is not None and "M=128" in why, why
  assert [policy.path("xuv", m) for m in (1, 2, 32, 33, 128)] == [0, 1, 1, 2, 2]
  assert [policy.path("mlp_swiglu", m) for m in (1, 2, 33, 64, 65, 128)] == [0, 1, 1, 1, 2, 2]


def test_a_batch_whose_whole_step_was_slower_with_the_kernels_goes_to_xla(use_table):
  """MODEL_AB: a call at M >= 2 follows the whole-model A/B at the nearest batch >= 2 (within
  WINDOW x), whatever its shape's own record says; M = 1 and far-off M keep the records.
  The A/B is that of the model whose hidden size is nearest the call's K."""
  use_table(
    "records",
    (
      ("xuv", 1, 4096, 1024, 14336, 10.0, 20.0),
      ("xuv", 8, 4096, 1024, 14336, 10.0, 12.0),
      ("xuv", 64, 4096, 1024, 14336, 10.0, 12.0),
      ("xuv", 1024, 4096, 1024, 14336, 10.0, 12.0),
    ),
  )
  use_table(
    "model_ab",
    (
      ("8b", 4096, 1, 5.0, 9.0),
      ("8b", 4096, 8, 5.2, 4.8),
      ("8b", 4096, 32, 5.0, 5.5),
      ("70b", 8192, 8, 5.0, 5.5),
      ("70b", 8192, 16, 5.1, 5.0),
      ("70b", 8192, 64, 5.0, 4.0),
    ),
  )
  assert policy.verdict("xuv", 1, 4096, 1024, 14336) is None
  for m in (2, 4, 8, 16):  # nearest: batch 8 (16 is a tie between 8 and 32: the larger)
    why = policy.verdict("xuv", m, 4096, 1024, 14336)
    assert (why is None) == (m == 16), (m, why)
  why = policy.verdict("xuv", 8, 4096, 1024, 14336)
  assert "batch 8" in why and "5.20 ms" in why and "4.80 ms" in why and "prefer_kernels" in why
  assert policy.verdict("xuv", 64, 4096, 1024, 14336) is None  # batch 32: faster
  assert policy.verdict("xuv", 1024, 4096, 1024, 14336) is None  # beyond WINDOW x of 32
  # the 70B's A/B decides for calls nearer its hidden size (8192): faster at batch 8, slower
  # at 64; the 8B's batch-8 loss does not reach them
  assert policy.verdict("xuv", 8, 6144, 1024, 14336) is None
  why = policy.verdict("xuv", 64, 6144, 1024, 14336)
  assert "70b model (hidden size 8192) at batch 64" in why
  # a step 2 % slower declines (MODEL_PARITY 0.99: steps vary far less than calls alone)
  assert D.model_parity == 0.99
  assert "at batch 16" in policy.verdict("xuv", 16, 6144, 1024, 14336)
  assert "batch 8" in policy.verdict("xuv", 8, 5792, 1024, 14336)  # nearer 4096
  use_table("model_ab", (("8b", 4096, 1, 5.0, 9.0),))
  assert policy.verdict("xuv", 8, 4096, 1024, 14336) is None  # no A/B at 2 or more rows


def test_an_op_whose_kernel_slowed_the_step_goes_to_xla(use_table):
  """MODEL_OP_AB: at M >= 2 an op's calls follow the step with every kernel against the step
  with every kernel but that op's, at the nearest batch of the model nearest in hidden size;
  other ops and M = 1 are not affected."""
  use_table("model_ab", ())
  use_table(
    "records",
    (
      ("mlp_swiglu", 1, 3584, 2048, 18944, 77.0, 134.0),
      ("mlp_swiglu", 4, 3584, 2048, 18944, 77.5, 80.2),
      ("xuv", 4, 3584, 1024, 3584, 10.0, 12.0),
    ),
  )
  use_table(
    "model_op_ab",
    (
      ("qwen", 3584, 4, "mlp_swiglu", 4.07, 3.96),
      ("qwen", 3584, 64, "mlp_swiglu", 6.70, 6.83),
      ("8b", 4096, 4, "mlp_swiglu", 4.39, 4.36),
    ),
  )
  why = policy.verdict("mlp_swiglu", 4, 3584, 2048, 18944)
  assert "qwen model (hidden size 3584) at batch 4" in why and "4.07 ms" in why, why
  assert "3.96 ms with all but mlp_swiglu's" in why and "prefer_kernels" in why
  assert policy.verdict("mlp_swiglu", 1, 3584, 2048, 18944) is None  # one row: its record
  assert policy.verdict("mlp_swiglu", 64, 3584, 2048, 18944) is None  # faster with it there
  assert policy.verdict("xuv", 4, 3584, 1024, 3584) is None  # another op's A/B
  # nearer the 8B's hidden size: its step was 0.7 % slower with the kernel, within
  # MODEL_PARITY, so the kernel stays
  assert policy.verdict("mlp_swiglu", 4, 4096, 2048, 18944) is None


def test_an_op_that_sped_the_step_is_served_where_every_kernel_together_lost(use_table):
  """Where the step with every kernel lost to XLA's (MODEL_AB) but an op has its own A/B at
  that model and batch, the op's decides: the grouped kernel, whose step was slower without
  it, is served; an op without an A/B of its own follows MODEL_AB; the op's A/B at another
  model leaves MODEL_AB to decide."""
  use_table(
    "records",
    (("xuv_group", 8, 3584, 1024, 4608, 12.0, 20.0), ("xuv", 8, 3584, 1024, 3584, 10.0, 12.0)),
  )
  use_table("model_ab", (("qwen", 3584, 8, 4.30, 4.21), ("8b", 4096, 8, 4.80, 4.60)))
  use_table("model_op_ab", (("qwen", 3584, 8, "xuv_group", 4.18, 4.32),))
  assert policy.verdict("xuv_group", 8, 3584, 1024, 4608) is None
  why = policy.verdict("xuv", 8, 3584, 1024, 3584)
  assert why is not None and "the kernels were slower (4.30 ms" in why, why
  why = policy.verdict("xuv_group", 8, 4096, 1024, 4608)  # the 8B's step: no own A/B there
  assert why is not None and "8b model" in why, why


def _xuv_avals(m, k, r, n, dtype=jnp.bfloat16):
  return [jax.ShapeDtypeStruct(s, dtype) for s in ((m, k), (k, r), (r, n))]


def _window_ratio(rec):
  op, m, k, r, n = rec[:5]
  return statistics.median(
    q[6] / q[5]
    for q in policy.current().records
    if q[0] == op
    and q[2:5] == (k, r, n)
    and m / D.window <= q[1] <= D.window * m
    and policy.path(op, q[1]) == policy.path(op, m)
  )


def test_lowering_policy_follows_every_measured_record():
  """Each benchmarked shape and token count is served only where its own record and its
  neighbours' median reach PARITY."""
  for rec in policy.current().records:
    op, m, k, r, n = rec[:5]
    if op == "xuv":
      why = lowering.xuv_faster(_xuv_avals(m, k, r, n), {})
    elif op == "xuv_group":  # summed ranks and widths
      why = policy.verdict(op, m, k, r, n)
    else:
      a = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
      avals = [a(m, k), a(k, r), a(r, n), a(k, r), a(r, n), a(n, r), a(r, k)]
      params = dict(gated=True, bias_mask=(False, False, False))
      why = lowering.mlp_faster(avals, params)
    serves = (
      _window_ratio(rec) >= D.parity
      and rec[6] / rec[5] >= D.parity
      and policy._model_verdict(m, k, op) is None
    )
    assert (why is None) == serves, (rec, why)


def test_every_triton_kernel_has_the_speed_check():
  assert all(k.faster is not None for k in lowering.KERNELS)


def test_grouped_kernel_verdicts(use_table):
  """q/k/v in one launch measured 1.55-3.6x XLA's merged dots: served at the benchmarked
  groups of the 8B and 1B shapes; a whole-model loss (measured with q/k/v grouped) declines
  it like any call; a group far smaller than any benchmarked one goes to XLA."""
  assert policy.verdict("xuv_group", 8, 4096, 2240, 6144) is None
  assert policy.verdict("xuv_group", 1, 2048, 1152, 3072) is None
  use_table("model_ab", (("8b", 4096, 8, 5.2, 4.7),))
  assert "decode step of the 8b model" in policy.verdict("xuv_group", 8, 4096, 2240, 6144)
  assert policy.verdict("xuv_group", 1, 4096, 2240, 6144) is None  # one row: its record
  use_table("model_ab", ())
  use_table("model_op_ab", ())
  tiny = policy.verdict("xuv_group", 8, 512, 48, 192)
  assert tiny is not None and "no benchmarked xuv_group shape" in tiny


def test_every_shipped_table_is_well_formed():
  """Each table under tuning/: a device name, its measured parts' sources in the tree, every
  threshold a value with a one-line reason, tiles for every tuned kernel, records of the three
  ops; every threshold the code reads is in it."""
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
  assert policy.tables(), "no tuning table shipped"
  for t in policy.tables():
    assert os.path.basename(t.path).startswith("policy_") and t.device.startswith("NVIDIA")
    for src in [t.sources["kernels"], t.sources["group"], *t.sources["model_steps"]]:
      assert os.path.exists(os.path.join(repo, src)), src
    assert set(t.thresholds) == set(policy.SECTIONS)
    for section, items in t.thresholds.items():
      for name in items:
        why = t.why(section, name)
        assert "\n" not in why and 20 < len(why) < 400, (section, name, why)
        assert "session" not in why.lower(), (section, name)
    assert set(t.tiles) == {"xuv_decode_tiled", "mlp_decode", "xuv_prefill", "mlp_prefill",
                            "kv_attention"}  # fmt: skip
    assert {r[0] for r in t.records} == set(policy.OPS)
    assert all(len(r) == 7 and r[5] > 0 and r[6] > 0 for r in t.records)
  h200 = policy.for_device("NVIDIA H200")[0]
  v = h200.values("xuv_decode")
  assert (v.pv_xla_min_m, v.pv_launch_min_m, v.pv_launch_max_v) == (64, 33, 2 << 20)
  assert h200.values("mlp_decode").compose_min_m == 65
  assert h200.values("planner").phase1_balance_cols == 112


def test_a_table_without_a_reason_or_of_an_unknown_section_is_refused():
  t = policy.tables()[0]
  bad = json.loads(json.dumps(dict(t.thresholds)))
  bad["planner"]["fill_us"] = {"value": 1.5}
  with pytest.raises(ValueError, match="planner.fill_us must be"):
    t.replace(thresholds=bad)
  with pytest.raises(ValueError, match="section 'speed'"):
    t.replace(thresholds={**t.thresholds, "speed": {}})
  with pytest.raises(KeyError, match="no_such"):
    t.with_values("planner", no_such=1)


def test_each_device_gets_its_table_or_the_nearest_with_a_note(tmp_path, monkeypatch):
  """A device with a table gets it, silently; an unknown GPU the nearest (its model family's,
  else the default) with a note naming both; a process without a GPU the default table."""
  h200, note = policy.for_device("NVIDIA H200")
  assert h200.device == "NVIDIA H200" and note is None
  h100, note = policy.for_device("NVIDIA H100 80GB HBM3")
  assert h100.device == "NVIDIA H100 80GB HBM3" and note is None
  assert h100.records != h200.records  # each measured on its own card
  t, note = policy.for_device("NVIDIA H100 PCIe")  # the H100 family's table
  assert t is h100 and note == (
    f"policy: measured on {h100.measured_on}; this device NVIDIA H100 PCIe has no table, "
    "using the nearest"
  )
  t, note = policy.for_device("NVIDIA A100-SXM4-80GB")  # no family table: the default
  assert t is h200 and "A100-SXM4-80GB has no table, using the nearest" in note
  t, note = policy.for_device("cpu", gpu=False)
  assert t is h200 and "no GPU here" in note
  # without the H100's table, the H100 gets the default one, and says so
  (tmp_path / "policy_h200.json").write_text(open(h200.path).read())
  monkeypatch.setattr(policy, "TUNING_DIR", str(tmp_path))
  policy.tables.cache_clear()
  try:
    t, note = policy.for_device("NVIDIA H100 80GB HBM3")
    assert t.device == "NVIDIA H200" and note == (
      f"policy: measured on {h200.measured_on}; this device NVIDIA H100 80GB HBM3 has no "
      "table, using the nearest"
    )
  finally:
    policy.tables.cache_clear()


def test_the_environment_picks_a_table_by_path_or_name(monkeypatch):
  h200 = policy.for_device("NVIDIA H200")[0]
  cases = ((h200.path, "NVIDIA H200", "LRJAX_TRITON_POLICY"),
           ("NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3", "nearest"))  # fmt: skip
  with policy.use(None):  # the process's own choice, not the tests' pinned table
    for value, device, want in cases:
      monkeypatch.setenv("LRJAX_TRITON_POLICY", value)
      monkeypatch.setattr(policy, "_chosen", None)
      assert policy.current().device == device and want in policy.note(), value
  monkeypatch.setattr(policy, "_chosen", None)


def test_a_table_in_use_steers_the_planner_and_the_kernels_defaults():
  """policy.use: the thresholds the planner and the wrappers read are the table's."""
  from lrjax.custom_calls.triton import planner

  base = planner.plan_decode_phase1(128, 8192, 2456, 8192, programs=132)
  assert base.cols_r == 112  # phase1_balance_cols
  with policy.use(policy.current().with_values("planner", phase1_balance_min=0.5)):
    assert planner.plan_decode_phase1(128, 8192, 2456, 8192, programs=132).cols_r == 128
  assert planner.plan_decode_phase1(128, 8192, 2456, 8192, programs=132) == base


def test_explain_names_the_table_that_decides():
  """lrjax.explain reports, beside the CUDA kernel choice, which card's table decided it."""
  u = jnp.ones((256, 32), jnp.bfloat16)
  v = jnp.ones((32, 512), jnp.bfloat16)
  rep = lrjax.explain(lambda x: (x @ u) @ v, jnp.ones((2, 256), jnp.bfloat16))
  cuda = rep.matches[0]["kernels"]["cuda"]
  assert cuda["policy"] == policy.note() and "NVIDIA H200" in cuda["policy"]
  assert f"cuda {policy.note()}" in str(rep)
