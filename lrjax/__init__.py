"""lrjax: a JAX/XLA compiler stack for low-rank (SVD-compressed) LLMs."""

__version__ = "0.1.0"

from lrjax import lowering
from lrjax import custom_calls
from lrjax.lowering import explain, fuse, lr_mlp, lr_xuv


_LAZY = (
  "checkpoint",
  "compress",  # lrjax.compress(model, ...) is callable
  "models",
  "nn",
  "quality",
  "quant",
  "serving",
  "sharding",
)


def __getattr__(name):
  """``lrjax.models``, ``lrjax.compress`` etc. are imported on first use."""
  if name in _LAZY:
    import importlib

    return importlib.import_module(f"lrjax.{name}")
  raise AttributeError(f"module 'lrjax' has no attribute {name!r}")


def quantize(model, scheme: str = "w4a8", **kwargs):
  """Quantizes a model's low-rank and dense projections (see :func:`lrjax.quant.quantize`)."""
  from lrjax.quant import quantize as _quantize

  return _quantize(model, scheme, **kwargs)


__all__ = [
  "custom_calls",
  "explain",
  "fuse",
  "lowering",
  "lr_mlp",
  "lr_xuv",
  "quantize",
  "__version__",
]
