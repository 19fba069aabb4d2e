"""The engine in its own thread, fed from asyncio: the HTTP side never blocks a step.

  loop = EngineLoop(engine, max_queue=64)
  loop.start()                                    # the stepping thread
  handle = loop.submit(Request(ids, sampling))    # from the event loop; QueueFull when full
  async for event in handle: ...                  # ("tokens", [ids]) ... ("done", Result)
  loop.cancel(handle.id)                          # e.g. the client went away
  loop.stop(timeout=10)                           # cancel what is left, join the thread

The thread steps while any request is live and sleeps on an event otherwise. Each step's
tokens and finished results reach the event loop in one ``call_soon_threadsafe`` call.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from lrjax.serving.engine import Engine, Request, Result, StepEvents

log = logging.getLogger("lrjax.serving")


class QueueFull(Exception):
  """The admission queue is full (HTTP 429)."""


class Handle:
  """One request's events, in order: ``("tokens", [ids])`` any number of times, then
  ``("done", Result)``. Iterate it with ``async for``."""

  def __init__(self, rid: int, prompt_len: int):
    self.id, self.prompt_len = rid, prompt_len
    self.t_submit = time.perf_counter()
    self.queue: asyncio.Queue = asyncio.Queue()
    self.result: Result | None = None

  def __aiter__(self):
    return self

  async def __anext__(self):
    if self.result is not None and self.queue.empty():
      raise StopAsyncIteration
    ev = await self.queue.get()
    if ev[0] == "done":
      self.result = ev[1]
    return ev


class EngineLoop:
  """Runs ``engine`` in a daemon thread; ``submit``/``cancel`` from the asyncio event loop.

  ``max_queue``: requests that may wait for a slot (beyond the engine's ``max_slots``
  running); one more is refused with :class:`QueueFull`. ``on_step(events, dt)``: called on
  the event loop after each step that produced something (metrics).
  """

  def __init__(
    self,
    engine: Engine,
    max_queue: int = 64,
    on_step: Callable[[StepEvents], None] | None = None,
  ):
    if not isinstance(max_queue, int) or max_queue < 0:
      raise ValueError(f"{max_queue=} must be an int >= 0")
    self.engine, self.max_queue, self.on_step = engine, max_queue, on_step
    self._handles: dict[int, Handle] = {}
    self._wake = threading.Event()
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._aloop: asyncio.AbstractEventLoop | None = None
    self.steps = 0
    self.error: BaseException | None = None

  # ---- lifecycle ------------------------------------------------------------------------------
  def start(self, aloop: asyncio.AbstractEventLoop | None = None):
    self._aloop = aloop or asyncio.get_running_loop()
    self._thread = threading.Thread(target=self._run, name="lrjax-engine", daemon=True)
    self._thread.start()

  def stop(self, timeout: float = 10.0) -> bool:
    """Cancel every live request, let the thread return them, and join it. True if it ended."""
    for rid in list(self._handles):
      self.engine.cancel(rid)
    deadline = time.monotonic() + timeout
    while self.engine.busy and time.monotonic() < deadline:
      self._wake.set()
      time.sleep(0.01)
    self._stop.set()
    self._wake.set()
    if self._thread is not None:
      self._thread.join(max(0.0, deadline - time.monotonic()))
      return not self._thread.is_alive()
    return True

  @property
  def alive(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  # ---- requests (event loop thread) -----------------------------------------------------------
  @property
  def queue_depth(self) -> int:
    return self.engine.num_waiting

  @property
  def running(self) -> int:
    return self.engine.num_running

  def submit(self, req: Request) -> Handle:
    """Queue ``req``; ValueError/TypeError if the engine refuses it, QueueFull if no room."""
    if not self.alive:
      raise RuntimeError("the engine thread is not running")
    # free slots take waiting requests at the next step: they do not count against the queue
    if self.engine.num_waiting >= self.max_queue + self.engine.free_slots:
      raise QueueFull(
        f"{self.engine.num_waiting} requests are waiting for one of {self.engine.max_slots} "
        "slots; retry later"
      )
    rid = self.engine.submit(req)
    h = Handle(rid, len(req.prompt))
    self._handles[rid] = h
    self._wake.set()
    return h

  def cancel(self, rid: int) -> bool:
    ok = self.engine.cancel(rid)
    self._wake.set()
    return ok

  def _deliver(self, ev: StepEvents):
    for rid, toks in ev.tokens.items():
      h = self._handles.get(rid)
      if h is not None:
        h.queue.put_nowait(("tokens", toks))
    for r in ev.finished:
      h = self._handles.pop(r.id, None)
      if h is not None:
        h.queue.put_nowait(("done", r))
    if self.on_step is not None:
      self.on_step(ev)

  # ---- the stepping thread --------------------------------------------------------------------
  def _run(self):
    eng = self.engine
    try:
      while not self._stop.is_set():
        if not eng.busy:
          self._wake.wait(0.05)
          self._wake.clear()
          continue
        ev = eng.step_events()
        self.steps += 1
        if ev.tokens or ev.finished:
          self._aloop.call_soon_threadsafe(self._deliver, ev)
    except BaseException as e:  # noqa: BLE001 - reported by /health and to waiting requests
      self.error = e
      log.exception("engine thread stopped")
      err = f"engine thread stopped: {type(e).__name__}: {e}"
      failed = [Result(rid, [], [], "error", None, [], err) for rid in list(self._handles)]
      if failed and self._aloop is not None and not self._aloop.is_closed():
        self._aloop.call_soon_threadsafe(self._deliver, StepEvents({}, failed))
