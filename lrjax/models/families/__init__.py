"""Model-family registry: HF ``model_type`` → :class:`Family`.

To add a family: write ``families/<name>.py`` defining one ``Family`` (see ``base.py`` and
``qwen3.py``), then add its line below. The checkpoint loader and exporter need no edits.
"""

from lrjax.models.families.base import Family
from lrjax.models.families.llama import LLAMA
from lrjax.models.families.mistral import MISTRAL
from lrjax.models.families.qwen2 import QWEN2
from lrjax.models.families.qwen3 import QWEN3

FAMILIES: dict[str, Family] = {
  f.model_type: f
  for f in (
    LLAMA,
    MISTRAL,
    QWEN2,
    QWEN3,
  )
}


def get_family(model_type: str) -> Family:
  """The registered family of HF ``model_type`` (``ValueError`` listing the supported ones)."""
  fam = FAMILIES.get(model_type) if isinstance(model_type, str) else None
  if fam is None:
    raise ValueError(
      f"model_type={model_type!r} is not supported; lrjax supports model_type in "
      f"{tuple(FAMILIES)} (to add one, see lrjax/models/families/__init__.py)"
    )
  return fam


__all__ = ["FAMILIES", "Family", "get_family"]
