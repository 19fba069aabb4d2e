"""W4A8-quantized lrjax checkpoints: what is recorded, and how any host loads them.

A quantized model (``lrjax.quantize(model, "w4a8")``) saves like any other: its state holds each
quantized projection's packed int4 factor(s) (``*_packed``, uint8), their f32 scales
(``*_scales``) and bias, and the embedding table and norms as floats. ``lrjax_metadata.json``
gains a ``quantization`` record (:func:`record`)::

  {"scheme": "w4a8", "version": 1, "layout": "x86_vnni", "groups": [128, 0],
   "layers": {"layers.0.attn.q_proj": {"u": [K, r, group, layout], "v": [r, N, group, layout],
                                       "bias": false, "dtype": null, "axes": ["embed", "q"]},
              "lm_head": {"w": [K, N, group, layout], ...}}}

On load (:func:`abstract` before the arrays are restored, :func:`for_host` after):

- the float model that config and ranks describe gets the recorded quantized modules in place
  of those projections, so the restored arrays land in them unchanged (save -> load is
  bit-exact);
- the packed layout depends on the ISA (``x86_vnni``; ``arm_sdot4`` / ``arm_smmla8`` on Arm):
  a checkpoint packed for another layout than this host's kernel reads is repacked at load,
  exactly (the int4 values and scales are unchanged, so are the kernel's results);
- where no W4A8 kernel runs (a platform other than CPU, or the extension not built), the int4
  weights are dequantized at load into float projections (``q · scale``), with a warning.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np
from flax import nnx

log = logging.getLogger("lrjax.checkpoint")

SCHEME = "w4a8"
VERSION = 1


def _quantized_modules(model) -> list[tuple[str, Any]]:
  from lrjax.quant import QuantizedLinear, QuantizedLowRankLinear

  out = []
  for path, m in nnx.iter_graph(model):
    if isinstance(m, (QuantizedLinear, QuantizedLowRankLinear)):
      out.append((".".join(map(str, path)), m))
  return out


def is_quantized(model) -> bool:
  return bool(_quantized_modules(model))


def record(model) -> dict | None:
  """The metadata's ``quantization`` record of ``model`` (None when nothing is quantized)."""
  from lrjax.quant import QuantizedLowRankLinear

  mods = _quantized_modules(model)
  if not mods:
    return None
  layers, layouts, groups = {}, set(), set()
  for key, m in mods:
    metas = (
      {"u": m.u_meta, "v": m.v_meta} if isinstance(m, QuantizedLowRankLinear) else {"w": m.meta}
    )
    entry = {name: [int(k), int(n), int(g), str(lay)] for name, (k, n, g, lay) in metas.items()}
    for _, _, g, lay in metas.values():
      layouts.add(lay)
      groups.add(int(g))
    entry["bias"] = m.bias is not None
    entry["dtype"] = None if m.dtype is None else np.dtype(m.dtype).name
    entry["axes"] = list(m.axes)
    layers[key] = entry
  if len(layouts) != 1:
    raise ValueError(f"the model mixes W4A8 layouts {sorted(layouts)}; quantize it with one")
  return {
    "scheme": SCHEME,
    "version": VERSION,
    "layout": layouts.pop(),
    "groups": sorted(groups, reverse=True),
    "layers": layers,
  }


def _check(rec: dict, where: str) -> None:
  from lrjax.lowering.quantized import LAYOUTS

  if not isinstance(rec, dict) or rec.get("scheme") != SCHEME:
    raise ValueError(f"{where}: quantization scheme {rec!r} is not readable; expected {SCHEME!r}")
  if rec.get("version", 0) > VERSION:
    raise ValueError(
      f"{where}: quantization record version {rec.get('version')} is newer than this lrjax "
      f"reads ({VERSION}); upgrade lrjax"
    )
  if rec.get("layout") not in LAYOUTS:
    raise ValueError(
      f"{where}: packed layout {rec.get('layout')!r} is unknown; expected one of {sorted(LAYOUTS)}"
    )


def _weight_spec(meta) -> Any:
  from lrjax.lowering.quantized import packed_shape, scales_shape
  from lrjax.quant import QuantizedWeight

  k, n, g, lay = int(meta[0]), int(meta[1]), int(meta[2]), str(meta[3])
  return QuantizedWeight(
    np.zeros(packed_shape(k, n, lay), np.uint8),
    np.zeros(scales_shape(k, n, g, lay), np.float32),
    k,
    n,
    g,
    lay,
  )


def _set(model, key: str, module) -> None:
  *parents, last = key.split(".")
  node = model
  for p in parents:
    node = node[int(p)] if p.isdigit() else getattr(node, p)
  if last.isdigit():
    node[int(last)] = module
  else:
    setattr(node, last, nnx.data(module))


def abstract(model, rec: dict | None, mesh=None, where: str = "checkpoint"):
  """``model`` (abstract, from config and ranks) with the recorded projections quantized, as
  abstract modules the restore fills. ``rec`` None returns ``model`` unchanged."""
  if rec is None:
    return model
  _check(rec, where)
  if mesh is not None:
    raise ValueError(
      f"{where} is W4A8-quantized: it loads on one device (the packed int4 weights are not "
      "sharded); load it without a mesh (tp=1)"
    )
  import jax.numpy as jnp

  from lrjax.quant import QuantizedLinear, QuantizedLowRankLinear

  for key, e in rec["layers"].items():
    bias = np.zeros(int((e.get("v") or e["w"])[1]), np.float32) if e.get("bias") else None
    dt = jnp.dtype(e["dtype"]) if e.get("dtype") else None
    axes = tuple(e.get("axes") or ("embed", "mlp"))
    if "u" in e:
      make = lambda e=e, bias=bias, dt=dt, axes=axes: QuantizedLowRankLinear(
        _weight_spec(e["u"]), _weight_spec(e["v"]), bias, dtype=dt, axes=axes
      )
    else:
      make = lambda e=e, bias=bias, dt=dt, axes=axes: QuantizedLinear(
        _weight_spec(e["w"]), bias, dtype=dt, axes=axes
      )
    _set(model, key, nnx.eval_shape(make))
  return model


def w4a8_kernel_available() -> str | None:
  """None when this process runs the W4A8 C++ kernel, else why not."""
  from lrjax.custom_calls.cpu import lowering as cpu_lowering

  backend = jax.default_backend()
  if backend != "cpu":
    return f"the default platform is {backend!r}, which has no W4A8 kernel (CPU only)"
  if not cpu_lowering.extension_available():
    return "the W4A8 C++ extension is not built (pip install lrjax builds it)"
  return None


def _repack(m, layout: str):
  """``m`` with its int4 weights packed for ``layout`` (same values and scales)."""
  import jax.numpy as jnp

  from lrjax.lowering.quantized import unpack_int4
  from lrjax.quant import QuantizedLinear, QuantizedWeight, pack

  def one(packed, scales, meta):
    k, n, g, lay = meta
    q = np.asarray(unpack_int4(jnp.asarray(packed), k, n, lay))
    s = np.asarray(scales)[:, :n]
    return QuantizedWeight(pack.pack_int4(q, layout), pack.pad_scales(s, layout), k, n, g, layout)

  bias = None if m.bias is None else np.asarray(m.bias[...])
  if isinstance(m, QuantizedLinear):
    w = one(m.w_packed[...], m.w_scales[...], m.meta)
    return QuantizedLinear(w, bias, dtype=m.dtype, axes=m.axes)
  u = one(m.u_packed[...], m.u_scales[...], m.u_meta)
  v = one(m.v_packed[...], m.v_scales[...], m.v_meta)
  return type(m)(u, v, bias, dtype=m.dtype, axes=m.axes)


def _dequantized(m):
  """A float ``Linear``/``LowRankLinear`` with ``m``'s weights (q · scale, f32)."""
  import jax.numpy as jnp

  from lrjax.lowering.quantized import unpack_int4
  from lrjax.nn import Linear, LowRankLinear
  from lrjax.quant import QuantizedLinear, pack

  def deq(packed, scales, meta):
    k, n, g, lay = meta
    q = np.asarray(unpack_int4(jnp.asarray(packed), k, n, lay))
    return pack.dequantize_int4(q, np.asarray(scales), g).astype(np.float32)

  kw = dict(use_bias=m.bias is not None, axes=m.axes, dtype=m.dtype, param_dtype=jnp.float32)
  if isinstance(m, QuantizedLinear):
    out = nnx.eval_shape(lambda: Linear(m.in_features, m.out_features, rngs=nnx.Rngs(0), **kw))
    out.kernel.set_value(jnp.asarray(deq(m.w_packed[...], m.w_scales[...], m.meta)))
  else:
    out = nnx.eval_shape(
      lambda: LowRankLinear(m.in_features, m.out_features, m.rank, rngs=nnx.Rngs(0), **kw)
    )
    out.u.set_value(jnp.asarray(deq(m.u_packed[...], m.u_scales[...], m.u_meta)))
    out.v.set_value(jnp.asarray(deq(m.v_packed[...], m.v_scales[...], m.v_meta)))
  if m.bias is not None:
    out.bias.set_value(jnp.asarray(m.bias[...], jnp.float32))
  return out


def dequantize(model):
  """``model`` with every W4A8 projection replaced by the float layer of its int4 weights
  (``q · scale`` in f32), e.g. to export a quantized checkpoint or run it without the kernel."""
  for key, m in _quantized_modules(model):
    _set(model, key, _dequantized(m))
  return model


def for_export(model):
  """``model`` made exportable to an HF format: every W4A8 projection dequantized (``q ·
  scale`` in f32, the weights the int4 codes stand for), and a W4A8 head made from a tied
  embedding table dropped, so the export ties its head to the (float) table again. The int8
  activations are a property of the kernel, not of the weights: transformers runs the export
  in float."""
  tied = getattr(getattr(model, "cfg", None), "tie_word_embeddings", False)
  head = getattr(model, "lm_head", None)
  if tied and head is not None and any(m is head for _, m in _quantized_modules(model)):
    model.lm_head = nnx.data(None)
  return dequantize(model)


def for_host(model, rec: dict | None, where: str = "checkpoint"):
  """The loaded ``model`` made runnable here: repacked for this host's kernel layout, or
  dequantized where no W4A8 kernel runs (see the module docstring)."""
  if rec is None:
    return model
  from lrjax.quant import default_layout

  why = w4a8_kernel_available()
  mods = _quantized_modules(model)
  if why is not None:
    log.warning("%s: %s; dequantizing its int4 weights to float32 at load", where, why)
    return dequantize(model)
  host = default_layout()
  if rec["layout"] != host:
    log.warning(
      "%s: packed for %s, this host's W4A8 kernel reads %s; repacking at load (exact)",
      where,
      rec["layout"],
      host,
    )
    for key, m in mods:
      _set(model, key, _repack(m, host))
  return model
