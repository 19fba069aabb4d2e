"""lrjax.custom_calls: per-platform kernels behind the lrjax primitives.

Installed as ``lrjax.custom_calls`` (on disk: ``custom_calls/``). One package per platform,
as named by :data:`lrjax.lowering.registry.PLATFORMS`: ``triton/`` (``cuda``, via jax-triton),
``cpu/`` (``cpu``: C++ XLA FFI, W4A8), ``nki/`` (``neuron``: Trainium).

Each package has a light ``lowering.py`` that never imports its toolchain at import time. It
defines ``KERNELS`` (a list of :class:`lrjax.lowering.KernelLowering`) and ``register()``,
which registers them where the platform can use them. The registry calls :func:`register`
for a platform on that platform's first lowering; :func:`kernel_catalog` lists every
platform's kernels (for explain) without registering anything.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

from lrjax.lowering.registry import PLATFORMS, KernelLowering

log = logging.getLogger("lrjax.custom_calls")


def kernel_module(platform: str) -> ModuleType | None:
  """``platform``'s light ``lowering`` module, or None where it has no kernel package."""
  package = PLATFORMS.get(platform)
  if package is None:
    return None
  name = f"lrjax.custom_calls.{package}"
  try:
    return importlib.import_module(f"{name}.lowering")
  except ModuleNotFoundError as e:
    if e.name in (name, f"{name}.lowering"):
      return None
    raise


def kernel_catalog() -> dict[str, list[KernelLowering]]:
  """Every platform's kernels, registered here or not (for explain); keyed by platform."""
  out = {}
  for platform in PLATFORMS:
    mod = kernel_module(platform)
    if mod is not None:
      out[platform] = list(getattr(mod, "KERNELS", ()))
  return out


def register(platform: str) -> None:
  """Registers ``platform``'s kernels with the lowering registry (its package decides
  whether the platform's toolchain is there)."""
  mod = kernel_module(platform)
  if mod is not None and hasattr(mod, "register"):
    mod.register()


def register_all() -> None:
  """Registers every platform's kernels now, instead of on each platform's first lowering.
  This runs every package's toolchain check (e.g. NKI's imports ``nki.language``)."""
  from lrjax.lowering import registry

  for platform in PLATFORMS:
    registry.load_platform(platform)
