"""Decode attention over the KV cache on the CPU: the ``decode_attention`` primitive
(lowering/decode_attention.py) as one C++ XLA FFI call (decode_attention.cc), registered by
the CPU extension as ``lrjax_cpu_decode_attention``.

XLA's lowering of the reference slices the first ``length`` keys of each cache buffer and
transposes the values before its dots: copies of every layer's attended K and V on each step.
The kernel reads the buffers in place, only each row's visible keys, in f32, one task per
(row, KV head) on the W4A8 kernels' thread pool (the calling thread alone under 1 MiB of K
and V): the G query heads' scores, the softmax as ``jax.nn.softmax`` computes it, then p·V.
On x86 with AVX2 and FMA, head dims that are multiples of 8 take the AVX2 body
(decode_attention_x86_avx2.cc), the rest the portable one; ``LRJAX_W4A8_ISA=scalar`` forces
the portable body. It serves every f32 call (benchmarks/cpu_decode_attention.py times it
against XLA from 0.5 to 512 MiB of K and V); ``LRJAX_CPU_DECODE_ATTENTION=0`` turns it off
(for A/B runs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

TARGET = "lrjax_cpu_decode_attention"
ENV = "LRJAX_CPU_DECODE_ATTENTION"


def decode_attention_reference(q, k, v, pos, *, window=None, length=None):
  """The op's reference: lowering/decode_attention.py's."""
  from lrjax.lowering.decode_attention import decode_attention_reference as ref

  return ref(q, k, v, pos, window=window, length=length)


def supports(avals_in: Sequence[Any], params: Mapping[str, Any]) -> str | None:
  """None where the kernel serves the call, else why not."""
  from lrjax.custom_calls.cpu.lowering import f32_kernel_refusal

  return f32_kernel_refusal(avals_in, ENV)


def load():
  """impl(q, k, v, pos, *, window, length) -> [B, Hq·D] through the FFI call."""
  import jax

  from lrjax.custom_calls.cpu.lowering import extension

  extension()

  def impl(q, k, v, pos, *, window, length):
    b, hq, d = q.shape
    out = jax.ShapeDtypeStruct((b, hq * d), q.dtype)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(
      q,
      k,
      v,
      pos.astype(np.int32),
      length=np.int64(k.shape[2] if length is None else length),
      window=np.int64(0 if window is None else window),
    )

  return impl


def decode_attention(q, k, v, pos, *, window=None, length=None):
  """The kernel called directly (tests, benchmarks): (q, k, v, pos) as the primitive takes
  them; raises ValueError naming why where it does not serve them."""
  import jax
  import jax.numpy as jnp

  avals = [jax.typeof(x) for x in (q, k, v)]
  reason = supports(avals, {"length": length, "window": window})
  if reason is not None:
    raise ValueError(reason)
  return load()(q, k, v, jnp.asarray(pos), window=window, length=length)
