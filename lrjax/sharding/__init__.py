"""Tensor parallelism for lrjax models: low-rank layouts with rank-space collectives.

  mesh  = lrjax.sharding.make_mesh(tp=4)                 # axes ("data", "tp")
  model = lrjax.sharding.shard(model, mesh, strategy="auto")   # or a name in STRATEGIES
  print(model.tp_plan)                                   # the choice, and why
  print(lrjax.sharding.explain(model, tp=8, batch=32))   # every strategy's predicted step
  spec  = lrjax.sharding.cache_spec("lowrank_tp")       # KV cache PartitionSpec

Params get ``NamedSharding``s from one rules table per strategy (:mod:`lrjax.sharding.rules`);
XLA's SPMD partitioner then inserts the collectives, except under ``lowrank_split``, whose
decoder layers run an explicit per-device program (:mod:`lrjax.sharding.split`).
:mod:`lrjax.sharding.hlo` counts the collectives in compiled HLO, :mod:`lrjax.sharding.cost`
predicts each strategy's decode step for ``auto``. Fused kernels (``lr_xuv``/``lr_mlp``/
``lr_mlp_rank`` custom calls) run on local shards through ``custom_partitioning``
(``lrjax.lowering.partitioning``) or inside the per-device program.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lrjax.sharding import cost
from lrjax.sharding.cost import TPExplain
from lrjax.sharding.hlo import Collective, collectives, summarize, weight_gathers
from lrjax.sharding.rules import (
  AUTO,
  CACHE,
  COL_PROJS,
  MESH_AXES,
  ROW_PROJS,
  RULES,
  STRATEGIES,
  check_strategy,
  param_spec,
)

log = logging.getLogger("lrjax.sharding")


def default_device() -> jax.Device:
  """Where arrays go without a mesh: ``jax.default_device``'s device when one is set (a
  Device or a platform name), else the first device."""
  d = jax.config.jax_default_device
  if d is None:
    return jax.devices()[0]
  return jax.devices(d)[0] if isinstance(d, str) else d


def make_mesh(tp: int, data: int = 1, devices=None) -> Mesh:
  """A ("data", "tp") mesh over the first data·tp devices."""
  devices = list(jax.devices() if devices is None else devices)
  for name, v in (("tp", tp), ("data", data)):
    if not isinstance(v, (int, np.integer)) or v < 1:
      raise ValueError(f"{name}={v!r} must be a positive int")
  if tp * data > len(devices):
    raise ValueError(
      f"tp={tp} × data={data} needs {tp * data} devices; {len(devices)} visible "
      "(on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before "
      "importing jax)"
    )
  return Mesh(np.asarray(devices[: tp * data]).reshape(data, tp), MESH_AXES)


def _tp(mesh: Mesh) -> int:
  if "tp" not in mesh.axis_names:
    raise ValueError(f"mesh axes {mesh.axis_names} must include 'tp' (use make_mesh)")
  return mesh.shape["tp"]


def _key(path) -> str:
  return ".".join(str(x) for x in path)


def _axes(var) -> tuple:
  return tuple(var.get_metadata().get("out_sharding") or ())


def _check_cfg(cfg, strategy: str, tp: int):
  if strategy in ("dense", "lowrank_tp", "repl_u_tp", "lowrank_split", "lowrank_megatron"):
    for name in ("num_heads", "num_kv_heads"):
      if getattr(cfg, name) % tp:
        raise ValueError(
          f"{strategy} with tp={tp} splits attention by heads: cfg.{name}="
          f"{getattr(cfg, name)} must be a multiple of tp (or use a smaller tp)"
        )
    if cfg.intermediate_size % tp:
      raise ValueError(f"cfg.intermediate_size={cfg.intermediate_size} must be a multiple of {tp=}")
  if strategy == "lowrank_split" and cfg.hidden_size % tp:
    raise ValueError(
      f"lowrank_split splits the hidden state: cfg.hidden_size={cfg.hidden_size} must be a "
      f"multiple of {tp=} (or use another strategy)"
    )


def spec_for(strategy: str, key: str, axes: tuple, shape: tuple, tp: int) -> P:
  """The checked PartitionSpec of one param; lm_head falls back to replicated if vocab % tp."""
  spec = param_spec(strategy, key, axes, len(shape))
  for d, ax in enumerate(spec):
    if ax == "tp" and shape[d] % tp:
      if tuple(axes) == ("embed", "vocab"):
        log.info("%s: vocab %d is not a multiple of tp=%d; lm_head replicated", key, shape[d], tp)
        return P()
      raise ValueError(
        f"{key}: dim {d} of shape {tuple(shape)} is split over tp={tp} by "
        f"{strategy} ({spec}) but is not a multiple of it; choose ranks that are "
        f"multiples of {tp} (compress with rank_multiple={tp}) or a smaller tp"
      )
  return spec


def param_shardings(cfg, mesh: Mesh, strategy: str = "lowrank_tp"):
  """``fn(key, logical_axes, shape=None) → NamedSharding`` for ``strategy`` on ``mesh``.

  With ``shape`` the divisibility is checked (:func:`spec_for`); ``lrjax.serving.load_model``
  passes it to :func:`lrjax.checkpoint.load` so params are restored straight into these shardings.
  """
  check_strategy(strategy)
  tp = _tp(mesh)
  _check_cfg(cfg, strategy, tp)

  def fn(key, axes, shape=None):
    if shape is None:
      return NamedSharding(mesh, param_spec(strategy, key, axes, len(axes)))
    return NamedSharding(mesh, spec_for(strategy, key, axes, shape, tp))

  return fn


@dataclasses.dataclass(frozen=True)
class TPPlan:
  """What :func:`shard` decided: the strategy, the mesh and the KV cache spec; with
  ``strategy="auto"``, ``explain`` holds the cost model's comparison that chose it."""

  strategy: str
  mesh: Mesh
  explain: TPExplain | None = dataclasses.field(default=None, compare=False)

  def __repr__(self) -> str:
    head = f"TPPlan({self.strategy}, tp={self.tp}, mesh {dict(self.mesh.shape)})"
    return head if self.explain is None else f"{head}\n{self.explain}"

  @property
  def tp(self) -> int:
    return self.mesh.shape["tp"]

  def cache_sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, CACHE[self.strategy])

  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  def batch(self, ndim: int = 1) -> NamedSharding:
    """Activations with a leading batch dim: split over "data", replicated over "tp"."""
    return NamedSharding(self.mesh, P("data", *([None] * (ndim - 1))))


def cache_spec(strategy: str) -> P:
  return CACHE[check_strategy(strategy)]


def _dtype_bytes(model) -> int:
  return int(np.dtype(model.embed.embedding[...].dtype).itemsize)


def explain(
  model_or_cfg,
  tp: int,
  *,
  ranks=None,
  heads=None,
  batch: int = cost.DEFAULT_BATCH,
  ctx: int = cost.DEFAULT_CTX,
  dtype_bytes: int | None = None,
  device: str | None = None,
) -> TPExplain:
  """Every strategy's predicted decode step for a model (or a config with ``ranks``) at ``tp``
  on ``device`` (a ``jax.Device.device_kind``; default: the first device's), fastest first.

  ``print()`` it for a table; ``.choice`` is what ``strategy="auto"`` picks."""
  if hasattr(model_or_cfg, "cfg"):
    model = model_or_cfg
    cfg, ranks, heads = model.cfg, model.layer_ranks(), model.layer_heads()
    dtype_bytes = dtype_bytes or _dtype_bytes(model)
  else:
    cfg = model_or_cfg
  return cost.explain(
    cfg,
    ranks,
    tp,
    heads=heads,
    batch=batch,
    ctx=ctx,
    dtype_bytes=dtype_bytes or 2,
    device=device or jax.devices()[0].device_kind,
  )


def resolve(strategy: str, model_or_cfg, tp: int, **kw) -> tuple[str, TPExplain | None]:
  """``strategy`` checked, or for "auto" the strategy :func:`explain` picks (and its report)."""
  if strategy != AUTO:
    return check_strategy(strategy), None
  report = explain(model_or_cfg, tp, **kw)
  log.info("auto: %s", report.reason)
  return report.choice, report


def shard(
  model,
  mesh: Mesh,
  strategy: str = "lowrank_tp",
  *,
  batch: int = cost.DEFAULT_BATCH,
  ctx: int = cost.DEFAULT_CTX,
  report: TPExplain | None = None,
):
  """Place every param of ``model`` by ``strategy``'s rules (in place); returns the model.

  ``strategy="auto"`` picks the strategy the cost model predicts fastest for a decode step of
  ``batch`` tokens at context ``ctx`` on the mesh's devices (:func:`explain`). The plan is kept on
  ``model.tp_plan`` for the serving engine; ``report`` (an :func:`explain` result) is kept on it.
  """
  tp = _tp(mesh)
  if strategy == AUTO:
    device = mesh.devices.flat[0].device_kind
    strategy, report = resolve(AUTO, model, tp, batch=batch, ctx=ctx, device=device)
  check_strategy(strategy)
  _check_cfg(model.cfg, strategy, tp)
  from lrjax.sharding import split

  if strategy == "lowrank_split":
    for i, layer in enumerate(model.layers):
      split.check_layer(layer, i)
  _, state = nnx.split(model)
  n = 0
  for path, var in nnx.to_flat_state(state):
    key = _key(path)
    spec = spec_for(strategy, key, _axes(var), tuple(var.shape), tp)
    var.value = jax.device_put(var.value, NamedSharding(mesh, spec))
    n += 1
  if strategy == "lowrank_split":
    split.install(model, mesh)
  else:
    split.uninstall(model)
  model.tp_plan = TPPlan(strategy, mesh, report)
  log.info("sharded %d params with %s over tp=%d", n, strategy, tp)
  return model


def plan_of(model) -> TPPlan | None:
  return getattr(model, "tp_plan", None)


def param_specs(model, strategy: str, tp: int) -> dict[str, P]:
  """{flat key: PartitionSpec} for ``model`` under ``strategy`` (no placement)."""
  _, state = nnx.split(model)
  return {
    _key(p): spec_for(strategy, _key(p), _axes(v), tuple(v.shape), tp)
    for p, v in nnx.to_flat_state(state)
  }


__all__ = [
  "AUTO",
  "CACHE",
  "COL_PROJS",
  "Collective",
  "MESH_AXES",
  "ROW_PROJS",
  "RULES",
  "STRATEGIES",
  "TPExplain",
  "TPPlan",
  "cache_spec",
  "collectives",
  "default_device",
  "explain",
  "make_mesh",
  "param_shardings",
  "param_spec",
  "param_specs",
  "plan_of",
  "resolve",
  "shard",
  "spec_for",
  "summarize",
  "weight_gathers",
]
