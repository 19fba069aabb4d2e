"""Calibration tokens from text files, tokenized with the model's tokenizer and packed.

A file ending in ``.jsonl`` holds one JSON object per line with a ``text`` field (one document
each); any other file is plain UTF-8 text, one document. Each document is encoded as the model
sees text at inference (with its BOS, if the tokenizer adds one), the documents are
concatenated, and the stream is cut into ``seq_len``-token windows (the remainder dropped).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence

import numpy as np

PIECE_CHARS = 1 << 20  # long plain-text documents are encoded in ~1M-character pieces


def _documents(path: str) -> Iterator[tuple[str, int]]:
  """(document text, bytes of the file it used) for each document of ``path``."""
  if path.endswith(".jsonl"):
    with open(path, encoding="utf-8") as fh:
      for n, line in enumerate(fh, 1):
        if not line.strip():
          yield "", len(line.encode("utf-8"))
          continue
        try:
          rec = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"{path}:{n}: not a JSON object ({e.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
          raise ValueError(f"{path}:{n}: expected an object with a string 'text' field")
        yield rec["text"], len(line.encode("utf-8"))
    return
  with open(path, encoding="utf-8") as fh:
    try:
      yield fh.read(), os.path.getsize(path)
    except UnicodeDecodeError as e:
      raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _encode_document(tokenizer, text: str) -> list[int]:
  if len(text) <= PIECE_CHARS:
    return tokenizer.encode(text)
  out: list[int] = []
  start = 0
  while start < len(text):  # cut after a newline where there is one, so words stay whole
    end = min(start + PIECE_CHARS, len(text))
    if end < len(text):
      nl = text.rfind("\n", start, end)
      end = nl + 1 if nl > start else end
    out += tokenizer.encode(text[start:end], add_special_tokens=start == 0)
    start = end
  return out


def calib_tokens_from_text(
  paths: Sequence[str | os.PathLike], tokenizer, seq_len: int, progress: bool = False
) -> np.ndarray:
  """Packed calibration windows [n, seq_len] int32 from text / jsonl files."""
  if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 2:
    raise ValueError(f"{seq_len=} must be an int >= 2 (tokens per calibration window)")
  if tokenizer is None:
    raise ValueError(
      "calibration text needs the model's tokenizer, and the source has no tokenizer.json; "
      "pass token ids with --calib instead"
    )
  paths = [os.fspath(p) for p in paths]
  for p in paths:
    if not os.path.isfile(p):
      raise FileNotFoundError(f"calibration text {p} does not exist")
  total = sum(os.path.getsize(p) for p in paths)
  bar = None
  if progress:
    from tqdm import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing calibration text")
  stream: list[int] = []
  docs = 0
  try:
    for p in paths:
      for text, nbytes in _documents(p):
        if text.strip():
          stream += _encode_document(tokenizer, text)
          docs += 1
        if bar is not None:
          bar.update(nbytes)
  finally:
    if bar is not None:
      bar.close()
  n = len(stream) // seq_len
  if n == 0:
    raise ValueError(
      f"calibration text {', '.join(paths)} has {len(stream)} tokens in {docs} documents, "
      f"fewer than one {seq_len}-token window; give more text or a smaller --calib-seq-len"
    )
  return np.asarray(stream[: n * seq_len], np.int32).reshape(n, seq_len)
