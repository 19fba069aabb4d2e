"""Serving throughput and latency of a model on this platform, through the generation engine.

  model, info = load_model_for_bench(ckpt="ck_dir", quantize="w4a8", group=64)
  result = run_bench(model, BenchSettings(concurrency=(1, 4, 8)))
  print(format_table(result))

Method (the repo's benchmarks': warm up, many steps, median). For each concurrency level ``c``
an :class:`lrjax.serving.Engine` with ``c`` slots (or ``slots``) is built and warmed up (every
step it will run is compiled and run once), then ``reps`` rounds each submit ``c`` requests of
``prompt_len`` random token ids at once and generate ``gen_len`` tokens greedily. Per round:

- TTFT: submit to first token, per request (the engine batches waiting prompts into shared
  prefill calls, so a request's TTFT includes the prefill of the prompts batched with it);
- prefill tokens/s: ``c · prompt_len`` over the time to the last first token;
- decode tokens/s: tokens generated after the last prefill over the time they took;
- ITL: the gaps between a request's decode tokens (each is one engine step).

Each metric is the median over rounds (ITL: the median and p90 of all gaps of all rounds).
``decode_weight_gbs`` is the weight bytes one decode step reads (every param except the
embedding table, which a step reads only ``c`` rows of, unless the LM head is tied to it)
times the decode steps per second; ``weight_roofline_frac`` is that rate over the memory
roofline (:func:`memory_roofline`: a listed GPU's HBM rate, or this CPU's measured read rate).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import logging
import os
import platform
import time
from collections.abc import Sequence

import numpy as np

log = logging.getLogger("lrjax.bench")

QUANT_SCHEMES = ("w4a8",)
# HBM bandwidth (bytes/s) by device-name substring: the H200's measured copy rate, the H100
# SXM's datasheet rate (DESIGN.md, "Measuring"). Other H100s (PCIe, NVL) have other rates and
# are not listed. The benchmarks' results state fractions of these too.
HBM_BPS = {"H200": 4.3e12, "H100 80GB HBM3": 3.35e12}
READ_BYTES = 1 << 30  # the CPU read measurement's array: well past any L3


@dataclasses.dataclass(frozen=True)
class BenchSettings:
  """What :func:`run_bench` measures; see the module docstring."""

  concurrency: tuple[int, ...] = (1, 4, 8)
  prompt_len: int = 128
  gen_len: int = 32
  reps: int = 3
  slots: int | None = None  # engine slots; None: one engine per level with c slots
  fuse: bool = True
  seed: int = 0

  def __post_init__(self):
    c = self.concurrency
    if not c or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in c):
      raise ValueError(f"concurrency={c!r} must be positive ints, e.g. (1, 4, 8)")
    for name in ("prompt_len", "gen_len", "reps"):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name}={v!r} must be a positive int")
    if self.gen_len < 3:
      raise ValueError(
        f"gen_len={self.gen_len} must be >= 3 (the inter-token latency is timed between the "
        "tokens after the first decode step)"
      )
    if self.slots is not None and (not isinstance(self.slots, int) or self.slots < max(c)):
      raise ValueError(
        f"slots={self.slots!r} must be an int >= the largest concurrency {max(c)} "
        "(or None for one engine per level)"
      )


# ------------------------------------------------------------------ models


def random_model(cfg, *, ratio: float | None = None, dtype=None, block: int = 128, seed: int = 0):
  """A model of architecture ``cfg`` with random weights; low-rank at the ranks ``lrjax
  convert --ratio`` would give (every projection, ``block``-aligned) when ``ratio`` is set."""
  import jax.numpy as jnp
  from flax import nnx

  from lrjax.compression.pipeline import plan_ranks
  from lrjax.models import LlamaForCausalLM

  ranks = None
  if ratio is not None:
    plan = plan_ranks(cfg, ratio=ratio, block=block, mlp_only=False, per_head=False)
    ranks = [{p: r for p, (r, _) in layer.items()} for layer in plan]
  dt = jnp.dtype(dtype or jnp.float32)
  return LlamaForCausalLM(cfg, ranks, dtype=dt, param_dtype=dt, rngs=nnx.Rngs(seed))


def load_model_for_bench(
  *,
  ckpt: str | None = None,
  hf: str | None = None,
  preset: str | None = None,
  ratio: float | None = None,
  dtype=None,
  quantize: str | None = None,
  group: int | None = None,
  block: int = 128,
):
  """(model, description) from exactly one of an lrjax checkpoint, an HF directory, or a
  ``ModelConfig`` preset with random weights (low-rank at ``ratio``, ranks multiples of
  ``block``); optionally quantized at load."""
  import jax.numpy as jnp

  if sum(x is not None for x in (ckpt, hf, preset)) != 1:
    raise ValueError("pass exactly one of ckpt=, hf= or preset= (random weights)")
  if ratio is not None and preset is None:
    raise ValueError(
      "ratio= applies to preset= (random weights) only; convert a checkpoint instead"
    )
  if quantize is not None and quantize not in QUANT_SCHEMES:
    raise ValueError(f"{quantize=} is not a scheme; expected one of {QUANT_SCHEMES}")
  if group is not None and quantize is None:
    raise ValueError("group= needs quantize='w4a8'")
  info: dict = {}
  ckpt, hf = (None if d is None else os.path.abspath(os.path.expanduser(d)) for d in (ckpt, hf))
  if ckpt is not None:
    from lrjax.serving import load_model

    if dtype is not None:
      raise ValueError("dtype= applies to hf= and preset= only; a checkpoint keeps its dtype")
    model = load_model(ckpt)
    info["source"] = {"ckpt": ckpt}
  elif hf is not None:
    from lrjax.checkpoint import load_hf

    model = load_hf(hf, dtype=dtype)
    info["source"] = {"hf": hf}
  else:
    from lrjax.models import ModelConfig

    make = getattr(ModelConfig, preset, None)
    if preset.startswith("_") or not callable(make) or preset in ("from_dict", "from_hf_config"):
      raise ValueError(f"preset={preset!r} is not a ModelConfig preset; expected e.g. llama3_2_1b")
    model = random_model(make(), ratio=ratio, dtype=dtype, block=block)
    info["source"] = {"preset": preset, "random_weights": True, "ratio": ratio}
  info["config"] = model.cfg.to_dict()
  info["dtype"] = str(jnp.dtype(model.embed.embedding[...].dtype))
  info["ranks_layer0"] = _ranks(model)
  if quantize is not None:
    from lrjax.quant import quantize as quantize_model

    t = time.perf_counter()
    g = 128 if group is None else group
    model = quantize_model(model, quantize, group=g)
    info["quantized"] = {"scheme": quantize, "group": g, "seconds": time.perf_counter() - t}
  info["param_bytes"], info["decode_weight_bytes"] = weight_bytes(model)
  return model, info


def _ranks(model) -> dict:
  from lrjax.models.llama import PROJ_NAMES, get_proj_module

  out = {}
  for name in PROJ_NAMES:
    r = getattr(get_proj_module(model.layers[0], name), "rank", None)
    if r is not None:
      out[name] = int(r)
  return out


def weight_bytes(model) -> tuple[int, int]:
  """(bytes of every param and packed weight, bytes one decode step reads): the second leaves
  out the embedding table unless the LM head is tied to it."""
  from flax import nnx

  total = decode = 0
  for path, var in nnx.to_flat_state(nnx.state(model)):
    a = var[...]
    nb = int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
    total += nb
    is_table = tuple(map(str, path[-2:])) == ("embed", "embedding")
    if not is_table or model.lm_head is None:
      decode += nb
  return total, decode


def decode_kernels(model, fuse: bool = True) -> dict[str, int]:
  """Custom calls in the compiled one-token decode step (as the engine runs it), by target."""
  import re

  import jax
  import jax.numpy as jnp
  from flax import nnx

  import lrjax
  from lrjax.models import KVCache

  model.scan_layers = False
  gdef, state = nnx.split(model)
  step = type(model).decode
  step = lrjax.fuse(step) if fuse else step
  cache = KVCache.init(model.cfg, 1, 16, jnp.float32)
  f = jax.jit(lambda st, t, c: step(nnx.merge(gdef, st), t, c))
  hlo = f.lower(state, jnp.zeros((1,), jnp.int32), cache).compile().as_text()
  out: dict[str, int] = {}
  for target in re.findall(r'custom_call_target="([^"]+)"', hlo):
    out[target] = out.get(target, 0) + 1
  return out


# ------------------------------------------------------------------ the measurement


def hbm_bps(device_name: str) -> float | None:
  """The HBM roofline of the card named ``device_name`` (None: not a card in HBM_BPS)."""
  return next((bps for key, bps in HBM_BPS.items() if key in device_name), None)


def measure_read_bps(nbytes: int = READ_BYTES, reps: int = 3, threads: int | None = None) -> float:
  """Bytes/s of a streaming read of this machine's memory: ``np.max`` over an ``nbytes``
  float32 array split among ``threads`` (every core by default; numpy releases the GIL),
  the best of ``reps`` timed passes after one that touches the pages."""
  from concurrent.futures import ThreadPoolExecutor

  if nbytes < 4 or reps < 1:
    raise ValueError(f"{nbytes=} and {reps=}: expected at least 4 bytes and 1 rep")
  a = np.ones(nbytes // 4, np.float32)
  parts = np.array_split(a, max(1, threads or os.cpu_count() or 1))
  with ThreadPoolExecutor(len(parts)) as ex:
    best = float("inf")
    for i in range(reps + 1):
      t = time.perf_counter()
      list(ex.map(np.max, parts))
      if i:
        best = min(best, time.perf_counter() - t)
  return a.nbytes / best


def memory_roofline(device_kind: str | None = None, platform: str | None = None) -> dict:
  """The decode roofline's memory rate for this process's first device (or a device named
  ``device_kind`` on ``platform``, jax's "cpu" / "gpu" / ...): ``{"bytes_per_s", "source"}``.
  A GPU listed in ``HBM_BPS`` gets its rate; a CPU its read rate, measured now
  (:func:`measure_read_bps`, a few seconds); any other device None (no fraction is stated)."""
  if device_kind is None:
    import jax

    d = jax.devices()[0]
    device_kind, platform = d.device_kind, d.platform
  if platform == "cpu":
    threads = os.cpu_count() or 1
    return {
      "bytes_per_s": measure_read_bps(threads=threads),
      "source": f"measured: np.max over {READ_BYTES >> 20} MiB on {threads} threads, best of 3",
    }
  bps = hbm_bps(device_kind) if platform == "gpu" else None
  if bps is None:
    return {"bytes_per_s": None, "source": f"no memory rate listed for {device_kind}"}
  return {"bytes_per_s": bps, "source": f"HBM rate of the {device_kind} (lrjax.bench.HBM_BPS)"}


def _round(engine, c: int, s: BenchSettings, rng) -> dict:
  from lrjax.serving import Request, SamplingParams

  vocab = engine.cfg.vocab_size
  sp = SamplingParams(max_new_tokens=s.gen_len, temperature=0.0)
  reqs = [Request([int(t) for t in rng.integers(0, vocab, s.prompt_len)], sp) for _ in range(c)]
  t0 = time.perf_counter()
  results = engine.generate(reqs)
  short = [r for r in results if len(r.tokens) != s.gen_len]
  if short:
    raise RuntimeError(
      f"{len(short)} requests stopped early ({short[0].finish_reason}, "
      f"{len(short[0].tokens)} of {s.gen_len} tokens); the timing would be wrong"
    )
  first = [r.token_times[0] for r in results]
  last = [r.token_times[-1] for r in results]
  t_prefilled, t_end = max(first), max(last)
  decode_tokens = sum(len(r.tokens) - 1 for r in results)
  gaps = [g for r in results for g in np.diff(r.token_times[1:])]
  return dict(
    ttft_s=[float(r.ttft_s) for r in results],
    prefill_tps=c * s.prompt_len / (t_prefilled - t0),
    decode_tps=decode_tokens / (t_end - t_prefilled),
    decode_steps_per_s=(s.gen_len - 1) / (t_end - t_prefilled),
    itl_s=[float(g) for g in gaps],
    wall_s=t_end - t0,
  )


def run_bench(
  model,
  settings: BenchSettings = BenchSettings(),
  *,
  info: dict | None = None,
  roofline: dict | None = None,
  progress: bool = False,
):
  """Measures ``model`` through the engine at each concurrency level; returns a JSON-able dict
  (levels, settings, machine, versions, memory roofline). See the module docstring for the
  method. ``roofline``: :func:`memory_roofline`'s dict (default: measured or looked up here).
  ``progress``: a bar on stderr over each level's warm-up and rounds."""
  from tqdm.auto import tqdm

  from lrjax.serving import Engine

  s = settings
  info = dict(info or {})
  if "decode_weight_bytes" not in info:
    info["param_bytes"], info["decode_weight_bytes"] = weight_bytes(model)
  roofline = roofline or memory_roofline()
  bps = roofline["bytes_per_s"]
  max_len = s.prompt_len + s.gen_len + 1
  rng = np.random.default_rng(s.seed)
  levels = []
  t_start = time.perf_counter()
  bar = tqdm(total=len(s.concurrency) * (1 + s.reps), unit="step", disable=not progress)
  for c in s.concurrency:
    slots = s.slots or c
    t = time.perf_counter()
    bar.set_description(f"bench c={c}: compile and warm up")
    engine = Engine(model, max_slots=slots, max_len=max_len, buckets=(s.prompt_len,), fuse=s.fuse)
    engine.warmup()
    _round(engine, c, s, rng)  # one untimed round: every path taken once
    warm = time.perf_counter() - t
    bar.update()
    rounds = []
    for i in range(s.reps):
      bar.set_description(f"bench c={c}: round {i + 1} of {s.reps}")
      rounds.append(_round(engine, c, s, rng))
      bar.update()
    ttft = [np.median(r["ttft_s"]) for r in rounds]
    itl = np.asarray([g for r in rounds for g in r["itl_s"]])
    decode_tps = float(np.median([r["decode_tps"] for r in rounds]))
    steps = float(np.median([r["decode_steps_per_s"] for r in rounds]))
    lvl = dict(
      concurrency=c,
      slots=slots,
      prefill_tps=float(np.median([r["prefill_tps"] for r in rounds])),
      decode_tps=decode_tps,
      decode_steps_per_s=steps,
      decode_weight_gbs=steps * info["decode_weight_bytes"] / 1e9,
      weight_roofline_frac=steps * info["decode_weight_bytes"] / bps if bps else None,
      ttft_ms_median=float(np.median(ttft)) * 1e3,
      ttft_ms_max=float(np.median([max(r["ttft_s"]) for r in rounds])) * 1e3,
      itl_ms_median=float(np.median(itl)) * 1e3,
      itl_ms_p90=float(np.percentile(itl, 90)) * 1e3,
      rounds=[{k: v for k, v in r.items() if k != "itl_s"} for r in rounds],
      warmup_s=warm,
    )
    log.info(
      "bench c=%d: decode %.1f tok/s, prefill %.1f tok/s, TTFT %.0f ms, ITL %.1f ms",
      c,
      decode_tps,
      lvl["prefill_tps"],
      lvl["ttft_ms_median"],
      lvl["itl_ms_median"],
    )
    levels.append(lvl)
    del engine
  bar.close()
  return dict(
    benchmark="lrjax_bench",
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    model=info,
    settings=dataclasses.asdict(s),
    max_len=max_len,
    method="per level: engine warm-up and one untimed round, then reps rounds of c concurrent "
    "requests; medians over rounds",
    machine=machine(),
    versions=versions(),
    memory_roofline=roofline,
    levels=levels,
    wall_s=time.perf_counter() - t_start,
  )


def _nvidia_smi(*args: str) -> str | None:
  """``nvidia-smi ARGS``'s output, or None on a host without it."""
  import shutil
  import subprocess

  if shutil.which("nvidia-smi") is None:
    return None
  try:
    r = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20)
  except (OSError, subprocess.SubprocessError) as e:
    return f"unavailable: {e}"
  return r.stdout.strip()


def machine(topology: bool = False) -> dict:
  """What a results file records about the host and its accelerators (the card above all:
  timings compare only on the same one). ``topology``: also ``nvidia-smi topo -m`` (how the
  GPUs are linked)."""
  import jax

  cpu = ""
  try:
    with open("/proc/cpuinfo") as fh:
      cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "")
  except OSError:
    pass
  devices = jax.devices()
  info = {
    "platform": platform.platform(),
    "python": platform.python_version(),
    "machine": platform.machine(),
    "cpu": cpu,
    "cpu_count": os.cpu_count(),
    "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    "device": devices[0].device_kind,
    "devices": [str(d) for d in devices],
    "n_devices": len(devices),
  }
  smi = _nvidia_smi("--query-gpu=name,driver_version,memory.total", "--format=csv,noheader")
  if smi is not None:
    info["nvidia_smi"] = smi.splitlines()
    if topology:
      info["topology"] = _nvidia_smi("topo", "-m")
  return info


def versions(*extra: str) -> dict:
  """Installed versions of lrjax, jax, jaxlib, flax, numpy and ``extra`` (None: not installed)."""
  out = {"python": platform.python_version()}
  for pkg in ("lrjax", "jax", "jaxlib", "flax", "numpy", *extra):
    try:
      out[pkg] = importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
      out[pkg] = None
  return out


def format_table(result: dict) -> str:
  """A short text table of the levels."""
  head = (
    f"{'conc':>4} {'decode tok/s':>12} {'prefill tok/s':>13} {'TTFT ms':>9} "
    f"{'TTFT max':>9} {'ITL ms':>8} {'ITL p90':>8} {'weights GB/s':>12} {'roofline':>8}"
  )
  lines = [head]
  for lv in result["levels"]:
    frac = lv.get("weight_roofline_frac")
    lines.append(
      f"{lv['concurrency']:>4} {lv['decode_tps']:>12.1f} {lv['prefill_tps']:>13.1f} "
      f"{lv['ttft_ms_median']:>9.1f} {lv['ttft_ms_max']:>9.1f} {lv['itl_ms_median']:>8.1f} "
      f"{lv['itl_ms_p90']:>8.1f} {lv['decode_weight_gbs']:>12.2f} "
      + (f"{frac:>8.0%}" if frac is not None else f"{'-':>8}")
    )
  roof = result.get("memory_roofline") or {}
  if roof.get("bytes_per_s"):
    lines.append(f"roofline: {roof['bytes_per_s'] / 1e9:.1f} GB/s ({roof['source']})")
  return "\n".join(lines)


def plot(result: dict, path: str) -> str | None:
  """Writes a PNG of decode/prefill throughput and TTFT/ITL against concurrency to ``path``.
  Returns None, or the reason no plot was written (matplotlib is an optional dependency)."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return "matplotlib is not installed (pip install matplotlib for the plot)"
  lv = result["levels"]
  c = [x["concurrency"] for x in lv]
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
  a1.plot(c, [x["decode_tps"] for x in lv], marker="o", label="decode")
  a1.plot(c, [x["prefill_tps"] for x in lv], marker="s", label="prefill")
  a1.set_xlabel("concurrent requests")
  a1.set_ylabel("tokens/s")
  a1.set_yscale("log")
  a1.legend()
  a2.plot(c, [x["ttft_ms_median"] for x in lv], marker="o", label="TTFT (median)")
  a2.plot(c, [x["itl_ms_median"] for x in lv], marker="s", label="ITL (median)")
  a2.set_xlabel("concurrent requests")
  a2.set_ylabel("ms")
  a2.set_yscale("log")
  a2.legend()
  src = result["model"].get("source", {})
  fig.suptitle(f"lrjax bench: {next(iter(src.values()), '')} on {result['machine']['cpu']}")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return None


def parse_levels(text: str) -> tuple[int, ...]:
  """'1,4,8' -> (1, 4, 8)."""
  try:
    out = tuple(int(v) for v in text.split(",") if v.strip())
  except ValueError:
    raise ValueError(f"{text!r}: expected comma-separated positive ints like 1,4,8") from None
  if not out or min(out) < 1:
    raise ValueError(f"{text!r}: expected comma-separated positive ints like 1,4,8")
  return out


__all__: Sequence[str] = (
  "BenchSettings",
  "decode_kernels",
  "format_table",
  "load_model_for_bench",
  "parse_levels",
  "plot",
  "random_model",
  "run_bench",
  "weight_bytes",
)
