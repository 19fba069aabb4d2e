"""Import hook of lrjax's editable install (``pip install -e``), loaded by a ``.pth`` file.

Maps the installed package names to the checkout's folders, and nothing else:
``lrjax`` -> ``lrjax/``, ``lrjax.lowering`` -> ``lowering/``, ``lrjax.custom_calls`` ->
``custom_calls/``. No directory is added to ``sys.path``. Each package's ``__path__`` is its
source folder, followed by the same package's folder in site-packages when the install put
built files there (the C++ extension ``lrjax/custom_calls/cpu/_w4a8*.so``). Modules are then
found by Python's own path finder within those ``__path__`` lists, so a new ``.py`` file in
the checkout imports without reinstalling; C++ changes need ``pip install -e .`` again.

The build backend (build_backend/lrjax_build.py) copies this file into the editable wheel and
appends the call ``install({...})`` with the checkout's absolute folders.
"""

import os
import sys

_INSTALLED = os.path.dirname(os.path.abspath(__file__))


class LrjaxEditableFinder:
  """A meta path finder for the packages of one editable lrjax checkout."""

  def __init__(self, roots: dict) -> None:
    # longest name first, so that lrjax.lowering wins over lrjax
    self.roots = sorted(roots.items(), key=lambda kv: -len(kv[0]))

  def _source_dir(self, fullname: str):
    for name, folder in self.roots:
      if fullname == name or fullname.startswith(name + "."):
        rest = fullname[len(name) :].split(".")[1:]
        return os.path.join(folder, *rest)
    return None

  def find_spec(self, fullname, path=None, target=None):
    """A spec for each package under the mapped names; ``None`` for everything else
    (modules inside the packages are found through the packages' ``__path__``)."""
    src = self._source_dir(fullname)
    if src is None:
      return None
    init = os.path.join(src, "__init__.py")
    if not os.path.isfile(init):
      return None
    locations = [src]
    built = os.path.join(_INSTALLED, *fullname.split("."))
    if os.path.isdir(built):
      locations.append(built)
    import importlib.util

    return importlib.util.spec_from_file_location(
      fullname, init, submodule_search_locations=locations
    )


def install(roots: dict) -> None:
  """Puts one finder for ``roots`` (package name -> absolute folder) first on sys.meta_path."""
  if any(type(f).__name__ == LrjaxEditableFinder.__name__ for f in sys.meta_path):
    return
  sys.meta_path.insert(0, LrjaxEditableFinder(roots))
