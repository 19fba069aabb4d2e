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
import contextlib
import importlib
import json
import logging
import math
import os
import sys
from collections.abc import Callable

from lrjax import __version__
from lrjax.files import one_line

# Modules that register further subcommands (skipped with a note if not importable).
EXTENSIONS: tuple[str, ...] = ("lrjax.serving.cli", "lrjax.bench_cli", "lrjax.evaluate_cli")

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
  p.add_argument(
    "--overwrite",
    action="store_true",
    help="replace --out if it holds an lrjax checkpoint (never any other directory or file)",
  )
  p.add_argument(
    "--quantize", choices=("w4a8",), help="save int4 weights / int8 activations (CPU kernels)"
  )
  p.add_argument(
    "--group", type=_w4a8_group, help="W4A8 weight group along K: 32, 64 or 128 (default 128)"
  )
  p.add_argument(
    "--verify",
    action="store_true",
    help="reload the output and check it equals the compressed model bit for bit",
  )
  _no_verify_arg(p)

  def run(a):
    from lrjax import checkpoint

    try:
      from lrjax.compression import compress
    except ImportError as e:
      print(f"lrjax convert: lrjax.compress is not available ({e})", file=sys.stderr)
      return 2
    if a.orbax and a.dtype is not None:
      print("lrjax convert: --dtype applies to --hf sources only", file=sys.stderr)
      return 2
    # Cheap checks first: nothing is loaded before the arguments and --out are known usable.
    with _reserved(
      "convert",
      lambda: _check_convert(a),
      overwrite=a.overwrite,
      replaceable=checkpoint.is_checkpoint,
    ) as (out, src):
      if out is None:
        return 2
      _check_ranks(a, src)
      verify = not a.no_verify
      calib = load_tokens(a.calib) if a.calib else None
      if a.calib_text:
        from lrjax import text

        calib = text.calib_tokens_for(src, a.calib_text, a.calib_seq_len, ids=calib)
      lora_tokens = load_tokens(a.lora_tokens) if a.lora_tokens else None
      if a.hf:
        print(f"loading HF checkpoint {a.hf}")
        model = checkpoint.load_hf(src, dtype=a.dtype, progress=True, verify=verify)
      else:
        print(f"loading orbax checkpoint {a.orbax}")
        model = checkpoint.load(src, verify=verify)
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
      rec["source"] = os.fspath(src)
      model.compression = rec
      model = _quantize_for_convert(model, a.quantize, a.group)
      from lrjax.text import carried_files

      from lrjax.bench import weight_bytes

      nb = weight_bytes(model)[0]
      size = f"{nb / 1e9:.2f} GB" if nb >= 1e9 else f"{nb / 1e6:.1f} MB"
      print(f"saving {a.out} ({size})", flush=True)
      with carried_files(src) as extra:  # tokenizer, chat template, generation config
        checkpoint.save(model, out, overwrite=a.overwrite, extra_files=extra)
      params = rec.get("params", {})
      print(
        f"wrote {a.out}: method={a.method} ratio={a.ratio} ranks={model.layer_ranks()[0]}"
        f" (layer 0) weights {params.get('dense')} → {params.get('compressed')}"
      )
      if a.verify:
        print(f"verifying {a.out}: reloading it", flush=True)
        _verify(model, checkpoint.load(out))
        print("verified: reloaded checkpoint equals the compressed model bit for bit")
      return 0

  return run


def _no_verify_arg(p: argparse.ArgumentParser):
  p.add_argument(
    "--no-verify",
    action="store_true",
    help="skip the sha256 check of every array when reading an lrjax checkpoint or export "
    "(faster on large models; shapes and dtypes are still checked)",
  )


@contextlib.contextmanager
def _reserved(command: str, check: Callable[[], tuple], *, overwrite: bool, replaceable):
  # Runs check() -> (out, inputs, src), then holds out's write lock for the block. Yields
  # (resolved out, src), or (None, None) after printing a one-line error when the arguments
  # or the output are unusable (the caller then returns 2).
  from lrjax import checkpoint

  stack = contextlib.ExitStack()
  try:
    out, inputs, src = check()
    resolved = stack.enter_context(
      checkpoint.reserve_output(out, overwrite, replaceable=replaceable, protect=inputs)
    )
  except (ValueError, OSError) as e:
    stack.close()
    print(f"lrjax {command}: error: {one_line(e, limit=500)}", file=sys.stderr)
    yield None, None
    return
  with stack:
    yield resolved, src


def _positive(name: str, v, integer: bool = False):
  ok = isinstance(v, int) if integer else isinstance(v, (int, float)) and math.isfinite(v)
  if not ok or v <= 0:
    raise ValueError(f"{name} {v!r} must be a positive {'integer' if integer else 'number'}")


def _check_convert(a) -> tuple:
  if not (math.isfinite(a.ratio) and 0.0 < a.ratio < 1.0):
    raise ValueError(
      f"--ratio {a.ratio!r} must be in (0, 1): the fraction of each compressed projection's "
      "weight parameters removed (0.2 keeps 80%)"
    )
  _positive("--block", a.block, integer=True)
  if a.lora_steps < 0:
    raise ValueError(f"--lora-steps {a.lora_steps} must be >= 0 (0 skips LoRA)")
  _positive("--lora-rank", a.lora_rank, integer=True)
  _positive("--lora-lr", a.lora_lr)
  _positive("--lora-batch", a.lora_batch, integer=True)
  if getattr(a, "calib_text", None):
    _positive("--calib-seq-len", a.calib_seq_len, integer=True)
  if getattr(a, "group", None) is not None and getattr(a, "quantize", None) is None:
    raise ValueError("--group applies with --quantize w4a8")
  calibrated = bool(a.calib or getattr(a, "calib_text", None))
  if a.method == "whiten" and not calibrated:
    raise ValueError(
      "--method whiten needs calibration tokens (--calib-text FILE for text, --calib FILE for "
      "token ids); or use --method svd"
    )
  if a.lora_steps and not (a.lora_tokens or calibrated):
    raise ValueError("--lora-steps > 0 needs --lora-tokens FILE or --calib FILE")
  src = _existing_dir(a.hf or a.orbax, "--hf" if a.hf else "--orbax")
  inputs = [src]
  for attr, flag in (("calib", "--calib"), ("lora_tokens", "--lora-tokens")):
    if getattr(a, attr):
      inputs.append(_existing_file(getattr(a, attr), flag))
      setattr(a, attr, os.path.abspath(os.path.expanduser(getattr(a, attr))))  # keeps its suffix
  for i, f in enumerate(getattr(a, "calib_text", None) or ()):
    inputs.append(_existing_file(f, "--calib-text"))
    a.calib_text[i] = os.path.abspath(os.path.expanduser(f))
  return a.out, inputs, src


def _check_ranks(a, src) -> None:
  """The source is dense and its config admits a rank in every projection's budget at --ratio
  and --block (before any weight is loaded)."""
  from lrjax import checkpoint
  from lrjax.checkpoint.hf import LOWRANK_KEY
  from lrjax.compression import plan_ranks
  from lrjax.models import ModelConfig

  try:
    if a.hf:
      cfg_json = checkpoint.read_hf_config(src)[1]
      done = "an lrjax low-rank export" if LOWRANK_KEY in cfg_json else None
      cfg = None if done else ModelConfig.from_hf_config(cfg_json)
    else:
      meta = checkpoint.read_checkpoint_arg(a.orbax, "--orbax")
      ratio = (meta.get("compression") or {}).get("ratio")
      done = any(meta.get("ranks") or ()) and (f"ratio {ratio}" if ratio else "low-rank")
      cfg = ModelConfig.from_dict(meta["config"])
  except (OSError, ValueError, TypeError, KeyError):
    return  # loading the source reports what is wrong with it, naming the file
  if done:
    flag = f"--hf {a.hf}" if a.hf else f"--orbax {a.orbax}"
    raise ValueError(f"{flag} is already compressed ({done}); convert its dense source instead")
  plan_ranks(cfg, ratio=a.ratio, block=a.block, mlp_only=a.mlp_only, per_head=a.per_head)


def _existing_dir(path: str, what: str):
  from lrjax.checkpoint import resolve

  p = resolve(path, what)
  if not p.is_dir():
    raise FileNotFoundError(f"{what} {path}: no such directory")
  return p


def _existing_file(path: str, what: str):
  from lrjax.checkpoint import resolve

  p = resolve(path, what)
  if not p.is_file():
    raise FileNotFoundError(f"{what} {path}: no such file")
  return p


def _w4a8_group(text: str) -> int:
  try:
    v = int(text)
  except ValueError:
    v = -1
  if v < 0 or v % 8:
    raise argparse.ArgumentTypeError(f"{text!r}: expected 32, 64 or 128 (0: one per column)")
  return v


def _quantize_for_convert(model, scheme: str | None, group: int | None):
  """``model`` quantized for ``convert --quantize`` (unchanged without it)."""
  if scheme is None:
    return model
  from lrjax.quant import quantize

  q = quantize(model, scheme, group=128 if group is None else group)
  print(f"quantized {scheme} group={128 if group is None else group}")
  return q


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


@subcommand("export", help="lrjax checkpoint → HF directory that transformers loads")
def export(p: argparse.ArgumentParser):
  p.add_argument("--ckpt", metavar="DIR", required=True, help="lrjax orbax checkpoint dir")
  p.add_argument("--out", metavar="DIR", required=True, help="output HF dir")
  p.add_argument(
    "--format",
    choices=("hf-lowrank", "hf-dense"),  # lrjax.checkpoint.hf_export.FORMATS
    default="hf-lowrank",
    help="hf-lowrank: factored U/V with its own modeling file (transformers: "
    "trust_remote_code=True); hf-dense: U·V multiplied back into the plain architecture "
    "(default: hf-lowrank; a checkpoint with no low-rank projection is written in its "
    "plain architecture either way)",
  )
  p.add_argument(
    "--tokenizer-from",
    metavar="DIR",
    help="copy tokenizer and generation_config files from DIR (default: those in --ckpt)",
  )
  p.add_argument(
    "--max-shard-gb", type=float, default=4.0, help="largest safetensors file, in GiB (> 0)"
  )
  p.add_argument(
    "--overwrite",
    action="store_true",
    help="replace --out if an earlier lrjax export wrote it (never any other directory or file)",
  )
  _no_verify_arg(p)

  def run(a):
    from lrjax import checkpoint
    from lrjax.checkpoint import hf_export

    texts = []

    def check():
      _positive("--max-shard-gb", a.max_shard_gb)
      if int(a.max_shard_gb * 2**30) < 1:
        raise ValueError(f"--max-shard-gb {a.max_shard_gb!r} is under one byte")
      meta = checkpoint.read_checkpoint_arg(a.ckpt)
      src = _existing_dir(a.ckpt, "--ckpt")
      inputs = [src]
      if a.tokenizer_from:
        tdir = _existing_dir(a.tokenizer_from, "--tokenizer-from")
        texts[:] = hf_export.text_files(tdir)
        if not texts:
          raise FileNotFoundError(
            f"--tokenizer-from {a.tokenizer_from}: no tokenizer or generation files there "
            f"(expected some of {', '.join(hf_export.TEXT_FILES[:6])})"
          )
        inputs.append(tdir)
      else:
        texts[:] = hf_export.text_files(src)
      hf_export.check_text_files(texts, int(meta["config"]["vocab_size"]))
      return a.out, inputs, src

    with _reserved("export", check, overwrite=a.overwrite, replaceable=checkpoint.is_export) as (
      out,
      src,
    ):
      if out is None:
        return 2
      model = checkpoint.load(src, verify=not a.no_verify)
      from lrjax.checkpoint import quantized as qck

      if qck.is_quantized(model):
        model = qck.for_export(model)
        print("W4A8 checkpoint: its int4 weights are written dequantized (q · scale)")
      checkpoint.export_hf(
        model,
        out,
        format=a.format,
        extra_files=texts,
        max_shard_bytes=int(a.max_shard_gb * 2**30),
        overwrite=a.overwrite,
        progress=True,
      )
      with open(os.path.join(out, "config.json")) as fh:
        arch = json.load(fh)["architectures"][0]
      print(f"wrote {a.out}: {arch} (ranks per layer: {json.dumps(model.layer_ranks())})")
      if texts:
        print(f"copied {', '.join(t.name for t in texts)}")
      if os.path.exists(os.path.join(out, hf_export.MODELING_FILE)):
        print(
          "load it with transformers.AutoModelForCausalLM.from_pretrained(DIR, "
          "trust_remote_code=True), or lrjax.checkpoint.load_hf(DIR)"
        )
      return 0

  return run


class _CommandParser(argparse.ArgumentParser):
  """A subcommand's parser. Subcommands take options only: a bare word (``lrjax generate ck``)
  is an error that names the option it was likely meant for (``--ckpt ck``), instead of
  argparse's complaint that ``--ckpt`` is missing."""

  def parse_known_args(self, args=None, namespace=None):
    if args is not None and not any(not a.option_strings for a in self._actions):
      word = self._stray_word(list(args))
      if word is not None:
        self.error(f"unexpected argument {word!r}: options only{self._hint(list(args), word)}")
    return super().parse_known_args(args, namespace)

  def _stray_word(self, args: list[str]) -> str | None:
    i = 0
    while i < len(args):
      t = args[i]
      if t == "--":
        return args[i + 1] if i + 1 < len(args) else None
      if t.startswith("-") and len(t) > 1:
        action = self._option_string_actions.get(t.split("=", 1)[0])
        if action is None:
          return None  # an unknown or abbreviated option: argparse's own message says which
        i += 2 if action.nargs != 0 and "=" not in t else 1
        continue
      return t
    return None

  def _hint(self, args: list[str], word: str) -> str:
    given = {a.split("=", 1)[0] for a in args if a.startswith("-")}
    for group in self._mutually_exclusive_groups:
      opts = [a.option_strings[0] for a in group._group_actions]
      if group.required and not given & set(opts):
        return f"; did you mean {opts[0]} {word}?" + (
          f" (or {' or '.join(opts[1:])})" if len(opts) > 1 else ""
        )
    for a in self._actions:
      if a.required and a.option_strings and not given & set(a.option_strings):
        return f"; did you mean {a.option_strings[0]} {word}?"
    return ""


def build_parser() -> argparse.ArgumentParser:
  for mod in EXTENSIONS:
    try:
      importlib.import_module(mod)
    except ImportError as e:
      logging.getLogger("lrjax.cli").debug("subcommand module %s not loaded: %s", mod, e)
  ap = argparse.ArgumentParser(prog="lrjax", description="lrjax: low-rank LLMs on JAX/XLA")
  ap.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
  ap.add_argument("--version", action="version", version=f"lrjax {__version__}")
  sub = ap.add_subparsers(
    dest="command", required=True, metavar="COMMAND", parser_class=_CommandParser
  )
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
    from lrjax import compile_cache

    compile_cache.enable()  # a second run of a command skips XLA's compiles
    return int(args._run(args) or 0)
  except (ValueError, OSError, TypeError) as e:
    print(f"lrjax {args.command}: error: {one_line(e, limit=None)}", file=sys.stderr)
    return 1


if __name__ == "__main__":  # python -m lrjax.cli: the subcommands register in lrjax.cli
  from lrjax.cli import main as _main

  sys.exit(_main())
