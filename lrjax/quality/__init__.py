"""Quality harness: a Markov source with an exact entropy rate, a small Llama trained on it
(cached by config), and excess-nats reports for compressed variants."""

from lrjax.quality.report import VARIANTS, EvalConfig, evaluate, format_table, quality_table
from lrjax.quality.source import MarkovSource, SourceConfig, describe
from lrjax.quality.train import (
  TrainConfig,
  cache_key,
  default_cache_dir,
  default_model_config,
  train_model,
  trained_model,
)

__all__ = [
  "EvalConfig",
  "MarkovSource",
  "SourceConfig",
  "TrainConfig",
  "VARIANTS",
  "cache_key",
  "default_cache_dir",
  "default_model_config",
  "describe",
  "evaluate",
  "format_table",
  "quality_table",
  "train_model",
  "trained_model",
]
