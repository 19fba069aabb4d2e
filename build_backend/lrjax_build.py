"""lrjax's PEP 517 build backend: scikit-build-core, with its own editable install.

On disk the packages are ``lrjax/``, ``lowering/`` and ``custom_calls/``; installed they are
``lrjax``, ``lrjax.lowering`` and ``lrjax.custom_calls`` (``[tool.scikit-build.wheel.packages]``
in pyproject.toml). Regular wheels and sdists are scikit-build-core's, unchanged.

For ``pip install -e``, scikit-build-core's redirect (its ``.pth`` and finder) maps remapped
folders by their parents: it puts the checkout and the checkout's parent on ``sys.path`` and
the checkout into ``lrjax.__path__``, so ``lowering``, ``tests``, ``lrjax.tests`` and anything
beside the checkout would import. The editable wheel keeps what scikit-build-core built (the
C++ extensions, the metadata, the ``lrjax`` script) and replaces that redirect with
``_lrjax_editable`` (build_backend/_lrjax_editable.py), a finder that maps exactly the three
package names to their folders and adds nothing to ``sys.path``.
"""

from __future__ import annotations

import base64
import hashlib
import os
import tomllib
import zipfile

from scikit_build_core.build import (
  build_sdist,
  build_wheel,
  get_requires_for_build_editable,
  get_requires_for_build_sdist,
  get_requires_for_build_wheel,
  prepare_metadata_for_build_editable,
  prepare_metadata_for_build_wheel,
)
from scikit_build_core.build import build_editable as _skbc_build_editable

__all__ = [
  "build_editable",
  "build_sdist",
  "build_wheel",
  "get_requires_for_build_editable",
  "get_requires_for_build_sdist",
  "get_requires_for_build_wheel",
  "prepare_metadata_for_build_editable",
  "prepare_metadata_for_build_wheel",
]

FINDER = "_lrjax_editable"
_SKBC_PREFIX = "_editable_skbc_"


def _record_hash(data: bytes) -> str:
  digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
  return "sha256=" + digest.decode()


def package_roots(project_dir: str) -> dict[str, str]:
  """Installed package name -> absolute source folder, from pyproject.toml's
  ``[tool.scikit-build.wheel.packages]`` (e.g. ``"lrjax/lowering" = "lowering"``)."""
  with open(os.path.join(project_dir, "pyproject.toml"), "rb") as f:
    packages = tomllib.load(f)["tool"]["scikit-build"]["wheel"]["packages"]
  return {
    target.replace("/", "."): os.path.abspath(os.path.join(project_dir, source))
    for target, source in packages.items()
  }


def finder_files(roots: dict[str, str]) -> dict[str, bytes]:
  """The editable install's hook: the finder module with its ``install`` call, and the
  ``.pth`` line that imports it at interpreter start."""
  here = os.path.dirname(os.path.abspath(__file__))
  with open(os.path.join(here, FINDER + ".py"), encoding="utf-8") as f:
    source = f.read()
  source += f"\n\ninstall({roots!r})\n"
  return {FINDER + ".py": source.encode(), FINDER + ".pth": f"import {FINDER}\n".encode()}


def _pth_without_paths(data: bytes) -> bytes:
  kept = [ln for ln in data.decode().splitlines() if ln.startswith(("import ", "import\t"))]
  return ("\n".join(kept) + "\n").encode() if kept else b""


def rewrite_wheel(wheel_path: str, add: dict[str, bytes]) -> list[str]:
  """Rewrites the wheel at ``wheel_path``: drops scikit-build-core's editable redirect
  (``_editable_skbc_*``), reduces any other top-level ``.pth`` to its ``import`` lines (none
  adds a ``sys.path`` entry), adds the files ``add`` and rewrites RECORD to match. Returns
  the top-level names dropped or changed."""
  with zipfile.ZipFile(wheel_path) as zin:
    infos = zin.infolist()
    contents = {i.filename: zin.read(i.filename) for i in infos}
  record = next(n for n in contents if n.endswith(".dist-info/RECORD"))
  dropped = {n for n in contents if "/" not in n and n.startswith(_SKBC_PREFIX)}
  changed = {}
  for name, data in contents.items():
    if "/" in name or name in dropped or not name.endswith(".pth"):
      continue
    new = _pth_without_paths(data)
    if new != data:
      if new:
        changed[name] = new
      else:
        dropped.add(name)
  changed.update(add)
  rows = []
  for row in contents[record].decode().splitlines():
    path = row.rsplit(",", 2)[0]
    if path in dropped or path in add:
      continue
    if path in changed:
      row = f"{path},{_record_hash(changed[path])},{len(changed[path])}"
    rows.append(row)
  rows += [f"{n},{_record_hash(d)},{len(d)}" for n, d in add.items()]
  contents[record] = ("\n".join(rows) + "\n").encode()
  tmp = wheel_path + ".tmp"
  with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zout:
    first_dist_info = next(i for i, info in enumerate(infos) if ".dist-info/" in info.filename)
    for i, info in enumerate(infos):
      if i == first_dist_info:
        for name, data in add.items():
          zout.writestr(zipfile.ZipInfo(name, date_time=info.date_time), data, zipfile.ZIP_DEFLATED)
      if info.filename in dropped or info.filename in add:
        continue
      zout.writestr(info, changed.get(info.filename, contents[info.filename]))
  os.replace(tmp, wheel_path)
  return sorted(dropped | set(changed) - set(add))


def build_editable(
  wheel_directory: str,
  config_settings: dict[str, list[str] | str] | None = None,
  metadata_directory: str | None = None,
) -> str:
  """scikit-build-core's editable wheel with its redirect replaced by ``_lrjax_editable``."""
  name = _skbc_build_editable(wheel_directory, config_settings, metadata_directory)
  rewrite_wheel(os.path.join(wheel_directory, name), finder_files(package_roots(os.getcwd())))
  return name
