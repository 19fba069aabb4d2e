"""Fused low-rank MLP (Algorithms 2-3) on the NKI test double vs lr_mlp_reference.

Shapes not multiples of 128 are zero-padded (gate/up ranks padded to the larger one).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close
from lrjax.custom_calls.nki import mlp, planner
from lrjax.lowering import lr_mlp_reference
from nki_helpers import hbm_total, j, on_double, rand


def proj(k, r, n, dtype, bias):
  return (
    rand((k, r), dtype, k**-0.5),
    rand((r, n), dtype, r**-0.5),
    rand((n,), dtype) if bias else None,
  )


@pytest.mark.parametrize(
  "M,K,r_gate,r_up,d_ff,r_down", [(1, 128, 128, 128, 256, 128), (70, 200, 140, 100, 300, 90)]
)
@pytest.mark.parametrize(
  "gated,act,bias,dtype",
  [
    (True, "silu", False, jnp.bfloat16),
    (True, "gelu_tanh", True, jnp.float16),
    (False, "relu", True, jnp.bfloat16),
    (False, "gelu", False, jnp.float16),
  ],
)
def test_fused_mlp_matches_reference_and_planner(
  M, K, r_gate, r_up, d_ff, r_down, gated, act, bias, dtype
):
  d, (ug, xv) = on_double("mlp_up_gate", "xuv")
  x = rand((M, K), dtype)
  up = proj(K, r_up, d_ff, dtype, bias)
  gate = proj(K, r_gate, d_ff, dtype, False) if gated else None
  down = proj(d_ff, r_down, K, dtype, bias)
  z = mlp.fused_mlp(x, up, down, gate, act=act, xp=np, up_gate_mod=ug, xuv_mod=xv)
  jt = lambda p: None if p is None else tuple(j(a) for a in p)
  ref = lr_mlp_reference(j(x), jt(up), jt(down), jt(gate), act=act)
  assert z.shape == (M, K) and z.dtype == np.dtype(dtype)
  assert_close(z, ref, dtype)
  p = planner.plan_mlp(
    M,
    K,
    max(r_gate, r_up) if gated else r_up,
    d_ff,
    r_down,
    K,
    dtype,
    gated=gated,
    up_bias=(2 if gated else 1) if bias else 0,
    down_bias=bias,
  )
  assert hbm_total(d) == p.traffic.total
  assert d.flops == p.flops
  assert d.peak_sbuf_bytes == max(p.up_gate.sbuf_peak_bytes, p.down.sbuf_peak_bytes)


def test_chain_has_no_transpose_between_kernels():
  """Y^T from UpGateProjection is loaded by DownProjection with plain DMAs only."""
  d, (ug, xv) = on_double("mlp_up_gate", "xuv")
  calls = []
  orig = d.nisa.dma_transpose
  d.nisa.dma_transpose = lambda **kw: (calls.append(kw["src"].alloc.name), orig(**kw))
  x = rand((128, 256), jnp.bfloat16)
  mlp.fused_mlp(
    x,
    proj(256, 128, 384, jnp.bfloat16, False),
    proj(384, 128, 256, jnp.bfloat16, False),
    proj(256, 128, 384, jnp.bfloat16, False),
    xp=np,
    up_gate_mod=ug,
    xuv_mod=xv,
  )
  assert calls and set(calls) == {"x"}  # only the model input X is transposed (by DMA)


@pytest.mark.parametrize("gated,scaled", [(True, "gate"), (True, "both"), (False, "up")])
def test_fused_mlp_rank_space_scales(gated, scaled):
  """Σ between a projection's factors: up/gate strips and the down strip are scaled on chip
  (a projection without one gets ones when its partner has one)."""
  dtype = jnp.bfloat16
  M, K, r, d_ff = 70, 200, 140, 300
  d, (ug, xv) = on_double("mlp_up_gate", "xuv")
  x = rand((M, K), dtype)
  sc = lambda n: rand((n,), dtype, scale=2.0)  # noqa: E731
  up = proj(K, r, d_ff, dtype, True) + ((sc(r),) if scaled in ("up", "both") else (None,))
  gate = None
  if gated:
    gate = proj(K, r, d_ff, dtype, False) + ((sc(r),) if scaled in ("gate", "both") else (None,))
  down = proj(d_ff, 90, K, dtype, False) + (sc(90),)
  z = mlp.fused_mlp(x, up, down, gate, act="silu", xp=np, up_gate_mod=ug, xuv_mod=xv)
  jt = lambda p: None if p is None else tuple(None if a is None else j(a) for a in p)  # noqa: E731
  ref = lr_mlp_reference(j(x), jt(up), jt(down), jt(gate), act="silu")
  assert_close(z, ref, dtype)
  p = planner.plan_mlp(
    M,
    K,
    r,
    d_ff,
    90,
    K,
    dtype,
    gated=gated,
    up_bias=2 if gated else 1,
    up_scale=2 if gated else 1,
    down_scale=True,
  )
  assert hbm_total(d) == p.traffic.total
  assert d.peak_sbuf_bytes == max(p.up_gate.sbuf_peak_bytes, p.down.sbuf_peak_bytes)
