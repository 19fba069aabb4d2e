"""Streaming text out of generated ids: incremental detokenization and stop strings.

``IncrementalDetokenizer`` emits text only once it is final: a byte-level BPE token can end in
the middle of a UTF-8 character (the decode then ends in U+FFFD) and a SentencePiece token
decodes differently with its left neighbour, so each step decodes a short window (the tokens
since the last emitted boundary, plus the window before it for context) and emits what the
longer decode adds. The concatenation of everything emitted equals the decode of all ids.

``StopMatcher`` holds back text that could be the start of a stop string, and cuts the stream
before the first stop string to complete (which is not emitted), as OpenAI's ``stop`` does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5  # prompt tokens decoded with the first generated ones (leading spaces)


class IncrementalDetokenizer:
  """Token ids in, final text out (see the module docstring).

  ``context``: ids that precede the generated ones (the prompt's tail); they shape how the
  first generated tokens decode but are not emitted.
  """

  def __init__(self, tokenizer, context: Sequence[int] = (), skip_special_tokens: bool = True):
    self.tok = tokenizer
    self.skip = skip_special_tokens
    self.ids: list[int] = list(context[-CONTEXT_TOKENS:]) if context else []
    self.prefix = 0  # start of the decode window
    self.read = len(self.ids)  # end of the text already emitted
    # a context that does not decode cleanly cannot anchor the window: start after it
    if self.ids and self._decode(self.ids).endswith(REPLACEMENT):
      self.ids, self.read = [], 0

  def _decode(self, ids) -> str:
    return self.tok.decode(ids, skip_special_tokens=self.skip)

  def push(self, token_id: int) -> str:
    """Add one id; returns the text that became final (often '', never a partial character)."""
    self.ids.append(int(token_id))
    return self._emit(final=False)

  def flush(self) -> str:
    """The text still held back (an incomplete character at the end decodes as U+FFFD)."""
    return self._emit(final=True)

  def _emit(self, final: bool) -> str:
    before = self._decode(self.ids[self.prefix : self.read])
    now = self._decode(self.ids[self.prefix :])
    if len(now) > len(before) and (final or not now.endswith(REPLACEMENT)):
      out = now[len(before) :]
      self.prefix, self.read = self.read, len(self.ids)
      return out
    return ""


class StopMatcher:
  """Cuts a text stream before the first of ``stops``; holds back possible stop prefixes."""

  def __init__(self, stops: Iterable[str] = ()):
    self.stops = tuple(s for s in stops if s)
    self.buf = ""
    self.stopped = False

  def push(self, text: str) -> str:
    """Text safe to emit now; after a stop string, sets ``stopped`` and emits nothing more."""
    if self.stopped:
      return ""
    if not self.stops:
      return text
    self.buf += text
    # the stop that completes first wins (the longest of those ending there), however the text
    # was cut into pieces
    hits = [(i + len(s), i) for s, i in ((s, self.buf.find(s)) for s in self.stops) if i >= 0]
    if hits:
      out, self.buf, self.stopped = self.buf[: min(hits)[1]], "", True
      return out
    hold = 0
    for s in self.stops:
      for k in range(min(len(s) - 1, len(self.buf)), hold, -1):
        if self.buf.endswith(s[:k]):
          hold = k
          break
    out = self.buf[: len(self.buf) - hold]
    self.buf = self.buf[len(self.buf) - hold :]
    return out

  def flush(self) -> str:
    out, self.buf = ("" if self.stopped else self.buf), ""
    return out


class TextStream:
  """One request's generated ids → text deltas, stopping at eos ids and stop strings.

  ``push(id)`` returns the new text; ``done`` turns true at an eos id (whose text is not
  emitted) or a stop string. ``finish()`` returns the text held back at the end.
  """

  def __init__(
    self,
    tokenizer,
    prompt: Sequence[int] = (),
    stop: Iterable[str] = (),
    eos_ids: Iterable[int] = (),
    skip_special_tokens: bool = True,
  ):
    self.detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
    self.stops = StopMatcher(stop)
    self.eos = frozenset(eos_ids)
    self.done = False
    self.reason: str | None = None  # "eos" | "stop_string"
    self.tokens = 0  # ids consumed, the eos id included

  def push(self, token_id: int) -> str:
    if self.done:
      return ""
    self.tokens += 1
    if int(token_id) in self.eos:
      self.done, self.reason = True, "eos"
      return self._end()
    out = self.stops.push(self.detok.push(token_id))
    if self.stops.stopped:
      self.done, self.reason = True, "stop_string"
    return out

  def _end(self) -> str:
    return self.stops.push(self.detok.flush()) + self.stops.flush()

  def finish(self) -> str:
    """Text left at the end of generation (nothing after a stop)."""
    if self.reason == "stop_string" or self.reason == "eos":
      return ""
    self.done = True
    return self._end()
