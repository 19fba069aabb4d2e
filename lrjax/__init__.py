"""lrjax: a JAX/XLA compiler stack for low-rank (SVD-compressed) LLMs."""
__version__ = "0.1.0"

from lrjax import lowering
from lrjax.lowering import lr_mlp, lr_xuv

__all__ = ["lowering", "lr_mlp", "lr_xuv", "__version__"]
