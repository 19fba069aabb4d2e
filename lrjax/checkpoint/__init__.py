"""Checkpoints: HF safetensors in and out, and lrjax orbax checkpoints with metadata.

- :func:`load_hf` / ``lrjax.models.from_hf``: HF dir (config.json + safetensors, single or
  sharded; bf16/f16/f32) → NNX model, streamed tensor by tensor.
- :func:`save` / :func:`load`: orbax arrays + ``lrjax_metadata.json`` (config, per-layer ranks,
  compression record, source digest, versions); ``load`` restores into target shardings.
- :func:`export_hf`: a (low-rank) model → HF-style safetensors with ``<p>_u_proj`` /
  ``<p>_v_proj`` tensors and ranks in config.json; :func:`load_hf` reads it back.

Every write goes to a hidden temp dir that is renamed into place; nothing uses pickle.
"""

from lrjax.checkpoint.atomic import atomic_dir
from lrjax.checkpoint.hf import digest, export_hf, hf_name, load_hf
from lrjax.checkpoint.orbax_io import METADATA_NAME, load, read_metadata, save
from lrjax.checkpoint.placement import logical_sharding
from lrjax.checkpoint.safetensors_io import SafetensorsDir, read_header, write_safetensors

__all__ = [
  "METADATA_NAME",
  "SafetensorsDir",
  "atomic_dir",
  "digest",
  "export_hf",
  "hf_name",
  "load",
  "load_hf",
  "logical_sharding",
  "read_header",
  "read_metadata",
  "save",
  "write_safetensors",
]
