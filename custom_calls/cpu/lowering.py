"""CPU lowerings of the W4A8 primitives to the C++ XLA FFI kernels (light module).

Importing this module imports neither the extension nor the primitives module;
``load()`` imports ``lrjax.custom_calls.cpu._w4a8``, registers its handlers with
XLA once and returns ``impl(*operands, **params)`` built on ``jax.ffi.ffi_call``.

Kernels: ``cpu.w4a8_matmul`` (primitive ``w4a8_matmul``), ``cpu.lr_xuv_w4a8``
(primitive ``lr_xuv_w4a8``), ``cpu.decode_attention`` (primitive ``decode_attention``,
decode_attention.py) and ``cpu.attention`` (primitive ``attention``, attention.py). Runtime
CPU dispatch happens inside the extension: x86 AVX512-VNNI -> AVX-VNNI -> AVX2 -> scalar,
aarch64 i8mm -> dotprod -> NEON -> scalar; ``LRJAX_W4A8_ISA`` caps it, ``LRJAX_W4A8_THREADS``
sets the thread count (a positive integer, capped at the hardware threads; anything else is
an error here).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from typing import Any
from collections.abc import Mapping, Sequence

import numpy as np

from lrjax.custom_calls.cpu import attention as _prefill_attention
from lrjax.custom_calls.cpu import decode_attention as _attention
from lrjax.lowering.registry import KernelLowering, register as _register_kernel

log = logging.getLogger("lrjax.custom_calls.cpu")

_EXT = "lrjax.custom_calls.cpu._w4a8"
_TARGETS = {"w4a8_matmul": "lrjax_w4a8_matmul", "lr_xuv_w4a8": "lrjax_w4a8_xuv"}
_LAYOUT_CODES = {"x86_vnni": 0, "arm_sdot4": 1, "arm_smmla8": 2}
_KERNEL_DTYPES = ("float32", "bfloat16")
_lock = threading.Lock()
_registered = False


def extension_available() -> bool:
  """Whether the compiled extension is installed (without importing it)."""
  try:
    return importlib.util.find_spec(_EXT) is not None
  except ModuleNotFoundError:
    return False


THREADS_ENV = "LRJAX_W4A8_THREADS"
SPIN_ENV = "LRJAX_W4A8_SPIN_US"
MAX_SPIN_US = 1_000_000  # w4a8.h kMaxSpinUs


def _env_int(name: str) -> tuple[str, int | None]:
  """(the raw value of env ``name``, its integer if it is only ASCII digits, else None), as
  the kernel reads it (w4a8.cc DigitsValue); ("", None) when unset."""
  raw = os.environ.get(name, "")
  return raw, int(raw) if raw.isascii() and raw.isdigit() else None


def check_threads_env() -> int | None:
  """The thread count ``LRJAX_W4A8_THREADS`` asks for (None when unset).

  Raises ValueError for a value that is not a positive integer; a count above the hardware
  threads is capped by the kernel (logged here).
  """
  raw, n = _env_int(THREADS_ENV)
  if raw == "":
    return None
  if n is None or n < 1:
    raise ValueError(
      f"{THREADS_ENV}={raw!r} is not a positive integer; set it to the number of W4A8 "
      f"worker threads (e.g. {os.cpu_count() or 1}) or unset it for one per hardware thread"
    )
  hw = os.cpu_count() or 0
  if hw and n > hw:
    log.warning("%s=%d exceeds the %d hardware threads; the kernel uses %d", THREADS_ENV, n, hw, hw)
  return n


def check_spin_env() -> int | None:
  """The microseconds ``LRJAX_W4A8_SPIN_US`` asks the kernels' threads to spin for the next
  task before sleeping (None when unset: 200). Raises ValueError for a value that is not an
  integer from 0 to 1000000."""
  raw, n = _env_int(SPIN_ENV)
  if raw == "":
    return None
  if n is None or n > MAX_SPIN_US:
    raise ValueError(
      f"{SPIN_ENV}={raw!r} is not an integer from 0 to {MAX_SPIN_US}; set it to the "
      "microseconds the W4A8 threads spin for the next task before sleeping (0: sleep at once, "
      "for a machine whose cores other processes need) or unset it for 200"
    )
  return n


def extension():
  """The compiled nanobind module, with its handlers registered with XLA.

  Raises ValueError when ``LRJAX_W4A8_THREADS`` or ``LRJAX_W4A8_SPIN_US`` is malformed (see
  :func:`check_threads_env`, :func:`check_spin_env`).
  """
  global _registered
  import jax

  check_threads_env()
  check_spin_env()
  from lrjax.custom_calls.cpu import _w4a8

  with _lock:
    if not _registered:
      for name, capsule in _w4a8.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
      _registered = True
  return _w4a8


def _supports(avals_in: Sequence[Any], params: Mapping[str, Any]) -> str | None:
  x = avals_in[0]
  if str(x.dtype) not in _KERNEL_DTYPES:
    return f"x dtype {x.dtype} is not float32/bfloat16"
  if str(params["out_dtype"]) not in _KERNEL_DTYPES:
    return f"out_dtype {params['out_dtype']} is not float32/bfloat16"
  if params["layout"] not in _LAYOUT_CODES:
    return f"layout {params['layout']!r} unknown"
  if not extension_available():
    return f"{_EXT} is not built (pip install lrjax builds it)"
  return None


def f32_kernel_refusal(avals, env: str) -> str | None:
  """Why a CPU attention kernel (f32 only, turned off by ``env``=0) does not serve a call whose
  first three operands are ``avals``; None where it does."""
  if os.environ.get(env, "") == "0":
    return f"off ({env}=0)"
  dts = {str(a.dtype) for a in avals[:3]}
  if dts != {"float32"}:
    return f"q, k, v are {sorted(dts)}: the CPU kernel takes float32 (XLA serves the rest)"
  if not extension_available():
    return f"{_EXT} is not built (pip install lrjax builds it)"
  return None


def _empty_f32():
  """An f32 [0] operand: the kernel's "no bias" / "no scale"."""
  import jax.numpy as jnp

  return jnp.zeros((0,), jnp.float32)


def _load_matmul():
  import jax

  extension()

  def impl(x, w, s, *rest, n, group, layout, has_bias, out_dtype):
    bias = rest[0] if has_bias else _empty_f32()
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (n,), out_dtype)
    return jax.ffi.ffi_call(_TARGETS["w4a8_matmul"], out, vmap_method="broadcast_all")(
      x,
      w,
      s,
      bias,
      k=np.int64(x.shape[-1]),
      n=np.int64(n),
      group=np.int64(group),
      layout=np.int64(_LAYOUT_CODES[layout]),
    )

  return impl


def _load_xuv():
  import jax

  extension()

  def impl(
    x, wu, su, wv, sv, *rest, r, n, group_u, group_v, layout, has_bias, out_dtype, has_scale=False
  ):
    bias = rest[0] if has_bias else _empty_f32()
    scale = rest[-1] if has_scale else _empty_f32()
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (n,), out_dtype)
    return jax.ffi.ffi_call(_TARGETS["lr_xuv_w4a8"], out, vmap_method="broadcast_all")(
      x,
      wu,
      su,
      wv,
      sv,
      bias,
      scale,
      k=np.int64(x.shape[-1]),
      r=np.int64(r),
      n=np.int64(n),
      group_u=np.int64(group_u),
      group_v=np.int64(group_v),
      layout=np.int64(_LAYOUT_CODES[layout]),
    )

  return impl


KERNELS = [
  KernelLowering("w4a8_matmul", "cpu", "cpu.w4a8_matmul", _supports, _load_matmul, priority=10),
  KernelLowering("lr_xuv_w4a8", "cpu", "cpu.lr_xuv_w4a8", _supports, _load_xuv, priority=10),
  KernelLowering(
    "decode_attention",
    "cpu",
    "cpu.decode_attention",
    _attention.supports,
    _attention.load,
    priority=10,
  ),
  KernelLowering(
    "attention",
    "cpu",
    "cpu.attention",
    _prefill_attention.supports,
    _prefill_attention.load,
    priority=10,
  ),
]


def register() -> None:
  """Registers the CPU kernels with the lowering registry."""
  for k in KERNELS:
    _register_kernel(k)
