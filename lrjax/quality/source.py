"""A synthetic token source with an exactly computable entropy rate.

A sparse random second-order Markov source over ``vocab`` tokens: token x_t is drawn from
P(· | x_{t-1}, g(x_{t-2})), where g maps tokens to ``groups`` classes and each of the
vocab·groups contexts has ``support`` successors with Dirichlet(``alpha``) probabilities.
The hidden chain on states s_t = (x_{t-1}, g(x_{t-2})) is first-order with vocab·groups states,
so its stationary distribution π is exact (a linear solve) and the entropy rate is
H = Σ_s π(s)·H(P(·|s)).

Sequences start in the stationary distribution: the first token is the state's x_{t-1}. From
the third token on (position ≥ :attr:`MarkovSource.floor_from`) the state is fully determined by
the visible past, so the best achievable cross-entropy there is exactly the entropy rate.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import scipy.sparse
import scipy.sparse.csgraph


@dataclasses.dataclass(frozen=True)
class SourceConfig:
  vocab: int = 256
  groups: int = 2
  support: int = 4
  alpha: float = 0.5
  seed: int = 0

  def __post_init__(self):
    for name in ("vocab", "groups", "support"):
      v = getattr(self, name)
      if not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name}={v!r} must be a positive int")
    if self.support > self.vocab:
      raise ValueError(f"support={self.support} must be <= vocab={self.vocab}")
    if self.groups > self.vocab:
      raise ValueError(f"groups={self.groups} must be <= vocab={self.vocab}")
    if not self.alpha > 0:
      raise ValueError(f"alpha={self.alpha!r} must be > 0")


class MarkovSource:
  """The source of :class:`SourceConfig`; see the module docstring."""

  floor_from = 2  # targets at sequence positions >= this have cross-entropy floor = entropy rate

  def __init__(self, cfg: SourceConfig = SourceConfig()):
    self.cfg = cfg
    v, g, k = cfg.vocab, cfg.groups, cfg.support
    rng = np.random.default_rng(cfg.seed)
    self.group = rng.permutation(np.arange(v) % g)  # [V] token → group
    n_states = v * g
    self.succ = np.stack([rng.choice(v, k, replace=False) for _ in range(n_states)])  # [S, k]
    self.prob = rng.dirichlet(np.full(k, cfg.alpha), size=n_states)  # [S, k]
    self.n_states = n_states
    self.pi = self._stationary()

  # state index of (previous token a, group c of the token before it)
  def state(self, a, c):
    return np.asarray(a) * self.cfg.groups + np.asarray(c)

  def transition_matrix(self) -> scipy.sparse.csr_matrix:
    """T[s, s'] = P(s_{t+1} = s' | s_t = s) on states s = (a, c)."""
    s = np.repeat(np.arange(self.n_states), self.cfg.support)
    a = s // self.cfg.groups
    nxt = self.state(self.succ.reshape(-1), self.group[a])
    return scipy.sparse.csr_matrix(
      (self.prob.reshape(-1), (s, nxt)), shape=(self.n_states, self.n_states)
    )

  def _stationary(self) -> np.ndarray:
    t = self.transition_matrix()
    n_comp, labels = scipy.sparse.csgraph.connected_components(t, connection="strong")
    # Closed classes: strongly connected components with no edge leaving them.
    coo = t.tocoo()
    leaving = np.zeros(n_comp, bool)
    leaving[labels[coo.row][labels[coo.row] != labels[coo.col]]] = True
    closed = np.flatnonzero(~leaving)
    if len(closed) != 1:
      raise ValueError(
        f"source {self.cfg} has {len(closed)} closed classes, so no unique "
        "stationary distribution; use another seed or a larger support"
      )
    members = np.flatnonzero(labels == closed[0])
    sub = t[members][:, members].toarray()
    # π (I − T) = 0 with Σπ = 1, solved densely on the closed class.
    m = len(members)
    a = np.vstack([(np.eye(m) - sub).T, np.ones((1, m))])
    b = np.zeros(m + 1)
    b[-1] = 1.0
    p_sub, *_ = np.linalg.lstsq(a, b, rcond=None)
    pi = np.zeros(self.n_states)
    pi[members] = np.clip(p_sub, 0.0, None)
    pi /= pi.sum()
    resid = np.abs(pi @ t - pi).max()
    if resid > 1e-10:
      raise RuntimeError(f"stationary distribution residual {resid:.3g} > 1e-10")
    return pi

  @property
  def entropy_rate(self) -> float:
    """Entropy rate in nats per token: Σ_s π(s)·H(P(·|s))."""
    p = self.prob
    h = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=1)
    return float(self.pi @ h)

  def sample(self, n: int, length: int, seed: int) -> np.ndarray:
    """``n`` sequences of ``length`` tokens (int32 [n, length]), started from π."""
    if n <= 0 or length < 1:
      raise ValueError(f"{n=} and {length=} must be positive")
    rng = np.random.default_rng(seed)
    g = self.cfg.groups
    s = rng.choice(self.n_states, size=n, p=self.pi)
    out = np.empty((n, length), np.int32)
    out[:, 0] = s // g
    cum = np.cumsum(self.prob, axis=1)
    for t in range(1, length):
      u = rng.random(n)[:, None]
      idx = np.minimum((cum[s] < u).sum(axis=1), self.cfg.support - 1)
      x = self.succ[s, idx]
      out[:, t] = x
      s = self.state(x, self.group[s // g])
    return out

  def log_prob_next(self, tokens: np.ndarray) -> np.ndarray:
    """True log P(x_t | past) for t >= floor_from: float64 [n, length - floor_from]."""
    tokens = np.asarray(tokens)
    s = self.state(tokens[:, 1:-1], self.group[tokens[:, :-2]])  # state before x_t, t >= 2
    x = tokens[:, 2:]
    hit = self.succ[s] == x[..., None]
    if not np.all(hit.any(-1)):
      raise ValueError("tokens contain a transition the source cannot produce")
    return np.log(np.sum(np.where(hit, self.prob[s], 0.0), axis=-1))


def describe(src: MarkovSource) -> dict:
  c = src.cfg
  return {
    "kind": "sparse second-order Markov",
    **dataclasses.asdict(c),
    "states": src.n_states,
    "entropy_rate_nats": src.entropy_rate,
    "floor_from_position": src.floor_from,
    "log_vocab_nats": math.log(c.vocab),
  }
