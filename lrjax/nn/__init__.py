"""Flax NNX building blocks whose forward passes are plain jnp."""

from lrjax.nn.linear import Linear, LowRankLinear, LowRankMLP, param, svd_factors

__all__ = ["Linear", "LowRankLinear", "LowRankMLP", "param", "svd_factors"]
