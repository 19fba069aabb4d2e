"""CPU tests of benchmarks/mlp_trace.py: its case syntax (shared with decode_trace.py), the
stages it reads from a launch plan, and its per-stage summary of a synthetic trace (the GPU
run itself needs a GPU)."""

import importlib.util
import textwrap

import pytest
from triton_offline import STUB, run_script

pytestmark = pytest.mark.skipif(
  importlib.util.find_spec("triton") is None,
  reason="needs triton (pip install 'lrjax[cuda]') for the SwiGLU kernel's launch plan",
)

_SCRIPT = STUB + textwrap.dedent("""
  import numpy as np
  import mlp_trace
  from lrjax.custom_calls.triton import mlp_decode

  def refused(parse, bad, says):  # parse(bad) exits naming what it expected
    try:
      parse(bad)
    except SystemExit as e:
      assert says in str(e), (bad, e)
    else:
      raise AssertionError(f"{bad} was accepted")

  dims, over = mlp_trace.parse_case("4,2048,1280,8192:prefetch=128,park_h=0")
  assert dims == (4, 2048, 1280, 8192) and over == {"prefetch": 128, "park_h": False}, over
  for bad, says in (("1,2,3", "T,D,r,F"), ("1,2,3,0", "T,D,r,F"), ("1,x,3,4", "T,D,r,F"),
                    ("1,2,3,4:foo=1", "foo"), ("1,2,3,4:prefetch=big", "not an integer")):
    refused(mlp_trace.parse_case, bad, says)
  # benchmarks/decode_trace.py's cases, the same syntax over the persistent X·U·V plan
  import decode_trace
  dims, over = decode_trace.parse_case("1,4096,1024,14336:k_per=128")
  assert dims == (1, 4096, 1024, 14336) and over == {"k_per": 128}, over
  for bad, says in (("1,2,3", "M,K,r,N"), ("1,2,3,4:block_f=64", "PersistentDecodePlan")):
    refused(decode_trace.parse_case, bad, says)
  # the scripts' shared record tail: kept whole, printed without the bulky fields
  import contextlib, io, json
  recs, buf = [], io.StringIO()
  with contextlib.redirect_stdout(buf):
    decode_trace.report(recs, {"case": "c", "per_call_us": 1.5, "ctas": [[0.0]]}, ("ctas",))
  assert recs == [{"case": "c", "per_call_us": 1.5, "ctas": [[0.0]]}], recs
  assert json.loads(buf.getvalue()) == {"case": "c", "per_call_us": 1.5}, buf.getvalue()

  kw = dict(gated=True, act="silu", bias_mask=(False,) * 3)
  for m, d, r, f in ((1, 2048, 1280, 8192), (4, 4096, 1024, 14336)):
    bs = mlp_decode.BlockSizes.get_default(m, d, f, r, d)
    plan = mlp_decode.launch_plan(m, d, r, f, r, d, bs=bs, **kw)
    b = mlp_trace.stage_bounds(plan["meta"], plan["grid"])
    edges = [b["A"][0], b["A"][1], b["B"][1], b["H"][1], b["C"][1]]
    assert edges[0] == 0 and edges[-1] == plan["grid"] and edges == sorted(edges), b
    assert b["B"][0] == b["A"][1] and b["H"][0] == b["B"][1] and b["C"][0] == b["H"][1], b
    assert (b["H"][1] > b["H"][0]) == bs.park_h, (b, bs.park_h)  # stage H only with h parked

  # 4 calls 10 us apart; stage A on CTAs 0-1, B on 2-3, C on 4; 0 = no such stamp
  us = 1000
  one = np.array([[0, 0, 0, 2, 2.5], [0, 0, 0, 2.5, 3],  # entry, wait1, wait, work, exit
                  [0, 2, 3, 6, 6.5], [0, 2.5, 3.5, 7, 7.5],
                  [0.1, 7.2, 7.2, 8, 8.5]]) * us
  tr = np.zeros((4, 5, 8), np.int64)
  for i in range(4):
    t0 = 10**9 + i * 10 * us
    tr[i, :, :5] = np.where(one > 0, t0 + one, 0)
    tr[i, :, 0] = t0 + one[:, 0]
  got = mlp_trace.summarize(tr, dict(A=(0, 2), B=(2, 4), H=(4, 4), C=(4, 5)))
  want = dict(period=10, exit=8.5, gap=1.5, A_enter_first=0, A_enter_last=0, A_work_med=2.25,
              A_work_last=2.5, B_enter_first=0, B_enter_last=0, B_wait1_med=2.25,
              B_wait1_last=2.5, B_wait_med=3.25, B_wait_last=3.5, B_work_med=6.5,
              B_work_last=7, C_enter_first=0.1, C_enter_last=0.1, C_wait1_med=7.2,
              C_wait1_last=7.2, C_wait_med=7.2, C_wait_last=7.2, C_work_med=8, C_work_last=8)
  assert got == want, got
  import decode_trace
  ctas = decode_trace.cta_stamps(tr, 1, 5, mlp_trace.SLOTS)  # µs from the call's first entry
  assert ctas["work"] == [2, 2.5, 6, 7, 8] and ctas["wait1"][:2] == [None, None], ctas
  assert ctas["entry"] == [0, 0, 0, 0, 0.1] and ctas["sm"] == [0] * 5, ctas
  print("ok")
""")


def test_cases_stages_and_summary():
  run_script(_SCRIPT, interpret=False)
