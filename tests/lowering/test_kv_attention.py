"""lr_kv_attention (decode attention over a low-rank KV cache): its reference lowering against
a float64 host implementation, its errors, vmap and gradients. The CUDA kernel is tested on the
GPU (tests/custom_calls/triton/test_triton_kernels_gpu.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, assert_grad_close, kv_attention_f64, randn
from lrjax.lowering import lr_kv_attention, lr_kv_attention_reference

INV = lambda d: 1.0 / (10000.0 ** (np.arange(0, d, 2) / d))


def operands(b, hq, hkv, d, t, rk, rv, dtype, bias):
  q = randn((b, hq, d), dtype)
  zk, zv = randn((b, t, rk), dtype), randn((b, t, rv), dtype)
  vk, vv = randn((rk, hkv * d), dtype, rk**-0.5), randn((rv, hkv * d), dtype, rv**-0.5)
  bk, bv = (randn((hkv * d,), dtype), randn((hkv * d,), dtype)) if bias else (None, None)
  return q, zk, zv, vk, vv, bk, bv


@pytest.mark.parametrize(
  "b,hq,hkv,d,t,rk,rv,window,bias",
  [
    (1, 2, 1, 8, 5, 3, 4, None, False),  # M=1-like: one sequence, tiny
    (3, 8, 2, 16, 37, 12, 20, None, True),  # GQA, biases, ragged lengths
    (2, 4, 4, 16, 50, 24, 8, 7, False),  # MHA, sliding window
  ],
)
def test_reference_matches_f64(b, hq, hkv, d, t, rk, rv, window, bias):
  q, zk, zv, vk, vv, bk, bv = operands(b, hq, hkv, d, t, rk, rv, jnp.float32, bias)
  pos = np.random.default_rng(t).integers(0, t, size=b).astype(np.int32)
  pos[0] = t - 1
  want = kv_attention_f64(q, zk, zv, vk, vv, pos, INV(d), bk, bv, window)
  got = jax.jit(lambda *a: lr_kv_attention(*a, window=window))(
    q, zk, zv, vk, vv, pos, INV(d), bk, bv
  )
  assert got.shape == (b, hq * d) and got.dtype == q.dtype
  assert_close(got, want, jnp.float32)


def test_keys_after_pos_are_ignored():
  q, zk, zv, vk, vv, _, _ = operands(2, 4, 2, 16, 20, 8, 8, jnp.float32, False)
  pos = np.array([6, 11], np.int32)
  a = lr_kv_attention(q, zk, zv, vk, vv, pos, INV(16))
  junk = jnp.where(jnp.arange(20)[None, :, None] > pos[:, None, None], 1e3, 0.0)
  b = lr_kv_attention(q, zk + junk, zv - junk, vk, vv, pos, INV(16))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_vmap_and_grad_follow_the_reference():
  q, zk, zv, vk, vv, _, _ = operands(2, 4, 2, 8, 9, 4, 6, jnp.float32, False)
  pos = np.array([8, 3], np.int32)
  inv = INV(8)
  batched = jax.vmap(lambda q, zk, zv, p: lr_kv_attention(q, zk, zv, vk, vv, p, inv))(
    q[:, None], zk[:, None], zv[:, None], pos[:, None]
  )
  np.testing.assert_allclose(
    np.asarray(batched[:, 0]),
    np.asarray(lr_kv_attention(q, zk, zv, vk, vv, pos, inv)),
    rtol=1e-5,
    atol=1e-6,
  )
  loss = lambda f: lambda q, vk: jnp.sum(f(q, zk, zv, vk, vv, pos, inv) ** 2)
  g = jax.grad(loss(lr_kv_attention), argnums=(0, 1))(q, vk)
  want = jax.grad(loss(lr_kv_attention_reference), argnums=(0, 1))(q, vk)
  for a, w in zip(g, want):
    assert_grad_close(a, w)


@pytest.mark.parametrize(
  "change,match",
  [
    (dict(q=(2, 4, 7)), "even head dim"),
    (dict(zv=(2, 9, 6, 1)), "expected q"),
    (dict(pos=(3,)), "integer positions"),
    (dict(inv=(3,)), "head dim / 2"),
    (dict(window=0), "sliding window"),
  ],
)
def test_bad_input_is_named(change, match):
  shapes = dict(q=(2, 4, 8), zk=(2, 9, 4), zv=(2, 9, 6), vk=(4, 16), vv=(6, 16), pos=(2,), inv=(4,))
  window = change.pop("window", None)
  shapes.update(change)
  a = {k: jnp.zeros(s, jnp.int32 if k == "pos" else jnp.float32) for k, s in shapes.items()}
  with pytest.raises(ValueError, match=match):
    lr_kv_attention(a["q"], a["zk"], a["zv"], a["vk"], a["vv"], a["pos"], a["inv"], window=window)
