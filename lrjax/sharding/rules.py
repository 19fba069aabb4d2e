"""Per-strategy rules: (projection role, param name) → PartitionSpec on a ("data", "tp") mesh.

A param's logical axes cannot tell the first sub-layer's "rank" from the second's, so the rules
are keyed by the projection's role instead:

  col  q_proj k_proj v_proj gate_proj up_proj   (first sub-layer: hidden → heads / intermediate)
  row  o_proj down_proj                          (second sub-layer: heads / intermediate → hidden)

and by the param name (``kernel``/``bias`` of a dense ``Linear``; ``u`` [in, rank], ``v`` [rank,
out], ``bias`` of a ``LowRankLinear``; a per-head ``v`` [heads, r_h, head_dim]).

Strategies (TP degree n = mesh size along "tp"):

  dense       Megatron TP: col kernels split on out, row kernels split on in; one all-reduce of
              the hidden state per sub-layer.
  naive_tp    DeInfer's Base (§2.2): every pair split along the rank, u column-parallel, v
              row-parallel, so every projection ends in an all-reduce of its full-width output
              and attention runs replicated on every device (KV cache replicated).
  lowrank_tp  DeInfer §4.1: col u split on the rank and all-gathered in rank space, col v split
              on out (local heads / local MLP columns); row u split on in (row-parallel) with its
              rank-space partial sums all-reduced, row v replicated.
  repl_u_tp   Third column: every u replicated, every v split on out like a column-parallel
              dense weight. Unfused, XLA then keeps the residual stream split on hidden and
              all-reduces in rank space; with fused kernels (lowering/partitioning.py) each
              projection's output is all-gathered at full width.
  lowrank_split
              No factor replicated: every u split on its input (K) dim, every v on its output
              dim, the residual stream split on hidden. Four rank-space all-reduces a layer (q/k/v
              partial sums with the input norm's sum of squares, o, gate/up with the second
              norm's, down), run by the layer program of :mod:`lrjax.sharding.split`. Dense
              kernels of a mixed model are split on their input dim too.
  lowrank_megatron
              Megatron's schedule on factor pairs: the factors on the hidden side (col u, row v)
              replicated, col v split on out, row u on in. Two rank-space all-reduces a layer
              (o and down), the residual stream replicated.

``lrjax.sharding.shard(..., strategy="auto")`` picks one by the cost model of
:mod:`lrjax.sharding.cost`.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "tp")
STRATEGIES = ("dense", "naive_tp", "lowrank_tp", "repl_u_tp", "lowrank_split", "lowrank_megatron")
AUTO = "auto"
COL_PROJS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PROJS = ("o_proj", "down_proj")

# Dense ``Linear`` projections follow Megatron in every strategy (a model may mix dense and
# low-rank projections).
_DENSE = {
  ("col", "kernel"): P(None, "tp"),
  ("col", "bias"): P("tp"),
  ("row", "kernel"): P("tp", None),
  ("row", "bias"): P(),
}

# (role, param) → spec for low-rank params; "v3" is a per-head v [heads, r_h, head_dim].
RULES: dict[str, dict[tuple[str, str], P]] = {
  "dense": {},
  "naive_tp": {
    ("col", "u"): P(None, "tp"),
    ("col", "v"): P("tp", None),
    ("col", "bias"): P(),
    ("row", "u"): P(None, "tp"),
    ("row", "v"): P("tp", None),
    ("row", "bias"): P(),
    ("col", "v3"): P("tp", None, None),
  },
  "lowrank_tp": {
    ("col", "u"): P(None, "tp"),
    ("col", "v"): P(None, "tp"),
    ("col", "bias"): P("tp"),
    ("row", "u"): P("tp", None),
    ("row", "v"): P(),
    ("row", "bias"): P(),
    ("col", "v3"): P("tp", None, None),
  },
  "repl_u_tp": {
    ("col", "u"): P(),
    ("col", "v"): P(None, "tp"),
    ("col", "bias"): P("tp"),
    ("row", "u"): P(),
    ("row", "v"): P(None, "tp"),
    ("row", "bias"): P("tp"),
    ("col", "v3"): P("tp", None, None),
  },
  "lowrank_split": {
    ("col", "u"): P("tp", None),
    ("col", "v"): P(None, "tp"),
    ("col", "bias"): P("tp"),
    ("row", "u"): P("tp", None),
    ("row", "v"): P(None, "tp"),
    ("row", "bias"): P("tp"),
    ("col", "v3"): P("tp", None, None),
    ("col", "kernel"): P("tp", None),
    ("row", "kernel"): P("tp", None),
  },
  "lowrank_megatron": {
    ("col", "u"): P(),
    ("col", "v"): P(None, "tp"),
    ("col", "bias"): P("tp"),
    ("row", "u"): P("tp", None),
    ("row", "v"): P(),
    ("row", "bias"): P(),
    ("col", "v3"): P("tp", None, None),
  },
}

# Params outside the projections, by logical axes: the embedding table and norms are replicated
# (the lookup stays local); lm_head is column-parallel over the vocabulary in every strategy.
OTHER = {("vocab", "embed"): P(), ("embed", "vocab"): P(None, "tp")}
# Per-strategy exceptions: lowrank_split keeps the hidden state split, so its norms are too.
OTHER_BY_STRATEGY = {"lowrank_split": {("embed",): P("tp")}}

# Each layer's KV cache buffer [batch, kv_heads, max_len, head_dim]: sharded on KV heads except
# in naive_tp, whose attention runs replicated.
CACHE = {
  "dense": P("data", "tp"),
  "naive_tp": P("data"),
  "lowrank_tp": P("data", "tp"),
  "repl_u_tp": P("data", "tp"),
  "lowrank_split": P("data", "tp"),
  "lowrank_megatron": P("data", "tp"),
}


def check_strategy(strategy: str) -> str:
  if strategy not in STRATEGIES:
    raise ValueError(
      f"{strategy=} is not a sharding strategy; expected one of {STRATEGIES} "
      f"(or {AUTO!r} where a model is sharded: lrjax.sharding.shard, lrjax.serving.load_model)"
    )
  return strategy


def role(proj: str) -> str:
  if proj in COL_PROJS:
    return "col"
  if proj in ROW_PROJS:
    return "row"
  raise ValueError(f"{proj=} is not a projection; expected one of {COL_PROJS + ROW_PROJS}")


def param_spec(strategy: str, key: str, axes: tuple, ndim: int) -> P:
  """PartitionSpec of the param at flat ``key`` (e.g. "layers.0.attn.q_proj.u")."""
  check_strategy(strategy)
  parts = key.split(".")
  proj = next((p for p in parts if p in COL_PROJS + ROW_PROJS), None)
  if proj is None:
    other = OTHER_BY_STRATEGY.get(strategy, {})
    return other.get(tuple(axes), OTHER.get(tuple(axes), P()))
  name = parts[-1]
  r = role(proj)
  if name == "kernel":
    return RULES[strategy].get((r, "kernel"), _DENSE[(r, "kernel")])
  if name == "bias" and (r, "bias") not in RULES[strategy]:
    return _DENSE[(r, "bias")]
  if strategy == "dense":
    raise ValueError(
      f"{key}: strategy 'dense' is for dense models but this param belongs to a "
      "low-rank projection; use 'lowrank_tp' (or 'naive_tp') for low-rank models"
    )
  if name == "v" and ndim == 3:
    if r != "col":
      raise ValueError(f"{key}: per-head factors are only supported on q/k/v projections")
    return RULES[strategy][("col", "v3")]
  spec = RULES[strategy].get((r, name))
  if spec is None:
    raise ValueError(f"{key}: no {strategy} rule for param {name!r} of a {r} projection")
  return spec
