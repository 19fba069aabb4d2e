"""Safe directory writes: build in a hidden temp dir beside the target, then swap it in.

Rules every lrjax write follows (``save``, ``export_hf``, ``lrjax convert``/``export``):

- **Paths** are resolved at the boundary (:func:`resolve`): ``~`` expanded, relative paths made
  absolute, symlinks followed; an empty path is an error.
- **Overwrite** replaces only a directory that ``replaceable`` recognises (an lrjax checkpoint,
  an lrjax export). It never replaces a file, the current directory or an ancestor of it, an
  input of the same command (``protect``) or a directory that holds one.
- **One writer per target**: a lock file ``.<name>.lock`` in the parent (``flock``) is held
  from :func:`reserve_output` (or the write itself) to the end; a second writer fails at once
  with :class:`OutputBusyError`.
- **Crash safety**: the new tree is written and fsynced in ``.<name>.tmp-<owner>``, then
  exchanged with the old one in one ``renameat2(RENAME_EXCHANGE)``, so ``path`` holds the old or
  the new tree at every instant. Where the exchange is unsupported, two renames are used and an
  interrupted pair is rolled back (an exception) or repaired by the next write (a kill).
- **Stale temporaries** (``.<name>.tmp-*``, ``.<name>.old-*``) whose owner process is gone are
  removed by the next write into the same parent. The owner (host, boot id, pid and process
  start time) is encoded in the temp name; temporaries of other hosts are left alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import logging
import os
import re
import shutil
import socket
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

try:
  import fcntl
except ImportError:  # pragma: no cover - non-POSIX
  fcntl = None

log = logging.getLogger("lrjax.checkpoint")

# replaceable(path) -> None if lrjax may replace the directory at ``path``, else the reason.
Replaceable = Callable[[Path], str | None]

_NAME_MAX = 255
_TEMP_RE = re.compile(
  r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<owner>[0-9a-f]{16}-\d+-\d+)-[0-9a-f]{8}$"
)


class OutputBusyError(BlockingIOError):
  """Another writer holds the lock of this output path."""

  def __str__(self) -> str:
    return str(self.args[0]) if self.args else "output is busy"


# ---- paths ------------------------------------------------------------------------------------
def resolve(path: str | os.PathLike, what: str = "path") -> Path:
  """``path`` with ``~`` expanded, made absolute and with symlinks resolved."""
  p = os.fspath(path)
  if isinstance(p, bytes):
    p = os.fsdecode(p)
  if not p.strip():
    raise ValueError(f"{what} is empty; give a directory path")
  return Path(os.path.realpath(os.path.expanduser(p)))


def _is_within(inner: Path, outer: Path) -> bool:
  """True if ``inner`` is ``outer`` or lies below it (both resolved)."""
  return inner == outer or outer in inner.parents


# ---- owner records ----------------------------------------------------------------------------
def _boot_id() -> str:
  try:
    with open("/proc/sys/kernel/random/boot_id") as fh:
      return fh.read().strip()
  except OSError:
    return "unknown"


def _start_time(pid: int) -> int:
  """Start time of process ``pid`` (clock ticks since boot), 0 if unknown, -1 if gone."""
  try:
    with open(f"/proc/{pid}/stat") as fh:
      stat = fh.read()
  except FileNotFoundError:
    return -1
  except OSError:
    return 0
  return int(stat.rsplit(")", 1)[1].split()[19])


def _machine() -> str:
  """8 hex of the host name + 8 hex of the boot id."""
  h = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
  return h + hashlib.sha1(_boot_id().encode()).hexdigest()[:8]


def _owner() -> str:
  pid = os.getpid()
  return f"{_machine()}-{pid}-{max(_start_time(pid), 0)}"


def _owner_gone(owner: str) -> bool:
  """True if the process that wrote ``owner`` has certainly exited (same host only)."""
  machine, pid, start = owner.split("-")
  here = _machine()
  if machine[:8] != here[:8]:
    return False  # another host (shared file system): it may still be writing
  if machine[8:] != here[8:]:
    return True  # this host rebooted since
  pid, start = int(pid), int(start)
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  except PermissionError:
    pass
  now = _start_time(pid)
  return now == -1 or (start > 0 and now > 0 and now != start)


def _temp_name(path: Path, kind: str) -> Path:
  name = f".{path.name}.{kind}-{_owner()}-{uuid.uuid4().hex[:8]}"
  if len(name.encode()) > _NAME_MAX:
    raise ValueError(
      f"output name {path.name!r} is too long ({len(path.name.encode())} bytes) to build "
      f"beside; use a name of at most {_NAME_MAX - len(name.encode()) + len(path.name.encode())}"
    )
  return path.parent / name


# ---- file-system steps (module-level so crash tests can intercept each one) --------------------
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_libc = None


def _exchange(a: Path, b: Path) -> bool:
  """Atomically swap ``a`` and ``b``; False where the OS or file system cannot."""
  global _libc
  if _libc is None:
    try:
      _libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
      _libc = False
  fn = getattr(_libc, "renameat2", None) if _libc else None
  if fn is None:
    return False
  rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
  if rc == 0:
    return True
  err = ctypes.get_errno()
  if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
    return False
  raise OSError(err, f"exchanging {a} and {b}: {os.strerror(err)}")


def _mkdir(p: Path):
  p.mkdir()


def _rename(a: Path, b: Path):
  os.rename(a, b)


def _rmtree(p: Path):
  shutil.rmtree(p)


def _fsync_one(p: Path | str):
  fd = os.open(p, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _fsync_path(p: Path | str):
  _fsync_one(p)


def _fsync_tree(root: Path):
  for dirpath, _, files in os.walk(root):
    for f in files:
      _fsync_one(os.path.join(dirpath, f))
    _fsync_one(dirpath)


# ---- locks ------------------------------------------------------------------------------------
_held: dict[Path, dict] = {}
_held_guard = threading.Lock()


def _lock_path(path: Path) -> Path:
  return path.parent / f".{path.name}.lock"


def _acquire(lock: Path, target: Path) -> int:
  if fcntl is None:  # pragma: no cover
    return -1
  while True:
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      try:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
      finally:
        os.close(fd)
      raise OutputBusyError(
        f"{target} is being written by another process (pid {holder}, lock {lock}); "
        "wait for it to finish or choose another output path"
      ) from None
    st = os.fstat(fd)
    try:
      cur = os.stat(lock)
    except FileNotFoundError:
      cur = None
    if cur is not None and (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino):
      os.ftruncate(fd, 0)
      os.write(fd, str(os.getpid()).encode())
      return fd
    os.close(fd)  # the previous holder removed the file after we opened it: try again


def _release(lock: Path, fd: int):
  if fd < 0:  # pragma: no cover
    return
  try:
    os.unlink(lock)
  except FileNotFoundError:
    pass
  finally:
    os.close(fd)


@contextlib.contextmanager
def _locked(path: Path, protect: Iterable[Path] = ()) -> Iterator[dict]:
  """Hold ``path``'s lock (re-entrant within one thread); yields the holder's record."""
  me = threading.get_ident()
  with _held_guard:
    rec = _held.get(path)
    if rec is not None and rec["thread"] != me:
      raise OutputBusyError(f"{path} is being written by another thread of this process")
    if rec is not None:
      rec["depth"] += 1
      rec["protect"] = list(rec["protect"]) + list(protect)
  if rec is not None:
    try:
      yield rec
    finally:
      with _held_guard:
        rec["depth"] -= 1
    return
  created = _make_parents(path.parent)
  try:
    fd = _acquire(_lock_path(path), path)
  except BaseException:
    _remove_empty(created)
    raise
  rec = {"thread": me, "depth": 1, "protect": list(protect), "created": created}
  with _held_guard:
    _held[path] = rec
  try:
    yield rec
  finally:
    with _held_guard:
      del _held[path]
    _release(_lock_path(path), fd)
    if not path.exists():
      _remove_empty(created)


def _make_parents(parent: Path) -> list[Path]:
  """Create missing parents (outermost first); returns those created."""
  missing = []
  p = parent
  while not p.exists():
    missing.append(p)
    p = p.parent
  if p.exists() and not p.is_dir():
    raise NotADirectoryError(f"cannot write under {parent}: {p} is a file, not a directory")
  created = []
  try:
    for d in reversed(missing):
      d.mkdir()
      created.append(d)
  except OSError as e:
    _remove_empty(created)
    raise OSError(
      e.errno, f"cannot create the output's parent directory {parent}: {e.strerror}"
    ) from None
  return created


def _remove_empty(dirs: list[Path]):
  for d in reversed(dirs):
    try:
      d.rmdir()
    except OSError:
      break


# ---- checks -----------------------------------------------------------------------------------
def _refusal(
  path: Path, overwrite: bool, replaceable: Replaceable | None, protect: Iterable[Path]
) -> Exception | None:
  """Why ``path`` may not be written (an exception to raise), or None."""
  if path == Path(path.anchor):
    return ValueError(f"{path} is a file-system root; choose a directory for the output")
  for p in protect:
    if _is_within(p, path):
      what = "is" if p == path else "contains"
      return FileExistsError(
        f"{path} {what} an input of this command ({p}); choose another output path"
      )
  if not os.path.lexists(path):
    return None
  if not path.is_dir():
    return FileExistsError(
      f"{path} exists and is not a directory; lrjax never replaces a file: remove it or "
      "choose another output path"
    )
  if not overwrite:
    return FileExistsError(f"{path} exists; pass overwrite=True (CLI: --overwrite) to replace it")
  try:
    cwd = resolve(os.getcwd())
  except OSError:
    cwd = None
  if cwd is not None and _is_within(cwd, path):
    what = "is" if cwd == path else "contains"
    return FileExistsError(
      f"{path} {what} the current directory; lrjax does not replace it: choose another output path"
    )
  if not any(path.iterdir()):
    return None  # an empty directory holds nothing to lose
  reason = replaceable(path) if replaceable is not None else "is not empty"
  if reason:
    return FileExistsError(
      f"{path} exists and {reason}; --overwrite replaces only that, "
      "so remove it yourself or choose another output path"
    )
  return None


@contextlib.contextmanager
def reserve_output(
  path: str | os.PathLike,
  overwrite: bool = False,
  *,
  replaceable: Replaceable | None = None,
  protect: Iterable[str | os.PathLike] = (),
) -> Iterator[Path]:
  """Lock ``path`` for this thread and check it may be written, before any long work.

  Proves the parent is writable (the lock file is created there). Writes to ``path`` inside
  the block re-use the lock and re-check ``protect``. Yields the resolved path.
  """
  p = resolve(path, "output path")
  prot = [resolve(x) for x in protect]
  with _locked(p, prot):
    clean_stale(p.parent)
    err = _refusal(p, overwrite, replaceable, prot)
    if err is not None:
      raise err
    yield p


# ---- stale temporaries ------------------------------------------------------------------------
def clean_stale(parent: str | os.PathLike) -> list[str]:
  """Remove ``.<name>.tmp-*``/``.old-*`` dirs in ``parent`` whose owner process is gone, and
  lock files that no process holds.

  An ``.old-*`` dir whose target is missing (a kill between the two renames of a replace
  without ``RENAME_EXCHANGE``) is renamed back to its target instead. Returns what was done.
  """
  parent = Path(parent)
  done = []
  try:
    entries = list(os.scandir(parent))
  except OSError:
    return done
  for e in entries:
    if e.name.startswith(".") and e.name.endswith(".lock") and len(e.name) > 6:
      if _drop_free_lock(parent / e.name):
        done.append(f"removed {parent / e.name}")
      continue
    m = _TEMP_RE.match(e.name)
    if not m or not e.is_dir(follow_symlinks=False) or not _owner_gone(m["owner"]):
      continue
    p = parent / e.name
    target = parent / m["name"]
    try:
      if m["kind"] == "old" and not os.path.lexists(target):
        with _locked(target):
          if not os.path.lexists(target):
            _rename(p, target)
            log.warning("restored %s from an interrupted replace (%s)", target, e.name)
            done.append(f"restored {target}")
            continue
      _rmtree(p)
      log.info("removed stale temporary %s", p)
      done.append(f"removed {p}")
    except OutputBusyError:
      continue
    except OSError as err:
      log.warning("could not remove stale temporary %s: %s", p, err)
  return done


def _drop_free_lock(lock: Path) -> bool:
  """Remove a lock file nobody holds (left by a killed writer); False if it is held."""
  if fcntl is None:  # pragma: no cover
    return False
  try:
    fd = os.open(lock, os.O_RDWR)
  except OSError:
    return False
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    os.close(fd)
    return False
  try:
    st, cur = os.fstat(fd), os.stat(lock)
    if (st.st_dev, st.st_ino) != (cur.st_dev, cur.st_ino):
      return False
    os.unlink(lock)
    return True
  except OSError:
    return False
  finally:
    os.close(fd)


# ---- the write --------------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_dir(
  path: str | os.PathLike,
  overwrite: bool = False,
  *,
  replaceable: Replaceable | None = None,
  protect: Iterable[str | os.PathLike] = (),
) -> Iterator[Path]:
  """Yield a temp dir; on clean exit it replaces ``path`` atomically, on error it is removed.

  ``replaceable(path)`` says whether an existing non-empty directory may be replaced (None:
  none may); ``protect`` lists inputs that must survive. See the module docstring.
  """
  p = resolve(path, "output path")
  prot = [resolve(x) for x in protect]
  with _locked(p, prot) as rec:
    prot = rec["protect"]
    clean_stale(p.parent)
    err = _refusal(p, overwrite, replaceable, prot)
    if err is not None:
      raise err
    tmp = _temp_name(p, "tmp")
    _mkdir(tmp)
    committed = False
    try:
      yield tmp
      _fsync_tree(tmp)
      err = _refusal(p, overwrite, replaceable, prot)  # re-checked: the body may take hours
      if err is not None:
        raise err
      committed = _commit(tmp, p)
    except BaseException:
      if not committed:
        shutil.rmtree(tmp, ignore_errors=True)
      raise
    log.info("wrote %s", p)


def _commit(tmp: Path, path: Path) -> bool:
  """Move ``tmp`` to ``path``; returns True once ``path`` holds the new tree."""
  if not os.path.lexists(path):
    _rename(tmp, path)
    _settle(path.parent)
    return True
  if _exchange(tmp, path):  # tmp now holds the old tree
    _settle(path.parent, old=tmp)
    return True
  old = _temp_name(path, "old")
  _rename(path, old)
  try:
    _rename(tmp, path)
  except BaseException:
    _rename(old, path)
    raise
  _settle(path.parent, old=old)
  return True


def _settle(parent: Path, old: Path | None = None):
  """After the new tree is in place: make the rename durable, drop the old tree (best effort)."""
  try:
    _fsync_path(parent)
    if old is not None:
      _rmtree(old)
  except Exception as e:  # the write itself succeeded; a later write removes what is left
    log.warning("wrote the output but could not finish cleaning up in %s: %s", parent, e)
