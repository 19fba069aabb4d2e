"""``lrjax generate`` and ``lrjax serve``: an lrjax checkpoint on 1 or N devices, text in and out.

Both read the tokenizer, chat template and generation settings that ``lrjax convert`` carried
into the checkpoint (:func:`lrjax.text.load_text`), and run the steps through ``lrjax.fuse``
unless ``--no-fuse`` is given; one line at start-up says what was fused and which kernel serves
each op here.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from lrjax.cli import subcommand

# lrjax.sharding.STRATEGIES and "auto", spelled here so the CLI imports no jax before
# --cpu-devices sets XLA_FLAGS (tests/sharding checks the two agree)
STRATEGY_CHOICES = (
  "auto",
  "lowrank_tp",
  "lowrank_split",
  "lowrank_megatron",
  "naive_tp",
  "repl_u_tp",
  "dense",
)

log = logging.getLogger("lrjax.serving")


def _ids(s: str) -> list[int]:
  try:
    out = [int(t) for t in s.split(",") if t.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"{s!r}: expected comma-separated token ids like 1,2,3")  # noqa: B904
  return out


def _engine_flags(p: argparse.ArgumentParser, max_len: int, slots: int):
  p.add_argument("--ckpt", required=True, metavar="DIR", help="lrjax checkpoint dir")
  p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (devices)")
  p.add_argument(
    "--strategy",
    choices=STRATEGY_CHOICES,
    help="default: lowrank_tp for low-rank checkpoints, dense otherwise; auto: the one the "
    "cost model predicts fastest here (lrjax.sharding.explain)",
  )
  p.add_argument("--max-len", type=int, default=max_len, help="KV cache length per request")
  p.add_argument("--slots", type=int, default=slots, help="concurrent decode slots")
  p.add_argument("--lowrank-kv", action="store_true", help="cache x·U_k, x·U_v (rank space)")
  p.add_argument(
    "--no-fuse", action="store_true", help="run XLA's own GEMMs instead of lrjax.fuse's kernels"
  )
  p.add_argument(
    "--cpu-devices",
    type=int,
    default=0,
    help="simulate this many CPU devices (for --tp on a CPU-only host)",
  )


def _load(a):
  """(engine, tokenizer or None, generation defaults, fusion summary) for the flags."""
  if a.cpu_devices:
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={a.cpu_devices}"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from lrjax import text
  from lrjax.checkpoint import read_checkpoint_arg
  from lrjax.serving import load_engine
  from lrjax.serving.engine import fusion_line

  for name in ("tp", "max_len", "slots"):
    v = getattr(a, name)
    if v < 1 or (name == "max_len" and v < 2):
      raise ValueError(f"--{name.replace('_', '-')}={v} must be >= {2 if name == 'max_len' else 1}")
  meta = read_checkpoint_arg(a.ckpt)  # a clear error before anything is loaded
  n_pos = meta["config"].get("max_position_embeddings")
  max_len = a.max_len if not n_pos else min(a.max_len, int(n_pos))
  tok, gen = text.load_text(a.ckpt)
  engine = load_engine(
    a.ckpt,
    tp=a.tp,
    strategy=a.strategy,
    max_slots=a.slots,
    max_len=max_len,
    lowrank_kv=a.lowrank_kv,
    fuse=not a.no_fuse,
  )
  summary = engine.fusion_report()
  line = fusion_line(summary)
  log.info("%s", line)
  print(f"lrjax: {line}", file=sys.stderr)
  for why in summary.get("near_miss_reasons", []):
    log.info("left unfused: %s", why)
  if tok is None:
    print(f"lrjax: {a.ckpt} has no tokenizer.json: token ids in and out", file=sys.stderr)
  return engine, tok, gen, summary


@subcommand("generate", help="generate text (or token ids) from an lrjax checkpoint")
def generate(p: argparse.ArgumentParser):
  _engine_flags(p, max_len=512, slots=8)
  p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="repeatable")
  p.add_argument(
    "--chat",
    action="append",
    default=[],
    metavar="TEXT",
    help="a user message through the model's chat template (repeatable: concurrent conversations)",
  )
  p.add_argument("--system", metavar="TEXT", help="a system message before each --chat message")
  p.add_argument(
    "--prompt-ids",
    type=_ids,
    action="append",
    default=[],
    metavar="IDS",
    help="comma-separated prompt token ids; repeat for concurrent requests",
  )
  p.add_argument(
    "--max-new-tokens",
    type=int,
    default=None,
    help="default: the generation config's max_new_tokens, else 64",
  )
  p.add_argument("--temperature", type=float, default=None, help="default: generation config")
  p.add_argument("--top-k", type=int, default=None)
  p.add_argument("--top-p", type=float, default=None)
  p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string")
  p.add_argument("--stop-ids", type=_ids, default=[], metavar="IDS")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--no-warmup", action="store_true", help="time the first (compiling) run")

  def run(a):
    if not (a.prompt or a.chat or a.prompt_ids):
      raise ValueError("give at least one --prompt, --chat or --prompt-ids")
    from lrjax.serving import Request, SamplingParams

    given = {k: getattr(a, k) for k in ("temperature", "top_k", "top_p", "max_new_tokens", "seed")}
    try:  # the flags given, checked before the model is loaded
      SamplingParams(**{k: v for k, v in given.items() if v is not None})
    except (TypeError, ValueError) as e:
      flag = str(e).split("=", 1)
      raise ValueError(f"--{flag[0].replace('_', '-')} {flag[1]}") from None
    engine, tok, gen, _ = _load(a)

    if (a.prompt or a.chat) and tok is None:
      raise ValueError(f"{a.ckpt} has no tokenizer.json; give --prompt-ids instead of text")
    reqs: list[tuple[str, list[int]]] = []
    for s in a.prompt:
      reqs.append(("text", tok.encode(s)))
    for s in a.chat:
      msgs = ([{"role": "system", "content": a.system}] if a.system else []) + [
        {"role": "user", "content": s}
      ]
      reqs.append(("text", tok.encode_chat(msgs)))
    for ids in a.prompt_ids:
      reqs.append(("ids", ids))
    sp = SamplingParams(
      temperature=gen.temperature if a.temperature is None else a.temperature,
      top_k=gen.top_k if a.top_k is None else a.top_k,
      top_p=gen.top_p if a.top_p is None else a.top_p,
      max_new_tokens=a.max_new_tokens if a.max_new_tokens is not None else gen.max_new_tokens or 64,
      stop_tokens=tuple(dict.fromkeys(list(gen.eos_ids) + list(a.stop_ids))),
      seed=a.seed,
    )
    room = min(engine.max_len - len(ids) for _, ids in reqs)
    if 0 < room < sp.max_new_tokens:
      n_pos = engine.cfg.max_position_embeddings
      at_limit = n_pos and engine.max_len >= n_pos
      more = "the model's position limit" if at_limit else "raise --max-len for more"
      print(
        f"lrjax: at most {room} new tokens fit after the longest prompt in the {engine.max_len}"
        f"-token cache (asked for {sp.max_new_tokens}); {more}",
        file=sys.stderr,
      )
    plan = engine.plan
    print(
      f"model {engine.cfg.model_type} layers={engine.cfg.num_layers} "
      f"strategy={plan.strategy if plan else 'single-device'} tp={plan.tp if plan else 1}",
      file=sys.stderr if tok is not None and not a.prompt_ids else sys.stdout,
    )
    if not a.no_warmup:  # compile the prompt buckets used and the decode step before timing
      t0 = time.perf_counter()
      engine.generate(
        [
          Request(ids, SamplingParams(max_new_tokens=2))
          # one prompt per length bucket; a prompt no bucket holds keys on its length, and the
          # engine then says what is wrong with it
          for ids in {
            next((b for b in engine.buckets if b >= len(ids)), len(ids)): ids for _, ids in reqs
          }.values()
        ]
      )
      print(f"compiled in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    return _run_generate(engine, tok, reqs, sp, a.stop)

  return run


def _run_generate(engine, tok, reqs, sp, stops) -> int:
  from lrjax.serving import Request
  from lrjax.text import TextStream

  out = sys.stdout
  live = len(reqs) == 1 and reqs[0][0] == "text"  # one text request: stream it as it comes
  streams, texts, results = {}, {}, {}
  t0 = time.perf_counter()
  for kind, ids in reqs:
    rid = engine.submit(Request(ids, sp))
    streams[rid] = TextStream(tok, ids, stops, sp.stop_tokens) if kind == "text" else None
    texts[rid] = []
  order = list(streams)
  while engine.busy:
    ev = engine.step_events()
    for rid, toks in ev.tokens.items():
      ts = streams[rid]
      if ts is None or ts.done:
        continue
      for t in toks:
        piece = ts.push(t)
        texts[rid].append(piece)
        if live and piece:
          out.write(piece)
          out.flush()
        if ts.done:
          if ts.reason == "stop_string":
            engine.cancel(rid)
          break
    for r in ev.finished:
      results[r.id] = r
  dt = time.perf_counter() - t0
  n = 0
  for i, rid in enumerate(order):
    r, ts = results[rid], streams[rid]
    if r.finish_reason == "error":
      print(f"[{i}] error: {r.error}", file=sys.stderr)
      continue
    if ts is not None:
      tail = ts.finish()
      texts[rid].append(tail)
      reason = "stop" if ts.reason else r.finish_reason
      n += ts.tokens
      if live:
        out.write(tail + "\n")
      else:
        print(f"[{i}] {''.join(texts[rid])}")
      print(f"[{i}] {ts.tokens} tokens ({reason}, ttft {r.ttft_s * 1e3:.1f} ms)", file=sys.stderr)
    else:
      n += len(r.tokens)
      print(
        f"[{i}] prompt={r.prompt} -> {','.join(map(str, r.tokens))} "
        f"({r.finish_reason}, ttft {r.ttft_s * 1e3:.1f} ms)"
      )
  stats = sys.stderr if all(s is not None for s in streams.values()) else sys.stdout
  print(f"{n} tokens in {dt:.3f} s: {n / dt:.1f} tokens/s", file=stats)
  done = [r for r in results.values() if r.token_times]
  if done:
    t_first = min(r.token_times[0] for r in done)
    t_last = max(r.token_times[-1] for r in done)
    if n > len(done) and t_last > t_first:
      rate = (n - len(done)) / (t_last - t_first)
      print(f"decode after the first token: {rate:.1f} tokens/s", file=stats)
  return 1 if any(r.finish_reason == "error" for r in results.values()) else 0


@subcommand("serve", help="serve an lrjax checkpoint over HTTP (OpenAI API)")
def serve(p: argparse.ArgumentParser):
  _engine_flags(p, max_len=2048, slots=8)
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--port", type=int, default=8000)
  p.add_argument("--model-name", help="the model id clients send (default: the ckpt dir's name)")
  p.add_argument(
    "--max-queue", type=int, default=64, help="requests that may wait for a slot; then 429"
  )
  p.add_argument(
    "--drain-timeout",
    type=float,
    default=30.0,
    help="seconds SIGTERM lets running requests finish before cancelling them",
  )
  p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))

  def run(a):
    if not 0 <= a.port < 65536:
      raise ValueError(f"--port={a.port} must be in [0, 65535]")
    if a.max_queue < 0 or a.drain_timeout <= 0:
      raise ValueError("--max-queue must be >= 0 and --drain-timeout > 0")
    try:
      from lrjax.serving.server import create_app, make_server
    except ImportError as e:
      print(
        f"lrjax serve needs fastapi and uvicorn ({e}); pip install fastapi uvicorn", file=sys.stderr
      )
      return 2
    engine, tok, gen, summary = _load(a)
    t0 = time.perf_counter()
    n = engine.warmup(progress=True)  # every step compiled before the port opens
    print(f"lrjax: warmed up {n} steps in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    name = a.model_name or os.path.basename(os.path.normpath(a.ckpt))
    plan = engine.plan
    meta = {
      "fusion": summary,
      "max_len": engine.max_len,
      "max_slots": engine.max_slots,
      "tp": plan.tp if plan else 1,
      "strategy": plan.strategy if plan else "single-device",
      "lowrank_kv": engine.lowrank_kv,
      "tokenizer": tok is not None,
      "chat_template": bool(tok is not None and tok.has_chat_template),
      "eos_token_ids": list(gen.eos_ids),
    }
    app = create_app(
      engine,
      model_name=name,
      tokenizer=tok,
      defaults=gen,
      max_queue=a.max_queue,
      metadata=meta,
      drain_timeout=a.drain_timeout,
    )
    server = make_server(app, a.host, a.port, drain_timeout=a.drain_timeout, log_level=a.log_level)
    print(f"lrjax: serving {name} on http://{a.host}:{a.port}/v1", file=sys.stderr, flush=True)
    server.run()
    print("lrjax: stopped", file=sys.stderr)
    return 0

  return run
