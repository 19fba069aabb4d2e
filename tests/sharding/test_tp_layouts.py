"""The lowrank_split and lowrank_megatron layouts and ``auto`` on 2, 4 and 8 simulated CPU devices
(one subprocess: the device count must be set before jax starts): logits against one device,
the collectives of the compiled HLO against the cost model's, the stand-in kernels on local
shards, and the serving engine and CLI."""

import json
import os
import random
import subprocess
import sys

import pytest

from conftest import tolerance

SCRIPT = os.path.join(os.path.dirname(__file__), "tp_layouts_script.py")
F32_TOL = tolerance("float32")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  seed = random.randrange(1 << 20)
  tmp = tmp_path_factory.mktemp("tp_layouts")
  p = subprocess.run(
    [sys.executable, SCRIPT, "numerics,hlo,serving", str(seed), str(tmp)],
    capture_output=True,
    text=True,
    env=env,
    timeout=900,
  )
  lines = [l for l in p.stdout.splitlines() if l.startswith("JSON")]
  assert p.returncode == 0 and lines, f"seed={seed} rc={p.returncode}\n{p.stderr[-3000:]}"
  out = json.loads(lines[-1][4:])
  assert out["n_devices"] == 8
  out["seed"] = seed
  return out


@pytest.mark.slow
def test_logits_equal_one_device(run):
  recs = run["numerics"]
  seen = {(r["config"], r["strategy"], r["tp"]) for r in recs}
  # the new layout at TP 2, 4 and 8; Llama (GQA, o/mlp biases), Qwen2 (qkv biases, tied
  # embeddings), Qwen3 (q/k norms); a model with dense k_proj and down_proj, one with per-head
  # q/k factors
  assert {("llama", "lowrank_split", t) for t in (2, 4, 8)} <= seen
  assert {("qwen2", "lowrank_split", 8), ("qwen3", "lowrank_split", 4)} <= seen
  assert ("llama_mixed", "lowrank_split", 4) in seen
  assert ("llama_headwise", "lowrank_split", 8) in seen  # per-head q/k factors
  for r in recs:
    assert r["rel_err"] < F32_TOL, (r, run["seed"])
    if r["strategy"] == "lowrank_split":
      assert r.get("layer_class", "SplitDecoderLayer") == "SplitDecoderLayer"
  # prefill into the KV cache (split on KV heads) and decode steps
  assert run["decode_rel_err"] < F32_TOL, run["seed"]
  # each layer's decode attention (with RoPE and the cache writes) on the device's heads at
  # TP 4 (16 query and 8 KV heads of 8): q [2, 4, 8], the cache buffers whole (12
  # positions), the attended length a bound
  want = [[[2, 16 // 4, 8], [2, 8 // 4, 12, 8]]] * 2
  got = [[ops[0], ops[1]] for ops, _ in run["split_decode_attention"]]
  assert got == want, run["split_decode_attention"]
  assert {length for _, length in run["split_decode_attention"]} == {8}
  # bf16: no less accurate than the one-device bf16 model, against f32 on the same weights
  b = run["bf16"]
  assert b["split_err"] <= max(1.25 * b["single_err"], tolerance("bfloat16")), (b, run["seed"])


@pytest.mark.slow
def test_auto_picks_and_explains(run):
  (r,) = [r for r in run["numerics"] if r["strategy"] == "auto"]
  assert r["chosen"] in ("lowrank_split", "lowrank_megatron", "lowrank_tp", "naive_tp")
  assert r["plan"].startswith(f"TPPlan({r['chosen']}, tp=8")
  assert f"auto → {r['chosen']} at tp=8" in r["plan"] and "predicted fastest" in r["plan"]
  assert "no entry for 'cpu'" in r["plan"]  # the simulated devices use the documented default


@pytest.mark.slow
def test_hlo_collectives_match_the_cost_model(run):
  hlo = run["hlo"]
  for key, h in hlo.items():
    if key == "split_model_collectives":
      continue
    got = [[k, shape[-1], 4] for k, shape, dt, n in h["hlo"] if n == 1]
    # cost bytes always agree; XLA:CPU combines independent all-reduces of the XLA-partitioned
    # strategies into tuples (n > 1), the two new layouts issue theirs already concatenated
    assert h["hlo_cost_bytes"] == h["model_cost_bytes"], (key, h)
    if key.startswith(("lowrank_split", "lowrank_megatron", "dense")):
      assert got == h["model"], (key, h)
  r = run["dims"]["ranks"]
  split = hlo["lowrank_split_8"]["hlo"]
  # four all-reduces a layer, all in rank space (f32): q/k/v + the norm's sum of squares, o,
  # gate/up + the norm's, down; no all-gather
  assert [(k, s[-1]) for k, s, dt, n in split] == [
    ("all-reduce", r["q_proj"] + r["k_proj"] + r["v_proj"] + 1),
    ("all-reduce", r["o_proj"]),
    ("all-reduce", r["gate_proj"] + r["up_proj"] + 1),
    ("all-reduce", r["down_proj"]),
  ]
  assert all(dt == "f32" for *_, dt, _ in split)
  assert [(k, s[-1]) for k, s, dt, n in hlo["lowrank_megatron_4"]["hlo"]] == [
    ("all-reduce", r["o_proj"]),
    ("all-reduce", r["down_proj"]),
  ]
  assert len(hlo["lowrank_tp_4"]["hlo"]) == 7 and len(hlo["dense_4"]["hlo"]) == 2
  # the whole split model: the layers' 4 each, the final norm and h gathered for the head
  assert len(hlo["split_model_collectives"]) == 4 + 2


@pytest.mark.slow
def test_kernels_run_on_local_shards(run):
  k, d = run["kernels"], run["dims"]
  r, f, e, n = d["ranks"], d["F"], d["E"], 4
  b, s = 2, 5
  # lr_mlp_rank between the collectives: full-rank inputs, the device's F/n columns
  want = [
    [b, s, r["gate_proj"]],
    [r["gate_proj"], f // n],
    [f // n],
    [b, s, r["up_proj"]],
    [r["up_proj"], f // n],
    [f // n],
    [f // n, r["down_proj"]],
  ]
  for strategy in ("lowrank_split", "lowrank_tp", "lowrank_megatron"):
    rank_calls = [c for c in k[strategy]["calls"] if c[0] == "test.callback_mlp_rank"]
    assert [c[1] for c in rank_calls] == [want], (strategy, k[strategy]["calls"])
    assert k[strategy]["rel_err"] < F32_TOL, (strategy, run["seed"])
  # lowrank_megatron: q/k/v as local X·U·V kernels (u whole, v on the local heads)
  xuv = [c[1] for c in k["lowrank_megatron"]["calls"] if c[0] == "test.callback_xuv"]
  assert sorted(map(str, xuv)) == sorted(
    map(
      str,
      [
        [[b, s, e], [e, r["q_proj"]], [r["q_proj"], 128 // n]],
        [[b, s, e], [e, r["k_proj"]], [r["k_proj"], 64 // n]],
        [[b, s, e], [e, r["v_proj"]], [r["v_proj"], 64 // n]],
      ],
    )
  )
  # without an lr_mlp_rank kernel, megatron's local gate/up X·U·V run lr_xuv kernels instead
  no_rank = k["megatron_no_rank_kernel"]
  assert [c[0] for c in no_rank] == ["test.callback_xuv"] * 5, no_rank
  assert [[b, s, e], [e, r["gate_proj"]], [r["gate_proj"], f // n]] in [c[1][:3] for c in no_rank]
  # lowrank_tp: gate and up all-gathered in one collective
  kinds = [c[0] for c in k["lowrank_tp"]["collectives"]]
  assert kinds.count("all-gather") == 4 and kinds.count("all-reduce") == 2
  # the same kernels without the partitioning rule run on whole operands: the check above
  # would fail there
  for strategy in ("lowrank_tp", "lowrank_megatron"):
    off = k[strategy]["calls_unpartitioned"]
    assert not any(c[0] == "test.callback_mlp_rank" for c in off), off
    assert ["test.callback_xuv", [[b, s, e], [e, r["q_proj"]], [r["q_proj"], 128]]] in off


@pytest.mark.slow
def test_serving_engine_and_cli(run):
  sv = run["serving"]
  single = sv["single"]
  assert all(len(t) == 4 for t in single)
  assert sv["lowrank_split_4_False"] == single, run["seed"]
  assert sv["lowrank_split_2_True"] == single, run["seed"]  # rank-space KV cache
  assert sv["plan_lowrank_split_4_False"] == "lowrank_split"
  # the per-device program's attention is judged by the kernel (which declines the tiny f32
  # model's dtypes), not refused for being sharded
  assert "pallas.decode_attention: dtypes" in sv["attention_lowrank_split_4_False"], sv
  assert sv["attention_lowrank_split_2_True"] == "lr_kv_attention (low-rank KV cache)"
  assert sv["up_u_spec"] == ["tp", "None"] and sv["up_u_shard"][0] == 64 // 4  # split on K
  rc, text = sv["cli_auto"]
  assert rc == 0 and "tp=8" in text and ",".join(map(str, single[0])) in text, text
  assert "strategy=auto" not in text  # the resolved strategy is printed
