"""The synthetic source: exact entropy rate vs brute-force enumeration, sampling, cache keying."""

import itertools
import json
import os

import numpy as np
import pytest

from lrjax.quality.source import MarkovSource, SourceConfig


def _small_source(seed):
  for s in range(seed, seed + 50):  # a seed whose chain has one closed class
    try:
      return MarkovSource(SourceConfig(vocab=3, groups=2, support=2, alpha=1.0, seed=s))
    except ValueError:
      continue
  raise AssertionError("no valid small source found")


def _block_entropy(src, n):
  """H(X_0..X_{n-1}) by enumerating every hidden start state and every token sequence."""
  v, g = src.cfg.vocab, src.cfg.groups
  probs = {}
  for s0 in range(src.n_states):
    if src.pi[s0] == 0:
      continue
    for rest in itertools.product(range(v), repeat=n - 1):
      a, c = divmod(s0, g)
      seq, p, prev, cls = (a,) + rest, src.pi[s0], a, c
      for x in rest:
        st = prev * g + cls
        q = sum(pr for t, pr in zip(src.succ[st], src.prob[st]) if t == x)
        p *= q
        prev, cls = x, src.group[prev]
      probs[seq] = probs.get(seq, 0.0) + p
  p = np.array([q for q in probs.values() if q > 0])
  assert np.isclose(p.sum(), 1.0)
  return float(-(p * np.log(p)).sum())


@pytest.mark.parametrize("seed", [0, 7, 21])
def test_entropy_rate_matches_brute_force(seed):
  src = _small_source(seed)
  h3, h4, h5 = (_block_entropy(src, n) for n in (3, 4, 5))
  # From position floor_from = 2 on, H(X_t | X_<t) equals the entropy rate exactly.
  assert src.floor_from == 2
  np.testing.assert_allclose(h4 - h3, src.entropy_rate, rtol=1e-10)
  np.testing.assert_allclose(h5 - h4, src.entropy_rate, rtol=1e-10)


def test_stationary_distribution_by_power_iteration():
  src = MarkovSource(SourceConfig(vocab=16, groups=2, support=3, seed=3))
  t = np.zeros((src.n_states, src.n_states))
  for s in range(src.n_states):  # transition matrix built by explicit loops
    a = s // 2
    for x, p in zip(src.succ[s], src.prob[s]):
      t[s, x * 2 + src.group[a]] += p
  pi = np.full(src.n_states, 1.0 / src.n_states)
  for _ in range(5000):
    pi = 0.5 * (pi + pi @ t)  # lazy chain: converges even if periodic
  np.testing.assert_allclose(src.pi, pi, atol=1e-9)


def test_samples_have_the_entropy_rate():
  src = MarkovSource(SourceConfig(vocab=64, groups=4, support=4, seed=5))
  tok = src.sample(400, 64, seed=np.random.default_rng().integers(1 << 30))
  assert tok.dtype == np.int32 and tok.min() >= 0 and tok.max() < 64
  nll = -src.log_prob_next(tok)
  # Samples are (nearly) independent across sequences; generous 5-sigma band.
  se = nll.mean(axis=1).std() / np.sqrt(len(nll))
  assert abs(nll.mean() - src.entropy_rate) < 5 * se + 1e-3


def test_impossible_transition_rejected():
  src = MarkovSource(SourceConfig(vocab=64, groups=4, support=2, seed=1))
  tok = src.sample(2, 10, seed=0)
  s = tok[0, 1] * 4 + src.group[tok[0, 0]]
  tok[0, 2] = next(x for x in range(64) if x not in src.succ[s])
  with pytest.raises(ValueError, match="cannot produce"):
    src.log_prob_next(tok)


def test_bad_source_config():
  with pytest.raises(ValueError, match="support=9 must be <= vocab=8"):
    SourceConfig(vocab=8, support=9)


def test_training_cache_is_keyed_by_config(tmp_path, monkeypatch):
  from lrjax.models import ModelConfig
  from lrjax.quality.train import TrainConfig, cache_key, trained_model

  src = MarkovSource(SourceConfig(vocab=64, groups=2, support=3, seed=2))
  mcfg = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
  )
  tc = TrainConfig(steps=3, warmup=1, batch=2, seq_len=8)
  m1, r1 = trained_model(src, mcfg, tc, cache_dir=str(tmp_path), progress=False)
  m2, r2 = trained_model(src, mcfg, tc, cache_dir=str(tmp_path), progress=False)
  assert not r1["cached"] and r2["cached"] and r1["cache_entry"] == r2["cache_entry"]
  tok = src.sample(2, 8, seed=0)
  np.testing.assert_array_equal(np.asarray(m1(tok)), np.asarray(m2(tok)))
  with open(os.path.join(r1["cache_entry"], "record.json")) as fh:
    assert json.load(fh)["train"]["steps"] == 3
  # Any config change gives a different key, so a stale entry is never picked up.
  other = cache_key(src.cfg, mcfg, TrainConfig(steps=4, warmup=1, batch=2, seq_len=8))
  assert other != os.path.basename(r1["cache_entry"])
  assert cache_key(src.cfg, mcfg.replace(hidden_size=64), tc) != other
  assert cache_key(SourceConfig(vocab=64, groups=2, support=3, seed=3), mcfg, tc) != other
  assert not os.path.exists(os.path.join(tmp_path, other))
  # ... and so does a change to the code that defines the model or the training loop.
  import lrjax.quality.train as train_mod

  monkeypatch.setattr(train_mod, "code_digest", lambda: "edited")
  assert cache_key(src.cfg, mcfg, tc) != os.path.basename(r1["cache_entry"])
  assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temp dirs left
