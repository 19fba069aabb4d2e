"""Corrupt or edited checkpoints fail with one line naming the array and the file.

lrjax checkpoints record each array's sha256, shape and dtype; exports record each tensor's
sha256; HF index entries must stay inside the checkpoint directory.
"""

import gc
import json
import os
import shutil

import numpy as np
import pytest
from ckpt_helpers import bit_equal, copy_fixture, data_files, index_files, random_model
from safetensors.numpy import load_file, save_file

from lrjax import checkpoint, cli
from lrjax.checkpoint import METADATA_NAME, read_header
from lrjax.models import from_hf


# A failed orbax restore leaves un-awaited read coroutines behind; they are collected (and
# reported by pytest as unraisable) when this module ends rather than in some later test.
pytestmark = [
  pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
  pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning"),
]


@pytest.fixture(autouse=True, scope="module")
def _collect_orbax_leftovers():
  yield
  gc.collect()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
  d = tmp_path_factory.mktemp("pristine")
  m = random_model()
  checkpoint.save(m, d / "ck")
  return d / "ck", m


@pytest.fixture
def ck(tmp_path, pristine):
  src, m = pristine
  shutil.copytree(src, tmp_path / "ck")
  return tmp_path / "ck", m


def _edit_meta(ck_dir, fn):
  p = ck_dir / METADATA_NAME
  meta = json.loads(p.read_text())
  fn(meta)
  p.write_text(json.dumps(meta))


def _one_line(e) -> str:
  s = str(e)
  assert "\n" not in s.strip(), s
  return s


def test_metadata_records_sha256_shape_dtype(ck):
  d, m = ck
  meta = checkpoint.read_metadata(d)
  assert meta["format_version"] == 2
  for info in meta["params"].values():
    assert len(info["sha256"]) == 64 and info["dtype"] == "float32" and info["shape"]
  q = next(k for k in meta["params"] if k.endswith("q_proj.kernel"))
  assert meta["params"][q]["sha256"] == checkpoint.array_sha256(m.layers[0].attn.q_proj.kernel[...])


def test_flipped_bytes_are_detected_or_harmless(tmp_path, ck):
  """Every single-byte flip in the array data either fails to load, naming an array, or loads
  bit-identical weights (a byte orbax never decodes). Unverified, some flips change weights."""
  d, m = ck
  f = data_files(d)[0]
  size = os.path.getsize(f)
  detected = 0
  for i in np.linspace(0, size - 1, 12).astype(int):
    work = tmp_path / f"flip{i}"
    shutil.copytree(d, work)
    wf = work / os.path.relpath(f, d)
    data = bytearray(wf.read_bytes())
    data[i] ^= 0x5A
    wf.write_bytes(bytes(data))
    try:
      back = checkpoint.load(work)
    except ValueError as e:
      msg = _one_line(e)
      assert "array '" in msg and "corrupt" in msg, msg
      detected += 1
      continue
    assert bit_equal(back, m), f"flip at byte {i} of {size} loaded different weights"
  assert detected >= 6


def test_truncated_data_file_is_detected(ck):
  d, _ = ck
  for f in data_files(d):  # every one: a file's tail may hold no array the load reads
    data = open(f, "rb").read()
    open(f, "wb").write(data[: len(data) // 2])
  with pytest.raises(ValueError, match=r"array '[\w.]+' .*corrupt") as e:
    checkpoint.load(d)
  assert str(d / "state") in _one_line(e.value)


def test_damaged_orbax_index_is_detected(tmp_path, ck):
  d, m = ck
  for i, f in enumerate(index_files(d)):
    work = tmp_path / f"idx{i}"
    shutil.copytree(d, work)
    wf = work / os.path.relpath(f, d)
    wf.write_bytes(wf.read_bytes()[: os.path.getsize(wf) // 2])
    try:
      back = checkpoint.load(work)
    except (ValueError, FileNotFoundError) as e:
      assert str(work) in _one_line(e) and ("corrupt" in str(e) or "incomplete" in str(e)), e
      continue
    assert bit_equal(back, m), f  # a file orbax does not need to read this checkpoint


def test_edited_dtype_or_shape_is_detected(ck):
  d, _ = ck
  _edit_meta(d, lambda m: m["params"]["layers.0.attn.q_proj.kernel"].update(dtype="int32"))
  with pytest.raises(
    ValueError,
    match=r"lrjax_metadata.json: param 'layers.0.attn.q_proj.kernel' is recorded as "
    r"int32\[16, 16\] but state/ holds float32\[16, 16\]",
  ) as e:
    checkpoint.load(d)
  _one_line(e.value)
  _edit_meta(d, lambda m: m["params"]["layers.0.attn.q_proj.kernel"].update(dtype="float32"))
  _edit_meta(d, lambda m: m["params"]["norm.weight"].update(shape=[17]))
  with pytest.raises(ValueError, match=r"param norm.weight has shape \[17\]"):
    checkpoint.load(d)


def test_edited_checksum_fails_unless_verify_is_off(ck, tmp_path, capsys):
  d, m = ck
  _edit_meta(d, lambda meta: meta["params"]["embed.embedding"].update(sha256="0" * 64))
  with pytest.raises(ValueError, match=r"array 'embed.embedding' fails its sha256 check") as e:
    checkpoint.load(d)
  assert str(d) in _one_line(e.value)
  assert bit_equal(checkpoint.load(d, verify=False), m)
  rc = cli.main(["export", "--ckpt", str(d), "--out", str(tmp_path / "ex")])
  err = capsys.readouterr().err
  assert rc == 1 and "fails its sha256 check" in err and len(err.strip().splitlines()) == 1
  assert not (tmp_path / "ex").exists()
  assert cli.main(["export", "--ckpt", str(d), "--out", str(tmp_path / "ex"), "--no-verify"]) == 0
  assert bit_equal(checkpoint.load_hf(tmp_path / "ex"), m)


@pytest.mark.parametrize(
  "text,match",
  [
    ('{"format": "lrjax-orb', "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ("\xff\xfe", "not valid JSON"),
  ],
)
def test_malformed_metadata_json(ck, text, match):
  d, _ = ck
  (d / METADATA_NAME).write_bytes(text.encode("latin-1"))
  with pytest.raises(ValueError, match=match) as e:
    checkpoint.load(d)
  assert str(d / METADATA_NAME) in _one_line(e.value)


@pytest.mark.parametrize(
  "edit,match",
  [
    (lambda m: m.pop("params"), "missing key 'params'"),
    (lambda m: m.pop("config"), "missing key 'config'"),
    (lambda m: m.update(config=[]), "'config' must be an object"),
    (lambda m: m["config"].update(hidden_size="16"), "'config': hidden_size='16' must be"),
    (lambda m: m["config"].update(rms_norm_eps=-1.0), "rms_norm_eps=-1.0 must be"),
    (lambda m: m["config"].update(bogus=1), r"unknown ModelConfig fields \['bogus'\]"),
    (lambda m: m.update(ranks=5), "'ranks' must be a list of 1 per-layer objects"),
    (lambda m: m.update(ranks=[{"q_proj": 2.5}]), r"ranks\[0\] must map projection names"),
    (lambda m: m.update(heads="x"), "'heads' must be a list"),
    (lambda m: m.update(params=[]), "'params' must be an object"),
    (lambda m: m["params"].update({"norm.weight": 3}), "params entry 'norm.weight' must be"),
    (lambda m: m["params"]["norm.weight"].update(shape="16"), "param 'norm.weight' has shape"),
    (lambda m: m["params"]["norm.weight"].update(dtype="flaot32"), "has dtype 'flaot32'"),
    (lambda m: m["params"]["norm.weight"].update(axes=3), "has axes 3"),
    (lambda m: m["params"]["norm.weight"].pop("sha256"), "has sha256 None"),
    (lambda m: m.update(format_version="2"), "version='2' is not readable"),
    (lambda m: m.update(format_version=True), "version=True is not readable"),
    (lambda m: m.update(compression=[1]), "'compression' must be an object or null"),
    (lambda m: m.update(source_digest=1), "'source_digest' must be a string or null"),
  ],
)
def test_metadata_with_wrong_types_or_missing_keys(ck, edit, match):
  d, _ = ck
  _edit_meta(d, edit)
  with pytest.raises(ValueError, match=match) as e:
    checkpoint.load(d)
  assert str(d / METADATA_NAME) in _one_line(e.value)


def test_missing_state_dir(ck):
  d, _ = ck
  shutil.rmtree(d / "state")
  with pytest.raises(FileNotFoundError, match="state does not exist; the checkpoint is incomplete"):
    checkpoint.load(d)


# ---- HF directories: index confinement, config.json, export checksums ------------------------
def _edit_index(d, fn):
  p = d / "model.safetensors.index.json"
  idx = json.loads(p.read_text())
  fn(idx["weight_map"])
  p.write_text(json.dumps(idx))


def _first_shard(d):
  return sorted(p for p in os.listdir(d) if p.startswith("model-"))[0]


def test_index_entries_outside_the_directory_are_refused(tmp_path):
  d = copy_fixture(tmp_path, "llama3")
  shard = _first_shard(d)
  outside = tmp_path / "x.safetensors"
  shutil.copy(d / shard, outside)  # a perfectly valid shard, but outside the checkpoint

  cur = [shard]

  def point_to(target):
    _edit_index(d, lambda wm: wm.update({k: target for k, v in wm.items() if v == cur[0]}))
    cur[0] = target

  point_to("../x.safetensors")
  with pytest.raises(ValueError, match=r"'\.\./x\.safetensors' is not a relative path inside"):
    from_hf(d)
  point_to(str(outside))
  with pytest.raises(ValueError, match="is not a relative path inside the checkpoint directory"):
    from_hf(d)
  point_to("/etc/passwd")
  with pytest.raises(ValueError, match="'/etc/passwd' is not a relative path inside"):
    from_hf(d)
  (d / "link.safetensors").symlink_to(outside)
  point_to("link.safetensors")
  with pytest.raises(ValueError, match=r"'link.safetensors' resolves to .*x\.safetensors, outside"):
    from_hf(d)
  os.remove(d / "model.safetensors.index.json")
  os.remove(d / "link.safetensors")
  (d / "model.safetensors").symlink_to(outside)
  with pytest.raises(ValueError, match="'model.safetensors' resolves to .* outside"):
    from_hf(d)


def test_hub_cache_snapshot_links_are_allowed(tmp_path):
  """The Hugging Face hub cache links snapshot files to ``../../blobs/<hash>``: that loads."""
  src = copy_fixture(tmp_path, "llama3")
  repo = tmp_path / "models--t--tiny"
  snap = repo / "snapshots" / "abc123"
  (repo / "blobs").mkdir(parents=True)
  snap.mkdir(parents=True)
  for i, f in enumerate(sorted(os.listdir(src))):
    shutil.copy(src / f, repo / "blobs" / f"blob{i}")
    (snap / f).symlink_to(f"../../blobs/blob{i}")
  assert bit_equal(from_hf(snap), from_hf(src))


def test_config_json_errors_name_the_file(tmp_path):
  d = copy_fixture(tmp_path, "qwen3")
  cfg = d / "config.json"
  text = cfg.read_text()
  cfg.write_text(text[: len(text) // 2])
  with pytest.raises(ValueError, match=r"config.json: not valid JSON") as e:
    from_hf(d)
  assert str(cfg) in _one_line(e.value)
  cfg.write_text("[]")
  with pytest.raises(ValueError, match="config.json: expected a JSON object, got list"):
    from_hf(d)
  c = json.loads(text)
  c["rms_norm_eps"] = -1e-6
  cfg.write_text(json.dumps(c))
  with pytest.raises(ValueError, match=r"config.json: config.json key 'rms_norm_eps'=-1e-06"):
    from_hf(d)
  c["rms_norm_eps"], c["torch_dtype"], c["dtype"] = 1e-6, ["float32"], None
  cfg.write_text(json.dumps(c))
  with pytest.raises(ValueError, match=r"config.json: dtype \['float32'\] is not supported"):
    from_hf(d)


def test_malformed_safetensors_headers(tmp_path):
  d = copy_fixture(tmp_path, "qwen3")
  f = d / "model.safetensors"
  data = f.read_bytes()
  n = int.from_bytes(data[:8], "little")
  header = json.loads(data[8 : 8 + n])
  for bad in (
    [],
    {"model.norm.weight": 5},
    {"model.norm.weight": {"dtype": "F32", "shape": [64.5], "data_offsets": [0, 256]}},
    {"model.norm.weight": {"dtype": "F32", "shape": [64], "data_offsets": [256, 0]}},
  ):
    blob = json.dumps(bad).encode()
    f.write_bytes(len(blob).to_bytes(8, "little") + blob + data[8 + n :])
    with pytest.raises(ValueError, match=r"model.safetensors: header") as e:
      read_header(str(f))
    _one_line(e.value)
  assert header  # the fixture header itself parses


def test_export_checksums_catch_a_flipped_tensor_byte(tmp_path):
  m = random_model()
  checkpoint.export_hf(m, tmp_path / "ex")
  rec = checkpoint.read_export_record(tmp_path / "ex")
  assert set(rec["tensors"]) == set(read_header(str(tmp_path / "ex" / "model.safetensors")))
  f = tmp_path / "ex" / "model.safetensors"
  t = load_file(str(f))
  t["model.layers.0.mlp.up_proj.weight"][3, 4] += 1.0
  save_file(t, str(f), metadata={"format": "pt"})
  with pytest.raises(
    ValueError,
    match=r"ex/model.safetensors: tensor 'model.layers.0.mlp.up_proj.weight' fails its sha256",
  ):
    checkpoint.load_hf(tmp_path / "ex")
  back = checkpoint.load_hf(tmp_path / "ex", verify=False)
  assert not bit_equal(back, m)
  (tmp_path / "ex" / checkpoint.EXPORT_NAME).write_text("{")
  with pytest.raises(ValueError, match="lrjax_export.json: not valid JSON"):
    checkpoint.load_hf(tmp_path / "ex")
