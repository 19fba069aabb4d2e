"""Compression of dense Llama-family models into low-rank ones: :func:`compress`, also
exported as ``lrjax.compress``.

``ratio`` is the fraction of each compressed projection's weight parameters removed: a [K, N]
projection gets the largest block-aligned rank r with r·(K + N) ≤ (1 − ratio)·K·N.

Methods: plain truncated SVD, and activation-aware whitening (Cholesky of XᵀX in f64 with a
logged positive-definite repair), both with the √Σ split into u and v (NeuronMM eq. 6-8), block-
aligned ranks (eq. 5), optional per-head q/k/v factorisation (FlashSVD; GQA-aware), MLP-only or
all-linear mode, and LoRA recovery merged back into u and v (eq. 9).
"""

from lrjax.compression.factorize import (
  budget_rank,
  check_rank,
  check_ratio,
  cholesky_factor,
  factorize,
  lowrank_params,
  reconstruct,
)
from lrjax.compression.lora import lora_recover, next_token_loss
from lrjax.compression.modules import HeadwiseLowRankLinear, headwise_apply
from lrjax.compression.pipeline import (
  ALL_PROJS,
  METHODS,
  MLP_PROJS,
  check_tokens,
  compress,
  param_counts,
  plan_ranks,
)

__all__ = [
  "ALL_PROJS",
  "HeadwiseLowRankLinear",
  "METHODS",
  "MLP_PROJS",
  "budget_rank",
  "check_rank",
  "check_ratio",
  "check_tokens",
  "cholesky_factor",
  "compress",
  "factorize",
  "headwise_apply",
  "lora_recover",
  "lowrank_params",
  "next_token_loss",
  "param_counts",
  "plan_ranks",
  "reconstruct",
]
