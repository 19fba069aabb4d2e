"""``lrjax bench``: prefill/decode throughput and TTFT/ITL of a checkpoint on this platform."""

from __future__ import annotations

import argparse
import json
import os
import sys

from lrjax.cli import subcommand


def _levels(text: str) -> tuple[int, ...]:
  from lrjax.bench import parse_levels

  try:
    return parse_levels(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text: str) -> int:
  try:
    v = int(text)
  except ValueError:
    v = 0
  if v < 1:
    raise argparse.ArgumentTypeError(f"{text!r}: expected a positive int")
  return v


def _group(text: str) -> int:
  try:
    v = int(text)
  except ValueError:
    v = -1
  if v < 0 or v % 8:
    raise argparse.ArgumentTypeError(
      f"{text!r}: expected 32, 64 or 128 (or 0 for per-channel, any multiple of 8)"
    )
  return v


def _is_bench(data: dict) -> bool:
  return data.get("benchmark") == "lrjax_bench"


@subcommand("bench", help="time prefill/decode and TTFT/ITL of a checkpoint through the engine")
def bench(p: argparse.ArgumentParser):
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--ckpt", metavar="DIR", help="lrjax checkpoint dir")
  src.add_argument("--hf", metavar="DIR", help="HF checkpoint dir (config.json + safetensors)")
  src.add_argument(
    "--preset",
    metavar="NAME",
    help="random weights of a ModelConfig preset (e.g. llama3_2_1b), for shape-only timing",
  )
  p.add_argument(
    "--ratio", type=float, help="with --preset: low-rank at the ranks convert --ratio would give"
  )
  p.add_argument(
    "--block", type=_positive, default=128, help="with --ratio: ranks are multiples of this"
  )
  p.add_argument("--dtype", choices=("float32", "bfloat16"), help="with --hf/--preset")
  p.add_argument(
    "--quantize", choices=("w4a8",), help="quantize at load (int4 weights, int8 activations)"
  )
  p.add_argument("--group", type=_group, help="W4A8 weight group along K (default 128)")
  p.add_argument("--concurrency", type=_levels, default=(1, 4, 8), metavar="LIST")
  p.add_argument("--prompt-len", type=_positive, default=128)
  p.add_argument("--gen-len", type=_positive, default=32, help="tokens generated per request")
  p.add_argument("--reps", type=_positive, default=3, help="timed rounds per level (median)")
  p.add_argument(
    "--slots", type=_positive, help="engine slots for every level (default: one per request)"
  )
  p.add_argument("--no-fuse", action="store_true", help="run the steps without lrjax.fuse")
  p.add_argument("--out", metavar="FILE", default="lrjax_bench.json", help="results JSON")
  p.add_argument("--plot", metavar="FILE", help="PNG plot (default: --out with .png)")
  p.add_argument(
    "--overwrite",
    action="store_true",
    help="replace --out if it holds an earlier bench result, and the plot file",
  )
  p.add_argument("--no-plot", action="store_true")

  def run(a):
    import jax.numpy as jnp

    from lrjax import bench as B
    from lrjax.checkpoint import read_checkpoint_arg, resolve
    from lrjax.files import check_out

    if a.group is not None and a.quantize is None:
      print("lrjax bench: --group needs --quantize w4a8", file=sys.stderr)
      return 2
    if a.ratio is not None and a.preset is None:
      print("lrjax bench: --ratio applies to --preset only", file=sys.stderr)
      return 2
    if a.dtype is not None and a.ckpt is not None:
      print(
        "lrjax bench: --dtype applies to --hf/--preset; a checkpoint keeps its dtype",
        file=sys.stderr,
      )
      return 2
    settings = B.BenchSettings(
      concurrency=a.concurrency,
      prompt_len=a.prompt_len,
      gen_len=a.gen_len,
      reps=a.reps,
      slots=a.slots,
      fuse=not a.no_fuse,
    )
    inputs = [resolve(x) for x in (a.ckpt, a.hf) if x]
    try:
      if a.ckpt is not None:
        read_checkpoint_arg(a.ckpt, hf_fix=f"pass it as --hf {a.ckpt}")
      out = str(check_out(a.out, a.overwrite, inputs, "an lrjax bench result", _is_bench))
      png = None if a.no_plot else str(resolve(a.plot or os.path.splitext(out)[0] + ".png"))
      if png and os.path.lexists(png) and not a.overwrite:
        raise FileExistsError(f"the plot {png} exists; pass --overwrite to replace it or --no-plot")
    except (OSError, ValueError) as e:
      print(f"lrjax bench: {e}", file=sys.stderr)
      return 2
    model, info = B.load_model_for_bench(
      ckpt=a.ckpt,
      hf=a.hf,
      preset=a.preset,
      ratio=a.ratio,
      dtype=jnp.dtype(a.dtype) if a.dtype else None,
      quantize=a.quantize,
      group=a.group,
      block=a.block,
    )
    info["decode_kernels"] = B.decode_kernels(model, fuse=settings.fuse)
    desc = ", ".join(f"{k}={v}" for k, v in info["source"].items() if v is not None)
    quant = info.get("quantized")
    print(
      f"model {desc} dtype={info['dtype']}"
      + (f" quantized {quant['scheme']} group={quant['group']}" if quant else "")
      + f", {info['param_bytes'] / 1e9:.2f} GB of weights"
      + f", decode-step custom calls {info['decode_kernels'] or 'none'}"
    )
    result = B.run_bench(model, settings, info=info, progress=True)
    result["command"] = " ".join(["lrjax"] + sys.argv[1:]) if sys.argv else "lrjax bench"
    print(B.format_table(result))
    if png:
      why = B.plot(result, png)
      result["plot"] = None if why else png
      print(f"no plot: {why}" if why else f"wrote {png}")
    tmp = out + ".tmp"
    with open(tmp, "w") as fh:
      json.dump(result, fh, indent=1)
    os.replace(tmp, out)
    print(f"wrote {out}")
    return 0

  return run
