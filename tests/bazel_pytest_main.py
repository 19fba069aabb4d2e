"""Entry point for Bazel py_test targets: runs pytest on the test file given as argument.

The runfiles tree is laid out like the checkout. Its folders are mapped to the installed
names by the finder of the editable install (build_backend/_lrjax_editable.py): ``lrjax/``,
``lowering/`` and ``custom_calls/`` import as ``lrjax``, ``lrjax.lowering`` and
``lrjax.custom_calls``, and nothing else under the runfiles root imports by its folder name.
Bazel does not build the C++ extensions; when the interpreter has lrjax installed (``make
venv``), its built ones (``lrjax/custom_calls/cpu/_w4a8*.so``) join the packages' ``__path__``.
"""

import importlib.metadata
import importlib.util
import os
import sys

import pytest


def map_packages(root: str) -> None:
  """Puts a finder for the lrjax packages under ``root`` first on ``sys.meta_path``."""
  path = os.path.join(root, "build_backend", "_lrjax_editable.py")
  spec = importlib.util.spec_from_file_location("_lrjax_bazel_finder", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  try:
    built = str(importlib.metadata.distribution("lrjax").locate_file(""))
  except importlib.metadata.PackageNotFoundError:
    built = None
  roots = {
    "lrjax": os.path.join(root, "lrjax"),
    "lrjax.lowering": os.path.join(root, "lowering"),
    "lrjax.custom_calls": os.path.join(root, "custom_calls"),
  }
  sys.meta_path.insert(0, mod.LrjaxEditableFinder(roots, built))


if __name__ == "__main__":
  map_packages(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
