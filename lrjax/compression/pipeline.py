"""``compress``: dense Llama-family model → low-rank model, in place (NeuronMM §4.1).

``ratio`` is the fraction of each compressed projection's weight parameters removed: a [K, N]
projection gets the largest block-aligned rank r with r·(K + N) ≤ (1 − ratio)·K·N.

Order of work: plan every rank (so a bad ``block`` fails before any calibration), then per layer
(sequentially, so layer i+1 is calibrated on the outputs of the already-compressed layers
0..i): accumulate XᵀX in f64 over all calibration batches, Cholesky (with logged PD repair),
factorise, replace the projections. Then optional LoRA recovery (eq. 9), merged into u and v.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from lrjax.models.llama import MLP_PROJS
from lrjax.models.llama import PROJ_NAMES as ALL_PROJS
from lrjax.compression.factorize import (
  RankBudgetError,
  budget_errors,
  budget_rank,
  check_rank,
  check_ratio,
  cholesky_factor,
  factorize,
  lowrank_params,
)
from lrjax.compression.modules import HeadwiseLowRankLinear
from lrjax.nn.linear import Linear, LowRankLinear

if TYPE_CHECKING:
  from flax import nnx
  from jax.typing import ArrayLike

log = logging.getLogger("lrjax.compression")

METHODS = ("whiten", "svd")

# Projection → input group (as yielded by ``lrjax.models.layer_inputs``).
PROJ_GROUP = {
  "q_proj": "qkv",
  "k_proj": "qkv",
  "v_proj": "qkv",
  "o_proj": "o",
  "gate_proj": "gate_up",
  "up_proj": "gate_up",
  "down_proj": "down",
}


def check_tokens(tokens, vocab_size: int, name: str = "calib_tokens") -> np.ndarray:
  """Integer tokens [batch, seq] with every id in [0, vocab_size)."""
  t = np.asarray(tokens)
  if t.ndim != 2 or not np.issubdtype(t.dtype, np.integer):
    raise ValueError(f"{name}.shape={t.shape} dtype={t.dtype} must be [batch, seq] integers")
  if t.shape[0] < 1 or t.shape[1] < 2:
    raise ValueError(f"{name}.shape={t.shape} needs at least 1 sequence of 2 tokens")
  lo, hi = int(t.min()), int(t.max())
  if lo < 0 or hi >= vocab_size:
    raise ValueError(
      f"{name} has ids in [{lo}, {hi}] outside the vocabulary [0, {vocab_size}); "
      "tokenize with the model's own tokenizer"
    )
  return t.astype(np.int32)


def plan_ranks(
  cfg, *, ratio: float, block: int, mlp_only: bool, per_head: bool, ranks=None
) -> list[dict[str, tuple[int, int]]]:
  """Per layer {proj: (rank, heads)} for the projections to compress.

  ``ranks`` overrides the budget: an int for every projection, or a dict {proj: rank}, or a list
  of such dicts per layer (rank = total rank over heads in per-head mode).
  """
  shapes = cfg.proj_shapes()
  names = MLP_PROJS if mlp_only else ALL_PROJS
  heads_of = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads, "v_proj": cfg.num_kv_heads}
  plan, short = [], []  # short: the projections whose budget no block-aligned rank fits
  for i in range(cfg.num_layers):
    layer = {}
    for p in names:
      k, n = shapes[p]
      heads = heads_of.get(p, 1) if per_head else 1
      where = f"layer {i} {p}"
      override = ranks
      if isinstance(ranks, (list, tuple)):
        if len(ranks) != cfg.num_layers:
          raise ValueError(f"len(ranks)={len(ranks)} must equal num_layers={cfg.num_layers}")
        override = ranks[i]
      if isinstance(override, dict):
        override = override.get(p)
      if override is None:
        try:
          r = budget_rank(k, n, ratio, block, heads=heads, name=where)
        except RankBudgetError as e:
          short.append(e)
          continue
      else:
        r = check_rank(k, n, override, heads=heads, name=where)
        if r % block:
          log.warning("%s: explicit rank %d is not a multiple of block=%d", where, r, block)
      layer[p] = (r, heads)
    plan.append(layer)
  if short:  # one error for all of them, with a block that fits every one
    raise budget_errors(short, block)
  return plan


def compress(
  model: nnx.Module,
  *,
  ratio: float,
  calib_tokens: ArrayLike | None = None,
  method: str = "whiten",
  block: int = 128,
  mlp_only: bool = False,
  per_head: bool = False,
  ranks: int | Mapping[str, int] | Sequence[int | Mapping[str, int]] | None = None,
  calib_batch: int = 8,
  sequential: bool = True,
  lora_steps: int = 0,
  lora_rank: int = 8,
  lora_lr: float = 1e-3,
  lora_tokens: ArrayLike | None = None,
  lora_batch: int = 8,
  lora_seed: int = 0,
  progress: bool = True,
) -> nnx.Module:
  """Compress a dense ``lrjax.models`` model **in place** and return it.

  Args:
    ratio: fraction of each compressed projection's weight parameters removed, in (0, 1).
    calib_tokens: int [batch, seq] calibration tokens; required for ``method="whiten"``. XᵀX is
      accumulated in f64 on the host for one layer at a time (sequential mode).
    method: ``"whiten"`` (activation-aware, Cholesky of XᵀX) or ``"svd"`` (plain truncated SVD).
    block: rank alignment (NeuronMM eq. 5); every rank is a multiple of it.
    mlp_only: compress only gate/up/down (NeuronMM); else all seven projections.
    per_head: factorise q/k/v per head (FlashSVD; k/v per KV head for GQA) into
      :class:`HeadwiseLowRankLinear`; else every projection becomes a ``LowRankLinear``.
    ranks: explicit ranks instead of the ratio budget (int, {proj: rank} or per-layer list).
    calib_batch: sequences per calibration forward.
    sequential: calibrate layer i on the outputs of the already-compressed layers < i.
    lora_steps, lora_rank, lora_lr, lora_tokens, lora_batch, lora_seed: LoRA recovery (eq. 9)
      on the next-token loss over ``lora_tokens`` (default ``calib_tokens``); 0 steps skips it.
      Give at least lora_steps·lora_batch sequences: cycling a small set overfits (logged).
    progress: show tqdm bars.

  Records ``model.compression`` (a JSON-able dict: method, ratio, block, ranks per layer,
  parameter counts, calibration and LoRA settings).
  """
  from lrjax.models import get_proj, layer_inputs, set_proj

  ratio = check_ratio(ratio)
  if method not in METHODS:
    raise ValueError(f"{method=} must be one of {METHODS}")
  for name, val in dict(calib_batch=calib_batch, lora_batch=lora_batch).items():
    if not isinstance(val, int) or val <= 0:
      raise ValueError(f"{name}={val!r} must be a positive int")
  if not isinstance(lora_steps, int) or lora_steps < 0:
    raise ValueError(f"{lora_steps=} must be a non-negative int")
  cfg = model.cfg
  if calib_tokens is not None:
    calib_tokens = check_tokens(calib_tokens, cfg.vocab_size)
  elif method == "whiten":
    raise ValueError(
      'method="whiten" needs calib_tokens [batch, seq]; pass them or use method="svd"'
    )
  if lora_steps:
    src = lora_tokens if lora_tokens is not None else calib_tokens
    if src is None:
      raise ValueError("lora_steps > 0 needs lora_tokens or calib_tokens [batch, seq]")
    lora_tokens = check_tokens(src, cfg.vocab_size, "lora_tokens")
  plan = plan_ranks(
    cfg, ratio=ratio, block=block, mlp_only=mlp_only, per_head=per_head, ranks=ranks
  )
  for i, layer in enumerate(plan):
    for p in layer:
      if not isinstance(get_proj(model, i, p), Linear):
        raise ValueError(
          f"layer {i} {p} is {type(get_proj(model, i, p)).__name__}, not a dense "
          "Linear; compress a dense model (it is already compressed)"
        )
  t0 = time.perf_counter()
  dense_params = sum(_weights(get_proj(model, i, p)) for i, l in enumerate(plan) for p in l)
  repairs: dict[str, str] = {}

  def compress_layer(i, grams):
    for p, (r, heads) in plan[i].items():
      old = get_proj(model, i, p)
      chol = None
      if grams is not None:
        g = PROJ_GROUP[p]
        if not isinstance(grams[g], tuple):
          grams[g] = cholesky_factor(grams[g], name=f"layer {i} {g} input")
          if grams[g][1] != "cholesky":
            repairs[f"{i}.{g}"] = grams[g][1]
        chol = grams[g][0]
      u, v = factorize(
        np.asarray(old.kernel[...], np.float64), r, chol, heads=heads, name=f"layer {i} {p}"
      )
      set_proj(model, i, p, _lowrank_module(old, u, v, r, heads))
      svd_bar.update(1)

  n_calib, bars = 0, []
  if method == "svd":
    svd_bar = tqdm(
      total=sum(map(len, plan)), desc="factorize (svd)", unit="proj", disable=not progress
    )
    bars.append(svd_bar)
    for i in range(cfg.num_layers):
      compress_layer(i, None)
  else:
    batches = [calib_tokens[j : j + calib_batch] for j in range(0, len(calib_tokens), calib_batch)]
    n_calib = int(calib_tokens.size)
    cal_bar = tqdm(
      total=cfg.num_layers * len(batches),
      desc="calibrate (XᵀX, f64)",
      unit="batch",
      disable=not progress,
      position=0,
    )
    svd_bar = tqdm(
      total=sum(map(len, plan)),
      desc="factorize (whitened svd)",
      unit="proj",
      disable=not progress,
      position=1,
    )
    bars += [cal_bar, svd_bar]
    if sequential:
      gens = [layer_inputs(model, b) for b in batches]
      for i in range(cfg.num_layers):
        compress_layer(i, _accumulate(i, (next(g) for g in gens), plan[i], cal_bar))
    else:
      all_grams = [dict() for _ in range(cfg.num_layers)]
      for b in batches:
        for i, xs in layer_inputs(model, b):
          for g, x in _accumulate(i, [(i, xs)], plan[i], cal_bar).items():
            all_grams[i][g] = all_grams[i].get(g, 0) + x
      for i in range(cfg.num_layers):
        compress_layer(i, all_grams[i])
  for b in bars:
    b.close()
  compressed_params = sum(_weights(get_proj(model, i, p)) for i, l in enumerate(plan) for p in l)
  model.compression = {
    "method": method,
    "ratio": ratio,
    "block": int(block),
    "mlp_only": bool(mlp_only),
    "per_head": bool(per_head),
    "rank_rule": "NeuronMM eq. 5 with alpha=0 (round down)",
    "ranks": [{p: int(r) for p, (r, _) in l.items()} for l in plan],
    "heads": [{p: int(h) for p, (_, h) in l.items() if h > 1} for l in plan],
    "params": {
      "dense": int(dense_params),
      "compressed": int(compressed_params),
      "removed_fraction": 1.0 - compressed_params / dense_params,
    },
    "calibration": (
      {
        "tokens": n_calib,
        "sequences": int(calib_tokens.shape[0]),
        "seq_len": int(calib_tokens.shape[1]),
        "batch": calib_batch,
        "sequential": bool(sequential),
        "gram_dtype": "float64",
        "pd_repairs": repairs,
      }
      if method == "whiten"
      else None
    ),
    "lora": None,
    "seconds": round(time.perf_counter() - t0, 3),
  }
  log.info(
    "compressed %d projections (%s, ratio %.3f): %d → %d weights (%.1f%% removed)",
    sum(len(l) for l in plan),
    method,
    ratio,
    dense_params,
    compressed_params,
    100 * model.compression["params"]["removed_fraction"],
  )
  if lora_steps:
    from lrjax.compression.lora import lora_recover

    targets = [(i, p) for i, l in enumerate(plan) for p in l]
    model.compression["lora"] = lora_recover(
      model,
      targets,
      lora_tokens,
      steps=lora_steps,
      rank=lora_rank,
      lr=lora_lr,
      batch=lora_batch,
      seed=lora_seed,
      progress=progress,
    )
  return model


def _accumulate(i, taps, layer_plan, bar):
  """{group: XᵀX (f64)} over the (i, {group: X}) taps of one layer, for groups in the plan."""
  groups = list(dict.fromkeys(PROJ_GROUP[p] for p in layer_plan))  # qkv, o, gate_up, down
  grams = {}
  for li, xs in taps:
    if li != i:
      raise RuntimeError(f"calibration out of step: got layer {li}, expected {i}")
    for g in groups:
      x = np.asarray(jax.device_get(xs[g]), dtype=np.float64)
      if not np.all(np.isfinite(x)):
        bad = int(np.sum(~np.isfinite(x)))
        raise ValueError(
          f"layer {i} {g} input: {bad} NaN/Inf calibration activations; the "
          "model overflows on these tokens (check weights, dtype, or tokens)"
        )
      grams[g] = grams.get(g, 0) + x.T @ x
    bar.update(1)
  return grams


def _weights(m) -> int:
  return m.num_params - (m.out_features if getattr(m, "bias", None) is not None else 0)


def _lowrank_module(old: Linear, u, v, rank: int, heads: int):
  """LowRankLinear (or HeadwiseLowRankLinear) carrying ``old``'s bias, axes and dtypes."""
  from flax import nnx

  dt = old.param_dtype
  bias = None if old.bias is None else old.bias[...]
  if heads == 1:
    make = lambda: LowRankLinear(
      old.in_features,
      old.out_features,
      rank,
      use_bias=bias is not None,
      axes=old.axes,
      dtype=old.dtype,
      param_dtype=dt,
      rngs=nnx.Rngs(0),
    )
  else:
    make = lambda: HeadwiseLowRankLinear(
      old.in_features,
      heads,
      old.out_features // heads,
      rank // heads,
      use_bias=bias is not None,
      axes=old.axes,
      dtype=old.dtype,
      param_dtype=dt,
      rngs=nnx.Rngs(0),
    )
  m = nnx.eval_shape(make)  # structure only: no random init to compile
  m.u.set_value(jnp.asarray(u, dt))
  m.v.set_value(jnp.asarray(v, dt))
  if bias is not None:
    m.bias.set_value(jnp.asarray(bias, dt))
  return m


def param_counts(model) -> dict[str, int]:
  """Weight parameters of all projections: {"dense_equiv", "actual"} (biases excluded)."""
  from lrjax.models import get_proj

  dense = actual = 0
  for i in range(model.cfg.num_layers):
    for p in ALL_PROJS:
      m = get_proj(model, i, p)
      dense += m.in_features * m.out_features
      actual += _weights(m)
  return {"dense_equiv": dense, "actual": actual}


__all__ = [
  "ALL_PROJS",
  "METHODS",
  "MLP_PROJS",
  "check_tokens",
  "compress",
  "lowrank_params",
  "param_counts",
  "plan_ranks",
]
