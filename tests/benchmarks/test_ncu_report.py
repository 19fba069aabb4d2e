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
  assert got == {
    "lts__t_sectors_op_red.sum [sector]": 1033091.0,
    "Duration [us]": 95.17,
    "Local Memory Spilling Requests": 0.0,
    "Block Size": 128.0,
  }


def test_text_without_metrics_is_refused(ncu):
  with pytest.raises(ValueError, match="no ncu metric rows"):
    ncu.parse("==PROF== Disconnected from process 683\n")


# two profiled calls of two kernels each, as ncu_xuv_decode.py's child launches them
TWO_CALLS = "".join(
  f"""  {name} ({grid}, 1, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    Duration                         us        {us}
    DRAM Throughput                   %        {dram}
"""
  for name, grid, us, dram in (
    ("_xuv_decode_persistent_kernel", 132, "21.40", "55.1"),
    ("gemm_fusion_dot", 256, "16.10", "61.0"),
    ("_xuv_decode_persistent_kernel", 132, "21.30", "55.3"),
    ("gemm_fusion_dot", 256, "16.00", "61.2"),
  )
)


@pytest.fixture(scope="module")
def ncu_xuv(load_benchmark):
  return load_benchmark("ncu_xuv_decode")


def test_every_kernel_of_a_report_and_the_last_calls(ncu_xuv):
  import ncu_report

  got = ncu_report.parse_kernels(TWO_CALLS)
  assert [k["kernel"] for k in got] == ["_xuv_decode_persistent_kernel", "gemm_fusion_dot"] * 2
  assert got[1] == {
    "kernel": "gemm_fusion_dot",
    "grid": [256, 1, 1],
    "block": [128, 1, 1],
    "Duration [us]": 16.1,
    "DRAM Throughput [%]": 61.0,
  }
  last = ncu_xuv.last_call(got, calls=2)
  assert [(k["kernel"], k["Duration [us]"]) for k in last] == [
    ("_xuv_decode_persistent_kernel", 21.3),
    ("gemm_fusion_dot", 16.0),
  ]
  with pytest.raises(ValueError, match="do not split into 3 equal calls"):
    ncu_xuv.last_call(got, calls=3)
  with pytest.raises(ValueError, match="launched different kernels"):
    ncu_xuv.last_call([got[0], got[1], got[1], got[0]], calls=2)


def test_saved_reports_become_one_record_a_kernel_of_the_last_call(ncu_xuv, tmp_path):
  import json

  report = tmp_path / "auto.txt"
  report.write_text(TWO_CALLS)
  out = tmp_path / "ncu.json"
  ncu_xuv.main(
    ["--parse", f"64,8192,2456,8192|auto={report}", "--out", str(out), "--note", "synthetic"]
  )
  got = json.loads(out.read_text())
  assert got["meta"]["note"] == "synthetic" and got["meta"]["calls"] == 2
  assert [
    (r["variant"], r["M"], r["r"], r["kernel"], r["Duration [us]"]) for r in got["records"]
  ] == [
    ("auto", 64, 2456, "_xuv_decode_persistent_kernel", 21.3),
    ("auto", 64, 2456, "gemm_fusion_dot", 16.0),
  ]


@pytest.mark.parametrize(
  "argv,msg",
  [
    (["--parse", "64,8192,2456,8192|auto"], "expected M,K,r,N|variant=FILE"),
    (["--parse", "64,8192,2456,8192|xla,,auto=r.txt"], "one variant"),
    (["64,8192|auto"], "expected M,K,r,N|variant"),
    ([], "expected at least one case"),
  ],
)
def test_bad_arguments_are_refused_by_name(ncu_xuv, capsys, argv, msg):
  with pytest.raises(SystemExit):
    ncu_xuv.main(argv + ["--out", "unused.json"])
  assert msg in capsys.readouterr().err
