"""Engine fuzz: random programs of submits (valid requests, invalid ones, duplicate ids, requests
that fail at admission), steps and cancels on one engine. The property: every valid request gets
exactly its own output (what it generates run alone: greedy, or seeded sampling), a cancelled one
a prefix of it, a failing one an error; nothing is lost or duplicated; and the engine ends idle
with every slot free. Prompts share prefill calls and long ones come in chunks. Deterministic
(derandomized), one engine and its compiled steps reused across all cases; the case count is
printed in the test summary."""

import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
SLOTS, MAX_LEN, MAX_NEW = 3, 32, 5
POOL_SIZE = 16
POISON = 13  # a seed whose admission fails (injected)
CASES = 1000
STATS = dict(cases=0, crashes=0, requests=0, rejected=0, cancelled=0, errors=0, steps=0)


@pytest.fixture(scope="module")
def world():
  model = LlamaForCausalLM(CFG, rngs=nnx.Rngs(1234))
  eng = Engine(model, max_slots=SLOTS, max_len=MAX_LEN, buckets=(8,), attend_buckets=(MAX_LEN,))
  rng = np.random.default_rng(99)
  pool = [  # up to 20 tokens: prompts past 8 are prefilled in 8-token chunks
    [int(t) for t in rng.integers(0, CFG.vocab_size, int(rng.integers(1, 21)))]
    for _ in range(POOL_SIZE)
  ]
  greedy = [
    eng.generate([Request(p, SamplingParams(max_new_tokens=MAX_NEW))])[0].tokens for p in pool
  ]
  real = engine_mod._seed_words

  def seed_words(seed):
    if seed == POISON:
      raise RuntimeError("injected admission failure")
    return real(seed)

  mp = pytest.MonkeyPatch()
  mp.setattr(engine_mod, "_seed_words", seed_words)
  yield eng, pool, greedy, {}
  mp.undo()


def _expected(world, spec):
  """What ``spec`` generates alone (memoized; sampled ones run alone on the idle engine)."""
  eng, pool, greedy, memo = world
  p, n, stop, temp, seed = spec["prompt"], spec["n"], spec["stop"], spec["temp"], spec["seed"]
  if temp == 0.0:
    toks = greedy[p][:n]
  else:
    key = (p, n, temp, spec["top_k"], seed)
    if key not in memo:
      sp = SamplingParams(max_new_tokens=n, temperature=temp, top_k=spec["top_k"], seed=seed)
      memo[key] = eng.generate([Request(pool[p], sp)])[0].tokens
    toks = memo[key]
  if stop is not None and stop in toks:
    return toks[: toks.index(stop) + 1], "stop"
  return toks, "length"


valid = st.fixed_dictionaries(
  {
    "kind": st.just("valid"),
    "prompt": st.integers(0, POOL_SIZE - 1),
    "n": st.integers(1, MAX_NEW),
    "stop": st.one_of(st.none(), st.integers(0, CFG.vocab_size - 1)),
    "temp": st.sampled_from([0.0, 0.0, 0.0, 1.0]),
    "top_k": st.sampled_from([0, 5]),
    "seed": st.sampled_from([1, 2, 3]),
    "id": st.one_of(st.none(), st.none(), st.integers(0, 4)),
  }
)
bad_prompts = ["12", [1.5, 2.0], [], [CFG.vocab_size], [-1], [1] * MAX_LEN, [True], None, [[1]]]
invalid = st.fixed_dictionaries(
  {"kind": st.just("bad_prompt"), "which": st.integers(0, len(bad_prompts) - 1)}
) | st.fixed_dictionaries(
  {
    "kind": st.just("bad_sampling"),
    "which": st.sampled_from(
      [
        dict(seed=2**70),
        dict(seed="x"),
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(max_new_tokens=0),
        dict(top_k=1.5),
      ]
    ),
  }
)
poison = st.fixed_dictionaries({"kind": st.just("poison"), "prompt": st.integers(0, POOL_SIZE - 1)})
op = st.one_of(
  st.tuples(st.just("submit"), st.one_of(valid, valid, valid, invalid, poison)),
  st.tuples(st.just("step"), st.integers(1, 3)),
  st.tuples(st.just("cancel"), st.integers(0, 12)),
)


@settings(
  max_examples=CASES,
  deadline=None,
  derandomize=True,
  database=None,
  suppress_health_check=list(HealthCheck),
)
@given(program=st.lists(op, min_size=1, max_size=14))
def _fuzz(world, program):
  STATS["cases"] += 1
  try:
    _run_case(world, program)
  except BaseException:
    STATS["crashes"] += 1  # hypothesis reruns a failing case while it shrinks it
    raise


def _run_case(world, program):
  eng, pool, _, _ = world
  subs = []  # [id, spec, result] per accepted submission, in order
  live = {}  # id → index in subs, until its result comes back
  cancelled = set()

  def step():
    STATS["steps"] += 1
    for r in eng.step():
      assert r.id in live, f"request {r.id} returned twice, or was never submitted"
      subs[live.pop(r.id)][2] = r

  for kind, arg in program:
    if kind == "step":
      for _ in range(arg):
        step()
    elif kind == "cancel":
      target = subs[arg % len(subs)][0] if subs and arg < 10 else 10**6 + arg  # or unknown
      assert eng.cancel(target) == (target in live)
      if target in live:
        cancelled.add(live[target])
    else:  # submit
      free, waiting = eng.free_slots, eng.num_waiting
      STATS["requests"] += 1
      try:
        if arg["kind"] == "bad_prompt":
          eng.submit(Request(bad_prompts[arg["which"]]))
        elif arg["kind"] == "bad_sampling":
          eng.submit(Request(pool[0], SamplingParams(**arg["which"])))
        else:
          sp, given_id = dict(max_new_tokens=MAX_NEW, seed=POISON), None
          if arg["kind"] == "valid":
            stops = () if arg["stop"] is None else (arg["stop"],)
            sp = dict(max_new_tokens=arg["n"], stop_tokens=stops, seed=arg["seed"])
            sp.update(temperature=arg["temp"], top_k=arg["top_k"])
            given_id = arg["id"]
          if given_id is not None and given_id in live:  # a duplicate live id: refused
            with pytest.raises(ValueError, match="already waiting or running"):
              eng.submit(Request(pool[arg["prompt"]], SamplingParams(**sp), id=given_id))
            STATS["rejected"] += 1
            assert (eng.free_slots, eng.num_waiting) == (free, waiting)
            continue
          rid = eng.submit(Request(pool[arg["prompt"]], SamplingParams(**sp), id=given_id))
          assert rid not in live, "a live id was handed out twice"
          live[rid] = len(subs)
          subs.append([rid, arg, None])
          continue
      except (ValueError, TypeError):
        STATS["rejected"] += 1
        assert (eng.free_slots, eng.num_waiting) == (free, waiting)  # a refusal changes nothing
        continue
      raise AssertionError(f"invalid request {arg} was accepted")
  guard = 0
  while eng.busy:
    step()
    guard += 1
    assert guard < 200, "the engine did not drain"
  assert eng.free_slots == SLOTS and eng.num_waiting == 0 and not live
  for i, (rid, spec, r) in enumerate(subs):
    assert r is not None and r.id == rid and r.prompt == pool[spec["prompt"]]
    if spec["kind"] == "poison":  # fails at admission, unless cancelled while waiting
      if r.finish_reason == "cancelled":
        assert i in cancelled and r.tokens == []
        continue
      STATS["errors"] += 1
      assert r.finish_reason == "error" and "injected" in r.error and r.tokens == []
      continue
    want, reason = _expected(world, spec)
    if r.finish_reason == "cancelled":
      STATS["cancelled"] += 1
      assert i in cancelled and r.tokens == want[: len(r.tokens)], (spec, r, want)
    else:
      assert (r.tokens, r.finish_reason) == (want, reason), (spec, r)
      assert len(r.token_times) == len(r.tokens) and r.error is None


def test_engine_fuzz(world, fuzz_report):
  """Every generated case passes; the run really generated its cases and their kinds (the
  end-of-run summary prints the counts, under xdist too)."""
  try:
    _fuzz(world)
  finally:
    s = STATS
    fuzz_report(
      f"lrjax.serving.Engine over random request mixes ({s['requests']} requests, "
      f"{s['rejected']} refused, {s['cancelled']} cancelled, {s['errors']} failed at admission, "
      f"{s['steps']} steps)",
      s["cases"],
      s["crashes"],
    )
  assert STATS["cases"] >= CASES
  assert STATS["rejected"] > 0 and STATS["cancelled"] > 0 and STATS["errors"] > 0
