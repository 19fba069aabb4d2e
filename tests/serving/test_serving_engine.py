"""Engine correctness on one device: batching, continuous batching, sampling, bad requests,
and the low-rank KV cache."""

import dataclasses
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lrjax.models import KVCache, LlamaForCausalLM, ModelConfig, decode_step, prefill_step
from lrjax.serving import Engine, Request, SamplingParams, lowrank_kv, sample
from lrjax.sharding.analysis import compressed_ranks

CFG = ModelConfig.tiny(
  hidden_size=64,
  intermediate_size=128,
  num_heads=4,
  num_kv_heads=2,
  head_dim=16,
  num_layers=2,
  vocab_size=128,
)
MAX_LEN = 40


@pytest.fixture(scope="module")
def model():
  seed = random.randrange(1 << 20)
  return LlamaForCausalLM(
    CFG, ranks=[compressed_ranks(CFG, 0.4, 8)] * CFG.num_layers, rngs=nnx.Rngs(seed)
  )


def prompts(n, rng):
  return [list(rng.integers(0, CFG.vocab_size, size=int(rng.integers(1, 14)))) for _ in range(n)]


def greedy_reference(model, prompt, n_new):
  """One request at a time with the model's own prefill/decode (no engine)."""
  cache = KVCache.init(CFG, 1, MAX_LEN)
  padded = np.zeros((1, 16), np.int32)
  padded[0, : len(prompt)] = prompt
  logits, cache = prefill_step(
    model, jnp.asarray(padded), cache, jnp.asarray([len(prompt)], jnp.int32)
  )
  toks = [int(jnp.argmax(logits[0, len(prompt) - 1]))]
  for _ in range(n_new - 1):
    logits, cache = decode_step(model, jnp.asarray([toks[-1]], jnp.int32), cache)
    toks.append(int(jnp.argmax(logits[0])))
  return toks


def test_batched_generation_equals_one_at_a_time(model):
  rng = np.random.default_rng(random.randrange(1 << 20))
  ps = prompts(4, rng)
  eng = Engine(model, max_slots=3, max_len=MAX_LEN, buckets=(16,))
  res = eng.generate([Request(p, SamplingParams(max_new_tokens=5 + i)) for i, p in enumerate(ps)])
  for i, (p, r) in enumerate(zip(ps, res)):
    assert r.prompt == [int(t) for t in p]
    assert r.tokens == greedy_reference(model, p, 5 + i), i
    assert r.finish_reason == "length"


def test_continuous_batching_loses_no_request(model):
  rng = np.random.default_rng(random.randrange(1 << 20))
  eng = Engine(model, max_slots=2, max_len=MAX_LEN, buckets=(16,))
  reqs = [
    Request(p, SamplingParams(max_new_tokens=int(rng.integers(1, 6))), id=100 + i)
    for i, p in enumerate(prompts(7, rng))
  ]
  res = eng.generate(reqs)
  assert [r.id for r in res] == [100 + i for i in range(7)]
  for q, r in zip(reqs, res):
    assert len(r.tokens) == q.sampling.max_new_tokens and r.finish_reason == "length"
    assert len(r.token_times) == len(r.tokens) and r.ttft_s > 0
  assert not eng.busy and sorted(eng._free) == [0, 1]
  # Requests submitted between steps join free slots.
  eng.submit(Request([3, 4], SamplingParams(max_new_tokens=3), id=7))
  first = eng.step()
  eng.submit(Request([5], SamplingParams(max_new_tokens=2), id=8))
  done = first + [r for _ in range(10) for r in eng.step()]
  assert sorted(r.id for r in done) == [7, 8]


def test_sampled_request_is_independent_of_batch(model):
  rng = np.random.default_rng(random.randrange(1 << 20))
  ps = prompts(3, rng)
  sp = SamplingParams(max_new_tokens=6, temperature=1.5, top_k=40, top_p=0.95, seed=11)
  alone = Engine(model, max_slots=1, max_len=MAX_LEN, buckets=(16,)).generate([Request(ps[0], sp)])
  eng = Engine(model, max_slots=3, max_len=MAX_LEN, buckets=(16,))
  mixed = eng.generate(
    [
      Request(ps[1], SamplingParams(max_new_tokens=3, temperature=1.0)),
      Request(ps[0], sp),
      Request(ps[2], SamplingParams(max_new_tokens=9)),
    ]
  )
  assert mixed[1].tokens == alone[0].tokens
  other = eng.generate([Request(ps[0], dataclasses.replace(sp, seed=12))])
  assert other[0].tokens != alone[0].tokens  # another seed, other draws


def test_stop_token_and_cache_full(model):
  p = [5, 9, 2]
  ref = greedy_reference(model, p, 3)
  eng = Engine(model, max_slots=2, max_len=MAX_LEN, buckets=(16,))
  [r] = eng.generate([Request(p, SamplingParams(max_new_tokens=10, stop_tokens=(ref[1],)))])
  assert r.tokens == ref[:2] or r.tokens == ref[:1]
  assert r.finish_reason == "stop" and r.tokens[-1] == ref[1]
  short = Engine(model, max_slots=1, max_len=8, buckets=(4,))
  [r] = short.generate([Request([1, 2, 3], SamplingParams(max_new_tokens=50))])
  assert r.finish_reason == "cache_full" and len(r.tokens) == 8 - 3


def test_bad_requests(model):
  eng = Engine(model, max_slots=1, max_len=MAX_LEN, buckets=(16,))
  with pytest.raises(ValueError, match="prompt is empty"):
    eng.submit(Request([]))
  with pytest.raises(ValueError, match="at most 39"):  # max_len - 1 (chunks of 16)
    eng.submit(Request(list(range(40))))
  with pytest.raises(ValueError, match="outside"):
    eng.submit(Request([1, CFG.vocab_size]))
  with pytest.raises(TypeError, match="Request"):
    eng.submit([1, 2, 3])
  for kw, msg in (
    (dict(temperature=-1.0), "temperature"),
    (dict(top_k=-2), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(stop_tokens=(-1,)), "stop"),
  ):
    with pytest.raises(ValueError, match=msg):
      SamplingParams(**kw)
  with pytest.raises(ValueError, match="buckets"):
    Engine(model, max_len=16, buckets=(32,))


def test_sampling_filters():
  key = jax.random.key(random.randrange(1 << 20))
  logits = jax.random.normal(key, (6, 50)) * 3
  greedy = np.asarray(jnp.argmax(logits, -1))
  b = logits.shape[0]
  jsample = jax.jit(sample)
  f = lambda t, k, p, s: np.asarray(
    jsample(  # noqa: E731
      logits, jax.random.key(s), jnp.full((b,), t), jnp.full((b,), k, jnp.int32), jnp.full((b,), p)
    )
  )
  assert (f(0.0, 0, 1.0, 0) == greedy).all()
  assert (f(1.0, 1, 1.0, 1) == greedy).all()  # top-k 1 is greedy
  assert (f(1.0, 0, 1e-6, 2) == greedy).all()  # top-p → only the best token
  top3 = np.argsort(-np.asarray(logits), -1)[:, :3]
  for s in range(5):
    t = f(2.0, 3, 1.0, s)
    assert all(t[i] in top3[i] for i in range(b))
  assert (f(1.0, 0, 1.0, 7) == f(1.0, 0, 1.0, 7)).all()  # same key, same tokens
  draws = np.stack([f(5.0, 0, 1.0, s) for s in range(8)])
  assert len(np.unique(draws)) > b  # high temperature really samples


def test_lowrank_kv_cache_equals_dense_cache(model):
  rng = np.random.default_rng(random.randrange(1 << 20))
  toks = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 6)), jnp.int32)
  lengths = jnp.asarray([6, 4], jnp.int32)
  d_pre, d_dec = nnx.jit(type(model).prefill), nnx.jit(type(model).decode)
  l_pre, l_dec = nnx.jit(lowrank_kv.prefill), nnx.jit(lowrank_kv.decode)
  d_logits, dc = d_pre(model, toks, KVCache.init(CFG, 2, 16), lengths)
  l_logits, lc = l_pre(model, toks, lowrank_kv.LowRankKVCache.init(model, 2, 16), lengths)
  rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))  # noqa: E731
  assert rel(l_logits[0], d_logits[0]) < 1e-5 and rel(l_logits[1, :4], d_logits[1, :4]) < 1e-5
  nxt = jnp.asarray(rng.integers(0, CFG.vocab_size, (2,)), jnp.int32)
  for _ in range(3):
    d, dc = d_dec(model, nxt, dc)
    lo, lc = l_dec(model, nxt, lc)
    assert rel(lo, d) < 1e-5
    nxt = jnp.argmax(d, -1).astype(jnp.int32)
  ranks = lowrank_kv.kv_ranks(model)
  assert len(ranks) == CFG.num_layers and len(set(ranks)) == 1
  rk, rv = ranks[0]
  assert len(lc.zk) == CFG.num_layers and all(z.shape == (2, 16, rk) for z in lc.zk)
  dense_b = lowrank_kv.bytes_per_token(model, 4, lowrank=False)
  assert lowrank_kv.bytes_per_token(model, 4, lowrank=True) == (rk + rv) * CFG.num_layers * 4
  assert dense_b == 2 * CFG.num_kv_heads * CFG.head_dim * CFG.num_layers * 4
  # And through the engine.
  ps = prompts(3, rng)
  reqs = lambda: [Request(p, SamplingParams(max_new_tokens=4)) for p in ps]  # noqa: E731
  a = Engine(model, max_slots=2, max_len=MAX_LEN, buckets=(16,)).generate(reqs())
  b = Engine(model, max_slots=2, max_len=MAX_LEN, buckets=(16,), lowrank_kv=True).generate(reqs())
  assert [r.tokens for r in a] == [r.tokens for r in b]


def test_lowrank_kv_decode_binds_the_attention_primitive(model):
  """A decode step goes through lr_kv_attention (so a GPU can lower it to the kernel); a
  prefill of several tokens keeps the inline rebuild."""
  cache = lowrank_kv.LowRankKVCache.init(model, 2, 16)
  toks = jnp.zeros((2,), jnp.int32)
  dec = str(jax.make_jaxpr(lambda c: lowrank_kv.decode(model, toks, c))(cache))
  pre = str(
    jax.make_jaxpr(lambda c: lowrank_kv.prefill(model, jnp.zeros((2, 5), jnp.int32), c))(cache)
  )
  assert dec.count("lr_kv_attention") == CFG.num_layers
  assert "lr_kv_attention" not in pre
  # q/k norms (Qwen3) act on the rebuilt K: those layers keep the inline rebuild
  cfg = dataclasses.replace(CFG, qk_norm=True)
  normed = LlamaForCausalLM(
    cfg, ranks=[compressed_ranks(cfg, 0.4, 8)] * cfg.num_layers, rngs=nnx.Rngs(1)
  )
  c = lowrank_kv.LowRankKVCache.init(normed, 2, 16)
  assert "lr_kv_attention" not in str(
    jax.make_jaxpr(lambda c: lowrank_kv.decode(normed, toks, c))(c)
  )


def test_lowrank_kv_needs_lowrank_projections():
  dense = LlamaForCausalLM(CFG, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="LowRankLinear k_proj"):
    lowrank_kv.LowRankKVCache.init(dense, 1, 8)


def test_fused_engine_runs_kernels_and_matches(model, caplog):
  from lrjax.sharding.testing import callback_kernels

  rng = np.random.default_rng(random.randrange(1 << 20))
  ps = prompts(3, rng)
  reqs = lambda: [Request(p, SamplingParams(max_new_tokens=4)) for p in ps]  # noqa: E731
  kw = dict(max_slots=2, max_len=MAX_LEN + 3, buckets=(16,))  # compiled by no other test
  plain = Engine(model, fuse=False, **kw).generate(reqs())
  with callback_kernels(execute=True), caplog.at_level("DEBUG", logger="lrjax.lowering"):
    fused = Engine(model, fuse=True, **kw).generate(reqs())
  assert [r.tokens for r in fused] == [r.tokens for r in plain]
  assert any("lowering with test.callback_xuv" in r.getMessage() for r in caplog.records)


def test_one_compiled_variant_per_shape(model):
  from lrjax.serving import engine as engine_mod

  rng = np.random.default_rng(random.randrange(1 << 20))
  before = (engine_mod._prefill_jit._cache_size(), engine_mod._decode_jit._cache_size())
  eng = Engine(model, max_slots=2, max_len=37, buckets=(8, 16))  # shapes no other test uses
  eng.generate([Request(p, SamplingParams(max_new_tokens=5)) for p in prompts(5, rng)])
  variants = len(eng.prefill_variants())
  after = (engine_mod._prefill_jit._cache_size(), engine_mod._decode_jit._cache_size())
  assert after[0] - before[0] <= variants and after[1] - before[1] == 1


def test_steps_do_not_hash_the_graph(model, monkeypatch):
  """The per-token host work does not grow with the model: the GraphDef is hashed once, when
  the engine is built (1.8 ms a token at 32 layers otherwise; the weights go in as a list)."""
  rng = np.random.default_rng(random.randrange(1 << 20))
  sp = SamplingParams(max_new_tokens=6)
  reqs = lambda: [Request(p, sp) for p in prompts(3, rng)]  # noqa: E731
  Engine(model, max_slots=2, max_len=MAX_LEN, buckets=(16,)).generate(reqs())  # compiles
  eng = Engine(model, max_slots=2, max_len=MAX_LEN, buckets=(16,))
  calls = []
  gdef_type = type(eng.gdef)
  real_hash = gdef_type.__hash__
  monkeypatch.setattr(gdef_type, "__hash__", lambda self: calls.append(1) or real_hash(self))
  out = eng.generate(reqs())
  assert all(len(r.tokens) == 6 for r in out)
  assert not calls


def test_decode_attends_only_the_context_bucket(model):
  """attend_buckets: each step reads the smallest bucket holding every row's context; the
  tokens are those of attending over the whole cache."""
  from lrjax.serving import engine as engine_mod

  rng = np.random.default_rng(random.randrange(1 << 20))
  ps = prompts(2, rng) + [list(rng.integers(0, CFG.vocab_size, size=14))]
  reqs = lambda: [Request(p, SamplingParams(max_new_tokens=24)) for p in ps]  # noqa: E731
  whole = Engine(
    model, max_slots=3, max_len=MAX_LEN, buckets=(16,), attend_buckets=(MAX_LEN,)
  ).generate(reqs())
  before = engine_mod._decode_jit._cache_size()
  eng = Engine(model, max_slots=3, max_len=MAX_LEN, buckets=(16,), attend_buckets=(16, 24, 32))
  assert eng.attend_buckets == (16, 24, 32, MAX_LEN)
  got = eng.generate(reqs())
  assert [r.tokens for r in got] == [r.tokens for r in whole]
  # the longest context grows from 15 to 37 tokens: new steps over 16, 24 and 32 positions
  # (the one over all 40 is the whole-cache engine's)
  assert engine_mod._decode_jit._cache_size() - before == 3
  with pytest.raises(ValueError, match="attend_buckets"):
    Engine(model, max_slots=1, max_len=MAX_LEN, attend_buckets=(64,))
  lowrank = [
    Engine(
      model, max_slots=3, max_len=MAX_LEN, buckets=(16,), lowrank_kv=True, attend_buckets=ab
    ).generate(reqs())
    for ab in ((MAX_LEN,), (16, 24, 32))
  ]
  assert [r.tokens for r in lowrank[0]] == [r.tokens for r in lowrank[1]]


def test_warmup_compiles_every_step_before_serving(model, capsys):
  from lrjax.serving import engine as engine_mod

  rng = np.random.default_rng(random.randrange(1 << 20))
  ps = prompts(3, rng) + [list(rng.integers(0, CFG.vocab_size, size=14))]
  reqs = lambda: [Request(p, SamplingParams(max_new_tokens=20)) for p in ps]  # noqa: E731
  kw = dict(max_len=MAX_LEN, buckets=(8, 16), attend_buckets=(20, 28))
  sizes = lambda: (engine_mod._prefill_jit._cache_size(), engine_mod._decode_jit._cache_size())  # noqa: E731
  eng = Engine(model, max_slots=5, **kw)  # a slot count no other test compiles for
  before = sizes()
  # prefill: 1, 2, 4 or 5 rows of first chunks of 8 or 16 tokens, and of later 16-token chunks
  # reading the whole row (prompts up to 39 tokens come in 16-token chunks); decode over 20, 28
  # and 40 positions
  want = [(r, w, w) for w in (8, 16) for r in (1, 2, 4, 5)] + [(r, 16, 40) for r in (1, 2, 4, 5)]
  assert eng.prefill_variants() == want
  assert eng.warmup(progress=True) == 12 + 3 + 1  # a step each, and the one short request
  bar = capsys.readouterr().err
  assert "warm-up (compile)" in bar and "16/16" in bar, bar
  assert sizes() == (before[0] + 12, before[1] + 3)
  warm = eng.generate(reqs())
  assert sizes() == (before[0] + 12, before[1] + 3)  # nothing left to compile
  cold = Engine(model, max_slots=3, **kw).generate(reqs())
  assert [r.tokens for r in warm] == [r.tokens for r in cold]
  eng.submit(Request(ps[0]))
  with pytest.raises(RuntimeError, match="idle"):
    eng.warmup()
