"""Quality of compressed models in excess nats over the exact entropy floor of the source.

``excess_nats`` = mean cross-entropy of the model on held-out source tokens (targets at positions
≥ ``MarkovSource.floor_from``) − the source's exact entropy rate. ``excess_paired`` subtracts the
true model's cross-entropy on the same tokens instead (a lower-variance KL estimate; its
``stderr_paired`` is over per-sequence means).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lrjax.quality.source import MarkovSource, describe
from lrjax.quality.train import TrainConfig, default_model_config, trained_model

log = logging.getLogger("lrjax.quality")

VARIANTS = ("svd", "whiten", "whiten+lora")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  eval_seqs: int = 4096
  calib_seqs: int = 64
  lora_seqs: int | None = None  # default lora_steps·lora_batch: one pass, no repeats
  lora_steps: int = 200
  lora_rank: int = 8
  lora_lr: float = 1e-3
  lora_batch: int = 32
  block: int = 4
  seed: int = 12345


@nnx.jit
def _ce_per_token(model, tokens):
  logits = model(tokens[:, :-1]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])


def evaluate(model, src: MarkovSource, tokens, batch: int = 64) -> dict:
  """Cross-entropy and excess nats of ``model`` on ``tokens`` [n, seq] from ``src``."""
  tokens = np.asarray(tokens, np.int32)
  ce = np.concatenate(
    [
      np.asarray(_ce_per_token(model, jnp.asarray(tokens[i : i + batch])))
      for i in range(0, len(tokens), batch)
    ]
  )
  ce = ce[:, src.floor_from - 1 :]  # targets at positions >= floor_from
  true_ce = -src.log_prob_next(tokens)
  mean = float(ce.mean())
  return {
    "ce_nats": mean,
    "excess_nats": mean - src.entropy_rate,
    "excess_paired": mean - float(true_ce.mean()),
    "stderr_paired": float((ce - true_ce).mean(axis=1).std() / np.sqrt(len(ce))),
    "sample_floor_nats": float(true_ce.mean()),
    "eval_tokens": int(ce.size),
  }


def quality_table(
  ratios=(0.1, 0.2, 0.4),
  *,
  variants=VARIANTS,
  src: MarkovSource | None = None,
  model_cfg=None,
  train_cfg: TrainConfig | None = None,
  eval_cfg: EvalConfig = EvalConfig(),
  cache_dir: str | None = None,
  progress: bool = True,
) -> dict:
  """Train (or reuse) the harness model, compress it each way at each ratio, and score it.

  Variants: ``svd`` (plain), ``whiten``, ``whiten+lora`` (LoRA recovery on fresh source
  tokens), ``whiten+per_head`` (q/k/v per head). Returns a JSON-able dict with the source, the
  model, the training record, the dense row and one row per (variant, ratio).
  """
  from lrjax.compression import compress, param_counts

  src = src or MarkovSource()
  ec = eval_cfg
  train_cfg = train_cfg or TrainConfig()
  model, train_rec = trained_model(
    src, model_cfg, train_cfg, cache_dir=cache_dir, progress=progress
  )
  seq = train_cfg.seq_len  # RoPE is only trained up to this length
  eval_tok = src.sample(ec.eval_seqs, seq + 1, seed=ec.seed)
  calib_tok = src.sample(ec.calib_seqs, seq, seed=ec.seed + 1)
  lora_tok = src.sample(ec.lora_seqs or ec.lora_steps * ec.lora_batch, seq + 1, seed=ec.seed + 2)
  dense = {
    "variant": "dense",
    "ratio": 0.0,
    **evaluate(model, src, eval_tok),
    "weights": param_counts(model)["actual"],
  }
  rows = []
  for ratio in ratios:
    for variant in variants:
      m = nnx.clone(model)
      kw = dict(ratio=ratio, block=ec.block, progress=progress)
      if variant == "svd":
        kw.update(method="svd")
      else:
        kw.update(method="whiten", calib_tokens=calib_tok, per_head=variant == "whiten+per_head")
      if variant == "whiten+lora":
        kw.update(
          lora_steps=ec.lora_steps,
          lora_rank=ec.lora_rank,
          lora_lr=ec.lora_lr,
          lora_batch=ec.lora_batch,
          lora_tokens=lora_tok,
        )
      elif variant not in ("svd", "whiten", "whiten+per_head"):
        raise ValueError(f"{variant=} must be one of {VARIANTS + ('whiten+per_head',)}")
      t0 = time.perf_counter()
      compress(m, **kw)
      rec = m.compression
      row = {
        "variant": variant,
        "ratio": ratio,
        **evaluate(m, src, eval_tok),
        "removed_fraction": rec["params"]["removed_fraction"],
        "weights": param_counts(m)["actual"],
        "ranks_layer0": rec["ranks"][0],
        "compress_seconds": round(time.perf_counter() - t0, 2),
      }
      if rec["lora"]:
        row["lora"] = {
          k: rec["lora"][k] for k in ("steps", "rank", "lr", "loss_first", "loss_last")
        }
      if rec["calibration"]:
        row["pd_repairs"] = rec["calibration"]["pd_repairs"]
      log.info("%s @ %.2f: excess %.4f nats", variant, ratio, row["excess_nats"])
      rows.append(row)
  return {
    "source": describe(src),
    "model": (model_cfg or default_model_config(src.cfg.vocab)).to_dict(),
    "train": train_rec,
    "eval": dataclasses.asdict(ec),
    "dense": dense,
    "rows": rows,
  }


def format_table(result: dict) -> str:
  """Excess nats per variant (rows) and ratio (columns), with the dense baseline."""
  rows = result["rows"]
  ratios = sorted({r["ratio"] for r in rows})
  variants = list(dict.fromkeys(r["variant"] for r in rows))
  cell = {(r["variant"], r["ratio"]): r for r in rows}
  floor = result["source"]["entropy_rate_nats"]
  lines = [
    f"entropy floor {floor:.4f} nats/token; dense excess {result['dense']['excess_nats']:.4f} nats",
    "excess nats over the floor (removed fraction of projection weights)",
    f"{'variant':<18}" + "".join(f"{'ratio ' + format(q, 'g'):>20}" for q in ratios),
  ]
  for v in variants:
    lines.append(
      f"{v:<18}"
      + "".join(
        f"{cell[v, q]['excess_nats']:>12.4f} ({cell[v, q]['removed_fraction']:.2f})" for q in ratios
      )
    )
  return "\n".join(lines)
