"""Generation engine: jitted prefill/decode over a mesh, slot-based continuous batching.

  engine = Engine(model, max_slots=8, max_len=512)          # model sharded by lrjax.sharding
  outs = engine.generate([Request([1, 2, 3], SamplingParams(max_new_tokens=32))])

The KV cache holds one static-shape buffer [slots, kv_heads, max_len, head_dim] per layer (or
the rank-space :class:`~lrjax.serving.lowrank_kv.LowRankKVCache`), sharded by the model's
:class:`~lrjax.sharding.TPPlan` and donated to every step. A new request is prefilled into a free
slot (prompt right-padded to a length bucket, so compiles are bounded by the bucket count); all
slots then decode together, one token per step, attending over the smallest attend bucket that
holds every active row's context (one compile per attend bucket); a finished request frees its
slot between steps and the next waiting request joins.

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
  ``lrjax.fuse``, so the low-rank projections reach this platform's kernels (:meth:`explain`
  says which). ``attend_buckets`` (default: powers of two from 128, and ``max_len``): each
  decode step attends over the smallest that holds every active row's context.
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
    self.plan = getattr(model, "tp_plan", None)
    if self.plan is not None and max_slots % self.plan.mesh.shape["data"]:
      raise ValueError(
        f"{max_slots=} must be a multiple of the mesh's data axis "
        f"({self.plan.mesh.shape['data']}): slots are split over it"
      )
    self.lowrank_kv, self.fuse = lowrank_kv, fuse
    self._cache_dtype = cache_dtype or model.dtype or model.embed.embedding[...].dtype
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
  def _prefill(self, *args):
    return _prefill_jit(self._static, self._weights, *args)

  def _decode(self, attend_len, *args):
    return _decode_jit(self._static, attend_len, self._weights, *args)

  # ---- requests ------------------------------------------------------------------------------
  @property
  def max_prompt_len(self) -> int:
    """The longest prompt this engine takes (the largest bucket, leaving room for a token)."""
    return min(self.buckets[-1], self.max_len - 1)

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
    while len(self._inflight) > (1 if launched else 0):
      entry = self._inflight.popleft()
      try:
        self._read(entry, ev)
      except Exception as e:  # noqa: BLE001
        self._fail_running(e, ev)
    return ev

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
    while self._free:
      with self._lock:
        if not self._waiting:
          return
        rid, prompt, sp, t0 = self._waiting.popleft()
      slot = self._free.pop(0)
      live = _Live(rid, prompt, sp, t0)
      self._slots[slot], self._slot_of[rid] = live, slot
      try:
        self._launch_prefill(slot, live)
      except Exception as e:  # noqa: BLE001 - this request fails; the others go on
        if not self._cache_intact():
          self._fail_running(e, ev)
        else:
          log.warning("engine: request %d failed at admission: %s", rid, e)
          self._finish(slot, "error", ev, error=f"{type(e).__name__}: {e}")

  def _launch_prefill(self, slot: int, live: _Live):
    sp, n = live.sp, len(live.prompt)
    toks = np.zeros((1, self._bucket(n)), np.int32)
    toks[0, :n] = live.prompt
    self._seeds[slot] = _seed_words(sp.seed)
    self._temp[slot], self._topk[slot], self._topp[slot] = sp.temperature, sp.top_k, sp.top_p
    self._params_dev = None
    first, self._tok_dev, self.cache = self._prefill(
      self.cache,
      jnp.asarray(toks),
      jnp.int32(n),
      jnp.int32(slot),
      # copies: a CPU device may alias a host array, and these rows change while the step runs
      self._seeds[slot].copy(),
      self._temp[slot : slot + 1].copy(),
      self._topk[slot : slot + 1].copy(),
      self._topp[slot : slot + 1].copy(),
      self._tok_dev,
    )
    self._pos[slot] = n
    self._inflight.append(("prefill", first, ((slot, live.id),)))

  def _upload_params(self):
    return tuple(
      jax.device_put(a.copy(), self._rep)  # a copy: the host rows change while steps run
      for a in (self._seeds, self._temp, self._topk, self._topp)
    )

  def _launch_decode(self) -> bool:
    rows = tuple((s, live.id) for s, live in self._slots.items())
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
    for i, (slot, rid) in enumerate(rows):
      live = self._slots.get(slot)
      if live is None or live.id != rid:
        continue  # finished or cancelled since: this row's token is discarded
      tok = int(vals[i] if kind == "prefill" else vals[slot])
      live.tokens.append(tok)
      live.times.append(now)
      if live.ttft is None:
        live.ttft = now - live.t0
      ev.tokens.setdefault(rid, []).append(tok)
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
    "kernels": {pattern: [kernel notes]}, "near_misses": n}``. See :func:`fusion_line`."""
    plat = _platform()
    if not self.fuse:
      return {
        "fused": False,
        "platform": plat,
        "ops": {},
        "kernels": {},
        "near_misses": 0,
        "grouped": 0,
      }
    import lrjax

    model = nnx.merge(self.gdef, self.state)
    fn = lrkv.decode if self.lowrank_kv else type(model).decode
    toks = jnp.zeros((self.max_slots,), jnp.int32)
    fn = functools.partial(fn, attend_len=self.attend_buckets[0])  # static, not traced
    rep = lrjax.explain(fn, model, toks, self.cache)
    return summarize_explain(rep, plat)

  def warmup(self) -> int:
    """Compile every step this engine can take (a prefill per length bucket, a decode per
    attend bucket, and a request's small per-admission ops) before serving, so no request waits
    on a compile. Only while idle: it runs the steps on free rows. Returns the steps run."""
    if self.busy:
      raise RuntimeError("warmup() needs an idle engine (no active or waiting requests)")
    done = 0
    for b in self.buckets:
      t0 = time.perf_counter()
      first, self._tok_dev, self.cache = self._prefill(
        self.cache,
        jnp.zeros((1, b), jnp.int32),
        jnp.int32(b),
        jnp.int32(0),
        self._seeds[0].copy(),
        self._temp[:1].copy(),
        self._topk[:1].copy(),
        self._topp[:1].copy(),
        self._tok_dev,
      )
      first.block_until_ready()
      done += 1
      log.info("engine warmup: prefill over %d tokens in %.1f s", b, time.perf_counter() - t0)
    params = self._upload_params()
    for b in self.attend_buckets:
      t0 = time.perf_counter()
      self._reset_positions()
      self._tok_dev, self.cache = self._decode(b, self.cache, self._tok_dev, *params)
      nxt = self._tok_dev
      nxt.block_until_ready()
      done += 1
      log.info("engine warmup: decode over %d positions in %.1f s", b, time.perf_counter() - t0)
    # one short request through the whole path: the per-admission ops compile too
    self.generate([Request([0], SamplingParams(max_new_tokens=2, temperature=1.0))])
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
  miss = f"; {summary['near_misses']} near-miss(es) left unfused" if summary["near_misses"] else ""
  return f"lrjax.fuse in the decode step: {ops}; on {summary['platform']}: {ks}{miss}"


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
  if key.lowrank:
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


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _prefill_jit(static, weights, cache, tokens, length, slot, seed, temp, topk, topp, tok_vec):
  """tokens [1, bucket], length/slot [] int32, seed [2] uint32 → (first token [1], tok_vec
  [slots] with it at ``slot``, cache with the slot filled)."""

  # a slot is row ``slot`` of every layer's buffer
  def sl(bufs):
    return tuple(jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=0) for a in bufs)

  def put(bufs, sub):
    return tuple(jax.lax.dynamic_update_slice_in_dim(a, s, slot, axis=0) for a, s in zip(bufs, sub))

  zero = jnp.zeros((1,), jnp.int32)
  pos = cache.pos.at[slot].set(length)
  if static.value.lowrank:
    sub = lrkv.LowRankKVCache(sl(cache.zk), sl(cache.zv), zero)
    logits, sub = _call(static, weights, "prefill", tokens, sub, length[None])
    cache = lrkv.LowRankKVCache(put(cache.zk, sub.zk), put(cache.zv, sub.zv), pos)
  else:
    sub = KVCache(sl(cache.k), sl(cache.v), zero)
    logits, sub = _call(static, weights, "prefill", tokens, sub, length[None])
    cache = KVCache(put(cache.k, sub.k), put(cache.v, sub.v), pos)
  last = jax.lax.dynamic_index_in_dim(logits[0], length - 1, axis=0)
  first = sample(last, _request_key(seed), temp, topk, topp)
  tok_vec = tok_vec.at[slot].set(first[0])
  shardings = static.value.shardings
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
