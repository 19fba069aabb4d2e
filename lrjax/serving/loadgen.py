"""A load generator for an OpenAI-compatible server: N concurrent clients, streaming or not, with
time to first token (TTFT), inter-token latency (ITL) and throughput measured at the client.

  reqs = [ClientRequest("completion", [1, 2, 3], max_tokens=32, stream=True), ...]
  results = asyncio.run(run_load("http://127.0.0.1:8000", "model", reqs, concurrency=64))
  summary = summarize(results)        # p50/p99 TTFT and ITL, tokens/s, counts

It asks for ``return_token_ids`` so results can be compared token for token. TTFT is measured
from sending the request to the first chunk carrying a token; ITL between chunks carrying
tokens (a chunk carries one step's token). Needs ``httpx``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass
class ClientRequest:
  kind: str  # "completion" | "chat"
  prompt: Any  # completion: text or token ids; chat: a list of messages
  max_tokens: int = 16
  stream: bool = True
  temperature: float = 0.0
  stop: list[str] | None = None
  seed: int | None = None


@dataclasses.dataclass
class ClientResult:
  request: ClientRequest
  status: int = 0
  text: str = ""
  token_ids: list[int] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None
  usage: dict | None = None
  t_start: float = 0.0
  t_first: float | None = None  # first token arrived (streaming)
  t_end: float = 0.0
  token_times: list[float] = dataclasses.field(default_factory=list)  # chunks with tokens
  error: str | None = None
  done_marker: bool = False  # the stream ended with data: [DONE]

  @property
  def ok(self) -> bool:
    return self.status == 200 and self.error is None and self.finish_reason is not None


def _body(req: ClientRequest, model: str) -> dict:
  body: dict[str, Any] = {
    "model": model,
    "max_tokens": req.max_tokens,
    "temperature": req.temperature,
    "stream": req.stream,
    "return_token_ids": True,
  }
  if req.stream:
    body["stream_options"] = {"include_usage": True}
  if req.stop:
    body["stop"] = req.stop
  if req.seed is not None:
    body["seed"] = req.seed
  body["messages" if req.kind == "chat" else "prompt"] = req.prompt
  return body


async def run_one(client, url: str, model: str, req: ClientRequest) -> ClientResult:
  """Send one request and record what came back, and when."""
  path = "/v1/chat/completions" if req.kind == "chat" else "/v1/completions"
  res = ClientResult(req, t_start=time.perf_counter())
  try:
    if not req.stream:
      r = await client.post(url + path, json=_body(req, model))
      res.status, res.t_end = r.status_code, time.perf_counter()
      data = r.json()
      if r.status_code != 200:
        res.error = json.dumps(data.get("error", data))
        return res
      c = data["choices"][0]
      res.text = c["message"]["content"] if req.kind == "chat" else c["text"]
      res.token_ids, res.finish_reason, res.usage = (
        c.get("token_ids", []),
        c["finish_reason"],
        data["usage"],
      )
      return res
    async with client.stream("POST", url + path, json=_body(req, model)) as r:
      res.status = r.status_code
      if r.status_code != 200:
        res.error = (await r.aread()).decode()
        return res
      parts = []
      async for line in r.aiter_lines():
        if not line.startswith("data: "):
          continue
        payload = line[6:]
        if payload == "[DONE]":
          res.done_marker = True
          break
        data = json.loads(payload)
        if "error" in data:
          res.error = json.dumps(data["error"])
          continue
        if data.get("usage"):
          res.usage = data["usage"]
        for c in data.get("choices", []):
          ids = c.get("token_ids") or []
          if ids:
            now = time.perf_counter()
            if res.t_first is None:
              res.t_first = now
            res.token_times.append(now)
            res.token_ids += ids
          piece = c["delta"].get("content") if req.kind == "chat" else c.get("text")
          parts.append(piece or "")
          if c.get("finish_reason"):
            res.finish_reason = c["finish_reason"]
      res.text = "".join(parts)
  except Exception as e:  # noqa: BLE001 - recorded per request, never lost
    res.error = f"{type(e).__name__}: {e}"
  res.t_end = time.perf_counter()
  return res


async def run_load(
  url: str, model: str, reqs: Sequence[ClientRequest], concurrency: int, timeout: float = 300.0
) -> list[ClientResult]:
  """Run ``reqs`` with at most ``concurrency`` in flight; results in the order of ``reqs``."""
  import httpx

  sem = asyncio.Semaphore(concurrency)
  limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
  async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

    async def one(r):
      async with sem:
        return await run_one(client, url, model, r)

    return list(await asyncio.gather(*(one(r) for r in reqs)))


def _pct(xs, q):
  return float(np.percentile(xs, q)) if len(xs) else None


def summarize(results: Sequence[ClientResult]) -> dict:
  """p50/p99 TTFT (streams) and ITL (seconds), output tokens/s over the whole run, counts."""
  ok = [r for r in results if r.ok]
  ttft = [r.t_first - r.t_start for r in ok if r.t_first is not None]
  itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
  tokens = sum(len(r.token_ids) for r in ok)
  wall = (max(r.t_end for r in results) - min(r.t_start for r in results)) if results else 0.0
  return {
    "requests": len(results),
    "ok": len(ok),
    "errors": len(results) - len(ok),
    "streams": sum(r.request.stream for r in results),
    "output_tokens": tokens,
    "wall_s": wall,
    "tokens_per_s": tokens / wall if wall > 0 else None,
    "ttft_p50_s": _pct(ttft, 50),
    "ttft_p99_s": _pct(ttft, 99),
    "itl_p50_s": _pct(itl, 50),
    "itl_p99_s": _pct(itl, 99),
    "latency_p50_s": _pct([r.t_end - r.t_start for r in ok], 50),
  }


def mixed_requests(
  n: int,
  seed: int,
  *,
  max_prompt: int,
  max_len: int,
  tokenizer=None,
  texts: Sequence[str] = (),
  vocab_size: int = 0,
  max_tokens: tuple[int, int] = (4, 48),
) -> list[tuple[ClientRequest, list[int]]]:
  """``n`` greedy requests of mixed kinds, lengths and stream modes, each with the prompt ids
  the server will see. With a tokenizer: completions of text cut from ``texts`` and chats with
  one user message; without: completions of random token ids below ``vocab_size``."""
  rng = np.random.default_rng(seed)
  words = " ".join(texts).split()
  out = []
  while len(out) < n:
    stream = bool(rng.integers(2))
    if tokenizer is None:
      ids = [int(t) for t in rng.integers(0, vocab_size, int(rng.integers(1, max_prompt + 1)))]
      req, prompt_ids = ClientRequest("completion", ids, stream=stream), ids
    else:
      start = int(rng.integers(0, max(1, len(words) - 1)))
      k = int(rng.integers(1, 40))
      text = " ".join(words[start : start + k])
      if rng.integers(2):
        msgs = [{"role": "user", "content": text}]
        req, prompt_ids = ClientRequest("chat", msgs, stream=stream), tokenizer.encode_chat(msgs)
      else:
        req, prompt_ids = ClientRequest("completion", text, stream=stream), tokenizer.encode(text)
    room = max_len - len(prompt_ids)
    if len(prompt_ids) > max_prompt or room < 1:
      continue
    req.max_tokens = min(room, int(rng.integers(max_tokens[0], max_tokens[1] + 1)))
    out.append((req, prompt_ids))
  return out


def check_exact(
  pairs: Sequence[tuple[ClientRequest, list[int]]],
  results: Sequence[ClientResult],
  alone,
  eos_ids: Sequence[int] = (),
  detokenize=None,
) -> list[str]:
  """Every result against the same request run alone: ``alone(prompt_ids, max_tokens)`` → the
  tokens it generates. Returns one line per difference (empty when all match): a lost, failed,
  cut-short or duplicated response, other tokens, text, finish reason or usage."""
  problems = []
  if len(results) != len(pairs):
    problems.append(f"{len(pairs)} requests sent, {len(results)} results")
  for i, ((req, ids), res) in enumerate(zip(pairs, results)):
    tag = f"request {i} ({req.kind}, stream={req.stream}, max_tokens={req.max_tokens})"
    if not res.ok:
      problems.append(f"{tag}: status {res.status}, error {res.error}")
      continue
    if req.stream and not res.done_marker:
      problems.append(f"{tag}: the stream did not end with data: [DONE]")
    want = alone(ids, req.max_tokens)
    if res.token_ids != want:
      problems.append(f"{tag}: tokens {res.token_ids} != alone {want}")
      continue
    reason = "stop" if want and want[-1] in eos_ids else "length"
    if res.finish_reason != reason:
      problems.append(f"{tag}: finish_reason {res.finish_reason} != {reason}")
    if res.usage is None or res.usage.get("completion_tokens") != len(want):
      problems.append(f"{tag}: usage {res.usage} does not count {len(want)} tokens")
    if detokenize is not None and res.text != detokenize(ids, want):
      problems.append(f"{tag}: text {res.text!r} != {detokenize(ids, want)!r}")
  return problems


def main(argv=None) -> int:
  """``python -m lrjax.serving.loadgen --url URL --model NAME --requests IN.json --out OUT.json
  --concurrency N``: the client side in a process of its own (so its parsing never competes
  with the server for one interpreter). IN.json: a list of ClientRequest fields."""
  import argparse

  ap = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
  ap.add_argument("--url", required=True)
  ap.add_argument("--model", required=True)
  ap.add_argument("--requests", required=True)
  ap.add_argument("--out", required=True)
  ap.add_argument("--concurrency", type=int, required=True)
  a = ap.parse_args(argv)
  with open(a.requests) as fh:
    reqs = [ClientRequest(**r) for r in json.load(fh)]
  results = asyncio.run(run_load(a.url, a.model, reqs, a.concurrency))
  out = []
  for r in results:
    d = dataclasses.asdict(r)
    d.pop("request")
    out.append(d)
  with open(a.out, "w") as fh:
    json.dump(out, fh)
  return 0


if __name__ == "__main__":
  import sys

  sys.exit(main())
