"""Prefill attention on the CPU: the ``attention`` primitive (lowering/attention.py, the models'
softmax attention with GQA and a boolean mask) as one C++ XLA FFI call (attention.cc),
registered by the CPU extension as ``lrjax_cpu_attention``.

XLA lowers the reference as written: every query's scores over every key ([B, Hkv, G, S, T] in
f32), the masked ones included, then the softmax and p·V over all of them. The kernel computes
each query's scores over its visible keys only (a causal prompt: about half), in f32, one task
per (row, KV head, block of 8 queries) on the W4A8 kernels' thread pool; the block reads each
key and value row once. The body is compiled twice, with the baseline flags and with AVX2 and
FMA (chosen at run time; ``LRJAX_W4A8_ISA=scalar`` forces the first). It serves f32 calls;
``LRJAX_CPU_ATTENTION=0`` turns it off (for A/B runs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

TARGET = "lrjax_cpu_attention"
ENV = "LRJAX_CPU_ATTENTION"


def attention_reference(q, k, v, mask, *, heads_first=False):
  """The op's reference: lowering/attention.py's."""
  from lrjax.lowering.attention import attention_reference as ref

  return ref(q, k, v, mask, heads_first=heads_first)


def supports(avals_in: Sequence[Any], params: Mapping[str, Any]) -> str | None:
  """None where the kernel serves the call, else why not."""
  from lrjax.custom_calls.cpu.lowering import f32_kernel_refusal

  return f32_kernel_refusal(avals_in, ENV)


def load():
  """impl(q, k, v, mask, *, heads_first) -> [B, S, Hq·D] through the FFI call."""
  import jax
  import jax.numpy as jnp

  from lrjax.custom_calls.cpu.lowering import extension

  extension()

  def impl(q, k, v, mask, *, heads_first):
    b, s, hq, d = q.shape
    out = jax.ShapeDtypeStruct((b, s, hq * d), q.dtype)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(
      q, k, v, mask.astype(jnp.uint8), heads_first=bool(heads_first)
    )

  return impl


def attention(q, k, v, mask, *, heads_first=False):
  """The kernel called directly (tests, benchmarks); raises ValueError naming why where it
  does not serve the call."""
  import jax
  import jax.numpy as jnp

  avals = [jax.typeof(x) for x in (q, k, v, mask)]
  reason = supports(avals, {"heads_first": heads_first})
  if reason is not None:
    raise ValueError(reason)
  return load()(q, k, v, jnp.asarray(mask), heads_first=heads_first)
