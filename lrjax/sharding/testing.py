"""CPU stand-in kernels that lower to real custom calls, to test partitioning without a GPU.

On CPU the primitives lower to their jnp reference, plain HLO that XLA partitions by itself, so
the sharded path of a real kernel would go untested. :func:`callback_kernels` registers, for
``lr_xuv``, ``lr_mlp`` and ``lr_mlp_rank`` on ``cpu``, kernels whose body is a
``jax.pure_callback`` into the numpy reference: an opaque ``custom_call`` that the SPMD
partitioner cannot split, exactly like a Triton or FFI kernel. Without
``lowering/partitioning.py`` XLA must gather their operands. :func:`kernel_calls` reads back from
compiled HLO which of them ran and on which operand shapes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import jax
import numpy as np

from lrjax.lowering import registry

PRIMS = ("lr_xuv", "lr_mlp", "lr_mlp_rank")
NAMES = ("test.callback_xuv", "test.callback_mlp", "test.callback_mlp_rank")
MARK = 9000


_ACT = {
  "silu": lambda x: x / (1.0 + np.exp(-x)),
  "relu": lambda x: np.maximum(x, 0.0),
  "gelu_tanh": lambda x: 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x**3))),
}


def _np_xuv(x, u, v, b, inter_dtype, out_dtype):
  t = (x.astype(np.float32) @ u.astype(np.float32)).astype(inter_dtype)
  y = t.astype(np.float32) @ v.astype(np.float32)
  if b is not None:
    y = y + b.astype(np.float32)
  return y.astype(out_dtype)


def _np_kernel(prim_name, params):
  """The numpy reference that runs on the host inside the callback."""
  from lrjax.lowering.mlp_rank import rank_operands
  from lrjax.lowering.primitives import mlp_operands

  inter, out_dt = np.dtype(params["inter_dtype"]), np.dtype(params["out_dtype"])
  if prim_name == "lr_mlp_rank":

    def mlp_rank(*ops):
      d = rank_operands(ops, params["gated"], params["bias_mask"])
      f = _ACT[params["act"]]

      def pv(p, v, b):
        y = p.astype(inter).astype(np.float32) @ v.astype(np.float32)
        return (y if b is None else y + b.astype(np.float32)).astype(inter).astype(np.float32)

      h = pv(*d["up"])
      h = f(pv(*d["gate"])) * h if params["gated"] else f(h)
      y = h.astype(inter).astype(np.float32) @ d["ud"].astype(np.float32)
      return y.astype(out_dt)

    return mlp_rank
  if prim_name == "lr_xuv":

    def xuv(*ops):
      return _np_xuv(ops[0], ops[1], ops[2], ops[3] if params["has_bias"] else None, inter, out_dt)

    return xuv

  def mlp(*ops):
    d = mlp_operands(ops, params["gated"], params["bias_mask"])
    f = _ACT[params["act"]]
    h = _np_xuv(d["x"], *d["up"], inter, inter).astype(np.float32)
    if params["gated"]:
      h = f(_np_xuv(d["x"], *d["gate"], inter, inter).astype(np.float32)) * h
    else:
      h = f(h)
    return _np_xuv(h.astype(inter), *d["down"], inter, out_dt)

  return mlp


def _inside_partition() -> bool:
  """Whether we are lowering a per-device program of a partitioned kernel (mesh axes bound)."""
  for name in ("tp", "data"):
    try:
      jax.lax.axis_size(name)
      return True
    except NameError:
      pass
  return False


def _callback_impl(prim_name, execute: bool):
  def impl(*ops, **params):
    from lrjax.lowering.mlp_rank import lr_mlp_rank_p
    from lrjax.lowering.primitives import REFERENCES, lr_mlp_p, lr_xuv_p

    prims = {"lr_xuv": lr_xuv_p, "lr_mlp": lr_mlp_p, "lr_mlp_rank": lr_mlp_rank_p}
    ref = REFERENCES[prims[prim_name]]
    if execute and _inside_partition():
      # jax drops the host callbacks of a partitioned sub-program (running it would crash),
      # so executable runs use the reference on the local shards there.
      return ref(*ops, **params)
    out = jax.eval_shape(lambda *a: ref(*a, **params), *ops)
    host = _np_kernel(prim_name, params)
    # A marker operand s8[MARK + i] names the custom call in compiled HLO (the op name metadata
    # does not survive partitioning); the host function drops it.
    marker = jax.numpy.zeros((MARK + PRIMS.index(prim_name),), np.int8)
    return jax.pure_callback(
      lambda *a: host(*(np.asarray(o) for o in a[:-1])),
      out,
      *ops,
      marker,
      vmap_method="sequential",
    )

  return impl


@contextlib.contextmanager
def callback_kernels(execute: bool = False, prims: tuple[str, ...] = PRIMS):
  """Register the pure_callback kernels (highest priority) for the duration of the context.

  ``execute=False``: the callback is lowered everywhere, also on local shards: compile and read
  the HLO (do not run a partitioned program; jax cannot run a callback inside it).
  ``execute=True``: partitioned programs use the reference on local shards, so they run.
  ``prims``: the primitives that get one (the others keep their reference).
  """
  ks = [
    registry.KernelLowering(
      p,
      "cpu",
      n,
      lambda avals, params: None,
      (lambda p=p: _callback_impl(p, execute)),
      priority=1000,
    )
    for p, n in zip(PRIMS, NAMES)
    if p in prims
  ]
  for k in ks:
    registry.register(k)
  try:
    yield
  finally:
    for k in ks:
      registry.unregister(k.primitive, k.platform, k.name)


_SHAPE = re.compile(r"[a-z]+[0-9]*\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class KernelCall:
  """One stand-in kernel's custom call in compiled HLO."""

  name: str  # one of NAMES
  operands: tuple[tuple[int, ...], ...]
  result: tuple[int, ...]


def kernel_calls(hlo_text: str) -> list[KernelCall]:
  """The stand-in kernels' custom calls in ``hlo_text`` (compiled HLO), with the operand and
  result shapes each was compiled for: on a partitioned program, the local shard shapes."""
  calls = []
  for line in hlo_text.splitlines():
    if "custom-call(" not in line:
      continue
    if "operand_layout_constraints={" not in line:
      continue
    ops = line.split("operand_layout_constraints={", 1)[1].split("}, api_version", 1)[0]
    shapes = [tuple(int(d) for d in m.group(1).split(",") if d) for m in _SHAPE.finditer(ops)]
    if not shapes or len(shapes[-1]) != 1 or not 0 <= shapes[-1][0] - MARK < len(NAMES):
      continue
    res = _SHAPE.search(line.split("=", 1)[1].split("custom-call(")[0])
    result = tuple(int(d) for d in res.group(1).split(",") if d)
    calls.append(KernelCall(NAMES[shapes[-1][0] - MARK], tuple(shapes[:-1]), result))
  return calls
