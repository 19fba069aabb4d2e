"""Atomic directory writes: build in a hidden temp dir beside the target, then rename."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from pathlib import Path

log = logging.getLogger("lrjax.checkpoint")


def _fsync_tree(root: Path):
  for dirpath, _, files in os.walk(root):
    for f in files:
      fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)
    fd = os.open(dirpath, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, overwrite: bool = False):
  """Yield a temp dir; on clean exit it replaces ``path`` in one rename, on error it is removed.

  An interrupted write (exception or killed process) never leaves a partial ``path``; a killed
  process may leave a hidden ``.<name>.tmp-*`` sibling, which is never read.
  """
  path = Path(path).absolute()
  if path.exists() and not overwrite:
    raise FileExistsError(f"{path} exists; pass overwrite=True (CLI: --overwrite) to replace it")
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
  tmp.mkdir()
  try:
    yield tmp
    _fsync_tree(tmp)
    if path.exists():
      old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
      os.rename(path, old)
      os.rename(tmp, path)
      shutil.rmtree(old)
    else:
      os.rename(tmp, path)
    log.info("wrote %s", path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
