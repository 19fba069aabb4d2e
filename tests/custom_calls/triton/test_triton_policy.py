"""CPU tests of the Triton kernels' measured speed policy (custom_calls/triton/measured.py)."""

import json
import os
import statistics

import jax
import jax.numpy as jnp

from lrjax.custom_calls.triton import lowering, measured, planner

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_records_are_the_committed_benchmark_results():
  """RECORDS must be regenerated (gpu_lowrank.py --emit-policy) whenever the JSON changes."""
  on, recs = measured.policy_records(os.path.join(REPO, measured.SOURCE))
  assert (on, recs) == (measured.MEASURED_ON, measured.RECORDS)
  ab = sum(
    (measured.model_ab_from_results(os.path.join(REPO, m)) for m in measured.MODEL_SOURCES), ()
  )
  assert ab == measured.MODEL_AB
  op_ab = sum(
    (measured.model_op_ab_from_results(os.path.join(REPO, m)) for m in measured.MODEL_SOURCES), ()
  )
  assert op_ab == measured.MODEL_OP_AB and {a[3] for a in op_ab} <= set(measured.OPS)
  assert {"mlp_swiglu", "xuv_group"} <= {a[3] for a in op_ab}
  models = {("8b", 4096), ("70b", 8192), ("qwen2.5-7b", 3584), ("1b", 2048)}
  assert {(a[0], a[1]) for a in ab} == models
  assert all(1 in [a[2] for a in ab if a[0] == name] for name, _ in models)
  assert {r[0] for r in recs} == {"xuv", "mlp_swiglu", "xuv_group"}
  assert min(r[1] for r in recs) == 1 and max(r[1] for r in recs) >= 4096


def test_render_rewrites_only_the_generated_block():
  with open(measured.__file__) as fh:
    text = fh.read()
  assert measured.render(os.path.join(REPO, measured.SOURCE), text) == text
  stale = text.replace(repr(measured.RECORDS[0]), "('xuv', 7, 1, 1, 1, 1.0, 1.0)")
  assert stale != text
  assert measured.render(os.path.join(REPO, measured.SOURCE), stale) == text


def test_nearest_record_and_verdict(monkeypatch):
  monkeypatch.setattr(measured, "MODEL_AB", ())
  monkeypatch.setattr(measured, "MODEL_OP_AB", ())
  monkeypatch.setattr(
    measured,
    "RECORDS",
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
  assert measured.verdict("xuv", 1, 4096, 1024, 4096) is None
  assert measured.verdict("xuv", 3, 4096, 1024, 4096) is None  # median of M=2, 4, 16: 1.0x
  why = measured.verdict("xuv", 2, 4096, 1024, 4096)  # at M=2 itself its own 0.90x decides
  assert why is not None and "this very shape" in why and "0.90x" in why
  assert measured.verdict("xuv", 2, 8192, 2048, 16384) is None
  why = measured.verdict("xuv", 4, 8192, 2048, 16384)
  assert why is not None and "clearly" in why and "0.85x" in why and "M=4" in why
  assert measured.verdict("xuv", 3, 3000, 1000, 4000) is None
  assert measured.verdict("xuv", 16, 4096, 1024, 4096) is None
  why = measured.verdict("xuv", 600, 4096, 1024, 4096)
  assert why is not None and "0.80x" in why and "M=1024" in why and "prefer_kernels" in why
  assert measured.nearest("xuv", 600, 4096, 1024, 4096)[1] == 1024
  assert "D_ff=14336" in measured.verdict("mlp_swiglu", 1, 4096, 1024, 14336)
  monkeypatch.setattr(measured, "RECORDS", ())
  assert measured.verdict("xuv", 600, 4096, 1024, 4096) is None  # nothing measured
  # a kernel 2 % behind XLA gains nothing: PARITY is XLA's own speed (session 14: such a
  # SwiGLU call cost the Llama-3-70B step 2.6 % at batch 8)
  monkeypatch.setattr(measured, "RECORDS", (("mlp_swiglu", 8, 8192, 3840, 28672, 215.0, 211.0),))
  why = measured.verdict("mlp_swiglu", 8, 8192, 3840, 28672)
  assert why is not None and "0.98x" in why


def test_the_nearest_shape_decides_before_the_nearest_token_count(monkeypatch):
  """Two SwiGLU shapes of one factor size (Qwen2.5-7B's and Llama-3-8B's): at a token count
  only the other one measured, the records of the shape nearest the call's decide (its own,
  or the Qwen model's rank 1792 near the 2048 benchmarked), M = 1 kept apart."""
  monkeypatch.setattr(measured, "MODEL_AB", ())
  monkeypatch.setattr(measured, "MODEL_OP_AB", ())
  monkeypatch.setattr(
    measured,
    "RECORDS",
    (
      ("mlp_swiglu", 1, 3584, 2048, 18944, 81.5, 134.4),  # 1.65x
      ("mlp_swiglu", 4, 3584, 2048, 18944, 84.7, 79.3),  # 0.94x
      ("mlp_swiglu", 16, 3584, 2048, 18944, 92.2, 83.8),  # 0.91x
      ("mlp_swiglu", 8, 4096, 2560, 14336, 85.7, 93.3),
    ),
  )  # 1.09x
  assert measured.nearest("mlp_swiglu", 8, 3584, 2048, 18944)[1:3] == (4, 3584)
  why = measured.verdict("mlp_swiglu", 8, 3584, 2048, 18944)
  assert why is not None and "D=3584" in why and "M=4, 16" in why
  assert measured.nearest("mlp_swiglu", 2, 3584, 2048, 18944)[1] == 4  # not its M=1
  assert measured.verdict("mlp_swiglu", 1, 3584, 2048, 18944) is None
  assert measured.verdict("mlp_swiglu", 8, 4096, 2560, 14336) is None
  assert measured.nearest("mlp_swiglu", 8, 3584, 1792, 18944)[1:3] == (4, 3584)
  assert "M=4, 16" in measured.verdict("mlp_swiglu", 8, 3584, 1792, 18944)
  assert measured.nearest("mlp_swiglu", 8, 4096, 1920, 14336)[1:3] == (8, 4096)


def test_calls_far_from_every_benchmarked_size_go_to_xla(monkeypatch):
  """No extrapolation beyond EXTRAPOLATE x in factor size (e.g. a TP-8 shard of q_proj)."""
  monkeypatch.setattr(
    measured,
    "RECORDS",
    (
      ("xuv", 1, 4096, 1024, 14336, 14.7, 26.1),  # 1.78x, 18.9M factor elements
      ("mlp_swiglu", 1, 2048, 1280, 8192, 35.1, 57.4),
    ),
  )
  assert measured.EXTRAPOLATE == 4.0
  assert measured.verdict("xuv", 1, 4096, 1216, 4096) is None  # 1.9x smaller: judged
  assert measured.verdict("xuv", 1, 4096, 608, 4096) is None  # 3.8x: still judged
  why = measured.verdict("xuv", 1, 4096, 152, 4096)  # 15.2x smaller
  assert why is not None and "within 4x" in why and "15.2x" in why and "prefer_kernels" in why
  assert measured.verdict("xuv", 1, 16384, 8192, 65536) is not None  # 32x larger
  why = measured.verdict("mlp_swiglu", 1, 896, 300, 4864)  # a 0.5B model's MLP: 7.6x
  assert why is not None and "D_ff=4864" in why


def test_one_row_is_judged_apart_from_wider_calls(monkeypatch):
  """XLA lowers M=1 with a multiply and a reduce, not a GEMM: no pooling across it."""
  monkeypatch.setattr(measured, "MODEL_AB", ())
  monkeypatch.setattr(measured, "MODEL_OP_AB", ())
  monkeypatch.setattr(
    measured,
    "RECORDS",
    (
      ("xuv", 1, 4096, 1024, 14336, 14.7, 26.1),  # 1.78x
      ("xuv", 2, 4096, 1024, 14336, 15.0, 14.0),  # 0.93x
      ("xuv", 4, 4096, 1024, 14336, 15.0, 14.1),  # 0.94x
      ("xuv", 8, 4096, 1024, 14336, 10.0, 9.6),
    ),
  )
  assert measured.verdict("xuv", 1, 4096, 1024, 14336) is None
  why = measured.verdict("xuv", 3, 4096, 1024, 14336)
  assert why is not None and "M=2, 4, 8" in why  # M=1 is not in M=4's window


def test_wide_xuv_records_pool_only_with_each_other(monkeypatch):
  """X·U·V from WIDE_M + 1 rows runs other tiles (64/128-row blocks, ·V by XLA's GEMM from 64
  rows): its records there are pooled, and a call there judged, only with each other; 4096->
  512->1024's 1.13 / 1.11x at 16 / 32 rows once kept it served at 65-90 rows, where its own
  records said 0.93 / 0.96x. Below WIDE_M + 1 rows, nothing changes. The MLP's records from
  MLP_COMPOSE_MIN_M rows (X·U·V decode calls, not the fused kernel) pool only with each
  other too: 80 rows follows 128's alone."""
  monkeypatch.setattr(measured, "MODEL_AB", ())
  monkeypatch.setattr(measured, "MODEL_OP_AB", ())
  recs = (
    ("xuv", 16, 4096, 512, 1024, 10.0, 11.3),
    ("xuv", 32, 4096, 512, 1024, 10.0, 11.1),
    ("xuv", 64, 4096, 512, 1024, 10.0, 9.3),
    ("xuv", 128, 4096, 512, 1024, 10.0, 9.6),
  )
  monkeypatch.setattr(measured, "RECORDS", recs + tuple(("mlp_swiglu",) + q[1:] for q in recs))
  for m in (8, 16, 24, 32):
    assert measured.verdict("xuv", m, 4096, 512, 1024) is None, m
  for m in (33, 40, 48, 80, 100, 128, 200):
    why = measured.verdict("xuv", m, 4096, 512, 1024)
    assert why is not None and ("M=64, 128" in why or "this very shape" in why), (m, why)
  assert measured.verdict("mlp_swiglu", 48, 4096, 512, 1024) is None  # pooled over 16-64
  why = measured.verdict("mlp_swiglu", 80, 4096, 512, 1024)
  assert why is not None and "M=128" in why, why
  assert [measured.path("xuv", m) for m in (1, 2, 32, 33, 128)] == [0, 1, 1, 2, 2]
  assert [measured.path("mlp_swiglu", m) for m in (1, 2, 33, 64, 65, 128)] == [0, 1, 1, 1, 2, 2]


def test_a_batch_whose_whole_step_was_slower_with_the_kernels_goes_to_xla(monkeypatch):
  """MODEL_AB: a call at M >= 2 follows the whole-model A/B at the nearest batch >= 2 (within
  WINDOW x), whatever its shape's own record says; M = 1 and far-off M keep the records.
  The A/B is that of the model whose hidden size is nearest the call's K."""
  monkeypatch.setattr(
    measured,
    "RECORDS",
    (
      ("xuv", 1, 4096, 1024, 14336, 10.0, 20.0),
      ("xuv", 8, 4096, 1024, 14336, 10.0, 12.0),
      ("xuv", 64, 4096, 1024, 14336, 10.0, 12.0),
      ("xuv", 1024, 4096, 1024, 14336, 10.0, 12.0),
    ),
  )
  monkeypatch.setattr(
    measured,
    "MODEL_AB",
    (
      ("8b", 4096, 1, 5.0, 9.0),
      ("8b", 4096, 8, 5.2, 4.8),
      ("8b", 4096, 32, 5.0, 5.5),
      ("70b", 8192, 8, 5.0, 5.5),
      ("70b", 8192, 16, 5.1, 5.0),
      ("70b", 8192, 64, 5.0, 4.0),
    ),
  )
  assert measured.verdict("xuv", 1, 4096, 1024, 14336) is None
  for m in (2, 4, 8, 16):  # nearest: batch 8 (16 is a tie between 8 and 32: the larger)
    why = measured.verdict("xuv", m, 4096, 1024, 14336)
    assert (why is None) == (m == 16), (m, why)
  why = measured.verdict("xuv", 8, 4096, 1024, 14336)
  assert "batch 8" in why and "5.20 ms" in why and "4.80 ms" in why and "prefer_kernels" in why
  assert measured.verdict("xuv", 64, 4096, 1024, 14336) is None  # batch 32: faster
  assert measured.verdict("xuv", 1024, 4096, 1024, 14336) is None  # beyond WINDOW x of 32
  # the 70B's A/B decides for calls nearer its hidden size (8192): faster at batch 8, slower
  # at 64; the 8B's batch-8 loss does not reach them
  assert measured.verdict("xuv", 8, 6144, 1024, 14336) is None
  why = measured.verdict("xuv", 64, 6144, 1024, 14336)
  assert "70b model (hidden size 8192) at batch 64" in why
  # a step 2 % slower declines (MODEL_PARITY 0.99: steps vary far less than calls alone)
  assert measured.MODEL_PARITY == 0.99
  assert "at batch 16" in measured.verdict("xuv", 16, 6144, 1024, 14336)
  assert "batch 8" in measured.verdict("xuv", 8, 5792, 1024, 14336)  # nearer 4096
  monkeypatch.setattr(measured, "MODEL_AB", (("8b", 4096, 1, 5.0, 9.0),))
  assert measured.verdict("xuv", 8, 4096, 1024, 14336) is None  # no A/B at 2 or more rows


def test_an_op_whose_kernel_slowed_the_step_goes_to_xla(monkeypatch):
  """MODEL_OP_AB: at M >= 2 an op's calls follow the step with every kernel against the step
  with every kernel but that op's, at the nearest batch of the model nearest in hidden size;
  other ops and M = 1 are not affected."""
  monkeypatch.setattr(measured, "MODEL_AB", ())
  monkeypatch.setattr(
    measured,
    "RECORDS",
    (
      ("mlp_swiglu", 1, 3584, 2048, 18944, 77.0, 134.0),
      ("mlp_swiglu", 4, 3584, 2048, 18944, 77.5, 80.2),
      ("xuv", 4, 3584, 1024, 3584, 10.0, 12.0),
    ),
  )
  monkeypatch.setattr(
    measured,
    "MODEL_OP_AB",
    (
      ("qwen", 3584, 4, "mlp_swiglu", 4.07, 3.96),
      ("qwen", 3584, 64, "mlp_swiglu", 6.70, 6.83),
      ("8b", 4096, 4, "mlp_swiglu", 4.39, 4.36),
    ),
  )
  why = measured.verdict("mlp_swiglu", 4, 3584, 2048, 18944)
  assert "qwen model (hidden size 3584) at batch 4" in why and "4.07 ms" in why, why
  assert "3.96 ms with all but mlp_swiglu's" in why and "prefer_kernels" in why
  assert measured.verdict("mlp_swiglu", 1, 3584, 2048, 18944) is None  # one row: its record
  assert measured.verdict("mlp_swiglu", 64, 3584, 2048, 18944) is None  # faster with it there
  assert measured.verdict("xuv", 4, 3584, 1024, 3584) is None  # another op's A/B
  # nearer the 8B's hidden size: its step was 0.7 % slower with the kernel, within
  # MODEL_PARITY, so the kernel stays
  assert measured.verdict("mlp_swiglu", 4, 4096, 2048, 18944) is None


def test_an_op_that_sped_the_step_is_served_where_every_kernel_together_lost(monkeypatch):
  """Where the step with every kernel lost to XLA's (MODEL_AB) but an op has its own A/B at
  that model and batch, the op's decides: the grouped kernel, whose step was slower without
  it, is served; an op without an A/B of its own follows MODEL_AB; the op's A/B at another
  model leaves MODEL_AB to decide."""
  monkeypatch.setattr(
    measured,
    "RECORDS",
    (("xuv_group", 8, 3584, 1024, 4608, 12.0, 20.0), ("xuv", 8, 3584, 1024, 3584, 10.0, 12.0)),
  )
  monkeypatch.setattr(
    measured, "MODEL_AB", (("qwen", 3584, 8, 4.30, 4.21), ("8b", 4096, 8, 4.80, 4.60))
  )
  monkeypatch.setattr(measured, "MODEL_OP_AB", (("qwen", 3584, 8, "xuv_group", 4.18, 4.32),))
  assert measured.verdict("xuv_group", 8, 3584, 1024, 4608) is None
  why = measured.verdict("xuv", 8, 3584, 1024, 3584)
  assert why is not None and "the kernels were slower (4.30 ms" in why, why
  why = measured.verdict("xuv_group", 8, 4096, 1024, 4608)  # the 8B's step: no own A/B there
  assert why is not None and "8b model" in why, why


def test_op_ab_pairs_only_adjacent_runs(tmp_path):
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
  assert measured.model_op_ab_from_results(str(path)) == (("m", 1024, 4, "mlp_swiglu", 4.1, 4.0),)


def _xuv_avals(m, k, r, n, dtype=jnp.bfloat16):
  return [jax.ShapeDtypeStruct(s, dtype) for s in ((m, k), (k, r), (r, n))]


def _window_ratio(rec):
  op, m, k, r, n = rec[:5]
  return statistics.median(
    q[6] / q[5]
    for q in measured.RECORDS
    if q[0] == op
    and q[2:5] == (k, r, n)
    and m / measured.WINDOW <= q[1] <= measured.WINDOW * m
    and measured.path(op, q[1]) == measured.path(op, m)
  )


def test_lowering_policy_follows_every_measured_record():
  """Each benchmarked shape and token count is served only where its own record and its
  neighbours' median reach PARITY."""
  for rec in measured.RECORDS:
    op, m, k, r, n = rec[:5]
    if op == "xuv":
      why = lowering.xuv_faster(_xuv_avals(m, k, r, n), {})
    elif op == "xuv_group":  # summed ranks and widths
      why = measured.verdict(op, m, k, r, n)
    else:
      a = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
      avals = [a(m, k), a(k, r), a(r, n), a(k, r), a(r, n), a(n, r), a(r, k)]
      params = dict(gated=True, bias_mask=(False, False, False))
      why = lowering.mlp_faster(avals, params)
    serves = (
      _window_ratio(rec) >= measured.PARITY
      and rec[6] / rec[5] >= measured.PARITY
      and measured._model_verdict(m, k, op) is None
    )
    assert (why is None) == serves, (rec, why)


def test_every_triton_kernel_has_the_speed_check():
  assert all(k.faster is not None for k in lowering.KERNELS)


def test_grouped_kernel_verdicts(monkeypatch):
  """q/k/v in one launch measured 1.55-3.6x XLA's merged dots: served at the benchmarked
  groups of the 8B and 1B shapes; a whole-model loss (measured with q/k/v grouped) declines
  it like any call; a group far smaller than any benchmarked one goes to XLA."""
  assert measured.verdict("xuv_group", 8, 4096, 2240, 6144) is None
  assert measured.verdict("xuv_group", 1, 2048, 1152, 3072) is None
  monkeypatch.setattr(measured, "MODEL_AB", (("8b", 4096, 8, 5.2, 4.7),))
  assert "decode step of the 8b model" in measured.verdict("xuv_group", 8, 4096, 2240, 6144)
  assert measured.verdict("xuv_group", 1, 4096, 2240, 6144) is None  # one row: its record
  monkeypatch.setattr(measured, "MODEL_AB", ())
  monkeypatch.setattr(measured, "MODEL_OP_AB", ())
  tiny = measured.verdict("xuv_group", 8, 512, 48, 192)
  assert tiny is not None and "no benchmarked xuv_group shape" in tiny


def test_model_ab_leaves_out_runs_with_only_some_kernels(tmp_path):
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
  assert measured.model_ab_from_results(str(path)) == (("70b", 8192, 4, 2.9, 3.0),)


def test_model_ab_leaves_out_steps_with_the_scratch_chain_off(tmp_path):
  """Steps timed with LRJAX_TRITON_SCRATCH_CHAIN=0 (scratch_chain False) are not the default
  lowering: neither MODEL_AB nor MODEL_OP_AB reads them."""
  base = dict(strategy="lowrank_tp", tp=1, group=True, model="m", batch=4)
  recs = [
    dict(base, run=1, step_ms=4.0, fuse=False),
    dict(base, run=2, step_ms=3.0, fuse=True, kernels=["xuv", "xuv_group"]),
    dict(base, run=3, step_ms=3.5, fuse=True, scratch_chain=False),
    dict(base, run=4, step_ms=3.9, fuse=True),
  ]
  path = tmp_path / "steps.json"
  path.write_text(json.dumps(dict(records=recs, models={"m": {"hidden_size": 1024}})))
  assert measured.model_ab_from_results(str(path)) == (("m", 1024, 4, 3.9, 4.0),)
  assert measured.model_op_ab_from_results(str(path)) == ()
  recs[2]["run"], recs[3]["run"] = 5, 3  # the chained step follows the --kernels run: a pair
  path.write_text(json.dumps(dict(records=recs, models={"m": {"hidden_size": 1024}})))
  assert measured.model_op_ab_from_results(str(path)) == (("m", 1024, 4, "mlp_swiglu", 3.9, 3.0),)


def test_model_ab_reads_only_steps_under_the_default_launchers(tmp_path):
  """A step timed under lrjax's own launcher (``lrjax``, ``pdl``) is an A/B of the launch, not
  of the kernels: MODEL_AB reads steps under planner.MODEL_AB_LAUNCHES alone, XLA's Triton call
  (the default), its PTX call and jaxlib's (defaults before; a record without
  ``triton_launch`` ran under jaxlib's)."""
  assert planner.DEFAULT_LAUNCH in planner.MODEL_AB_LAUNCHES
  base = dict(strategy="lowrank_tp", tp=1, group=True, model="m", batch=4)
  recs = [
    dict(base, run=1, step_ms=4.0, fuse=False),
    dict(base, run=2, step_ms=3.9, fuse=True),
    dict(base, run=3, step_ms=3.5, fuse=True, triton_launch="pdl"),
  ]
  path = tmp_path / "steps.json"
  path.write_text(json.dumps(dict(records=recs, models={"m": {"hidden_size": 1024}})))
  assert measured.model_ab_from_results(str(path)) == (("m", 1024, 4, 3.9, 4.0),)
  recs[2]["triton_launch"] = "xla"  # the last of the repeated runs
  path.write_text(json.dumps(dict(records=recs, models={"m": {"hidden_size": 1024}})))
  assert measured.model_ab_from_results(str(path)) == (("m", 1024, 4, 3.5, 4.0),)
