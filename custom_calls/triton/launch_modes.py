"""Which launcher runs lrjax's Triton calls, and the scratch chain's bookkeeping.

Pure Python (no triton or jax-triton import), so the CPU suite, the benchmarks and
``launch.py`` share it. ``launch.py`` holds the lowering rule that acts on these choices.
"""

from __future__ import annotations

import os

# the custom-call targets lrjax's Triton calls lower to (launch.py)
LEGACY_TARGET = "triton_kernel_call"  # jax-triton's own (jaxlib's legacy handler)
FFI_TARGET = "triton_kernel_call_ffi"  # jaxlib's typed-FFI handler (launch mode jaxlib)
LAUNCH_TARGET = "lrjax_triton_launch"  # lrjax's handler (pdl_launch.cc)
XLA_TARGET = "__gpu$xla.gpu.ptx"  # XLA launches the kernel's PTX itself (launch mode xla)
XLA_TRITON_TARGET = "__gpu$xla.gpu.triton"  # XLA compiles the kernel's TTIR with its own
# Triton and launches it (launch mode xla_triton)

LAUNCH_MODES = ("jaxlib", "lrjax", "pdl", "xla", "xla_triton")
XLA_LAUNCH_MIN_JAXLIB = (0, 11, 2)  # the jaxlib whose XLA's PTX call was verified (H200)
# [first, end): the jaxlibs whose XLA has the Triton call xla_triton needs (verified on 0.11.2);
# a TODO in XLA's source marks that target for removal, so later jaxlibs take the PTX call
XLA_TRITON_JAXLIB = ((0, 11, 2), (0, 12))

# The kernels launch mode xla_triton may hand to XLA's Triton call. XLA's Triton compiles the
# grouped and SwiGLU decode kernels to more shared memory than an H200 CTA has, so those and
# every other kernel take XLA's PTX call.
XLA_TRITON_KERNELS = ("_xuv_decode_persistent_kernel", "_xuv_decode_pv_kernel")

SCRATCH_MIN_HALF = 1 << 17  # floats in each half of a scratch chain's buffer at least (512
# KiB): one chain then serves every decode call of a Llama-class step at M <= 16


def count_calls(hlo_text: str) -> int:
  """Triton custom calls (any of the five targets) in a compiled module's HLO text."""
  return sum(
    hlo_text.count(f'custom_call_target="{t}"')
    for t in (LEGACY_TARGET, FFI_TARGET, LAUNCH_TARGET, XLA_TARGET, XLA_TRITON_TARGET)
  )


def xla_triton_serves(kernel: str, meta: dict) -> bool:
  """Whether launch mode xla_triton hands a call of ``kernel`` (the Triton function's name)
  with constexprs ``meta`` to XLA's Triton call rather than its PTX call: the ·V launch always,
  and the persistent X·U·V decode kernel where its phase-1 tiles are all BLOCK_R columns wide
  or V is resident. Those plans measured 0.12-0.23 us a call faster through XLA's Triton call
  (it launches them as programmatic dependents); plans of masked, narrower phase-1 tiles were
  up to 2.3 us slower there (benchmarks/results/gpu_xuv_decode_points_ab_h200.json)."""
  if kernel not in XLA_TRITON_KERNELS:
    return False
  return (
    kernel == "_xuv_decode_pv_kernel" or meta["COLS_R"] == meta["BLOCK_R"] or bool(meta["V_RES"])
  )


def _default_launch() -> str:
  import jaxlib.version

  version = jaxlib.version.__version_info__
  if XLA_TRITON_JAXLIB[0] <= version < XLA_TRITON_JAXLIB[1]:
    return "xla_triton"
  return "xla" if version >= XLA_LAUNCH_MIN_JAXLIB else "jaxlib"


DEFAULT_LAUNCH = _default_launch()


def launch_mode() -> str:
  """Which handler launches lrjax's Triton kernels (launch.py): ``LRJAX_TRITON_LAUNCH``, read
  when a call is lowered; DEFAULT_LAUNCH unless set (``xla_triton`` on jaxlib 0.11.x from
  0.11.2, ``xla`` on later jaxlibs, else ``jaxlib``)."""
  mode = os.environ.get("LRJAX_TRITON_LAUNCH", "") or DEFAULT_LAUNCH
  if mode not in LAUNCH_MODES:
    raise ValueError(f"LRJAX_TRITON_LAUNCH={mode!r}: expected one of {LAUNCH_MODES}")
  return mode


def chain_scratch() -> bool:
  """Whether the decode calls of one block share a chained scratch buffer (launch.py; the
  default) or each has its own zeroed by an XLA op (``LRJAX_TRITON_SCRATCH_CHAIN=0``, read
  when a call is lowered)."""
  return os.environ.get("LRJAX_TRITON_SCRATCH_CHAIN", "") in ("", "1")


def pdl_overlap() -> bool:
  """Whether lrjax's kernels launched as programmatic dependents let the next launch start
  once their own wait ends and fetch their first weight tiles into L2 before it
  (``LRJAX_TRITON_PDL_OVERLAP=1``, read when a call is lowered; _common.pdl_join). Off
  unless set."""
  value = os.environ.get("LRJAX_TRITON_PDL_OVERLAP", "")
  if value not in ("", "0", "1"):
    raise ValueError(f"LRJAX_TRITON_PDL_OVERLAP={value!r}: expected 0 or 1")
  return value == "1"


def pdl_level() -> int:
  """The PDL constexpr of a kernel launched as a programmatic dependent: 2 with
  ``pdl_overlap``, else 1 (wait only)."""
  return 2 if pdl_overlap() else 1


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def next_link(last: tuple[int, int, int] | None, need: int) -> tuple[bool, int, int, int]:
  """Where a decode call needing ``need`` scratch floats runs in its block's scratch chain
  (launch.py). ``last`` is what the chain's last call left: (the buffer's half size, the
  half it worked in, floats of that half it used), or None where no chain runs yet.
  Returns (a fresh zeroed buffer?, its half size, the half this call works in, floats of
  the other half it zeroes). Offsets and counts are 0 or multiples of 16 (_common.leave_chain
  tells Triton so of the zeroed half's offset), never 1 (which jax-triton would compile in as
  a constant)."""
  if need < 1:
    raise ValueError(f"a scratch of {need} floats: expected at least 1")
  if last is None or need > last[0]:
    return True, _cdiv(max(need, SCRATCH_MIN_HALF), 1024) * 1024, 0, 0
  half, parity, dirty = last
  if parity not in (0, 1) or not 0 <= dirty <= half:
    raise ValueError(f"{last=}: expected (half, 0 or 1, 0 <= used floats <= half)")
  return False, half, 1 - parity, min(half, _cdiv(dirty, 16) * 16)
