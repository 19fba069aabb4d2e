"""Perplexity and nats per token of a model on a text (``lrjax eval``, :mod:`lrjax.evaluate_cli`).

Scoring is the strided sliding window of transformers' perplexity guide, with every token
counted at most once. Windows of ``seq_len`` tokens start every ``stride`` tokens; a window
scores only the tokens the previous window did not reach, so each scored token sees at least
``seq_len - stride`` tokens of context (fewer only near the start of the text)::

  windows = strided_windows(n_tokens, seq_len=1024, stride=512)
  res = score(model, ids, seq_len=1024, stride=512)   # res.nats_per_token, res.perplexity

Token 0 has no context and is never scored, so with ``stride < seq_len`` the other
``n_tokens - 1`` tokens are. With ``stride == seq_len`` (windows that do not overlap) the first
token of every window has no context either and is not scored. Windows are padded
to one length (causal attention: padding after a position does not change its logits) and run
``batch`` at a time through one jitted forward; the negative log-likelihoods are summed in
float64 on the host.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from lrjax.files import check_out as check_out_file
from lrjax.files import one_line

log = logging.getLogger("lrjax.evaluate")

EVAL_FORMAT = "lrjax-eval"
EVAL_VERSION = 1
DEFAULT_SEQ_LEN = 2048


@dataclasses.dataclass(frozen=True)
class Window:
  """Tokens ``[begin, end)`` go in; tokens ``[first, end)`` are scored (``first > begin``)."""

  begin: int
  end: int
  first: int


def strided_windows(n_tokens: int, seq_len: int, stride: int) -> list[Window]:
  """The windows that score each token at most once: every token but the first when
  ``stride < seq_len`` (see the module docstring)."""
  for name, v in (("n_tokens", n_tokens), ("seq_len", seq_len), ("stride", stride)):
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      raise ValueError(f"{name}={v!r} must be a positive int")
  if n_tokens < 2:
    raise ValueError(f"{n_tokens=}: scoring needs at least 2 tokens (one to predict from)")
  if seq_len < 2:
    raise ValueError(f"{seq_len=} must be >= 2 (a window predicts from at least one token)")
  if stride > seq_len:
    raise ValueError(
      f"{stride=} > {seq_len=} would skip tokens between windows; use stride <= seq_len "
      "(seq_len // 2 is usual)"
    )
  out, prev_end = [], 0
  for begin in range(0, n_tokens, stride):
    end = min(begin + seq_len, n_tokens)
    first = max(prev_end, begin + 1)
    if first < end:
      out.append(Window(begin, end, first))
    prev_end = end
    if end == n_tokens:
      break
  return out


@dataclasses.dataclass(frozen=True)
class Score:
  """Negative log-likelihood (nats) of a text under one model."""

  nll_sum: float
  scored: int
  windows: int
  seconds: float

  @property
  def nats_per_token(self) -> float:
    return self.nll_sum / self.scored

  @property
  def perplexity(self) -> float:
    return math.exp(self.nats_per_token)


def _batches(ids: np.ndarray, windows: Sequence[Window], length: int, batch: int):
  """[batch, length] inputs, next-token targets and 0/1 weights, padded with empty rows."""
  for i in range(0, len(windows), batch):
    group = windows[i : i + batch]
    tok = np.zeros((batch, length), np.int32)
    tgt = np.zeros((batch, length), np.int32)
    w = np.zeros((batch, length), np.float32)
    for row, win in enumerate(group):
      n = win.end - win.begin
      tok[row, :n] = ids[win.begin : win.end]
      tgt[row, : n - 1] = ids[win.begin + 1 : win.end]
      # position j predicts token begin + j + 1
      w[row, win.first - win.begin - 1 : n - 1] = 1.0
    yield len(group), tok, tgt, w


def _nll_fn(fuse: bool):
  import jax
  import jax.numpy as jnp
  from flax import nnx

  @nnx.jit
  def nll(model, tokens, targets, weights):
    if fuse:
      import lrjax

      logits = lrjax.fuse(model)(tokens)
    else:
      logits = model(tokens)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    ll = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return -(ll * weights).sum(axis=-1)  # [batch]

  return nll


def score(
  model,
  ids: Sequence[int] | np.ndarray,
  *,
  seq_len: int,
  stride: int,
  batch: int = 1,
  fuse: bool = False,
  progress: bool = False,
  desc: str = "eval",
) -> Score:
  """Strided sliding-window negative log-likelihood of token ``ids`` under ``model`` (any
  ``model(tokens [B, S]) -> logits [B, S, vocab]``, e.g. an lrjax checkpoint as
  :func:`lrjax.checkpoint.load` returns it). ``fuse`` runs the forward through
  :func:`lrjax.fuse`."""
  from tqdm.auto import tqdm

  ids = np.asarray(ids)
  if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"ids {ids.dtype}{ids.shape} must be a 1-D sequence of integer token ids")
  if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
    raise ValueError(f"{batch=} must be a positive int")
  vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)
  if vocab is not None and len(ids) and (ids.min() < 0 or ids.max() >= vocab):
    raise ValueError(
      f"token ids span [{ids.min()}, {ids.max()}] but the model's vocab_size is {vocab}; "
      "tokenize with the model's own tokenizer"
    )
  windows = strided_windows(len(ids), seq_len, stride)
  length = max(w.end - w.begin for w in windows)
  nll = _nll_fn(fuse)
  total, t0 = 0.0, time.perf_counter()
  with tqdm(total=len(windows), desc=desc, unit="window", disable=not progress) as bar:
    for n, tok, tgt, w in _batches(ids, windows, length, min(batch, len(windows))):
      out = np.asarray(nll(model, tok, tgt, w), np.float64)
      total += float(out[:n].sum())
      bar.update(n)
  scored = sum(w.end - w.first for w in windows)
  return Score(total, scored, len(windows), time.perf_counter() - t0)


# ---- tokenizer --------------------------------------------------------------------------------
def tokenizer_encoder(path: str | os.PathLike) -> Callable[[str], list[int]] | None:
  """``encode(text) -> ids`` (with the special tokens the model expects, e.g. BOS) of model
  directory ``path``, or None when it has no ``tokenizer.json``.

  Uses :class:`lrjax.text.Tokenizer` where lrjax.text is installed, else the ``tokenizers``
  library on ``tokenizer.json`` directly (its post-processor adds the special tokens).
  """
  path = os.fspath(path)
  tj = os.path.join(path, "tokenizer.json")
  if not os.path.isfile(tj):
    return None
  try:
    from lrjax.text import Tokenizer
  except ImportError:
    Tokenizer = None
  if Tokenizer is not None:
    tok = Tokenizer.from_dir(path)
    return lambda text: list(tok.encode(text))
  from tokenizers import Tokenizer as Backend

  try:
    backend = Backend.from_file(tj)
  except Exception as e:  # the Rust library raises its own exception type
    raise ValueError(f"{tj}: not a tokenizers file ({one_line(e, limit=500)})") from None
  return lambda text: list(backend.encode(text).ids)


def read_text(path: str | os.PathLike) -> str:
  try:
    with open(path, encoding="utf-8") as fh:
      text = fh.read()
  except UnicodeDecodeError as e:
    raise ValueError(f"--text {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
  if not text.strip():
    raise ValueError(f"--text {path}: the file is empty; give a text to score")
  return text


# ---- models -----------------------------------------------------------------------------------
def describe(model, meta: dict | None) -> dict:
  """Size and compression of a loaded model; ``meta`` is an lrjax checkpoint's metadata (its
  ranks and ``quantization`` record), None for an HF directory."""
  from flax import nnx

  leaves = [v for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
  ranks = meta.get("ranks") if meta else model.layer_ranks()
  comp = getattr(model, "compression", None)
  quant = meta.get("quantization") if meta else None
  return {
    "params": int(sum(int(np.prod(v.shape)) for v in leaves)),
    "weight_bytes": int(sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in leaves)),
    "dtypes": sorted({np.dtype(v.dtype).name for v in leaves}),
    "low_rank_projections": int(sum(len(r) for r in ranks or [])),
    "compression": dict(comp) if comp else None,
    "quantization": quant if isinstance(quant, dict) else None,
  }


def label(desc: dict) -> str:
  """A short description of a :func:`describe` record: dense / low-rank ratio, W4A8, dtypes."""
  comp = desc.get("compression") or {}
  parts = []
  if desc["low_rank_projections"]:
    r = comp.get("ratio")
    parts.append(f"low-rank {comp.get('method', '')} ratio {r}".replace("  ", " "))
  else:
    parts.append("dense")
  if desc.get("quantization"):
    q = desc["quantization"]
    groups = q.get("groups")
    parts.append(str(q.get("scheme", "quantized")) + (f" group {groups[0]}" if groups else ""))
  return ", ".join(parts) + " " + "/".join(desc["dtypes"])


# ---- JSON output ------------------------------------------------------------------------------
def check_out(path: str, overwrite: bool, inputs: Sequence[Path]) -> Path:
  """The resolved ``--out`` file (:func:`lrjax.files.check_out`), replaceable only when it
  holds an earlier eval result."""
  return check_out_file(
    path, overwrite, inputs, "an lrjax eval result", lambda d: d.get("format") == EVAL_FORMAT
  )


def write_json(p: Path, obj: dict) -> None:
  """Write ``obj`` to ``p`` through a temp file beside it and one rename (never half-written)."""
  tmp = p.parent / f".{p.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
  try:
    with open(tmp, "w", encoding="utf-8") as fh:
      json.dump(obj, fh, indent=1)
      fh.write("\n")
      fh.flush()
      os.fsync(fh.fileno())
    os.replace(tmp, p)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise


def _count(n: int) -> str:
  for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
    if n >= div:
      return f"{n / div:.3g}{unit}"
  return str(n)


def table(rows: list[dict]) -> str:
  """The results as a text table, with each row's nats/token against the first row's."""
  base = rows[0]["nats_per_token"]
  head = ("model", "weights", "params", "MiB", "nats/token", "Δ nats", "perplexity")
  body = [
    (
      r["source"],
      r["label"],
      _count(r["params"]),
      f"{r['weight_bytes'] / 2**20:.3g}",
      f"{r['nats_per_token']:.5f}",
      f"{r['nats_per_token'] - base:+.5f}",
      f"{r['perplexity']:.4f}",
    )
    for r in rows
  ]
  widths = [max(len(x[i]) for x in (head, *body)) for i in range(len(head))]
  fmt = lambda row: "  ".join(  # noqa: E731
    c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
  )
  return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, body)])
