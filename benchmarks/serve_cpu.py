"""`lrjax serve` under load on CPU: N concurrent clients (mixed prompt and output lengths,
completions and chats, streaming and not) against the server in-process over real HTTP on
127.0.0.1, on the tiny chat fixture with 30 % of its projection params removed.

Every response is checked against the same request run alone (greedy: identical tokens, text,
finish reason and usage; none lost, duplicated or cut short), then p50/p99 TTFT and ITL (at the
client) and output tokens/s are written to benchmarks/results/serve_cpu.json.

  python benchmarks/serve_cpu.py                       # 64 clients, 16 slots
  python benchmarks/serve_cpu.py --clients 16 --out /tmp/s.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import sys
import time

from lrjax.bench import machine, versions

os.environ.setdefault("RAYON_NUM_THREADS", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CHAT = os.path.join(REPO, "tests", "fixtures", "hf", "llama_chat")
CORPUS = os.path.join(REPO, "tests", "fixtures", "text", "corpus.txt")
sys.path.insert(0, HERE)


def build_model(ratio: float = 0.3):
  import lrjax
  from lrjax.models import from_hf

  return lrjax.compress(from_hf(CHAT), ratio=ratio, method="svd", block=8, progress=False)


def run(
  model,
  clients: int = 64,
  slots: int = 16,
  max_len: int = 128,
  seed: int = 0,
  prefill: str | None = None,
) -> tuple[dict, list[str], dict]:
  """Serve ``model`` and drive ``clients`` concurrent requests; returns (summary, problems,
  timings). ``prefill`` ("single" or "batched"; default the engine's) picks the admission
  policy when the engine has one."""
  from lrjax import text
  from lrjax.serving import Engine, Request, SamplingParams
  from lrjax.serving.loadgen import check_exact, mixed_requests, run_load, summarize
  from lrjax.serving.server import ServerThread, create_app

  tok, gen = text.load_text(CHAT)
  kw = dict(max_slots=slots, max_len=max_len, buckets=(16, 32, 64), attend_buckets=(max_len,))
  if prefill is not None:
    kw["prefill"] = prefill
  t0 = time.perf_counter()
  engine = Engine(model, **kw)
  engine.warmup()
  t_warm = time.perf_counter() - t0
  app = create_app(engine, model_name="tiny-chat", tokenizer=tok, defaults=gen, max_queue=clients)
  with open(CORPUS, encoding="utf-8") as fh:
    corpus = fh.read().split("\n\n")
  pairs = mixed_requests(
    clients, seed, max_prompt=engine.max_prompt_len, max_len=max_len, tokenizer=tok, texts=corpus
  )
  finished = []  # the engine's own view: its Results (submit → token times at the engine)
  state = app.state.lrjax
  metrics_step = state.loop.on_step
  state.loop.on_step = lambda ev: (finished.extend(ev.finished), metrics_step(ev))
  t0 = time.perf_counter()
  with ServerThread(app) as srv:
    results = asyncio.run(
      run_load(srv.url, "tiny-chat", [p[0] for p in pairs], concurrency=clients)
    )
  t_load = time.perf_counter() - t0
  alone_engine = Engine(model, **kw)
  cache: dict = {}

  def alone(ids, n):
    key = (tuple(ids), n)
    if key not in cache:
      sp = SamplingParams(max_new_tokens=n, stop_tokens=tuple(gen.eos_ids))
      cache[key] = alone_engine.generate([Request(ids, sp)])[0].tokens
    return cache[key]

  def detok(ids, toks):
    ts = text.TextStream(tok, ids, eos_ids=gen.eos_ids)
    return "".join(ts.push(t) for t in toks) + ts.finish()

  t0 = time.perf_counter()
  problems = check_exact(pairs, results, alone, gen.eos_ids, detok)
  t_check = time.perf_counter() - t0
  summary = {"client": summarize(results), "engine": engine_view(finished)}
  summary["prompt_tokens_p50"] = float(sorted(len(p[1]) for p in pairs)[len(pairs) // 2])
  return summary, problems, {"warmup_s": t_warm, "load_s": t_load, "check_s": t_check}


def engine_view(results) -> dict:
  """p50/p99 TTFT and ITL as the engine saw them (its Results' times), seconds."""
  import numpy as np

  ttft = [r.ttft_s for r in results if r.ttft_s is not None]
  itl = [b - a for r in results for a, b in zip(r.token_times, r.token_times[1:])]
  pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
  return {
    "requests": len(results),
    "ttft_p50_s": pct(ttft, 50),
    "ttft_p99_s": pct(ttft, 99),
    "itl_p50_s": pct(itl, 50),
    "itl_p99_s": pct(itl, 99),
  }


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--clients", type=int, default=64)
  ap.add_argument("--slots", type=int, default=16)
  ap.add_argument("--max-len", type=int, default=128)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default=os.path.join(HERE, "results", "serve_cpu.json"))
  a = ap.parse_args(argv)
  from results_io import write_json

  model = build_model()
  summary, problems, times = run(model, a.clients, a.slots, a.max_len, a.seed)
  for p in problems:
    print("MISMATCH", p)
  rec = {
    "what": "lrjax serve under load on CPU: tiny chat fixture (2 layers, hidden 64, vocab 384, "
    "30 % of projection params removed), greedy, every response checked against the request "
    "run alone",
    "command": "python benchmarks/serve_cpu.py " + " ".join(argv or sys.argv[1:]),
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "machine": machine(),
    "versions": versions("fastapi", "uvicorn"),
    "config": {"clients": a.clients, "slots": a.slots, "max_len": a.max_len, "seed": a.seed},
    "summary": summary,
    "mismatches": len(problems),
    "seconds": times,
  }
  write_json(a.out, rec)
  c, e = summary["client"], summary["engine"]
  ms = lambda x: f"{x * 1e3:.1f}"  # noqa: E731
  print(
    f"{c['ok']}/{c['requests']} ok, {len(problems)} mismatches; client TTFT p50 "
    f"{ms(c['ttft_p50_s'])} ms p99 {ms(c['ttft_p99_s'])} ms; engine TTFT p50 "
    f"{ms(e['ttft_p50_s'])} p99 {ms(e['ttft_p99_s'])} ms, ITL p50 {ms(e['itl_p50_s'])} p99 "
    f"{ms(e['itl_p99_s'])} ms; {c['tokens_per_s']:.0f} tokens/s; load {times['load_s']:.1f} s"
    f" -> {a.out}"
  )
  return 1 if problems or c["errors"] else 0


if __name__ == "__main__":
  sys.exit(main())
