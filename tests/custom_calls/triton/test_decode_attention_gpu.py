"""GPU tests of decode_attention's CUDA lowerings, jax's Pallas flash-decoding kernel (the first
choice) and lrjax's Triton kernel (the cache lengths the first declines): compiled on the GPU,
against a float64 host oracle on fresh random inputs, and bound in the model's decode step
(``pytest -m gpu`` on a CUDA machine)."""

import contextlib
import importlib
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, rel_err, tolerance
from conftest import decode_attention_f64 as oracle
from conftest import decode_attention_operands as operands
from lrjax.custom_calls.triton import decode_attention_pallas as kernel
from lrjax.lowering import force_reference, registry
from lrjax.lowering.decode_attention import decode_attention


def _gpu_reason():
  if importlib.util.find_spec("jax_triton") is None:
    return "jax-triton is not installed (pip install 'lrjax[cuda]')"
  try:
    return None if jax.devices("gpu") else "no GPU"
  except RuntimeError as e:
    return f"no CUDA backend: {e}"


_REASON = _gpu_reason()
pytestmark = [
  pytest.mark.gpu,
  pytest.mark.skipif(_REASON is not None, reason=f"needs an NVIDIA GPU: {_REASON}"),
]

SHAPES = [  # b, hq, hkv, t, d
  (1, 32, 8, 1024, 128),  # Llama-3-8B
  (16, 32, 8, 8192, 128),
  (3, 28, 4, 256, 128),  # Qwen2.5-7B: 7 query heads a KV head
  (5, 8, 8, 128, 64),  # no grouping
  (2, 64, 8, 16, 256),
  (7, 12, 2, 2048, 32),
]


@contextlib.contextmanager
def _only(which: str):
  """The registry with one decode_attention kernel: "pallas" or "lrjax" (the other removed)."""
  registry.load_platform("cuda")
  other = "triton" if which == "pallas" else "pallas"
  gone = [k for k in registry.candidates("decode_attention", "cuda") if k.name.startswith(other)]
  for k in gone:
    registry.unregister("decode_attention", "cuda", k.name)
  try:
    yield which
  finally:
    for k in gone:
      registry.register(k)


@pytest.fixture(params=["pallas", "lrjax"])
def served_by(request):
  with _only(request.param) as which:
    yield which


@pytest.fixture
def pallas_only():
  with _only("pallas"):
    yield


def _lowered_by(fn, *args) -> str:
  """Which lowering serves the decode_attention calls of ``fn``: the registry's choice for
  their operands where the lowered program calls a kernel, else "xla"."""
  calls = []

  def spy(q, k, v, pos, **params):
    avals = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v, pos))
    sel = registry.select("decode_attention", "cuda", avals, params)
    calls.append("xla" if sel.kernel is None else sel.name.split(".")[0])

  prim = importlib.import_module("lrjax.lowering.decode_attention")
  real = prim.decode_attention_p.bind

  def bind(*a, **params):
    spy(*a, **params)
    return real(*a, **params)

  prim.decode_attention_p.bind = bind
  try:
    text = fn.lower(*args).as_text()
  finally:
    prim.decode_attention_p.bind = real
  assert calls and len(set(calls)) == 1, calls
  assert ("custom_call" in text) == (calls[0] != "xla"), calls
  return {"triton": "lrjax"}.get(calls[0], calls[0])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [None, 100])
def test_kernels_match_oracle(shape, dtype, window, served_by):
  """bf16 and f16 through each kernel; f32 through XLA (both decline it)."""
  q, k, v, pos = operands(*shape, dtype)
  fn = jax.jit(lambda *a: decode_attention(*a, window=window))
  assert _lowered_by(fn, q, k, v, pos) == ("xla" if dtype == jnp.float32 else served_by)
  # XLA's f32 dots run on TF32 unless asked for full precision
  with jax.default_matmul_precision("highest"):  # no effect on the 16-bit kernels
    out = fn(q, k, v, pos)
  assert_close(out, oracle(q, k, v, pos, window), dtype)


def test_a_length_the_pallas_kernel_declines_goes_to_lrjax_kernel():
  q, k, v, pos = operands(3, 28, 4, 1000, 128, jnp.bfloat16)
  fn = jax.jit(decode_attention)
  assert _lowered_by(fn, q, k, v, pos) == "lrjax"
  assert_close(fn(q, k, v, pos), oracle(q, k, v, pos), jnp.bfloat16)


@pytest.mark.parametrize("merge", ["walk", "tile"])
@pytest.mark.parametrize("splits", [1, 2, 3, 7, 16, 64])
@pytest.mark.parametrize("block_n", [16, 64, 128])
def test_lrjax_kernel_at_every_split_count(splits, block_n, merge):
  """Ragged chunks (2000 keys), empty trailing splits (rows short of the length), a window
  that skips leading splits; the merge reads only the splits that ran."""
  from lrjax.custom_calls.triton import decode_attention as ours

  q, k, v, _ = operands(4, 32, 8, 2048, 128, jnp.bfloat16)
  pos = jnp.asarray([0, 17, 1500, 1999], jnp.int32)
  bs = ours.BlockSizes(block_n=block_n, splits=splits, merge=merge)
  for window in (None, 333):
    out = ours.decode_attention(q, k, v, pos, window=window, length=2000, block_sizes=bs)
    ref = oracle(q, k[:, :, :2000], v[:, :, :2000], pos, window)
    assert_close(out, ref, jnp.bfloat16)


def test_lrjax_kernel_called_three_times_in_one_step():
  """Calls in one jit, each on its own partials, each merged right."""
  q, k, v, pos = operands(8, 32, 8, 1024, 128, jnp.bfloat16)
  fn = jax.jit(lambda q, k, v, p: [decode_attention(q * s, k, v, p) for s in (1.0, 0.5, 2.0)])
  outs = fn(q, k, v, pos)
  for s, out in zip((1.0, 0.5, 2.0), outs):
    assert_close(out, oracle((q * s).astype(q.dtype), k, v, pos), jnp.bfloat16)


@pytest.mark.parametrize("k_splits", [1, 2, 4, 8, 16, 32])
def test_every_split_count(k_splits):
  q, k, v, pos = operands(4, 32, 8, 4096, 128, jnp.bfloat16)
  out = kernel.decode_attention(q, k, v, pos, k_splits=k_splits)
  assert_close(out, oracle(q, k, v, pos), jnp.bfloat16)


def test_rows_at_every_fill_level(served_by):
  """Rows from an empty cache (pos 0) to a full one, with keys past pos set to huge values
  that a kernel reading past the row's last key would not survive."""
  t = 512
  q, k, v, _ = operands(8, 16, 4, t, 64, jnp.bfloat16)
  pos = jnp.asarray([0, 1, 15, 16, 127, 128, 300, t - 1], jnp.int32)
  past = jnp.arange(t)[None, None, :, None] > pos[:, None, None, None]
  k, v = jnp.where(past, 3e4, k).astype(k.dtype), jnp.where(past, -3e4, v).astype(v.dtype)
  out = jax.jit(decode_attention)(q, k, v, pos)
  assert_close(out, oracle(q, k, v, pos), jnp.bfloat16)


@pytest.mark.parametrize("t, length", [(2048, 1024), (8192, 512), (4096, 16)])
def test_length_bound_reads_the_buffers_in_place(t, length, pallas_only):
  """Pallas: a buffer longer than the attended length: passed whole (no copy in the compiled
  HLO) where the split plan stretches over it, sliced where it would take too many splits;
  keys past ``length`` hold huge values that reading them would show."""
  q, k, v, _ = operands(4, 32, 8, t, 128, jnp.bfloat16)
  pos = jnp.asarray([0, 1, length // 2, length - 1], jnp.int32)
  past = jnp.arange(t)[None, None, :, None] >= length
  k, v = jnp.where(past, 3e4, k).astype(k.dtype), jnp.where(past, -3e4, v).astype(v.dtype)
  fn = jax.jit(lambda *a: decode_attention(*a, length=length))
  whole = kernel.buffer_plan(kernel.plan(4, 8, length), t, length) is not None
  hlo = fn.lower(q, k, v, pos).compile().as_text()
  copied = f"bf16[4,8,{length},128]" in hlo  # a [B, Hkv, length, D] slice of the buffer
  assert copied != whole, f"{whole=} but {copied=}"
  out = fn(q, k, v, pos)
  assert_close(out, oracle(q, k[:, :, :length], v[:, :, :length], pos), jnp.bfloat16)


@pytest.mark.parametrize("t, length", [(2048, 1024), (8192, 512), (4096, 16), (1000, 999)])
def test_lrjax_kernel_reads_the_buffers_in_place(t, length):
  """lrjax's kernel takes any buffer whole (no [B, Hkv, length, D] copy in the compiled HLO)
  and never reads a key at or past ``length``, which holds a huge value here."""
  q, k, v, _ = operands(4, 32, 8, t, 128, jnp.bfloat16)
  pos = jnp.asarray([0, 1, length // 2, length - 1], jnp.int32)
  past = jnp.arange(t)[None, None, :, None] >= length
  k, v = jnp.where(past, 3e4, k).astype(k.dtype), jnp.where(past, -3e4, v).astype(v.dtype)
  fn = jax.jit(lambda *a: decode_attention(*a, length=length))
  with _only("lrjax"):
    assert _lowered_by(fn, q, k, v, pos) == "lrjax"
    assert f"bf16[4,8,{length},128]" not in fn.lower(q, k, v, pos).compile().as_text()
    out = fn(q, k, v, pos)
  assert_close(out, oracle(q, k[:, :, :length], v[:, :, :length], pos), jnp.bfloat16)


def _tiny_decode(dtype, reference, check=None):
  """(logits, cache) of one decode step of a 2-layer tiny Llama after a 40-token prefill
  (attend_len 64 of a 128 cache, the cache donated): under force_reference (matmuls at full
  precision) or the kernels, ``check(step, toks, cache)`` first."""
  from flax import nnx

  from lrjax.models import LlamaForCausalLM, ModelConfig
  from lrjax.models.llama import KVCache

  cfg = ModelConfig.tiny(num_layers=2)
  seq = jax.random.randint(jax.random.key(0), (4, 40), 0, cfg.vocab_size)
  toks = jnp.asarray(np.arange(4), jnp.int32)
  model = LlamaForCausalLM(cfg, dtype=dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  _, cache = model.prefill(seq, KVCache.init(cfg, 4, 128, dtype))
  step = jax.jit(lambda t, c: model.decode(t, c, attend_len=64), donate_argnums=1)
  if reference:
    with force_reference(), jax.default_matmul_precision("highest"):
      return step(toks, cache)
  if check is not None:
    check(step, toks, cache)
  return step(toks, cache)


def test_model_decode_on_the_gpu_matches_the_reference(monkeypatch):
  """A bf16 model's decode step with the Pallas kernel (the append kernel declined, so the
  step's RoPE and cache writes are XLA's and its attention the plain ``decode_attention``) is
  as close to the f32 model as with XLA's attention (both round q·k, the softmax and p·v to
  bf16, differently). test_model_decode_with_the_append_kernel checks the default path."""
  from lrjax.custom_calls.triton import lowering as cuda_lowering

  def check(step, toks, cache):
    assert _lowered_by(step, toks, cache) == "pallas"

  monkeypatch.setattr(cuda_lowering, "APPEND_GPU_VERIFIED", False)
  truth = np.asarray(_tiny_decode(jnp.float32, True)[0], np.float64)
  kernel_err = rel_err(_tiny_decode(jnp.bfloat16, False, check)[0], truth)
  xla_err = rel_err(_tiny_decode(jnp.bfloat16, True)[0], truth)
  assert kernel_err <= max(1.5 * xla_err, tolerance(jnp.bfloat16)), (kernel_err, xla_err)


def _append_operands(b, hq, hkv, t, d, dtype, seed=0):
  from lrjax.lowering.decode_attention import rope_tables

  q, kc, vc, pos = operands(b, hq, hkv, t, d, dtype)
  ks = jax.random.split(jax.random.key(seed + 7), 2)
  kn = jax.random.normal(ks[0], (b, hkv, d), dtype)
  vn = jax.random.normal(ks[1], (b, hkv, d), dtype)
  inv = 1.0 / (500000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  cos, sin = rope_tables(pos, inv, dtype)
  return q, kn, vn, kc, vc, pos, cos, sin


def _bf16_mismatch(got, want) -> str:
  """How two bf16 arrays differ: the elements that differ, the largest difference in bf16 ulps
  (adjacent bf16 values are 1 apart, across zero too) and the largest absolute one."""

  def ordered(a):
    i = np.asarray(a).view(np.uint16).astype(np.int32)
    return np.where(i & 0x8000, -(i & 0x7FFF), i)

  ulps = np.abs(ordered(got) - ordered(want))
  absd = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max()
  return (
    f"{int((ulps > 0).sum())} of {ulps.size} elements differ, by up to {ulps.max()} bf16 ulps "
    f"(up to {absd:.3g} in value)"
  )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("apart", [False, True])
def test_append_kernel_matches_its_reference(shape, window, apart):
  """decode_attention_append on the GPU against its XLA reference (RoPE, cache write, the
  models' attention): the attention within bf16's tolerance, the written rows bit for bit,
  every other cache row unchanged; the new key spliced into the cache loop or attended apart
  (NEW_KEY_APART)."""
  from lrjax.custom_calls.triton import decode_attention_append as dap

  ops = _append_operands(*shape, jnp.bfloat16)
  out, kc, vc = dap.decode_attention_append(*ops, window=window, new_key_apart=apart)
  ref, kr, vr = dap.decode_attention_append_reference(*ops, window=window)
  assert_close(out, np.asarray(ref, np.float64), jnp.bfloat16)
  for got, want in ((kc, kr), (vc, vr)):
    got, want = np.asarray(got), np.asarray(want)
    assert np.array_equal(got, want), _bf16_mismatch(got, want)


@pytest.mark.parametrize("merge", ["walk", "tile"])
@pytest.mark.parametrize("splits", [1, 3, 16, 64])
@pytest.mark.parametrize("apart", [False, True])
def test_append_kernel_with_the_caches_donated_in_a_loop(merge, splits, apart):
  """Eight steps in one jit, the caches carried (updated in place, as a decode loop donates
  them), each step's new row at the next position of each row, at the split boundaries the
  kernel cuts: the same outputs and caches as the reference's loop."""
  _check_append_loop(merge, splits, apart)


@pytest.mark.parametrize("launch, overlap", [("pdl", "0"), ("pdl", "1"), ("xla_triton", "1")])
@pytest.mark.parametrize("merge", ["walk", "tile"])
def test_append_kernel_loop_launched_as_programmatic_dependents(
  monkeypatch, launch, overlap, merge
):
  """The same loop with the attention's two launches as programmatic dependents (lrjax's
  launcher: they wait for the kernel ahead first), and with each letting the next launch start
  after its wait, its split's first keys and values prefetched before it
  (LRJAX_TRITON_PDL_OVERLAP): the same outputs and caches."""
  monkeypatch.setenv("LRJAX_TRITON_LAUNCH", launch)
  monkeypatch.setenv("LRJAX_TRITON_PDL_OVERLAP", overlap)
  _check_append_loop(merge, 16, True)


def _check_append_loop(merge, splits, apart):
  from lrjax.custom_calls.triton import decode_attention as ours
  from lrjax.custom_calls.triton import decode_attention_append as dap

  q, kn, vn, kc, vc, pos, cos, sin = _append_operands(3, 32, 8, 1024, 128, jnp.bfloat16)
  pos = jnp.asarray([0, 511, 1000], jnp.int32)
  bs = ours.BlockSizes(splits=splits, merge=merge)

  def loop(fn):
    def body(i, carry):
      kc, vc, acc = carry
      out, kc, vc = fn(q * (i + 1), kn * (i + 1), vn, kc, vc, pos + i, cos, sin)
      return kc, vc, acc + out.astype(jnp.float32)

    init = (jnp.copy(kc), jnp.copy(vc), jnp.zeros((3, 32 * 128), jnp.float32))  # donated
    return jax.jit(lambda *c: jax.lax.fori_loop(0, 8, body, c), donate_argnums=(0, 1))(*init)

  got = loop(
    lambda *a: dap.decode_attention_append(*a, length=1016, block_sizes=bs, new_key_apart=apart)
  )
  want = loop(lambda *a: dap.decode_attention_append_reference(*a, length=1016))
  assert rel_err(got[2], want[2]) < 2 * tolerance(jnp.bfloat16)
  for g, w in zip(got[:2], want[:2]):
    g, w = np.asarray(g), np.asarray(w)
    assert np.array_equal(g, w), _bf16_mismatch(g, w)


def _lowrank_decode(feed=None, steps=4):
  """Logits [steps, 4, vocab] of fused decode steps (lrjax.fuse, the kernels preferred) of a
  2-layer low-rank Llama with kernel-sized shapes after a 40-token prefill, each step fed
  its greedy token or ``feed``'s; the tokens fed; the compiled step's HLO text."""
  from flax import nnx

  import lrjax
  from lrjax.models import LlamaForCausalLM, ModelConfig
  from lrjax.models.llama import KVCache

  cfg = ModelConfig(
    vocab_size=512, hidden_size=512, intermediate_size=1408, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=128,
  )  # fmt: skip
  ranks = dict(q_proj=128, k_proj=64, v_proj=64, o_proj=128, gate_proj=128, up_proj=128,
               down_proj=128)  # fmt: skip
  dtype = jnp.bfloat16
  model = LlamaForCausalLM(cfg, ranks=[ranks] * 2, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
  seq = jax.random.randint(jax.random.key(0), (4, 40), 0, cfg.vocab_size)
  logits, cache = model.prefill(seq, KVCache.init(cfg, 4, 128, dtype))
  decode = lrjax.fuse(lambda t, c: model.decode(t, c, attend_len=64))
  with lrjax.lowering.prefer_kernels():
    step = jax.jit(decode, donate_argnums=1).lower(jnp.zeros((4,), jnp.int32), cache).compile()
  toks = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
  fed, out = [], []
  for i in range(steps):
    if feed is not None:
      toks = jnp.asarray(feed[i])
    fed.append(np.asarray(toks))
    logits, cache = step(toks, cache)
    logits = logits.reshape(4, -1)
    out.append(np.asarray(logits, np.float32))
    toks = jnp.argmax(logits, -1).astype(jnp.int32)
  return np.stack(out), np.stack(fed), step.as_text()


@pytest.mark.parametrize("launch", ["pdl", "xla_triton"])
def test_model_decode_with_pdl_overlap(monkeypatch, launch):
  """A fused low-rank model's decode steps (grouped q/k/v, o_proj and SwiGLU kernels with the
  norms and residual adds in them, RoPE and the cache writes in the attention's launches)
  with every kernel letting the next launch start after its wait and prefetching its first
  tile before it (LRJAX_TRITON_PDL_OVERLAP=1), under lrjax's launcher and XLA's calls: the
  same logits as without, step after step on the same tokens (within bf16's tolerance: the
  kernels' split-K sums are f32 atomics, whose order varies from run to run)."""
  from lrjax.custom_calls.triton import launch_modes
  from lrjax.custom_calls.triton import lowering as cuda_lowering

  for name in ("APPEND", "NORM", "RESIDUAL"):
    monkeypatch.setattr(cuda_lowering, f"{name}_GPU_VERIFIED", True)
  monkeypatch.setenv("LRJAX_TRITON_LAUNCH", launch)
  want, fed, off = _lowrank_decode()
  assert launch_modes.count_calls(off) >= 10, off  # 5 a layer: q/k/v, 2 attention, o, MLP
  monkeypatch.setenv("LRJAX_TRITON_PDL_OVERLAP", "1")
  got, _, on = _lowrank_decode(feed=fed)
  if launch == "pdl":  # the PTX lrjax's launcher loads is an attribute of each call
    assert "launch_dependents" not in off and "launch_dependents" in on
  assert rel_err(got, want) < tolerance(jnp.bfloat16), rel_err(got, want)


def test_model_decode_with_the_append_kernel(monkeypatch):
  """The model's decode step with RoPE and the cache writes in lrjax's attention launches
  (decode_attention_append's kernel, enabled here): as close to the f32 model as with XLA's
  attention, the same caches as the reference path's, the kernel in the program, and no copy
  of a cache buffer in the compiled step (the caches donated and updated in place)."""
  from lrjax.custom_calls.triton import lowering as cuda_lowering

  def check(step, toks, cache):
    # the registry serves each append call with the kernel, and no reference lowering binds
    # the plain decode_attention primitive (as the declined path would)
    prims = importlib.import_module("lrjax.lowering.decode_attention")
    chosen, plain = [], []
    real_append, real_plain = prims.decode_attention_append_p.bind, prims.decode_attention_p.bind

    def append(*a, **params):
      avals = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in a)
      chosen.append(registry.select("decode_attention_append", "cuda", avals, params).name)
      return real_append(*a, **params)

    def plain_bind(*a, **params):
      plain.append(a[0].shape)
      return real_plain(*a, **params)

    prims.decode_attention_append_p.bind = append
    prims.decode_attention_p.bind = plain_bind
    try:
      lowered = step.lower(toks, cache)
    finally:
      prims.decode_attention_append_p.bind = real_append
      prims.decode_attention_p.bind = real_plain
    assert chosen == ["triton.decode_attention_append"] * 2 and not plain, (chosen, plain)
    assert "custom_call" in lowered.as_text()
    buf = "bf16[{}]".format(",".join(map(str, cache.k[0].shape)))
    copies = [ln for ln in lowered.compile().as_text().splitlines() if " copy(" in ln and buf in ln]
    assert not copies, copies

  truth = np.asarray(_tiny_decode(jnp.float32, True)[0], np.float64)
  monkeypatch.setattr(cuda_lowering, "APPEND_GPU_VERIFIED", True)
  logits, cache = _tiny_decode(jnp.bfloat16, False, check)
  ref_logits, ref_cache = _tiny_decode(jnp.bfloat16, True)
  kernel_err, xla_err = rel_err(logits, truth), rel_err(ref_logits, truth)
  assert kernel_err <= max(1.5 * xla_err, tolerance(jnp.bfloat16)), (kernel_err, xla_err)
  for got, want in zip(cache.k + cache.v, ref_cache.k + ref_cache.v):
    assert_close(got, np.asarray(want, np.float64), jnp.bfloat16)
