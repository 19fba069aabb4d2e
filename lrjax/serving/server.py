"""``lrjax serve``: an OpenAI-compatible HTTP server (FastAPI under uvicorn) over an
:class:`~lrjax.serving.engine.Engine` stepping in its own thread.

  POST /v1/completions         streaming (SSE, ``data: [DONE]``) or not, with usage
  POST /v1/chat/completions    the same through the model's chat template
  GET  /v1/models              the model, and what lrjax fused and which kernels serve it
  GET  /health                 200 while the engine thread runs, 503 when draining or dead
  GET  /metrics                Prometheus: TTFT and ITL histograms, queue depth, running
                               requests, tokens, requests by finish reason, rejections

A bad request gets 400 with OpenAI's error JSON naming the field; a full admission queue gets
429. A client that disconnects has its request cancelled (its slot is free at the next step).
SIGTERM stops admission (503 for new requests), lets running requests finish for up to
``drain_timeout`` seconds, cancels the rest, and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from lrjax.serving import api
from lrjax.serving.engine import Engine, Request, StepEvents
from lrjax.serving.loop import EngineLoop, QueueFull

log = logging.getLogger("lrjax.serving")

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0)


class Metrics:
  """The server's Prometheus metrics, in a registry of their own."""

  def __init__(self, loop: EngineLoop):
    import prometheus_client as pc

    self.registry = r = pc.CollectorRegistry()
    self.ttft = pc.Histogram(
      "lrjax_time_to_first_token_seconds", "Submit to first token", buckets=TTFT_BUCKETS, registry=r
    )
    self.itl = pc.Histogram(
      "lrjax_inter_token_latency_seconds",
      "Between a request's tokens",
      buckets=ITL_BUCKETS,
      registry=r,
    )
    self.queue = pc.Gauge("lrjax_queue_depth", "Requests waiting for a slot", registry=r)
    self.queue.set_function(lambda: loop.queue_depth)
    self.running = pc.Gauge("lrjax_running_requests", "Requests in a slot", registry=r)
    self.running.set_function(lambda: loop.running)
    self.tokens = pc.Counter("lrjax_generated_tokens", "Generated tokens", registry=r)
    self.prompt_tokens = pc.Counter("lrjax_prompt_tokens", "Prompt tokens admitted", registry=r)
    self.requests = pc.Counter("lrjax_requests", "Finished requests", ["finish_reason"], registry=r)
    self.rejected = pc.Counter(
      "lrjax_rejected_requests", "Refused requests", ["reason"], registry=r
    )

  def on_step(self, ev: StepEvents):
    self.tokens.inc(sum(len(t) for t in ev.tokens.values()))
    for res in ev.finished:
      self.requests.labels(res.finish_reason).inc()
      if res.ttft_s is not None:
        self.ttft.observe(res.ttft_s)
      times = res.token_times
      for a, b in zip(times, times[1:]):
        self.itl.observe(b - a)

  def render(self) -> tuple[bytes, str]:
    import prometheus_client as pc

    return pc.generate_latest(self.registry), pc.CONTENT_TYPE_LATEST


class _State:
  def __init__(self, loop, ctx, metadata, metrics):
    self.loop, self.ctx, self.metadata, self.metrics = loop, ctx, metadata, metrics
    self.draining = False
    self.created = int(time.time())


def create_app(
  engine: Engine,
  *,
  model_name: str,
  tokenizer=None,
  defaults=None,
  max_queue: int = 64,
  metadata: dict | None = None,
  drain_timeout: float = 30.0,
):
  """The FastAPI app serving ``engine`` (call ``engine.warmup()`` first). ``tokenizer`` and
  ``defaults`` come from :func:`lrjax.text.load_text`; ``metadata`` shows in /v1/models."""
  from fastapi import FastAPI

  loop = EngineLoop(engine, max_queue=max_queue)
  metrics = Metrics(loop)
  loop.on_step = metrics.on_step
  ctx = api.Context(
    model_name=model_name,
    max_len=engine.max_len,
    max_prompt=engine.max_prompt_len,
    vocab_size=engine.cfg.vocab_size,
    tokenizer=tokenizer,
    defaults=defaults,
  )
  state = _State(loop, ctx, dict(metadata or {}), metrics)

  @contextlib.asynccontextmanager
  async def lifespan(app):
    loop.start()
    try:
      yield
    finally:
      state.draining = True
      if not loop.stop(timeout=drain_timeout):
        log.warning("the engine thread did not stop within %.0f s", drain_timeout)

  app = FastAPI(title="lrjax", lifespan=lifespan, docs_url=None, redoc_url=None)
  app.state.lrjax = state

  def error(e: api.ApiError) -> JSONResponse:
    if e.status == 400:
      metrics.rejected.labels("bad_request").inc()
    return JSONResponse(e.body(), status_code=e.status)

  @app.exception_handler(Exception)
  async def _unexpected(request, exc):  # a bug, never a bad request: say so, as OpenAI does
    log.exception("request failed")
    return JSONResponse(
      api.ApiError(
        f"internal error: {type(exc).__name__}: {exc}", status=500, type="server_error"
      ).body(),
      status_code=500,
    )

  @app.get("/health")
  async def health():
    if state.draining:
      return JSONResponse({"status": "draining"}, status_code=503)
    if not loop.alive:
      return JSONResponse({"status": "engine stopped", "error": str(loop.error)}, status_code=503)
    return {"status": "ok", "running": loop.running, "waiting": loop.queue_depth}

  @app.get("/metrics")
  async def prom():
    body, ctype = metrics.render()
    return Response(body, media_type=ctype)

  @app.get("/v1/models")
  async def models():
    card = {"id": model_name, "object": "model", "created": state.created, "owned_by": "lrjax"}
    card["lrjax"] = state.metadata
    return {"object": "list", "data": [card]}

  async def handle(request: HttpRequest, kind: str):
    if state.draining:
      return error(api.ApiError("the server is shutting down", status=503, type="server_error"))
    raw = await request.body()
    try:
      body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      return error(api.ApiError(f"the request body is not valid JSON ({e})"))
    try:
      job = api.parse(body, kind, ctx)
    except api.ApiError as e:
      return error(e)
    try:
      h = loop.submit(Request(job.prompt_ids, job.sampling))
    except QueueFull as e:
      metrics.rejected.labels("queue_full").inc()
      return error(api.ApiError(str(e), status=429, type="rate_limit_error", code="queue_full"))
    except (ValueError, TypeError) as e:
      return error(api.ApiError(str(e)))
    except RuntimeError as e:  # the engine thread is gone
      return error(api.ApiError(str(e), status=503, type="server_error"))
    metrics.prompt_tokens.inc(len(job.prompt_ids))
    run = _Run(job, h, loop, ctx, model_name)
    if job.stream:
      return _SSEResponse(run)
    return await run.collect(request)

  @app.post("/v1/completions")
  async def completions(request: HttpRequest):
    return await handle(request, "completion")

  @app.post("/v1/chat/completions")
  async def chat(request: HttpRequest):
    return await handle(request, "chat")

  return app


class _Run:
  """One admitted request: engine events → text deltas → OpenAI chunks or one response."""

  def __init__(self, job: api.Job, handle, loop: EngineLoop, ctx: api.Context, model: str):
    self.job, self.h, self.loop, self.ctx, self.model = job, handle, loop, ctx, model
    self.id = ("chatcmpl-" if job.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    self.created = int(time.time())
    self.ended = False  # the engine returned the request, or it was cancelled here
    self.text_stream = None
    if ctx.tokenizer is not None:
      from lrjax.text import TextStream

      eos = ctx.defaults.eos_ids if ctx.defaults is not None else ()
      self.text_stream = TextStream(ctx.tokenizer, job.prompt_ids, job.stop, eos)
    self.n_tokens = 0

  async def deltas(self) -> AsyncIterator[tuple]:
    """("delta", text, ids) ... then ("finish", reason) or ("error", message)."""
    ts = self.text_stream
    async for kind, payload in self.h:
      if kind == "tokens":
        text, ids = "", []
        for t in payload:
          ids.append(t)
          self.n_tokens += 1
          if ts is not None:
            text += ts.push(t)
            if ts.done and ts.reason == "stop_string":  # a stop string: end here
              self.loop.cancel(self.h.id)
              self.ended = True
              yield ("delta", text, ids)
              yield ("finish", "stop")
              return
        yield ("delta", text, ids)
        continue
      self.ended = True
      res = payload
      if res.finish_reason == "error":
        yield ("error", res.error or "the engine failed")
        return
      tail = ts.finish() if ts is not None else ""
      if tail:
        yield ("delta", tail, [])
      yield ("finish", "stop" if res.finish_reason == "stop" else "length")
      return

  def cancel_if_running(self):
    if not self.ended:
      self.loop.cancel(self.h.id)
      self.ended = True

  def usage(self) -> dict:
    p = len(self.job.prompt_ids)
    return {
      "prompt_tokens": p,
      "completion_tokens": self.n_tokens,
      "total_tokens": p + self.n_tokens,
    }

  def _choice(self, text: str | None, ids: list[int], reason: str | None, final: bool) -> dict:
    c: dict[str, Any] = {"index": 0}
    if self.job.kind == "chat":
      if final and not self.job.stream:
        c["message"] = {"role": "assistant", "content": text}
      else:
        c["delta"] = {} if text is None else {"content": text}
    else:
      c["text"] = text if text is not None else ""
    c["logprobs"] = None
    c["finish_reason"] = reason
    if self.job.return_token_ids:
      c["token_ids"] = ids
    return c

  def _chunk(self, choices: list, usage: dict | None = None) -> str:
    obj = "chat.completion.chunk" if self.job.kind == "chat" else "text_completion"
    body = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
    body["choices"] = choices
    if usage is not None:
      body["usage"] = usage
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

  async def sse(self) -> AsyncIterator[str]:
    try:
      if self.job.kind == "chat":
        first = self._choice("", [], None, False)
        first["delta"] = {"role": "assistant", "content": ""}
        yield self._chunk([first])
      async for ev in self.deltas():
        if ev[0] == "delta":
          _, text, ids = ev
          if text or (ids and self.job.return_token_ids):
            yield self._chunk([self._choice(text, ids, None, False)])
        elif ev[0] == "finish":
          yield self._chunk(
            [self._choice(None if self.job.kind == "chat" else "", [], ev[1], False)]
          )
        else:
          err = api.ApiError(ev[1], status=500, type="server_error")
          yield f"data: {json.dumps(err.body())}\n\n"
      if self.job.include_usage:
        yield self._chunk([], self.usage())
      yield "data: [DONE]\n\n"
    finally:  # the client went away (the task was cancelled) or the stream ended
      self.cancel_if_running()

  async def collect(self, request):
    """The non-streaming response; a client that disconnects meanwhile cancels the request."""

    async def gather():
      text, ids, reason = [], [], None
      async for ev in self.deltas():
        if ev[0] == "delta":
          text.append(ev[1])
          ids += ev[2]
        elif ev[0] == "finish":
          reason = ev[1]
        else:
          return ("error", ev[1])
      return ("ok", "".join(text), ids, reason)

    task = asyncio.ensure_future(gather())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
      done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
      gone.cancel()
      if not task.done():
        task.cancel()
      self.cancel_if_running()
    if task not in done:
      return Response(status_code=499)  # nobody is listening
    out = task.result()
    if out[0] == "error":
      err = api.ApiError(out[1], status=500, type="server_error")
      return JSONResponse(err.body(), status_code=500)
    _, text, ids, reason = out
    obj = "chat.completion" if self.job.kind == "chat" else "text_completion"
    return {
      "id": self.id,
      "object": obj,
      "created": self.created,
      "model": self.model,
      "choices": [self._choice(text, ids, reason, True)],
      "usage": self.usage(),
    }


async def _disconnected(request):
  """Returns when the client disconnects (the body has been read: only that can arrive)."""
  while True:
    msg = await request.receive()
    if msg["type"] == "http.disconnect":
      return


class _SSEResponse(Response):
  """An SSE stream that watches for the client's disconnect while it streams (whatever ASGI
  spec version the server speaks) and cancels the stream when it comes."""

  def __init__(self, run: _Run):
    self.run = run
    self.status_code, self.background = 200, None
    self.init_headers({})

  async def __call__(self, scope, receive, send):
    headers = [
      (b"content-type", b"text/event-stream; charset=utf-8"),
      (b"cache-control", b"no-cache"),
      (b"x-accel-buffering", b"no"),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})

    async def stream():
      agen = self.run.sse()
      try:
        async for chunk in agen:
          await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
      finally:
        await agen.aclose()

    async def watch():
      while (await receive())["type"] != "http.disconnect":
        pass

    st, wt = asyncio.ensure_future(stream()), asyncio.ensure_future(watch())
    try:
      await asyncio.wait({st, wt}, return_when=asyncio.FIRST_COMPLETED)
    finally:
      for t in (st, wt):
        if not t.done():
          t.cancel()
      await asyncio.gather(st, wt, return_exceptions=True)
      self.run.cancel_if_running()


def _server_class():
  import uvicorn

  class Server(uvicorn.Server):
    """uvicorn's server; SIGTERM/SIGINT start the drain and the process then exits 0 (uvicorn
    would re-raise the signal after shutting down, ending the process by it)."""

    app_state: _State | None = None

    def handle_exit(self, sig, frame):
      if self.app_state is not None:
        self.app_state.draining = True
      if self.should_exit and sig == signal.SIGINT:
        self.force_exit = True
      else:
        self.should_exit = True

  return Server


def make_server(
  app,
  host: str = "127.0.0.1",
  port: int = 8000,
  *,
  drain_timeout: float = 30.0,
  log_level: str = "warning",
):
  """A uvicorn server for ``app`` (``server.run()`` blocks; from a thread, see ServerThread)."""
  import uvicorn

  config = uvicorn.Config(
    app,
    host=host,
    port=port,
    log_level=log_level,
    timeout_graceful_shutdown=max(1, int(drain_timeout)),
    lifespan="on",
  )
  server = _server_class()(config)
  server.app_state = app.state.lrjax
  return server


class ServerThread:
  """Serve ``app`` from a background thread (tests, benchmarks): ``url`` once started."""

  def __init__(self, app, host: str = "127.0.0.1", port: int = 0, **kw):
    import socket

    if port == 0:  # pick a free port
      with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    self.url = f"http://{host}:{port}"
    self.server = make_server(app, host, port, **kw)
    self.thread = threading.Thread(target=self.server.run, name="lrjax-http", daemon=True)

  def __enter__(self):
    self.thread.start()
    t0 = time.monotonic()
    while not self.server.started:
      if not self.thread.is_alive() or time.monotonic() - t0 > 60:
        raise RuntimeError("the HTTP server did not start")
      time.sleep(0.01)
    return self

  def __exit__(self, *exc):
    self.server.should_exit = True
    self.thread.join(60)
