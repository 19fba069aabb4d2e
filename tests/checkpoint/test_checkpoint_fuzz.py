"""Property fuzzers over checkpoint inputs (hypothesis, derandomized, offline, bounded).

1. ``lrjax convert`` (in-process) over mutated HF directories: bad or mutated config.json
   (bytes and fields), truncated or byte-mutated safetensors, edited headers, bad index files,
   edited export records, missing files. Property: exit 0 with a loadable checkpoint at
   ``--out``, or a non-zero exit with exactly one error line on stderr, no traceback and
   nothing at ``--out`` (no temporaries or lock files either).
2. ``lrjax.checkpoint.load`` over a saved tiny low-rank checkpoint with flipped, truncated or
   deleted bytes in any of its files. Property: a one-line ``ValueError``/``FileNotFoundError``
   naming the checkpoint, or weights bit-identical to the saved ones.

Each runs ``LRJAX_FUZZ_CASES`` (default 1000) generated cases; the end-of-run summary prints
the case and crash counts (``tests/conftest.py``).
"""

import contextlib
import gc
import io
import json
import os
import shutil
import struct
import tempfile
import traceback
from pathlib import Path

import pytest
from ckpt_helpers import TINY, random_model, weights
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lrjax import checkpoint, cli
from lrjax.checkpoint import EXPORT_NAME, atomic

CASES = int(os.environ.get("LRJAX_FUZZ_CASES", "1000"))
SETTINGS = settings(
  max_examples=CASES,
  derandomize=True,  # the same cases on every run and machine
  deadline=None,
  database=None,
  suppress_health_check=list(HealthCheck),
  print_blob=False,
)
DELETE = object()

# A failed orbax restore leaves un-awaited read coroutines behind; collected at module end.
pytestmark = [
  pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
  pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning"),
]


@pytest.fixture(autouse=True, scope="module")
def _quiet_and_fast():
  """No progress bars; no fsync (durability is not what these fuzzers test)."""
  mp = pytest.MonkeyPatch()
  mp.setenv("TQDM_DISABLE", "1")
  mp.setattr(atomic, "_fsync_tree", lambda root: None)
  mp.setattr(atomic, "_fsync_path", lambda p: None)
  yield
  mp.undo()
  gc.collect()


@pytest.fixture
def scratch(tmp_path):
  """A work directory in memory (tmpfs) where there is one: file creation and removal on a
  disk dominate a case's cost otherwise."""
  shm = "/dev/shm"
  if not (os.path.isdir(shm) and os.access(shm, os.W_OK)):
    yield tmp_path
    return
  d = tempfile.mkdtemp(prefix="lrjax-fuzz-", dir=shm)
  try:
    yield Path(d)
  finally:
    shutil.rmtree(d, ignore_errors=True)


def _read_tree(d) -> dict[str, bytes]:
  out = {}
  for root, _, files in os.walk(d):
    for f in files:
      p = os.path.join(root, f)
      out[os.path.relpath(p, d)] = open(p, "rb").read()
  return out


def _write_tree(d, files: dict[str, bytes]):
  for rel, data in files.items():
    p = os.path.join(d, rel)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    with open(p, "wb") as fh:
      fh.write(data)


# ---- strategies --------------------------------------------------------------------------------
json_values = st.recursive(
  st.none()
  | st.booleans()
  | st.sampled_from([0, 1, -1, 2, 3, 4, 16, 64, 64.9, 1e-5, -1e-5, 2**31, 2**70, 1e308])
  | st.integers(-3, 300)
  | st.floats(allow_nan=True, allow_infinity=True)
  | st.text(max_size=8)
  | st.sampled_from(["llama", "qwen3", "float32", "bfloat16", "../x.safetensors", "/etc/passwd"]),
  lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
  max_leaves=6,
)


def _mutate_bytes(data: bytes, draw, header_bias: int | None = None) -> bytes:
  """Flip, truncate, overwrite or insert bytes of ``data``."""
  if not data:
    return b"x"
  op = draw(st.sampled_from(["flip", "flip", "truncate", "overwrite", "insert"]))
  hi = len(data) - 1
  if header_bias and draw(st.booleans()):
    hi = min(hi, header_bias)
  i = draw(st.integers(0, hi))
  if op == "flip":
    b = bytearray(data)
    b[i] ^= draw(st.integers(1, 255))
    return bytes(b)
  if op == "truncate":
    return data[:i]
  junk = draw(st.binary(min_size=1, max_size=8))
  if op == "overwrite":
    return data[:i] + junk + data[i + len(junk) :]
  return data[:i] + junk + data[i:]


# The config.json keys lrjax reads (most edits of other keys change nothing).
CONFIG_KEYS = [
  "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
  "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
  "rope_scaling", "rope_parameters", "max_position_embeddings", "tie_word_embeddings",
  "hidden_act", "attention_bias", "mlp_bias", "sliding_window", "use_sliding_window",
  "max_window_layers", "layer_types", "dtype", "torch_dtype", "lrjax_lowrank",
  "lrjax_compression",
]  # fmt: skip


def _edit_json(obj, draw, focus: list[str] | None = None):
  """Set, delete or add one (possibly nested) field of a JSON object to a random value;
  ``focus``: keys to pick three times in four."""
  if not isinstance(obj, dict) or not obj:
    return draw(json_values)
  if focus and draw(st.integers(0, 3)):
    key = draw(st.sampled_from(focus))
    if key not in obj:
      obj[key] = draw(json_values)
      return obj
  else:
    key = draw(st.sampled_from(sorted(obj) + ["<new>"]))
  if key == "<new>":
    obj[draw(st.text(max_size=12))] = draw(json_values)
    return obj
  if isinstance(obj[key], dict) and draw(st.booleans()):
    obj[key] = _edit_json(obj[key], draw)
    return obj
  if isinstance(obj[key], list) and obj[key] and draw(st.booleans()):
    j = draw(st.integers(0, len(obj[key]) - 1))
    obj[key][j] = _edit_json(obj[key][j], draw)
    return obj
  v = draw(st.one_of(st.just(DELETE), json_values))
  if v is DELETE:
    del obj[key]
  else:
    obj[key] = v
  return obj


def _safetensors_files(files):
  return sorted(f for f in files if f.endswith(".safetensors"))


def _mutate_hf(files: dict[str, bytes], draw) -> str:
  """Apply one mutation to an HF directory's files; returns its description."""
  kinds = ["config_bytes", "config_field", "st_bytes", "st_header", "remove_file"]
  if "model.safetensors.index.json" in files:
    kinds += ["index"]
  if EXPORT_NAME in files:
    kinds += ["record"]
  kind = draw(st.sampled_from(kinds))
  if kind == "config_bytes":
    files["config.json"] = _mutate_bytes(files["config.json"], draw)
  elif kind == "config_field":
    cfg = _edit_json(json.loads(files["config.json"]), draw, CONFIG_KEYS)
    files["config.json"] = json.dumps(cfg).encode()
  elif kind == "st_bytes":
    f = draw(st.sampled_from(_safetensors_files(files)))
    n = struct.unpack("<Q", files[f][:8])[0]
    files[f] = _mutate_bytes(files[f], draw, header_bias=8 + n)
  elif kind == "st_header":
    f = draw(st.sampled_from(_safetensors_files(files)))
    n = struct.unpack("<Q", files[f][:8])[0]
    header = json.loads(files[f][8 : 8 + n])
    header = _edit_json(header, draw, sorted(k for k in header if k != "__metadata__"))
    blob = json.dumps(header).encode()
    files[f] = struct.pack("<Q", len(blob)) + blob + files[f][8 + n :]
  elif kind == "index":
    idx = json.loads(files["model.safetensors.index.json"])
    if draw(st.booleans()):
      idx = _edit_json(idx, draw, ["weight_map"])
      files["model.safetensors.index.json"] = json.dumps(idx).encode()
    else:
      b = files["model.safetensors.index.json"]
      files["model.safetensors.index.json"] = _mutate_bytes(b, draw)
  elif kind == "record":
    if draw(st.booleans()):
      rec = _edit_json(json.loads(files[EXPORT_NAME]), draw, ["tensors", "format_version"])
      files[EXPORT_NAME] = json.dumps(rec).encode()
    else:
      files[EXPORT_NAME] = _mutate_bytes(files[EXPORT_NAME], draw)
  else:
    del files[draw(st.sampled_from(sorted(files)))]
  return kind


# ---- fuzzer 1: the convert CLI over mutated HF directories -----------------------------------
@pytest.fixture(scope="module")
def hf_bases(tmp_path_factory):
  """Three tiny HF directories: one file, sharded with an index, and an lrjax export."""
  d = tmp_path_factory.mktemp("bases")
  m = random_model(TINY)
  checkpoint.export_hf(m, d / "export")
  checkpoint.export_hf(m, d / "sharded", max_shard_bytes=3000)
  os.remove(d / "sharded" / EXPORT_NAME)
  (d / "single").mkdir()
  shutil.copy(d / "export" / "config.json", d / "single")
  shutil.copy(d / "export" / "model.safetensors", d / "single")
  bases = {name: _read_tree(d / name) for name in ("single", "sharded", "export")}
  assert "model.safetensors.index.json" in bases["sharded"]
  return bases


def _convert_case(work, files: dict[str, bytes], kind: str):
  if work.exists():
    shutil.rmtree(work)
  src, out = work / "hf", work / "out"
  _write_tree(src, files)
  args = ["convert", "--hf", str(src), "--out", str(out), "--ratio", "0.5", "--method", "svd",
          "--mlp-only"]  # fmt: skip
  err, std = io.StringIO(), io.StringIO()
  try:
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
      rc = cli.main(args + ["--block", "2"])
  except BaseException as e:  # anything escaping main is a crash
    raise AssertionError(f"{kind}: {type(e).__name__} escaped lrjax convert:\n"
                         f"{traceback.format_exc()}") from None  # fmt: skip
  text = err.getvalue()
  assert "Traceback" not in text, f"{kind}: traceback on stderr:\n{text}"
  left = sorted(os.listdir(work))
  if rc == 0:
    assert left == ["hf", "out"], f"{kind}: exit 0 left {left}"
    checkpoint.read_metadata(out)
    return "ok"
  # Progress bars (tqdm, "...%|...|") are drawn on stderr too; what matters is the rest.
  lines = [ln for ln in text.replace("\r", "\n").splitlines() if ln.strip() and "%|" not in ln]
  errors = [ln for ln in lines if ln.startswith("lrjax convert:")]
  others = [ln for ln in lines if not ln.startswith(("lrjax convert:", "WARNING ", "INFO "))]
  assert rc in (1, 2) and len(errors) == 1 and not others, f"{kind}: rc={rc} stderr:\n{text}"
  assert left == ["hf"], f"{kind}: a failed convert left {left} beside its input"
  return "error"


def test_fuzz_convert_over_mutated_hf_dirs(hf_bases, scratch, fuzz_report):
  stats = {"cases": 0, "crashes": 0}

  @SETTINGS
  @given(data=st.data())
  def run(data):
    stats["cases"] += 1
    base = data.draw(st.sampled_from(sorted(hf_bases)))
    files = dict(hf_bases[base])
    kind = _mutate_hf(files, data.draw)
    try:
      r = _convert_case(scratch / "case", files, f"{base}/{kind}")
      stats[r] = stats.get(r, 0) + 1
    except BaseException:
      stats["crashes"] += 1
      raise

  try:
    run()
  finally:
    fuzz_report("lrjax convert over mutated HF dirs", stats["cases"], stats["crashes"])
  assert stats["cases"] >= CASES


# ---- fuzzer 2: bytes of a saved lrjax checkpoint ----------------------------------------------
@pytest.fixture(scope="module")
def saved_ckpt(tmp_path_factory):
  d = tmp_path_factory.mktemp("saved")
  m = random_model(TINY, [{"q_proj": 4, "up_proj": 8}])
  checkpoint.save(m, d / "ck")
  return d / "ck", weights(m), _read_tree(d / "ck")


def test_fuzz_checkpoint_bytes(saved_ckpt, scratch, fuzz_report):
  ck, want, files = saved_ckpt
  work = scratch / "ck"
  shutil.copytree(ck, work)
  names = sorted(files)
  data_files = [f for f in names if f"{os.sep}d{os.sep}" in f and "ocdbt.process" in f]
  groups = {
    "metadata": [checkpoint.METADATA_NAME],
    "array data": data_files,
    "orbax index": [f for f in names if f not in data_files and f != checkpoint.METADATA_NAME],
  }
  stats = {"cases": 0, "crashes": 0}

  @SETTINGS
  @given(data=st.data())
  def run(data):
    stats["cases"] += 1
    group = data.draw(st.sampled_from(sorted(groups)))
    rel = data.draw(st.sampled_from(groups[group]))
    op = data.draw(st.sampled_from(["mutate"] * 6 + ["flip2", "delete"]))
    p = work / rel
    orig = files[rel]
    if op == "delete":
      os.remove(p)
    else:
      new = _mutate_bytes(orig, data.draw)
      if op == "flip2":
        new = _mutate_bytes(new, data.draw)
      p.write_bytes(new)
    try:
      try:
        back = checkpoint.load(work)
      except (ValueError, FileNotFoundError) as e:
        msg = str(e)
        assert "\n" not in msg.strip(), f"{group} {rel} {op}: multi-line error:\n{msg}"
        assert str(work) in msg, f"{group} {rel} {op}: error does not name the checkpoint: {msg}"
      except BaseException as e:
        raise AssertionError(f"{group} {rel} {op}: {type(e).__name__}: {e}") from None
      else:
        got = weights(back)
        diff = [k for k in want if got[k].tobytes() != want[k].tobytes()]
        assert not diff, f"{group} {rel} {op}: loaded without error but {diff[:3]} differ"
    except BaseException:
      stats["crashes"] += 1
      raise
    finally:
      p.write_bytes(orig)

  try:
    run()
  finally:
    fuzz_report("lrjax.checkpoint.load over mutated checkpoint bytes", stats["cases"],
                stats["crashes"])  # fmt: skip
  assert stats["cases"] >= CASES
