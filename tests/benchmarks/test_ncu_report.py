"""CPU test of benchmarks/ncu_mlp_decode.py's reading of ncu text reports."""
import pytest

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
def ncu(load_benchmark):
  return load_benchmark("ncu_mlp_decode")


def test_rows_with_and_without_units(ncu):
  got = ncu.parse(REPORT)
  assert got == {"lts__t_sectors_op_red.sum [sector]": 1033091.0, "Duration [us]": 95.17,
                 "Local Memory Spilling Requests": 0.0, "Block Size": 128.0}


def test_text_without_metrics_is_refused(ncu):
  with pytest.raises(ValueError, match="no ncu metric rows"):
    ncu.parse("==PROF== Disconnected from process 683\n")
