"""`lrjax serve` on one GPU: dense against low-rank (40 % of projection params removed) through
``lrjax.fuse``, Llama-3-8B shapes with random bf16 weights, at 1, 16 and 64 concurrent streaming
clients. One command; about 8 minutes on one H100 (mostly compiling: each model and client count
is an engine of that many slots, one prefill and one decode step each).

For each model and client count it records, from the same run:
  - TTFT and ITL p50/p99 at the client (a process of its own: ``python -m
    lrjax.serving.loadgen``) and at the engine (its Results' token times);
  - output tokens/s over the run;
  - the device step: the engine's own compiled decode step called back to back (each step's
    tokens feed the next, no host sync in between), median ms per step; and ITL / step.

  python benchmarks/serve_gpu.py                                   # the GPU run -> results JSON
  python benchmarks/serve_gpu.py --preset tiny --clients 1 2 --prompt-len 16 --new-tokens 8 \\
      --out /tmp/serve_gpu.json                                    # a CPU check of the script

``--transport http`` (default when fastapi and uvicorn import) serves over HTTP on 127.0.0.1;
``inproc`` drives the engine thread directly (the same loop, without HTTP). ``--prefill single
batched`` runs both admission policies (one prompt per prefill call; waiting prompts together,
the engine's default) and records TTFT for each; benchmarks/serve_prefill.py --preset 8b
compares prefill against earlier engines' at 16 and 64 concurrent requests.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from lrjax.bench import machine, versions

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def model_config(preset: str, layers: int | None):
  from lrjax.models import ModelConfig

  if preset == "tiny":
    cfg = ModelConfig(
      vocab_size=512,
      hidden_size=128,
      intermediate_size=448,
      num_layers=2,
      num_heads=8,
      num_kv_heads=4,
      head_dim=16,
    )
  else:
    cfg = ModelConfig.llama3_8b()
  return cfg.replace(num_layers=layers) if layers else cfg


def build(cfg, ratio: float | None, dtype, multiple: int):
  import jax
  from flax import nnx

  from lrjax.models import LlamaForCausalLM
  from lrjax.sharding.analysis import compressed_ranks

  ranks = None if ratio is None else [compressed_ranks(cfg, ratio, multiple=multiple)]
  t0 = time.perf_counter()
  m = LlamaForCausalLM(
    cfg,
    ranks=None if ranks is None else ranks * cfg.num_layers,
    dtype=dtype,
    param_dtype=dtype,
    scan_layers=False,
    rngs=nnx.Rngs(0),
  )
  jax.block_until_ready(nnx.state(m))
  return m, (None if ranks is None else ranks[0]), time.perf_counter() - t0


def device_step_ms(engine, calls: int = 32, reps: int = 3) -> float:
  """Median ms per decode step: ``calls`` of the engine's compiled decode step back to back
  (each one's tokens feed the next; one host sync at the end), every slot active."""
  attend = engine.attend_buckets[-1]
  params = engine._upload_params()
  times = []
  for _ in range(reps + 1):  # the first rep warms the dispatch path
    engine._reset_positions()
    tok = engine._tok_dev
    t0 = time.perf_counter()
    for _ in range(calls):
      tok, engine.cache = engine._decode(attend, engine.cache, tok, *params)
    tok.block_until_ready()
    times.append((time.perf_counter() - t0) / calls)
  engine._reset_positions()
  engine._reset_device_state()
  return float(np.median(times[1:])) * 1e3


def _pct(xs, q):
  return float(np.percentile(xs, q)) if len(xs) else None


def engine_view(results) -> dict:
  ttft = [r.ttft_s for r in results if r.ttft_s is not None]
  itl = [b - a for r in results for a, b in zip(r.token_times, r.token_times[1:])]
  return {
    "ttft_p50_ms": _pct(ttft, 50) and _pct(ttft, 50) * 1e3,
    "ttft_p99_ms": _pct(ttft, 99) and _pct(ttft, 99) * 1e3,
    "itl_p50_ms": _pct(itl, 50) and _pct(itl, 50) * 1e3,
    "itl_p99_ms": _pct(itl, 99) and _pct(itl, 99) * 1e3,
  }


def run_http(engine, reqs, concurrency: int) -> tuple[dict, list]:
  """The server in this process, the clients in another; returns (client summary, results)."""
  from lrjax.serving.loadgen import ClientResult, summarize
  from lrjax.serving.server import ServerThread, create_app

  app = create_app(engine, model_name="bench", max_queue=len(reqs))
  finished = []
  state = app.state.lrjax
  metrics_step = state.loop.on_step
  state.loop.on_step = lambda ev: (finished.extend(ev.finished), metrics_step(ev))
  with tempfile.TemporaryDirectory() as tmp, ServerThread(app) as srv:
    rin, rout = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
    with open(rin, "w") as fh:
      json.dump([dataclasses.asdict(r) for r in reqs], fh)
    cmd = [sys.executable, "-m", "lrjax.serving.loadgen", "--url", srv.url, "--model", "bench"]
    cmd += ["--requests", rin, "--out", rout, "--concurrency", str(concurrency)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")  # the client never touches the GPU
    subprocess.run(cmd, check=True, env=env, timeout=900)
    with open(rout) as fh:
      raw = json.load(fh)
  results = [ClientResult(request=q, **d) for q, d in zip(reqs, raw)]
  for r in results:
    if not r.ok:
      raise RuntimeError(f"a request failed: {r.status} {r.error}")
  return summarize(results), finished


def run_inproc(engine, reqs, concurrency: int) -> tuple[dict, list]:
  """The engine thread driven from asyncio in this process (no HTTP)."""
  from lrjax.serving import Request, SamplingParams
  from lrjax.serving.loop import EngineLoop

  finished = []

  async def go():
    loop = EngineLoop(engine, max_queue=len(reqs), on_step=lambda ev: finished.extend(ev.finished))
    loop.start()
    sem = asyncio.Semaphore(concurrency)
    firsts, gaps, t0 = [], [], time.perf_counter()

    async def one(q):
      async with sem:
        start = time.perf_counter()
        h = loop.submit(Request(q.prompt, SamplingParams(max_new_tokens=q.max_tokens)))
        last = None
        async for kind, _ in h:
          if kind == "tokens":
            now = time.perf_counter()
            if last is None:
              firsts.append(now - start)
            else:
              gaps.append(now - last)
            last = now

    await asyncio.gather(*(one(q) for q in reqs))
    wall = time.perf_counter() - t0
    loop.stop()
    tokens = sum(len(r.tokens) for r in finished)
    return {
      "requests": len(reqs),
      "ok": len(finished),
      "output_tokens": tokens,
      "wall_s": wall,
      "tokens_per_s": tokens / wall,
      "ttft_p50_s": _pct(firsts, 50),
      "ttft_p99_s": _pct(firsts, 99),
      "itl_p50_s": _pct(gaps, 50),
      "itl_p99_s": _pct(gaps, 99),
    }

  return asyncio.run(go()), finished


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", choices=("8b", "tiny"), default="8b")
  ap.add_argument("--layers", type=int, default=None, help="fewer layers (default: all)")
  ap.add_argument("--ratio", type=float, default=0.4)
  ap.add_argument("--models", nargs="+", choices=("dense", "lowrank"), default=["dense", "lowrank"])
  ap.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64])
  ap.add_argument("--rounds", type=int, default=2, help="requests per client")
  ap.add_argument("--prompt-len", type=int, default=128)
  ap.add_argument("--new-tokens", type=int, default=64)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--transport", choices=("auto", "http", "inproc"), default="auto")
  ap.add_argument(
    "--prefill", nargs="+", default=[None], help="admission policies to run (default: the engine's)"
  )
  ap.add_argument("--out", default=os.path.join(HERE, "results", "serve_gpu.json"))
  ap.add_argument("--no-plot", action="store_true")
  a = ap.parse_args(argv)
  import jax.numpy as jnp

  from lrjax.serving import Engine
  from lrjax.serving.engine import fusion_line
  from lrjax.serving.loadgen import ClientRequest
  from results_io import write_json

  transport = a.transport
  if transport == "auto":
    try:
      import fastapi  # noqa: F401
      import uvicorn  # noqa: F401

      transport = "http"
    except ImportError:
      transport = "inproc"
  dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[a.dtype]
  cfg = model_config(a.preset, a.layers)
  t_start = time.perf_counter()
  rec = {
    "what": "lrjax serve on one GPU: dense vs low-rank through lrjax.fuse, random weights, "
    "greedy streaming clients",
    "command": "python benchmarks/serve_gpu.py "
    + " ".join(argv if argv is not None else sys.argv[1:]),
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "machine": machine(),
    "versions": versions("fastapi", "uvicorn", "starlette", "triton", "jax-triton"),
    "config": {
      "preset": a.preset,
      "layers": cfg.num_layers,
      "ratio": a.ratio,
      "prompt_len": a.prompt_len,
      "new_tokens": a.new_tokens,
      "rounds": a.rounds,
      "dtype": a.dtype,
      "transport": transport,
    },
    "ranks": None,
    "records": [],
  }
  rng = np.random.default_rng(0)
  max_len = a.prompt_len + a.new_tokens + 1
  for kind in a.models:
    model, ranks, build_s = build(
      cfg, a.ratio if kind == "lowrank" else None, dtype, 8 if a.preset == "tiny" else 64
    )
    if ranks is not None:
      rec["ranks"] = ranks
    print(f"{kind}: built in {build_s:.1f} s", flush=True)
    for clients in a.clients:
      for policy in a.prefill:
        kw = dict(
          max_slots=clients, max_len=max_len, buckets=(a.prompt_len,), attend_buckets=(max_len,)
        )
        if policy is not None:
          kw["prefill"] = policy
        t0 = time.perf_counter()
        engine = Engine(model, **kw)
        fusion = engine.fusion_report()
        steps = engine.warmup()
        warm_s = time.perf_counter() - t0
        reqs = [
          ClientRequest(
            "completion",
            [int(t) for t in rng.integers(0, cfg.vocab_size, a.prompt_len)],
            max_tokens=a.new_tokens,
            stream=True,
          )
          for _ in range(clients * a.rounds)
        ]
        run = run_http if transport == "http" else run_inproc
        client, finished = run(engine, reqs, clients)
        step = device_step_ms(engine)
        ev = engine_view(finished)
        r = {
          "model": kind,
          "clients": clients,
          "prefill": policy or getattr(engine, "prefill", "single"),
          "warmup_s": warm_s,
          "warmup_steps": steps,
          "fusion": fusion_line(fusion),
          "client": client,
          "engine": ev,
          "step_ms": step,
          "itl_over_step": ev["itl_p50_ms"] / step if ev["itl_p50_ms"] else None,
          "tokens_per_s": client["tokens_per_s"],
        }
        rec["records"].append(r)
        print(
          f"{kind} clients={clients} prefill={r['prefill']}: {r['tokens_per_s']:.0f} tok/s, "
          f"TTFT p50 {ev['ttft_p50_ms']:.1f} ms, ITL p50 {ev['itl_p50_ms']:.2f} ms, "
          f"step {step:.2f} ms (ITL/step {r['itl_over_step']:.2f}); warmup {warm_s:.0f} s",
          flush=True,
        )
        write_json(a.out, rec)  # each record saved as it comes
        del engine
        gc.collect()
    del model
    gc.collect()
  ratios = {}
  for r in rec["records"]:
    if r["model"] == "lowrank":
      d = next(
        (
          q
          for q in rec["records"]
          if q["model"] == "dense" and (q["clients"], q["prefill"]) == (r["clients"], r["prefill"])
        ),
        None,
      )
      if d:
        ratios[f"{r['clients']}/{r['prefill']}"] = r["tokens_per_s"] / d["tokens_per_s"]
  rec["lowrank_over_dense_tokens_per_s"] = ratios
  rec["total_s"] = time.perf_counter() - t_start
  write_json(a.out, rec)
  print(f"wrote {a.out} in {rec['total_s']:.0f} s; low-rank / dense tokens/s: {ratios}")
  if not a.no_plot:
    try:
      print("plot:", plot(a.out))
    except ImportError as e:
      print(f"no plot ({e})")
  return 0


def plot(path_json: str) -> str:
  """Tokens/s, and ITL against the device step, over client count: dense vs low-rank."""
  from plotting import pyplot, save_beside

  plt = pyplot()
  with open(path_json) as fh:
    recs = json.load(fh)["records"]
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
  for model, color in (("dense", "tab:gray"), ("lowrank", "tab:blue")):
    for policy, style in (("single", "o-"), ("batched", "s--")):
      rs = sorted(
        (r for r in recs if r["model"] == model and r["prefill"] == policy),
        key=lambda r: r["clients"],
      )
      if not rs:
        continue
      x = [r["clients"] for r in rs]
      lab = f"{model} ({policy} prefill)"
      axes[0].plot(x, [r["tokens_per_s"] for r in rs], style, color=color, label=lab)
      axes[1].plot(
        x, [r["engine"]["itl_p50_ms"] for r in rs], style, color=color, label=f"{lab} ITL"
      )
      axes[1].plot(x, [r["step_ms"] for r in rs], ":", color=color, label=f"{model} device step")
      axes[2].plot(x, [r["engine"]["ttft_p50_ms"] for r in rs], style, color=color, label=lab)
  titles = ("output tokens/s", "ms: ITL p50 and device step", "ms: TTFT p50")
  for ax, t in zip(axes, titles):
    ax.set(xlabel="concurrent clients", title=t)
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
  return save_beside(fig, path_json)


if __name__ == "__main__":
  sys.exit(main())
