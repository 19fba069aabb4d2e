"""A small Llama trained on :class:`MarkovSource` with optax, cached on disk by config.

The cache key is a SHA-256 of the source, model and training configs, :data:`CACHE_VERSION`
and the text of the modules that define the source, the model and the training loop, so a cache
entry is only reused for exactly the configuration and code that produced it. Weights are
stored as ``.npz`` (read with ``allow_pickle=False``) next to a JSON record; writes are atomic
(temp dir, then rename).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from lrjax.quality.source import MarkovSource, SourceConfig

log = logging.getLogger("lrjax.quality")

CACHE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 1000
  batch: int = 32
  seq_len: int = 32
  lr: float = 5e-3
  warmup: int = 100
  weight_decay: float = 0.0
  seed: int = 0


def default_model_config(vocab: int = 256):
  """The harness model: Llama-3 style, hidden 128, 2 layers, GQA 4/2 heads of 32, MLP 384."""
  from lrjax.models import ModelConfig

  return ModelConfig(
    vocab_size=vocab,
    hidden_size=128,
    intermediate_size=384,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    max_position_embeddings=512,
  )


def default_cache_dir() -> str:
  return os.path.join(
    os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "lrjax", "quality"
  )


def code_digest() -> str:
  """SHA-256 of the modules whose code decides what a trained model is."""
  import lrjax.compression.lora
  import lrjax.models.config
  import lrjax.models.llama
  import lrjax.nn.linear
  import lrjax.quality.source

  h = hashlib.sha256()
  for mod in (
    lrjax.models.config,
    lrjax.models.llama,
    lrjax.nn.linear,
    lrjax.quality.source,
    lrjax.compression.lora,
    sys.modules[__name__],
  ):
    with open(mod.__file__, "rb") as fh:
      h.update(fh.read())
  return h.hexdigest()


def cache_key(src_cfg: SourceConfig, model_cfg, train_cfg: TrainConfig) -> str:
  blob = json.dumps(
    {
      "version": CACHE_VERSION,
      "source": dataclasses.asdict(src_cfg),
      "model": model_cfg.to_dict(),
      "train": dataclasses.asdict(train_cfg),
      "code": code_digest(),
    },
    sort_keys=True,
  )
  return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _flat_params(model) -> dict[str, np.ndarray]:
  _, params = nnx.split(model, nnx.Param)
  return {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(params)}


def _load_params(model, arrays) -> None:
  _, params = nnx.split(model, nnx.Param)
  flat = nnx.to_flat_state(params)
  names = {".".join(map(str, p)) for p, _ in flat}
  if names != set(arrays):
    raise ValueError(
      f"cached weights do not match the model: missing "
      f"{sorted(names - set(arrays))[:5]}, extra {sorted(set(arrays) - names)[:5]}"
    )
  for p, v in flat:
    a = arrays[".".join(map(str, p))]
    if a.shape != v[...].shape:
      raise ValueError(
        f"cached {'.'.join(map(str, p))} has shape {a.shape}, expected {v[...].shape}"
      )
    v[...] = jnp.asarray(a, v[...].dtype)


def train_model(src: MarkovSource, model_cfg, train_cfg: TrainConfig, *, progress: bool = True):
  """Train a fresh ``LlamaForCausalLM`` on fresh source samples; returns (model, record)."""
  from lrjax.compression.lora import next_token_loss
  from lrjax.models import LlamaForCausalLM

  if model_cfg.vocab_size != src.cfg.vocab:
    raise ValueError(
      f"model vocab_size={model_cfg.vocab_size} must equal source vocab={src.cfg.vocab}"
    )
  tc = train_cfg
  model = LlamaForCausalLM(model_cfg, rngs=nnx.Rngs(tc.seed))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  sched = optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup, tc.steps, tc.lr * 0.05)
  opt = optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=tc.weight_decay)
  )
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state, rest, tok):
    loss, g = jax.value_and_grad(lambda p: next_token_loss(nnx.merge(graphdef, p, rest), tok))(
      params
    )
    upd, opt_state = opt.update(g, opt_state, params)
    return optax.apply_updates(params, upd), opt_state, loss

  t0 = time.perf_counter()
  losses = []
  bar = tqdm(range(tc.steps), desc="train", unit="step", disable=not progress)
  for i in bar:
    tok = jnp.asarray(src.sample(tc.batch, tc.seq_len + 1, seed=1_000_000 + tc.seed * 100_000 + i))
    params, opt_state, loss = step(params, opt_state, rest, tok)
    losses.append(float(loss))
    if i % 50 == 0:
      bar.set_postfix(loss=f"{losses[-1]:.4f}")
  bar.close()
  nnx.update(model, params)
  rec = {
    "steps": tc.steps,
    "seconds": round(time.perf_counter() - t0, 2),
    "final_train_loss": float(np.mean(losses[-50:])),
  }
  return model, rec


def trained_model(
  src: MarkovSource | None = None,
  model_cfg=None,
  train_cfg: TrainConfig | None = None,
  *,
  cache_dir: str | None = None,
  progress: bool = True,
):
  """The trained harness model, from the cache when an entry for this exact config exists.

  Returns (model, record); record["cached"] says whether it came from the cache. ``cache_dir``
  None uses :func:`default_cache_dir`; pass ``""`` to disable caching.
  """
  from lrjax.models import LlamaForCausalLM

  src = src or MarkovSource()
  model_cfg = model_cfg or default_model_config(src.cfg.vocab)
  train_cfg = train_cfg or TrainConfig()
  cache_dir = default_cache_dir() if cache_dir is None else cache_dir
  key = cache_key(src.cfg, model_cfg, train_cfg)
  entry = os.path.join(cache_dir, key) if cache_dir else None
  if entry and os.path.isfile(os.path.join(entry, "record.json")):
    with open(os.path.join(entry, "record.json")) as fh:
      rec = json.load(fh)
    model = LlamaForCausalLM(model_cfg, rngs=nnx.Rngs(0))
    with np.load(os.path.join(entry, "weights.npz"), allow_pickle=False) as z:
      _load_params(model, {k: z[k] for k in z.files})
    log.info("reused cached trained model %s", entry)
    return model, {**rec, "cached": True, "cache_entry": entry}
  model, rec = train_model(src, model_cfg, train_cfg, progress=progress)
  rec = {
    **rec,
    "key": key,
    "source": dataclasses.asdict(src.cfg),
    "model": model_cfg.to_dict(),
    "train": dataclasses.asdict(train_cfg),
    "cache_version": CACHE_VERSION,
  }
  if entry:
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{key}.", dir=cache_dir)
    try:
      np.savez(os.path.join(tmp, "weights.npz"), **_flat_params(model))
      with open(os.path.join(tmp, "record.json"), "w") as fh:
        json.dump(rec, fh, indent=1)
      os.replace(tmp, entry)
    except OSError:
      shutil.rmtree(tmp, ignore_errors=True)
      if not os.path.isfile(os.path.join(entry, "record.json")):
        raise
    log.info("cached trained model in %s", entry)
  return model, {**rec, "cached": False, "cache_entry": entry}
