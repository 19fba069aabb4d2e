"""CPU tests of benchmarks/decode_trace.py's per-call summary of a synthetic trace, with and
without phase 2 (``--phase1``), and its command line (the GPU run itself needs a GPU)."""

import numpy as np
import pytest


@pytest.fixture(scope="module")
def dt(load_benchmark):
  return load_benchmark("decode_trace")


def _trace(one, calls=4, period_us=10):
  """[calls, CTAs, 8] int64 ns stamps: ``one`` (µs from the call's start, 0 = no stamp) for
  every call, ``period_us`` apart."""
  tr = np.zeros((calls, len(one), 8), np.int64)
  for i in range(calls):
    t0 = 10**9 + i * period_us * 1000
    tr[i, :, :5] = np.where(one > 0, t0 + one * 1000, 0)
    tr[i, :, 0] = t0 + one[:, 0] * 1000
  return tr


def test_the_summary_reads_both_phases(dt):
  # entry, phase-1 end, wait end, phase-2 end, exit; CTAs 0-1 ran phase-1 tiles
  one = np.array([[0, 3, 4, 7, 7.5], [0.2, 4, 4.5, 8, 8.5], [0.4, 0.4, 4.5, 9, 9.5]])
  got = dt.summarize(_trace(one), 3, 2)
  assert got == dict(
    period=10,
    enter=0.4,
    p1_med=3.5,
    p1_end=4,
    wait_first=4,
    wait_med=4.5,
    wait_last=4.5,
    p2_med=8,
    p2_end=9,
    exit=9.5,
    gap=0.5,
  ), got


def test_phase1_alone_has_no_wait_or_phase2(dt):
  # phase 1 alone (pv="xla"): no wait or phase-2 stamps (slot 2 never written)
  one = np.array([[0, 3, 0, 3.2, 3.5], [0.2, 4, 0, 4.1, 4.5]])
  got = dt.summarize(_trace(one), 2, 2, pv=False)
  assert got == dict(period=10, enter=0.2, p1_med=3.5, p1_end=4, exit=4.5, gap=5.5), got


def test_phase1_is_a_flag_of_decode_trace_alone(dt):
  args, cases = dt.cli(
    "M,K,r,N", phase1=True, argv=["--out", "o.json", "--case", "128,2048,256,512", "--phase1"]
  )
  assert args.phase1 and cases == [((128, 2048, 256, 512), {})]
  args, _ = dt.cli("M,K,r,N", phase1=True, argv=["--out", "o.json", "--case", "1,2,3,4"])
  assert not args.phase1
  with pytest.raises(SystemExit):  # mlp_trace's command line has no --phase1
    dt.cli("T,D,r,F", argv=["--out", "o.json", "--case", "1,2,3,4", "--phase1"])
