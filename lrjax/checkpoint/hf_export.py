"""What the two export formats add to an HF directory: the low-rank model's remote-code files
and config keys (``hf-lowrank``), U·V merged back into dense weights (``hf-dense``), and the
tokenizer and generation files copied from the source.

- ``hf-lowrank``: ``config.json`` names a model type of its own (``lrjax_lowrank_<type>``,
  architecture ``LowRank<Family>ForCausalLM``) with an ``auto_map`` to the shipped
  ``modeling_lrjax_lowrank.py`` (:mod:`lrjax.checkpoint.remote_modeling` plus the family's two
  classes), so transformers loads it with ``trust_remote_code=True`` and refuses it without,
  instead of building a plain model with random projections. A model with no low-rank
  projection is written in its plain architecture.
- ``hf-dense``: every low-rank projection becomes one dense weight, U·V computed in float32 and
  cast to the stored dtype; the plain architecture, loadable by transformers with no remote code.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from lrjax.files import one_line
from lrjax.models.families import Family
from lrjax.text import TEXT_FILES  # what an export carries from its source, when present

FORMATS = ("hf-lowrank", "hf-dense")
DEFAULT_FORMAT = "hf-lowrank"
MODELING_FILE = "modeling_lrjax_lowrank.py"
MODEL_TYPE_PREFIX = "lrjax_lowrank_"

_CAUSAL_LM = "ForCausalLM"
# files an export writes itself (with its *.safetensors)
_EXPORT_OWN = frozenset(
  {"config.json", "lrjax_export.json", "model.safetensors.index.json", MODELING_FILE}
)

# The family's classes, appended to remote_modeling.py's text in the exported modeling file.
_FAMILY_CLASSES = '''

# ---- the {prefix} family (written by lrjax export) --------------------------------------------
from transformers import {prefix}Config, {prefix}ForCausalLM  # noqa: E402


class LowRank{prefix}Config({prefix}Config):
  """{prefix} config of a low-rank model (ranks in ``lrjax_lowrank``)."""

  model_type = "{model_type}"


class LowRank{prefix}ForCausalLM({prefix}ForCausalLM):
  """transformers' {prefix}ForCausalLM with its low-rank projections as two linears each."""

  config_class = LowRank{prefix}Config

  def __init__(self, config):
    super().__init__(config)
    make_low_rank(self, config)
'''


def check_format(fmt: str) -> str:
  if fmt not in FORMATS:
    raise ValueError(f"export format {fmt!r} is not one of {FORMATS}")
  return fmt


def family_prefix(fam: Family) -> str:
  """``Llama`` for ``LlamaForCausalLM``: the transformers class-name stem of a family."""
  arch = fam.architecture
  prefix = arch[: -len(_CAUSAL_LM)] if arch.endswith(_CAUSAL_LM) else ""
  if not prefix.isidentifier():
    raise ValueError(
      f"model_type={fam.model_type!r}: architecture {arch!r} is not a transformers "
      f"'<Name>{_CAUSAL_LM}' class, so no low-rank remote-code class can be built on it; "
      "export with format='hf-dense' (CLI: --format hf-dense)"
    )
  return prefix


def lowrank_model_type(fam: Family) -> str:
  return MODEL_TYPE_PREFIX + fam.model_type


def remote_config(cfg_json: dict, fam: Family) -> dict:
  """``cfg_json`` (the plain architecture's config.json) relabelled as the low-rank model."""
  prefix = family_prefix(fam)
  out = dict(cfg_json)
  out["architectures"] = [f"LowRank{prefix}{_CAUSAL_LM}"]
  out["model_type"] = lowrank_model_type(fam)
  stem = MODELING_FILE[: -len(".py")]
  out["auto_map"] = {
    "AutoConfig": f"{stem}.LowRank{prefix}Config",
    "AutoModelForCausalLM": f"{stem}.LowRank{prefix}{_CAUSAL_LM}",
  }
  return out


def modeling_source(fam: Family) -> str:
  """The text of the exported ``modeling_lrjax_lowrank.py`` for family ``fam``."""
  body = importlib.resources.files("lrjax.checkpoint").joinpath("remote_modeling.py").read_text()
  prefix = family_prefix(fam)
  return body + _FAMILY_CLASSES.format(prefix=prefix, model_type=lowrank_model_type(fam))


def plain_model_type(cfg_json: dict, lowrank: object, cfg_path: str) -> dict:
  """config.json of an ``hf-lowrank`` export with its base ``model_type`` back, for lrjax's
  own reader; other configs come back unchanged."""
  mt = cfg_json.get("model_type")
  if not (isinstance(mt, str) and mt.startswith(MODEL_TYPE_PREFIX)):
    return cfg_json
  base = mt[len(MODEL_TYPE_PREFIX) :]
  got = lowrank.get("base_model_type") if isinstance(lowrank, dict) else None
  if got != base:
    raise ValueError(
      f"{cfg_path}: model_type {mt!r} needs lrjax_lowrank.base_model_type={base!r}, got "
      f"{got!r}; config.json was edited: re-export the model"
    )
  return {**cfg_json, "model_type": base}


def merged_weight(u: np.ndarray, v: np.ndarray, dtype) -> np.ndarray:
  """HF-layout [out, in] weight of a low-rank projection: (u·v)ᵀ in float32, cast to ``dtype``.

  u [in, rank]; v [rank, out], or per head [heads, rank_per_head, head_dim] with u's columns
  grouped by head.
  """
  u32 = np.asarray(u, np.float32)
  v32 = np.asarray(v, np.float32)
  if v32.ndim == 3:
    h, r, d = v32.shape
    w = np.einsum("khr,hrd->khd", u32.reshape(u32.shape[0], h, r), v32).reshape(-1, h * d)
  else:
    w = u32 @ v32
  return np.ascontiguousarray(w.T).astype(dtype)


# ---- tokenizer and generation files --------------------------------------------------------------
def text_files(src: str | os.PathLike) -> list[Path]:
  """The :data:`TEXT_FILES` present in directory ``src`` (regular files, or links to them)."""
  src = Path(src)
  return [src / f for f in TEXT_FILES if (src / f).is_file()]


def check_text_files(files: Sequence[str | os.PathLike], vocab_size: int) -> list[Path]:
  """``files`` checked: existing regular files with distinct names, and a ``tokenizer.json``
  that parses and whose ids fit ``vocab_size``."""
  out, names = [], set()
  for f in files:
    p = Path(os.path.realpath(os.path.expanduser(os.fspath(f))))
    if not p.is_file():
      raise FileNotFoundError(f"tokenizer/generation file {f}: no such file")
    if p.name in names:
      raise ValueError(f"two tokenizer/generation files are named {p.name!r}; give one")
    if p.name in _EXPORT_OWN or p.name.endswith(".safetensors"):
      raise ValueError(f"{f}: an export writes its own {p.name}; it cannot be copied in")
    names.add(p.name)
    out.append(p)
  for p in out:
    if p.name == "tokenizer.json":
      n = _tokenizer_size(p)
      if n > vocab_size:
        raise ValueError(
          f"{p}: the tokenizer has {n} tokens but the model's vocab_size is {vocab_size}; "
          "give the tokenizer of the model the checkpoint came from (--tokenizer-from DIR)"
        )
  return out


def _tokenizer_size(path: Path) -> int:
  from tokenizers import Tokenizer

  try:
    tok = Tokenizer.from_file(os.fspath(path))
  except Exception as e:  # the Rust library raises its own exception type
    raise ValueError(f"{path}: not a tokenizers file ({one_line(e, limit=None)})") from None
  return tok.get_vocab_size(with_added_tokens=True)


def copy_text_files(files: Iterable[Path], dest: str | os.PathLike) -> dict[str, str]:
  """Copy ``files`` into ``dest``; returns {name: sha256 of the copy}."""
  sums = {}
  for p in files:
    target = os.path.join(dest, p.name)
    shutil.copyfile(p, target)
    h = hashlib.sha256()
    with open(target, "rb") as fh:
      while chunk := fh.read(1 << 20):
        h.update(chunk)
    sums[p.name] = h.hexdigest()
  return sums
