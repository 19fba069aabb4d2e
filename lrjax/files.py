"""Reading the user's files with errors that name the file: one-line messages, JSON objects."""

from __future__ import annotations

import json
import os


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
