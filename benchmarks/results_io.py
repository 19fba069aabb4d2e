"""The benchmark scripts' results files (written whole or not at all) and the cards' HBM
rooflines they state fractions of."""

import json
import math
import os

from lrjax.bench import HBM_BPS, hbm_bps  # the cards' HBM rates (DESIGN.md, "Measuring")


def roofline_bps(device_name: str) -> float:
  """:func:`hbm_bps`, or the H200's for a device not listed (a fraction still gets stated)."""
  return hbm_bps(device_name) or HBM_BPS["H200"]


def _strict(obj):
  """``obj`` with every non-finite float as None (JSON has no Infinity or NaN)."""
  if isinstance(obj, float):
    return obj if math.isfinite(obj) else None
  if isinstance(obj, dict):
    return {k: _strict(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [_strict(v) for v in obj]
  return obj


def write_json(path: str, data) -> None:
  """``data`` to ``path`` (its folder made where missing) through a temporary file beside it,
  renamed over ``path`` once complete: a crash or a full disk never leaves a half-written
  results file, and the previous one stays until the new one is whole. A non-finite number
  (the spread of a host timing that was all noise, say) is written as null, so the file is
  strict JSON that any reader parses."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  try:
    with open(tmp, "w") as fh:
      json.dump(_strict(data), fh, indent=1, allow_nan=False)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
