"""W4A8 quantized NNX layers and ``quantize(model, "w4a8")``.

The layers' forward passes call the ``w4a8_matmul`` primitive directly, which
lowers to the C++ XLA FFI kernel on CPU (custom call ``lrjax_w4a8_matmul``) and to
its jnp reference elsewhere. A quantized low-rank layer is
``w4a8_matmul(w4a8_matmul(x, U), V)``; the fusion pass may turn that pair into one
``lr_xuv_w4a8`` (see lowering/quantized.py).
"""

from __future__ import annotations

import dataclasses
import logging

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lrjax.lowering.quantized import w4a8_matmul
from lrjax.nn.linear import Linear, LowRankLinear
from lrjax.quant.pack import default_layout, dequantize_int4, pack_int4, pad_scales, quantize_int4

log = logging.getLogger("lrjax.quant")

GROUPS = (0, 32, 64, 128)


class QuantizedArray(nnx.Variable):
  """Packed int4 weights and their scales: state, but not trainable params."""


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  """One packed [K, N] int4 weight for the W4A8 kernels."""

  packed: np.ndarray  # uint8 [Np/BW, Kp/8, 4 BW]
  scales: np.ndarray  # f32 [G, Np]
  k: int
  n: int
  group: int  # 0 = per channel
  layout: str

  def dequantize(self) -> np.ndarray:
    """The f64 [K, N] weight the kernel multiplies by."""
    from lrjax.lowering.quantized import unpack_int4

    q = np.asarray(unpack_int4(jnp.asarray(self.packed), self.k, self.n, self.layout))
    return dequantize_int4(q, self.scales, self.group)


def quantize_weight(w, group: int = 128, layout: str | None = None) -> QuantizedWeight:
  """Quantizes a float [K, N] weight to int4 (symmetric, per group) and packs it."""
  if group not in GROUPS and (group < 0 or group % 8):
    raise ValueError(f"{group=} must be 0 (per channel), 32, 64 or 128 (or a multiple of 8)")
  layout = layout or default_layout()
  w = np.asarray(w, np.float32)
  q, s = quantize_int4(w, group)
  return QuantizedWeight(
    pack_int4(q, layout), pad_scales(s, layout), w.shape[0], w.shape[1], group, layout
  )


def _call(x, qw_packed, qw_scales, bias, meta, out_dtype):
  return w4a8_matmul(
    x, qw_packed, qw_scales, bias, n=meta[1], group=meta[2], layout=meta[3], out_dtype=out_dtype
  )


def _out_dtype(dtype, x):
  dt = jnp.dtype(dtype or x.dtype)
  return dt if dt in (jnp.float32, jnp.bfloat16, jnp.float16) else jnp.dtype(jnp.float32)


class QuantizedLinear(Linear):
  """y = W4A8(x · W) (+ bias) for a dense ``Linear``.

  A ``Linear`` to code that asks what a projection is (a dense one, e.g. for
  ``layer_ranks``), but it holds packed int4 weights instead of a ``kernel``.
  """

  def __init__(self, w: QuantizedWeight, bias=None, *, dtype=None, axes=("embed", "mlp")):
    self.w_packed = QuantizedArray(jnp.asarray(w.packed))
    self.w_scales = QuantizedArray(jnp.asarray(w.scales))
    self.bias = nnx.Param(jnp.asarray(bias, jnp.float32)) if bias is not None else None
    self.meta = (w.k, w.n, w.group, w.layout)
    self.in_features, self.out_features, self.axes = w.k, w.n, tuple(axes)
    self.dtype = dtype

  def __call__(self, x):
    b = self.bias[...] if self.bias is not None else None
    return _call(x, self.w_packed[...], self.w_scales[...], b, self.meta, _out_dtype(self.dtype, x))

  @classmethod
  def from_linear(cls, m: Linear, group: int = 128, layout: str | None = None):
    bias = np.asarray(m.bias[...]) if m.bias is not None else None
    w = quantize_weight(np.asarray(m.kernel[...]), group, layout)
    return cls(w, bias, dtype=m.dtype, axes=m.axes)


class QuantizedLowRankLinear(nnx.Module):
  """y = W4A8(W4A8(x · U) · V) (+ bias) for a ``LowRankLinear``; t = x·U stays f32."""

  def __init__(
    self, u: QuantizedWeight, v: QuantizedWeight, bias=None, *, dtype=None, axes=("embed", "mlp")
  ):
    if u.n != v.k or u.layout != v.layout:
      raise ValueError(
        f"u [{u.k}, {u.n}] {u.layout} and v [{v.k}, {v.n}] {v.layout} "
        "must share the rank and the layout"
      )
    self.u_packed = QuantizedArray(jnp.asarray(u.packed))
    self.u_scales = QuantizedArray(jnp.asarray(u.scales))
    self.v_packed = QuantizedArray(jnp.asarray(v.packed))
    self.v_scales = QuantizedArray(jnp.asarray(v.scales))
    self.bias = nnx.Param(jnp.asarray(bias, jnp.float32)) if bias is not None else None
    self.u_meta = (u.k, u.n, u.group, u.layout)
    self.v_meta = (v.k, v.n, v.group, v.layout)
    self.in_features, self.out_features, self.rank, self.axes = u.k, v.n, u.n, tuple(axes)
    self.dtype = dtype

  def __call__(self, x):
    t = _call(x, self.u_packed[...], self.u_scales[...], None, self.u_meta, jnp.float32)
    b = self.bias[...] if self.bias is not None else None
    return _call(
      t, self.v_packed[...], self.v_scales[...], b, self.v_meta, _out_dtype(self.dtype, x)
    )

  @classmethod
  def from_low_rank(cls, m: LowRankLinear, group: int = 128, layout: str | None = None):
    bias = np.asarray(m.bias[...]) if m.bias is not None else None
    # Rank-space K (= rank) may be smaller than a group; a single group then covers it.
    gv = group if group == 0 or group < m.rank else 0
    return cls(
      quantize_weight(np.asarray(m.u[...]), group, layout),
      quantize_weight(np.asarray(m.v[...]), gv, layout),
      bias,
      dtype=m.dtype,
      axes=m.axes,
    )


def _convert(node, group, layout, counts):
  if isinstance(node, (QuantizedLinear, QuantizedLowRankLinear)):
    counts["quantized"] += 1
    return node
  if isinstance(node, LowRankLinear):
    counts["low_rank"] += 1
    return QuantizedLowRankLinear.from_low_rank(node, group, layout)
  if isinstance(node, Linear):
    counts["dense"] += 1
    return QuantizedLinear.from_linear(node, group, layout)
  if isinstance(node, nnx.Module):
    for name, child in list(vars(node).items()):
      new = _convert(child, group, layout, counts)
      if new is not child:
        setattr(node, name, new)
    return node
  if isinstance(node, (list, tuple)):
    items = [_convert(c, group, layout, counts) for c in node]
    if all(a is b for a, b in zip(items, node)):
      return node
    if isinstance(node, list):
      node[:] = items
      return node
    return type(node)(items)
  if isinstance(node, dict):
    for key, child in list(node.items()):
      node[key] = _convert(child, group, layout, counts)
    return node
  return node


def _tied_head(model) -> bool:
  """Whether ``model`` is an lrjax LM whose output head is its embedding table (tied)."""
  cfg = getattr(model, "cfg", None)
  return (
    getattr(cfg, "tie_word_embeddings", False)
    and getattr(model, "lm_head", "absent") is None
    and hasattr(getattr(model, "embed", None), "attend")
  )


def quantize(
  model: nnx.Module,
  scheme: str = "w4a8",
  *,
  group: int = 128,
  layout: str | None = None,
  tied_head: bool = True,
) -> nnx.Module:
  """A copy of ``model`` whose ``LowRankLinear`` and ``Linear`` layers are W4A8.

  Args:
    model: an NNX module (or a single layer).
    scheme: only ``"w4a8"`` (int4 weights, int8 per-row activations).
    group: rows of K per weight scale: 32, 64, 128, or 0 for per channel. A
      low-rank layer's V (K = rank) uses per-channel scales when rank <= group.
    layout: packed layout; default: this machine's (``default_layout()``).
    tied_head: for an LM whose output head is tied to the embedding table, give it a
      W4A8 ``lm_head`` made from the table's transpose (a decode step then reads int4 head
      weights instead of the whole float table; the table stays for the token lookup).
  """
  if scheme != "w4a8":
    raise ValueError(f"{scheme=} is not supported; expected 'w4a8'")
  if group < 0 or group % 8:
    raise ValueError(f"{group=} must be 0 (per channel) or a positive multiple of 8 (32/64/128)")
  layout = layout or default_layout()
  graphdef, state = nnx.split(model)
  copy = nnx.merge(graphdef, state)
  counts = {"low_rank": 0, "dense": 0, "quantized": 0}
  out = _convert(copy, group, layout, counts)
  head = tied_head and _tied_head(out)
  if head:
    table = np.asarray(out.embed.embedding[...], np.float32)
    head_layer = QuantizedLinear(quantize_weight(table.T, group, layout), dtype=out.embed.dtype)
    out.lm_head = nnx.data(head_layer)  # replaces a None (static) attribute
    counts["dense"] += 1
  log.info(
    "quantize w4a8 (group=%d, layout=%s): %d low-rank, %d dense layers%s",
    group,
    layout,
    counts["low_rank"],
    counts["dense"],
    " (one the tied LM head)" if head else "",
  )
  if counts["low_rank"] + counts["dense"] == 0:
    if counts["quantized"]:
      raise ValueError("the model is already quantized (its layers are W4A8)")
    raise ValueError("quantize found no Linear or LowRankLinear layer in the model")
  return out
