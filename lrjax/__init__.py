"""lrjax: a JAX/XLA compiler stack for low-rank (SVD-compressed) LLMs."""

__version__ = "0.1.0"

import os as _os

# Source-tree use (Bazel, PYTHONPATH=<repo>): lowering/ and custom_calls/ sit beside lrjax/
# on disk and are installed as lrjax.lowering / lrjax.custom_calls. Installed wheels and
# editable installs already map them; only a bare source tree needs this.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "lowering")) and _os.path.isfile(
  _os.path.join(_root, "lowering", "__init__.py")
):
  __path__.append(_root)  # noqa: F821 - package __path__

from lrjax import lowering  # noqa: E402
from lrjax import custom_calls  # noqa: E402
from lrjax.lowering import explain, fuse, lr_mlp, lr_xuv  # noqa: E402

custom_calls.register_all()


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
