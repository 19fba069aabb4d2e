"""Prefill under load: time to first token when 16 or 64 requests arrive at once, for each of the
engine's admission policies ("single": one prompt per prefill call; "batched": waiting prompts
together in one call, long prompts in chunks between decode steps), on a small random low-rank
model on CPU (or Llama-3-8B shapes on a GPU). Every request's greedy tokens are compared with
the request run alone: in f32 (the CPU preset) they must match; in bf16 the batch's shape
changes the rounding and random weights' near-tied logits then pick other tokens, so they are
counted, not failed.

  python benchmarks/serve_prefill.py --baseline-commit 06bcd4c 6477c1a
      # -> benchmarks/results/serve_prefill_cpu.json
  python benchmarks/serve_prefill.py --preset 8b --baseline-commit 06bcd4c \
      --out benchmarks/results/serve_prefill_gpu.json            # one GPU, a few minutes
  python benchmarks/serve_prefill.py --baseline-commit 06bcd4c --save-baseline .cache/bl
      # then, on a machine whose copy of the tree has no git history: --baseline-dir .cache/bl

TTFT is the engine's (submit → first token read on the host). ``--baseline-commit`` also runs
the engines of earlier commits (there: one prompt per prefill call, logits at every position;
06bcd4c also read each first token before the next prefill), loaded beside the current one.
Each variant runs ``--reps`` times, the variants interleaved; the record keeps every rep and
their median.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def small_model(ratio: float = 0.4, preset: str = "small", dtype=None):
  """Random weights, ``ratio`` of each projection's params removed: "small" (hidden 256, 4
  layers, vocab 2048, f32) for CPU, "8b" (Llama-3-8B shapes) for a GPU."""
  import jax.numpy as jnp
  from flax import nnx

  from lrjax.models import LlamaForCausalLM, ModelConfig
  from lrjax.sharding.analysis import compressed_ranks

  if preset == "8b":
    cfg, multiple, dtype = ModelConfig.llama3_8b(), 64, dtype or jnp.bfloat16
  else:
    cfg = ModelConfig(
      vocab_size=2048,
      hidden_size=256,
      intermediate_size=704,
      num_layers=4,
      num_heads=8,
      num_kv_heads=4,
      head_dim=32,
    )
    multiple, dtype = 16, dtype or jnp.float32
  ranks = [compressed_ranks(cfg, ratio, multiple=multiple)] * cfg.num_layers
  return LlamaForCausalLM(
    cfg, ranks=ranks, dtype=dtype, param_dtype=dtype, scan_layers=False, rngs=nnx.Rngs(0)
  )


def run_once(engine, prompts, new_tokens):
  from lrjax.serving import SamplingParams

  Request = sys.modules[type(engine).__module__].Request  # the engine's own (a baseline's too)

  sp = SamplingParams(max_new_tokens=new_tokens)
  t0 = time.perf_counter()
  ids = [engine.submit(Request(p, sp)) for p in prompts]
  done = {}
  while engine.busy:
    for r in engine.step():
      done[r.id] = r
  wall = time.perf_counter() - t0
  res = [done[i] for i in ids]
  ttft = [r.ttft_s for r in res]
  return res, {
    "ttft_p50_ms": float(np.percentile(ttft, 50)) * 1e3,
    "ttft_p99_ms": float(np.percentile(ttft, 99)) * 1e3,
    "wall_s": wall,
    "tokens_per_s": sum(len(r.tokens) for r in res) / wall,
  }


def baseline_source(commit: str, source_dir: str | None = None) -> str:
  """lrjax/serving/engine.py as it was at ``commit``: ``git show``, or, where the checkout has
  no history (a copy of the tree on another machine), ``source_dir``/engine_<commit>.py, a
  file written here beforehand by ``--save-baseline DIR``."""
  if source_dir:
    path = os.path.join(source_dir, f"engine_{commit}.py")
    if not os.path.exists(path):
      raise SystemExit(
        f"{path} not found: write it where git has the history with "
        f"`python benchmarks/serve_prefill.py --baseline-commit {commit} --save-baseline DIR`"
      )
    with open(path) as fh:
      return fh.read()
  try:
    got = subprocess.run(
      ["git", "show", f"{commit}:lrjax/serving/engine.py"],
      capture_output=True,
      text=True,
      cwd=HERE,
    )
    why = got.stderr.strip() if got.returncode else None
  except FileNotFoundError:
    why = "no git on this machine"
  if why:
    raise SystemExit(
      f"git show {commit}:lrjax/serving/engine.py failed ({why}); without the history, pass "
      "--baseline-dir with the file --save-baseline wrote"
    )
  return got.stdout


def baseline_engine(commit: str, source_dir: str | None = None):
  """The Engine class of lrjax/serving/engine.py as it was at ``commit``, loaded beside the
  current one, to compare both in one run."""
  import importlib.util
  import tempfile

  src = baseline_source(commit, source_dir)
  path = os.path.join(tempfile.mkdtemp(prefix="lrjax-baseline-"), "engine_baseline.py")
  with open(path, "w") as fh:
    fh.write(src)
  spec = importlib.util.spec_from_file_location(f"lrjax.serving._engine_{commit}", path)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod  # its dataclasses look their module up
  spec.loader.exec_module(mod)
  return mod.Engine


def parse_variant(spec: str) -> tuple[str, dict]:
  """``NAME:KEY=VALUE,...`` -> (NAME, {KEY: VALUE}): Engine keyword arguments, integer values
  (or a prefill policy name for ``prefill``)."""
  name, sep, body = spec.partition(":")
  if not (name and sep and body):
    raise SystemExit(
      f"--variant {spec!r}: expected NAME:KEY=VALUE,... (e.g. big:prefill_tokens=8192)"
    )
  kw = {}
  for item in body.split(","):
    key, eq, value = item.partition("=")
    if not (key and eq and value):
      raise SystemExit(f"--variant {spec!r}: {item!r} is not KEY=VALUE")
    if key == "prefill":
      kw[key] = value
    elif value.isdigit():
      kw[key] = int(value)
    else:
      raise SystemExit(f"--variant {spec!r}: {key}={value!r} must be a whole number")
  return name, kw


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--policy", nargs="+", default=["single", "batched"])
  ap.add_argument(
    "--baseline-commit",
    nargs="*",
    default=[],
    help="also run the engines of these commits (their own admission), interleaved",
  )
  ap.add_argument(
    "--baseline-dir",
    default=None,
    help="read the baselines' engine.py from DIR/engine_<commit>.py instead of git",
  )
  ap.add_argument(
    "--save-baseline",
    metavar="DIR",
    default=None,
    help="write each --baseline-commit's engine.py into DIR (for --baseline-dir) and exit",
  )
  ap.add_argument(
    "--variant",
    action="append",
    default=[],
    metavar="NAME:KEY=INT,...",
    help="also run the current engine with these settings, e.g. "
    "big:prefill_tokens=8192,prefill_call_tokens=1024",
  )
  ap.add_argument("--preset", choices=("small", "8b"), default="small")
  ap.add_argument(
    "--dtype",
    choices=("float32", "bfloat16"),
    default=None,
    help="the model's dtype (default: the preset's, small f32, 8b bf16)",
  )
  ap.add_argument("--ratio", type=float, default=0.4)
  ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
  ap.add_argument("--prompt-len", type=int, default=128)
  ap.add_argument("--new-tokens", type=int, default=16)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--label", default=None, help="a name for this run")
  ap.add_argument("--out", default=os.path.join(HERE, "results", "serve_prefill_cpu.json"))
  a = ap.parse_args(argv)
  extra_variants = [parse_variant(v) for v in a.variant]
  names = [*a.policy, *(n for n, _ in extra_variants)]
  if len(set(names)) < len(names):
    raise SystemExit(f"--policy and --variant names must differ: {names}")
  if a.save_baseline:
    os.makedirs(a.save_baseline, exist_ok=True)
    for c in a.baseline_commit:
      path = os.path.join(a.save_baseline, f"engine_{c}.py")
      with open(path, "w") as fh:
        fh.write(baseline_source(c))
      print(f"-> {path}")
    return 0
  import jax
  import jax.numpy as jnp

  from lrjax.serving import Engine, Request, SamplingParams
  from results_io import write_json

  model = small_model(a.ratio, a.preset, getattr(jnp, a.dtype) if a.dtype else None)
  rng = np.random.default_rng(0)
  commit = subprocess.run(
    ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
  ).stdout.strip()
  variants = [(p, Engine, {"prefill": p}) for p in a.policy]
  variants += [(name, Engine, kw) for name, kw in extra_variants]
  for c in reversed(a.baseline_commit):
    variants.insert(0, (f"baseline@{c}", baseline_engine(c, a.baseline_dir), {}))
  settings = {name: extra for name, _, extra in variants}
  records = []
  for c in a.concurrency:
    prompts = [
      [int(t) for t in rng.integers(0, model.cfg.vocab_size, a.prompt_len)] for _ in range(c)
    ]
    kw = dict(
      max_slots=c,
      max_len=a.prompt_len + a.new_tokens + 1,
      buckets=(a.prompt_len,),
      attend_buckets=(a.prompt_len + a.new_tokens + 1,),
      fuse=True,  # an older engine's default may differ: every variant runs lrjax.fuse
    )
    engines, warm = {}, {}
    for name, cls, extra in variants:
      t0 = time.perf_counter()
      engines[name] = cls(model, **kw, **extra)
      engines[name].warmup()
      warm[name] = time.perf_counter() - t0
    reps = {name: [] for name in engines}
    last = {}
    for _ in range(a.reps):  # interleaved, so the machine's drift touches every variant alike
      for name, eng in engines.items():
        last[name], stats = run_once(eng, prompts, a.new_tokens)
        reps[name].append(stats)
    sp = SamplingParams(max_new_tokens=a.new_tokens)
    current = engines[a.policy[0]]
    alone = [current.generate([Request(p, sp)])[0].tokens for p in prompts]
    for name in engines:
      mismatches = sum(r.tokens != t for r, t in zip(last[name], alone))
      first = sum(r.tokens[:1] != t[:1] for r, t in zip(last[name], alone))
      rec = {
        "policy": name,
        "engine_settings": settings[name],
        "concurrency": c,
        "warmup_s": warm[name],
        "mismatches_vs_alone": mismatches,
        "first_token_mismatches_vs_alone": first,
        "reps": reps[name],
      }
      for k in ("ttft_p50_ms", "ttft_p99_ms", "wall_s", "tokens_per_s"):
        rec[k] = float(np.median([r[k] for r in reps[name]]))
      records.append(rec)
      print(
        f"{name:18s} c={c:3d}: TTFT p50 {rec['ttft_p50_ms']:8.1f} ms p99 "
        f"{rec['ttft_p99_ms']:8.1f} ms, {rec['tokens_per_s']:7.0f} tok/s, "
        f"{mismatches} mismatches vs alone",
        flush=True,
      )
  run = {
    "label": a.label,
    "commit": commit,
    "dtype": str(jnp.dtype(model.dtype)),
    "config": {
      "preset": a.preset,
      "ratio": a.ratio,
      "prompt_len": a.prompt_len,
      "new_tokens": a.new_tokens,
      "reps": a.reps,
    },
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "command": "python benchmarks/serve_prefill.py "
    + " ".join(argv if argv is not None else sys.argv[1:]),
    "records": records,
  }
  out = {
    "what": "engine TTFT with 16 / 64 requests arriving at once, random low-rank model "
    f"({a.preset}: {model.cfg.num_layers} layers, hidden {model.cfg.hidden_size}, vocab "
    f"{model.cfg.vocab_size}, {a.ratio:.0%} of projection params removed), fused, "
    f"{jax.devices()[0].device_kind}",
    "machine": {
      "platform": platform.platform(),
      "cpu_count": os.cpu_count(),
      "jax": jax.__version__,
      "device": str(jax.devices()[0]),
      "device_kind": jax.devices()[0].device_kind,
    },
    "runs": [],
  }
  if os.path.exists(a.out):  # runs accumulate (e.g. before and after a change)
    with open(a.out) as fh:
      out["runs"] = json.load(fh).get("runs", [])
  out["runs"].append(run)
  write_json(a.out, out)
  print(f"-> {a.out}")
  # f32 (the small preset's default) must match the request run alone token for token. In
  # bf16 a row's numbers depend on the batch's shape (another GEMM tiling, another rounding),
  # and random weights' near-tied logits turn that into other greedy tokens: counted only.
  exact = model.dtype == np.float32
  return 1 if exact and any(r["mismatches_vs_alone"] for r in records) else 0


if __name__ == "__main__":
  sys.exit(main())
