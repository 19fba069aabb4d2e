"""Where loaded params go: one Sharding, a dict by param key, a function, or logical-axis rules."""

from __future__ import annotations

from typing import Any
from collections.abc import Callable, Mapping

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lrjax.sharding import default_device

# What the ``shardings`` argument of the loaders may be.
Shardings = (
  jax.sharding.Sharding
  | Mapping[str, jax.sharding.Sharding]
  | Callable[[str, tuple], jax.sharding.Sharding]
)


def param_key(path: tuple) -> str:
  """Param key, e.g. ``layers.0.attn.q_proj.u``."""
  return ".".join(str(x) for x in path)


def param_axes(var) -> tuple:
  """Logical axis names of a param Variable."""
  return tuple(var.get_metadata().get("out_sharding") or ())


def logical_sharding(mesh: Mesh, rules: Mapping[str, str | None] | None = None):
  """``(key, logical axes) → NamedSharding`` mapping logical names through ``rules``.

  Names without a rule (or mapped to an axis the mesh lacks) are replicated.
  """
  rules = dict(rules or {})

  def fn(key, axes):
    spec = [
      rules.get(a) if a is not None and rules.get(a) in mesh.axis_names else None for a in axes
    ]
    return NamedSharding(mesh, PartitionSpec(*spec))

  return fn


def pick(shardings: Any, key: str, axes: tuple, mesh: Mesh | None) -> jax.sharding.Sharding:
  """The sharding of param ``key`` (logical ``axes``) under ``shardings`` / ``mesh``."""
  default = jax.sharding.SingleDeviceSharding(default_device())
  if shardings is None:
    return NamedSharding(mesh, PartitionSpec()) if mesh is not None else default
  if isinstance(shardings, jax.sharding.Sharding):
    return shardings
  if callable(shardings):
    return shardings(key, axes)
  if isinstance(shardings, Mapping):
    if key in shardings:
      return shardings[key]
    return NamedSharding(mesh, PartitionSpec()) if mesh is not None else default
  raise TypeError(
    f"shardings={type(shardings).__name__} must be a Sharding, a dict of "
    "key → Sharding, or a function (key, logical_axes) → Sharding"
  )
