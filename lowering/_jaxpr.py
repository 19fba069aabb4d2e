"""The jaxpr walker: the only lrjax module that touches ``jax._src`` internals.

Pinned to jax >= 0.10.2, < 0.12. Everything else in lrjax goes through the
small API below (eqn evaluation, sub-jaxpr discovery, source locations).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any
from collections.abc import Callable, Sequence

import jax
from jax._src import core
from jax._src import source_info_util
from jax._src.interpreters import partial_eval as pe

SUPPORTED_JAX = ((0, 10, 2), (0, 12, 0))


def _version_tuple(v: str) -> tuple[int, ...]:
  out = []
  for part in v.split(".")[:3]:
    digits = "".join(c for c in part if c.isdigit())
    out.append(int(digits or 0))
  return tuple(out)


if not SUPPORTED_JAX[0] <= _version_tuple(jax.__version__) < SUPPORTED_JAX[1]:
  raise ImportError(
    f"lrjax's jaxpr pass supports jax >=0.10.2,<0.12; found jax {jax.__version__}. "
    "Install a supported jax (pip install 'jax>=0.10.2,<0.12')."
  )

Var = core.Var
Literal = core.Literal
Jaxpr = core.Jaxpr
ClosedJaxpr = core.ClosedJaxpr
JaxprEqn = core.JaxprEqn
DropVar = core.DropVar


def _varying(a) -> frozenset:
  mat = getattr(a, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(a, "vma", ()) or ())


def result_aval(shape, dtype, *operands):
  """The ShapedArray of a primitive's result, varying over the manual mesh axes its operands
  vary over (shard_map's type check: a result computed from per-device values is one)."""
  varying = frozenset().union(*(_varying(a) for a in operands))
  if not varying:
    return core.ShapedArray(shape, dtype)
  ref = max(operands, key=lambda a: len(_varying(a)))  # a per-device operand: its mesh
  sharding = jax.sharding.NamedSharding(ref.sharding.mesh, jax.sharding.PartitionSpec())
  if hasattr(core, "ManualAxisType"):  # jax 0.10
    mat = core.ManualAxisType(varying=varying)
    return core.ShapedArray(shape, dtype, sharding=sharding, manual_axis_type=mat)
  return core.ShapedArray(shape, dtype, sharding=sharding, vma=varying)


def is_literal(a) -> bool:
  return isinstance(a, core.Literal)


def aval(a):
  return a.aval


def bind_eqn(eqn: JaxprEqn, invals: Sequence[Any], params: dict | None = None) -> list:
  """Binds ``eqn``'s primitive on ``invals`` (as ``core.eval_jaxpr`` does); returns a list."""
  params = eqn.params if params is None else params
  bind_params = eqn.primitive.get_bind_params(params)
  if isinstance(bind_params, tuple):  # (subfuns, params) on some primitives
    subfuns, bind_params = bind_params
  else:
    subfuns = ()
  name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
  with (
    source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
    eqn.ctx.manager,
  ):
    ans = eqn.primitive.bind(*subfuns, *invals, **bind_params)
  return list(ans) if eqn.primitive.multiple_results else [ans]


_LOWERING_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def location(eqn: JaxprEqn, depth: int = 2) -> str:
  """'file.py:LINE (function)' of the user code that produced ``eqn``, innermost first,
  with up to ``depth`` frames (e.g. the layer's __call__ and the model code calling it)."""
  try:
    frames = [
      f
      for f in source_info_util.user_frames(eqn.source_info.traceback)
      if not f.file_name.startswith(_LOWERING_DIR)
    ][:depth]
    parts = [f"{f.file_name}:{f.start_line} ({f.function_name})" for f in frames]
    return " <- ".join(parts) if parts else source_info_util.summarize(eqn.source_info)
  except Exception:  # pragma: no cover - best effort only
    return "<unknown>"


def scope(eqn: JaxprEqn) -> str:
  """The eqn's name stack (jax.named_scope, transformations, module names), e.g. 'mlp/down'."""
  try:
    return str(eqn.source_info.name_stack)
  except Exception:  # pragma: no cover - best effort only
    return ""


@dataclasses.dataclass(frozen=True)
class SubJaxpr:
  """One jaxpr held in an eqn's params, and how the eqn's operands map onto its invars."""

  key: str  # param name
  index: int | None  # position when the param is a tuple of jaxprs (cond branches)
  jaxpr: Jaxpr
  consts: tuple  # closed-over consts ( () for an open Jaxpr)
  closed: bool
  operand_map: tuple[int | None, ...]  # inner invar i <- eqn operand operand_map[i] (None: none)


def sub_jaxprs(eqn: JaxprEqn) -> list[SubJaxpr]:
  """The jaxprs nested in ``eqn`` that the pass descends into."""
  name = eqn.primitive.name
  n_in = len(eqn.invars)
  out = []
  for key, val in eqn.params.items():
    vals = val if isinstance(val, (tuple, list)) else (val,)
    for idx, j in enumerate(vals):
      if isinstance(j, core.ClosedJaxpr):
        jx, consts, closed = j.jaxpr, tuple(j.consts), True
      elif isinstance(j, core.Jaxpr):
        jx, consts, closed = j, (), False
      else:
        continue
      n = len(jx.invars)
      if name == "while":
        cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        carry = list(range(cn + bn, n_in))
        omap = (
          (list(range(cn)) + carry) if key == "cond_jaxpr" else (list(range(cn, cn + bn)) + carry)
        )
      elif name == "cond":
        omap = list(range(1, n_in))  # operand 0 is the branch index
      else:
        omap = list(range(n_in)) if n == n_in else [None] * n
      out.append(
        SubJaxpr(
          key, idx if isinstance(val, (tuple, list)) else None, jx, consts, closed, tuple(omap)
        )
      )
  return out


def scan_counts(eqn: JaxprEqn) -> tuple[int, int]:
  """(consts, carry) operand counts of a scan: ``num_consts`` / ``num_carry`` up to jax 0.10,
  the (consts, carry, xs) split of its ``ft_in`` tree from jax 0.11."""
  p = eqn.params
  if "num_consts" in p:
    return p["num_consts"], p["num_carry"]
  if "ft_in" in p:
    consts, carry, _ = p["ft_in"].update(list(range(len(eqn.invars)))).unpack()
    return len(consts), len(carry)
  raise NotImplementedError(
    f"scan params {sorted(p)}: neither num_consts nor ft_in (an unsupported jax version)"
  )


def carried_invars(eqn: JaxprEqn, sub: SubJaxpr) -> set[int]:
  """Inner invar positions that are loop-carried (their value changes across iterations)."""
  name = eqn.primitive.name
  if name == "scan":
    nc, ncar = scan_counts(eqn)
    return set(range(nc, nc + ncar))
  if name == "while":
    k = eqn.params["cond_nconsts"] if sub.key == "cond_jaxpr" else eqn.params["body_nconsts"]
    return set(range(k, len(sub.jaxpr.invars)))
  return set()


def retrace(fn: Callable, in_avals: Sequence[Any]):
  """Traces ``fn(*args)`` at ``in_avals`` to a ClosedJaxpr."""
  structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in in_avals]
  return jax.make_jaxpr(fn)(*structs)


def is_shard_map(eqn: JaxprEqn) -> bool:
  return eqn.primitive.name == "shard_map"


def rebind_shard_map(eqn: JaxprEqn, body: Callable, invals: Sequence[Any]) -> list:
  """Binds ``eqn`` (a shard_map) again with ``body`` as its per-device function, through the
  public ``jax.shard_map`` so that the body is traced with the mesh axes bound and the
  operands' varying-axes types, as shard_map itself traces it."""
  p = eqn.params
  fn = jax.shard_map(
    lambda *a: tuple(body(*a)),
    mesh=p["mesh"],
    in_specs=tuple(p["in_specs"]),
    out_specs=tuple(p["out_specs"]),
    axis_names=set(p["newly_manual_axes"]),
    check_vma=p["check_vma"],
  )
  return list(fn(*invals))


def replace_sub_jaxpr(eqn: JaxprEqn, sub: SubJaxpr, new: ClosedJaxpr, params: dict):
  """Returns (params, extra_leading_operands) with ``sub`` replaced by ``new``."""
  extra = ()
  if sub.closed:
    newval: Any = new
  else:
    newval = new.jaxpr
    if new.consts:
      if eqn.primitive.name not in ("remat", "checkpoint", "remat2"):
        raise NotImplementedError(f"rewritten open jaxpr of {eqn.primitive.name} gained consts")
      newval = pe.convert_constvars_jaxpr(new.jaxpr)
      extra = tuple(new.consts)
  params = dict(params)
  if sub.index is None:
    params[sub.key] = newval
  else:
    lst = list(params[sub.key])
    lst[sub.index] = newval
    params[sub.key] = tuple(lst)
  return params, extra


def require_devices_during_lowering(*prims) -> None:
  """Makes jax hand device assignments to these primitives' lowering rules
  (custom_partitioning needs them when a kernel is lowered under SPMD)."""
  from jax._src import dispatch

  dispatch.prim_requires_devices_during_lowering.update(prims)


def last_uses(jaxpr: Jaxpr) -> dict:
  """var -> list of (eqn index | 'out', operand position) that read it."""
  uses: dict = {}
  for i, e in enumerate(jaxpr.eqns):
    for k, v in enumerate(e.invars):
      if isinstance(v, core.Var):
        uses.setdefault(v, []).append((i, k))
  for k, v in enumerate(jaxpr.outvars):
    if isinstance(v, core.Var):
      uses.setdefault(v, []).append(("out", k))
  return uses


def eval_closed(jaxpr: Jaxpr, consts, *args):
  return core.eval_jaxpr(jaxpr, consts, *args)
