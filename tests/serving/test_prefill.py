"""Prefill under load: waiting prompts share prefill calls, long prompts are prefilled in chunks
with decode steps in between, and every greedy output equals the request run alone."""

import numpy as np
import pytest
from flax import nnx

from lrjax.models import LlamaForCausalLM, ModelConfig
from lrjax.serving import Engine, Request, SamplingParams
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


@pytest.fixture(scope="module")
def model():
  ranks = [compressed_ranks(CFG, 0.4, 8)] * CFG.num_layers
  return LlamaForCausalLM(CFG, ranks=ranks, rngs=nnx.Rngs(7))


def _prompts(lengths, seed):
  rng = np.random.default_rng(seed)
  return [[int(t) for t in rng.integers(0, CFG.vocab_size, n)] for n in lengths]


def _calls(engine):
  """Record each prefill call's (rows, width, window, real rows)."""
  calls, real = [], engine._prefill

  def spy(window, cache, toks, starts, lengths, slots, *rest):
    calls.append((toks.shape[0], toks.shape[1], window, int((slots < engine.max_slots).sum())))
    return real(window, cache, toks, starts, lengths, slots, *rest)

  engine._prefill = spy
  return calls


def _alone(engine, prompts, n):
  return [
    engine.generate([Request(p, SamplingParams(max_new_tokens=n))])[0].tokens for p in prompts
  ]


def test_waiting_prompts_share_a_prefill_call(model):
  eng = Engine(model, max_slots=8, max_len=40, buckets=(8, 16), prefill_call_tokens=64)
  ps = _prompts([3, 12, 7, 16, 1, 9], 1)
  want = _alone(eng, ps, 5)
  calls = _calls(eng)
  ids = [eng.submit(Request(p, SamplingParams(max_new_tokens=5))) for p in ps]
  eng.step()
  # oldest first, a call no wider than its oldest prompt's bucket, at most 64 // 8 = 8 rows of
  # 8 tokens: the 3-, 7- and 1-token prompts together (3 rows, padded to 4), then the 12-, 16-
  # and 9-token ones at 16 tokens
  assert calls == [(4, 8, 8, 3), (4, 16, 16, 3)]
  done = {}
  while eng.busy:
    for r in eng.step():
      done[r.id] = r
  assert [done[i].tokens for i in ids] == want


def test_single_policy_prefills_one_prompt_a_call(model):
  eng = Engine(model, max_slots=4, max_len=40, buckets=(16,), prefill="single")
  ps = _prompts([5, 9, 2], 2)
  calls = _calls(eng)
  out = eng.generate([Request(p, SamplingParams(max_new_tokens=4)) for p in ps])
  assert [c[:2] for c in calls] == [(1, 16)] * 3
  batched = Engine(model, max_slots=4, max_len=40, buckets=(16,))
  assert [r.tokens for r in out] == _alone(batched, ps, 4)


def test_long_prompt_is_chunked_between_decode_steps(model):
  eng = Engine(model, max_slots=2, max_len=48, buckets=(8, 16), prefill_chunk=8)
  short, long_ = _prompts([4, 30], 3)
  want_short, want_long = _alone(eng, [short, long_], 12)
  calls = _calls(eng)
  a = eng.submit(Request(short, SamplingParams(max_new_tokens=12)))
  got = {a: list(eng.step_events().tokens.get(a, []))}
  b = eng.submit(Request(long_, SamplingParams(max_new_tokens=12)))
  got[b] = []
  firsts = []
  for step in range(40):
    ev = eng.step_events()
    for rid, toks in ev.tokens.items():
      got[rid] += toks
    if got[b] and not firsts:
      firsts.append(step)
    if not eng.busy:
      break
  # 30 tokens in chunks of 8, 8, 8, 6: one chunk a step, the short request decoding meanwhile
  long_calls = [c for c in calls if c[3] == 1][1:]
  assert [c[2] for c in long_calls] == [8, 48, 48, 48]  # later chunks read the whole row
  assert len(got[a]) >= 4 and firsts and firsts[0] >= 3
  assert got == {a: want_short, b: want_long}
  # chunked or whole, the same greedy tokens
  whole = Engine(model, max_slots=2, max_len=48, buckets=(8, 16, 32), prefill_chunk=32)
  assert _alone(whole, [long_], 12) == [want_long]


def test_step_budget_spreads_prefill_over_steps(model):
  eng = Engine(
    model, max_slots=6, max_len=40, buckets=(16,), prefill_call_tokens=16, prefill_tokens=32
  )
  ps = _prompts([10] * 6, 4)
  want = _alone(eng, ps, 3)
  calls = _calls(eng)
  ids = [eng.submit(Request(p, SamplingParams(max_new_tokens=3))) for p in ps]
  eng.step()
  assert calls == [(1, 16, 16, 1), (1, 16, 16, 1)]  # 32 tokens a step, 16 a call
  done = {}
  while eng.busy:
    for r in eng.step():
      done[r.id] = r
  assert len(calls) == 6 and [done[i].tokens for i in ids] == want


def test_lowrank_kv_cache_batched_and_chunked(model):
  kw = dict(max_slots=3, max_len=48, buckets=(8, 16), prefill_chunk=8)
  ps = _prompts([3, 21, 11, 30], 5)
  reqs = lambda: [Request(p, SamplingParams(max_new_tokens=6)) for p in ps]  # noqa: E731
  dense = Engine(model, **kw).generate(reqs())
  low = Engine(model, lowrank_kv=True, **kw).generate(reqs())
  assert [r.tokens for r in low] == [r.tokens for r in dense]


def test_prefill_settings_are_checked(model):
  with pytest.raises(ValueError, match="prefill='fast'"):
    Engine(model, max_len=40, prefill="fast")
  with pytest.raises(ValueError, match="prefill_chunk=64"):
    Engine(model, max_len=40, buckets=(16,), prefill_chunk=64)
  with pytest.raises(ValueError, match="prefill_call_tokens"):
    Engine(model, max_len=40, prefill_call_tokens=4096, prefill_tokens=1024)
  with pytest.raises(ValueError, match="prefill_rows"):
    Engine(model, max_slots=2, max_len=40, prefill_rows=(1, 4))
