"""Where the NKI kernel modules get ``nki``, ``nl`` (nki.language) and ``nisa`` (nki.isa).

Kernel files are plain NKI code: like the kernels in the NKI docs they use the
module globals ``nki``, ``nl`` and ``nisa``. They bind them with one line,
``nki, nl, nisa = _api.toolchain(globals())``, which gives

* the real NKI modules of the Neuron SDK (``import nki``; NKI 0.7, Neuron SDK 2.33)
  when they are installed;
* otherwise (not installed, or PyPI's placeholder ``nki`` 0.0.1 that raises on
  import) placeholders: ``nki.jit`` leaves the function undecorated so the module
  still imports (for its BlockSizes, docs and wrappers), and any use of ``nl`` or
  ``nisa`` raises an ImportError that names the fix;
* the names pre-seeded by :func:`instantiate`, which executes a private copy of a
  kernel module against other modules with the same API, e.g. the numpy test
  double in ``tests/custom_calls/nki/nki_double.py``. The copy is not put in
  ``sys.modules``, so the real kernels are never affected.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import sys
import types

_instances = itertools.count()

_MISSING_MSG = (
  "the NKI toolchain (`import nki`, AWS Neuron SDK 2.33 / NKI 0.7) is not installed; "
  "it ships from AWS's Neuron package repository, not PyPI. On a machine without it, "
  "run the kernels on a test double via lrjax.custom_calls.nki._api.instantiate"
)


class _Missing(types.ModuleType):
  def __getattr__(self, name):
    raise ImportError(f"{self.__name__}.{name}: {_MISSING_MSG}")


class _MissingNki(_Missing):
  @staticmethod
  def jit(fn=None, **_kw):
    return fn if fn is not None else (lambda f: f)


def available() -> bool:
  """True when the real NKI package can be imported (checked without importing it)."""
  try:
    return importlib.util.find_spec("nki") is not None
  except (ImportError, ValueError):
    return False


def toolchain(module_globals: dict):
  """(nki, nl, nisa) for a kernel module: pre-seeded names, else the real NKI, else placeholders."""
  if all(k in module_globals for k in ("nki", "nl", "nisa")):
    return module_globals["nki"], module_globals["nl"], module_globals["nisa"]
  if available():
    try:
      return (
        importlib.import_module("nki"),
        importlib.import_module("nki.language"),
        importlib.import_module("nki.isa"),
      )
    except ImportError:  # e.g. PyPI's placeholder `nki` 0.0.1, which raises on import
      pass
  return _MissingNki("nki"), _Missing("nki.language"), _Missing("nki.isa")


def instantiate(module_name: str, *, nki, nl, nisa) -> types.ModuleType:
  """Executes a fresh copy of kernel module ``module_name`` with these NKI modules."""
  found = importlib.util.find_spec(module_name)
  if found is None or found.origin is None:
    raise ValueError(f"{module_name=} not found")
  name = f"{module_name}__instance{next(_instances)}"
  spec = importlib.util.spec_from_file_location(name, found.origin)
  mod = importlib.util.module_from_spec(spec)
  mod.__dict__.update(nki=nki, nl=nl, nisa=nisa)
  sys.modules[name] = mod  # dataclasses resolve their module while the class is created
  try:
    spec.loader.exec_module(mod)
  finally:
    del sys.modules[name]
  return mod
