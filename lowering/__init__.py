"""lrjax.lowering: the lr_xuv / lr_mlp / lr_xuv_group / lr_xuv_batched / lr_kv_attention
primitives, the kernel registry and the fusion pass.

Installed as ``lrjax.lowering`` (on disk: ``lowering/``).
"""

from lrjax.lowering import registry
from lrjax.lowering.primitives import (
  ACTIVATIONS,
  lr_mlp,
  lr_mlp_p,
  lr_mlp_reference,
  lr_xuv,
  lr_xuv_p,
  lr_xuv_reference,
)
from lrjax.lowering.group import lr_xuv_group, lr_xuv_group_p
from lrjax.lowering.batched import lr_xuv_batched, lr_xuv_batched_p, lr_xuv_batched_reference
from lrjax.lowering.kv_attention import (
  lr_kv_attention,
  lr_kv_attention_p,
  lr_kv_attention_reference,
)
from lrjax.lowering.registry import KernelLowering, force_reference, prefer_kernels
from lrjax.lowering.rules import DEFAULT_RULES, MLPRule, XUVRule
from lrjax.lowering.fuse import fuse
from lrjax.lowering.explain import ExplainReport, explain

__all__ = [
  "ACTIVATIONS",
  "DEFAULT_RULES",
  "ExplainReport",
  "MLPRule",
  "XUVRule",
  "explain",
  "fuse",
  "KernelLowering",
  "force_reference",
  "lr_kv_attention",
  "lr_kv_attention_p",
  "lr_kv_attention_reference",
  "lr_mlp",
  "lr_mlp_p",
  "lr_mlp_reference",
  "lr_xuv",
  "lr_xuv_batched",
  "lr_xuv_batched_p",
  "lr_xuv_batched_reference",
  "lr_xuv_group",
  "lr_xuv_group_p",
  "lr_xuv_p",
  "lr_xuv_reference",
  "prefer_kernels",
  "registry",
]
