"""Streaming safetensors: validated reading (single file or sharded) and a tensor-by-tensor writer.

Reading opens each file with ``safetensors.safe_open`` and loads one tensor at a time, so a
checkpoint larger than RAM never sits in memory whole. Every header is checked against its
file's size first, so a truncated file fails with the name of the tensor that is cut off.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from lrjax.checkpoint.atomic import resolve
from lrjax.files import one_line, read_json_object

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# safetensors dtype tag ↔ numpy dtype (the float and int types checkpoints use).
DTYPES = {
  "F64": np.dtype(np.float64),
  "F32": np.dtype(np.float32),
  "F16": np.dtype(np.float16),
  "BF16": np.dtype(jnp.bfloat16),
  "I64": np.dtype(np.int64),
  "I32": np.dtype(np.int32),
  "I8": np.dtype(np.int8),
  "U8": np.dtype(np.uint8),
  "BOOL": np.dtype(np.bool_),
}
TAGS = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 << 20


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def confined(root: str | os.PathLike, name: str, what: str) -> str:
  """``root/name`` resolved, if it stays inside ``root``; else ``ValueError`` naming ``what``.

  ``name`` must be relative without ``..``. A symlink may point anywhere inside ``root`` or,
  for a snapshot of the Hugging Face hub cache (``.../snapshots/<rev>/``), into that repo's
  ``blobs/`` folder, where the hub keeps the files its snapshot links point to.
  """
  if not isinstance(name, str) or not name or "\0" in name:
    raise ValueError(f"{what}: file name {name!r} must be a non-empty string")
  parts = Path(name).parts
  if os.path.isabs(name) or ".." in parts:
    raise ValueError(
      f"{what}: file {name!r} is not a relative path inside the checkpoint directory; "
      "shard files must sit in the checkpoint directory"
    )
  root = os.path.realpath(root)
  real = os.path.realpath(os.path.join(root, name))
  allowed = [root]
  if os.path.basename(os.path.dirname(root)) == "snapshots":
    allowed.append(os.path.join(os.path.dirname(os.path.dirname(root)), "blobs"))
  if not any(real == a or real.startswith(a + os.sep) for a in allowed):
    raise ValueError(
      f"{what}: file {name!r} resolves to {real}, outside the checkpoint directory {root}; "
      "shard files (and links to them) must stay inside it"
    )
  return real


def read_header(path: str) -> dict:
  """Parse and validate one file's header: {name: {"dtype", "shape", "data_offsets"}}."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: not a regular file; expected a safetensors file")
  size = os.path.getsize(path)
  with open(path, "rb") as fh:
    head = fh.read(8)
    if len(head) < 8:
      raise ValueError(
        f"{path}: {size} bytes is too short for a safetensors header; "
        "the file is truncated or not safetensors"
      )
    (n,) = struct.unpack("<Q", head)
    if n > _MAX_HEADER or 8 + n > size:
      raise ValueError(
        f"{path}: header claims {n} bytes but the file has {size}; "
        "the file is truncated or not safetensors"
      )
    try:
      header = json.loads(fh.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
      raise ValueError(  # noqa: B904
        f"{path}: header is not valid JSON ({one_line(e)}); the file is corrupt"
      )
  if not isinstance(header, dict):
    raise ValueError(f"{path}: header is a JSON {type(header).__name__}, expected an object")
  header.pop("__metadata__", None)
  data = size - 8 - n
  for name, info in header.items():
    if not isinstance(info, dict):
      raise ValueError(f"{path}: header entry {name!r} is not an object; the file is corrupt")
    tag, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if (
      not isinstance(tag, str)
      or not isinstance(shape, list)
      or not all(_is_int(d) and d >= 0 for d in shape)
      or not isinstance(offs, list)
      or len(offs) != 2
      or not all(_is_int(o) for o in offs)
      or not 0 <= offs[0] <= offs[1]
    ):
      raise ValueError(
        f"{path}: header entry {name!r} ({info!r:.120}) needs a dtype string, a shape of "
        "ints >= 0 and data_offsets [begin, end]; the file is corrupt"
      )
    b, e = offs
    if tag in DTYPES:
      want = int(np.prod(shape, dtype=np.int64)) * DTYPES[tag].itemsize
      if e - b != want:
        raise ValueError(
          f"{path}: tensor {name!r} ({tag} {shape}) spans {e - b} bytes, "
          f"expected {want}; the header is corrupt"
        )
    if e > data:
      raise ValueError(
        f"{path}: tensor {name!r} ({tag} {shape}) needs data bytes [{b}, {e}) "
        f"but the file holds only {data} data bytes; the file is truncated"
      )
  return header


class SafetensorsDir:
  """The tensors of a checkpoint directory: ``model.safetensors`` or an index plus shards.

  ``names``/``info(name)`` come from the validated headers; ``get(name)`` reads one tensor
  (as numpy) from its file.
  """

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(resolve(path, "checkpoint path"))
    index = os.path.join(self.path, INDEX_NAME)
    single = os.path.join(self.path, SINGLE_NAME)
    if os.path.lexists(index):
      confined(self.path, INDEX_NAME, index)
      weight_map = read_json_object(index).get("weight_map")
      if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
      ):
        raise ValueError(f"{index}: expected a 'weight_map' object of tensor name → shard file")
      files = sorted(set(weight_map.values()))
      for f in files:
        confined(self.path, f, index)
    elif os.path.lexists(single):
      confined(self.path, SINGLE_NAME, single)
      files, weight_map = [SINGLE_NAME], None
    else:
      raise FileNotFoundError(
        f"{self.path}: no {SINGLE_NAME} or {INDEX_NAME}; expected an HF "
        "checkpoint directory with safetensors weights"
      )
    self.files = files
    self._info: dict[str, tuple[str, dict]] = {}
    for f in files:
      fp = os.path.join(self.path, f)
      if not os.path.exists(fp):
        raise FileNotFoundError(f"{fp}: shard listed in {INDEX_NAME} does not exist")
      if not os.path.isfile(fp):
        raise ValueError(f"{fp}: not a regular file; expected a safetensors shard")
      for name, info in read_header(fp).items():
        if weight_map is not None and weight_map.get(name) != f:
          raise ValueError(
            f"tensor {name!r} is in {f} but {INDEX_NAME} maps it to {weight_map.get(name)!r}"
          )
        self._info[name] = (f, info)
    if weight_map is not None:
      lost = sorted(set(weight_map) - set(self._info))
      if lost:
        raise ValueError(
          f"{INDEX_NAME} lists tensors that no shard holds: {lost[:5]}; a shard is incomplete"
        )

  @property
  def names(self) -> list[str]:
    return list(self._info)

  def __contains__(self, name: str) -> bool:
    return name in self._info

  def info(self, name: str) -> tuple[str, tuple[int, ...]]:
    """(dtype tag, shape) of tensor ``name``."""
    _, i = self._info[name]
    return i["dtype"], tuple(i["shape"])

  def get(self, name: str) -> np.ndarray:
    """Read one tensor. The file is mapped only for this read, so its pages do not stay in
    this process's resident set while the rest of the checkpoint loads."""
    f, _ = self._info[name]
    fp = os.path.join(self.path, f)
    try:
      with safe_open(fp, framework="numpy") as h:
        return h.get_tensor(name)
    except Exception as e:
      raise ValueError(f"{fp}: tensor {name!r} cannot be read ({one_line(e)})") from None

  def file_of(self, name: str) -> str:
    """The file (relative to the directory) that holds tensor ``name``."""
    return self._info[name][0]

  def close(self):
    """Nothing stays open between reads; kept so the class works as a context manager."""

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def plan_shards(
  specs: Mapping[str, tuple[np.dtype, tuple[int, ...]]], max_bytes: int
) -> list[list[str]]:
  """Group tensor names (in order) into shards of at most ``max_bytes`` (one tensor may exceed)."""
  shards, cur, size = [], [], 0
  for name, (dt, shape) in specs.items():
    nb = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
    if cur and size + nb > max_bytes:
      shards.append(cur)
      cur, size = [], 0
    cur.append(name)
    size += nb
  if cur:
    shards.append(cur)
  return shards


def write_safetensors(
  path: str,
  specs: Mapping[str, tuple[np.dtype, tuple[int, ...]]],
  tensors: Iterable[tuple[str, np.ndarray]],
  metadata: Mapping[str, str] | None = None,
) -> None:
  """Write one safetensors file, tensor by tensor.

  ``specs`` (name → (dtype, shape), in file order) fixes the header up front; ``tensors``
  yields (name, array) in the same order, so only one tensor is on the host at a time.
  """
  header, off = {}, 0
  if metadata:
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
  for name, (dt, shape) in specs.items():
    dt = np.dtype(dt)
    if dt not in TAGS:
      raise TypeError(f"tensor {name!r} has dtype {dt}; safetensors export supports {list(TAGS)}")
    nb = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    header[name] = {"dtype": TAGS[dt], "shape": list(shape), "data_offsets": [off, off + nb]}
    off += nb
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  names = [n for n in specs]
  with open(path, "wb") as fh:
    fh.write(struct.pack("<Q", len(blob)))
    fh.write(blob)
    i = -1
    for i, (name, arr) in enumerate(tensors):
      if i >= len(names) or name != names[i]:
        raise ValueError(
          f"tensor {name!r} arrived out of order; expected "
          f"{names[i] if i < len(names) else 'no more tensors'}"
        )
      dt, shape = specs[name]
      arr = np.ascontiguousarray(arr)
      if arr.dtype != np.dtype(dt) or arr.shape != tuple(shape):
        raise ValueError(
          f"tensor {name!r} is {arr.dtype}{arr.shape}, header says {np.dtype(dt)}{tuple(shape)}"
        )
      fh.write(arr.tobytes())
    if i + 1 != len(names):
      raise ValueError(f"only {i + 1} of {len(names)} tensors were written to {path}")
    fh.flush()
    os.fsync(fh.fileno())
