"""Checkpoints: HF safetensors in and out, and lrjax orbax checkpoints with metadata.

- :func:`load_hf` / ``lrjax.models.from_hf``: HF dir (config.json + safetensors, single or
  sharded; bf16/f16/f32) → NNX model, streamed tensor by tensor.
- :func:`save` / :func:`load`: orbax arrays + ``lrjax_metadata.json`` (config, per-layer ranks,
  compression record, source digest, versions, each array's shape, dtype and sha256);
  ``load`` verifies them and restores into target shardings.
- :func:`export_hf`: a (low-rank) model → HF directory that transformers loads: ``hf-lowrank``
  (``<p>_u_proj`` / ``<p>_v_proj`` tensors, ranks in config.json, its own model type and
  modeling file; ``trust_remote_code=True``) or ``hf-dense`` (U·V merged, plain architecture);
  :func:`load_hf` reads both back.

Every path may be relative, start with ``~`` or go through symlinks. Every write goes to a
hidden temp dir that is swapped into place under a lock; ``overwrite`` replaces only what lrjax
wrote (see :mod:`lrjax.checkpoint.atomic`). Nothing uses pickle.
"""

from lrjax.checkpoint.atomic import (
  OutputBusyError,
  atomic_dir,
  clean_stale,
  reserve_output,
  resolve,
)
from lrjax.checkpoint.hf import (
  EXPORT_NAME,
  digest,
  export_hf,
  hf_name,
  is_export,
  load_hf,
  read_export_record,
  read_hf_config,
)
from lrjax.checkpoint.orbax_io import (
  METADATA_NAME,
  array_sha256,
  is_checkpoint,
  load,
  read_checkpoint_arg,
  read_metadata,
  save,
)
from lrjax.checkpoint.placement import logical_sharding
from lrjax.checkpoint.safetensors_io import SafetensorsDir, read_header, write_safetensors

__all__ = [
  "EXPORT_NAME",
  "METADATA_NAME",
  "OutputBusyError",
  "SafetensorsDir",
  "array_sha256",
  "atomic_dir",
  "clean_stale",
  "digest",
  "export_hf",
  "hf_name",
  "is_checkpoint",
  "is_export",
  "load",
  "load_hf",
  "logical_sharding",
  "read_export_record",
  "read_header",
  "read_hf_config",
  "read_checkpoint_arg",
  "read_metadata",
  "reserve_output",
  "resolve",
  "save",
  "write_safetensors",
]
