"""lrjax checkpoints: orbax arrays plus one ``lrjax_metadata.json``, written atomically.

Layout of ``path/``::

  lrjax_metadata.json   format, lrjax/jax/orbax versions, architecture config, per-layer ranks,
                        compression record (method, ratio, calibration, LoRA), source digest,
                        and every param's shape, dtype, logical axes and sha256 of its bytes
  state/                orbax standard (OCDBT) tree {"layers.0.attn.q_proj.u": array, ...}

Saving and restoring keep at most ``concurrent_gb`` of array bytes in flight, so the host
copies orbax makes while writing stay bounded instead of duplicating the whole model.

``load`` checks the metadata's schema, each param's shape and dtype against what ``state/``
holds, and (``verify=True``, the default) each array's sha256, so a flipped byte, a truncated
file or an edited metadata entry fails with a message naming the array and the file.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from lrjax.checkpoint import quantized as quantized_ckpt
from lrjax.checkpoint.atomic import atomic_dir, resolve
from lrjax.checkpoint.hf import abstract_model, abstract_split
from lrjax.checkpoint.placement import Shardings, logical_sharding, param_axes, param_key, pick
from lrjax.files import one_line, read_json_object
from lrjax.models.config import ModelConfig
from lrjax.models.llama import LlamaForCausalLM

log = logging.getLogger("lrjax.checkpoint")

METADATA_NAME = "lrjax_metadata.json"
STATE_DIR = "state"
FORMAT = "lrjax-orbax"
FORMAT_VERSION = 2  # 2: per-array sha256 ("sha256" in each params entry)
_HASH_WORKERS = 4
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _flat(model: LlamaForCausalLM):
  _, state = nnx.split(model)
  return list(nnx.to_flat_state(state))


def _checkpointer(concurrent_gb: int) -> ocp.Checkpointer:
  if not isinstance(concurrent_gb, int) or concurrent_gb < 1:
    raise ValueError(f"{concurrent_gb=} must be an int >= 1 (GB of array bytes in flight)")
  return ocp.Checkpointer(
    ocp.StandardCheckpointHandler(
      save_concurrent_gb=concurrent_gb, restore_concurrent_gb=concurrent_gb
    )
  )


def array_sha256(a) -> str:
  """sha256 (hex) of an array's bytes in C order (its dtype as stored)."""
  host = np.ascontiguousarray(jax.device_get(a))
  return hashlib.sha256(host.reshape(-1).view(np.uint8)).hexdigest()


def _hashes(arrays: Mapping[str, object]) -> dict[str, str]:
  with concurrent.futures.ThreadPoolExecutor(_HASH_WORKERS) as ex:
    return dict(zip(arrays, ex.map(array_sha256, arrays.values())))


def is_checkpoint(path: str | os.PathLike) -> str | None:
  """None if ``path`` holds an lrjax checkpoint whose metadata parses, else the reason."""
  try:
    read_metadata(path)
  except (OSError, ValueError) as e:
    return f"is not an lrjax checkpoint ({one_line(e)})"
  return None


def read_checkpoint_arg(path: str, flag: str = "--ckpt", hf_fix: str | None = None) -> dict:
  """A command's checkpoint argument ``flag path``: its metadata, or a one-line error naming
  the argument and the fix (an HF model directory: ``hf_fix``, else convert it first)."""
  p = resolve(path, flag)
  if not p.exists():
    raise FileNotFoundError(f"{flag} {path}: no such directory")
  if p.is_dir() and not (p / METADATA_NAME).exists():
    if (p / "config.json").is_file():
      fix = hf_fix or f"convert it first: lrjax convert --hf {path} --out DIR --ratio R"
      raise ValueError(f"{flag} {path} is an HF model directory, not an lrjax checkpoint; {fix}")
    raise FileNotFoundError(
      f"{flag} {path} is not an lrjax checkpoint: no {METADATA_NAME} there "
      "(expected a directory written by lrjax convert)"
    )
  try:
    return read_metadata(p)
  except (OSError, ValueError) as e:
    kind = FileNotFoundError if isinstance(e, FileNotFoundError) else ValueError
    raise kind(f"{flag} {path}: {one_line(e)}") from None


def save(
  model: LlamaForCausalLM,
  path: str | os.PathLike,
  *,
  compression: Mapping | None = None,
  source_digest: str | None = None,
  overwrite: bool = False,
  concurrent_gb: int = 1,
  extra_files: Sequence[str | os.PathLike] = (),
) -> None:
  """Save ``model`` to ``path`` (orbax arrays + metadata JSON) atomically.

  ``compression`` and ``source_digest`` default to ``model.compression`` and
  ``model.source_digest``. ``overwrite`` replaces only an existing lrjax checkpoint (see
  :func:`lrjax.checkpoint.atomic_dir` for what is never replaced). ``extra_files`` (e.g.
  tokenizer.json) are copied into the checkpoint under their own names, inside the same atomic
  write.
  """
  import lrjax

  extra = [os.fspath(f) for f in extra_files]
  names = [os.path.basename(f) for f in extra]
  for f, n in zip(extra, names):
    if n in (METADATA_NAME, STATE_DIR) or names.count(n) > 1 or not os.path.isfile(f):
      raise ValueError(
        f"extra_files: {f} must be an existing file, its name unique and not {METADATA_NAME} "
        f"or {STATE_DIR}"
      )
  path = resolve(path, "checkpoint path")
  flat = _flat(model)
  arrays = {param_key(p): var[...] for p, var in flat}
  sums = _hashes(arrays)
  meta = {
    "format": FORMAT,
    "format_version": FORMAT_VERSION,
    "lrjax_version": lrjax.__version__,
    "jax_version": jax.__version__,
    "orbax_version": getattr(ocp, "__version__", None),
    "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "config": model.cfg.to_dict(),
    "ranks": model.layer_ranks(),
    "heads": model.layer_heads(),
    "compression": dict(compression)
    if compression is not None
    else getattr(model, "compression", None),
    "source_digest": source_digest or getattr(model, "source_digest", None),
    "params": {
      param_key(p): {
        "shape": list(var.shape),
        "dtype": np.dtype(var.dtype).name,
        "axes": list(param_axes(var)),
        "sha256": sums[param_key(p)],
      }
      for p, var in flat
    },
  }
  if (qrec := quantized_ckpt.record(model)) is not None:
    meta["quantization"] = qrec  # W4A8: scheme, layout, groups, per-projection shapes
  json.dumps(meta)  # fail before writing anything if the compression record is not JSON
  with atomic_dir(path, overwrite, replaceable=is_checkpoint) as tmp:
    _checkpointer(concurrent_gb).save(
      os.path.join(tmp, STATE_DIR), args=ocp.args.StandardSave(arrays)
    )
    with open(os.path.join(tmp, METADATA_NAME), "w") as fh:
      json.dump(meta, fh, indent=1)
    for f, n in zip(extra, names):
      shutil.copyfile(f, os.path.join(tmp, n))
  log.info("saved %s (%d arrays)", path, len(arrays))


# ---- metadata ---------------------------------------------------------------------------------
def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _check_layer_dicts(mp: str, key: str, v, n: int, optional: bool):
  if v is None and optional:
    return
  if not isinstance(v, list) or len(v) != n:
    raise ValueError(f"{mp}: {key!r} must be a list of {n} per-layer objects (num_layers={n})")
  for i, d in enumerate(v):
    if not isinstance(d, dict) or not all(
      isinstance(k, str) and _is_int(r) and r > 0 for k, r in d.items()
    ):
      raise ValueError(f"{mp}: {key}[{i}] must map projection names to positive ints, got {d!r}")


def _check_param(mp: str, k, info, checksums: bool):
  if not isinstance(k, str) or not isinstance(info, dict):
    raise ValueError(f"{mp}: params entry {k!r} must be an object with shape, dtype, axes")
  shape, dtype = info.get("shape"), info.get("dtype")
  if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
    raise ValueError(f"{mp}: param {k!r} has shape {shape!r}; expected a list of ints >= 0")
  try:
    ok = isinstance(dtype, str) and jnp.dtype(dtype).name == dtype
  except TypeError:
    ok = False
  if not ok:
    raise ValueError(f"{mp}: param {k!r} has dtype {dtype!r}; expected a dtype name like float32")
  axes = info.get("axes", [])
  if not isinstance(axes, list) or not all(a is None or isinstance(a, str) for a in axes):
    raise ValueError(f"{mp}: param {k!r} has axes {axes!r}; expected a list of names or null")
  if checksums and not (isinstance(info.get("sha256"), str) and _HEX64.match(info["sha256"])):
    raise ValueError(
      f"{mp}: param {k!r} has sha256 {info.get('sha256')!r}; expected 64 lowercase hex digits"
    )


def read_metadata(path: str | os.PathLike) -> dict:
  """Read and validate ``path/lrjax_metadata.json`` (errors name the file and the entry)."""
  path = resolve(path, "checkpoint path")
  mp = os.path.join(path, METADATA_NAME)
  if os.path.isfile(path):
    raise NotADirectoryError(f"{path} is a file; expected an lrjax checkpoint directory")
  if not os.path.isfile(mp):
    raise FileNotFoundError(
      f"{mp} does not exist; {path} is not an lrjax checkpoint "
      "(for an HF directory use lrjax.models.from_hf)"
    )
  meta = read_json_object(mp, hint="the checkpoint is corrupt")
  fmt, ver = meta.get("format"), meta.get("format_version")
  if fmt != FORMAT or not _is_int(ver) or not 1 <= ver <= FORMAT_VERSION:
    raise ValueError(
      f"{mp}: format={fmt!r} version={ver!r} "
      f"is not readable by this lrjax (reads {FORMAT} <= {FORMAT_VERSION})"
    )
  for key in ("config", "ranks", "params"):
    if key not in meta:
      raise ValueError(f"{mp}: missing key {key!r}; the checkpoint is corrupt")
  if not isinstance(meta["config"], dict):
    raise ValueError(f"{mp}: 'config' must be an object, got {type(meta['config']).__name__}")
  try:
    cfg = ModelConfig.from_dict(meta["config"])
  except (ValueError, TypeError) as e:
    raise ValueError(f"{mp}: 'config': {one_line(e)}") from None
  _check_layer_dicts(mp, "ranks", meta["ranks"], cfg.num_layers, optional=False)
  _check_layer_dicts(mp, "heads", meta.get("heads"), cfg.num_layers, optional=True)
  if not isinstance(meta["params"], dict):
    raise ValueError(f"{mp}: 'params' must be an object of param name → shape, dtype, axes")
  for k, info in meta["params"].items():
    _check_param(mp, k, info, checksums=ver >= 2)
  for key in ("compression",):
    if meta.get(key) is not None and not isinstance(meta[key], dict):
      raise ValueError(f"{mp}: {key!r} must be an object or null")
  if meta.get("source_digest") is not None and not isinstance(meta["source_digest"], str):
    raise ValueError(f"{mp}: 'source_digest' must be a string or null")
  return meta


def _stored(state_dir: str, ckptr: ocp.Checkpointer) -> dict[str, tuple[tuple, np.dtype]]:
  """{key: (shape, dtype)} of the arrays orbax recorded in ``state_dir``."""
  try:
    md = ckptr.metadata(state_dir)
    tree = getattr(md, "item_metadata", md)
    tree = getattr(tree, "tree", tree)
    return {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in dict(tree).items()}
  except Exception as e:
    raise ValueError(
      f"{state_dir}: the array index cannot be read ({one_line(e)}); the checkpoint is corrupt"
    ) from None


def _locate(state_dir: str, target: dict, err: Exception) -> ValueError:
  """After a failed restore: the first array that cannot be read on its own, by name."""
  ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
  dev = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  for k, t in target.items():
    sd = jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=dev)
    try:
      ckptr.restore(
        state_dir,
        args=ocp.args.PyTreeRestore(
          item={k: sd},
          restore_args={k: ocp.ArrayRestoreArgs(sharding=dev, dtype=t.dtype)},
          partial_restore=True,
        ),
      )
    except Exception as e:
      return ValueError(
        f"{state_dir}: array {k!r} cannot be read ({one_line(e)}); the checkpoint is corrupt"
      )
  return ValueError(f"{state_dir}: restoring failed ({one_line(err)}); the checkpoint is corrupt")


def load(
  path: str | os.PathLike,
  mesh: Mesh | None = None,
  shardings: Shardings | None = None,
  *,
  rules: Mapping[str, str | None] | None = None,
  concurrent_gb: int = 1,
  verify: bool = True,
) -> LlamaForCausalLM:
  """Load an lrjax checkpoint, restoring arrays straight into their target shardings.

  ``shardings``: one ``Sharding`` for all params, a dict ``{"layers.0.attn.q_proj.u": s}``
  (missing keys replicate on ``mesh`` or go to the default device), or a function
  ``(key, logical_axes) → Sharding``. With only ``mesh``, params are placed by logical axes
  through ``rules`` ({"mlp": "tp", ...}; none → replicated on the mesh).

  ``verify`` checks every array's sha256 against the metadata (one pass over the weights);
  shapes and dtypes are always checked against what ``state/`` holds.
  """
  path = resolve(path, "checkpoint path")
  mp = os.path.join(path, METADATA_NAME)
  meta = read_metadata(path)
  cfg = ModelConfig.from_dict(meta["config"])
  params = meta["params"]
  emb = params.get("embed.embedding")
  if emb is None:
    raise ValueError(f"{mp}: lists no 'embed.embedding' param; the checkpoint is corrupt")
  try:
    if meta.get("quantization") is None:
      gdef, flat = abstract_split(cfg, meta["ranks"], jnp.dtype(emb["dtype"]), meta.get("heads"))
    else:  # W4A8: the recorded projections as abstract quantized modules
      model = abstract_model(cfg, meta["ranks"], jnp.dtype(emb["dtype"]), meta.get("heads"))
      model = quantized_ckpt.abstract(model, meta["quantization"], mesh, path)
      gdef, state = nnx.split(model)
      flat = tuple(nnx.to_flat_state(state))
  except (ValueError, TypeError, KeyError) as e:
    raise ValueError(
      f"{mp}: config, ranks and heads do not build a model ({one_line(e)})"
    ) from None
  keys = [param_key(p) for p, _ in flat]
  if set(keys) != set(params):
    raise ValueError(
      f"{mp}: metadata params differ from the model its config and ranks "
      f"describe: missing {sorted(set(keys) - set(params))[:3]}, "
      f"extra {sorted(set(params) - set(keys))[:3]}"
    )
  state_dir = os.path.join(path, STATE_DIR)
  if not os.path.isdir(state_dir):
    raise FileNotFoundError(f"{state_dir} does not exist; the checkpoint is incomplete")
  ckptr = _checkpointer(concurrent_gb)
  if shardings is None and mesh is not None:
    shardings = logical_sharding(mesh, rules)
  target = {}
  for k, (p, var) in zip(keys, flat):  # noqa: B007
    info = params[k]
    if tuple(info["shape"]) != tuple(var.shape):
      raise ValueError(
        f"{mp}: param {k} has shape {info['shape']}, config and ranks imply {list(var.shape)}"
      )
    target[k] = jax.ShapeDtypeStruct(
      tuple(info["shape"]),
      jnp.dtype(info["dtype"]),
      sharding=pick(shardings, k, param_axes(var), mesh),
    )
  # What state/ holds is compared with the metadata up front without checksums; with them,
  # only to explain a failure (a restore casts to the recorded dtype, so an edited dtype
  # shows up as a checksum mismatch first).
  if not verify:
    _check_stored(mp, state_dir, ckptr, params)
  try:
    restored = ckptr.restore(state_dir, args=ocp.args.StandardRestore(target))
  except Exception as e:
    if verify:
      _check_stored(mp, state_dir, ckptr, params)
    raise _locate(state_dir, target, e) from None
  if verify:
    bad = _mismatched(meta, restored)
    if bad:
      _check_stored(mp, state_dir, ckptr, params)
      raise ValueError(
        f"{path}: array {bad!r} fails its sha256 check against {METADATA_NAME} (data in "
        f"{state_dir}); the checkpoint is corrupt: re-create it "
        "(verify=False / --no-verify skips the check)"
      )
  state = nnx.from_flat_state([(p, var.replace(restored[k])) for k, (p, var) in zip(keys, flat)])
  out = quantized_ckpt.for_host(nnx.merge(gdef, state), meta.get("quantization"), path)
  out.compression = meta.get("compression")
  out.source_digest = meta.get("source_digest")
  log.info("loaded %s (%s, ranks %s)", path, cfg.model_type, meta["ranks"])
  return out


def _check_stored(mp: str, state_dir: str, ckptr: ocp.Checkpointer, params: dict):
  """Raise if a param's recorded shape or dtype differs from what ``state_dir`` holds."""
  stored = _stored(state_dir, ckptr)
  for k, info in params.items():
    if k not in stored:
      raise ValueError(f"{state_dir}: holds no array {k!r} listed in {METADATA_NAME}")
    shape, dt = stored[k]
    if shape != tuple(info["shape"]) or dt != np.dtype(info["dtype"]):
      raise ValueError(
        f"{mp}: param {k!r} is recorded as {info['dtype']}{info['shape']} but {STATE_DIR}/ "
        f"holds {dt.name}{list(shape)}; the metadata was edited or is corrupt"
      )


def _mismatched(meta: dict, restored: Mapping[str, object]) -> str | None:
  """The first array whose sha256 differs from the metadata's, or None."""
  if meta["format_version"] < 2:
    log.warning("format version %d records no checksums; not verified", meta["format_version"])
    return None
  got = _hashes(restored)
  return next((k for k, h in got.items() if h != meta["params"][k]["sha256"]), None)
