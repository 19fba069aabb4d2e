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

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

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


def read_header(path: str) -> dict:
  """Parse and validate one file's header: {name: {"dtype", "shape", "data_offsets"}}."""
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
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise ValueError(f"{path}: header is not valid JSON ({e}); the file is corrupt")  # noqa: B904
  header.pop("__metadata__", None)
  data = size - 8 - n
  for name, info in header.items():
    tag, shape, (b, e) = info["dtype"], info["shape"], info["data_offsets"]
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
    self.path = os.fspath(path)
    index = os.path.join(self.path, INDEX_NAME)
    single = os.path.join(self.path, SINGLE_NAME)
    if os.path.exists(index):
      with open(index) as fh:
        weight_map = json.load(fh).get("weight_map")
      if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: expected a 'weight_map' object of tensor → shard file")
      files = sorted(set(weight_map.values()))
    elif os.path.exists(single):
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
    with safe_open(os.path.join(self.path, f), framework="numpy") as h:
      return h.get_tensor(name)

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
