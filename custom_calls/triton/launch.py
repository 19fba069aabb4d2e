"""How the Triton kernels are launched: jaxlib's typed-FFI Triton call.

jax-triton 0.3.1 compiles a kernel and lowers ``jax_triton.triton_call`` to jaxlib's legacy
``triton_kernel_call`` custom call (API version 2). XLA does not record legacy custom calls
into its command buffers, and in the H200 profiles each one left the GPU idle 1.1-1.6 µs
before the next kernel started (benchmarks/gpu_notes.md, session 6). jaxlib also registers
``triton_kernel_call_ffi``: a typed-FFI handler for the same compressed kernel-call proto
(passed as an ``opaque`` attribute), marked command-buffer compatible, that parses the proto
once at initialization; later jax-triton releases lower to it. With it the idle gaps were
gone and each decode call 1.2-2.0 µs shorter.

``triton_call`` here is ``jax_triton.triton_call`` with a target name that this module's
lowering rule recognises: it lets jax-triton compile and lower the call as usual, then
replaces the legacy op with the typed-FFI one. Every other jax-triton call keeps jax-triton's
own lowering. ``LRJAX_TRITON_LEGACY_CALL=1`` (read when a call is lowered) keeps the legacy
op, for A/B timing; so does a jaxlib without the FFI target (<= 0.10.2).

jax-triton does not check a compiled kernel's shared memory against the GPU's, so block sizes
that ask for too much used to fail only at launch ("Shared memory requested ... exceeds
device resources"). While it compiles one of our calls, its compile step is wrapped so that
``planner.check_cta_smem`` raises a ValueError at lowering, naming the kernel and its needs.
"""
from __future__ import annotations

import functools
import os
import threading

import jax
import jax_triton as jt
import jaxlib.version
from jax._src.lib.mlir import ir
from jax.interpreters import mlir
from jax_triton import triton_lib

from lrjax.custom_calls.triton import planner

LEGACY_TARGET = "triton_kernel_call"
FFI_TARGET = "triton_kernel_call_ffi"
_REQUEST = "lrjax_triton_kernel_call"  # the name our calls pass; never reaches XLA


def use_ffi() -> bool:
  return (jaxlib.version.__version_info__ > (0, 10, 2)
          and os.environ.get("LRJAX_TRITON_LEGACY_CALL", "") in ("", "0"))


def xla_zeroing() -> bool:
  """Whether a decode kernel's scratch is zeroed by an XLA op aliased into the call (the
  default) or by jax-triton's memset inside it (``LRJAX_TRITON_SCRATCH_MEMSET=1``, read
  when a call is traced; for A/B timing). In the Llama-3-8B decode step on the H200 both
  cost about 1 µs a call (results/model_1gpu_memset_h200.json)."""
  return os.environ.get("LRJAX_TRITON_SCRATCH_MEMSET", "") in ("", "0")


def triton_call(*args, **kwargs):
  """``jax_triton.triton_call``, launched through the typed-FFI target where available."""
  if "custom_call_target_name" in kwargs:
    raise TypeError("lrjax chooses the custom-call target of its kernels")
  return jt.triton_call(*args, custom_call_target_name=_REQUEST, **kwargs)


def count_calls(hlo_text: str) -> int:
  """Triton custom calls (either target) in a compiled module's HLO text."""
  return sum(hlo_text.count(f'custom_call_target="{t}"') for t in (LEGACY_TARGET, FFI_TARGET))


_jax_triton_rule = functools.partial(triton_lib.triton_kernel_call_lowering,
                                     triton_lib.get_cuda_backend)


_ours = threading.local()  # .active while jax-triton compiles one of our calls
_jax_triton_compile = getattr(triton_lib, "compile_ttir_inplace", None)  # jax-triton 0.3.x


def _compile_checked(ttir, backend, options, compute_capability, platform):
  result = _jax_triton_compile(ttir, backend, options, compute_capability, platform)
  if getattr(_ours, "active", False) and platform == "cuda":
    planner.check_cta_smem(result.name, result.shared_mem_bytes, compute_capability,
                           options.num_warps, options.num_stages)
  return result


if _jax_triton_compile is not None:
  # jax-triton caches only kernels that compiled, so a refused one is checked again
  triton_lib.compile_ttir_inplace = _compile_checked


def _lowering(ctx, *array_args, custom_call_target_name, **params):
  if custom_call_target_name != _REQUEST:  # someone else's jax-triton call
    return _jax_triton_rule(ctx, *array_args, custom_call_target_name=custom_call_target_name,
                            **params)
  _ours.active = True
  try:
    legacy = _jax_triton_rule(ctx, *array_args, custom_call_target_name=LEGACY_TARGET,
                              **params)
  finally:
    _ours.active = False
  if not use_ffi():
    return legacy
  op = legacy[0].owner
  op = getattr(op, "operation", op)
  opaque = ir.StringAttr(op.attributes["backend_config"]).value_bytes
  rule = jax.ffi.ffi_lowering(FFI_TARGET, api_version=4,
                              operand_output_aliases=dict(params["input_output_aliases"]))
  results = rule(ctx, *array_args, opaque=opaque)
  op.erase()  # nothing uses the legacy op's results
  return results


mlir.register_lowering(triton_lib.triton_kernel_call_p, _lowering, platform="cuda")
