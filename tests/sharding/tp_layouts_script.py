"""Run by test_tp_layouts.py in a subprocess with 8 simulated CPU devices; prints JSON.

Parts (argv[1], comma-separated): numerics, hlo, serving. argv[2] seeds the weights, argv[3] is a
scratch directory (serving's checkpoint).
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import lrjax  # noqa: E402
from lrjax import sharding as S  # noqa: E402
from lrjax.lowering import partitioning  # noqa: E402
from lrjax.models import LlamaForCausalLM, ModelConfig  # noqa: E402
from lrjax.models.llama import KVCache  # noqa: E402
from lrjax.sharding import analysis as A  # noqa: E402
from lrjax.sharding import cost  # noqa: E402
from lrjax.sharding import testing as T  # noqa: E402

parts, seed = sys.argv[1].split(","), int(sys.argv[2])
tmp = sys.argv[3] if len(sys.argv) > 3 else None
out = {"n_devices": jax.device_count()}

BASE = dict(
  hidden_size=64,
  intermediate_size=128,
  num_heads=16,
  num_kv_heads=8,
  head_dim=8,
  num_layers=2,
  vocab_size=128,
)
CONFIGS = {
  # GQA (2 query heads per KV head), Llama attention_bias and mlp_bias
  "llama": ModelConfig.tiny(**BASE, o_bias=True, mlp_bias=True),
  # q/k/v biases, tied embeddings
  "qwen2": ModelConfig.tiny(**BASE, model_type="qwen2", qkv_bias=True, tie_word_embeddings=True),
  # per-head q/k RMSNorm
  "qwen3": ModelConfig.tiny(**BASE, model_type="qwen3", qk_norm=True),
}


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def make(cfg, ranks, dtype=jnp.float32, heads=None):
  """The same random model on every call: biases and norm weights random too (not 0 / 1)."""
  m = LlamaForCausalLM(
    cfg, ranks=ranks, heads=heads, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(seed)
  )
  _, state = nnx.split(m)
  key = jax.random.key(seed + 1)
  for i, (path, var) in enumerate(nnx.to_flat_state(state)):
    name = str(path[-1])
    k = jax.random.fold_in(key, i)
    if name == "bias":
      var.value = (0.1 * jax.random.normal(k, var.shape)).astype(var.dtype)
    elif name == "weight":
      var.value = (1.0 + 0.1 * jax.random.normal(k, var.shape)).astype(var.dtype)
  return m


def ranks_of(cfg, drop=()):
  r = {k: v for k, v in A.compressed_ranks(cfg, 0.4, 8).items() if k not in drop}
  return [r] * cfg.num_layers


def logits(m, tok):
  return np.asarray(nnx.jit(lambda mm, t: mm(t))(m, tok), np.float64)


def part_numerics():
  tok = jax.random.randint(jax.random.key(seed + 2), (2, 7), 0, 128)
  recs = []
  cases = [("llama", "lowrank_split", tp) for tp in (2, 4, 8)]
  cases += [("qwen2", "lowrank_split", 8), ("qwen3", "lowrank_split", 4)]
  cases += [("qwen2", "lowrank_megatron", 4), ("llama", "auto", 8)]
  refs = {}
  for name, strategy, tp in cases:
    cfg = CONFIGS[name]
    if name not in refs:
      refs[name] = logits(make(cfg, ranks_of(cfg)), tok)
    m = S.shard(make(cfg, ranks_of(cfg)), S.make_mesh(tp), strategy)
    recs.append(
      {
        "config": name,
        "strategy": strategy,
        "chosen": m.tp_plan.strategy,
        "tp": tp,
        "rel_err": rel(logits(m, tok), refs[name]),
        "layer_class": type(m.layers[0]).__name__,
        "plan": repr(m.tp_plan),
      }
    )
  # a mixed model: k_proj and down_proj dense
  cfg = CONFIGS["llama"]
  rk = ranks_of(cfg, drop=("k_proj", "down_proj"))
  m = S.shard(make(cfg, rk), S.make_mesh(4), "lowrank_split")
  recs.append(
    {
      "config": "llama_mixed",
      "strategy": "lowrank_split",
      "chosen": "lowrank_split",
      "tp": 4,
      "rel_err": rel(logits(m, tok), logits(make(cfg, rk), tok)),
    }
  )
  # per-head q and k factors (HeadwiseLowRankLinear), split over the heads
  rh = [dict(ranks_of(cfg)[0], q_proj=32, k_proj=16)] * cfg.num_layers
  hh = [{"q_proj": 16, "k_proj": 8}] * cfg.num_layers
  m = S.shard(make(cfg, rh, heads=hh), S.make_mesh(8), "lowrank_split")
  recs.append(
    {
      "config": "llama_headwise",
      "strategy": "lowrank_split",
      "chosen": "lowrank_split",
      "tp": 8,
      "rel_err": rel(logits(m, tok), logits(make(cfg, rh, heads=hh), tok)),
    }
  )
  # bf16 weights and activations, both against the f32 model with the same (rounded) weights
  single = make(cfg, ranks_of(cfg), jnp.bfloat16)
  exact = make(cfg, ranks_of(cfg))
  for (_, vb), (_, v) in zip(
    nnx.to_flat_state(nnx.split(single)[1]), nnx.to_flat_state(nnx.split(exact)[1])
  ):
    v.value = vb.value.astype(jnp.float32)
  exact = logits(exact, tok)
  m = S.shard(make(cfg, ranks_of(cfg), jnp.bfloat16), S.make_mesh(4), "lowrank_split")
  out["bf16"] = {
    "single_err": rel(logits(single, tok), exact),
    "split_err": rel(logits(m, tok), exact),
  }

  # prefill into a KV cache, then decode steps (the cache split on KV heads)
  def steps(m):
    cache = KVCache.init(cfg, 2, 12)
    if getattr(m, "tp_plan", None) is not None:
      cache = jax.device_put(
        cache,
        jax.tree.map(
          lambda a: m.tp_plan.cache_sharding() if a.ndim > 1 else m.tp_plan.replicated(), cache
        ),
      )
    lg, cache = nnx.jit(lambda mm, t, c: mm.prefill(t, c))(m, tok[:, :5], cache)
    outs = [lg]
    for i in range(3):  # the last step attends to the first 8 of the 12 positions
      attend_len = 8 if i == 2 else None
      dec = nnx.jit(lambda mm, t, c, n=attend_len: mm.decode(t, c, attend_len=n))
      lg, cache = dec(m, tok[:, 5 + i % 2], cache)
      outs.append(lg)
    return [np.asarray(o, np.float64) for o in outs], cache

  single, _ = steps(make(cfg, ranks_of(cfg)))
  m = S.shard(make(cfg, ranks_of(cfg)), S.make_mesh(4), "lowrank_split")
  split, cache = steps(m)
  out["decode_rel_err"] = max(rel(a, b) for a, b in zip(split, single))
  # the split program's decode step binds decode_attention_append (RoPE, cache writes and
  # attention) on each device's KV heads: its q and its k cache buffer
  jaxpr = jax.make_jaxpr(lambda t, c: m.decode(t, c, attend_len=8))(tok[:, 0], cache)
  out["split_decode_attention"] = [
    [[list(e.invars[i].aval.shape) for i in (0, 3)], e.params["length"]]
    for e in eqns(jaxpr.jaxpr)
    if e.primitive.name == "decode_attention_append"
  ]
  out["numerics"] = recs


def eqns(jaxpr):
  """Every equation of ``jaxpr`` and of the jaxprs in its equations' params."""
  for e in jaxpr.eqns:
    yield e
    for v in e.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          yield from eqns(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          yield from eqns(sub)


def colls(text):
  return [[c.kind, list(c.shapes[0]), c.dtypes[0], len(c.shapes)] for c in S.collectives(text)]


def part_hlo():
  cfg = CONFIGS["llama"].replace(num_layers=1)
  r = ranks_of(cfg)
  h = jax.random.normal(jax.random.key(seed + 3), (2, 5, cfg.hidden_size))
  res = {}
  for strategy, tp in (
    ("lowrank_split", 4),
    ("lowrank_split", 8),
    ("lowrank_megatron", 4),
    ("lowrank_tp", 4),
    ("naive_tp", 4),
    ("repl_u_tp", 4),
    ("dense", 4),
  ):
    m = S.shard(make(cfg, None if strategy == "dense" else r), S.make_mesh(tp), strategy)
    text = A.layer_hlo(m.layers[0], cfg, h)
    want = cost.layer_collectives(strategy, cfg, r[0] if strategy != "dense" else {}, 4)
    res[f"{strategy}_{tp}"] = {
      "hlo": colls(text),
      "hlo_cost_bytes": S.summarize(S.collectives(text))["cost_bytes"],
      "model": [[c.kind, c.elems, c.elem_bytes] for c in want],
      "model_cost_bytes": sum(c.cost_bytes_per_token for c in want) * 10,  # 2 x 5 tokens
    }
    if strategy == "lowrank_split" and tp == 4:  # the whole model: the layers and the head
      tok = jax.random.randint(jax.random.key(seed), (2, 5), 0, 128)
      full = nnx.jit(lambda mm, t: mm(t)).lower(m, tok).compile().as_text()
      res["split_model_collectives"] = colls(full)
  out["hlo"] = res

  # Kernels on local shards: the stand-in kernels' custom calls and the shapes they ran on.
  kern = {}
  tok = jax.random.randint(jax.random.key(seed + 4), (2, 5), 0, 128)
  ref = logits(make(cfg, r), tok)
  for strategy in ("lowrank_split", "lowrank_tp", "lowrank_megatron"):
    m = S.shard(make(cfg, r), S.make_mesh(4), strategy)
    fused = strategy != "lowrank_split"  # split binds lr_mlp_rank itself, fused or not
    with T.callback_kernels():
      text = A.layer_hlo(m.layers[0], cfg, h, fused=fused)
      with partitioning.disabled():
        text_off = A.layer_hlo(m.layers[0], cfg, h, fused=True)
    with T.callback_kernels(execute=True):
      fwd = (lambda mm, t: lrjax.fuse(lambda a, b: a(b))(mm, t)) if fused else (lambda mm, t: mm(t))
      err = rel(np.asarray(nnx.jit(fwd)(m, tok), np.float64), ref)
    kern[strategy] = {
      "calls": [
        [c.name, [list(s) for s in c.operands], list(c.result)] for c in T.kernel_calls(text)
      ],
      "calls_unpartitioned": [
        [c.name, [list(s) for s in c.operands]] for c in T.kernel_calls(text_off)
      ],
      "collectives": colls(text),
      "rel_err": err,
    }
  # without an lr_mlp_rank kernel, lowrank_megatron's local gate/up X·U·V keep lr_xuv kernels
  m = S.shard(make(cfg, r), S.make_mesh(4), "lowrank_megatron")
  with T.callback_kernels(prims=("lr_xuv", "lr_mlp")):
    text = A.layer_hlo(m.layers[0], cfg, h, fused=True)
  kern["megatron_no_rank_kernel"] = [
    [c.name, [list(s) for s in c.operands]] for c in T.kernel_calls(text)
  ]
  out["kernels"] = kern
  out["dims"] = {"ranks": r[0], "F": cfg.intermediate_size, "E": cfg.hidden_size}


def part_serving():
  from lrjax import checkpoint
  from lrjax.cli import main as cli_main
  from lrjax.serving import Request, SamplingParams, load_engine, load_model

  cfg = CONFIGS["llama"]
  ckpt = os.path.join(tmp, "ckpt")
  checkpoint.save(make(cfg, ranks_of(cfg)), ckpt)
  rng = np.random.default_rng(seed)
  ps = [list(map(int, rng.integers(0, 128, size=n))) for n in (3, 9, 1, 6)]
  reqs = lambda: [Request(p, SamplingParams(max_new_tokens=4)) for p in ps]  # noqa: E731
  kw = dict(max_slots=4, max_len=24, buckets=(16,))
  res = {"single": [r.tokens for r in load_engine(ckpt, **kw).generate(reqs())]}
  for strategy, tp, lowrank_kv in (("lowrank_split", 4, False), ("lowrank_split", 2, True)):
    eng = load_engine(ckpt, tp=tp, strategy=strategy, lowrank_kv=lowrank_kv, **kw)
    res[f"{strategy}_{tp}_{lowrank_kv}"] = [r.tokens for r in eng.generate(reqs())]
    res[f"plan_{strategy}_{tp}_{lowrank_kv}"] = eng.plan.strategy
    # what would serve its decode attention on a GPU: judged on the local heads
    res[f"attention_{strategy}_{tp}_{lowrank_kv}"] = eng._attention_lowering("cuda")
  m = load_model(ckpt, tp=4, strategy="lowrank_split")
  u = m.layers[0].mlp.up_proj.u[...]
  res["up_u_spec"] = [str(a) for a in u.sharding.spec]
  res["up_u_shard"] = list(u.addressable_shards[0].data.shape)
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    rc = cli_main(
      ["generate", "--ckpt", ckpt, "--tp", "8", "--strategy", "auto", "--max-new-tokens", "4"]
      + ["--prompt-ids", ",".join(map(str, ps[0])), "--no-warmup"]
    )
  res["cli_auto"] = [rc, buf.getvalue()]
  out["serving"] = res


for p in parts:
  {"numerics": part_numerics, "hlo": part_hlo, "serving": part_serving}[p]()
print("JSON" + json.dumps(out))
