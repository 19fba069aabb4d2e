"""The on-disk compilation cache the ``lrjax`` commands use, so a second start skips XLA's
compiles (JAX's persistent compilation cache; its key covers the program, the compile options,
the backend and the jax/jaxlib versions, so a changed model, kernel choice or install compiles
anew).

``LRJAX_COMPILE_CACHE``: a directory, or ``off``; default ``$XDG_CACHE_HOME/lrjax/xla`` (else
``~/.cache/lrjax/xla``). ``LRJAX_COMPILE_CACHE_GB``: its size bound, least recently used
entries evicted first (default 2). Programs that compile in under 0.2 s are not stored.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

log = logging.getLogger("lrjax")

ENV_DIR, ENV_GB = "LRJAX_COMPILE_CACHE", "LRJAX_COMPILE_CACHE_GB"
OFF = ("off", "0", "none", "false", "no")
DEFAULT_GB = 2.0
MIN_COMPILE_S = 0.2


def cache_dir(environ=os.environ) -> str | None:
  """The cache directory ``environ`` asks for; None when it is switched off."""
  v = environ.get(ENV_DIR, "").strip()
  if v.lower() in OFF:
    return None
  if v:
    return os.path.abspath(os.path.expanduser(v))
  base = environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(
    os.path.expanduser("~"), ".cache"
  )
  return os.path.join(base, "lrjax", "xla")


def cache_bytes(environ=os.environ) -> int:
  """The size bound in bytes from ``LRJAX_COMPILE_CACHE_GB``."""
  v = environ.get(ENV_GB, "").strip()
  try:
    gb = float(v) if v else DEFAULT_GB
  except ValueError:
    gb = float("nan")
  if not gb > 0 or gb == float("inf"):
    raise ValueError(f"{ENV_GB}={v!r} must be a positive number of GB (default {DEFAULT_GB})")
  return int(gb * 1e9)


def enable(environ=os.environ) -> str | None:
  """Points jax's persistent compilation cache at :func:`cache_dir`; returns the directory in
  effect, or None (switched off, or not writable: then a warning says so and nothing is
  cached). A setting the user gave jax's own environment variable (``JAX_COMPILATION_CACHE_DIR``
  and the others) wins. Before jax is imported this sets those variables, so it imports
  nothing; after, it updates jax's config. Call before the first compile: jax keeps the
  cache it has once it compiled."""
  path = cache_dir(environ)
  if path is None:
    return None
  path = environ.get("JAX_COMPILATION_CACHE_DIR") or path  # the user's own wins
  size = cache_bytes(environ)
  try:
    os.makedirs(path, exist_ok=True)
    if not os.access(path, os.W_OK | os.X_OK):
      raise PermissionError(f"{path} is not writable")
  except OSError as e:
    log.warning("no compilation cache (%s); set %s to a writable directory or off", e, ENV_DIR)
    return None
  if importlib.util.find_spec("filelock") is None:  # jax bounds the size only with it
    size = -1
  settings = {
    "jax_compilation_cache_dir": path,
    "jax_compilation_cache_max_size": size,
    "jax_persistent_cache_min_compile_time_secs": MIN_COMPILE_S,
  }
  settings = {k: v for k, v in settings.items() if k.upper() not in environ}  # the user's win
  if "jax" in sys.modules:
    import jax

    for k, v in settings.items():
      jax.config.update(k, v)
  else:
    for k, v in settings.items():
      environ[k.upper()] = str(v)
  return path
