"""Low-rank model code written the way people outside lrjax write it, for the corpus tests.

Each builder returns a :class:`Case`: the function, its arguments, the matches ``lrjax.explain``
must report (pattern -> count), the number of lr_xuv groups, the near-miss reasons it must
show (substrings), and how the fused result compares with the unfused one: ``"bitwise"`` where
the primitives' reference performs the same operations as the user's code (2-D chains, MLPs),
``"tol"`` (the per-dtype tolerance table) where it computes the same maths in another layout
(per-head factors, whose batched GEMMs XLA may sum in another order).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
from collections.abc import Callable

import flax.linen as linen
import jax
import jax.numpy as jnp
from flax import nnx

from conftest import randn


@dataclasses.dataclass
class Case:
  fn: Callable
  args: tuple
  matches: dict
  groups: int = 0
  misses: tuple = ()  # substrings, one near-miss each
  compare: str = "bitwise"
  dtype: Any = jnp.float32


def lowrank(k, r, n, dtype=jnp.float32):
  return randn((k, r), dtype, k**-0.5), randn((r, n), dtype, r**-0.5)


# ---------------------------------------------------------------- Flax Linen: nn.scan + nn.remat


class LinenLowRank(linen.Module):
  """A dense layer replaced by two Dense layers, as SVD tooling for Linen checkpoints does."""

  rank: int
  features: int
  use_bias: bool = True

  @linen.compact
  def __call__(self, x):
    h = linen.Dense(self.rank, use_bias=False, name="u")(x)
    return linen.Dense(self.features, use_bias=self.use_bias, name="v")(h)


class LinenBlock(linen.Module):
  @linen.compact
  def __call__(self, x, _):
    x = x + LinenLowRank(8, 64, name="o_proj")(x)
    g = LinenLowRank(8, 160, name="gate")(x)
    up = LinenLowRank(8, 160, name="up")(x)
    x = x + LinenLowRank(8, 64, use_bias=False, name="down")(linen.silu(g) * up)
    return x, None


class LinenModel(linen.Module):
  @linen.compact
  def __call__(self, x):
    block = linen.remat(LinenBlock)
    stack = linen.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
    x, _ = stack()(x, None)
    return x


def linen_scan_remat() -> Case:
  net = LinenModel()
  x = randn((2, 5, 64))
  params = net.init(jax.random.key(1), x)
  # Linen initialises biases to zero: give them values so that a dropped bias would show
  params = jax.tree.map(lambda p: p + 0.1 * randn(p.shape), params)
  return Case(
    lambda p, x: net.apply(p, x),
    (params, x),
    {"lr_xuv": 1, "lr_mlp(gated)": 1},
  )


# ---------------------------------------------------------------- Flax NNX


class NnxLowRank(nnx.Module):
  def __init__(self, k, r, n, *, use_bias=True, rngs: nnx.Rngs):
    self.a = nnx.Linear(k, r, use_bias=False, rngs=rngs)
    self.b = nnx.Linear(r, n, use_bias=use_bias, rngs=rngs)
    if use_bias:
      self.b.bias[...] = 0.1 * randn((n,))

  def __call__(self, x):
    return self.b(self.a(x))


class NnxBlock(nnx.Module):
  def __init__(self, d=64, f=128, r=8, *, rngs: nnx.Rngs):
    self.q = NnxLowRank(d, r, d, rngs=rngs)
    self.k = NnxLowRank(d, r, d, rngs=rngs)
    self.v = NnxLowRank(d, r, d, rngs=rngs)
    self.o = NnxLowRank(d, r, d, rngs=rngs)
    self.fc1 = NnxLowRank(d, r, f, rngs=rngs)
    self.fc2 = NnxLowRank(f, r, d, rngs=rngs)

  def __call__(self, x):
    q, k, v = self.q(x), self.k(x), self.v(x)
    att = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / 8.0, axis=-1) @ v
    x = x + self.o(att)
    return x + self.fc2(nnx.gelu(self.fc1(x), approximate=True))


def nnx_block() -> Case:
  model = NnxBlock(rngs=nnx.Rngs(2))
  x = randn((2, 6, 64))
  return Case(
    lambda x: model(x),
    (x,),
    {"lr_xuv": 4, "lr_mlp(non-gated)": 1},
    groups=1,  # q, k, v read x
    # softmax(q·kᵀ)·v: 6 keys < 16 head dims is a bottleneck too, reported for what it is
    misses=("activation × activation",),
  )


# ---------------------------------------------------------------- Equinox-style pytrees


@functools.partial(jax.tree_util.register_dataclass, data_fields=["u", "v", "b"], meta_fields=[])
@dataclasses.dataclass
class EqxLowRankLinear:
  """Equinox keeps weights as [out, in] and applies a layer to one example (vmap for batches)."""

  u: jax.Array  # [r, in]
  v: jax.Array  # [out, r]
  b: jax.Array  # [out]

  def __call__(self, x):
    return self.v @ (self.u @ x) + self.b


@functools.partial(jax.tree_util.register_dataclass, data_fields=["l1", "l2"], meta_fields=[])
@dataclasses.dataclass
class EqxMLP:
  l1: EqxLowRankLinear
  l2: EqxLowRankLinear

  def __call__(self, x):
    return self.l2(jax.nn.relu(self.l1(x)))


def equinox_vmap() -> Case:
  def layer(k, r, n):
    u, v = lowrank(k, r, n)
    return EqxLowRankLinear(u.T, v.T, 0.1 * randn((n,)))

  model = EqxMLP(layer(48, 8, 96), layer(96, 8, 48))
  xs = randn((5, 48))
  return Case(
    lambda m, xs: jax.vmap(m)(xs),
    (model, xs),
    {"lr_xuv": 2},  # batched by vmap into [out, batch] products: relaid out, bias kept outside
    compare="tol",
  )


# ---------------------------------------------------------------- Haiku-style transform


class _Frame:
  params: dict | None = None
  init_key: Any = None
  creating = False


def get_parameter(module: str, name: str, shape, scale: float):
  """hk.get_parameter: created at init, read at apply."""
  if _Frame.creating:
    _Frame.init_key, k = jax.random.split(_Frame.init_key)
    _Frame.params.setdefault(module, {})[name] = scale * jax.random.normal(k, shape)
  return _Frame.params[module][name]


def transform(fn):
  """hk.transform without haiku: (init(rng, *a) -> params, apply(params, rng, *a))."""

  def init(rng, *a):
    _Frame.params, _Frame.init_key, _Frame.creating = {}, rng, True
    try:
      fn(*a)
      return _Frame.params
    finally:
      _Frame.creating, _Frame.params = False, None

  def apply(params, rng, *a):
    del rng
    _Frame.params = params
    try:
      return fn(*a)
    finally:
      _Frame.params = None

  return init, apply


def hk_low_rank_linear(name, x, rank, out):
  k = x.shape[-1]
  u = get_parameter(f"{name}/~/u", "w", (k, rank), k**-0.5)
  v = get_parameter(f"{name}/~/v", "w", (rank, out), rank**-0.5)
  b = get_parameter(f"{name}/~/v", "b", (out,), 0.1)
  return jnp.dot(jnp.dot(x, u), v) + b


def haiku_like() -> Case:
  def forward(x):
    h = jax.nn.gelu(hk_low_rank_linear("mlp/fc1", x, 8, 128), approximate=False)
    return hk_low_rank_linear("mlp/fc2", h, 8, 64)

  init, apply = transform(forward)
  x = randn((3, 7, 64))
  params = init(jax.random.key(3), x)
  return Case(lambda p, x: apply(p, None, x), (params, x), {"lr_mlp(non-gated)": 1})


# ---------------------------------------------------------------- MaxText-style einsums


def maxtext_einsum() -> Case:
  d, h, hd, f, r = 64, 4, 16, 128, 8
  p = {
    "query": (randn((d, r), scale=d**-0.5), randn((r, h, hd), scale=r**-0.5)),  # DenseGeneral
    "out": (randn((h, hd, r), scale=d**-0.5), randn((r, d), scale=r**-0.5)),  # axis=(-2, -1)
    "wi_0": lowrank(d, r, f),
    "wi_1": lowrank(d, r, f),
    "wo": lowrank(f, r, d),
  }

  def block(p, x):
    q = jnp.einsum("btr,rhk->bthk", jnp.einsum("btd,dr->btr", x, p["query"][0]), p["query"][1])
    o = jnp.einsum("btr,rd->btd", jnp.einsum("bthk,hkr->btr", q, p["out"][0]), p["out"][1])
    x = x + o
    h0 = jnp.einsum("btr,rf->btf", jnp.einsum("btd,dr->btr", x, p["wi_0"][0]), p["wi_0"][1])
    h1 = jnp.einsum("btr,rf->btf", jnp.einsum("btd,dr->btr", x, p["wi_1"][0]), p["wi_1"][1])
    h = jax.nn.silu(h0) * h1
    return x + jnp.einsum("btr,rd->btd", jnp.einsum("btf,fr->btr", h, p["wo"][0]), p["wo"][1])

  return Case(block, (p, randn((2, 5, d))), {"lr_xuv": 2, "lr_mlp(gated)": 1})


# ---------------------------------------------------------------- SVD-LLM / ASVD: U·Σ·Vᵀ


def svd_llm() -> Case:
  def factor(k, n, r):
    w = randn((k, n), scale=k**-0.5)
    uu, ss, vt = jnp.linalg.svd(w, full_matrices=False)
    return uu[:, :r], ss[:r], vt[:r]  # Σ kept as its own vector, as the checkpoints store it

  q, o = factor(64, 64, 8), factor(64, 64, 8)
  s_in = 1.0 + 0.1 * randn((64,))  # ASVD's activation-aware input scaling (diagonal)

  def attn_proj(x, layers):
    (uq, sq, vq), (uo, so, vo) = layers
    y = ((x * s_in) @ uq * sq) @ vq  # ASVD: (x·S_in)·U·Σ·Vᵀ
    return ((y @ uo) * so[None, None, :]) @ vo  # SVD-LLM, Σ broadcast explicitly

  return Case(attn_proj, (randn((2, 5, 64)), (q, o)), {"lr_xuv": 2})


# ---------------------------------------------------------------- bf16 with casts


def bf16_casts() -> Case:
  bf = jnp.bfloat16
  u1, v1 = lowrank(64, 16, 96, bf)
  u2, v2 = lowrank(96, 16, 64, bf)
  s = randn((16,))  # Σ kept in f32

  def f(x):
    t = jnp.matmul(x, u1, preferred_element_type=jnp.float32)  # accumulate in f32
    h = (t * s).astype(bf) @ v1  # scale in f32, cast back to the model dtype
    t2 = (h @ u2).astype(jnp.float32)  # widen the intermediate
    return (t2 @ v2.astype(jnp.float32)).astype(bf)

  return Case(f, (randn((3, 64), bf),), {"lr_xuv": 2}, dtype=bf)


# ---------------------------------------------------------------- grouped q/k/v


def grouped_qkv() -> Case:
  (uq, vq), (uk, vk), (uv, vv) = lowrank(64, 8, 64), lowrank(64, 4, 32), lowrank(64, 4, 32)
  bq, bk, bv = randn((64,)), randn((32,)), randn((32,))

  def qkv(x):  # Qwen-style: biases on q/k/v
    return x @ uq @ vq + bq, x @ uk @ vk + bk, x @ uv @ vv + bv

  return Case(qkv, (randn((2, 3, 64)),), {"lr_xuv": 3}, groups=1)


# ---------------------------------------------------------------- a model under jax.vmap


def vmap_model() -> Case:
  p = lowrank(64, 8, 128) + lowrank(64, 8, 128) + lowrank(128, 8, 64)

  def mlp(x):  # written for one example [T, D]
    return (jax.nn.silu(x @ p[0] @ p[1]) * (x @ p[2] @ p[3])) @ p[4] @ p[5]

  return Case(jax.vmap(mlp), (randn((4, 3, 64)),), {"lr_mlp(gated)": 1})


# ---------------------------------------------------------------- per-head factors


def per_head_model() -> Case:
  from lrjax.models import LlamaForCausalLM, ModelConfig

  cfg = ModelConfig.tiny()  # hidden 64, 4 heads / 2 KV heads of 16, 2 layers
  ranks = [{"q_proj": 16, "k_proj": 8, "v_proj": 8}] * cfg.num_layers
  heads = [{"q_proj": 4, "k_proj": 2, "v_proj": 2}] * cfg.num_layers
  model = LlamaForCausalLM(cfg, ranks=ranks, heads=heads, rngs=nnx.Rngs(4))
  toks = jax.random.randint(jax.random.key(5), (2, 6), 0, cfg.vocab_size)
  return Case(
    lambda t: model(t),
    (toks,),
    {"lr_xuv(batched)": 3},  # q/k/v inside the scan over the stacked layers
    compare="tol",
  )


def einsum_heads() -> Case:
  uh, vh = randn((4, 16, 4), scale=0.25), randn((4, 4, 16), scale=0.5)
  s = 1.0 + randn((1, 4, 1, 4), scale=0.1)

  def f(x):  # x [b, h, s, d]
    return jnp.einsum("bhsr,hrn->bhsn", jnp.einsum("bhsd,hdr->bhsr", x, uh) * s, vh)

  return Case(f, (randn((2, 4, 5, 16)),), {"lr_xuv(batched)": 1}, compare="tol")


POSITIVE = {
  "linen_scan_remat": linen_scan_remat,
  "nnx_block": nnx_block,
  "equinox_vmap": equinox_vmap,
  "haiku_like": haiku_like,
  "maxtext_einsum": maxtext_einsum,
  "svd_llm": svd_llm,
  "bf16_casts": bf16_casts,
  "grouped_qkv": grouped_qkv,
  "vmap_model": vmap_model,
  "per_head_model": per_head_model,
  "einsum_heads": einsum_heads,
}


# ---------------------------------------------------------------- must not fuse


def activation_times_activation() -> Case:
  v = randn((8, 96))
  return Case(
    lambda x, y: (x @ jnp.tanh(y)) @ v,
    (randn((2, 64)), randn((64, 8))),
    {},
    misses=("computed by 'tanh'",),
  )


def activation_derived_factor() -> Case:
  return Case(
    lambda x, v: (x @ x[:8].T) @ v,
    (randn((16, 64)), randn((8, 96))),
    {},
    misses=("derived from the chain's input",),
  )


def reused_intermediate() -> Case:
  u, v = lowrank(64, 8, 96)

  def f(x):
    t = x @ u
    return t @ v, jnp.tanh(t).sum()

  return Case(f, (randn((2, 64)),), {}, misses=("used elsewhere",))


def high_rank() -> Case:
  u, v = lowrank(64, 48, 64)
  return Case(lambda x: x @ u @ v, (randn((2, 64)),), {}, misses=("not low-rank",))


def integer_dtype() -> Case:
  u = jax.random.randint(jax.random.key(6), (64, 8), -3, 3)
  v = jax.random.randint(jax.random.key(7), (8, 96), -3, 3)
  x = jax.random.randint(jax.random.key(8), (2, 64), -3, 3)
  return Case(lambda x: x @ u @ v, (x,), {}, misses=("int32 is not bf16/f16/f32",))


def rank_space_nonlinearity() -> Case:
  u, v = lowrank(64, 8, 96)
  return Case(lambda x: jnp.tanh(x @ u) @ v, (randn((2, 64)),), {}, misses=("op 'tanh'",))


def clipped_activation() -> Case:
  p = lowrank(64, 8, 128) + lowrank(128, 8, 64)
  f = lambda x: jax.nn.silu(jnp.clip(x @ p[0] @ p[1], -20, 20)) @ p[2] @ p[3]  # noqa: E731
  return Case(f, (randn((2, 64), scale=50.0),), {"lr_xuv": 2}, misses=("closest by value is silu",))


NEGATIVE = {
  "activation_times_activation": activation_times_activation,
  "activation_derived_factor": activation_derived_factor,
  "reused_intermediate": reused_intermediate,
  "high_rank": high_rank,
  "integer_dtype": integer_dtype,
  "rank_space_nonlinearity": rank_space_nonlinearity,
  "clipped_activation": clipped_activation,
}
