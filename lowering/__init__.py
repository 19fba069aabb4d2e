"""lrjax.lowering: the fusion pass, the lrjax primitives and the per-platform kernel registry.

Installed as ``lrjax.lowering`` (on disk: ``lowering/``). What users call is listed in
``__all__``. The primitive objects (``lr_xuv_p``, ``lr_mlp_p``, ...) live in their modules
(:mod:`lrjax.lowering.primitives`, :mod:`~lrjax.lowering.group`,
:mod:`~lrjax.lowering.kv_attention`, :mod:`~lrjax.lowering.decode_attention`,
:mod:`~lrjax.lowering.attention`,
:mod:`~lrjax.lowering.quantized`), and the kernel registry
in :mod:`lrjax.lowering.registry`.
"""

from lrjax.lowering.primitives import (
  ACTIVATIONS,
  lr_mlp,
  lr_mlp_reference,
  lr_xuv,
  lr_xuv_reference,
)
from lrjax.lowering.group import lr_xuv_group
from lrjax.lowering.batched import lr_xuv_batched, lr_xuv_batched_reference
from lrjax.lowering.kv_attention import lr_kv_attention, lr_kv_attention_reference
from lrjax.lowering.attention import attention, attention_reference
from lrjax.lowering.decode_attention import (
  decode_attention,
  decode_attention_append,
  decode_attention_append_reference,
  decode_attention_reference,
)
from lrjax.lowering.registry import KernelLowering, force_reference, prefer_kernels
from lrjax.lowering.rules import DEFAULT_RULES, MLPRule, XUVRule
from lrjax.lowering.fuse import fuse
from lrjax.lowering.explain import ExplainReport, explain

__all__ = [
  "ACTIVATIONS",
  "DEFAULT_RULES",
  "ExplainReport",
  "KernelLowering",
  "MLPRule",
  "XUVRule",
  "attention",
  "attention_reference",
  "decode_attention",
  "decode_attention_append",
  "decode_attention_append_reference",
  "decode_attention_reference",
  "explain",
  "force_reference",
  "fuse",
  "lr_kv_attention",
  "lr_kv_attention_reference",
  "lr_mlp",
  "lr_mlp_reference",
  "lr_xuv",
  "lr_xuv_batched",
  "lr_xuv_batched_reference",
  "lr_xuv_group",
  "lr_xuv_reference",
  "prefer_kernels",
]
