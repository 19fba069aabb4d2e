"""decode_attention: the primitive against a float64 oracle, the second CUDA lowering's wrapper
(jax's Pallas flash-decoding kernel, run in Pallas's interpreter here) against the primitive,
its split plan, the registry's choice per platform, and the model's decode step binding it.
lrjax's own kernel runs in Triton's interpreter in
tests/custom_calls/triton/test_triton_interpret.py and on a GPU in test_decode_attention_gpu.py."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import assert_close, assert_grad_close, primitive_names, split_plan_violations
from conftest import decode_attention_f64 as oracle
from conftest import decode_attention_operands as operands
from lrjax.custom_calls.triton import decode_attention_pallas as kernel
from lrjax.custom_calls.triton import policy
from lrjax.custom_calls.triton import lowering as cuda_lowering
from lrjax.lowering import registry
from lrjax.lowering.decode_attention import decode_attention, decode_attention_reference


SHAPES = [  # b, hq, hkv, t, d
  (1, 1, 1, 1, 8),
  (3, 8, 2, 37, 16),
  (2, 7, 7, 64, 32),
  (4, 12, 4, 129, 64),
  (2, 32, 8, 256, 128),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [None, 5])
def test_primitive_matches_oracle(shape, dtype, window):
  q, k, v, pos = operands(*shape, dtype)
  out = jax.jit(lambda *a: decode_attention(*a, window=window))(q, k, v, pos)
  assert out.shape == (shape[0], shape[1] * shape[4]) and out.dtype == dtype
  assert_close(out, oracle(q, k, v, pos, window), dtype)


def test_cache_dtype_other_than_the_queries():
  q, k, v, pos = operands(2, 8, 2, 40, 16, jnp.float32)
  out = decode_attention(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), pos)
  assert out.dtype == jnp.float32
  assert_close(out, oracle(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), pos), jnp.bfloat16)


def test_vmap_and_grad_through_the_reference():
  q, k, v, pos = operands(2, 4, 2, 16, 8, jnp.float32)
  batched = jax.vmap(lambda *a: decode_attention(*a))(q[None], k[None], v[None], pos[None])
  assert_close(batched[0], oracle(q, k, v, pos), jnp.float32)
  g = jax.grad(lambda q: decode_attention(q, k, v, pos).sum())(q)
  want = jax.grad(lambda q: decode_attention_reference(q, k, v, pos).sum())(q)
  assert_close(g, want, jnp.float32)


@pytest.mark.parametrize(
  "args, match",
  [
    (((2, 4, 8), (2, 2, 16, 8), (2, 2, 16, 8), (3,)), r"expected \[2\] integer positions"),
    (((2, 4, 8), (2, 3, 16, 8), (2, 3, 16, 8), (2,)), "multiple of Hkv"),
    (((2, 4, 8), (2, 2, 16, 4), (2, 2, 16, 4), (2,)), "head dim must agree"),
    (((2, 4), (2, 2, 16, 8), (2, 2, 16, 8), (2,)), r"expected q \[B, Hq, D\]"),
    (((2, 4, 8), (2, 2, 16, 8), (2, 2, 15, 8), (2,)), r"k, v \[B, Hkv, T, D\]"),
  ],
)
def test_bad_operands_name_what_was_expected(args, match):
  q, k, v, pos = (jnp.zeros(s, jnp.int32 if len(s) == 1 else jnp.float32) for s in args)
  with pytest.raises(ValueError, match=match):
    decode_attention(q, k, v, pos)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("window", [None, 3])
def test_length_bounds_the_keys_without_slicing_the_buffers(dtype, window):
  """Keys past ``length`` (random here, never zeros) are never read; the primitive takes the
  whole buffers and the reference slices them itself."""
  q, k, v, pos = operands(3, 8, 2, 24, 16, dtype)
  pos = jnp.asarray([0, 5, 9], jnp.int32)
  fn = lambda *a: decode_attention(*a, window=window, length=10)  # noqa: E731
  want = oracle(q, k[:, :, :10], v[:, :, :10], pos, window)
  assert_close(jax.jit(fn)(q, k, v, pos), want, dtype)
  assert_close(decode_attention_reference(q, k, v, pos, window=window, length=10), want, dtype)
  jaxpr = jax.make_jaxpr(fn)(q, k, v, pos)
  (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "decode_attention"]
  assert eqn.params["length"] == 10 and eqn.invars[1].aval.shape == k.shape
  batched = jax.vmap(fn)(q[None], k[None], v[None], pos[None])
  assert_close(batched[0], want, dtype)
  # the whole length is the default
  eqn = jax.make_jaxpr(lambda *a: decode_attention(*a, length=24))(q, k, v, pos).jaxpr.eqns[-1]
  assert eqn.params["length"] is None


@pytest.mark.parametrize("length", [0, 25, 3.0, True])
def test_bad_length(length):
  with pytest.raises(ValueError, match=r"expected a Python int in \[1, 24\]"):
    decode_attention(*operands(1, 2, 1, 24, 8, jnp.float32), length=length)


@pytest.mark.parametrize("window", [0, -3, True])
def test_bad_window(window):
  with pytest.raises(ValueError, match="sliding window"):
    decode_attention(*operands(1, 2, 1, 16, 8, jnp.float32), window=window)


# The CUDA kernel's wrapper in Pallas's interpreter: its layout, masks and split plan.
INTERPRET = [  # b, hq, hkv, t, d, window, k_splits
  (3, 8, 2, 128, 64, None, None),
  (2, 12, 2, 256, 16, 9, 4),
  (1, 4, 4, 16, 32, None, 1),
  (2, 6, 1, 512, 64, 300, 8),
]


@pytest.mark.parametrize("b, hq, hkv, t, d, window, k_splits", INTERPRET)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_kernel_wrapper_in_the_interpreter(b, hq, hkv, t, d, window, k_splits, dtype):
  q, k, v, pos = operands(b, hq, hkv, t, d, dtype)
  out = kernel.decode_attention(q, k, v, pos, window=window, k_splits=k_splits, interpret=True)
  assert out.shape == (b, hq * d) and out.dtype == dtype
  assert_close(out, oracle(q, k, v, pos, window), dtype)


# (b, hq, hkv, buffer, length, window): the buffer read whole, split alike past ``length``
# (256 = 16 splits of 16 keys), then sliced: 200 keys do not divide into splits of 16, and
# 4096 would take 256 splits
BUFFERS = [(2, 4, 2, 256, 64, None), (2, 4, 2, 256, 64, 7), (2, 4, 1, 200, 64, None),
           (1, 2, 1, 4096, 16, None)]  # fmt: skip


@pytest.mark.parametrize("b, hq, hkv, t, length, window", BUFFERS)
def test_kernel_wrapper_bounded_by_length_in_the_interpreter(b, hq, hkv, t, length, window):
  dtype = jnp.bfloat16
  q, k, v, _ = operands(b, hq, hkv, t, 32, dtype)
  pos = jnp.asarray([0, length - 1][-b:], jnp.int32)
  p = kernel.plan(b, hkv, length)
  whole = kernel.buffer_plan(p, t, length)
  assert (whole is not None) == (t == 256)
  out = kernel.decode_attention(q, k, v, pos, window=window, length=length, interpret=True)
  assert_close(out, oracle(q, k[:, :, :length], v[:, :, :length], pos, window), dtype)
  # the whole-buffer path takes the buffers as they are; the sliced one copies a slice
  names = primitive_names(
    lambda *a: kernel.decode_attention(*a, length=length, interpret=True), q, k, v, pos
  )
  assert ("slice" in names) == (whole is None), names


@settings(max_examples=200, deadline=None)
@given(
  b=st.integers(1, 64),
  hkv=st.integers(1, 16),
  t=st.sampled_from([2**i for i in range(4, 15)] + [100, 1000, 3000]),
  length_log=st.integers(4, 14),
)
def test_buffer_plan_splits_alike_or_declines(b, hkv, t, length_log):
  length = 2**length_log
  if length > t:
    return
  p = kernel.plan(b, hkv, length)
  whole = kernel.buffer_plan(p, t, length)
  if whole is None:
    assert t % (length // p.k_splits) or t // (length // p.k_splits) > kernel.MAX_BUFFER_SPLITS
    return
  assert t // whole.k_splits == length // p.k_splits  # the same split size
  assert whole.block_k == p.block_k and whole.k_splits <= kernel.MAX_BUFFER_SPLITS


@settings(max_examples=300, deadline=None)
@given(
  b=st.integers(1, 64),
  hkv=st.integers(1, 16),
  t=st.one_of(st.integers(1, 20000), st.sampled_from([2**i for i in range(4, 15)])),
)
def test_plan_is_one_the_kernel_accepts(b, hkv, t):
  p = kernel.plan(b, hkv, t)
  if t >= 16 and not t & (t - 1):  # the engine's attend buckets: always served
    assert isinstance(p, kernel.Plan), p
  if isinstance(p, str):
    assert f"cache length {t}" in p
    return
  split = t // p.k_splits
  assert t % p.k_splits == 0 and split >= kernel.MIN_SPLIT and p.k_splits <= kernel.MAX_SPLITS
  assert p.block_k & (p.block_k - 1) == 0 and split % p.block_k == 0
  assert p.block_k == min(kernel.BLOCK_K, split)


def _max_split_keys(n):
  return policy.use(policy.current().with_values("decode_attention", max_split_keys=n))


def test_plan_fills_the_gpu_then_stops_splitting():
  with _max_split_keys(0):
    assert kernel.plan(1, 8, 8192).k_splits == 32  # 256 programs
    assert kernel.plan(16, 8, 8192).k_splits == 2
    assert kernel.plan(64, 8, 8192).k_splits == 1
    assert kernel.plan(1, 8, 64).k_splits == 4  # as many as the length allows
  with _max_split_keys(256):
    assert kernel.plan(16, 8, 2048).k_splits == 8  # 256 keys a split, 1024 programs
    assert kernel.plan(64, 8, 8192).k_splits == 32
    assert kernel.plan(1, 8, 8192).k_splits == 32


@settings(max_examples=300, deadline=None)
@given(
  b=st.integers(1, 64),
  hkv=st.integers(1, 16),
  t_log=st.integers(4, 16),
  max_keys=st.sampled_from([0, 16, 64, 128, 256, 1024]),
)
def test_split_plan_is_the_fewest_meeting_both_bounds(b, hkv, t_log, max_keys):
  t = 2**t_log
  with _max_split_keys(max_keys):
    splits = kernel.plan(b, hkv, t).k_splits
  bounds = (kernel.TARGET_PROGRAMS, kernel.MAX_SPLITS, kernel.MIN_SPLIT)
  assert not split_plan_violations(splits, b, hkv, t, max_keys, *bounds)


def _avals(b, hq, hkv, t, d, dt=jnp.bfloat16, kdt=None):
  sds = jax.ShapeDtypeStruct
  kv = sds((b, hkv, t, d), kdt or dt)
  return (sds((b, hq, d), dt), kv, kv, sds((b,), jnp.int32))


def test_registry_serves_cuda_with_the_kernels_and_says_why_not(monkeypatch):
  """jax's Pallas kernel first; lrjax's kernel (where jax-triton is installed) for the cache
  lengths the Pallas kernel declines; each names the operands it declines."""
  monkeypatch.setattr(cuda_lowering, "_toolchain", lambda: None)
  sel = registry.select("decode_attention", "cuda", _avals(8, 32, 8, 1024, 128), {"window": None})
  assert sel.name == "pallas.decode_attention", sel.declined
  sel = registry.select("decode_attention", "cuda", _avals(8, 32, 8, 1000, 128), {"window": None})
  assert sel.name == "triton.decode_attention", sel.declined
  assert "cache length 1000" in dict(sel.declined)["pallas.decode_attention"], sel.declined
  for avals, why in [
    (_avals(8, 32, 8, 1024, 96), "head dim 96"),
    (_avals(8, 32, 8, 1024, 128, kdt=jnp.float8_e4m3fn), "must share one of"),
    (_avals(8, 32, 8, 1024, 128, dt=jnp.float32), "must share one of"),
  ]:
    sel = registry.select("decode_attention", "cuda", avals, {"window": None})
    assert sel.kernel is None and all(why in r for _, r in sel.declined), sel.declined
  assert registry.select("decode_attention", "cpu", _avals(1, 4, 2, 16, 8), {}).kernel is None
  # a length bound is planned by its own length: a 1000-key buffer attended to 512 serves
  sel = registry.select("decode_attention", "cuda", _avals(8, 32, 8, 1000, 128), {"length": 512})
  assert sel.name == "pallas.decode_attention", sel.declined


def test_without_jax_triton_other_cache_lengths_stay_on_xla(monkeypatch):
  monkeypatch.setattr(cuda_lowering, "_toolchain", lambda: "jax-triton/triton not installed")
  sel = registry.select("decode_attention", "cuda", _avals(8, 32, 8, 1024, 128), {"window": None})
  assert sel.name == "pallas.decode_attention", sel.declined
  sel = registry.select("decode_attention", "cuda", _avals(8, 32, 8, 1000, 128), {"window": None})
  assert sel.kernel is None and "not installed" in sel.declined[-1][1], sel.declined


def test_model_decode_binds_it_and_prefill_does_not():
  from flax import nnx

  from lrjax.models import LlamaForCausalLM, ModelConfig
  from lrjax.models.llama import KVCache

  cfg = ModelConfig.tiny(num_layers=2)
  model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
  cache = KVCache.init(cfg, 2, 32)
  toks = jnp.zeros((2,), jnp.int32)
  names = primitive_names(lambda t, c: model.decode(t, c, attend_len=16), toks, cache)
  assert names.count("decode_attention_append") == cfg.num_layers  # RoPE + writes + attention
  assert "decode_attention" not in names
  names = primitive_names(lambda t, c: model.prefill(t, c), jnp.zeros((2, 5), jnp.int32), cache)
  assert "decode_attention" not in names and "decode_attention_append" not in names
  # a decode step after a prefill gives the full forward's logits of the next position
  seq = jax.random.randint(jax.random.key(1), (2, 6), 0, cfg.vocab_size)
  _, cache = model.prefill(seq[:, :5], cache)
  step, _ = model.decode(seq[:, 5], cache, attend_len=16)
  assert_close(step, model(seq)[:, 5], jnp.float32)


def test_a_jax_without_the_pallas_kernel_falls_back_by_name(monkeypatch):
  monkeypatch.setattr(cuda_lowering, "_toolchain", lambda: "jax-triton/triton not installed")
  real = cuda_lowering.importlib.util.find_spec
  monkeypatch.setattr(
    cuda_lowering.importlib.util,
    "find_spec",
    lambda name, *a: None if name == kernel.PALLAS_MODULE else real(name, *a),
  )
  sel = registry.select("decode_attention", "cuda", _avals(8, 32, 8, 1024, 128), {"window": None})
  assert sel.kernel is None and "has no jax.experimental.pallas" in sel.declined[0][1]


def _append_operands(b, hq, hkv, t, d, dtype):
  from lrjax.lowering.decode_attention import rope_tables

  q, kc, vc, pos = operands(b, hq, hkv, t, d, dtype)
  kn = jax.random.normal(jax.random.key(1), (b, hkv, d), dtype)
  vn = jax.random.normal(jax.random.key(2), (b, hkv, d), dtype)
  inv = 1.0 / (10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  return (q, kn, vn, kc, vc, pos, *rope_tables(pos, inv, dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("window, length", [(None, None), (5, 24)])
def test_append_primitive_is_rope_writes_and_attention(dtype, window, length):
  """decode_attention_append: the new rows written at each row's position (RoPE applied to
  the key), every other row unchanged, and the attention equal to decode_attention over the
  written caches with the roped queries; jitted and under vmap."""
  from lrjax.lowering.decode_attention import (
    decode_attention_append,
    decode_attention_append_reference,
    rope,
  )

  ops = _append_operands(3, 8, 2, 32, 16, dtype)
  q, kn, vn, kc, vc, pos, cos, sin = ops
  pos = jnp.asarray([0, 11, 23], jnp.int32)
  ops = (q, kn, vn, kc, vc, pos, cos, sin)
  out, k2, v2 = jax.jit(lambda *a: decode_attention_append(*a, window=window, length=length))(*ops)
  rows = np.arange(3)
  want_k = np.array(kc)
  want_k[rows, :, np.asarray(pos)] = np.asarray(rope(kn, cos[:, None], sin[:, None]))
  want_v = np.array(vc)
  want_v[rows, :, np.asarray(pos)] = np.asarray(vn)
  written = np.zeros(kc.shape, bool)
  written[rows, :, np.asarray(pos)] = True
  for got, want in ((k2, want_k), (v2, want_v)):
    got = np.asarray(got)
    assert np.array_equal(got[~written], want[~written])  # every other row untouched
    # the new rows: RoPE compiled may contract x·cos + y·sin (an f32 ulp)
    np.testing.assert_allclose(got[written], want[written], rtol=1e-6, atol=1e-6)
  qr = rope(q, cos[:, None], sin[:, None])
  want = decode_attention_reference(qr, k2, v2, pos, window=window, length=length)
  assert_close(out, oracle(qr, k2[:, :, : length or 32], v2[:, :, : length or 32], pos, window),
               dtype)  # fmt: skip
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                             rtol=1e-6, atol=1e-6)  # fmt: skip
  ref = decode_attention_append_reference(*ops, window=window, length=length)
  for g, w in zip((out, k2, v2), ref):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), 1e-6, 1e-6)
  # vmap over a leading axis of every operand: the reference per slice
  stacked = tuple(jnp.stack([a, a]) for a in ops)
  vout = jax.vmap(lambda *a: decode_attention_append(*a, window=window, length=length))(*stacked)
  assert all(v.shape == (2, *g.shape) for v, g in zip(vout, (out, k2, v2)))
  np.testing.assert_allclose(np.asarray(vout[0][1], np.float32), np.asarray(out, np.float32),
                             rtol=1e-6, atol=1e-6)  # fmt: skip


def test_append_primitive_refuses_operands_of_the_wrong_shape():
  from lrjax.lowering.decode_attention import decode_attention_append

  q, kn, vn, kc, vc, pos, cos, sin = _append_operands(2, 4, 2, 16, 8, jnp.float32)
  with pytest.raises(ValueError, match=r"k_new.shape=.*expected \[B, Hkv, D\]"):
    decode_attention_append(q, kn[:, :1], vn, kc, vc, pos, cos, sin)
  with pytest.raises(ValueError, match=r"cos.shape=.*expected \[B, D\]"):
    decode_attention_append(q, kn, vn, kc, vc, pos, cos[:, :4], sin)
  with pytest.raises(ValueError, match="window"):
    decode_attention_append(q, kn, vn, kc, vc, pos, cos, sin, window=0)
  with pytest.raises(ValueError, match="length"):
    decode_attention_append(q, kn, vn, kc, vc, pos, cos, sin, length=17)


def test_append_kernel_is_gated_by_its_gpu_run_and_the_table(monkeypatch):
  """On CUDA the append kernel declines, naming why, where it is not marked verified on a GPU
  or the tuning table switches it off; else it serves bf16 operands of a head dim it takes
  and declines others by name."""
  monkeypatch.setattr(cuda_lowering, "_toolchain", lambda: None)
  sds = jax.ShapeDtypeStruct
  b, hq, hkv, t, d = 8, 32, 8, 1024, 128

  def avals(dt=jnp.bfloat16, d=d, tab=None):
    new, kv = sds((b, hkv, d), dt), sds((b, hkv, t, d), dt)
    return (sds((b, hq, d), dt), new, new, kv, kv, sds((b,), jnp.int32),
            sds((b, d), tab or dt), sds((b, d), tab or dt))  # fmt: skip

  monkeypatch.setattr(cuda_lowering, "APPEND_GPU_VERIFIED", False)
  sel = registry.select("decode_attention_append", "cuda", avals(), {"window": None})
  assert (
    sel.kernel is None
    and "not yet run on a GPU" in dict(sel.declined)["triton.decode_attention_append"]
  )
  monkeypatch.setattr(cuda_lowering, "APPEND_GPU_VERIFIED", True)
  sel = registry.select("decode_attention_append", "cuda", avals(), {"window": None})
  assert sel.name == "triton.decode_attention_append", sel.declined
  # the table's switch off: declined with its reason (the reference's attention serves)
  off = policy.current().with_values("dispatch", attention_append=False)
  with policy.use(off):
    sel = registry.select("decode_attention_append", "cuda", avals(), {"window": None})
  assert sel.kernel is None
  assert dict(sel.declined)["triton.decode_attention_append"] == off.why(
    "dispatch", "attention_append"
  )
  for bad, why in [
    (avals(d=96), "head dim 96"),
    (avals(dt=jnp.float32), "must share one of"),
    (avals(tab=jnp.float32), "must share one dtype"),
  ]:
    sel = registry.select("decode_attention_append", "cuda", bad, {"window": None})
    assert sel.kernel is None and why in sel.declined[0][1], sel.declined
  assert not registry.candidates("decode_attention_append", "cpu")


def test_append_primitive_differentiates_as_its_reference():
  from lrjax.lowering.decode_attention import (
    decode_attention_append,
    decode_attention_append_reference,
  )

  ops = _append_operands(2, 4, 2, 16, 8, jnp.float32)
  floats = [0, 1, 2, 3, 4, 6, 7]  # every operand but pos

  def f(fn):
    def g(*fl):
      args = list(ops)
      for i, a in zip(floats, fl):
        args[i] = a
      out, kc, vc = fn(*args, window=5)
      return out.sum() + (kc * kc).sum() + vc.sum()

    return g

  primals = [ops[i] for i in floats]
  got = jax.grad(f(decode_attention_append), argnums=tuple(range(7)))(*primals)
  want = jax.grad(f(decode_attention_append_reference), argnums=tuple(range(7)))(*primals)
  for g, w in zip(got, want):
    assert_grad_close(g, w)
  assert float(jnp.abs(got[0]).sum()) > 0  # q reaches the output


def test_example_runs_both_primitives_against_their_references():
  import os
  import subprocess
  import sys

  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  res = subprocess.run(
    [sys.executable, os.path.join(repo, "examples", "decode_attention.py")],
    capture_output=True,
    text=True,
    timeout=600,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert res.returncode == 0, res.stderr
  from lrjax.custom_calls.cpu.lowering import extension_available

  lines = res.stdout.splitlines()
  # f32 on a CPU: lrjax's C++ kernel where the extension is built; the append binds it too
  served = "cpu.decode_attention" if extension_available() else "reference"
  assert f"on cpu: decode_attention -> {served}" in lines
  assert "on cpu: decode_attention_append -> reference" in lines
  last = re.fullmatch(
    r"append: relative difference (\S+); 32 key rows written \(a row a KV head\)", lines[-1]
  )
  assert last and float(last.group(1)) < 1e-6, lines[-1]
