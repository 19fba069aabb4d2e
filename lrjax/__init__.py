"""lrjax: a JAX/XLA compiler stack for low-rank (SVD-compressed) LLMs."""
__version__ = "0.1.0"

from lrjax import lowering
from lrjax import custom_calls
from lrjax.lowering import explain, fuse, lr_mlp, lr_xuv

custom_calls.register_all()

__all__ = ["custom_calls", "explain", "fuse", "lowering", "lr_mlp", "lr_xuv", "__version__"]
