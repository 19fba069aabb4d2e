"""Compile a sharded decoder layer / model and measure its collectives and its logits error.

Used by ``benchmarks/tp_collectives.py`` and the sharding tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lrjax.sharding import hlo
from lrjax.sharding import make_mesh, shard

PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def compressed_ranks(cfg, ratio: float, multiple: int = 8) -> dict[str, int]:
  """Per-projection rank keeping (1 - ratio) of each weight's params, rounded to ``multiple``."""
  out = {}
  for name, (k, n) in cfg.proj_shapes().items():
    r = (1.0 - ratio) * k * n / (k + n)
    out[name] = max(multiple, int(round(r / multiple)) * multiple)
  return out


def _layer_fn(cfg):
  from lrjax.models import rope_inv_freq

  inv = np.asarray(rope_inv_freq(cfg), np.float32)

  def fn(layer, h):
    b, s, _ = h.shape
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((s, s), bool)), (b, s, s))
    return layer(h, pos, jnp.asarray(inv), mask)[0]

  return fn


def layer_hlo(layer, cfg, h, *, fused: bool = False) -> str:
  """Compiled HLO text of one decoder layer's forward on ``h`` [B, S, hidden]."""
  fn = _layer_fn(cfg)
  if fused:
    import lrjax

    fn = lrjax.fuse(fn)
  return nnx.jit(fn).lower(layer, h).compile().as_text()


def weight_shapes(model) -> list[tuple[int, ...]]:
  _, state = nnx.split(model)
  return [tuple(v.shape) for _, v in nnx.to_flat_state(state) if len(v.shape) >= 2]


def measure(
  make_model,
  cfg,
  strategy: str,
  tp: int,
  *,
  batch: int = 2,
  seq: int = 8,
  seed: int = 0,
  fused: bool = False,
) -> dict:
  """One record: collectives of one sharded layer per token, and the logits error vs 1 device.

  ``make_model()`` must return the same model (same weights) on every call. With ``fused`` the
  forward goes through ``lrjax.fuse`` and the CPU stand-in kernels of
  :mod:`lrjax.sharding.testing` (opaque custom calls), so the HLO shows the kernels partitioned.
  """
  import contextlib

  import lrjax
  from lrjax.sharding import testing

  ref_model = make_model()
  tokens = jax.random.randint(jax.random.key(seed), (batch, seq), 0, cfg.vocab_size)
  ref = np.asarray(nnx.jit(lambda m, t: m(t))(ref_model, tokens), np.float64)
  model = shard(make_model(), make_mesh(tp), strategy)
  if fused:
    fwd = lambda m, t: lrjax.fuse(lambda mm, tt: mm(tt))(m, t)  # noqa: E731
    run_ctx, hlo_ctx = testing.callback_kernels(execute=True), testing.callback_kernels()
  else:
    fwd = lambda m, t: m(t)  # noqa: E731
    run_ctx = hlo_ctx = contextlib.nullcontext()
  with run_ctx:
    out = np.asarray(nnx.jit(fwd)(model, tokens), np.float64)
  err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
  h = jax.random.normal(jax.random.key(seed + 1), (batch, seq, cfg.hidden_size), jnp.float32)
  with hlo_ctx:
    text = layer_hlo(model.layers[0], cfg, h, fused=fused)
  colls = hlo.collectives(text)
  s = hlo.summarize(colls)
  n_tok = batch * seq
  gathers = hlo.weight_gathers(colls, weight_shapes(model.layers[0]))
  layer_bytes = sum(
    v[...].addressable_shards[0].data.nbytes
    for _, v in nnx.to_flat_state(nnx.split(model.layers[0])[1])
  )
  return {
    "strategy": strategy,
    "tp": tp,
    "fused": fused,
    "layer_weight_bytes_per_device": layer_bytes,
    "bytes_per_token": s["cost_bytes"] / n_tok,
    "n_collectives": s["n"],
    "max_rel_logit_err": err,
    "by_kind": {
      k: {"n": v["n"], "bytes_per_token": v["bytes"] / n_tok} for k, v in s["by_kind"].items()
    },
    "kernel_custom_calls": text.count("custom-call(") if fused else 0,
    "whole_weight_all_gathers": len(gathers),
  }
