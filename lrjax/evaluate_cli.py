"""``lrjax eval``: perplexity and nats per token of checkpoints on a text file, side by side.

The scoring is :mod:`lrjax.evaluate`'s; this module only registers the subcommand (and imports
nothing heavy until it runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import os
import sys
from pathlib import Path

from lrjax.cli import subcommand
from lrjax.files import one_line

DEFAULT_SEQ_LEN = 2048  # lrjax.evaluate.DEFAULT_SEQ_LEN


@dataclasses.dataclass(frozen=True)
class Source:
  kind: str  # "ckpt" or "hf"
  path: str  # as the user gave it
  resolved: Path


class _AddSource(argparse.Action):
  def __call__(self, parser, ns, value, option_string=None):
    models = getattr(ns, "models", None) or []
    models.append((self.const, value))
    ns.models = models


def _load(src: Source, dtype, verify: bool):
  """(model, metadata or None) of one source."""
  from lrjax import checkpoint

  if src.kind == "hf":
    return checkpoint.load_hf(src.resolved, dtype=dtype, verify=verify), None
  return checkpoint.load(src.resolved, verify=verify), checkpoint.read_metadata(src.resolved)


# ---- the subcommand ---------------------------------------------------------------------------
@subcommand("eval", help="perplexity and nats/token of checkpoints on a text file")
def eval_command(p: argparse.ArgumentParser):
  p.add_argument(
    "--ckpt",
    metavar="DIR",
    action=_AddSource,
    const="ckpt",
    help="lrjax checkpoint (repeat to compare several, e.g. ratios or W4A8)",
  )
  p.add_argument(
    "--hf", metavar="DIR", action=_AddSource, const="hf", help="HF directory (repeatable)"
  )
  p.add_argument("--text", metavar="FILE", required=True, help="UTF-8 text file to score")
  p.add_argument(
    "--seq-len",
    type=int,
    default=None,
    help=f"tokens per window (default: min(max_position_embeddings, {DEFAULT_SEQ_LEN}))",
  )
  p.add_argument(
    "--stride", type=int, default=None, help="window start step, <= seq-len (default seq-len/2)"
  )
  p.add_argument("--batch", type=int, default=1, help="windows per forward")
  p.add_argument(
    "--tokenizer",
    metavar="DIR",
    help="directory with tokenizer.json (default: each model's own)",
  )
  p.add_argument(
    "--dtype",
    choices=("float32", "bfloat16", "float16"),
    help="param dtype for --hf models (default: the checkpoint's); lrjax checkpoints keep theirs",
  )
  p.add_argument("--fuse", action="store_true", help="run the forward through lrjax.fuse")
  p.add_argument("--out", metavar="FILE", help="write the results as JSON")
  p.add_argument(
    "--overwrite", action="store_true", help="replace --out if it holds an earlier eval result"
  )
  p.add_argument(
    "--no-verify", action="store_true", help="skip the sha256 check of checkpoint arrays"
  )
  p.set_defaults(models=None)
  return _run


def _check(a) -> tuple[list[Source], Path, Path | None, Path | None]:
  from lrjax import evaluate as ev
  from lrjax.checkpoint import read_checkpoint_arg, resolve

  models = getattr(a, "models", None) or []
  if not models:
    raise ValueError("give at least one model: --ckpt DIR or --hf DIR (repeatable)")
  for name in ("seq_len", "stride"):
    v = getattr(a, name)
    if v is not None and v < (2 if name == "seq_len" else 1):
      raise ValueError(f"--{name.replace('_', '-')} {v} must be >= {2 if name == 'seq_len' else 1}")
  if a.seq_len and a.stride and a.stride > a.seq_len:
    raise ValueError(
      f"--stride {a.stride} > --seq-len {a.seq_len} would skip tokens; use stride <= seq-len"
    )
  if a.batch < 1:
    raise ValueError(f"--batch {a.batch} must be >= 1")
  sources = []
  for kind, path in models:
    r = resolve(path, f"--{kind}")
    if kind == "ckpt":
      read_checkpoint_arg(path, hf_fix=f"pass it as --hf {path}")
    elif not r.is_dir():
      raise FileNotFoundError(f"--{kind} {path}: no such directory")
    elif not (r / "config.json").is_file():
      raise FileNotFoundError(f"--hf {path}: no config.json (expected an HF model directory)")
    sources.append(Source(kind, path, r))
  text = resolve(a.text, "--text")
  if not text.is_file():
    raise FileNotFoundError(f"--text {a.text}: no such file")
  tok = None
  if a.tokenizer:
    tok = resolve(a.tokenizer, "--tokenizer")
    if not (tok / "tokenizer.json").is_file():
      raise FileNotFoundError(f"--tokenizer {a.tokenizer}: no tokenizer.json there")
  elif not any((s.resolved / "tokenizer.json").is_file() for s in sources):
    raise FileNotFoundError(
      "no model directory has a tokenizer.json; pass --tokenizer DIR (the source HF directory)"
    )
  inputs = [s.resolved for s in sources] + [text] + ([tok] if tok else [])
  out = ev.check_out(a.out, a.overwrite, inputs) if a.out else None
  return sources, text, tok, out


def _run(a) -> int:
  import numpy as np

  from lrjax import evaluate as ev

  try:
    sources, text_path, tok_dir, out = _check(a)
    text = ev.read_text(text_path)
    # one tokenization per tokenizer; every model must see the same ids
    encoded: dict[Path, list[int]] = {}
    for d in [tok_dir] if tok_dir else [s.resolved for s in sources]:
      enc = ev.tokenizer_encoder(d)
      if enc is not None:
        encoded[d] = enc(text)
    (first_dir, ids), *others = encoded.items()
    for d, other in others:
      if other != ids:
        raise ValueError(
          f"{first_dir} and {d} tokenize the text differently; compare models of one "
          "tokenizer, or pass --tokenizer DIR to use one for all"
        )
  except (ValueError, OSError) as e:
    print(f"lrjax eval: error: {one_line(e, limit=500)}", file=sys.stderr)
    return 2
  ids = np.asarray(ids, np.int64)
  print(f"{text_path.name}: {len(text)} characters, {len(ids)} tokens ({first_dir})")
  rows = []
  for src in sources:
    try:
      model, meta = _load(src, a.dtype, not a.no_verify)
      seq_len = a.seq_len or min(model.cfg.max_position_embeddings, DEFAULT_SEQ_LEN)
      if seq_len > model.cfg.max_position_embeddings:
        raise ValueError(
          f"--seq-len {seq_len} exceeds {src.path}'s max_position_embeddings "
          f"{model.cfg.max_position_embeddings}; use a --seq-len at most that"
        )
      stride = a.stride or max(1, seq_len // 2)
      s = ev.score(
        model, ids, seq_len=seq_len, stride=stride, batch=a.batch, fuse=a.fuse, progress=True,
        desc=os.path.basename(os.path.normpath(src.path)) or src.path,
      )  # fmt: skip
    except (ValueError, OSError) as e:
      print(f"lrjax eval: error: {src.path}: {one_line(e, limit=500)}", file=sys.stderr)
      return 2
    desc = ev.describe(model, meta)
    del model
    rows.append(
      {
        "source": src.path,
        "path": os.fspath(src.resolved),
        "kind": src.kind,
        "label": ev.label(desc),
        **desc,
        "seq_len": seq_len,
        "stride": stride,
        "windows": s.windows,
        "scored_tokens": s.scored,
        "nll_sum": s.nll_sum,
        "nats_per_token": s.nats_per_token,
        "perplexity": s.perplexity,
        "seconds": round(s.seconds, 3),
      }
    )
  print(ev.table(rows))
  if out is not None:
    import jax

    import lrjax

    ev.write_json(
      out,
      {
        "format": ev.EVAL_FORMAT,
        "format_version": ev.EVAL_VERSION,
        "text": {
          "path": os.fspath(text_path),
          "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
          "characters": len(text),
        },
        "tokenizer": os.fspath(first_dir),
        "tokens": len(ids),
        "scoring": "strided sliding window: windows of seq_len tokens every stride tokens; "
        "each scores the tokens the previous did not reach; token 0 is not scored",
        "fuse": bool(a.fuse),
        "lrjax_version": lrjax.__version__,
        "jax_version": jax.__version__,
        "device": str(jax.devices()[0].device_kind),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "results": rows,
      },
    )
    print(f"wrote {a.out}")
  return 0
