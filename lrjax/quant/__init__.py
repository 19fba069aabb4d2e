"""W4A8 quantization: int4 weights packed for the CPU kernels, int8 activations.

``quantize(model, "w4a8", group=128)`` converts a model's ``LowRankLinear`` and
``Linear`` layers; their forward passes call :func:`w4a8_matmul`, which lowers to
the C++ XLA FFI kernel on CPU. The offline packing functions live in
:mod:`lrjax.quant.pack`.
"""

from lrjax.lowering.quantized import (
  fused_xuv_params,
  lr_xuv_w4a8,
  lr_xuv_w4a8_p,
  lr_xuv_w4a8_reference,
  w4a8_matmul,
  w4a8_matmul_p,
  w4a8_matmul_reference,
)
from lrjax.quant.modules import (
  QuantizedArray,
  QuantizedLinear,
  QuantizedLowRankLinear,
  QuantizedWeight,
  quantize,
  quantize_weight,
)
from lrjax.quant.pack import default_layout, dequantize_int4, pack_int4, pad_scales, quantize_int4

__all__ = [
  "QuantizedArray",
  "QuantizedLinear",
  "QuantizedLowRankLinear",
  "QuantizedWeight",
  "default_layout",
  "dequantize_int4",
  "fused_xuv_params",
  "lr_xuv_w4a8",
  "lr_xuv_w4a8_p",
  "lr_xuv_w4a8_reference",
  "pack_int4",
  "pad_scales",
  "quantize",
  "quantize_int4",
  "quantize_weight",
  "w4a8_matmul",
  "w4a8_matmul_p",
  "w4a8_matmul_reference",
]
