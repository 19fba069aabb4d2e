"""Which TP strategy is fastest for a model, a TP degree and a device: the cost model behind
``lrjax.sharding.shard(model, mesh, strategy="auto")``.

A decode step of ``batch`` tokens at context ``ctx`` is predicted per strategy as

  t = overhead + per_token · batch                           (every strategy alike)
    + (weight bytes read + KV bytes read) per device / HBM bandwidth
    + Σ collectives (latency + cost bytes · batch / link bandwidth)

Weight bytes per device follow the strategy's rules table (:mod:`lrjax.sharding.rules`) applied to
the model's param shapes; the embedding table counts only where it is read (tied output head).
The collectives per layer are those the strategy runs (:func:`layer_collectives`): as compiled by
XLA:GPU, which did not combine independent collectives (benchmarks/results/tp_h200.json),
and, for ``lowrank_split``, as its layer program issues them. Cost bytes follow
:mod:`lrjax.sharding.hlo` (an all-reduce moves twice its operand).

The constants are data (``interconnect.json``), one entry per device kind: the H200's are a
least-squares fit to 60 measured decode steps (``python benchmarks/tp_costfit.py``); an
unmeasured device falls back to the entry whose name it shares, else to the default (the H200
fit), and :func:`explain` says which.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence

from lrjax.models.llama import PROJ_NAMES as PROJS
from lrjax.models.llama import proj_axes
from lrjax.sharding.rules import (
  CACHE,
  STRATEGIES,
)

TABLE_PATH = os.path.join(os.path.dirname(__file__), "interconnect.json")
DEFAULT_BATCH = 8
DEFAULT_CTX = 1024
_COST = {"all-reduce": 2.0, "all-gather": 1.0, "reduce-scatter": 1.0}


# ----------------------------------------------------------------------------- the data table


@dataclasses.dataclass(frozen=True)
class Interconnect:
  """Cost-model constants of one device kind (one entry of ``interconnect.json``)."""

  name: str
  hbm_tbps: float  # effective HBM bandwidth for streaming weights and the KV cache
  latency_us: float  # per collective
  link_gbps: float  # effective bandwidth for a collective's cost bytes
  overhead_ms: float  # per decode step, the same for every strategy
  per_token_us: float  # per token of a decode step, the same for every strategy
  measured: bool
  source: str


def table(path: str = TABLE_PATH) -> tuple[dict[str, Interconnect], str]:
  """({device kind: entry}, the default entry's device kind) from ``interconnect.json``."""
  with open(path) as f:
    raw = json.load(f)
  names = [f.name for f in dataclasses.fields(Interconnect)[1:]]
  entries = {k: Interconnect(k, **{n: v[n] for n in names}) for k, v in raw["devices"].items()}
  return entries, raw["default"]


def interconnect_for(device_kind: str | None) -> tuple[Interconnect, str]:
  """The table entry for ``device_kind`` (``jax.Device.device_kind``) and how it was chosen:
  its own entry, else the entry sharing a model name with it (e.g. "H100"), else the default."""
  entries, default = table()

  def said(e):
    return f"{e.name} ({'measured' if e.measured else 'not measured'}: {e.source})"

  if device_kind in entries:
    return entries[device_kind], said(entries[device_kind])
  words = set((device_kind or "").replace("-", " ").split()) - {"NVIDIA", "GPU"}
  for key, e in entries.items():
    if words & (set(key.replace("-", " ").split()) - {"NVIDIA", "GPU"}):
      return e, f"no entry for {device_kind!r}; nearest {said(e)}"
  e = entries[default]
  return e, f"no entry for {device_kind!r}; the default, {said(e)}"


# ----------------------------------------------------------------------------- the model's shapes


@dataclasses.dataclass(frozen=True)
class ParamShape:
  key: str  # flat key as in the model's state, e.g. "layers.0.attn.q_proj.u"
  axes: tuple
  shape: tuple[int, ...]


def param_inventory(cfg, ranks: Sequence[Mapping[str, int]] | None, heads=None) -> list[ParamShape]:
  """The params of an lrjax Llama-family model with ``ranks`` (per layer {proj: rank}; absent
  projections are dense) and ``heads`` (per layer {proj: heads} of per-head factors)."""
  out = []
  shapes = cfg.proj_shapes()
  bias = {"q_proj": cfg.qkv_bias, "k_proj": cfg.qkv_bias, "v_proj": cfg.qkv_bias}
  bias["o_proj"] = cfg.o_bias
  for i in range(cfg.num_layers):
    r_i = dict(ranks[i]) if ranks else {}
    h_i = dict(heads[i]) if heads else {}
    pre = f"layers.{i}"
    for norm in ("input_layernorm", "post_attention_layernorm"):
      out.append(ParamShape(f"{pre}.{norm}.weight", ("embed",), (cfg.hidden_size,)))
    if cfg.qk_norm:
      for norm in ("q_norm", "k_norm"):
        out.append(ParamShape(f"{pre}.attn.{norm}.weight", (None,), (cfg.head_dim,)))
    for name in PROJS:
      k, n = shapes[name]
      ax_in, ax_out = proj_axes(name)
      p = f"{pre}.{'attn' if name in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{name}"
      r = r_i.get(name)
      if r is None:
        out.append(ParamShape(f"{p}.kernel", (ax_in, ax_out), (k, n)))
      elif h_i.get(name, 1) > 1:
        hh = h_i[name]
        out.append(ParamShape(f"{p}.u", (ax_in, "rank"), (k, int(r))))
        out.append(ParamShape(f"{p}.v", (ax_out, "rank", None), (hh, int(r) // hh, n // hh)))
      else:
        out.append(ParamShape(f"{p}.u", (ax_in, "rank"), (k, int(r))))
        out.append(ParamShape(f"{p}.v", ("rank", ax_out), (int(r), n)))
      if bias.get(name, cfg.mlp_bias):
        out.append(ParamShape(f"{p}.bias", (ax_out,), (n,)))
  out.append(ParamShape("embed.embedding", ("vocab", "embed"), (cfg.vocab_size, cfg.hidden_size)))
  out.append(ParamShape("norm.weight", ("embed",), (cfg.hidden_size,)))
  if not cfg.tie_word_embeddings:
    out.append(ParamShape("lm_head.kernel", ("embed", "vocab"), (cfg.hidden_size, cfg.vocab_size)))
  return out


def lowrank(ranks) -> bool:
  return bool(ranks) and any(r for r in ranks)


# ----------------------------------------------------------------------------- collectives


@dataclasses.dataclass(frozen=True)
class Coll:
  """One collective of a layer: kind, elements per token of its (gathered) result, and bytes per
  element."""

  kind: str
  elems: int
  elem_bytes: int
  what: str

  @property
  def cost_bytes_per_token(self) -> float:
    return _COST[self.kind] * self.elems * self.elem_bytes


def _width(cfg, name):
  return cfg.proj_shapes()[name][1]


def layer_collectives(strategy: str, cfg, r: Mapping[str, int], act_bytes: int) -> list[Coll]:
  """The collectives one decoder layer runs per step under ``strategy`` (ranks ``r``; a dense
  projection of a low-rank model reduces its full width)."""
  e = cfg.hidden_size

  def rank(name):
    return r.get(name) or _width(cfg, name)

  ar = lambda n, what, b=act_bytes: Coll("all-reduce", n, b, what)  # noqa: E731
  ag = lambda n, what: Coll("all-gather", n, act_bytes, what)  # noqa: E731
  if strategy == "dense":
    return [ar(e, "o"), ar(e, "down")]
  if strategy == "naive_tp":
    return [ar(_width(cfg, n), n) for n in PROJS]
  if strategy == "lowrank_tp":
    return [
      ag(rank("q_proj"), "q"),
      ag(rank("k_proj"), "k"),
      ag(rank("v_proj"), "v"),
      ar(rank("o_proj"), "o"),
      ag(rank("gate_proj"), "gate"),
      ag(rank("up_proj"), "up"),
      ar(rank("down_proj"), "down"),
    ]
  if strategy == "repl_u_tp":  # unfused: the residual split on hidden, as XLA propagates it
    return [
      ar(1, "norm", 4),
      *(ar(rank(n), n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
      ar(1, "norm", 4),
      *(ar(rank(n), n) for n in ("gate_proj", "up_proj", "down_proj")),
    ]
  if strategy == "lowrank_split":
    qkv = rank("q_proj") + rank("k_proj") + rank("v_proj")
    return [
      ar(qkv + 1, "q/k/v + norm", 4),
      ar(rank("o_proj"), "o", 4),
      ar(rank("gate_proj") + rank("up_proj") + 1, "gate/up + norm", 4),
      ar(rank("down_proj"), "down", 4),
    ]
  if strategy == "lowrank_megatron":
    return [ar(rank("o_proj"), "o"), ar(rank("down_proj"), "down")]
  raise ValueError(f"{strategy=} is not a sharding strategy; expected one of {STRATEGIES}")


def model_collectives(strategy: str, cfg, act_bytes: int) -> list[Coll]:
  """Collectives outside the layers that one strategy runs and the others do not."""
  if strategy == "lowrank_split":  # the final norm's sum of squares, and h for the output head
    return [
      Coll("all-reduce", 1, 4, "final norm"),
      Coll("all-gather", cfg.hidden_size, act_bytes, "h"),
    ]
  return []


# ----------------------------------------------------------------------------- predictions


@dataclasses.dataclass(frozen=True)
class StrategyCost:
  """The predicted decode step of one strategy (``ms`` None when it does not apply)."""

  strategy: str
  ms: float | None
  weight_bytes: int  # held per device (every param)
  read_bytes: int  # weights read per step per device (the embedding table only if tied)
  kv_bytes: int  # KV cache read per step per device
  collectives: int  # per step
  collective_bytes: float  # cost bytes per step
  breakdown: dict  # ms: {"weights", "kv", "collective latency", "collective bytes", "other"}
  note: str = ""


def _spec_split(strategy, p: ParamShape, tp: int) -> int:
  """How many ways ``strategy`` splits param ``p`` over tp; ValueError if it cannot."""
  from lrjax.sharding import spec_for

  spec = spec_for(strategy, p.key, p.axes, p.shape, tp)
  return tp ** sum(1 for a in spec if a == "tp")


def _check(strategy: str, cfg, tp: int):
  from lrjax.sharding import _check_cfg

  _check_cfg(cfg, strategy, tp)


def predict(
  strategy: str,
  cfg,
  ranks,
  tp: int,
  *,
  heads=None,
  batch: int = DEFAULT_BATCH,
  ctx: int = DEFAULT_CTX,
  dtype_bytes: int = 2,
  ic: Interconnect | None = None,
) -> StrategyCost:
  """The predicted decode step of ``strategy`` (see the module docstring)."""
  ic = ic or interconnect_for(None)[0]
  params = param_inventory(cfg, ranks, heads)
  try:
    if strategy == "dense" and lowrank(ranks):
      raise ValueError("a low-rank model: dense Megatron needs merged weights")
    if strategy != "dense" and not lowrank(ranks):
      raise ValueError("a dense model has no factor pairs")
    _check(strategy, cfg, tp)
    splits = [_spec_split(strategy, p, tp) for p in params]
  except ValueError as err:
    return StrategyCost(strategy, None, 0, 0, 0, 0, 0.0, {}, f"does not apply: {err}")
  held = read = 0
  for p, k in zip(params, splits):
    b = math.prod(p.shape) * dtype_bytes // k
    held += b
    if p.key != "embed.embedding" or cfg.tie_word_embeddings:
      read += b
  kv_split = tp if "tp" in tuple(CACHE[strategy]) else 1
  kv = cfg.num_layers * batch * ctx * cfg.num_kv_heads * cfg.head_dim * 2 * dtype_bytes // kv_split
  colls = model_collectives(strategy, cfg, dtype_bytes)
  for i in range(cfg.num_layers):
    colls += layer_collectives(strategy, cfg, dict(ranks[i]) if ranks else {}, dtype_bytes)
  cb = sum(c.cost_bytes_per_token for c in colls) * batch
  br = {
    "weights": read / (ic.hbm_tbps * 1e12) * 1e3,
    "kv": kv / (ic.hbm_tbps * 1e12) * 1e3,
    "collective latency": len(colls) * ic.latency_us * 1e-3,
    "collective bytes": cb / (ic.link_gbps * 1e9) * 1e3,
    "other": ic.overhead_ms + ic.per_token_us * batch * 1e-3,
  }
  return StrategyCost(strategy, sum(br.values()), held, read, kv, len(colls), cb, br)


def _merged_dense(cfg, ranks):
  """The model with every low-rank pair merged into one dense kernel (a reference point)."""
  return None if not lowrank(ranks) else [dict() for _ in range(cfg.num_layers)]


@dataclasses.dataclass(frozen=True)
class TPExplain:
  """Why ``auto`` picks what it picks: every strategy's predicted decode step."""

  choice: str
  tp: int
  batch: int
  ctx: int
  device: str
  interconnect: str  # the table entry used and how it was chosen
  costs: tuple[StrategyCost, ...]  # sorted, fastest first; inapplicable last
  merged_dense: StrategyCost | None  # dense Megatron on merged factors, for reference
  reason: str

  def __str__(self) -> str:
    lines = [
      f"auto → {self.choice} at tp={self.tp}, decode batch {self.batch}, context {self.ctx}",
      f"  device {self.device}: {self.interconnect}",
      f"  {self.reason}",
      f"  {'strategy':18s} {'ms/step':>8s} {'GB/dev':>7s} {'colls':>6s} "
      f"{'weights':>8s} {'kv':>6s} {'latency':>8s} {'bytes':>6s} {'other':>6s}",
    ]
    rows = list(self.costs) + ([self.merged_dense] if self.merged_dense else [])
    for c in rows:
      name = c.strategy if c is not self.merged_dense else "(merged dense)"
      if c.ms is None:
        lines.append(f"  {name:18s} {c.note}")
        continue
      b = c.breakdown
      lines.append(
        f"  {name:18s} {c.ms:8.3f} {c.weight_bytes / 1e9:7.2f} {c.collectives:6d} "
        f"{b['weights']:8.3f} {b['kv']:6.3f} {b['collective latency']:8.3f} "
        f"{b['collective bytes']:6.3f} {b['other']:6.3f}"
      )
    if self.merged_dense is not None and self.merged_dense.ms is not None:
      lines.append(
        "  (merged dense): Megatron on U·V merged into dense kernels, for reference (not a "
        "strategy for factored weights)"
      )
    return "\n".join(lines)


def explain(
  cfg,
  ranks,
  tp: int,
  *,
  heads=None,
  batch: int = DEFAULT_BATCH,
  ctx: int = DEFAULT_CTX,
  dtype_bytes: int = 2,
  device: str | None = None,
  strategies: Sequence[str] = STRATEGIES,
  interconnect: Interconnect | None = None,
) -> TPExplain:
  """Every strategy's predicted decode step and the fastest that applies (``choice``), with the
  constants of ``device``'s table entry (or ``interconnect``, given)."""
  if interconnect is not None:
    ic, how = interconnect, f"{interconnect.name} (given)"
  else:
    ic, how = interconnect_for(device)
  kw = dict(heads=heads, batch=batch, ctx=ctx, dtype_bytes=dtype_bytes, ic=ic)
  costs = [predict(s, cfg, ranks, tp, **kw) for s in strategies]
  ok = sorted((c for c in costs if c.ms is not None), key=lambda c: c.ms)
  if not ok:
    raise ValueError(
      f"no sharding strategy applies at tp={tp}: "
      + "; ".join(f"{c.strategy} {c.note}" for c in costs)
    )
  merged = None
  if lowrank(ranks):
    merged = predict("dense", cfg, _merged_dense(cfg, ranks), tp, **kw)
  best = ok[0]
  reason = f"{best.strategy} is predicted fastest"
  if len(ok) > 1:
    nxt = ok[1]
    dw = (nxt.breakdown["weights"] + nxt.breakdown["kv"]) - (
      best.breakdown["weights"] + best.breakdown["kv"]
    )
    dc = (nxt.breakdown["collective latency"] + nxt.breakdown["collective bytes"]) - (
      best.breakdown["collective latency"] + best.breakdown["collective bytes"]
    )

    def more(x):
      return f"{abs(x):.3f} ms {'more' if x >= 0 else 'less'}"

    reason += (
      f": {best.ms:.3f} ms a step against {nxt.ms:.3f} for {nxt.strategy}, which spends "
      f"{more(dw)} on HBM reads and {more(dc)} on collectives ({nxt.collectives} against "
      f"{best.collectives} a step)"
    )
  rest = tuple(c for c in costs if c.ms is None)
  return TPExplain(
    best.strategy, tp, batch, ctx, device or "unknown", how, tuple(ok) + rest, merged, reason
  )


def choose(cfg, ranks, tp: int, **kw) -> str:
  """The strategy :func:`explain` predicts fastest."""
  return explain(cfg, ranks, tp, **kw).choice
