"""The TP cost model and ``auto`` (no devices needed): the param inventory against real models,
weights per device, collective counts, the choice under different constants, the data table's
fallbacks and the strategy names the CLI offers."""

import dataclasses

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from lrjax import sharding as S
from lrjax.models import LlamaForCausalLM, ModelConfig
from lrjax.serving.cli import STRATEGY_CHOICES
from lrjax.sharding import cost
from lrjax.sharding.analysis import compressed_ranks

TINY = dict(hidden_size=64, intermediate_size=128, num_heads=8, num_kv_heads=4, head_dim=8)


@pytest.mark.parametrize(
  "kw,drop,heads",
  [
    ({}, (), {}),
    ({"model_type": "qwen2", "qkv_bias": True, "tie_word_embeddings": True}, ("k_proj",), {}),
    ({"model_type": "qwen3", "qk_norm": True, "mlp_bias": True}, ("down_proj",), {"q_proj": 8}),
  ],
)
def test_inventory_matches_the_model(kw, drop, heads):
  cfg = ModelConfig.tiny(**TINY, num_layers=2, **kw)
  r = {k: v for k, v in compressed_ranks(cfg, 0.4, 8).items() if k not in drop}
  m = LlamaForCausalLM(cfg, ranks=[r] * 2, heads=[heads] * 2 if heads else None, rngs=nnx.Rngs(0))
  real = {
    ".".join(map(str, p)): (tuple(v.shape), tuple(v.get_metadata().get("out_sharding") or ()))
    for p, v in nnx.to_flat_state(nnx.split(m)[1])
  }
  inv = {p.key: (p.shape, p.axes) for p in cost.param_inventory(cfg, [r] * 2, [heads] * 2)}
  assert inv == real


def _proj_bytes(strategy, cfg, ranks, tp):
  """Bytes per device of the projection params (and the layer norms) under ``strategy``."""
  tot = dev = 0
  for p in cost.param_inventory(cfg, ranks):
    if p.key.startswith("layers."):
      n = (
        2
        * p.shape[0]
        * (p.shape[1] if len(p.shape) > 1 else 1)
        * (p.shape[2] if len(p.shape) > 2 else 1)
      )
      tot += n
      dev += n // cost._spec_split(strategy, p, tp)
  return tot, dev


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("preset", [ModelConfig.llama3_8b, ModelConfig.llama3_70b])
def test_split_holds_lowrank_bytes_over_tp(preset, tp):
  cfg = preset().replace(num_layers=2)
  ranks = [compressed_ranks(cfg, 0.4, 64)] * 2
  tot, dev = _proj_bytes("lowrank_split", cfg, ranks, tp)
  assert dev * tp == tot  # no factor (nor norm) replicated
  # the others replicate some factors: lowrank_tp its row v, lowrank_megatron col u and row v
  for s in ("lowrank_tp", "lowrank_megatron", "repl_u_tp"):
    assert _proj_bytes(s, cfg, ranks, tp)[1] * tp > tot
  c = cost.predict("lowrank_split", cfg, ranks, tp)
  m = cost.predict("lowrank_megatron", cfg, ranks, tp)
  assert c.weight_bytes < m.weight_bytes


def test_collectives_per_layer():
  cfg = ModelConfig.llama3_8b()
  r = compressed_ranks(cfg, 0.4, 64)
  n = {s: len(cost.layer_collectives(s, cfg, r, 2)) for s in S.STRATEGIES}
  assert n == {
    "dense": 2,
    "naive_tp": 7,
    "lowrank_tp": 7,
    "repl_u_tp": 9,
    "lowrank_split": 4,
    "lowrank_megatron": 2,
  }
  split = cost.layer_collectives("lowrank_split", cfg, r, 2)
  assert [c.elems for c in split] == [
    r["q_proj"] + r["k_proj"] + r["v_proj"] + 1,
    r["o_proj"],
    r["gate_proj"] + r["up_proj"] + 1,
    r["down_proj"],
  ]
  # rank space: each all-reduce moves less than Megatron's hidden-size one
  assert all(c.cost_bytes_per_token < 2 * 2 * cfg.hidden_size * 2 for c in split)


def test_choice_follows_the_constants():
  cfg = ModelConfig.llama3_70b().replace(num_layers=4)
  ranks = [compressed_ranks(cfg, 0.4, 64)] * 4
  ic = cost.interconnect_for("NVIDIA H200")[0]
  # no collective latency: the fewest bytes per device wins (no factor replicated)
  free = dataclasses.replace(ic, name="free", latency_us=0.0, link_gbps=1e9)
  rep = cost.explain(cfg, ranks, 8, interconnect=free)
  assert rep.choice == "lowrank_split"
  # collectives 100x dearer: Megatron's count wins
  slow = dataclasses.replace(ic, name="slow", latency_us=1700.0)
  assert cost.explain(cfg, ranks, 8, interconnect=slow).choice == "lowrank_megatron"
  # the report: fastest first, every strategy, dense marked inapplicable, why in words
  ms = [c.ms for c in rep.costs if c.ms is not None]
  assert ms == sorted(ms) and rep.costs[0].strategy == rep.choice
  assert {c.strategy for c in rep.costs} == set(S.STRATEGIES)
  assert next(c for c in rep.costs if c.strategy == "dense").ms is None
  text = str(rep)
  assert "auto → lowrank_split at tp=8" in text and "(merged dense)" in text
  assert "predicted fastest" in rep.reason


def test_dense_model_and_infeasible_tp():
  cfg = ModelConfig.tiny(**TINY, num_layers=1)
  assert cost.choose(cfg, None, 4) == "dense"
  r = [compressed_ranks(cfg, 0.4, 8)]
  rep = cost.explain(cfg, r, 8)  # 4 KV heads cannot split 8 ways
  assert rep.choice == "naive_tp"
  assert "does not apply" in next(c.note for c in rep.costs if c.strategy == "lowrank_split")
  with pytest.raises(ValueError, match="no sharding strategy applies"):
    cost.explain(cfg, [{k: 9 for k in r[0]}], 8)  # ranks no strategy can split


def test_interconnect_table_fallbacks():
  e, how = cost.interconnect_for("NVIDIA H200")
  assert e.measured and "tp_h200.json" in e.source and "measured" in how
  e, how = cost.interconnect_for("NVIDIA H100 PCIe")
  assert e.name == "NVIDIA H100 80GB HBM3" and "nearest" in how and "not measured" in how
  e, how = cost.interconnect_for("cpu")
  assert e.name == cost.table()[1] and "the default" in how


def test_strategy_names():
  assert set(STRATEGY_CHOICES) == set(S.STRATEGIES) | {S.AUTO}
  with pytest.raises(ValueError, match="auto"):
    S.check_strategy("megatron")
  key = "layers.0.attn.q_proj"
  assert S.param_spec("lowrank_split", key + ".u", ("embed", "rank"), 2) == P("tp", None)
  assert S.param_spec("lowrank_split", key + ".v", ("rank", "heads"), 2) == P(None, "tp")
  assert S.param_spec("lowrank_split", "layers.0.mlp.down_proj.v", ("rank", "embed"), 2) == P(
    None, "tp"
  )
  assert S.param_spec("lowrank_split", "layers.0.input_layernorm.weight", ("embed",), 1) == P("tp")
  assert S.param_spec("lowrank_split", key + ".kernel", ("embed", "heads"), 2) == P("tp", None)
  assert S.param_spec("lowrank_megatron", key + ".u", ("embed", "rank"), 2) == P()
  assert S.param_spec("lowrank_megatron", "layers.0.attn.o_proj.v", ("rank", "embed"), 2) == P()
  assert S.cache_spec("lowrank_split") == P("data", "tp")


def test_shard_auto_on_one_device():
  cfg = ModelConfig.tiny(**TINY, num_layers=1)
  m = LlamaForCausalLM(cfg, ranks=[compressed_ranks(cfg, 0.4, 8)], rngs=nnx.Rngs(0))
  S.shard(m, S.make_mesh(1, devices=jax.devices()[:1]), "auto", batch=4, ctx=64)
  plan = m.tp_plan
  assert plan.strategy in S.STRATEGIES and plan.explain.choice == plan.strategy
  assert plan.explain.batch == 4 and plan.explain.ctx == 64
  assert repr(plan).startswith(f"TPPlan({plan.strategy}, tp=1")
