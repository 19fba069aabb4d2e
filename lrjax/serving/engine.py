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
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from typing import NamedTuple
from collections.abc import Iterable, Sequence

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


@dataclasses.dataclass
class Request:
  prompt: Sequence[int]
  sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
  id: int | None = None


@dataclasses.dataclass
class Result:
  id: int
  prompt: list[int]
  tokens: list[int]
  finish_reason: str  # "stop" | "length" | "cache_full"
  ttft_s: float  # submit → first token
  token_times: list[float]  # wall time of every generated token (perf_counter)


def default_buckets(max_len: int, smallest: int = 16) -> tuple[int, ...]:
  b, out = smallest, []
  while b < max_len:
    out.append(b)
    b *= 2
  return tuple(out) + (max_len,)


class Engine:
  """Continuous-batching generator over ``model`` (sharded or on one device).

  ``unroll_layers`` (default) sets ``model.scan_layers = False``: a scanned model would stack
  (copy) all layer weights inside every step. ``fuse`` runs the steps through ``lrjax.fuse``.
  ``attend_buckets`` (default: powers of two from 128, and ``max_len``): each decode step
  attends over the smallest that holds every active row's context.
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
    fuse: bool = False,
    unroll_layers: bool = True,
    attend_buckets: Sequence[int] | None = None,
  ):
    cfg = model.cfg
    if unroll_layers and getattr(model, "scan_layers", False):
      # The model's scan stacks every layer's weights inside each call: a full weight copy per
      # decode step. Unrolled, each step reads the weights once.
      log.info("engine: running %s's layers unrolled (scan_layers=False)", type(model).__name__)
      model.scan_layers = False
    if not isinstance(max_slots, int) or max_slots < 1:
      raise ValueError(f"{max_slots=} must be a positive int")
    if not isinstance(max_len, int) or max_len < 2:
      raise ValueError(f"{max_len=} must be an int >= 2")
    self.cfg, self.max_slots, self.max_len = cfg, max_slots, max_len
    self.buckets = tuple(sorted(set(buckets or default_buckets(max_len))))
    if self.buckets[-1] > max_len or self.buckets[0] < 1:
      raise ValueError(f"buckets={self.buckets} must lie in [1, {max_len=}]")
    # Decode attends over the smallest of these (max_len always one) that holds every active
    # row's context, not over the whole cache: one compiled step each.
    ab = tuple(attend_buckets or default_buckets(max_len, 128))
    if not all(isinstance(b, int) and 1 <= b <= max_len for b in ab):
      raise ValueError(f"attend_buckets={ab} must be ints in [1, {max_len=}]")
    self.attend_buckets = tuple(sorted(set(ab) | {max_len}))
    self.plan = getattr(model, "tp_plan", None)
    if self.plan is not None and max_slots % self.plan.mesh.shape["data"]:
      raise ValueError(
        f"{max_slots=} must be a multiple of the mesh's data axis "
        f"({self.plan.mesh.shape['data']}): slots are split over it"
      )
    self.lowrank_kv = lowrank_kv
    dtype = cache_dtype or model.dtype or model.embed.embedding[...].dtype
    self.gdef, self.state = nnx.split(model)
    if lowrank_kv:
      cache = lrkv.LowRankKVCache.init(model, max_slots, max_len, dtype)
      spec = P("data") if self.plan else None
    else:
      cache = KVCache.init(cfg, max_slots, max_len, dtype)
      spec = self.plan.cache_sharding().spec if self.plan else None
    self._cache_shardings = None  # (sharding of the two cache arrays, of pos): hashable
    if self.plan is not None:
      mesh = self.plan.mesh
      # spelled as the steps return it (size-1 mesh axes and trailing Nones dropped), so the
      # fresh cache and every step's output share one compiled variant of each step
      self._cache_shardings = (
        NamedSharding(mesh, _canonical_spec(spec, mesh)),
        NamedSharding(mesh, P()),
      )
      cache = jax.device_put(cache, _cache_tree(cache, self._cache_shardings))
    else:  # committed from the start, like every step's output: one compiled variant
      cache = jax.device_put(cache, jax.sharding.SingleDeviceSharding(default_device()))
    self.cache = cache
    # Each step's jit is keyed by the graph, the cache layout and two flags. Hashing a GraphDef
    # walks the whole model (1.8 ms at 32 layers) and flattening the nnx State takes 0.4 ms:
    # both once here, not every token; the steps take the weights as a flat list.
    leaves, treedef = jax.tree.flatten(self.state)
    self._weights = leaves
    self._static = _Static(_StepKey(self.gdef, treedef, lowrank_kv, fuse, self._cache_shardings))
    self._free = list(range(max_slots))
    self._slots: dict[int, dict] = {}
    self._waiting: collections.deque = collections.deque()
    self._next_id = 0
    self._tokens = np.zeros((max_slots,), np.int32)
    self._temp = np.zeros((max_slots,), np.float32)
    self._topk = np.zeros((max_slots,), np.int32)
    self._topp = np.ones((max_slots,), np.float32)
    # Per-slot request keys: a request's draws depend only on its seed and positions.
    # Small per-step inputs live replicated (on the mesh, or on one device), the same sharding
    # as the decode step's outputs, so feeding tokens back never changes the compiled variant.
    self._rep = (
      NamedSharding(self.plan.mesh, P())
      if self.plan is not None
      else jax.sharding.SingleDeviceSharding(default_device())
    )
    self._keys = jax.device_put(jax.random.split(jax.random.key(0), max_slots), self._rep)
    self._dev = None  # device copies of (tokens, temp, top_k, top_p); None after slot changes

  # ---- jitted steps (module-level jits: engines over the same model share compilations) ------
  def _prefill(self, *args):
    return _prefill_jit(self._static, self._weights, *args)

  def _decode(self, attend_len, *args):
    return _decode_jit(self._static, attend_len, self._weights, *args)

  # ---- requests ------------------------------------------------------------------------------
  def _check(self, req: Request) -> list[int]:
    if not isinstance(req, Request):
      raise TypeError(f"request must be a lrjax.serving.Request; got {type(req).__name__}")
    if not isinstance(req.sampling, SamplingParams):
      raise TypeError(f"request.sampling must be SamplingParams; got {type(req.sampling).__name__}")
    prompt = [int(t) for t in req.prompt]
    if not prompt:
      raise ValueError("prompt is empty; a request needs at least one token id")
    if len(prompt) > self.buckets[-1] or len(prompt) >= self.max_len:
      raise ValueError(
        f"prompt has {len(prompt)} tokens; this engine takes at most "
        f"{min(self.buckets[-1], self.max_len - 1)} (max_len={self.max_len} "
        "leaves room for one generated token)"
      )
    bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
    if bad:
      raise ValueError(
        f"prompt token ids {bad[:5]} are outside [0, vocab_size={self.cfg.vocab_size})"
      )
    return prompt

  def submit(self, req: Request) -> int:
    """Queue a request (validated now); returns its id."""
    prompt = self._check(req)
    rid = req.id if req.id is not None else self._next_id
    self._next_id = max(self._next_id, rid + 1)
    self._waiting.append((rid, prompt, req.sampling, time.perf_counter()))
    return rid

  def _bucket(self, n: int) -> int:
    return next(b for b in self.buckets if b >= n)

  def _admit(self, finished: list[Result]):
    while self._waiting and self._free:
      rid, prompt, sp, t0 = self._waiting.popleft()
      slot = self._free.pop(0)
      b = self._bucket(len(prompt))
      toks = np.zeros((1, b), np.int32)
      toks[0, : len(prompt)] = prompt
      key = jax.random.key(sp.seed)
      self._keys = jax.device_put(self._keys.at[slot].set(key), self._rep)
      self._temp[slot], self._topk[slot], self._topp[slot] = sp.temperature, sp.top_k, sp.top_p
      first, self.cache = self._prefill(
        self.cache,
        jnp.asarray(toks),
        jnp.int32(len(prompt)),
        jnp.int32(slot),
        key,
        self._temp[slot : slot + 1],
        self._topk[slot : slot + 1],
        self._topp[slot : slot + 1],
      )
      tok = int(first[0])
      now = time.perf_counter()
      st = dict(
        id=rid, prompt=prompt, sp=sp, tokens=[tok], t0=t0, ttft=now - t0, times=[now], key=key
      )
      self._tokens[slot] = tok
      self._slots[slot] = st
      self._dev = None
      self._maybe_finish(slot, finished)

  def _maybe_finish(self, slot: int, finished: list[Result]):
    st = self._slots[slot]
    sp, toks = st["sp"], st["tokens"]
    reason = None
    if toks[-1] in sp.stop_tokens:
      reason = "stop"
    elif len(toks) >= sp.max_new_tokens:
      reason = "length"
    elif len(st["prompt"]) + len(toks) >= self.max_len:
      reason = "cache_full"
    if reason is not None:
      finished.append(Result(st["id"], st["prompt"], list(toks), reason, st["ttft"], st["times"]))
      del self._slots[slot]
      self._free.append(slot)
      self._temp[slot], self._topk[slot], self._topp[slot] = 0.0, 0, 1.0
      self._dev = None

  def step(self) -> list[Result]:
    """Admit waiting requests into free slots, then one decode step for all slots."""
    finished: list[Result] = []
    self._admit(finished)
    if not self._slots:
      return finished
    if self._dev is None:  # upload only after slots changed; else feed back the last tokens
      self._dev = tuple(
        jax.device_put(a, self._rep) for a in (self._tokens, self._temp, self._topk, self._topp)
      )
    toks, temp, topk, topp = self._dev
    # every active row decodes at position len(prompt) + len(tokens) - 1
    need = max(len(st["prompt"]) + len(st["tokens"]) for st in self._slots.values())
    attend = next(b for b in self.attend_buckets if b >= min(need, self.max_len))
    nxt_dev, self.cache = self._decode(attend, self.cache, toks, self._keys, temp, topk, topp)
    self._dev = (nxt_dev, temp, topk, topp)
    nxt = np.asarray(nxt_dev)
    now = time.perf_counter()
    for slot in list(self._slots):
      st = self._slots[slot]
      st["tokens"].append(int(nxt[slot]))
      st["times"].append(now)
      self._tokens[slot] = nxt[slot]
      self._maybe_finish(slot, finished)
    return finished

  def warmup(self) -> int:
    """Compile every step this engine can take (a prefill per length bucket, a decode per
    attend bucket) before serving, so no request waits on a compile. Only while idle: it runs
    the steps on the free slots' rows. Returns the number of steps run."""
    if self.busy:
      raise RuntimeError("warmup() needs an idle engine (no active or waiting requests)")
    done = 0
    for b in self.buckets:
      t0 = time.perf_counter()
      first, self.cache = self._prefill(
        self.cache,
        jnp.zeros((1, b), jnp.int32),
        jnp.int32(b),
        jnp.int32(0),
        jax.random.key(0),
        self._temp[:1],
        self._topk[:1],
        self._topp[:1],
      )
      first.block_until_ready()
      done += 1
      log.info("engine warmup: prefill over %d tokens in %.1f s", b, time.perf_counter() - t0)
    self._reset_positions()
    toks, temp, topk, topp = (
      jax.device_put(a, self._rep) for a in (self._tokens, self._temp, self._topk, self._topp)
    )
    for b in self.attend_buckets:
      t0 = time.perf_counter()
      nxt, self.cache = self._decode(b, self.cache, toks, self._keys, temp, topk, topp)
      nxt.block_until_ready()
      done += 1
      log.info("engine warmup: decode over %d positions in %.1f s", b, time.perf_counter() - t0)
    self._reset_positions()
    self._dev = None
    return done

  def _reset_positions(self):
    pos = self.cache.pos
    self.cache = dataclasses.replace(
      self.cache, pos=jax.device_put(jnp.zeros(pos.shape, pos.dtype), pos.sharding)
    )

  @property
  def busy(self) -> bool:
    return bool(self._slots or self._waiting)

  def generate(self, requests: Iterable[Request]) -> list[Result]:
    """Run ``requests`` to completion (continuous batching); results in submission order."""
    ids = [self.submit(r) for r in requests]
    done: dict[int, Result] = {}
    while self.busy:
      for r in self.step():
        done[r.id] = r
    return [done[i] for i in ids]


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
def _prefill_jit(static, weights, cache, tokens, length, slot, key, temp, topk, topp):
  """tokens [1, bucket], length/slot [] int32 → (first token [1], cache with the slot filled)."""

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
  return sample(last, key, temp, topk, topp), _constrain(cache, static.value.shardings)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def _decode_jit(static, attend_len, weights, cache, tokens, keys, temp, topk, topp):
  """tokens [slots], keys [slots] (each slot's request key) → (next tokens [slots], cache);
  attention over the first ``attend_len`` cache positions."""
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
