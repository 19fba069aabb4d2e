"""Generation engine: jitted prefill/decode over a mesh, slot-based continuous batching.

  engine = Engine(model, max_slots=8, max_len=512)          # model sharded by lrjax.sharding
  outs = engine.generate([Request([1, 2, 3], SamplingParams(max_new_tokens=32))])

The KV cache holds one static-shape buffer [slots, kv_heads, max_len, head_dim] per layer (or
the rank-space :class:`~lrjax.serving.lowrank_kv.LowRankKVCache`), sharded by the model's
:class:`~lrjax.sharding.TPPlan` and donated to every step. A waiting request takes a free slot;
its prompt is prefilled into the slot's row, and all rows whose prompt is in then decode
together, one token per step, attending over the smallest attend bucket that holds every active
row's context (one compile per attend bucket); a finished request frees its slot between steps
and the next waiting request joins.

Prefill ("batched", the default): several waiting prompts go through one call (rows padded to a
row bucket, tokens to a length bucket; about ``prefill_call_tokens`` tokens a call, enough to
keep a GPU busy, up to ``prefill_tokens`` a step), and each call's first tokens are read before
the next call's, so they stream out as the calls finish. A prompt longer than ``prefill_chunk``
is prefilled one chunk a step, the decode steps of the running requests in between (a later
chunk attends to the row's cached tokens). "single" prefills each prompt in a call of its own.
Every (rows, length) pair is a compile: :meth:`Engine.prefill_variants` lists them, and
:meth:`Engine.warmup` compiles them all.

The loop runs one step ahead of the host: each :meth:`Engine.step_events` launches the next
decode (its input tokens are the previous step's output, still on the device) before it reads
the previous step's tokens, so the host's bookkeeping overlaps the device's work and the only
host round trip is that one read per step. The sampler runs on the device. A row whose request
turned out to be finished by the step just read has decoded one extra token in the step in
flight; it is discarded.

Requests are validated at :meth:`Engine.submit` (types, ranges, duplicate ids), so a bad one is
refused before it takes a slot. A request that fails once admitted (its prefill raises) comes
back with ``finish_reason="error"`` and frees its slot; a failed decode step returns every
running request that way and the engine carries on with a fresh cache. :meth:`Engine.cancel`
frees a request's slot at the next step (the HTTP server calls it when a client disconnects).
``submit`` and ``cancel`` may be called from other threads while one thread steps.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lrjax.models import KVCache
from lrjax.models.llama import _mask
from lrjax.serving import lowrank_kv as lrkv
from lrjax.serving.sampling import SamplingParams, sample
from lrjax.sharding import default_device

log = logging.getLogger("lrjax.serving")

FINISH_REASONS = ("stop", "length", "cache_full", "cancelled", "error")


@dataclasses.dataclass
class Request:
  """``prompt``: token ids (a list, tuple or 1-D integer array); ``id``: an int unique among the
  engine's live requests (default: the engine numbers it)."""

  prompt: Sequence[int]
  sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
  id: int | None = None


@dataclasses.dataclass
class Result:
  id: int
  prompt: list[int]
  tokens: list[int]
  finish_reason: str  # one of FINISH_REASONS
  ttft_s: float | None  # submit → first token (None when no token was generated)
  token_times: list[float]  # wall time of every generated token (perf_counter)
  error: str | None = None  # what failed, for finish_reason "error"


class StepEvents(NamedTuple):
  """What one :meth:`Engine.step_events` produced: each request's new tokens (in order) and the
  requests that finished."""

  tokens: dict[int, list[int]]
  finished: list[Result]


@dataclasses.dataclass
class _Live:
  id: int
  prompt: list[int]
  sp: SamplingParams
  t0: float
  tokens: list[int] = dataclasses.field(default_factory=list)
  times: list[float] = dataclasses.field(default_factory=list)
  ttft: float | None = None
  filled: int = 0  # prompt tokens in the cache; the row decodes once all are
  seq: int = 0  # the admission's number: tells a step's rows from a later request's in that slot


def default_buckets(max_len: int, smallest: int = 16) -> tuple[int, ...]:
  b, out = smallest, []
  while b < max_len:
    out.append(b)
    b *= 2
  return tuple(out) + (max_len,)


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _seed_words(seed: int) -> np.ndarray:
  """A 64-bit seed as [low, high] uint32 words (without x64, ``jax.random.key(seed)`` would keep
  only the low 32 bits); :func:`_request_key` turns them into the request's key on device."""
  return np.asarray([seed & 0xFFFFFFFF, seed >> 32], np.uint32)


def _request_key(words):
  """words [2] uint32 → the request's PRNG key (the high word folded into the low one's)."""
  return jax.random.fold_in(jax.random.key(words[0]), words[1])


class Engine:
  """Continuous-batching generator over ``model`` (sharded or on one device).

  ``unroll_layers`` (default) sets ``model.scan_layers = False``: a scanned model would stack
  (copy) all layer weights inside every step. ``fuse`` (default) runs the steps through
  ``lrjax.fuse``, so the low-rank projections reach this platform's kernels
  (:meth:`fusion_report` says which). ``buckets`` (default: powers of two from 16, and
  ``max_len``): prompt chunks are padded to one. ``attend_buckets`` (default: powers of two
  from 128, and ``max_len``): each decode step attends over the smallest that holds every active
  row's context. ``prefill``, ``prefill_chunk`` (default: the largest bucket, at most 512),
  ``prefill_call_tokens``, ``prefill_tokens`` and ``prefill_rows`` (default: powers of two up
  to ``prefill_call_tokens`` // the smallest bucket): see the module docstring.
  """

  def __init__(
    self,
    model,
    *,
    max_slots: int = 8,
    max_len: int = 256,
    buckets: Sequence[int] | None = None,
    cache_dtype=None,
    lowrank_kv: bool = False,
    fuse: bool = True,
    unroll_layers: bool = True,
    attend_buckets: Sequence[int] | None = None,
    prefill: str = "batched",
    prefill_chunk: int | None = None,
    prefill_call_tokens: int = 512,
    prefill_tokens: int = 2048,
    prefill_rows: Sequence[int] | None = None,
  ):
    cfg = model.cfg
    if unroll_layers and getattr(model, "scan_layers", False):
      # The model's scan stacks every layer's weights inside each call: a full weight copy per
      # decode step. Unrolled, each step reads the weights once.
      log.info("engine: running %s's layers unrolled (scan_layers=False)", type(model).__name__)
      model.scan_layers = False
    if not _is_int(max_slots) or max_slots < 1:
      raise ValueError(f"{max_slots=} must be a positive int")
    if not _is_int(max_len) or max_len < 2:
      raise ValueError(f"{max_len=} must be an int >= 2")
    self.cfg, self.max_slots, self.max_len = cfg, int(max_slots), int(max_len)
    self.buckets = tuple(sorted(set(buckets or default_buckets(max_len))))
    if self.buckets[-1] > max_len or self.buckets[0] < 1:
      raise ValueError(f"buckets={self.buckets} must lie in [1, {max_len=}]")
    # Decode attends over the smallest of these (max_len always one) that holds every active
    # row's context, not over the whole cache: one compiled step each.
    ab = tuple(attend_buckets or default_buckets(max_len, 128))
    if not all(_is_int(b) and 1 <= b <= max_len for b in ab):
      raise ValueError(f"attend_buckets={ab} must be ints in [1, {max_len=}]")
    self.attend_buckets = tuple(sorted(set(ab) | {max_len}))
    # Admission ("batched"): each step prefills the waiting prompts in calls of a few rows
    # (about prefill_call_tokens padded tokens a call: enough to keep the device busy), up to
    # prefill_tokens a step, each call's first tokens read before the next call's; a prompt
    # longer than prefill_chunk is prefilled a chunk a step, decode steps in between.
    # "single": each admitted prompt in a call of its own, all before the step's decode.
    if prefill not in ("batched", "single"):
      raise ValueError(f"{prefill=} must be 'batched' or 'single'")
    self.prefill = prefill
    self.prefill_chunk = int(prefill_chunk or min(self.buckets[-1], 512))
    if not 1 <= self.prefill_chunk <= self.buckets[-1]:
      raise ValueError(f"{prefill_chunk=} must be in [1, the largest bucket {self.buckets[-1]}]")
    self.prefill_call_tokens = int(prefill_call_tokens)
    self.prefill_tokens = int(prefill_tokens)
    if not 1 <= self.prefill_call_tokens <= self.prefill_tokens:
      raise ValueError(f"need 1 <= {prefill_call_tokens=} <= {prefill_tokens=}")
    most = max(1, self.prefill_call_tokens // self.buckets[0])
    rows = prefill_rows or tuple(sorted({min(2**i, most, max_slots) for i in range(16)}))
    if prefill == "single":
      rows = (1,)
    if not all(_is_int(r) and 1 <= r <= max_slots for r in rows):
      raise ValueError(f"prefill_rows={tuple(rows)} must be ints in [1, {max_slots=}]")
    self.prefill_rows = tuple(sorted(set(rows)))
    self.plan = getattr(model, "tp_plan", None)
    if self.plan is not None and max_slots % self.plan.mesh.shape["data"]:
      raise ValueError(
        f"{max_slots=} must be a multiple of the mesh's data axis "
        f"({self.plan.mesh.shape['data']}): slots are split over it"
      )
    self.lowrank_kv, self.fuse = lowrank_kv, fuse
    self._compute_dtype = model.dtype or model.embed.embedding[...].dtype
    self._cache_dtype = cache_dtype or self._compute_dtype
    self.gdef, self.state = nnx.split(model)
    self._cache_shardings = None  # (sharding of the two cache arrays, of pos): hashable
    if self.plan is not None:
      mesh = self.plan.mesh
      spec = P("data") if lowrank_kv else self.plan.cache_sharding().spec
      # spelled as the steps return it (size-1 mesh axes and trailing Nones dropped), so the
      # fresh cache and every step's output share one compiled variant of each step
      self._cache_shardings = (
        NamedSharding(mesh, _canonical_spec(spec, mesh)),
        NamedSharding(mesh, P()),
      )
    self.cache = self._fresh_cache(model)
    # Each step's jit is keyed by the graph, the cache layout and two flags. Hashing a GraphDef
    # walks the whole model (1.8 ms at 32 layers) and flattening the nnx State takes 0.4 ms:
    # both once here, not every token; the steps take the weights as a flat list.
    leaves, treedef = jax.tree.flatten(self.state)
    self._weights = leaves
    self._static = _Static(_StepKey(self.gdef, treedef, lowrank_kv, fuse, self._cache_shardings))
    # Small per-step inputs live replicated (on the mesh, or on one device), the same sharding
    # as the decode step's outputs, so feeding tokens back never changes the compiled variant.
    self._rep = (
      NamedSharding(self.plan.mesh, P())
      if self.plan is not None
      else jax.sharding.SingleDeviceSharding(default_device())
    )
    # Requests: submit/cancel may come from other threads; the stepping thread owns the slots.
    self._lock = threading.Lock()
    self._waiting: collections.deque = collections.deque()  # (id, prompt, sampling, t_submit)
    self._ids: set[int] = set()  # live ids: waiting or in a slot
    self._cancels: set[int] = set()
    self._next_id = 0
    self._admitted = 0
    self._free = list(range(self.max_slots))
    self._slots: dict[int, _Live] = {}
    self._slot_of: dict[int, int] = {}  # id → slot
    self._pos = np.zeros((self.max_slots,), np.int64)  # each row's next cache position
    self._temp = np.zeros((self.max_slots,), np.float32)
    self._topk = np.zeros((self.max_slots,), np.int32)
    self._topp = np.ones((self.max_slots,), np.float32)
    self._seeds = np.zeros((self.max_slots, 2), np.uint32)  # each slot's request seed words
    self._reset_device_state()
    self._inflight: collections.deque = collections.deque()  # (kind, device tokens, rows)

  def _fresh_cache(self, model=None):
    model = model if model is not None else nnx.merge(self.gdef, self.state)
    if self.lowrank_kv:
      cache = lrkv.LowRankKVCache.init(model, self.max_slots, self.max_len, self._cache_dtype)
    else:
      cache = KVCache.init(self.cfg, self.max_slots, self.max_len, self._cache_dtype)
    if self._cache_shardings is not None:
      return jax.device_put(cache, _cache_tree(cache, self._cache_shardings))
    # committed from the start, like every step's output: one compiled variant
    return jax.device_put(cache, jax.sharding.SingleDeviceSharding(default_device()))

  def _reset_device_state(self):
    self._tok_dev = jax.device_put(np.zeros((self.max_slots,), np.int32), self._rep)
    self._params_dev = None  # device copies of (seeds, temp, top_k, top_p); None after changes

  # ---- jitted steps (module-level jits: engines over the same model share compilations) ------
  def _prefill(self, window, *args):
    return _prefill_jit(self._static, window, self._weights, *args)

  def _decode(self, attend_len, *args):
    return _decode_jit(self._static, attend_len, self._weights, *args)

  # ---- requests ------------------------------------------------------------------------------
  @property
  def max_prompt_len(self) -> int:
    """The longest prompt this engine takes: all but one position of a cache row (prompts
    longer than a chunk are prefilled in chunks)."""
    return self.max_len - 1

  def check(self, req: Request) -> list[int]:
    """Validate ``req`` (types, ranges, token ids); returns its prompt as a list of ints."""
    if not isinstance(req, Request):
      raise TypeError(f"request must be a lrjax.serving.Request; got {type(req).__name__}")
    if not isinstance(req.sampling, SamplingParams):
      raise TypeError(f"request.sampling must be SamplingParams; got {type(req.sampling).__name__}")
    if req.id is not None and (not _is_int(req.id) or req.id < 0):
      raise TypeError(f"request.id={req.id!r} must be a non-negative int or None")
    prompt = req.prompt
    if isinstance(prompt, np.ndarray):
      if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
        raise TypeError(
          f"prompt array {prompt.dtype}{list(prompt.shape)} must be 1-D integer token ids"
        )
      prompt = prompt.tolist()
    elif not isinstance(prompt, (list, tuple)) or not all(_is_int(t) for t in prompt):
      raise TypeError(
        f"prompt must be a list of int token ids; got {type(prompt).__name__} "
        f"{str(prompt)[:40]!r} (tokenize text first, e.g. with lrjax.text)"
      )
    prompt = [int(t) for t in prompt]
    if not prompt:
      raise ValueError("prompt is empty; a request needs at least one token id")
    if len(prompt) > self.max_prompt_len:
      raise ValueError(
        f"prompt has {len(prompt)} tokens; this engine takes at most "
        f"{self.max_prompt_len} (max_len={self.max_len} leaves room for one generated token)"
      )
    bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
    if bad:
      raise ValueError(
        f"prompt token ids {bad[:5]} are outside [0, vocab_size={self.cfg.vocab_size})"
      )
    return prompt

  def submit(self, req: Request) -> int:
    """Queue a request (validated now; a duplicate live id is refused); returns its id."""
    prompt = self.check(req)
    with self._lock:
      rid = self._claim_id(req.id)
      self._waiting.append((rid, prompt, req.sampling, time.perf_counter()))
    return rid

  def _claim_id(self, rid: int | None) -> int:
    if rid is None:
      while self._next_id in self._ids:
        self._next_id += 1
      rid = self._next_id
    elif rid in self._ids:
      raise ValueError(
        f"request id {rid} is already waiting or running; give each live request its own id"
      )
    rid = int(rid)
    self._ids.add(rid)
    self._next_id = max(self._next_id, rid + 1)
    return rid

  def cancel(self, rid: int) -> bool:
    """Cancel a waiting or running request: at the next step it frees its slot and comes back
    with ``finish_reason="cancelled"`` and the tokens it had. False if ``rid`` is not live."""
    with self._lock:
      if rid not in self._ids:
        return False
      self._cancels.add(rid)
      return True

  @property
  def busy(self) -> bool:
    """Some request is waiting or running (a step left in flight for finished rows is not)."""
    return bool(self._slots or self._waiting)

  @property
  def free_slots(self) -> int:
    return len(self._free)

  @property
  def num_waiting(self) -> int:
    return len(self._waiting)

  @property
  def num_running(self) -> int:
    return len(self._slots)

  def _bucket(self, n: int) -> int:
    return next(b for b in self.buckets if b >= n)

  # ---- stepping -----------------------------------------------------------------------------
  def step(self) -> list[Result]:
    """One step (see :meth:`step_events`); returns the requests that finished."""
    return self.step_events().finished

  def step_events(self) -> StepEvents:
    """Apply cancels, admit waiting requests into free slots (one prefill each), launch one
    decode step for all slots, then read the previous step's tokens."""
    ev = StepEvents({}, [])
    self._apply_cancels(ev)
    self._admit(ev)
    try:
      launched = self._launch_decode()
    except Exception as e:  # noqa: BLE001 - returned to every running request
      self._fail_running(e, ev)
      launched = False
    self._read_all(ev, keep=1 if launched else 0)
    return ev

  def _read_all(self, ev: StepEvents, keep: int):
    """Read every launched step's tokens but the newest ``keep``."""
    while len(self._inflight) > keep:
      entry = self._inflight.popleft()
      try:
        self._read(entry, ev)
      except Exception as e:  # noqa: BLE001 - returned to every running request
        self._fail_running(e, ev)

  def _apply_cancels(self, ev: StepEvents):
    with self._lock:
      cancels, self._cancels = self._cancels, set()
      if not cancels:
        return
      kept = collections.deque()
      for item in self._waiting:
        if item[0] in cancels:
          rid, prompt, _, _ = item
          self._ids.discard(rid)
          ev.finished.append(Result(rid, prompt, [], "cancelled", None, []))
        else:
          kept.append(item)
      self._waiting = kept
    for rid in cancels:
      slot = self._slot_of.get(rid)
      if slot is not None:
        self._finish(slot, "cancelled", ev)

  def _admit(self, ev: StepEvents):
    """Waiting requests take free slots (lowest first); then this step's prefill call(s)."""
    while self._free:
      with self._lock:
        if not self._waiting:
          break
        rid, prompt, sp, t0 = self._waiting.popleft()
      self._free.sort()
      slot = self._free.pop(0)
      self._admitted += 1
      live = _Live(rid, prompt, sp, t0, seq=self._admitted)
      self._slots[slot], self._slot_of[rid] = live, slot
      try:
        self._seeds[slot] = _seed_words(sp.seed)
      except Exception as e:  # noqa: BLE001 - this request fails; the others go on
        log.warning("engine: request %d failed at admission: %s", rid, e)
        self._finish(slot, "error", ev, error=f"{type(e).__name__}: {e}")
        continue
      self._temp[slot], self._topk[slot], self._topp[slot] = sp.temperature, sp.top_k, sp.top_p
      self._params_dev = None
    budget = self.prefill_tokens if self.prefill == "batched" else float("inf")
    done: set[int] = set()  # slots prefilled this step: a long prompt gets one chunk a step
    while True:
      batch = self._next_prefill_batch(budget, done if self.prefill == "batched" else set())
      if not batch:
        return
      done.update(slot for slot, _, _ in batch)
      width = self._width(batch)
      budget -= self._row_bucket(len(batch)) * width
      try:
        self._launch_prefill(batch, width)
      except Exception as e:  # noqa: BLE001 - these requests fail; the others go on
        if not self._cache_intact():
          self._fail_running(e, ev)
          return
        for slot, _, _ in batch:
          live = self._slots[slot]
          log.warning("engine: request %d failed at prefill: %s", live.id, e)
          self._finish(slot, "error", ev, error=f"{type(e).__name__}: {e}")
      if self.prefill == "batched":  # this call's first tokens as soon as it is done
        self._read_all(ev, keep=1)

  def _width(self, batch) -> int:
    """A call's padded chunk length: later chunks at the chunk's bucket (one compiled width)."""
    if any(start for _, start, _ in batch):
      return self._bucket(self.prefill_chunk)
    return self._bucket(max(n for _, _, n in batch))

  def _next_prefill_batch(self, budget, skip: set[int]) -> list[tuple[int, int, int]]:
    """[(slot, start, length)] of prompt chunks for one prefill call, oldest request first. A
    call holds first chunks only (attending to themselves) or later chunks only (attending to
    the row's cache too), no wider than the oldest's, as many rows as fit prefill_call_tokens
    and the step's remaining ``budget``; the step's first call always gets one row."""
    pending = sorted(
      (live.t0, slot)
      for slot, live in self._slots.items()
      if live.filled < len(live.prompt) and slot not in skip
    )
    out: list[tuple[int, int, int]] = []
    for _, slot in pending:
      live = self._slots[slot]
      n = min(self.prefill_chunk, len(live.prompt) - live.filled)
      if not out:
        later = live.filled > 0
        width = self._bucket(self.prefill_chunk) if later else self._bucket(n)
        most = min(self.prefill_rows[-1], max(1, self.prefill_call_tokens // width))
        if width > budget and budget < self.prefill_tokens:
          return []  # the step's budget is spent; the next step goes on
      elif (live.filled > 0) != later or n > width:
        continue  # another kind of call, or wider: a later call
      elif len(out) >= most or self._row_bucket(len(out) + 1) * width > budget:
        break
      out.append((slot, live.filled, n))
    return out

  def _row_bucket(self, n: int) -> int:
    return next(r for r in self.prefill_rows if r >= n)

  def prefill_variants(self) -> list[tuple[int, int, int]]:
    """(rows, width, window) of every prefill call this engine can make: first chunks at each
    bucket up to the chunk's (window = width), later chunks at the chunk's bucket (window =
    max_len) when a prompt can be longer than a chunk."""
    top = self._bucket(self.prefill_chunk)
    out = []

    def rows_for(w):
      most = min(self.prefill_rows[-1], max(1, self.prefill_call_tokens // w))
      budget = self.prefill_tokens if self.prefill == "batched" else float("inf")
      return sorted(
        {
          self._row_bucket(k)
          for k in range(1, most + 1)
          if k == 1 or self._row_bucket(k) * w <= budget
        }
      )

    for w in (b for b in self.buckets if b <= top):
      out += [(r, w, w) for r in rows_for(w)]
    if self.max_prompt_len > self.prefill_chunk:
      out += [(r, top, self.max_len) for r in rows_for(top)]
    return out

  def _launch_prefill(self, batch: list[tuple[int, int, int]], width: int):
    """One prefill call over ``batch``'s chunks (rows padded to a row bucket, tokens to
    ``width``); rows whose prompt it completes sample their first token."""
    rows = self._row_bucket(len(batch))
    toks = np.zeros((rows, width), np.int32)
    starts = np.zeros((rows,), np.int32)
    lengths = np.ones((rows,), np.int32)
    slots = np.full((rows,), self.max_slots, np.int32)  # padding rows write nowhere
    done = np.zeros((rows,), bool)
    seeds = np.zeros((rows, 2), np.uint32)
    temp, topk, topp = (
      np.zeros((rows,), np.float32),
      np.zeros((rows,), np.int32),
      np.ones((rows,), np.float32),
    )
    for i, (slot, start, n) in enumerate(batch):
      live = self._slots[slot]
      toks[i, :n] = live.prompt[start : start + n]
      starts[i], lengths[i], slots[i] = start, n, slot
      done[i] = start + n == len(live.prompt)
      seeds[i], temp[i], topk[i], topp[i] = (
        self._seeds[slot],
        self._temp[slot],
        self._topk[slot],
        self._topp[slot],
      )
    # the first chunks attend only to themselves; later chunks to the row's cache too
    window = width if not starts.any() else self.max_len
    first, self._tok_dev, self.cache = self._prefill(
      window,
      self.cache,
      toks,
      starts,
      lengths,
      slots,
      done,
      seeds,
      temp,
      topk,
      topp,
      self._tok_dev,
    )
    read = []
    for i, (slot, start, n) in enumerate(batch):
      live = self._slots[slot]
      live.filled = start + n
      self._pos[slot] = start + n
      if done[i]:
        read.append((slot, live.seq, i))
    if read:
      self._inflight.append(("prefill", first, tuple(read)))

  def _upload_params(self):
    return tuple(
      jax.device_put(a.copy(), self._rep)  # a copy: the host rows change while steps run
      for a in (self._seeds, self._temp, self._topk, self._topp)
    )

  def _launch_decode(self) -> bool:
    rows = tuple(
      (s, live.seq) for s, live in self._slots.items() if live.filled == len(live.prompt)
    )
    if not rows:
      return False
    need = int(max(self._pos[s] for s, _ in rows)) + 1  # each row attends to its pos too
    attend = next(b for b in self.attend_buckets if b >= min(need, self.max_len))
    if self._params_dev is None:  # upload only after slots changed
      self._params_dev = self._upload_params()
    nxt, self.cache = self._decode(attend, self.cache, self._tok_dev, *self._params_dev)
    self._tok_dev = nxt
    for s, _ in rows:
      self._pos[s] += 1
    self._inflight.append(("decode", nxt, rows))
    return True

  def _read(self, entry, ev: StepEvents):
    kind, arr, rows = entry
    vals = np.asarray(arr)  # the one host round trip of a step
    now = time.perf_counter()
    for row in rows:
      slot, seq = row[0], row[1]
      live = self._slots.get(slot)
      if live is None or live.seq != seq:
        continue  # finished or cancelled since: this row's token is discarded
      tok = int(vals[row[2]] if kind == "prefill" else vals[slot])
      live.tokens.append(tok)
      live.times.append(now)
      if live.ttft is None:
        live.ttft = now - live.t0
      ev.tokens.setdefault(live.id, []).append(tok)
      reason = None
      if tok in live.sp.stop_tokens:
        reason = "stop"
      elif len(live.tokens) >= live.sp.max_new_tokens:
        reason = "length"
      elif len(live.prompt) + len(live.tokens) >= self.max_len:
        reason = "cache_full"
      if reason is not None:
        self._finish(slot, reason, ev)

  def _finish(self, slot: int, reason: str, ev: StepEvents, error: str | None = None):
    live = self._slots.pop(slot)
    del self._slot_of[live.id]
    with self._lock:
      self._ids.discard(live.id)
      self._cancels.discard(live.id)
    self._free.append(slot)
    # a free row samples greedily (the sampled path runs only while some row samples)
    self._temp[slot], self._topk[slot], self._topp[slot] = 0.0, 0, 1.0
    self._params_dev = None
    ev.finished.append(
      Result(live.id, live.prompt, list(live.tokens), reason, live.ttft, live.times, error)
    )

  def _cache_intact(self) -> bool:
    return not any(a.is_deleted() for a in jax.tree.leaves(self.cache))

  def _fail_running(self, e: Exception, ev: StepEvents):
    """A step failed: every running request returns with the error; fresh cache and state."""
    log.error(
      "engine: a step failed (%s: %s); returning %d running requests with the error",
      type(e).__name__,
      e,
      len(self._slots),
    )
    msg = f"{type(e).__name__}: {e}"
    for slot in list(self._slots):
      self._finish(slot, "error", ev, error=msg)
    self._inflight.clear()
    self._pos[:] = 0
    self.cache = self._fresh_cache()
    self._reset_device_state()

  def fusion_report(self) -> dict:
    """What ``lrjax.fuse`` rewrites in this engine's decode step and which kernel serves each op
    on this platform (from ``lrjax.explain``): ``{"fused", "platform", "ops": {pattern: count},
    "kernels": {pattern: [kernel notes]}, "near_misses": n, "near_miss_reasons": [why]}``.
    See :func:`fusion_line`."""
    plat = _platform()
    if not self.fuse:
      return {
        "fused": False,
        "platform": plat,
        "ops": {},
        "kernels": {},
        "near_misses": 0,
        "near_miss_reasons": [],
        "grouped": 0,
        "attention": self._attention_lowering(plat),
      }
    import lrjax

    model = nnx.merge(self.gdef, self.state)
    fn = lrkv.decode if self.lowrank_kv else type(model).decode
    toks = jnp.zeros((self.max_slots,), jnp.int32)
    fn = functools.partial(fn, attend_len=self.attend_buckets[0])  # static, not traced
    rep = lrjax.explain(fn, model, toks, self.cache)
    return dict(summarize_explain(rep, plat), attention=self._attention_lowering(plat))

  def _attention_lowering(self, plat: str) -> str:
    """What serves the decode steps' attention over the KV cache on ``plat`` (at the largest
    attend bucket): a kernel's name, or the XLA reference and why."""
    if self.lowrank_kv:
      return "lr_kv_attention (low-rank KV cache)"
    from lrjax.sharding.split import STRATEGY as SPLIT

    c = self.cfg
    rows, heads, kv_heads = self.max_slots, c.num_heads, c.num_kv_heads
    if self.plan is not None and self.plan.mesh.size > 1:
      if self.plan.strategy != SPLIT:  # XLA partitions the reference of a GSPMD program
        return f"XLA reference (a model sharded over {self.plan.mesh.size} devices)"
      # lowrank_split's per-device program binds it on each device's rows and heads
      tp = self.plan.mesh.shape["tp"]
      rows, heads, kv_heads = rows // self.plan.mesh.shape["data"], heads // tp, kv_heads // tp
    from lrjax.lowering import registry

    q = jax.ShapeDtypeStruct((rows, heads, c.head_dim), self._compute_dtype)
    kshape = (rows, kv_heads, self.max_len, c.head_dim)
    k = jax.ShapeDtypeStruct(kshape, self._cache_dtype)
    pos = jax.ShapeDtypeStruct((rows,), jnp.int32)
    length = self.attend_buckets[-1]
    params = {"window": c.sliding_window, "length": None if length == self.max_len else length}
    # the step binds decode_attention_append (RoPE, cache writes, attention); where its kernel
    # declines, its reference binds decode_attention
    new = jax.ShapeDtypeStruct((rows, kv_heads, c.head_dim), self._compute_dtype)
    tab = jax.ShapeDtypeStruct((rows, c.head_dim), self._compute_dtype)
    avals = (q, new, new, k, k, pos, tab, tab)
    sel = registry.select("decode_attention_append", plat, avals, params)
    if sel.kernel is not None:
      return sel.kernel.name
    declined = list(sel.declined)
    sel = registry.select("decode_attention", plat, (q, k, k, pos), params)
    if sel.kernel is not None:
      return sel.kernel.name + (
        f" (RoPE and cache writes by XLA: {declined[0][1]})" if declined else ""
      )
    why = "; ".join(f"{name}: {reason}" for name, reason in declined + list(sel.declined))
    return "XLA reference" + (f" ({why})" if why else "")

  def warmup(self, progress: bool = False) -> int:
    """Compile every step this engine can take (each of :meth:`prefill_variants`, a decode per
    attend bucket, and a request's small per-admission ops) before serving, so no request waits
    on a compile. Only while idle (the prefills write nothing; the decodes run on free rows).
    Returns the steps run, the short request's counted as one. ``progress``: a bar on
    stderr, a step each."""
    from tqdm.auto import tqdm

    if self.busy:
      raise RuntimeError("warmup() needs an idle engine (no active or waiting requests)")
    variants = self.prefill_variants()
    total = len(variants) + len(self.attend_buckets) + 1
    with tqdm(total=total, desc="warm-up (compile)", unit="step", disable=not progress) as bar:
      done = self._warmup(variants, bar)
    return done

  def _warmup(self, variants, bar) -> int:
    done = 0
    for rows, b, window in variants:
      t0 = time.perf_counter()
      first, self._tok_dev, self.cache = self._prefill(
        window,
        self.cache,
        np.zeros((rows, b), np.int32),
        np.zeros((rows,), np.int32),
        np.ones((rows,), np.int32),
        np.full((rows,), self.max_slots, np.int32),  # padding rows: nothing is written
        np.zeros((rows,), bool),
        np.zeros((rows, 2), np.uint32),
        np.zeros((rows,), np.float32),
        np.zeros((rows,), np.int32),
        np.ones((rows,), np.float32),
        self._tok_dev,
      )
      first.block_until_ready()
      done += 1
      bar.update()
      log.info(
        "engine warmup: prefill of %d rows x %d tokens (window %d) in %.1f s",
        rows,
        b,
        window,
        time.perf_counter() - t0,
      )
    params = self._upload_params()
    for b in self.attend_buckets:
      t0 = time.perf_counter()
      self._reset_positions()
      self._tok_dev, self.cache = self._decode(b, self.cache, self._tok_dev, *params)
      nxt = self._tok_dev
      nxt.block_until_ready()
      done += 1
      bar.update()
      log.info("engine warmup: decode over %d positions in %.1f s", b, time.perf_counter() - t0)
    # one short request through the whole path: the per-admission ops compile too
    self.generate([Request([0], SamplingParams(max_new_tokens=2, temperature=1.0))])
    done += 1
    bar.update()
    self._reset_positions()
    self._reset_device_state()
    return done

  def _reset_positions(self):
    pos = self.cache.pos
    self.cache = dataclasses.replace(
      self.cache, pos=jax.device_put(jnp.zeros(pos.shape, pos.dtype), pos.sharding)
    )

  def generate(self, requests: Iterable[Request]) -> list[Result]:
    """Run ``requests`` to completion (continuous batching); results in submission order.

    The batch is validated whole before any of it is queued. Requests submitted by others
    meanwhile are stepped too, and their results dropped: use :meth:`step_events` to share."""
    requests = list(requests)
    for r in requests:
      self.check(r)
    given = [r.id for r in requests if r.id is not None]
    dup = {i for i in given if given.count(i) > 1}
    if dup:
      raise ValueError(f"request id {min(dup)} appears twice in the batch; ids must be unique")
    ids: list[int] = []
    try:
      for r in requests:
        ids.append(self.submit(r))
    except Exception:
      for rid in ids:  # refuse the batch whole
        self.cancel(rid)
      self.step_events()
      raise
    want, done = set(ids), {}
    while want - set(done):
      for r in self.step():
        if r.id in want:
          done[r.id] = r
    return [done[i] for i in ids]


def _platform() -> str:
  """The lowering platform name of the default backend (cpu, cuda, rocm, neuron)."""
  dev = default_device()
  if dev.platform == "gpu":
    return "rocm" if "rocm" in dev.client.platform_version.lower() else "cuda"
  return dev.platform


def _note(k: dict) -> str:
  if k["kernel"] == "reference":
    return f"XLA reference ({k['declined'][0][0]} declined)" if k["declined"] else "XLA reference"
  return k["kernel"]


def summarize_explain(rep, platform: str) -> dict:
  """An :class:`~lrjax.lowering.explain.ExplainReport` → counts of each fused op and the
  kernels that serve them on ``platform``."""
  ops: dict[str, int] = {}
  kernels: dict[str, set] = {}
  grouped = {loc for g in rep.groups for loc in g["members"]}  # source locations (per line)
  n_grouped = sum(len(g["members"]) for g in rep.groups)
  for m in rep.matches:
    ops[m["pattern"]] = ops.get(m["pattern"], 0) + 1
    if m["location"] in grouped:
      continue  # served by its group's kernel
    k = m["kernels"].get(platform)
    if k is not None:
      kernels.setdefault(m["pattern"], set()).add(_note(k))
  for g in rep.groups:
    ops["lr_xuv_group"] = ops.get("lr_xuv_group", 0) + 1
    k = g["kernels"].get(platform)
    if k is not None:
      kernels.setdefault("lr_xuv_group", set()).add(_note(k))
  return {
    "fused": True,
    "platform": platform,
    "ops": ops,
    "kernels": {p: sorted(v) for p, v in kernels.items()},
    "near_misses": len(rep.near_misses),
    "near_miss_reasons": sorted({f"{n['pattern']}: {n['reason']}" for n in rep.near_misses}),
    "grouped": n_grouped,  # lr_xuv matches bound into the groups
  }


def fusion_line(summary: dict) -> str:
  """One log line of :meth:`Engine.fusion_report`."""
  if not summary["fused"]:
    return f"fusion off (--no-fuse): the steps run XLA's own GEMMs on {summary['platform']}"
  if not summary["ops"]:
    return "lrjax.fuse found nothing to fuse in the decode step (a dense model): XLA's GEMMs"
  ops = ", ".join(
    f"{n} {p}"
    + (
      f" ({summary['grouped']} of them grouped)" if p == "lr_xuv" and summary.get("grouped") else ""
    )
    for p, n in sorted(summary["ops"].items())
  )
  ks = "; ".join(f"{p} -> {', '.join(v)}" for p, v in sorted(summary["kernels"].items()))
  n_miss = summary["near_misses"]
  why = "lrjax -v or lrjax.explain says why"
  miss = f"; {n_miss} near-miss(es) left unfused ({why})" if n_miss else ""
  att = f"; decode attention -> {summary['attention']}" if summary.get("attention") else ""
  return f"lrjax.fuse in the decode step: {ops}; on {summary['platform']}: {ks}{miss}{att}"


def _canonical_spec(spec, mesh) -> P:
  """``spec`` without size-1 mesh axes or trailing Nones: how XLA spells a step's output."""
  out = []
  for a in spec:
    names = tuple(
      n for n in (a if isinstance(a, tuple) else (a,)) if n is not None and mesh.shape[n] > 1
    )
    out.append(None if not names else names[0] if len(names) == 1 else names)
  while out and out[-1] is None:
    out.pop()
  return P(*out)


def _cache_tree(cache, shardings):
  arr, pos = shardings
  return jax.tree.map(lambda a: arr if a.ndim > 1 else pos, cache)


class _StepKey(NamedTuple):
  gdef: nnx.GraphDef
  treedef: jax.tree_util.PyTreeDef  # of the weights list
  lowrank: bool  # rank-space KV cache
  fuse: bool
  shardings: tuple | None  # (the cache arrays', pos's) or None on one device


class _Static:
  """A static jit argument whose hash is computed once; equal to itself at once (by identity)
  and to an equal value from another engine (so engines over one model share compilations)."""

  __slots__ = ("value", "_hash")

  def __init__(self, value):
    self.value, self._hash = value, hash(value)

  def __hash__(self):
    return self._hash

  def __eq__(self, other):
    return isinstance(other, _Static) and (
      self.value is other.value or (self._hash == other._hash and self.value == other.value)
    )


def _call(static, weights, method, *args, **static_kw):
  key = static.value
  model = nnx.merge(key.gdef, jax.tree.unflatten(key.treedef, weights))
  if method == "extend":
    fn = _extend
  elif key.lowrank:
    fn = {"prefill": lrkv.prefill, "decode": lrkv.decode}[method]
  else:
    fn = {"prefill": type(model).prefill, "decode": type(model).decode}[method]
  fn = functools.partial(fn, **static_kw) if static_kw else fn
  if key.fuse:
    import lrjax

    fn = lrjax.fuse(fn)
  return fn(model, *args)


def _constrain(cache, shardings):
  """The cache keeps its sharding (KV heads over "tp") across steps."""
  if shardings is None:
    return cache
  return jax.tree.map(jax.lax.with_sharding_constraint, cache, _cache_tree(cache, shardings))


def _extend(model, tokens, cache, starts, lengths, lowrank: bool):
  """Run prompt chunks ``tokens`` [R, S] (valid lengths [R]) at positions ``starts`` [R] + 0..
  over a cache of R rows whose first ``T`` positions hold each row's earlier tokens (T =
  the cache's length): the chunk's keys and values are written at ``starts``, attention covers
  the row's earlier tokens and the chunk's causal prefix. Returns (h at each row's last valid
  token [R, hidden], the rows' cache)."""
  r, s = tokens.shape
  t = cache.max_len
  q_pos = starts[:, None] + jnp.arange(s, dtype=jnp.int32)[None]
  k_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (r, t))
  mask = _mask(q_pos, k_pos, k_pos < (starts + lengths)[:, None], model.cfg.sliding_window)
  h = model.embed(tokens)
  if lowrank:
    h, zk, zv = lrkv._run(model, h, q_pos, mask, cache, starts)
    cache = lrkv.LowRankKVCache(zk, zv, starts + lengths)
  else:
    h, (k, v) = model._run_layers(h, q_pos, mask, cache, starts, scan=False, attend_cache=True)
    cache = KVCache(k, v, starts + lengths)
  last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
  return model._logits(last), cache


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def _prefill_jit(
  static,
  window,
  weights,
  cache,
  tokens,
  starts,
  lengths,
  slots,
  done,
  seeds,
  temp,
  topk,
  topp,
  tok_vec,
):
  """Prompt chunks into cache rows. tokens [R, S]; starts, lengths, slots [R] int32 (a padding
  row's slot is out of range: it writes nothing); done [R] (the chunk ends the prompt: its
  sampled token goes to ``tok_vec``); seeds [R, 2]; temp/topk/topp [R]. The rows' first
  ``window`` positions are read and written back (``window`` = S when every start is 0).
  Returns (first tokens [R], tok_vec, cache)."""
  key = static.value
  n = cache.pos.shape[0]
  safe = jnp.minimum(slots, n - 1)  # padding rows read a real row; their writes are dropped

  def rows(bufs):
    return tuple(
      jnp.take(b, safe, axis=0)[:, :, :window]
      if b.ndim == 4
      else jnp.take(b, safe, axis=0)[:, :window]
      for b in bufs
    )

  def put(bufs, sub):
    return tuple(
      b.at[slots, :, :window].set(x, mode="drop")
      if b.ndim == 4
      else b.at[slots, :window].set(x, mode="drop")
      for b, x in zip(bufs, sub)
    )

  if key.lowrank:
    sub = lrkv.LowRankKVCache(rows(cache.zk), rows(cache.zv), starts)
  else:
    sub = KVCache(rows(cache.k), rows(cache.v), starts)
  logits, sub = _call(static, weights, "extend", tokens, sub, starts, lengths, lowrank=key.lowrank)
  keys = jax.vmap(_request_key)(seeds)
  first = sample(logits, keys, temp, topk, topp)
  pos = cache.pos.at[slots].set(starts + lengths, mode="drop")
  if key.lowrank:
    cache = lrkv.LowRankKVCache(put(cache.zk, sub.zk), put(cache.zv, sub.zv), pos)
  else:
    cache = KVCache(put(cache.k, sub.k), put(cache.v, sub.v), pos)
  tok_vec = tok_vec.at[jnp.where(done, slots, n)].set(first, mode="drop")
  shardings = key.shardings
  if shardings is not None:
    first, tok_vec = (jax.lax.with_sharding_constraint(a, shardings[1]) for a in (first, tok_vec))
  return first, tok_vec, _constrain(cache, shardings)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def _decode_jit(static, attend_len, weights, cache, tokens, seeds, temp, topk, topp):
  """tokens [slots], seeds [slots, 2] uint32 (each slot's request seed) → (next tokens [slots],
  cache); attention over the first ``attend_len`` cache positions."""
  keys = jax.vmap(_request_key)(seeds)
  step_keys = jax.vmap(jax.random.fold_in)(keys, cache.pos)  # draw i of a request: its pos
  logits, cache = _call(static, weights, "decode", tokens, cache, attend_len=attend_len)
  nxt = sample(logits, step_keys, temp, topk, topp)
  shardings = static.value.shardings
  if shardings is not None:
    nxt = jax.lax.with_sharding_constraint(nxt, shardings[1])
  return nxt, _constrain(cache, shardings)


def itl(results: Sequence[Result]) -> list[float]:
  """Inter-token latencies (s) over all results."""
  out = []
  for r in results:
    out += list(np.diff(r.token_times))
  return out
