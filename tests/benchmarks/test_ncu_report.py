"""CPU test of benchmarks/ncu_mlp_decode.py's reading of ncu text reports."""
import importlib.util
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPORT = """==PROF== Profiling "_mlp_decode_kernel": 0%....50%....100% - 19 passes
  _mlp_decode_kernel (400, 1, 1)x(128, 1, 1), Context 1, Stream 14, Device 0, CC 9.0
    Section: Command line profiler metrics
    --------------------------------------------------- ----------- ------------
    Metric Name                                         Metric Unit Metric Value
    --------------------------------------------------- ----------- ------------
    lts__t_sectors_op_red.sum                                sector    1,033,091
    Duration                         us        95.17
    Local Memory Spilling Requests                                0
    Block Size                                                     128
    OPT   Memory is more heavily utilized than Compute: Look at the Memory Workload Analysis
"""


@pytest.fixture(scope="module")
def ncu():
  spec = importlib.util.spec_from_file_location(
      "ncu_mlp_decode", os.path.join(REPO, "benchmarks", "ncu_mlp_decode.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_rows_with_and_without_units(ncu):
  got = ncu.parse(REPORT)
  assert got == {"lts__t_sectors_op_red.sum [sector]": 1033091.0, "Duration [us]": 95.17,
                 "Local Memory Spilling Requests": 0.0, "Block Size": 128.0}


def test_text_without_metrics_is_refused(ncu):
  with pytest.raises(ValueError, match="no ncu metric rows"):
    ncu.parse("==PROF== Disconnected from process 683\n")
