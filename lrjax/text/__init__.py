"""lrjax.text: a model directory's tokenizer, chat template and generation settings.

  tok, gen = lrjax.text.load_text("ckpt_or_hf_dir")   # tok is None without a tokenizer.json
  ids = tok.encode_chat([{"role": "user", "content": "Hello"}])
  stream = TextStream(tok, ids, stop=["\\n\\n"], eos_ids=gen.eos_ids)

``lrjax convert`` copies the files of :data:`TEXT_FILES` into the checkpoint it writes, so a
converted checkpoint serves text on its own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator

from lrjax.text.calib import calib_tokens_from_text
from lrjax.text.chat import TemplateError, render
from lrjax.text.generation import GENERATION_CONFIG, HF_CONFIG, GenerationDefaults
from lrjax.text.stream import IncrementalDetokenizer, StopMatcher, TextStream
from lrjax.text.tokenizer import Tokenizer, read_json

log = logging.getLogger("lrjax.text")

TEXT_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "chat_template.jinja",
  "chat_template.json",
  GENERATION_CONFIG,
  # not read here; carried so that an export of the checkpoint has the source's complete set
  "tokenizer.model",
  "vocab.json",
  "merges.txt",
  "added_tokens.json",
)

_warned: set[str] = set()


def load_text(path: str | os.PathLike) -> tuple[Tokenizer | None, GenerationDefaults]:
  """The tokenizer (None without ``tokenizer.json``, logged once per directory) and the
  generation defaults of a model directory (HF or lrjax checkpoint)."""
  path = os.fspath(path)
  tok = Tokenizer.from_dir(path)
  if tok is None and os.path.abspath(path) not in _warned:
    _warned.add(os.path.abspath(path))
    log.warning(
      "%s has no tokenizer.json: prompts and outputs are token ids only (convert from an HF "
      "directory that has one to serve text)",
      path,
    )
  extra = () if tok is None or tok.eos_id is None else (tok.eos_id,)
  return tok, GenerationDefaults.from_dir(path, extra_eos=extra)


def calib_tokens_for(src: str | os.PathLike, paths, seq_len: int, ids=None, progress: bool = True):
  """``lrjax convert --calib-text``: the files tokenized with ``src``'s tokenizer and packed
  into [n, seq_len] windows (see :func:`calib_tokens_from_text`). ``ids``: calibration ids
  also given (refused: one source of calibration at a time)."""
  if ids is not None:
    raise ValueError("give calibration as --calib (token ids) or --calib-text, not both")
  tok = Tokenizer.from_dir(src)
  return calib_tokens_from_text(paths, tok, seq_len, progress=progress)


@contextlib.contextmanager
def carried_files(src: str | os.PathLike) -> Iterator[list[str]]:
  """The text files of model directory ``src`` for ``checkpoint.save(extra_files=...)``.

  When ``src`` has no generation_config.json but its config.json names eos/bos ids, a
  generation_config.json holding them is written to a temporary directory (alive inside the
  ``with``) and carried instead, so the checkpoint still stops at the model's eos.
  """
  src = os.fspath(src)
  files = [os.path.join(src, f) for f in TEXT_FILES if os.path.isfile(os.path.join(src, f))]
  hf = os.path.join(src, HF_CONFIG)
  with tempfile.TemporaryDirectory(prefix="lrjax-text-") as tmp:
    if not os.path.isfile(os.path.join(src, GENERATION_CONFIG)) and os.path.isfile(hf):
      cfg = read_json(hf)
      ids = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg.get(k) is not None}
      if ids:
        gp = os.path.join(tmp, GENERATION_CONFIG)
        with open(gp, "w") as fh:
          json.dump(ids, fh)
        files.append(gp)
    yield files


__all__ = [
  "GenerationDefaults",
  "IncrementalDetokenizer",
  "StopMatcher",
  "TEXT_FILES",
  "TemplateError",
  "TextStream",
  "Tokenizer",
  "calib_tokens_for",
  "calib_tokens_from_text",
  "carried_files",
  "load_text",
  "render",
]
