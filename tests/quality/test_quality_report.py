"""The quality harness end to end on a tiny config: rows, checks and the printed table."""

import pytest

from lrjax.models import ModelConfig
from lrjax.quality import (
  EvalConfig,
  MarkovSource,
  SourceConfig,
  TrainConfig,
  format_table,
  quality_table,
)


@pytest.mark.slow
def test_quality_table_tiny(tmp_path):
  src = MarkovSource(SourceConfig(vocab=64, groups=2, support=3, seed=4))
  mcfg = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
  )
  res = quality_table(
    (0.3,),
    variants=("svd", "whiten", "whiten+lora"),
    src=src,
    model_cfg=mcfg,
    train_cfg=TrainConfig(steps=30, warmup=5, batch=8, seq_len=16),
    eval_cfg=EvalConfig(eval_seqs=32, calib_seqs=16, lora_steps=3, lora_batch=4, block=4),
    cache_dir=str(tmp_path),
    progress=False,
  )
  assert [r["variant"] for r in res["rows"]] == ["svd", "whiten", "whiten+lora"]
  floor = src.entropy_rate
  assert res["source"]["entropy_rate_nats"] == floor
  for r in [res["dense"]] + res["rows"]:
    assert abs(r["ce_nats"] - floor - r["excess_nats"]) < 1e-9
    assert r["excess_paired"] > -0.05  # nothing beats the true source by much
  for r in res["rows"]:
    assert r["removed_fraction"] >= 0.3 and r["weights"] < res["dense"]["weights"]
  assert res["rows"][2]["lora"]["steps"] == 3
  table = format_table(res)
  assert "whiten+lora" in table and f"{floor:.4f}" in table
