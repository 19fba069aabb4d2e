"""One decode step's attention with the new token's RoPE and cache write in the same launches,
on NVIDIA GPUs: ``decode_attention_append``.

  q            [B, Hq, D]       the new token's queries, before RoPE
  k_new, v_new [B, Hkv, D]      its key (before RoPE) and value
  k_cache, v_cache [B, Hkv, T, D]  the cache buffers (lrjax.models.llama.KVCache's layout)
  pos          [B] int32        the new token's position; key t is visible iff t <= pos[b]
  cos, sin     [B, D]           RoPE's tables at pos, in q's dtype (rotate-half RoPE, as the
                                models compute them: lowering.decode_attention.rope_tables)
  → (out [B, Hq·D], k_cache with rope(k_new) at pos, v_cache with v_new at pos)

The op's reference (lowering/decode_attention.py) runs these as XLA fusions (RoPE of q and of
k, a write into each cache buffer) around the ``decode_attention`` primitive; here inside lrjax's
flash-decoding launch (decode_attention.py): every program ropes its query rows in registers,
the program whose split holds position pos[b] writes the new key and value into the cache
buffers (aliased in place), and every program takes that key and value from registers rather
than from the cache, so no program waits for another's write. The merge launch is
decode_attention.py's.

RoPE is computed in q's dtype one operation at a time, as XLA rounds the models' code on the
CPU and on the GPU (x·cos, rotate_half(x)·sin, their sum), so the written key equals the
reference's. The kernel is compiled without floating-point contraction (``COMPILE_OPTIONS``):
with it, Triton fuses the second product into the sum (a bf16 FMA that skips the product's
rounding), and on an H200 the written key rows differed from XLA's in about a fifth of their
elements. Checked in Triton's interpreter, in the sm_90 PTX (each product and the sum
rounded, no FMA: tests/custom_calls/triton/test_triton_rounding.py), and so compiled on an
H100 (test_decode_attention_gpu.py -k append: the written rows equal XLA's bit for bit).
The registry serves it where the tuning table's ``dispatch.attention_append`` is on
(docs/kernels.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from lrjax.custom_calls.triton import decode_attention as da
from lrjax.custom_calls.triton import launch
from lrjax.custom_calls.triton.lowering import decode_attention_shape_reason


def decode_attention_append_reference(q, k_new, v_new, k_cache, v_cache, pos, cos, sin, **kw):
  """The op's reference (lowering/decode_attention.py): the models' RoPE, cache writes and the
  ``decode_attention`` primitive, one after another."""
  from lrjax.lowering.decode_attention import decode_attention_append_reference as ref

  return ref(q, k_new, v_new, k_cache, v_cache, pos, cos, sin, **kw)


# no floating-point contraction: RoPE's products are rounded before their sum, as XLA rounds
# them (with contraction Triton fuses the second product into the add: one bf16 FMA)
COMPILE_OPTIONS = dict(enable_fp_fusion=False)

# How the program holding the new position attends the new key and value. True ("apart"): the
# loop reads the cache's keys before the new one, the plain kernel's loop, and the new key
# joins the online softmax after it. False ("splice"): they replace that row of the K and V
# tiles in its cache loop, which takes the tiles through registers and back to shared memory
# (sm_90 build at batch 16: 168 registers and 54 KB of shared memory against the plain
# kernel's 128 and 38 KB). Both passed their GPU tests; apart's attention measured 3-12 %
# faster in the step (docs/kernels.md).
NEW_KEY_APART = True


@triton.jit
def _rope_rows(x_ptr, rows, offs_d, cos, sin, D: tl.constexpr, mask):
  """RoPE of rows ``rows`` [R] of x [*, D] with cos, sin [D]: x·cos + rotate_half(x)·sin,
  rounded to x's dtype after each operation (as the models' XLA code rounds it)."""
  dt = x_ptr.dtype.element_ty
  half = D // 2
  x = tl.load(x_ptr + rows[:, None] * D + offs_d[None, :], mask=mask, other=0.0)
  turned = (offs_d + half) % D  # rotate_half reads the other half...
  xr = tl.load(x_ptr + rows[:, None] * D + turned[None, :], mask=mask, other=0.0)
  xr = tl.where((offs_d < half)[None, :], -xr, xr)  # ...negating the second one
  a = (x.to(tl.float32) * cos.to(tl.float32)[None, :]).to(dt)
  c = (xr.to(tl.float32) * sin.to(tl.float32)[None, :]).to(dt)
  return (a.to(tl.float32) + c.to(tl.float32)).to(dt)


@triton.jit
def _decode_attention_append_kernel(
  q_ptr,  # [B, HQ, D] before RoPE
  kn_ptr,  # [B, HKV, D] the new key, before RoPE
  vn_ptr,  # [B, HKV, D] the new value
  kc_ptr,
  vc_ptr,  # [B, HKV, T, D] the caches as they came in
  pos_ptr,  # [B] i32
  cos_ptr,
  sin_ptr,  # [B, D]
  part_ptr,  # f32 partials, as decode_attention.py's kernel writes them
  ko_ptr,
  vo_ptr,  # the caches again (aliased to kc_ptr, vc_ptr): the new rows are written here
  T: tl.constexpr,
  LEN: tl.constexpr,
  HQ: tl.constexpr,
  HKV: tl.constexpr,
  D: tl.constexpr,
  G: tl.constexpr,
  GP: tl.constexpr,
  S: tl.constexpr,
  SP: tl.constexpr,
  CHUNK: tl.constexpr,
  WINDOW: tl.constexpr,
  SCALE: tl.constexpr,
  BLOCK_N: tl.constexpr,
  NROWS: tl.constexpr,
  GM: tl.constexpr,
  BLOCK_D: tl.constexpr,
  APART: tl.constexpr,  # NEW_KEY_APART
  PDL: tl.constexpr = 0,  # launched as a programmatic dependent (launch.py, _common.pdl_join)
):
  pid = tl.program_id(0)
  bh = pid // S
  s = pid % S
  b = bh // HKV
  h = bh % HKV
  kv_off = (b * HKV + h).to(tl.int64) * T * D
  da.pdl_start_split(kc_ptr + kv_off, vc_ptr + kv_off, pos_ptr, b, s, LEN, WINDOW, CHUNK, D, PDL)
  w = tl.load(pos_ptr + b)
  offs_d = tl.arange(0, D)
  cos = tl.load(cos_ptr + b * D + offs_d)
  sin = tl.load(sin_ptr + b * D + offs_d)
  one = tl.arange(0, 1)
  k_new = tl.reshape(_rope_rows(kn_ptr, bh + one, offs_d, cos, sin, D, True), [D])
  v_new = tl.load(vn_ptr + bh * D + offs_d)
  # the split holding position w writes the new row (a position past T is dropped)
  if (s == tl.minimum(w // CHUNK, S - 1)) & (w < T):
    tl.store(ko_ptr + kv_off + w * D + offs_d, k_new.to(ko_ptr.dtype.element_ty))
    tl.store(vo_ptr + kv_off + w * D + offs_d, v_new.to(vo_ptr.dtype.element_ty))
  lo, hi = da._split_range(pos_ptr, b, s, LEN, WINDOW, CHUNK)
  if lo < hi:
    offs_g = tl.arange(0, GP)
    q = _rope_rows(q_ptr, b * HQ + h * G + offs_g, offs_d, cos, sin, D, (offs_g < G)[:, None])
    if APART:
      holds = (w >= lo) & (w < hi)  # the new key is its row's last visible one: w == hi - 1
      acc, m_i, l_i = da._attend_split(
        q, kc_ptr + kv_off, vc_ptr + kv_off, lo, tl.where(holds, w, hi), q, q, -1, D, GP,
        SCALE, BLOCK_N, False,
      )  # fmt: skip
      if holds:
        acc, m_i, l_i = _join_new_key(q, k_new, v_new, acc, m_i, l_i, SCALE)
    else:
      acc, m_i, l_i = da._attend_split(
        q, kc_ptr + kv_off, vc_ptr + kv_off, lo, hi, k_new, v_new, w, D, GP, SCALE, BLOCK_N, True
      )
    da._store_partials(part_ptr, acc, m_i, l_i, bh, s, S, G, GP, D, NROWS)


@triton.jit
def _join_new_key(q, k_new, v_new, acc, m_i, l_i, SCALE: tl.constexpr):
  """The online softmax state (acc [GP, D], max, sum) with one more key and value [D]: its
  score from q [GP, D] in f32, its weight rounded to the value's dtype as the loop's p·V
  rounds it."""
  sc = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * SCALE
  m_new = tl.maximum(m_i, sc)
  alpha = tl.exp(m_i - m_new)
  p = tl.exp(sc - m_new)
  pv = p.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)[None, :]
  return acc * alpha[:, None] + pv, m_new, l_i * alpha + p


def decode_attention_append(q, k_new, v_new, k_cache, v_cache, pos, cos, sin, *, window=None,
                            length=None, block_sizes=None, new_key_apart=None):  # fmt: skip
  """(out [B, Hq·D], k_cache, v_cache) as :func:`decode_attention_append_reference`, in two
  Triton launches with the caches updated in place (module docstring). ``new_key_apart``:
  how the new key is attended (None: ``NEW_KEY_APART``)."""
  from lrjax.lowering.decode_attention import _append_check

  _append_check(q, k_new, v_new, k_cache, v_cache, pos, cos, sin)
  b, hq, d = q.shape
  _, hkv, t, _ = k_cache.shape
  length = t if length is None else length
  dts = (q.dtype.name, k_cache.dtype.name, v_cache.dtype.name)
  reason = decode_attention_shape_reason(q.shape, dts)
  if reason is None and len({*dts, k_new.dtype.name, v_new.dtype.name, cos.dtype.name}) > 1:
    reason = f"q, k_new, v_new, the caches and cos/sin must share one dtype, got {dts}"
  if reason is not None:
    raise ValueError(reason)
  bs = block_sizes or da.BlockSizes.get_default()
  plan = da.launch_plan(b, hq, hkv, t, d, length, window, bs)
  pos = jnp.asarray(pos, jnp.int32)
  part, k_cache, v_cache = launch.triton_call(
    q,
    k_new,
    v_new,
    k_cache,
    v_cache,
    pos,
    cos,
    sin,
    kernel=_decode_attention_append_kernel,
    out_shape=[
      jax.ShapeDtypeStruct((plan["part"],), jnp.float32),
      jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
      jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
    ],
    input_output_aliases={3: 1, 4: 2},
    grid=plan["grid"],
    num_warps=bs.num_warps,
    num_stages=bs.num_stages,
    name="lrjax_decode_attention_append",
    APART=NEW_KEY_APART if new_key_apart is None else bool(new_key_apart),
    **COMPILE_OPTIONS,
    **plan["meta"],
  )
  out = launch.triton_call(
    part,
    pos,
    kernel=da._merge_tile_kernel if plan["merge"] == "tile" else da._merge_kernel,
    out_shape=jax.ShapeDtypeStruct((b, hq * d), q.dtype),
    grid=plan["merge_grid"],
    num_warps=4,
    num_stages=1,
    name="lrjax_decode_attention_merge",
    **plan["meta"],
  )
  return out, k_cache, v_cache
