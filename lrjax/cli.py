"""The ``lrjax`` command line.

Subcommands register with :func:`subcommand`; a module that defines more of them (``generate``,
``serve``) is listed in ``EXTENSIONS`` and imported when the parser is built::

  @subcommand("serve", help="serve a checkpoint")
  def serve(p: argparse.ArgumentParser):
    p.add_argument("--ckpt", required=True)
    return lambda args: ...          # run(args) -> exit code (None means 0)
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable

# Modules that register further subcommands (skipped with a note if not importable).
EXTENSIONS: tuple[str, ...] = ("lrjax.serving.cli",)

Configure = Callable[[argparse.ArgumentParser], Callable[[argparse.Namespace], int | None]]
_COMMANDS: dict[str, tuple[str, Configure]] = {}


def subcommand(name: str, *, help: str):
  """Register ``configure(parser) -> run(args)`` as ``lrjax <name>``."""

  def deco(fn: Configure) -> Configure:
    if name in _COMMANDS:
      raise ValueError(f"subcommand {name!r} is registered twice")
    _COMMANDS[name] = (help, fn)
    return fn

  return deco


def _dtype(name: str):
  import jax.numpy as jnp

  table = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
  if name not in table:
    raise argparse.ArgumentTypeError(f"dtype {name!r}: expected one of {sorted(table)}")
  return table[name]


def load_tokens(path: str):
  """Calibration tokens [batch, seq] int from .npy (no pickle), .safetensors ("tokens"), or text
  (one sequence of whitespace-separated ids per line, all the same length)."""
  import numpy as np

  if path.endswith(".npy"):
    t = np.load(path, allow_pickle=False)
  elif path.endswith(".safetensors"):
    from safetensors.numpy import load_file

    d = load_file(path)
    if "tokens" not in d:
      raise ValueError(f"{path}: expected a tensor named 'tokens', found {sorted(d)}")
    t = d["tokens"]
  else:
    with open(path) as fh:
      rows = [[int(x) for x in line.split()] for line in fh if line.strip()]
    if len({len(r) for r in rows}) > 1:
      raise ValueError(
        f"{path}: lines have different lengths {sorted({len(r) for r in rows})}; "
        "every calibration sequence must have the same length"
      )
    t = np.asarray(rows)
  if t.ndim == 1:
    t = t[None]
  if t.ndim != 2 or not np.issubdtype(t.dtype, np.integer):
    raise ValueError(f"{path}: tokens {t.dtype}{t.shape} must be integers [batch, seq]")
  return t


@subcommand("convert", help="HF or dense orbax checkpoint → low-rank orbax checkpoint")
def convert(p: argparse.ArgumentParser):
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--hf", metavar="DIR", help="HF checkpoint dir (config.json + safetensors)")
  src.add_argument("--orbax", metavar="DIR", help="lrjax orbax checkpoint dir (dense)")
  p.add_argument("--out", metavar="DIR", required=True, help="output lrjax checkpoint dir")
  p.add_argument(
    "--ratio",
    type=float,
    required=True,
    help="fraction of each compressed projection's weight parameters removed",
  )
  p.add_argument("--method", choices=("whiten", "svd"), default="whiten")
  p.add_argument(
    "--calib",
    metavar="FILE",
    help="calibration tokens: .npy / .safetensors ('tokens') / text, [batch, seq]",
  )
  p.add_argument(
    "--calib-text",
    metavar="FILE",
    action="append",
    help="calibration text (plain, or .jsonl with a 'text' field; repeatable), tokenized with "
    "the source's tokenizer and packed into --calib-seq-len windows",
  )
  p.add_argument("--calib-seq-len", type=int, default=512, help="tokens per --calib-text window")
  p.add_argument("--lora-steps", type=int, default=0)
  p.add_argument("--lora-rank", type=int, default=8)
  p.add_argument("--lora-lr", type=float, default=1e-3)
  p.add_argument(
    "--lora-tokens",
    metavar="FILE",
    help="LoRA training tokens (same formats as --calib; default: the calibration "
    "tokens, which overfit when there are few sequences)",
  )
  p.add_argument("--lora-batch", type=int, default=8, help="sequences per LoRA step")
  p.add_argument("--mlp-only", action="store_true", help="compress gate/up/down only")
  p.add_argument("--per-head", action="store_true", help="factorise q/k/v per (kv) head")
  p.add_argument("--block", type=int, default=128, help="ranks are multiples of this")
  p.add_argument(
    "--dtype", type=_dtype, default=None, help="param dtype (default: the checkpoint's)"
  )
  p.add_argument("--overwrite", action="store_true")
  p.add_argument(
    "--verify",
    action="store_true",
    help="reload the output and check it equals the compressed model bit for bit",
  )

  def run(a):
    from lrjax import checkpoint

    try:
      from lrjax.compress import compress
    except ImportError as e:
      print(f"lrjax convert: lrjax.compress is not available ({e})", file=sys.stderr)
      return 2
    if a.out and os.path.exists(a.out) and not a.overwrite:
      print(f"lrjax convert: {a.out} exists; pass --overwrite to replace it", file=sys.stderr)
      return 2
    if a.orbax and a.dtype is not None:
      print("lrjax convert: --dtype applies to --hf sources only", file=sys.stderr)
      return 2
    calib = load_tokens(a.calib) if a.calib else None
    if a.calib_text:
      from lrjax import text

      calib = text.calib_tokens_for(a.hf or a.orbax, a.calib_text, a.calib_seq_len, ids=calib)
    lora_tokens = load_tokens(a.lora_tokens) if a.lora_tokens else None
    if a.hf:
      print(f"loading HF checkpoint {a.hf}")
      model = checkpoint.load_hf(a.hf, dtype=a.dtype, progress=True)
    else:
      print(f"loading orbax checkpoint {a.orbax}")
      model = checkpoint.load(a.orbax)
    model = compress(
      model,
      ratio=a.ratio,
      calib_tokens=calib,
      method=a.method,
      block=a.block,
      mlp_only=a.mlp_only,
      per_head=a.per_head,
      lora_steps=a.lora_steps,
      lora_rank=a.lora_rank,
      lora_lr=a.lora_lr,
      lora_tokens=lora_tokens,
      lora_batch=a.lora_batch,
      progress=True,
    )
    rec = dict(model.compression or {})
    rec["source"] = os.path.abspath(a.hf or a.orbax)
    model.compression = rec
    from lrjax.text import carried_files

    with carried_files(a.hf or a.orbax) as extra:  # tokenizer, chat template, generation config
      checkpoint.save(model, a.out, overwrite=a.overwrite, extra_files=extra)
    params = rec.get("params", {})
    print(
      f"wrote {a.out}: method={a.method} ratio={a.ratio} ranks={model.layer_ranks()[0]}"
      f" (layer 0) weights {params.get('dense')} → {params.get('compressed')}"
    )
    if a.verify:
      _verify(model, checkpoint.load(a.out))
      print("verified: reloaded checkpoint equals the compressed model bit for bit")
    return 0

  return run


def _verify(a, b):
  import jax
  import numpy as np
  from flax import nnx

  fa, fb = nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b))
  da, db = dict(fa), dict(fb)
  if set(da) != set(db):
    raise SystemExit(f"verify failed: param sets differ ({sorted(set(da) ^ set(db))[:3]})")
  for k in da:
    x, y = np.asarray(jax.device_get(da[k][...])), np.asarray(jax.device_get(db[k][...]))
    if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
      raise SystemExit(f"verify failed: param {'.'.join(map(str, k))} differs after reload")


@subcommand("export", help="lrjax checkpoint → HF-style safetensors (u/v tensors for low rank)")
def export(p: argparse.ArgumentParser):
  p.add_argument("--ckpt", metavar="DIR", required=True, help="lrjax orbax checkpoint dir")
  p.add_argument("--out", metavar="DIR", required=True, help="output HF-style dir")
  p.add_argument("--max-shard-gb", type=float, default=4.0)
  p.add_argument("--overwrite", action="store_true")

  def run(a):
    from lrjax import checkpoint

    model = checkpoint.load(a.ckpt)
    checkpoint.export_hf(
      model,
      a.out,
      max_shard_bytes=int(a.max_shard_gb * 2**30),
      overwrite=a.overwrite,
      progress=True,
    )
    print(f"wrote {a.out} (ranks per layer: {json.dumps(model.layer_ranks())})")
    return 0

  return run


def build_parser() -> argparse.ArgumentParser:
  for mod in EXTENSIONS:
    try:
      importlib.import_module(mod)
    except ImportError as e:
      logging.getLogger("lrjax.cli").debug("subcommand module %s not loaded: %s", mod, e)
  ap = argparse.ArgumentParser(prog="lrjax", description="lrjax: low-rank LLMs on JAX/XLA")
  ap.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
  sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
  for name, (help_, configure) in sorted(_COMMANDS.items()):
    sp = sub.add_parser(name, help=help_, description=help_)
    sp.set_defaults(_run=configure(sp))
  return ap


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  logging.basicConfig(
    level=logging.INFO if args.verbose else logging.WARNING,
    format="%(levelname)s %(name)s: %(message)s",
  )
  try:
    return int(args._run(args) or 0)
  except (ValueError, FileNotFoundError, FileExistsError, TypeError) as e:
    print(f"lrjax {args.command}: error: {e}", file=sys.stderr)
    return 1


if __name__ == "__main__":
  sys.exit(main())
