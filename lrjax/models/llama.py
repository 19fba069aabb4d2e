"""Llama-family decoder (Llama 2/3.x, Mistral, Qwen2, Qwen3) in Flax NNX with plain-jnp math.

Each projection is an ``lrjax.nn.Linear`` or ``lrjax.nn.LowRankLinear``; the MLP is written as
``down(silu(gate(x)) * up(x))`` so ``lrjax.fuse`` sees the x·u·v chains and the low-rank MLP.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lrjax.lowering.attention import attention
from lrjax.lowering.decode_attention import (
  decode_attention,
  decode_attention_append,
  rope,
  rope_tables,
)
from lrjax.lowering.rms_norm import rms_norm
from lrjax.models.config import ModelConfig
from lrjax.nn.linear import Linear, LowRankLinear, param

log = logging.getLogger("lrjax.models")

ATTN_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJS = ("gate_proj", "up_proj", "down_proj")
PROJ_NAMES = ATTN_PROJS + MLP_PROJS
_PROJ_AXES = {
  "q_proj": ("embed", "heads"),
  "k_proj": ("embed", "kv_heads"),
  "v_proj": ("embed", "kv_heads"),
  "o_proj": ("heads", "embed"),
  "gate_proj": ("embed", "mlp"),
  "up_proj": ("embed", "mlp"),
  "down_proj": ("mlp", "embed"),
}

# Per-layer ranks: {proj_name: rank} for low-rank projections; absent names are dense.
LayerRanks = Mapping[str, int]


class Record(dict):
  """A JSON-like dict that hashes by content, so a model holding it keeps a hashable graphdef."""

  def __hash__(self):
    return hash(json.dumps(self, sort_keys=True, default=str))


def proj_axes(name: str) -> tuple[str, str]:
  """Logical (in, out) axis names of projection ``name``."""
  return _PROJ_AXES[name]


def make_proj(
  cfg: ModelConfig,
  name: str,
  rank: int | None,
  *,
  heads: int = 1,
  dtype,
  param_dtype,
  rngs: nnx.Rngs,
):
  """The projection module ``name`` of one layer.

  Dense ``Linear`` if ``rank`` is None, ``LowRankLinear`` if ``heads`` is 1, else a per-head
  ``lrjax.compression.HeadwiseLowRankLinear`` with total rank ``rank`` over ``heads`` heads.
  """
  k, n = cfg.proj_shapes()[name]
  bias = {
    "q_proj": cfg.qkv_bias,
    "k_proj": cfg.qkv_bias,
    "v_proj": cfg.qkv_bias,
    "o_proj": cfg.o_bias,
  }.get(name, cfg.mlp_bias)
  kw = dict(use_bias=bias, axes=_PROJ_AXES[name], dtype=dtype, param_dtype=param_dtype, rngs=rngs)
  if rank is None:
    return Linear(k, n, **kw)
  if heads == 1:
    return LowRankLinear(k, n, int(rank), **kw)
  if n % heads or rank % heads:
    raise ValueError(f"{name}: out={n} and {rank=} must be multiples of {heads=}")
  from lrjax.compression.modules import HeadwiseLowRankLinear

  return HeadwiseLowRankLinear(k, heads, n // heads, int(rank) // heads, **kw)


class RMSNorm(nnx.Module):
  """y = w · x / rms(x) over the last axis; statistics in f32 (as HF)."""

  def __init__(self, dim: int, eps: float, *, axes=("embed",), dtype=None, param_dtype=jnp.float32):
    self.eps, self.dtype = eps, dtype
    self.weight = param(jnp.ones((dim,), param_dtype), axes)

  def __call__(self, x):
    # one primitive, so that lrjax.fuse can fold it into the projections that read it
    return rms_norm(x, self.weight[...], eps=self.eps, dtype=self.dtype or x.dtype)


class Embed(nnx.Module):
  """Token embedding table [vocab, embed]."""

  def __init__(self, vocab: int, dim: int, *, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.dtype = dtype
    self.embedding = param(
      jax.random.normal(rngs.params(), (vocab, dim), param_dtype) * 0.02, ("vocab", "embed")
    )

  def __call__(self, tokens):
    e = jnp.take(self.embedding[...], tokens, axis=0)
    return e.astype(self.dtype or e.dtype)

  def attend(self, h):
    """Tied output head: h [..., embed] · embeddingᵀ → [..., vocab]."""
    dt = self.dtype or h.dtype
    return jnp.matmul(h.astype(dt), self.embedding[...].astype(dt).T)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """Rotary inverse frequencies [head_dim/2] (f64), with ``linear``/``llama3`` scaling."""
  d = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
  rs = cfg.rope_scaling_dict
  rtype = rs.get("rope_type", "default")
  if rtype == "linear":
    inv = inv / float(rs["factor"])
  elif rtype == "llama3":
    factor, lo, hi = (
      float(rs["factor"]),
      float(rs["low_freq_factor"]),
      float(rs["high_freq_factor"]),
    )
    old = float(rs["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    inv = np.where(medium, smoothed, scaled)
  return inv


def apply_rope(x, positions, inv_freq):
  """Rotate-half RoPE. x [B, S, H, D], positions [B, S] int, inv_freq [D/2] f32."""
  ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, D/2]
  ang = jnp.concatenate([ang, ang], axis=-1)[:, :, None, :]  # [B, S, 1, D]
  return rope(x, jnp.cos(ang).astype(x.dtype), jnp.sin(ang).astype(x.dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  """Static-shape KV cache, one buffer per layer: ``k[i]``, ``v[i]`` [batch, kv_heads, max_len,
  head_dim] (tuples of num_layers arrays); pos [batch] int32.

  ``pos[b]`` is the number of valid positions of row b (the next write index). Per-layer
  buffers, not one [layers, ...] array: XLA copies a layer's slice out of a stacked array before
  attention reads it (two memcpys a layer on an H200, 16-25 % of a Llama-3-8B decode step at
  batch 8-16: benchmarks/results/model_1gpu_h200.json), while a buffer of its own is read where
  it lies and updated in place. Heads before positions: the attention dots batch over (batch,
  head), and with positions first XLA:GPU transposed every layer's whole buffer on the way in
  and out of a jitted decode step.
  """

  k: tuple
  v: tuple
  pos: jax.Array

  @classmethod
  def init(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))  # noqa: E731
    return cls(zeros(), zeros(), jnp.zeros((batch,), jnp.int32))

  @property
  def max_len(self) -> int:
    return self.k[0].shape[2]


def write_kv(buf, new, write_pos, heads_first: bool = False):
  """``buf`` [B,T,...] (or [B,H,T,D] with ``heads_first``) with ``new`` [B,S,...] written at
  positions ``write_pos`` [B] + 0..S-1 (in place when ``buf`` is donated); writes past T are
  dropped."""
  b, s = new.shape[:2]
  rows = jnp.arange(b)[:, None]
  cols = write_pos[:, None] + jnp.arange(s, dtype=jnp.int32)[None]
  at = buf.at[rows, :, cols] if heads_first else buf.at[rows, cols]  # both take [B,S,...]
  return at.set(new.astype(buf.dtype), mode="drop")


def cached_attention(q, k, v, mask, kv, write_pos, attend_cache, *, window=None):
  """(attention [B,S,H·D], kv) of roped q [B,S,H,D] and new k, v [B,S,KV,D] (see
  :meth:`DecoderLayer.__call__` for ``mask``, ``kv``, ``write_pos`` and ``attend_cache``): the
  new keys and values written into the cache buffers, then attention over the cache's first
  ``mask.shape[-1]`` positions (one decode step: the ``decode_attention`` primitive on the
  whole buffers), or over this call's keys alone."""
  if kv is None:
    return attention(q, k, v, mask), None
  kv = tuple(write_kv(c, n, write_pos, heads_first=True) for c, n in zip(kv, (k, v)))
  if not attend_cache:
    return attention(q, k, v, mask), kv
  t = mask.shape[-1]  # the attended positions (the model's attend_len)
  if q.shape[1] == 1:  # one decode step: the primitive reads the buffers unsliced
    return decode_attention(q[:, 0], *kv, write_pos, window=window, length=t)[:, None], kv
  kt, vt = (c[:, :, :t].astype(q.dtype) for c in kv)
  return attention(q, kt, vt, mask, heads_first=True), kv


def rope_and_attend(q, k, v, positions, inv_freq, mask, kv, write_pos, attend_cache, *,
                    window=None):  # fmt: skip
  """:func:`cached_attention` of q [B,S,H,D] and new k, v [B,S,KV,D] before RoPE, which is
  applied at ``positions`` [B,S]. One decode step over the cache (S = 1) binds the
  ``decode_attention_append`` primitive: RoPE, the cache writes and the attention, which a GPU
  kernel may run in the attention's own launches; its reference is the same ops as below."""
  if kv is not None and attend_cache and q.shape[1] == 1 and k.dtype == q.dtype:
    cos, sin = rope_tables(positions[:, 0], inv_freq, q.dtype)
    out, kc, vc = decode_attention_append(
      q[:, 0], k[:, 0], v[:, 0], *kv, write_pos, cos, sin, window=window, length=mask.shape[-1]
    )
    return out[:, None], (kc, vc)
  q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
  return cached_attention(q, k, v, mask, kv, write_pos, attend_cache, window=window)


def _add_projs(module, names, cfg, ranks, heads, **kw):
  """``module.<name>`` for each projection name: dense, or low-rank at ``ranks[name]``."""
  for name in names:
    setattr(module, name, make_proj(cfg, name, ranks.get(name), heads=heads.get(name, 1), **kw))


class Attention(nnx.Module):
  def __init__(
    self, cfg: ModelConfig, ranks: LayerRanks, heads: LayerRanks, *, dtype, param_dtype, rngs
  ):
    self.cfg = cfg
    _add_projs(self, ATTN_PROJS, cfg, ranks, heads, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    if cfg.qk_norm:
      kw = dict(axes=(None,), dtype=dtype, param_dtype=param_dtype)
      self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, **kw)
      self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, **kw)
    else:
      self.q_norm = self.k_norm = None

  def qkv(self, x, positions, inv_freq, rope: bool = True):
    """x [B,S,E] → q [B,S,H,D], k [B,S,KV,D], v [B,S,KV,D]; q and k roped unless ``rope`` is
    False."""
    c = self.cfg
    b, s, _ = x.shape
    q = self.q_proj(x).reshape(b, s, c.num_heads, c.head_dim)
    k = self.k_proj(x).reshape(b, s, c.num_kv_heads, c.head_dim)
    v = self.v_proj(x).reshape(b, s, c.num_kv_heads, c.head_dim)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    if not rope:
      return q, k, v
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


class MLP(nnx.Module):
  def __init__(
    self, cfg: ModelConfig, ranks: LayerRanks, heads: LayerRanks, *, dtype, param_dtype, rngs
  ):
    _add_projs(self, MLP_PROJS, cfg, ranks, heads, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
  """Pre-norm block: h += o(attn(norm(h))); h += mlp(norm(h))."""

  def __init__(
    self,
    cfg: ModelConfig,
    ranks: LayerRanks | None = None,
    heads: LayerRanks | None = None,
    *,
    dtype=None,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    ranks, heads = dict(ranks or {}), dict(heads or {})
    bad = (set(ranks) | set(heads)) - set(PROJ_NAMES)
    if bad:
      raise ValueError(
        f"ranks/heads name unknown projections {sorted(bad)}; expected names in {PROJ_NAMES}"
      )
    kw = dict(dtype=dtype, param_dtype=param_dtype)
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
    self.attn = Attention(cfg, ranks, heads, rngs=rngs, **kw)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
    self.mlp = MLP(cfg, ranks, heads, rngs=rngs, **kw)

  def __call__(
    self, h, positions, inv_freq, mask, kv=None, write_pos=None, taps=None, attend_cache=True
  ):
    """One block. Returns (h, kv).

    Without ``kv`` attention is over this call's keys (``mask`` [B,S,S]). With ``kv`` =
    (k_buf, v_buf), this layer's cache buffers [B,KV,T,D], the new keys and values are written
    at positions ``write_pos`` [B] + 0..S-1 (in place when the cache is donated) and kv comes
    back updated. Attention then covers the cache under ``mask`` [B,S,T], or only this call's
    keys if ``attend_cache`` is False (prefill of an empty cache, ``mask`` [B,S,S]). ``taps``,
    a dict, receives the projection inputs.
    """
    x = self.input_layernorm(h)
    q, k, v = self.attn.qkv(x, positions, inv_freq, rope=False)
    a, kv = rope_and_attend(
      q, k, v, positions, inv_freq, mask, kv, write_pos, attend_cache,
      window=self.attn.cfg.sliding_window,
    )  # fmt: skip
    h = h + self.attn.o_proj(a)
    x2 = self.post_attention_layernorm(h)
    if taps is not None:
      taps.update(
        qkv=x, o=a, gate_up=x2, down=jax.nn.silu(self.mlp.gate_proj(x2)) * self.mlp.up_proj(x2)
      )
    return h + self.mlp(x2), kv

  def ranks(self) -> dict[str, int]:
    """{proj_name: total rank} of this layer's low-rank projections (dense ones are absent)."""
    return {
      name: int(m.rank)
      for name in PROJ_NAMES
      if not isinstance(m := get_proj_module(self, name), Linear)
    }

  def heads(self) -> dict[str, int]:
    """{proj_name: heads} of this layer's per-head low-rank projections."""
    return {
      name: int(m.heads)
      for name in PROJ_NAMES
      if getattr(m := get_proj_module(self, name), "heads", 1) > 1
    }


def get_proj_module(layer: DecoderLayer, name: str):
  if name not in PROJ_NAMES:
    raise ValueError(f"{name=} is not a projection; expected one of {PROJ_NAMES}")
  return getattr(layer.attn if name in ATTN_PROJS else layer.mlp, name)


def _mask(q_pos, k_pos, k_valid, window):
  """[B,S,T] bool: key t is visible from query s (causal, valid, inside the sliding window)."""
  m = (k_pos[:, None, :] <= q_pos[:, :, None]) & k_valid[:, None, :]
  if window is not None:
    m = m & (q_pos[:, :, None] - k_pos[:, None, :] < window)
  return m


class LlamaForCausalLM(nnx.Module):
  """Decoder-only LM. ``model(tokens [B,S]) → logits [B,S,vocab]``.

  ``layers`` is a list of :class:`DecoderLayer`; replace projections in place
  (``model.layers[i].attn.q_proj = LowRankLinear(...)``) or with :func:`set_proj`.
  When every layer has identical param shapes and ``scan_layers`` is true, the full forward and
  prefill stack the layers' params and run one ``lax.scan`` (one compiled block instead of L);
  otherwise they run a Python loop. Stacking copies the layer weights inside the compiled
  program, which prefill amortises over its tokens; ``decode`` therefore always loops.
  """

  def __init__(
    self,
    cfg: ModelConfig,
    ranks: Sequence[LayerRanks] | None = None,
    heads: Sequence[LayerRanks] | None = None,
    *,
    dtype=None,
    param_dtype=jnp.float32,
    scan_layers: bool = True,
    rngs: nnx.Rngs,
  ):
    for name, per_layer in (("ranks", ranks), ("heads", heads)):
      if per_layer is not None and len(per_layer) != cfg.num_layers:
        raise ValueError(f"len({name})={len(per_layer)} must equal num_layers={cfg.num_layers}")
    self.cfg, self.dtype, self.scan_layers = cfg, dtype, scan_layers
    kw = dict(dtype=dtype, param_dtype=param_dtype)
    self.embed = Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs, **kw)
    self.layers = nnx.List(
      [
        DecoderLayer(cfg, ranks[i] if ranks else None, heads[i] if heads else None, rngs=rngs, **kw)
        for i in range(cfg.num_layers)
      ]
    )
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
    self.lm_head = (
      None
      if cfg.tie_word_embeddings
      else Linear(cfg.hidden_size, cfg.vocab_size, axes=("embed", "vocab"), rngs=rngs, **kw)
    )
    self._compression: Record | None = None
    self.source_digest: str | None = None

  @property
  def compression(self) -> dict | None:
    """Compression record (method, ratio, ranks, calibration, LoRA), JSON-able; set by
    ``lrjax.compress`` and saved in checkpoint metadata."""
    return self._compression

  @compression.setter
  def compression(self, value):
    self._compression = None if value is None else Record(value)

  # ---- structure ---------------------------------------------------------------------------
  def layer_ranks(self) -> list[dict[str, int]]:
    """Per layer, {proj_name: total rank} of the low-rank projections."""
    return [layer.ranks() for layer in self.layers]

  def layer_heads(self) -> list[dict[str, int]]:
    """Per layer, {proj_name: heads} of the per-head low-rank projections."""
    return [layer.heads() for layer in self.layers]

  def homogeneous(self) -> bool:
    """True when all layers have the same module structure and param shapes (scan-able)."""
    g0, s0 = nnx.split(self.layers[0])
    sig0 = jax.tree.map(lambda a: (a.shape, a.dtype), s0)
    for layer in self.layers[1:]:
      g, s = nnx.split(layer)
      if g != g0 or jax.tree.map(lambda a: (a.shape, a.dtype), s) != sig0:
        return False
    return True

  # ---- forward -----------------------------------------------------------------------------
  def _logits(self, h):
    h = self.norm(h)
    return self.embed.attend(h) if self.lm_head is None else self.lm_head(h)

  def _run_layers(
    self, h, positions, mask, cache=None, write_pos=None, scan=True, attend_cache=True
  ):
    """Run all layers; with ``cache`` returns (h, (k_bufs, v_bufs)), the cache's per-layer
    buffers updated in place."""
    inv = jnp.asarray(rope_inv_freq(self.cfg), jnp.float32)
    if scan and self.scan_layers and len(self.layers) > 1 and self.homogeneous():
      if cache is not None and attend_cache:
        raise ValueError(
          "the layer scan attends only to each call's own keys "
          "(attend_cache=False); run attention over a cache with scan=False"
        )
      gdef = nnx.split(self.layers[0])[0]
      stacked = jax.tree.map(
        lambda *xs: jnp.stack(xs), *[nnx.split(layer)[1] for layer in self.layers]
      )
      b, s = h.shape[:2]
      if cache is not None:
        _, kvh, _, d = cache.k[0].shape
        fresh = jnp.zeros((b, kvh, s, d), cache.k[0].dtype)

      def body(h, st):
        # a cache's layers cannot be indexed by the scan: each layer's keys and values go
        # into an S-long buffer of their own, stacked by the scan, written below
        kv = None if cache is None else (fresh, fresh)
        h, kv = nnx.merge(gdef, st)(
          h, positions, inv, mask, kv, jnp.zeros((b,), jnp.int32), attend_cache=False
        )
        return h, kv

      log.debug("forward: lax.scan over %d identical layers", len(self.layers))
      h, new = jax.lax.scan(body, h, stacked)
      if cache is None:
        return h, None
      return h, tuple(
        tuple(
          write_kv(buf, n[i].swapaxes(1, 2), write_pos, heads_first=True)
          for i, buf in enumerate(bufs)
        )
        for bufs, n in zip((cache.k, cache.v), new)
      )
    log.debug(
      "forward: Python loop over %d layers (scan_layers=%s)", len(self.layers), self.scan_layers
    )
    ks, vs = [], []
    for i, layer in enumerate(self.layers):
      kv = None if cache is None else (cache.k[i], cache.v[i])
      h, kv = layer(h, positions, inv, mask, kv, write_pos, attend_cache=attend_cache)
      if kv is not None:
        ks.append(kv[0]), vs.append(kv[1])
    return h, (None if cache is None else (tuple(ks), tuple(vs)))

  def __call__(self, tokens):
    """Full-sequence forward (scoring/training): tokens [B,S] int → logits [B,S,vocab]."""
    tokens = _check_tokens(tokens, 2)
    b, s = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    mask = _mask(pos, pos, jnp.ones((b, s), bool), self.cfg.sliding_window)
    h, _ = self._run_layers(self.embed(tokens), pos, mask)
    return self._logits(h)

  def prefill(self, tokens, cache: KVCache, lengths=None):
    """Fill an empty cache with a right-padded prompt batch.

    tokens [B,S] int, ``lengths`` [B] valid tokens per row (default S). Returns
    (logits [B,S,vocab], cache) with ``cache.pos = lengths``; logits past a row's length are junk.
    """
    tokens = _check_tokens(tokens, 2)
    b, s = tokens.shape
    _check_cache(cache, self.cfg, b, s)
    lengths = jnp.full((b,), s, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    mask = _mask(pos, pos, jnp.ones((b, s), bool), self.cfg.sliding_window)
    # The cache starts empty: attend over this call's S keys, not all max_len slots.
    h, (k, v) = self._run_layers(
      self.embed(tokens), pos, mask, cache, jnp.zeros((b,), jnp.int32), attend_cache=False
    )
    return self._logits(h), KVCache(k, v, lengths)

  def decode(self, tokens, cache: KVCache, attend_len: int | None = None):
    """One step for each row: tokens [B] int at position ``cache.pos`` → (logits [B,vocab], cache).

    ``attend_len`` (a Python int, default ``max_len``): attention reads only the first
    ``attend_len`` cache positions, so a step costs what the context holds, not what the cache
    could. Every row's ``pos`` must be below it (checked when ``pos`` is concrete); a row past
    it attends to the wrong keys.
    """
    tokens = _check_tokens(tokens, 1)
    b = tokens.shape[0]
    _check_cache(cache, self.cfg, b, 1)
    pos = cache.pos[:, None]  # [B, 1]
    mask = decode_mask(cache.pos, cache.max_len, attend_len, self.cfg.sliding_window)
    # Python loop: a per-step stack of the layer weights for lax.scan would double the weight
    # traffic of a bandwidth-bound step.
    h, (k, v) = self._run_layers(
      self.embed(tokens[:, None]), pos, mask, cache, cache.pos, scan=False
    )
    return self._logits(h)[:, 0], KVCache(k, v, cache.pos + 1)


def decode_mask(pos, max_len: int, attend_len=None, window=None):
  """[B, 1, T] decode mask of rows at ``pos`` [B] over the first T = ``attend_len`` (default
  ``max_len``) cache positions; ``attend_len`` checked, and ``pos`` against it when concrete."""
  t_len = max_len if attend_len is None else attend_len
  if not isinstance(t_len, int) or isinstance(t_len, bool) or not 1 <= t_len <= max_len:
    raise ValueError(f"{attend_len=} must be a Python int in [1, max_len={max_len}]")
  if not isinstance(pos, jax.core.Tracer) and int(jnp.max(pos)) >= t_len:
    raise ValueError(
      f"a row is at position {int(jnp.max(pos))}, past {attend_len=}: its key "
      "would fall outside the attended positions"
    )
  t = jnp.broadcast_to(jnp.arange(t_len, dtype=jnp.int32), (pos.shape[0], t_len))
  return _mask(pos[:, None], t, t <= pos[:, None], window)


def _check_tokens(tokens, ndim):
  tokens = jnp.asarray(tokens)
  if tokens.ndim != ndim or not jnp.issubdtype(tokens.dtype, jnp.integer):
    want = "[batch, seq]" if ndim == 2 else "[batch]"
    raise ValueError(f"tokens.shape={tokens.shape} dtype={tokens.dtype} must be {want} integers")
  return tokens


def _check_cache(cache, cfg, b, s):
  bufs = (cache.k, cache.v)
  t = cache.k[0].shape[2] if isinstance(cache.k, tuple) and cache.k else None
  want = (b, cfg.num_kv_heads, t, cfg.head_dim)
  if any(
    not isinstance(x, tuple)
    or len(x) != cfg.num_layers
    or any(getattr(a, "shape", None) != want for a in x)
    for x in bufs
  ):
    got = [
      type(x).__name__
      if not isinstance(x, tuple)
      else f"{len(x)} x {getattr(x[0], 'shape', None) if x else None}"
      for x in bufs
    ]
    raise ValueError(
      f"cache.k / cache.v are {got}; each must be a tuple of "
      f"num_layers={cfg.num_layers} arrays {want} (batch, kv_heads, max_len, "
      "head_dim); build the cache with KVCache.init(cfg, batch, max_len)"
    )
  if s > cache.max_len:
    raise ValueError(f"{s=} tokens do not fit in cache max_len={cache.max_len}")


@nnx.jit(donate_argnums=2)
def prefill_step(model: LlamaForCausalLM, tokens, cache: KVCache, lengths=None):
  """Jitted :meth:`LlamaForCausalLM.prefill`; the cache is donated."""
  return model.prefill(tokens, cache, lengths)


@nnx.jit(donate_argnums=2)
def decode_step(model: LlamaForCausalLM, tokens, cache: KVCache):
  """Jitted :meth:`LlamaForCausalLM.decode`; the cache is donated (updated in place).

  Each call walks the model's NNX graph on the host (25 ms a call for 32 layers on a CPU, of
  a 3 ms step). In a token loop, ``step = nnx.cached_partial(decode_step, model)`` walks it
  once; build a new one after changing the model's structure (e.g. ``lrjax.compress``)."""
  return model.decode(tokens, cache)
