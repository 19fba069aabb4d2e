"""Per-head low-rank projection (FlashSVD's multi-head SVD) in Flax NNX.

A q/k/v projection [K, heads·d] factorised per head keeps u [K, heads·r_h] and a block-diagonal v
stored as [heads, r_h, d], so it costs heads·r_h·(K + d) weights instead of R·(K + heads·d) for a
joint factorisation of total rank R. For GQA, k and v use the number of key/value heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lrjax.nn.linear import RANK_AXIS, param


class HeadwiseLowRankLinear(nnx.Module):
  """y[..., h, :] = (x·u[:, h·r:(h+1)·r])·v[h] (+ bias), flattened to [..., heads·head_dim].

  u [in, heads·rank_per_head], v [heads, rank_per_head, head_dim], optional bias [heads·head_dim].
  ``rank`` is the total rank heads·rank_per_head.
  """

  def __init__(
    self,
    in_features: int,
    heads: int,
    head_dim: int,
    rank_per_head: int,
    *,
    use_bias: bool = False,
    axes=("embed", "heads"),
    rank_axis: str = RANK_AXIS,
    dtype=None,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    for name, val in dict(
      in_features=in_features, heads=heads, head_dim=head_dim, rank_per_head=rank_per_head
    ).items():
      if not isinstance(val, int) or val <= 0:
        raise ValueError(f"{name}={val!r} must be a positive int")
    if rank_per_head > min(in_features, head_dim):
      raise ValueError(
        f"{rank_per_head=} must be <= min(in_features, head_dim)={min(in_features, head_dim)}"
      )
    self.in_features, self.heads, self.head_dim = in_features, heads, head_dim
    self.rank_per_head, self.rank = rank_per_head, heads * rank_per_head
    self.out_features = heads * head_dim
    self.dtype, self.param_dtype, self.axes = dtype, param_dtype, tuple(axes)
    su, sv = (1.0 / in_features) ** 0.5, (1.0 / rank_per_head) ** 0.5
    self.u = param(
      su * jax.random.normal(rngs.params(), (in_features, self.rank), param_dtype),
      (axes[0], rank_axis),
    )
    self.v = param(
      sv * jax.random.normal(rngs.params(), (heads, rank_per_head, head_dim), param_dtype),
      (axes[1], rank_axis, None),
    )
    self.bias = param(jnp.zeros((self.out_features,), param_dtype), axes[1:]) if use_bias else None

  def __call__(self, x):
    return headwise_apply(
      x, self.u[...], self.v[...], None if self.bias is None else self.bias[...], self.dtype
    )

  @property
  def num_params(self) -> int:
    return self.rank * (self.in_features + self.head_dim) + (
      self.out_features if self.bias is not None else 0
    )


def headwise_apply(x, u, v, bias=None, dtype=None):
  """x [..., K], u [K, H·r], v [H, r, d], bias [H·d] -> [..., H·d]."""
  dt = dtype or x.dtype
  h, r, d = v.shape
  z = jnp.matmul(x.astype(dt), u.astype(dt)).reshape(*x.shape[:-1], h, r)
  y = jnp.einsum("...hr,hrd->...hd", z, v.astype(dt)).reshape(*x.shape[:-1], h * d)
  return y if bias is None else y + bias.astype(dt)
