"""lrjax checkpoints: orbax arrays plus one ``lrjax_metadata.json``, written atomically.

Layout of ``path/``::

  lrjax_metadata.json   format, lrjax/jax/orbax versions, architecture config, per-layer ranks,
                        compression record (method, ratio, calibration, LoRA), source digest,
                        and every param's shape, dtype and logical axes
  state/                orbax standard (OCDBT) tree {"layers.0.attn.q_proj.u": array, ...}

Saving and restoring keep at most ``concurrent_gb`` of array bytes in flight, so the host
copies orbax makes while writing stay bounded instead of duplicating the whole model.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from lrjax.checkpoint.atomic import atomic_dir
from lrjax.checkpoint.hf import abstract_model
from lrjax.checkpoint.placement import Shardings, logical_sharding, param_axes, param_key, pick
from lrjax.models.config import ModelConfig
from lrjax.models.llama import LlamaForCausalLM

log = logging.getLogger("lrjax.checkpoint")

METADATA_NAME = "lrjax_metadata.json"
STATE_DIR = "state"
FORMAT = "lrjax-orbax"
FORMAT_VERSION = 1


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
  ``model.source_digest``. ``extra_files`` (e.g. tokenizer.json) are copied into the checkpoint
  under their own names, inside the same atomic write.
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

  flat = _flat(model)
  arrays = {param_key(p): var[...] for p, var in flat}
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
      }
      for p, var in flat
    },
  }
  json.dumps(meta)  # fail before writing anything if the compression record is not JSON
  with atomic_dir(path, overwrite) as tmp:
    _checkpointer(concurrent_gb).save(
      os.path.join(tmp, STATE_DIR), args=ocp.args.StandardSave(arrays)
    )
    with open(os.path.join(tmp, METADATA_NAME), "w") as fh:
      json.dump(meta, fh, indent=1)
    for f, n in zip(extra, names):
      shutil.copyfile(f, os.path.join(tmp, n))
  log.info("saved %s (%d arrays)", path, len(arrays))


def read_metadata(path: str | os.PathLike) -> dict:
  mp = os.path.join(os.fspath(path), METADATA_NAME)
  if not os.path.exists(mp):
    raise FileNotFoundError(
      f"{mp} does not exist; {path} is not an lrjax checkpoint "
      "(for an HF directory use lrjax.models.from_hf)"
    )
  with open(mp) as fh:
    meta = json.load(fh)
  if meta.get("format") != FORMAT or meta.get("format_version", 0) > FORMAT_VERSION:
    raise ValueError(
      f"{mp}: format={meta.get('format')!r} version={meta.get('format_version')} "
      f"is not readable by this lrjax (reads {FORMAT} <= {FORMAT_VERSION})"
    )
  return meta


def load(
  path: str | os.PathLike,
  mesh: Mesh | None = None,
  shardings: Shardings | None = None,
  *,
  rules: Mapping[str, str | None] | None = None,
  concurrent_gb: int = 1,
) -> LlamaForCausalLM:
  """Load an lrjax checkpoint, restoring arrays straight into their target shardings.

  ``shardings``: one ``Sharding`` for all params, a dict ``{"layers.0.attn.q_proj.u": s}``
  (missing keys replicate on ``mesh`` or go to the default device), or a function
  ``(key, logical_axes) → Sharding``. With only ``mesh``, params are placed by logical axes
  through ``rules`` ({"mlp": "tp", ...}; none → replicated on the mesh).
  """
  path = os.fspath(path)
  meta = read_metadata(path)
  cfg = ModelConfig.from_dict(meta["config"])
  params = meta["params"]
  emb = params.get("embed.embedding")
  if emb is None:
    raise ValueError(f"{path}: metadata lists no 'embed.embedding' param; checkpoint is corrupt")
  model = abstract_model(cfg, meta["ranks"], jnp.dtype(emb["dtype"]), meta.get("heads"))
  gdef, state = nnx.split(model)
  flat = list(nnx.to_flat_state(state))
  keys = [param_key(p) for p, _ in flat]
  if set(keys) != set(params):
    raise ValueError(
      f"{path}: metadata params differ from the model its config and ranks "
      f"describe: missing {sorted(set(keys) - set(params))[:3]}, "
      f"extra {sorted(set(params) - set(keys))[:3]}"
    )
  if shardings is None and mesh is not None:
    shardings = logical_sharding(mesh, rules)
  target = {}
  for k, (p, var) in zip(keys, flat):  # noqa: B007
    info = params[k]
    if tuple(info["shape"]) != tuple(var.shape):
      raise ValueError(
        f"{path}: param {k} has shape {info['shape']}, config and ranks imply {list(var.shape)}"
      )
    target[k] = jax.ShapeDtypeStruct(
      tuple(info["shape"]),
      jnp.dtype(info["dtype"]),
      sharding=pick(shardings, k, param_axes(var), mesh),
    )
  restored = _checkpointer(concurrent_gb).restore(
    os.path.join(path, STATE_DIR), args=ocp.args.StandardRestore(target)
  )
  state = nnx.from_flat_state([(p, var.replace(restored[k])) for k, (p, var) in zip(keys, flat)])
  out = nnx.merge(gdef, state)
  out.compression = meta.get("compression")
  out.source_digest = meta.get("source_digest")
  log.info("loaded %s (%s, ranks %s)", path, cfg.model_type, meta["ranks"])
  return out
