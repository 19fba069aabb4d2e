"""The engine never loses, swaps or silently coerces a request: validation at submit, a request
that fails mid-flight returns with an error and frees its slot, and cancel."""

import random

import numpy as np
import pytest
from flax import nnx

from lrjax.models import LlamaForCausalLM, ModelConfig
from lrjax.serving import Engine, Request, SamplingParams
from lrjax.serving import engine as engine_mod

CFG = ModelConfig.tiny(
  hidden_size=32,
  intermediate_size=64,
  num_heads=2,
  num_kv_heads=1,
  head_dim=16,
  num_layers=1,
  vocab_size=64,
)
KW = dict(max_slots=3, max_len=24, buckets=(8,), attend_buckets=(24,))


@pytest.fixture(scope="module")
def model():
  return LlamaForCausalLM(CFG, rngs=nnx.Rngs(random.randrange(1 << 20)))


@pytest.fixture(scope="module")
def engine(model):
  return Engine(model, **KW)


def _prompts(n, seed):
  rng = np.random.default_rng(seed)
  return [
    [int(t) for t in rng.integers(0, CFG.vocab_size, int(rng.integers(1, 8)))] for _ in range(n)
  ]


def _alone(engine, prompt, n):
  [r] = engine.generate([Request(prompt, SamplingParams(max_new_tokens=n))])
  return r.tokens


def test_duplicate_ids_are_refused(engine):
  a, b = _prompts(2, 1)
  engine.submit(Request(a, SamplingParams(max_new_tokens=3), id=5))
  with pytest.raises(ValueError, match="id 5"):
    engine.submit(Request(b, SamplingParams(max_new_tokens=3), id=5))
  while engine.busy:  # runs the queued request down
    engine.step()
  with pytest.raises(ValueError, match="id 7"):
    engine.generate([Request(a, id=7), Request(b, id=7)])
  assert not engine.busy  # the batch was refused whole: nothing of it was queued
  # each id gets its own output
  out = engine.generate(
    [
      Request(a, SamplingParams(max_new_tokens=4), id=8),
      Request(b, SamplingParams(max_new_tokens=4), id=9),
    ]
  )
  assert [o.id for o in out] == [8, 9]
  assert out[0].tokens == _alone(engine, a, 4) and out[1].tokens == _alone(engine, b, 4)


@pytest.mark.parametrize(
  "seed,err",
  [(2**70, ValueError), (-1, ValueError), ("abc", TypeError), (1.5, TypeError), (True, TypeError)],
)
def test_seed_is_validated(seed, err):
  with pytest.raises(err, match="seed"):
    SamplingParams(seed=seed)


def test_64_bit_seeds_are_distinct(engine):
  p = _prompts(1, 2)[0]
  sp = lambda s: SamplingParams(max_new_tokens=8, temperature=5.0, seed=s)  # noqa: E731
  lo, hi, lo2 = engine.generate([Request(p, sp(5)), Request(p, sp(2**32 + 5)), Request(p, sp(5))])
  assert lo.tokens == lo2.tokens
  assert lo.tokens != hi.tokens  # not truncated to the low 32 bits


@pytest.mark.parametrize(
  "prompt",
  ["123", b"\x01\x02", [1.0, 2.0], [True, 3], np.array([1.5, 2.0]), [1, "2"], 7, [[1, 2]]],
)
def test_prompts_are_not_coerced(engine, prompt):
  free = engine.free_slots
  with pytest.raises(TypeError, match="prompt"):
    engine.submit(Request(prompt))
  assert engine.free_slots == free and not engine.busy


def test_integer_arrays_are_prompts(engine):
  p = _prompts(1, 3)[0]
  [a, b] = engine.generate(
    [
      Request(np.asarray(p, np.int64), SamplingParams(max_new_tokens=3)),
      Request(tuple(p), SamplingParams(max_new_tokens=3)),
    ]
  )
  assert a.tokens == b.tokens and a.prompt == p


def test_a_request_failing_mid_flight_frees_its_slot(engine, monkeypatch):
  ps = _prompts(4, 4)
  want = [_alone(engine, p, 5) for p in ps]
  real = engine_mod._seed_words

  def flaky(seed):
    if seed == 666:
      raise RuntimeError("injected failure")
    return real(seed)

  monkeypatch.setattr(engine_mod, "_seed_words", flaky)
  reqs = [Request(p, SamplingParams(max_new_tokens=5)) for p in ps]
  reqs.insert(2, Request(ps[0], SamplingParams(max_new_tokens=5, seed=666)))
  out = engine.generate(reqs)
  bad = out.pop(2)
  assert bad.finish_reason == "error" and "injected failure" in bad.error and bad.tokens == []
  assert [r.tokens for r in out] == want
  assert all(r.finish_reason == "length" and r.error is None for r in out)
  assert engine.free_slots == KW["max_slots"] and not engine.busy


def test_a_failed_step_returns_every_running_request(engine, monkeypatch):
  ps = _prompts(3, 5)
  want = [_alone(engine, p, 4) for p in ps]
  calls = {"n": 0}
  real = engine_mod._decode_jit

  def flaky(*a, **k):
    calls["n"] += 1
    if calls["n"] == 2:
      raise RuntimeError("injected step failure")
    return real(*a, **k)

  monkeypatch.setattr(engine_mod, "_decode_jit", flaky)
  out = engine.generate([Request(p, SamplingParams(max_new_tokens=4)) for p in ps])
  assert {r.finish_reason for r in out} == {"error"}
  assert all("injected step failure" in r.error for r in out)
  assert engine.free_slots == KW["max_slots"] and not engine.busy
  monkeypatch.undo()
  # the engine serves on, with a fresh cache
  again = engine.generate([Request(p, SamplingParams(max_new_tokens=4)) for p in ps])
  assert [r.tokens for r in again] == want


def test_cancel_waiting_and_running(engine):
  ps = _prompts(5, 6)
  want = [_alone(engine, p, 6) for p in ps]
  ids = [engine.submit(Request(p, SamplingParams(max_new_tokens=6))) for p in ps]
  assert not engine.cancel(10**9)  # unknown id
  done = {}
  for r in engine.step():
    done[r.id] = r
  assert engine.cancel(ids[0])  # running
  assert engine.cancel(ids[4])  # still waiting (3 slots)
  assert engine.cancel(ids[0])  # a second cancel before the step is harmless
  while engine.busy:
    for r in engine.step():
      done[r.id] = r
  assert sorted(done) == sorted(ids)
  c0, c4 = done[ids[0]], done[ids[4]]
  assert c0.finish_reason == "cancelled" and c0.tokens == want[0][: len(c0.tokens)]
  assert c4.finish_reason == "cancelled" and c4.tokens == []
  for i in (1, 2, 3):
    assert done[ids[i]].tokens == want[i] and done[ids[i]].finish_reason == "length"
  assert engine.free_slots == KW["max_slots"]


def test_step_events_stream_every_token_once(engine):
  ps = _prompts(4, 7)
  want = [_alone(engine, p, 5) for p in ps]
  ids = [engine.submit(Request(p, SamplingParams(max_new_tokens=5))) for p in ps]
  got = {i: [] for i in ids}
  results = {}
  while engine.busy:
    ev = engine.step_events()
    for rid, toks in ev.tokens.items():
      got[rid] += toks
    for r in ev.finished:
      results[r.id] = r
  assert [got[i] for i in ids] == want
  assert [results[i].tokens for i in ids] == want


def test_bad_sampling_types():
  for kw in (
    dict(temperature=True),
    dict(top_p=True),
    dict(max_new_tokens=2.0),
    dict(stop_tokens=(1.0,)),
    dict(stop_tokens="ab"),
    dict(temperature=float("nan")),
  ):
    with pytest.raises((TypeError, ValueError)):
      SamplingParams(**kw)


def test_sampled_neighbour_leaves_greedy_rows_alone(engine):
  """A sampled request batched with greedy ones leaves their tokens unchanged."""
  ps = _prompts(3, 8)
  want = [_alone(engine, p, 5) for p in ps[:2]]
  out = engine.generate(
    [
      Request(ps[0], SamplingParams(max_new_tokens=5)),
      Request(ps[2], SamplingParams(max_new_tokens=5, temperature=1.0, seed=3)),
      Request(ps[1], SamplingParams(max_new_tokens=5)),
    ]
  )
  assert [out[0].tokens, out[2].tokens] == want


def test_reused_id_never_gets_a_stale_token(model):
  """A finished request leaves a decode step in flight for its row; a new request with the
  same id in the same slot must not be handed that step's token."""
  engine = Engine(model, **{**KW, "max_slots": 1})  # one slot: the same row for both
  a, b = _prompts(2, 9)
  want = _alone(engine, b, 4)
  engine.generate([Request(a, SamplingParams(max_new_tokens=2), id=42)])  # leaves a step in flight
  [r] = engine.generate([Request(b, SamplingParams(max_new_tokens=4), id=42)])
  assert r.tokens == want
