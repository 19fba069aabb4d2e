"""GPU tests of decode_attention's CUDA lowering (jax's Pallas flash-decoding kernel): compiled
on the GPU, against a float64 host oracle on fresh random inputs, and bound in the model's
decode step (``pytest -m gpu`` on a CUDA machine)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, rel_err, tolerance
from conftest import decode_attention_f64 as oracle
from conftest import decode_attention_operands as operands
from lrjax.custom_calls.triton import decode_attention as kernel
from lrjax.lowering import force_reference
from lrjax.lowering.decode_attention import decode_attention


def _gpu_reason():
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


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [None, 100])
def test_kernel_matches_oracle(shape, dtype, window):
  """bf16 and f16 through the kernel; f32 through XLA (the kernel declines it)."""
  q, k, v, pos = operands(*shape, dtype)
  fn = jax.jit(lambda *a: decode_attention(*a, window=window))
  lowered = "triton" in fn.lower(q, k, v, pos).as_text().lower()
  assert lowered == (dtype != jnp.float32), "kernel chosen for f32 or not chosen for 16 bits"
  # XLA's f32 dots run on TF32 unless asked for full precision
  with jax.default_matmul_precision("highest"):  # no effect on the 16-bit kernel
    out = fn(q, k, v, pos)
  assert_close(out, oracle(q, k, v, pos, window), dtype)


@pytest.mark.parametrize("k_splits", [1, 2, 4, 8, 16, 32])
def test_every_split_count(k_splits):
  q, k, v, pos = operands(4, 32, 8, 4096, 128, jnp.bfloat16)
  out = kernel.decode_attention(q, k, v, pos, k_splits=k_splits)
  assert_close(out, oracle(q, k, v, pos), jnp.bfloat16)


def test_rows_at_every_fill_level():
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
def test_length_bound_reads_the_buffers_in_place(t, length):
  """A buffer longer than the attended length: passed whole (no copy in the compiled HLO)
  where the split plan stretches over it, sliced where it would take too many splits; keys
  past ``length`` hold huge values that reading them would show."""
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


def test_model_decode_on_the_gpu_matches_the_reference():
  """A bf16 model's decode step with the kernel is as close to the f32 model as with XLA's
  attention (both round q·k, the softmax and p·v to bf16, differently)."""
  from flax import nnx

  from lrjax.models import LlamaForCausalLM, ModelConfig
  from lrjax.models.llama import KVCache

  cfg = ModelConfig.tiny(num_layers=2)
  seq = jax.random.randint(jax.random.key(0), (4, 40), 0, cfg.vocab_size)
  toks = jnp.asarray(np.arange(4), jnp.int32)

  def decode(dtype, reference):
    model = LlamaForCausalLM(cfg, dtype=dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    _, cache = model.prefill(seq, KVCache.init(cfg, 4, 128, dtype))
    step = jax.jit(lambda t, c: model.decode(t, c, attend_len=64)[0])
    if reference:
      with force_reference(), jax.default_matmul_precision("highest"):
        return step(toks, cache)
    assert "triton" in step.lower(toks, cache).as_text().lower()
    return step(toks, cache)

  truth = np.asarray(decode(jnp.float32, True), np.float64)
  kernel_err = rel_err(decode(jnp.bfloat16, False), truth)
  xla_err = rel_err(decode(jnp.bfloat16, True), truth)
  assert kernel_err <= max(1.5 * xla_err, tolerance(jnp.bfloat16)), (kernel_err, xla_err)
