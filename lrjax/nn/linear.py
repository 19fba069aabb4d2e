"""Dense and low-rank linear layers and MLPs in Flax NNX.

Forward passes are plain jnp: ``lrjax.fuse`` decides what becomes a fused kernel.
Every param carries logical axis names (``out_sharding`` metadata); one rules
table in ``lrjax.sharding`` maps them to mesh axes.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lrjax.lowering.primitives import ACTIVATIONS

Axes = tuple[str | None, str | None]
RANK_AXIS = "rank"


def param(value, names: Sequence[str | None]) -> nnx.Param:
  """A Param with logical axis names and no eager sharding (mesh comes later)."""
  return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


def _check_dims(**dims):
  for k, v in dims.items():
    if not isinstance(v, (int, np.integer)) or v <= 0:
      raise ValueError(f"{k}={v!r} must be a positive int")


def svd_factors(kernel, rank: int):
  """Truncated SVD of ``kernel`` [K, N] with the √Σ split: U√Σ [K, r], √ΣVᵀ [r, N] (f64)."""
  w = np.asarray(kernel, dtype=np.float64)
  if w.ndim != 2:
    raise ValueError(f"kernel.shape={w.shape} must be 2-D [in, out]")
  if not 0 < rank <= min(w.shape):
    raise ValueError(f"{rank=} must be in [1, min(K, N)={min(w.shape)}] for kernel {w.shape}")
  uu, s, vt = np.linalg.svd(w, full_matrices=False)
  rs = np.sqrt(s[:rank])
  return uu[:, :rank] * rs, rs[:, None] * vt[:rank]


class Linear(nnx.Module):
  """y = x·kernel (+ bias); kernel [in, out] with logical axes ``axes``."""

  def __init__(
    self,
    in_features: int,
    out_features: int,
    *,
    use_bias: bool = False,
    axes: Axes = ("embed", "mlp"),
    dtype=None,
    param_dtype=jnp.float32,
    kernel_init=nnx.initializers.lecun_normal(),  # noqa: B008
    rngs: nnx.Rngs,
  ):
    _check_dims(in_features=in_features, out_features=out_features)
    self.in_features, self.out_features = in_features, out_features
    self.dtype, self.param_dtype, self.axes = dtype, param_dtype, tuple(axes)
    self.kernel = param(kernel_init(rngs.params(), (in_features, out_features), param_dtype), axes)
    self.bias = param(jnp.zeros((out_features,), param_dtype), axes[1:]) if use_bias else None

  def __call__(self, x):
    dt = self.dtype or x.dtype
    y = jnp.matmul(x.astype(dt), self.kernel[...].astype(dt))
    if self.bias is not None:
      y = y + self.bias[...].astype(dt)
    return y

  @property
  def num_params(self) -> int:
    return self.in_features * self.out_features + (
      self.out_features if self.bias is not None else 0
    )


class LowRankLinear(nnx.Module):
  """y = (x·u)·v (+ bias); u [in, rank], v [rank, out].

  Logical axes: u (axes[0], rank_axis), v (rank_axis, axes[1]), bias (axes[1],).
  """

  def __init__(
    self,
    in_features: int,
    out_features: int,
    rank: int,
    *,
    use_bias: bool = False,
    axes: Axes = ("embed", "mlp"),
    rank_axis: str = RANK_AXIS,
    dtype=None,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    _check_dims(in_features=in_features, out_features=out_features, rank=rank)
    if rank > min(in_features, out_features):
      raise ValueError(
        f"{rank=} must be <= min(in_features, out_features)={min(in_features, out_features)}"
      )
    self.in_features, self.out_features, self.rank = in_features, out_features, rank
    self.dtype, self.param_dtype = dtype, param_dtype
    self.axes, self.rank_axis = tuple(axes), rank_axis
    # Product u·v has the variance of a lecun-normal dense kernel.
    su = (1.0 / in_features) ** 0.5
    sv = (1.0 / rank) ** 0.5
    self.u = param(
      su * jax.random.normal(rngs.params(), (in_features, rank), param_dtype), (axes[0], rank_axis)
    )
    self.v = param(
      sv * jax.random.normal(rngs.params(), (rank, out_features), param_dtype), (rank_axis, axes[1])
    )
    self.bias = param(jnp.zeros((out_features,), param_dtype), axes[1:]) if use_bias else None

  def __call__(self, x):
    dt = self.dtype or x.dtype
    y = jnp.matmul(jnp.matmul(x.astype(dt), self.u[...].astype(dt)), self.v[...].astype(dt))
    if self.bias is not None:
      y = y + self.bias[...].astype(dt)
    return y

  @classmethod
  def from_dense(
    cls,
    kernel,
    rank: int,
    bias=None,
    *,
    axes: Axes = ("embed", "mlp"),
    rank_axis: str = RANK_AXIS,
    dtype=None,
    param_dtype=None,
    rngs: nnx.Rngs | None = None,
  ) -> LowRankLinear:
    """Truncated SVD of ``kernel`` [in, out], √Σ split into u and v."""
    u, v = svd_factors(kernel, rank)
    param_dtype = param_dtype or jnp.asarray(kernel).dtype
    k, n = u.shape[0], v.shape[1]
    m = cls(
      k,
      n,
      rank,
      use_bias=bias is not None,
      axes=axes,
      rank_axis=rank_axis,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs or nnx.Rngs(0),
    )
    m.u[...] = jnp.asarray(u, param_dtype)
    m.v[...] = jnp.asarray(v, param_dtype)
    if bias is not None:
      if np.shape(bias) != (n,):
        raise ValueError(f"bias.shape={np.shape(bias)} must be ({n},)")
      m.bias[...] = jnp.asarray(bias, param_dtype)
    return m

  @property
  def num_params(self) -> int:
    return self.rank * (self.in_features + self.out_features) + (
      self.out_features if self.bias is not None else 0
    )


class LowRankMLP(nnx.Module):
  """Low-rank MLP with plain-jnp forward.

  gated:     down(act(gate(x)) * up(x))        (SwiGLU / GeGLU)
  non-gated: down(act(up(x)))                  (GPT-style, usually with biases)

  ``ranks`` is (gate, up, down) when gated, else (up, down).
  """

  def __init__(
    self,
    hidden: int,
    intermediate: int,
    ranks: Sequence[int],
    *,
    gated: bool = True,
    act: str = "silu",
    use_bias: bool = False,
    dtype=None,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    if act not in ACTIVATIONS:
      raise ValueError(f"{act=} is not supported; expected one of {sorted(ACTIVATIONS)}")
    ranks = tuple(ranks)
    if len(ranks) != (3 if gated else 2):
      raise ValueError(f"{ranks=} must have {3 if gated else 2} entries for {gated=}")
    self.gated, self.act = gated, act
    kw = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    if gated:
      self.gate_proj = LowRankLinear(hidden, intermediate, ranks[0], axes=("embed", "mlp"), **kw)
    else:
      self.gate_proj = None
    self.up_proj = LowRankLinear(hidden, intermediate, ranks[-2], axes=("embed", "mlp"), **kw)
    self.down_proj = LowRankLinear(intermediate, hidden, ranks[-1], axes=("mlp", "embed"), **kw)

  def __call__(self, x):
    f = ACTIVATIONS[self.act]
    if self.gated:
      return self.down_proj(f(self.gate_proj(x)) * self.up_proj(x))
    return self.down_proj(f(self.up_proj(x)))
