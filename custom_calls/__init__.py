"""lrjax.custom_calls: per-platform kernels behind the lrjax primitives.

Installed as ``lrjax.custom_calls`` (on disk: ``custom_calls/``). Rooms:
``triton/`` (CUDA, via jax-triton), ``cpu/`` (C++ XLA FFI, W4A8), ``nki/`` (Trainium).

Each room has a light ``lowering.py`` that never imports its toolchain at import
time. It defines ``KERNELS`` (a list of :class:`lrjax.lowering.KernelLowering`)
and ``register()``, which registers them where the platform can use them.
"""

from __future__ import annotations

import importlib
import logging

log = logging.getLogger("lrjax.custom_calls")

ROOMS = ("triton", "cpu", "nki")


def _room_lowering(room: str):
  try:
    return importlib.import_module(f"lrjax.custom_calls.{room}.lowering")
  except ModuleNotFoundError as e:
    if e.name == f"lrjax.custom_calls.{room}.lowering" or e.name == f"lrjax.custom_calls.{room}":
      return None
    raise


def kernel_catalog() -> dict[str, list]:
  """Every kernel each room provides, registered here or not (for explain)."""
  out = {}
  for room in ROOMS:
    mod = _room_lowering(room)
    if mod is not None:
      out[room] = list(getattr(mod, "KERNELS", ()))
  return out


def register_all() -> None:
  """Registers every room's kernels with the lowering registry."""
  for room in ROOMS:
    mod = _room_lowering(room)
    if mod is not None and hasattr(mod, "register"):
      mod.register()
