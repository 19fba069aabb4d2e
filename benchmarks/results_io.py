"""The benchmark scripts' results files: written whole or not at all."""
import json
import os


def write_json(path: str, data) -> None:
  """``data`` to ``path`` (its folder made where missing) through a temporary file beside it,
  renamed over ``path`` once complete: a crash or a full disk never leaves a half-written
  results file, and the previous one stays until the new one is whole."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  try:
    with open(tmp, "w") as fh:
      json.dump(data, fh, indent=1)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
