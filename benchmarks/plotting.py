"""matplotlib for the benchmark scripts' ``--plot`` (not an lrjax dependency)."""

import os


def pyplot():
  """matplotlib.pyplot on the Agg backend (no display needed)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt


def save_beside(fig, path_json: str) -> str:
  """Write ``fig`` next to the results file, as <name>.png; returns its path."""
  fig.tight_layout()
  out = os.path.splitext(path_json)[0] + ".png"
  fig.savefig(out, dpi=110)
  return out
