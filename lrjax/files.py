"""The user's files with errors that name the file: one-line messages, JSON objects, and the
``--out`` file a command may write."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path


def one_line(e: BaseException, limit: int | None = 300) -> str:
  """The first line of ``e``'s message (at most ``limit`` characters; None: all of it), else
  its type's name."""
  lines = str(e).strip().splitlines()
  return lines[0][:limit] if lines else type(e).__name__


def read_json_object(path: str | os.PathLike, hint: str = "") -> dict:
  """The JSON object in file ``path``; a one-line ValueError naming the file (and ``hint``,
  what to do about it) when it is not valid JSON, not an object, or a directory."""
  tail = f"; {hint}" if hint else ""
  try:
    with open(path, encoding="utf-8") as fh:
      out = json.load(fh)
  except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
    raise ValueError(f"{path}: not valid JSON ({one_line(e)}){tail}") from None
  except IsADirectoryError:
    raise ValueError(f"{path}: is a directory, expected a JSON file") from None
  if not isinstance(out, dict):
    raise ValueError(f"{path}: expected a JSON object, got {type(out).__name__}{tail}")
  return out


def check_out(
  path: str, overwrite: bool, inputs: Sequence[Path], what: str, is_ours: Callable[[dict], bool]
) -> Path:
  """The resolved ``--out`` file of a command, if it may be written: not an input or inside
  one, not a directory, its folder present and writable, and when it exists only with
  ``overwrite`` and only if it holds ``what`` (``is_ours`` of its JSON object)."""
  from lrjax.checkpoint import resolve

  p = resolve(path, "--out")
  for i in inputs:
    if p == i or i in p.parents:
      raise FileExistsError(
        f"--out {path} is {'an input' if p == i else 'inside an input'} of this command ({i}); "
        "choose another output path"
      )
  if p.is_dir():
    raise IsADirectoryError(f"--out {path} is a directory; give a file path like results.json")
  if os.path.lexists(p):
    if not overwrite:
      raise FileExistsError(f"--out {path} exists; pass --overwrite to replace it")
    try:
      with open(p, encoding="utf-8") as fh:
        data = json.load(fh)
      ok = isinstance(data, dict) and is_ours(data)
    except (OSError, ValueError):
      ok = False
    if not ok:
      raise FileExistsError(
        f"--out {path} exists and is not {what}; --overwrite replaces only that, so remove it "
        "yourself or choose another output path"
      )
  if not p.parent.is_dir():
    raise FileNotFoundError(f"--out {path}: directory {p.parent} does not exist")
  if not os.access(p.parent, os.W_OK):
    raise PermissionError(f"--out {path}: directory {p.parent} is not writable")
  return p
