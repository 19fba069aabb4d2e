"""The ``neuron`` lowerings of lr_xuv and lr_mlp by the NKI TrainiumFusion kernels.

Light module: importing it never imports the Neuron toolchain. ``KERNELS`` can be
listed and their ``supports`` evaluated on any machine (they only consult the
block planner), so the explain report can say which NKI kernel would serve a
primitive on Trainium. :func:`register` registers them only when the Neuron
toolchain is installed (``nki`` of Neuron SDK 2.33 and the ``jax_neuronx`` PJRT
plugin, checked with ``find_spec``, nothing imported); elsewhere it does nothing and
the reference lowering serves. ``load()`` imports the kernel modules, whose
``@nki.jit`` kernels are called with jax arrays (NKI's JAX integration, which
replaced ``jax_neuronx.nki_call`` in Neuron 2.23).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math

import numpy as np

from lrjax.custom_calls.nki import planner
from lrjax.lowering import registry
from lrjax.lowering.registry import KernelLowering

log = logging.getLogger("lrjax.custom_calls.nki")

PLATFORM = "neuron"
_DTYPES = ("bfloat16", "float16")
_ACTS = ("silu", "gelu_tanh", "gelu", "relu")


def neuron_available() -> bool:
  """True when NKI and jax-neuronx are importable (nothing is imported to find out)."""
  try:
    return all(importlib.util.find_spec(m) is not None for m in ("nki", "jax_neuronx"))
  except (ImportError, ValueError):
    return False


def _dtype_reason(avals, params) -> str | None:
  x = avals[0]
  dt = np.dtype(x.dtype)
  if dt.name not in _DTYPES:
    return (
      f"x.dtype={dt.name}: the NKI kernels take {'/'.join(_DTYPES)} (X is transposed by "
      "DMA in transit, which moves 2-byte types)"
    )
  for i, a in enumerate(avals[1:], 1):
    if np.dtype(a.dtype) != dt:
      return f"operand {i} dtype={np.dtype(a.dtype).name} != x.dtype={dt.name}; the kernels do not cast on load"  # noqa: E501
  for name in ("inter_dtype", "out_dtype", "scaled_dtype"):
    if name in params and np.dtype(params[name]) != dt:
      return (
        f"{name}={np.dtype(params[name]).name} != x.dtype={dt.name}: the kernels keep the "
        "cached strip and the output in the input dtype"
      )
  return None


def _rows(x) -> int:
  return math.prod(x.shape[:-1])


def xuv_plan(avals_in, params) -> planner.Plan:
  """The plan the lr_xuv kernel would run with (raises PlanError / ValueError if none)."""
  x, u, v = avals_in[:3]
  return planner.plan(
    "xuv",
    _rows(x),
    x.shape[-1],
    u.shape[1],
    v.shape[1],
    x.dtype,
    n_bias=int(params["has_bias"]),
    n_scale=int(params.get("has_scale", False)),
  )


def mlp_plan(avals_in, params) -> planner.MlpPlan:
  """The plans of the two launches the lr_mlp kernel would run with."""
  from lrjax.lowering.primitives import mlp_operands

  d = mlp_operands(avals_in, params["gated"], params["bias_mask"], params.get("scale_mask", ()))
  x = d["x"]
  uu, vu, bu = d["up"]
  sc = d["scales"]
  r_up = max(uu.shape[1], d["gate"][0].shape[1]) if params["gated"] else uu.shape[1]
  has_up_bias = bu is not None or (params["gated"] and d["gate"][2] is not None)
  has_up_scale = sc["up"] is not None or sc["gate"] is not None
  ud, vd, bd = d["down"]
  return planner.plan_mlp(
    _rows(x),
    x.shape[-1],
    r_up,
    vu.shape[1],
    ud.shape[1],
    vd.shape[1],
    x.dtype,
    gated=params["gated"],
    up_bias=(2 if params["gated"] else 1) if has_up_bias else 0,
    down_bias=bd is not None,
    up_scale=(2 if params["gated"] else 1) if has_up_scale else 0,
    down_scale=sc["down"] is not None,
  )


def _planned_supports(plan):
  """supports() from a planner: dtype rules, non-empty input, and a plan that fits."""

  def supports(avals_in, params):
    reason = _dtype_reason(avals_in, params)
    if reason:
      return reason
    if _rows(avals_in[0]) == 0:
      return "empty input (M=0)"
    try:
      plan(avals_in, params)
    except ValueError as e:
      return str(e)
    return None

  return supports


_xuv_supports = _planned_supports(xuv_plan)
_plan_mlp_supports = _planned_supports(mlp_plan)


def _mlp_supports(avals_in, params):
  if params["act"] not in _ACTS:
    return f"act={params['act']!r} has no NKI activation; expected one of {_ACTS}"
  return _plan_mlp_supports(avals_in, params)


def _load_xuv():
  from lrjax.custom_calls.nki import xuv

  def impl(*ops, has_bias, inter_dtype, out_dtype, has_scale=False, scaled_dtype=None):
    from lrjax.lowering.primitives import xuv_operands

    x, u, v, b, s = xuv_operands(ops, dict(has_bias=has_bias, has_scale=has_scale))
    return xuv.xuv(x, u, v, b, s)

  return impl


def _load_mlp():
  from lrjax.custom_calls.nki import mlp
  from lrjax.lowering.primitives import mlp_operands

  def impl(*ops, gated, act, bias_mask, inter_dtype, out_dtype, scale_mask=()):
    d = mlp_operands(ops, gated, bias_mask, scale_mask)
    sc = d["scales"]
    proj = lambda name: None if d[name] is None else (*d[name], sc[name])  # noqa: E731
    return mlp.mlp(d["x"], proj("up"), proj("down"), proj("gate"), act=act)

  return impl


KERNELS = [
  KernelLowering(
    primitive="lr_xuv",
    platform=PLATFORM,
    name="nki.xuv_trainium_fusion",
    supports=_xuv_supports,
    load=_load_xuv,
    priority=10,
  ),
  KernelLowering(
    primitive="lr_mlp",
    platform=PLATFORM,
    name="nki.mlp_up_gate_down",
    supports=_mlp_supports,
    load=_load_mlp,
    priority=10,
  ),
]


def register() -> None:
  """Registers the NKI lowerings when the Neuron toolchain is installed; else does nothing."""
  if not neuron_available():
    log.debug("NKI lowerings not registered: nki / jax_neuronx not installed")
    return
  try:  # only reached where both packages exist: tell the real NKI from PyPI's placeholder
    importlib.import_module("nki.language")
  except ImportError as e:
    log.warning("NKI lowerings not registered: `import nki.language` failed: %s", e)
    return
  for k in KERNELS:
    registry.register(k)


def would_serve(prim_name, avals_in, params) -> tuple[str | None, str]:
  """Which NKI kernel would lower this primitive on Neuron, and why (any machine).

  Returns (kernel name, plan summary) or (None, the declines joined by "; ").
  """
  name = getattr(prim_name, "name", prim_name)
  declines = []
  for k in KERNELS:
    if k.primitive != name:
      continue
    try:
      reason = k.supports(avals_in, params)
    except Exception as e:  # a malformed operand list must not break explain
      reason = f"supports() raised {type(e).__name__}: {e}"
    if reason is None:
      p = xuv_plan(avals_in, params) if name == "lr_xuv" else mlp_plan(avals_in, params)
      plans = (p,) if name == "lr_xuv" else (p.up_gate, p.down)
      desc = "; ".join(
        f"{q.kernel} blocks (B_M,B_K,B_r,B_N)={q.blocks.as_tuple()}, predicted HBM "
        f"{q.traffic.total / 2**20:.1f} MiB, AI {q.ai:.0f} flop/B, SBUF "
        f"{q.sbuf_pipelined_bytes / 2**20:.1f}/24 MiB"
        for q in plans
      )
      return k.name, desc
    declines.append(f"{k.name}: {reason}")
  if not declines:
    return None, f"no NKI kernel for {name}"
  return None, "; ".join(declines)
