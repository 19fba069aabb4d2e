"""lrjax.serving: a pjit generation engine over a ("data", "tp") mesh.

  engine = lrjax.serving.load_engine("ckpt_dir", tp=4)       # orbax → target shardings
  [res] = engine.generate([Request([1, 2, 3], SamplingParams(max_new_tokens=32))])

See :mod:`lrjax.serving.engine` (continuous batching), :mod:`lrjax.serving.sampling`,
:mod:`lrjax.serving.lowrank_kv` (rank-space KV cache), and :mod:`lrjax.serving.server` (the
OpenAI-compatible HTTP server of ``lrjax serve``).
"""

from __future__ import annotations

import logging

from lrjax.serving.engine import Engine, Request, Result, StepEvents, default_buckets, itl
from lrjax.serving.lowrank_kv import LowRankKVCache
from lrjax.serving.sampling import SamplingParams, sample

log = logging.getLogger("lrjax.serving")


def default_strategy(ranks) -> str:
  """``lowrank_tp`` when any projection is low-rank, else Megatron ``dense``."""
  return "lowrank_tp" if any(r for r in ranks) else "dense"


def load_model(path, tp: int = 1, strategy: str | None = None, data: int = 1):
  """Load an lrjax orbax checkpoint straight into ``strategy``'s shardings on a (data, tp) mesh.

  ``strategy="auto"`` picks the strategy ``lrjax.sharding.explain`` predicts fastest for this
  checkpoint on this mesh's devices (``model.tp_plan`` shows why). ``tp == data == 1`` loads onto
  the default device, unsharded.
  """
  import numpy as np

  from lrjax import checkpoint, sharding

  meta = checkpoint.read_metadata(path)
  strategy = strategy or default_strategy(meta["ranks"])
  if tp * data == 1:
    return checkpoint.load(path)
  from lrjax.models import ModelConfig

  cfg = ModelConfig.from_dict(meta["config"])
  mesh = sharding.make_mesh(tp, data)
  emb = meta["params"].get("embed.embedding", {})
  strategy, report = sharding.resolve(
    strategy,
    cfg,
    tp,
    ranks=meta["ranks"],
    heads=meta.get("heads"),
    dtype_bytes=np.dtype(emb.get("dtype", "bfloat16")).itemsize,
    device=mesh.devices.flat[0].device_kind,
  )
  shapes = {k: tuple(v["shape"]) for k, v in meta["params"].items()}
  fn = sharding.param_shardings(cfg, mesh, strategy)
  model = checkpoint.load(path, mesh, lambda key, axes: fn(key, axes, shapes[key]))
  # records the plan (arrays already in place)
  return sharding.shard(model, mesh, strategy, report=report)


def load_engine(path, tp: int = 1, strategy: str | None = None, **engine_kw) -> Engine:
  """An :class:`Engine` over the checkpoint at ``path`` (steps through ``lrjax.fuse`` unless
  ``fuse=False``)."""
  return Engine(load_model(path, tp, strategy), **engine_kw)


__all__ = [
  "Engine",
  "LowRankKVCache",
  "Request",
  "Result",
  "SamplingParams",
  "StepEvents",
  "default_buckets",
  "default_strategy",
  "itl",
  "load_engine",
  "load_model",
  "sample",
]
