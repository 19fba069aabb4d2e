"""Per-platform kernel registry for the lrjax primitives.

Platform lowerings (Triton on ``cuda``, the XLA FFI W4A8 kernel on ``cpu``, NKI on
``neuron``) register a :class:`KernelLowering` per primitive. At lowering time the
dispatcher asks each candidate, highest priority first, whether it serves the
abstract operands; the first that does is lowered, otherwise the pure-jnp
reference is. Every decline is logged with its reason and is visible in
:func:`lrjax.lowering.explain`.

Two questions are asked of a kernel: can it serve these operands (``supports``), and, where
the kernel's platform has measurements, is it faster than XLA's own lowering of the
reference there (``faster``). A kernel that serves but measured slower is declined too,
unless :func:`prefer_kernels` (or ``LRJAX_PREFER_KERNELS=1``) asks for kernels wherever
they serve, e.g. for their smaller memory footprint.

Kernels register lazily: the first lowering for a platform (:func:`candidates`, which
:func:`select` asks) imports that platform's light ``custom_calls/<package>/lowering.py`` and
calls its ``register()``, once per process and thread-safely. Kernel modules are never
imported here: ``load`` is called only when a kernel is selected for lowering, so a CPU
lowering never imports triton or NKI, nor checks for their toolchains.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import types
import warnings
from typing import Any
from collections.abc import Callable, Iterator, Mapping, Sequence

log = logging.getLogger("lrjax.lowering")

# The platforms kernels lower for, each with the package of lrjax.custom_calls that holds its
# kernels (None: none yet; the reference serves).
PLATFORMS: Mapping[str, str | None] = types.MappingProxyType(
  {"cpu": "cpu", "cuda": "triton", "rocm": None, "neuron": "nki"}
)

# supports(avals_in, params) -> None when the kernel serves, else the reason it declines.
SupportsFn = Callable[[Sequence[Any], Mapping[str, Any]], "str | None"]


@dataclasses.dataclass(frozen=True)
class KernelLowering:
  """One kernel that can lower one primitive on one platform."""

  primitive: str  # "lr_xuv" | "lr_mlp" | any primitive registered in lowering.primitives
  platform: str  # one of PLATFORMS
  name: str  # e.g. "triton.xuv_splitk"
  supports: SupportsFn
  load: Callable[[], Callable[..., Any]]  # returns impl(*operands, **params) -> output
  priority: int = 0
  # faster(avals_in, params) -> None when measured at least as fast as XLA's lowering of the
  # reference (or never measured), else why not. Skipped under prefer_kernels().
  faster: SupportsFn | None = None

  def __post_init__(self):
    if self.platform not in PLATFORMS:
      raise ValueError(
        f"{self.platform=} is not a known platform; expected one of {tuple(PLATFORMS)}"
      )


@dataclasses.dataclass(frozen=True)
class Selection:
  """Outcome of kernel selection for one primitive instance on one platform."""

  platform: str
  kernel: KernelLowering | None  # None means the XLA reference lowering
  declined: tuple[tuple[str, str], ...]  # (kernel name, reason)

  @property
  def name(self) -> str:
    return self.kernel.name if self.kernel is not None else "reference"


_REGISTRY: dict[tuple[str, str], list[KernelLowering]] = {}
_LOCK = threading.Lock()
_state = threading.local()
_loaded: set[str] = set()  # platforms whose kernel package has registered its kernels
_loading: set[str] = set()
_LOAD_LOCK = threading.RLock()  # reentrant: a package's register() may ask candidates()


def load_platform(platform: str) -> None:
  """Registers ``platform``'s kernels (``lrjax.custom_calls`` package ``PLATFORMS[platform]``)
  unless already done. Called by :func:`candidates`; a failing ``register()`` raises here
  and is retried at the next lowering."""
  if platform in _loaded or PLATFORMS.get(platform) is None:
    return
  with _LOAD_LOCK:
    if platform in _loaded or platform in _loading:
      return
    _loading.add(platform)
    try:
      from lrjax import custom_calls

      custom_calls.register(platform)
      _loaded.add(platform)
      log.debug("%s kernels registered", platform)
    finally:
      _loading.discard(platform)


def loaded_platforms() -> frozenset[str]:
  """The platforms whose kernels have been registered in this process."""
  return frozenset(_loaded)


def register(kernel: KernelLowering) -> KernelLowering:
  """Registers ``kernel``; re-registering the same name replaces it."""
  with _LOCK:
    lst = _REGISTRY.setdefault((kernel.primitive, kernel.platform), [])
    lst[:] = [k for k in lst if k.name != kernel.name] + [kernel]
    lst.sort(key=lambda k: -k.priority)
  return kernel


def unregister(primitive: str, platform: str, name: str) -> None:
  """Removes the kernel ``name`` registered for ``primitive`` on ``platform``, if any."""
  with _LOCK:
    lst = _REGISTRY.get((primitive, platform), [])
    lst[:] = [k for k in lst if k.name != name]


def candidates(primitive: str, platform: str, *, load: bool = True) -> tuple[KernelLowering, ...]:
  """The kernels registered for ``primitive`` on ``platform``, highest priority first; with
  ``load``, the platform's kernel package registers its kernels first (once)."""
  if load:
    load_platform(platform)
  with _LOCK:
    return tuple(_REGISTRY.get((primitive, platform), ()))


def reference_forced() -> bool:
  return bool(getattr(_state, "force_reference", 0)) or os.environ.get(
    "LRJAX_FORCE_REFERENCE", ""
  ) not in ("", "0")


@contextlib.contextmanager
def _flag_raised(name: str) -> Iterator[None]:
  """Raises this thread's nesting count of the mode ``name`` for the context."""
  prev = getattr(_state, name, 0)
  setattr(_state, name, prev + 1)
  try:
    yield
  finally:
    setattr(_state, name, prev)


def kernels_preferred() -> bool:
  return bool(getattr(_state, "prefer_kernels", 0)) or os.environ.get(
    "LRJAX_PREFER_KERNELS", ""
  ) not in ("", "0")


@contextlib.contextmanager
def prefer_kernels() -> Iterator[None]:
  """Within this context, kernels serve wherever they can, even where measured slower
  than XLA (their ``faster`` check is skipped). Like :func:`force_reference`, it acts at
  lowering time: wrap the first call (or ``.lower()``) of a fresh ``jax.jit`` object.
  """
  with _flag_raised("prefer_kernels"):
    yield


@contextlib.contextmanager
def force_reference() -> Iterator[None]:
  """Within this context, newly lowered primitives use the XLA reference.

  Lowering happens when a jitted function is first compiled, so wrap the
  first call (or ``.lower()``) of a fresh ``jax.jit`` object.
  """
  with _flag_raised("force_reference"):
    yield


def select(
  primitive: str, platform: str, avals_in: Sequence[Any], params: Mapping[str, Any]
) -> Selection:
  """Picks the kernel that serves these operands, or the reference."""
  if reference_forced():
    return Selection(
      platform, None, (("*", "reference forced (force_reference / LRJAX_FORCE_REFERENCE)"),)
    )
  kernel, declined = choose(candidates(primitive, platform), avals_in, params)
  return Selection(platform, kernel, declined)


def choose(
  kernels: Sequence[KernelLowering], avals_in: Sequence[Any], params: Mapping[str, Any]
) -> tuple[KernelLowering | None, tuple[tuple[str, str], ...]]:
  """The first of ``kernels`` (in order) that serves and, unless kernels are preferred,
  is not measured slower than XLA; with the (name, reason) of each one passed over."""
  declined = []
  checks = ("supports",) if kernels_preferred() else ("supports", "faster")
  for k in kernels:
    reason = None
    for check in checks:
      fn = getattr(k, check)
      if fn is None:
        continue
      try:
        reason = fn(avals_in, params)
      except Exception as e:  # a buggy predicate must not break compilation, nor hide
        reason = f"{check}() raised {type(e).__name__}: {e}"
        warnings.warn(
          f"lrjax: kernel {k.name} falls back to the reference because its {reason}",
          RuntimeWarning,
          stacklevel=2,
        )
      if reason is not None:
        break
    if reason is None:
      return k, tuple(declined)
    declined.append((k.name, reason))
  return None, tuple(declined)
