"""CPU tests of benchmarks/results_io.py: a results file is written whole or not at all."""

import json

import pytest


@pytest.fixture(scope="module")
def rio(load_benchmark):
  return load_benchmark("results_io")


def test_writes_the_file_and_its_folder(rio, tmp_path):
  path = tmp_path / "new" / "r.json"
  rio.write_json(str(path), dict(meta=dict(a=1), records=[1.5]))
  assert json.loads(path.read_text()) == dict(meta=dict(a=1), records=[1.5])
  assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temporary left


def test_a_failed_write_keeps_the_previous_file_and_no_temporary(rio, tmp_path):
  path = tmp_path / "r.json"
  rio.write_json(str(path), dict(records=[1]))
  with pytest.raises(TypeError):
    rio.write_json(str(path), dict(records=[object()]))  # not JSON: fails mid-write
  assert json.loads(path.read_text()) == dict(records=[1])
  assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_non_finite_numbers_are_written_as_null(rio, tmp_path):
  path = tmp_path / "r.json"
  rio.write_json(str(path), dict(records=[dict(us=-1.5, spread=float("inf")), (float("nan"), 2.0)]))
  text = path.read_text()
  assert "Infinity" not in text and "NaN" not in text
  assert json.loads(text) == dict(records=[dict(us=-1.5, spread=None), [None, 2.0]])


def test_rooflines_by_card(rio):
  assert rio.hbm_bps("NVIDIA H100 80GB HBM3") == 3.35e12
  assert rio.hbm_bps("NVIDIA H200") == 4.3e12
  assert rio.hbm_bps("NVIDIA H100 PCIe") is None  # another H100, another rate
  assert rio.hbm_bps("cpu") is None
  assert rio.roofline_bps("NVIDIA A100-SXM4-80GB") == rio.HBM_BPS["H200"]
