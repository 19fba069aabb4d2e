"""lrjax: a JAX/XLA compiler stack for low-rank (SVD-compressed) LLMs.

The public API::

  lrjax.fuse(fn)                   # rewrites X·U·V and low-rank MLPs into lrjax's primitives
  lrjax.explain(fn, *args)         # what fuse rewrites, what it refuses, which kernel serves
  lrjax.compress(model, ratio=...) # a dense Llama-family model -> a low-rank one
  lrjax.quantize(model, "w4a8")    # int4 weights, int8 activations (CPU kernels)
  lrjax.models, lrjax.nn, lrjax.checkpoint, lrjax.sharding, lrjax.serving
  lrjax.__version__

``import lrjax`` imports none of them: each name is imported on first use, so the package
(and the ``lrjax`` command line) starts without importing jax. The primitives, the kernel
registry and the pattern rules live in :mod:`lrjax.lowering`; the per-platform kernels in
:mod:`lrjax.custom_calls`, registered on the first lowering for their platform.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module that defines it
_FUNCTIONS = {
  "fuse": "lrjax.lowering.fuse",
  "explain": "lrjax.lowering.explain",
  "compress": "lrjax.compression.pipeline",
  "quantize": "lrjax.quant.modules",
}
_SUBPACKAGES = ("checkpoint", "models", "nn", "serving", "sharding")
# importable as lrjax.<name> too, but not part of the top-level API
_OTHER_SUBPACKAGES = ("compression", "custom_calls", "lowering", "quality", "quant")

__all__ = [
  "__version__",
  "checkpoint",
  "compress",
  "explain",
  "fuse",
  "models",
  "nn",
  "quantize",
  "serving",
  "sharding",
]

if TYPE_CHECKING:
  from lrjax import checkpoint, models, nn, serving, sharding
  from lrjax.compression.pipeline import compress
  from lrjax.lowering.explain import explain
  from lrjax.lowering.fuse import fuse
  from lrjax.quant.modules import quantize


def __getattr__(name: str) -> Any:
  """Imports ``lrjax.fuse``, ``lrjax.models`` etc. on first use."""
  if name in _FUNCTIONS:
    value = getattr(importlib.import_module(_FUNCTIONS[name]), name)
  elif name in _SUBPACKAGES or name in _OTHER_SUBPACKAGES:
    value = importlib.import_module(f"lrjax.{name}")
  else:
    raise AttributeError(f"module 'lrjax' has no attribute {name!r}")
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__) | set(_OTHER_SUBPACKAGES))
