"""LoRA recovery of a compressed model (NeuronMM eq. 9), trained with optax and merged back.

The factorised weights u' [K, r] and v' [r, N] stay frozen; trainable adapters give
u = u' + B_u·A_u and v = v' + B_v·A_v (B_u [K, a], A_u [a, r], B_v [r, a], A_v [a, N]; per-head
v [H, r_h, d] gets per-head adapters [H, r_h, a]·[H, a, d]). B starts at zero, so training starts
from the compressed model. The loss is the mean next-token cross-entropy. Merging adds B·A into
u and v, whose shapes are unchanged, so every rank stays exactly as compressed (no
re-factorisation is needed: rank(u·v) ≤ r by shape).
"""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

log = logging.getLogger("lrjax.compression")


def init_adapters(model, targets, rank: int, key) -> list[dict[str, jax.Array]]:
  """Adapters for each (layer, proj) target: B zeros, A ~ N(0, 1/a)."""
  from lrjax.models import get_proj

  if not isinstance(rank, int) or rank <= 0:
    raise ValueError(f"lora_rank={rank!r} must be a positive int")
  out = []
  for i, p in targets:
    m = get_proj(model, i, p)
    ad = {}
    for name in ("u", "v"):
      shape = getattr(m, name)[...].shape
      *lead, rows, cols = shape
      a = min(rank, rows, cols)
      key, sub = jax.random.split(key)
      ad["b" + name] = jnp.zeros((*lead, rows, a), jnp.float32)
      ad["a" + name] = jax.random.normal(sub, (*lead, a, cols), jnp.float32) / np.sqrt(a)
    out.append(ad)
  return out


def apply_adapters(model, targets, adapters) -> None:
  """u += B_u·A_u and v += B_v·A_v on ``model``'s target projections (in place)."""
  from lrjax.models import get_proj

  for (i, p), ad in zip(targets, adapters):
    m = get_proj(model, i, p)
    for name in ("u", "v"):
      w = getattr(m, name)
      w[...] = (w[...].astype(jnp.float32) + ad["b" + name] @ ad["a" + name]).astype(w[...].dtype)


def next_token_loss(model, tokens):
  """Mean cross-entropy (nats) of predicting tokens[:, 1:] from tokens[:, :-1]."""
  logits = model(tokens[:, :-1]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def module_paths(model, targets) -> list[tuple]:
  """Graph path of each (layer, proj) target module inside ``model``."""
  from lrjax.models import get_proj

  where = {id(node): path for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)}
  return [where[id(get_proj(model, i, p))] for i, p in targets]


def adapter_model(graphdef, state, paths, adapters):
  """The model (graphdef, state) with ``adapters`` added to u and v, built functionally.

  No mutation, so it can be differentiated w.r.t. ``adapters`` under jit.
  """
  delta = {}
  for path, ad in zip(paths, adapters):
    for name in ("u", "v"):
      delta[tuple(path) + (name,)] = ad["b" + name] @ ad["a" + name]
  flat = [
    (
      p,
      v.replace((v[...].astype(jnp.float32) + delta[p]).astype(v[...].dtype)) if p in delta else v,
    )
    for p, v in nnx.to_flat_state(state)
  ]
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def lora_recover(
  model,
  targets,
  tokens,
  *,
  steps: int,
  rank: int = 8,
  lr: float = 1e-3,
  batch: int = 8,
  seed: int = 0,
  progress: bool = True,
) -> dict:
  """Train adapters on ``targets`` [(layer, proj)] for ``steps`` Adam steps, merge, return a record.

  The learning rate warms up over the first 10% of steps to ``lr``, then decays to 0 (cosine).

  ``tokens`` int [n, seq]: minibatches of ``batch`` rows are drawn in a seeded random order
  (reshuffled every pass).
  """
  if not isinstance(steps, int) or steps <= 0:
    raise ValueError(f"lora_steps={steps!r} must be a positive int")
  if not (isinstance(lr, (int, float)) and lr > 0):
    raise ValueError(f"lora_lr={lr!r} must be a positive float")
  tokens = np.asarray(tokens, np.int32)
  passes = steps * batch / len(tokens)
  if passes > 1:
    log.warning(
      "LoRA: %d steps × %d sequences revisit each of the %d training sequences %.1f "
      "times; pass more lora_tokens if the held-out loss rises (overfitting)",
      steps,
      batch,
      len(tokens),
      passes,
    )
  t0 = time.perf_counter()
  graphdef, state = nnx.split(model)
  paths = module_paths(model, targets)
  adapters = init_adapters(model, targets, rank, jax.random.key(seed))
  sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 10), steps, 0.0)
  opt = optax.adam(sched)
  opt_state = opt.init(adapters)

  @jax.jit
  def step(adapters, opt_state, state, tok):
    loss, g = jax.value_and_grad(
      lambda ad: next_token_loss(adapter_model(graphdef, state, paths, ad), tok)
    )(adapters)
    upd, opt_state = opt.update(g, opt_state, adapters)
    return optax.apply_updates(adapters, upd), opt_state, loss

  rng = np.random.default_rng(seed)
  order, pos = rng.permutation(len(tokens)), 0
  losses = []
  bar = tqdm(range(steps), desc="LoRA", unit="step", disable=not progress)
  for _ in bar:
    if pos + batch > len(order):
      order, pos = rng.permutation(len(tokens)), 0
    tok = jnp.asarray(tokens[order[pos : pos + batch]])
    pos += batch
    adapters, opt_state, loss = step(adapters, opt_state, state, tok)
    losses.append(float(loss))
    bar.set_postfix(loss=f"{losses[-1]:.4f}")
  bar.close()
  apply_adapters(model, targets, adapters)
  k = max(1, min(20, steps // 5))
  rec = {
    "steps": steps,
    "rank": rank,
    "lr": lr,
    "batch": batch,
    "seed": seed,
    "optimizer": "adam, 10% warmup + cosine decay to 0",
    "frozen_factors": True,
    "merged": True,
    "loss_first": float(np.mean(losses[:k])),
    "loss_last": float(np.mean(losses[-k:])),
    "tokens": int(tokens.size),
    "seconds": round(time.perf_counter() - t0, 3),
  }
  log.info(
    "LoRA: %d steps, train loss %.4f → %.4f (merged into u, v; ranks unchanged)",
    steps,
    rec["loss_first"],
    rec["loss_last"],
  )
  return rec
