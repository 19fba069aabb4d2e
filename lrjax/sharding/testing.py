"""CPU stand-in kernels that lower to real custom calls, to test partitioning without a GPU.

On CPU the primitives lower to their jnp reference, plain HLO that XLA partitions by itself, so
the sharded path of a real kernel would go untested. :func:`callback_kernels` registers, for
``lr_xuv`` and ``lr_mlp`` on ``cpu``, kernels whose body is a ``jax.pure_callback`` into the
numpy reference: an opaque ``custom_call`` that the SPMD partitioner cannot split, exactly like a
Triton or FFI kernel. Without ``lowering/partitioning.py`` XLA must gather their operands.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np

from lrjax.lowering import registry

NAMES = ("test.callback_xuv", "test.callback_mlp")


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
  from lrjax.lowering.primitives import mlp_operands

  inter, out_dt = np.dtype(params["inter_dtype"]), np.dtype(params["out_dtype"])
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
    from lrjax.lowering.primitives import REFERENCES, lr_mlp_p, lr_xuv_p

    ref = REFERENCES[lr_xuv_p if prim_name == "lr_xuv" else lr_mlp_p]
    if execute and _inside_partition():
      # jax drops the host callbacks of a partitioned sub-program (running it would crash),
      # so executable runs use the reference on the local shards there.
      return ref(*ops, **params)
    out = jax.eval_shape(lambda *a: ref(*a, **params), *ops)
    host = _np_kernel(prim_name, params)
    return jax.pure_callback(
      lambda *a: host(*(np.asarray(o) for o in a)), out, *ops, vmap_method="sequential"
    )

  return impl


@contextlib.contextmanager
def callback_kernels(execute: bool = False):
  """Register the pure_callback kernels (highest priority) for the duration of the context.

  ``execute=False``: the callback is lowered everywhere, also on local shards: compile and read
  the HLO (do not run a partitioned program; jax cannot run a callback inside it).
  ``execute=True``: partitioned programs use the reference on local shards, so they run.
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
    for p, n in zip(("lr_xuv", "lr_mlp"), NAMES)
  ]
  for k in ks:
    registry.register(k)
  try:
    yield
  finally:
    for k in ks:
      registry.unregister(k.primitive, k.platform, k.name)
