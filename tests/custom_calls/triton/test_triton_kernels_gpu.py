"""GPU tests of the Triton kernels (``pytest -m gpu`` on a CUDA machine with jax-triton).

Each test draws fresh random inputs, poisons the output buffer with NaN (the kernel
writes into it through input_output_aliases, so an unwritten element stays NaN and
fails), and compares with a float64 host reference that applies the kernels' rounding
of the rank-space intermediate to the factor dtype.
"""

import contextlib
import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, randn
from lrjax.custom_calls.triton import launch_modes, planner, policy  # no triton import


def _gpu_reason():
  if importlib.util.find_spec("jax_triton") is None:
    return "jax-triton is not installed (pip install 'lrjax[cuda]')"
  try:
    if not jax.devices("gpu"):
      return "no GPU"
  except RuntimeError as e:
    return f"no CUDA backend: {e}"
  return None


_REASON = _gpu_reason()
pytestmark = [
  pytest.mark.gpu,
  pytest.mark.skipif(_REASON is not None, reason=f"needs an NVIDIA GPU: {_REASON}"),
]


def f64(a):
  return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def rnd(a, dtype):
  """Rounds a float64 host array to ``dtype`` (the kernels' intermediate rounding)."""
  return f64(jnp.asarray(a, jnp.float32).astype(dtype))


def poisoned(shape, dtype):
  return jnp.full(shape, jnp.nan, dtype)


def xuv_ref(x, u, v, b, dtype):
  y = rnd(f64(x) @ f64(u), dtype) @ f64(v)
  return y + f64(b) if b is not None else y


def lr_factors(k, r, n, dtype):
  return randn((k, r), dtype, k**-0.5), randn((r, n), dtype, r**-0.5)


XUV_SHAPES = [  # (M, K, r, N): M=1, ragged everything, a multi-super-block prefill
  (1, 512, 128, 256),
  (1, 200, 72, 130),
  (7, 1000, 96, 520),
  (16, 4096, 256, 1024),
  (64, 384, 136, 200),
  (100, 320, 256, 384),
  (333, 1000, 200, 700),
  (1280, 512, 320, 640),
  (3, 2048, 2304, 1000),  # r >= 2048: the tuned large-rank configs
  (64, 1000, 2560, 8200),  # P per phase-2 tile >= the planner's p_split_bytes: two r-chunks
  (1, 512, 16, 1024),
  (5, 300, 7, 200),  # ranks <= 32 (TP-8 shards): narrow tiles
  (4, 64, 16, 32),
  (2, 40, 1, 48),  # K <= 64: one 64-row step; rank one
  (4, 8192, 2432, 8192),  # >= 64 KB of U a CTA: round-trip-wide phase-1 tiles, ragged
  # split-K partials over the planner's partial_free_bytes: fewer, 128-column phase-1 tiles
  (8, 4096, 1024, 1000),
  (16, 8192, 2048, 520),
  # 33-64 rows, N <= K/4, K >= 4096: phase 1 alone (xuv_decode.default_pv) on 64-column
  # tiles of 6 stages (phase1_inflight_bytes), K ragged; at 48 rows part of the block
  (64, 4100, 520, 1000),
  (48, 4100, 520, 1000),
  # phase 1 alone on 112 of 128 columns a tile (phase1_balance_cols), K and r ragged
  (100, 4100, 2456, 1000),
  # up to 64 rows with r >= 2048 not a multiple of 16: the fused kernel by default
  # (the pv_xla_pad_* thresholds: XLA's GEMM would pad V every call)
  (64, 2000, 2056, 1100),
]


@pytest.mark.parametrize(
  "dtype,bias", [(jnp.bfloat16, False), (jnp.float16, True), (jnp.bfloat16, True)]
)
@pytest.mark.parametrize("shape", XUV_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize(
  "kind",
  [
    "decode",
    "decode_small_blocks",
    "persistent",
    "persistent_small_grid",
    "persistent_xla_zeroing",
    "persistent_p16",
    "persistent_small_grid_p16",
    "persistent_pv_xla",
    "persistent_small_grid_pv_xla",
    "persistent_two_waves_pv_xla",
    "persistent_planned",
    "persistent_no_v_resident",
    "persistent_stream_k",
    "persistent_wide_rows",
    "persistent_deep_kv",
    "persistent_p16_pv_xla",
    "persistent_pv_launch",
    "persistent_pv_launch_small_tiles",
    "prefill",
  ],
)
def test_xuv_kernels(kind, shape, dtype, bias):
  from lrjax.custom_calls.triton import xuv_decode, xuv_prefill

  m, k, r, n = shape
  if kind != "prefill" and m > xuv_decode.MAX_M:
    pytest.skip(f"decode kernel serves M <= {xuv_decode.MAX_M}")
  x = randn((m, k), dtype)
  u, v = lr_factors(k, r, n, dtype)
  b = randn((n,), dtype) if bias else None
  if kind == "prefill":
    fn = lambda x, u, v, b, o: xuv_prefill.xuv_prefill(x, u, v, b, out=o)
  elif kind.startswith("persistent"):
    p = planner.plan_decode_persistent(m, k, r, n)
    if kind == "persistent_wide_rows":  # V's tiles >= 256 columns where N allows
      p = planner.plan_decode_persistent(m, k, r, n, min_row_bytes=512)
    if kind == "persistent_no_v_resident":  # small ranks on the looping phase 2 instead
      p = planner.plan_decode_persistent(m, k, r, n, v_resident=False)
    if kind.startswith("persistent_small_grid"):  # several ragged, part-width tiles per CTA
      p = dataclasses.replace(
        p,
        block_r=64,
        cols_r=32,
        k_per=128,
        block_n=64,
        cols_n=48,
        block_kv=32,
        r_chunks=3,
        programs=5,
        prefetch=16,
        v_resident=False,
        stream_k=False,
      )
    if kind == "persistent_two_waves_pv_xla":  # phase 1 alone may outnumber the SMs
      from lrjax.custom_calls.triton._common import num_sms

      p = dataclasses.replace(p, block_r=64, cols_r=32, k_per=64, programs=2 * num_sms())
    if kind == "persistent_stream_k":  # phase 1 split evenly by K steps over the CTAs
      steps = planner.cdiv(r, 128) * planner.cdiv(k, p.block_k)
      p = dataclasses.replace(
        p,
        stream_k=True,
        block_r=128,
        cols_r=128,
        r_chunks=1,
        p16=False,
        v_resident=False,
        programs=min(p.programs, steps),
      )
    if kind == "persistent_deep_kv":  # the deep_kv_* thresholds: 128-row phase-2 steps, 3 stages
      p = dataclasses.replace(
        p,
        block_kv=policy.values("planner").deep_kv_rows,
        stages=policy.values("planner").deep_kv_stages,
        r_chunks=1,
        p16=False,
        v_resident=False,
      )
    if kind == "persistent_p16_pv_xla":  # phase 1 alone rounds P itself (the default: f32)
      p = dataclasses.replace(planner.plan_decode_phase1(m, k, r, n), p16=True)
    if kind.endswith("_p16"):  # phase 2 reads P rounded once by each block's last tile
      p = dataclasses.replace(p, p16=True, v_resident=False, stream_k=False)
    fn = lambda x, u, v, b, o: xuv_decode._xuv_decode(x, u, v, b, out=o, persistent=p, pv="kernel")
    if kind.endswith("_pv_xla"):  # phase 1 alone, then XLA's GEMM (it writes all of y)
      fn = lambda x, u, v, b, o: xuv_decode._xuv_decode(x, u, v, b, persistent=p, pv="xla")
    if kind.startswith("persistent_pv_launch"):  # phase 1 alone, then the ·V launch
      pp = planner.plan_pv_launch(m, r, n)
      if kind.endswith("small_tiles"):  # ragged 16 x 16 tiles, 32-row steps over r
        pp = dataclasses.replace(pp, block_m=16, block_n=16, block_kv=32, stages=2)
      p = planner.plan_decode_phase1(m, k, r, n)
      fn = lambda x, u, v, b, o: xuv_decode._xuv_decode(
        x, u, v, b, out=o, persistent=p, pv="launch", pv_plan=pp
      )
    if kind == "persistent_planned":  # the wrapper's own plan (pv="xla" on
      # planner.plan_decode_phase1's tiles from pv_xla_min_m rows)
      fn = lambda x, u, v, b, o: xuv_decode.xuv_decode(x, u, v, b)
    if kind == "persistent_xla_zeroing":  # the default: scratch zeroed by XLA, no out=
      fn = lambda x, u, v, b, o: xuv_decode._xuv_decode(x, u, v, b, persistent=p)
  else:
    bs = xuv_decode.TiledBlockSizes.get_default(m, k, r, n)
    if kind == "decode_small_blocks":  # many ragged r-chunks and column blocks
      bs = dataclasses.replace(bs, block_r=32, split_k=3, block_n=32, block_kv=32, r_chunks=3)
    fn = lambda x, u, v, b, o: xuv_decode._xuv_decode(x, u, v, b, out=o, block_sizes=bs)
  out = jax.jit(fn)(x, u, v, b, poisoned((m, n), dtype))
  assert_close(out, xuv_ref(x, u, v, b, dtype), dtype)


GROUP_CASES = [  # (M, K, [(r_i, N_i)], members with a bias): Llama-3-8B q/k/v at 40 % removed,
  (8, 4096, [(1216, 4096), (512, 1024), (512, 1024)], (1,)),  # ragged pairs, tiny ranks
  (1, 1000, [(96, 520), (72, 130)], (0, 1)),
  (5, 64, [(16, 32), (7, 20), (1, 48)], ()),
  (16, 512, [(136, 200), (64, 64), (256, 100)], (2,)),
  (32, 4096, [(1216, 4096), (512, 1024), (512, 1024)], (0,)),  # 32 and 64 rows (8 warps)
  (64, 512, [(136, 200), (64, 64), (256, 100)], (1,)),
  (4, 8192, [(2432, 8192), (576, 1024), (576, 1024)], ()),  # Llama-3-70B, Qwen2.5-7B
  (16, 3584, [(1088, 3584), (256, 512), (256, 512)], (0,)),  # (ragged 224-column U tiles)
]


def _group_inputs(case, dtype):
  """(x, members) of a GROUP_CASES-style case: fresh factors, a bias where the case says."""
  m, k, mem, biased = case
  members = []
  for i, (r, n) in enumerate(mem):
    u, v = lr_factors(k, r, n, dtype)
    members.append((u, v, randn((n,), dtype)) if i in biased else (u, v))
  return randn((m, k), dtype), members


def _check_group(outs, x, members, dtype):
  assert len(outs) == len(members)
  for out, mb in zip(outs, members):
    assert_close(out, xuv_ref(x, mb[0], mb[1], mb[2] if len(mb) == 3 else None, dtype), dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("case", GROUP_CASES)
@pytest.mark.parametrize("grid", ["planned", "small", "wide_rows"])
def test_xuv_decode_group(case, dtype, grid):
  """Several X·U_i·V_i sharing X in one launch; each output poisoned, against the reference."""
  from lrjax.custom_calls.triton import xuv_decode_group

  m, k, mem, _ = case
  x, members = _group_inputs(case, dtype)
  wide = dict(min_row_bytes=512) if grid == "wide_rows" else {}  # V_i's tiles >= 256 columns
  plan = planner.plan_decode_group(m, k, mem, programs=7 if grid == "small" else None, **wide)
  outs = jax.jit(lambda x, ms, o: xuv_decode_group._xuv_decode_group(x, ms, out=o, plan=plan))(
    x, members, [poisoned((m, n), dtype) for _, n in mem]
  )
  _check_group(outs, x, members, dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
  "case",
  GROUP_CASES[:4]
  + [
    (65, 4100, [(2560, 1000), (2560, 1000)], (1,)),  # the composed MLP's gate and up, ragged
    (128, 4096, [(2560, 14336), (2560, 14336)], ()),  # Llama-3-8B's gate and up at 128 rows
    (100, 1000, [(200, 130), (72, 520), (40, 64)], (0, 2)),
  ],
)
@pytest.mark.parametrize("grid", ["planned", "small"])
@pytest.mark.parametrize("one", [False, True])
def test_xuv_decode_group_phase1_alone(case, dtype, grid, one):
  """``pv="xla"``: every member's X·U_i in one launch (up to 128 rows), then XLA's GEMMs;
  ``one``: members of one rank through the kernel's one phase-1 call site (one_branch)."""
  from lrjax.custom_calls.triton import xuv_decode_group

  m, k, mem, _ = case
  if one and len({r for r, _ in mem}) > 1:
    pytest.skip("one_branch: members of one rank only")
  x, members = _group_inputs(case, dtype)
  plan = planner.plan_decode_group_phase1(
    m, k, mem, programs=7 if grid == "small" else None, one_branch=one
  )
  outs = jax.jit(lambda x, ms: xuv_decode_group._xuv_decode_group(x, ms, plan=plan, pv="xla"))(
    x, members
  )
  _check_group(outs, x, members, dtype)


def test_xuv_decode_group_checks_its_input():
  from lrjax.custom_calls.triton import xuv_decode_group

  x = randn((2, 64), jnp.bfloat16)
  u, v = lr_factors(64, 16, 32, jnp.bfloat16)
  with pytest.raises(ValueError, match="2 or 3"):
    xuv_decode_group.xuv_decode_group(x, [(u, v)])
  with pytest.raises(ValueError, match="M <= 64"):
    xuv_decode_group.xuv_decode_group(randn((65, 64), jnp.bfloat16), [(u, v), (u, v)])
  with pytest.raises(ValueError, match="bias"):
    xuv_decode_group.xuv_decode_group(x, [(u, v, randn((31,), jnp.bfloat16)), (u, v)])


@pytest.mark.parametrize("dynamic", [False, True])  # tiles round-robin / from a counter
def test_xuv_prefill_ring_reuse_and_small_grid(dynamic):
  """More super-blocks than ring slots and fewer CTAs than tiles: slot reuse waits."""
  from lrjax.custom_calls.triton import xuv_prefill

  dtype = jnp.bfloat16
  m, k, r, n = 1100, 256, 192, 320
  x = randn((m, k), dtype)
  u, v = lr_factors(k, r, n, dtype)
  bs = xuv_prefill.BlockSizes(128, 64, 64, 1, 2, 4, 3, 7, dynamic)
  out = jax.jit(lambda x, u, v, o: xuv_prefill.xuv_prefill(x, u, v, out=o, block_sizes=bs))(
    x, u, v, poisoned((m, n), dtype)
  )
  assert_close(out, xuv_ref(x, u, v, None, dtype), dtype)


ACT = {
  "silu": lambda t: t / (1 + np.exp(-t)),
  "relu": lambda t: np.maximum(t, 0),
  "gelu_tanh": lambda t: 0.5 * t * (1 + np.tanh(0.7978845608028654 * (t + 0.044715 * t**3))),
}


def mlp_ref(x, gate, up, down, act, dtype):
  def xuv(a, p):
    return xuv_ref(a, p[0], p[1], p[2] if len(p) == 3 else None, dtype)

  h = ACT[act](xuv(x, gate)) * xuv(x, up) if gate is not None else ACT[act](xuv(x, up))
  return xuv(rnd(h, dtype), down)


def mlp_params(d, f, r, rd, d_out, dtype, gated, bias):
  def proj(k, rr, n):
    u, v = lr_factors(k, rr, n, dtype)
    return (u, v, randn((n,), dtype)) if bias else (u, v)

  return (proj(d, r, f) if gated else None), proj(d, r, f), proj(f, rd, d_out)


MLP_SHAPES = [  # (M, D, F, r, r_d)
  (1, 200, 520, 72, 40),
  (5, 512, 1000, 96, 136),
  (16, 1024, 2816, 256, 256),
  (64, 320, 1000, 200, 72),
  (128, 256, 704, 128, 128),
  (300, 512, 1400, 256, 192),
  (2, 1024, 2000, 2304, 2048),  # r >= 2048: the tuned large-rank configs
  (3, 256, 12900, 64, 72),  # D_ff wide enough for 128-column stage-B slices, ragged
  (1, 512, 1024, 16, 24),
  (2, 48, 100, 8, 8),  # ranks <= 32 (TP-8 shards); D <= 64
]


@pytest.mark.parametrize(
  "dtype,gated,act,bias",
  [
    (jnp.bfloat16, True, "silu", False),
    (jnp.float16, True, "gelu_tanh", True),
    (jnp.bfloat16, False, "relu", True),
  ],
)
@pytest.mark.parametrize("shape", MLP_SHAPES)
@pytest.mark.parametrize(
  "kind",
  [
    "decode",
    "decode_xla_zeroing",
    "decode_p16",
    "decode_park_h",
    "decode_cols_f",
    "decode_h_inline",
    "decode_prefetch",
    "persistent",
    "persistent_small_grid",
    "persistent_small_grid_p16",
    "persistent_wide_rows",
    "compose",
    "prefill",
  ],
)
def test_mlp_kernels(kind, shape, dtype, gated, act, bias):
  from lrjax.custom_calls.triton import mlp_decode, mlp_prefill

  m, d, f, r, rd = shape
  if kind.startswith(("decode", "compose")) and m > mlp_decode.MAX_M:
    pytest.skip(f"decode kernel serves M <= {mlp_decode.MAX_M}")
  if kind.startswith("persistent") and m > mlp_decode.PERSISTENT_MAX_M:
    pytest.skip(f"persistent schedule serves M <= {mlp_decode.PERSISTENT_MAX_M}")
  gate, up, down = mlp_params(d, f, r, rd, d, dtype, gated, bias)
  x = randn((m, d), dtype)
  kern = mlp_prefill.mlp_prefill if kind == "prefill" else mlp_decode._mlp_decode
  if kind == "decode_xla_zeroing":  # the default: scratch zeroed by XLA, no out= buffer
    # (from compose_min_m rows the default is the composed schedule)
    out = jax.jit(lambda x, g, u, dn: mlp_decode.mlp_decode(x, u, dn, g, act=act))(
      x, gate, up, down
    )
  elif kind == "compose":  # X·U·V decode calls (the default from compose_min_m rows)
    out = jax.jit(lambda x, g, u, dn, o: kern(x, u, dn, g, act=act, out=o, compose=True))(
      x, gate, up, down, poisoned((m, d), dtype)
    )
  elif kind.startswith("persistent"):
    # >= 128 columns (512 bytes, before phase B was capped at 128 columns, overflowed shared
    # memory at M=64 and at r=2304)
    wide = dict(min_row_bytes=256) if kind == "persistent_wide_rows" else {}
    p = planner.plan_mlp_decode_persistent(m, d, f, r, rd, d, gate is not None, **wide)
    if kind.startswith("persistent_small_grid"):  # several ragged, part-width tiles per CTA
      p = dataclasses.replace(
        p,
        block_r=64,
        cols_r=32,
        k_per=128,
        block_f=64,
        cols_f=48,
        block_n=64,
        cols_n=48,
        c_chunks=3,
        programs=5,
        prefetch=16,
      )
    if kind.endswith("_p16"):  # phase B reads Pg, Pu rounded once by each block's last tile
      p = dataclasses.replace(p, p16=True)
    out = jax.jit(lambda x, g, u, dn, o: kern(x, u, dn, g, act=act, out=o, persistent=p))(
      x, gate, up, down, poisoned((m, d), dtype)
    )
  else:
    bs, var = None, None
    if kind == "decode_p16":  # stage B reads Pg, Pu rounded once by each block's last tile
      bs = dataclasses.replace(mlp_decode.BlockSizes.get_default(m, d, f, r, d), p16=True)
    if kind == "decode_park_h":  # h parked, projected by stage H in 3 splits of 64 columns
      bs = dataclasses.replace(
        mlp_decode.BlockSizes.get_default(m, d, f, r, d), park_h=True, block_h=64, h_splits=3
      )
    if kind == "decode_h_inline":  # h parked; stage-B CTAs project their split's h
      bs = dataclasses.replace(
        mlp_decode.BlockSizes.get_default(m, d, f, r, d), park_h=True, block_h=64
      )
      var = mlp_decode.Variant(h_inline=True)
    if kind == "decode_prefetch":  # h parked; L2 prefetch before every stage's first wait
      bs = dataclasses.replace(
        mlp_decode.BlockSizes.get_default(m, d, f, r, d),
        park_h=True,
        block_h=64,
        h_splits=3,
      )
      var = mlp_decode.Variant(prefetch=64, prefetch_h=32, prefetch_c=16)
    if kind == "decode_cols_f":  # stage-B slices own 16 columns fewer than their block
      bs = mlp_decode.BlockSizes.get_default(m, d, f, r, d)
      var = mlp_decode.Variant(cols_f=bs.block_f - 16)
    fused = {} if kind == "prefill" else dict(compose=False, variant=var)
    out = jax.jit(
      lambda x, g, u, dn, o: kern(x, u, dn, g, act=act, out=o, block_sizes=bs, **fused)
    )(x, gate, up, down, poisoned((m, d), dtype))
  assert_close(out, mlp_ref(x, gate, up, down, act, dtype), dtype)


@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("shape", [(4096, 14336, 2560), (8192, 28672, 3824)])
def test_mlp_persistent_plans_of_llama_shapes(shape, m):
  """The planner's own persistent plan for Llama-3-8B's and -70B's SwiGLU at 40 % removed
  launches (it once asked for more shared memory than a CTA has: at 70B, and with 128-column
  phase-B slices at 64 rows) and is right."""
  from lrjax.custom_calls.triton import mlp_decode

  d, f, r = shape
  dtype = jnp.bfloat16
  gate, up, down = mlp_params(d, f, r, r, d, dtype, True, False)
  x = randn((m, d), dtype)
  out = jax.jit(lambda x, g, u, dn: mlp_decode._mlp_decode(x, u, dn, g, persistent=True))(
    x, gate, up, down
  )
  assert_close(out, mlp_ref(x, gate, up, down, "silu", dtype), dtype)


@pytest.mark.parametrize(
  "shape,m,park_h",
  [
    *[((4096, 14336, 2560), m, park) for m in (1, 32, 128) for park in (False, True)],
    ((3584, 18944, 2048), 1, False),
    ((3584, 18944, 2048), 16, False),
    ((3584, 18944, 2048), 1, True),
    ((3584, 18944, 2048), 16, True),
    *[
      (shape, m, "inline")
      for shape in ((4096, 14336, 2560), (3584, 18944, 2048), (8192, 28672, 3840))
      for m in (1, 16)
    ],
    ((8192, 28672, 3840), 32, True),
    ((8192, 28672, 3840), 64, True),
  ],
)
def test_mlp_decode_tiles_of_llama_shapes(shape, m, park_h):
  """The tiled decode kernel's default blocks at Llama-3-8B's SwiGLU (40 % removed), h parked
  or not, launch at 1-128 tokens (shared memory, registers) and are right; and at
  Qwen2.5-7B's, whose 148 stage-B slices (more than the SMs) take narrower U_d chunks
  unparked, and parked (the default) stage H in about four tiles an SM; at Llama-3-70B's
  at 32 and 64 tokens, the wide rule's blocks (256-column stage-H tiles, 5 stages at 32).
  "inline": h parked and projected by the stage-B CTAs, 256 r_d columns a tile (splits of
  10-19 slices that wait for each other)."""
  from lrjax.custom_calls.triton import mlp_decode

  d, f, r = shape
  dtype = jnp.bfloat16
  gate, up, down = mlp_params(d, f, r, r, d, dtype, True, False)
  x = randn((m, d), dtype)
  inline = dict(block_h=256) if park_h == "inline" else {}
  var = mlp_decode.Variant(h_inline=True) if park_h == "inline" else None
  # unparked at T <= 16: the unparked blocks (5 stages with h not parked would ask for 282 KB
  # of shared memory)
  bs = dataclasses.replace(
    mlp_decode._default_blocks(m, d, f, r, d, park_small=bool(park_h)),
    park_h=bool(park_h),
    **inline,
  )
  out = jax.jit(
    lambda x, g, u, dn: mlp_decode._mlp_decode(x, u, dn, g, block_sizes=bs, variant=var)
  )(x, gate, up, down)
  assert_close(out, mlp_ref(x, gate, up, down, "silu", dtype), dtype)


@pytest.mark.parametrize("m", [65, 128])
@pytest.mark.parametrize("shape", [(4096, 14336, 2560), (8192, 28672, 3824)])
def test_mlp_decode_composes_xuv_calls_from_65_rows(shape, m):
  """From compose_min_m rows mlp_decode's default is X·U·V decode calls (X·Ug and X·Uu in one
  grouped launch, then ·Ud: phase 1 alone each, XLA's GEMMs apply the V factors) and XLA's
  activation fusion, not the fused kernel: two Triton calls in the compiled module (three
  with gate and up as two calls). Right at Llama-3-8B's and -70B's SwiGLU."""
  from lrjax.custom_calls.triton import mlp_decode

  assert policy.values("mlp_decode").compose_min_m == 65
  d, f, r = shape
  dtype = jnp.bfloat16
  gate, up, down = mlp_params(d, f, r, r, d, dtype, True, False)
  x = randn((m, d), dtype)
  for group, calls in ((True, 2), (False, 3)):
    fn = (
      jax.jit(
        lambda x, g, u, dn, group=group: mlp_decode._mlp_decode(x, u, dn, g, compose_group=group)
      )
      .lower(x, gate, up, down)
      .compile()
    )
    assert _count_triton_calls(fn.as_text()) == calls, group
    assert_close(fn(x, gate, up, down), mlp_ref(x, gate, up, down, "silu", dtype), dtype)


def test_block_sizes_beyond_shared_memory_are_refused_at_lowering():
  """Blocks whose compiled kernel asks for more shared memory than the GPU allows raise a
  ValueError when the call is lowered, naming the kernel and both sizes (CUDA itself would
  only refuse the launch). h not parked with 5 stages at 16 tokens asks for 282 KB."""
  from lrjax.custom_calls.triton import mlp_decode

  d, f, r, m = 4096, 14336, 2560, 16
  dtype = jnp.bfloat16
  gate, up, down = mlp_params(d, f, r, r, d, dtype, True, False)
  x = randn((m, d), dtype)
  fits = mlp_decode.BlockSizes.get_default(m, d, f, r, d)
  assert fits.park_h and fits.num_stages == 5
  for bs, ok in ((dataclasses.replace(fits, park_h=False), False), (fits, True)):
    fn = jax.jit(lambda x, g, u, dn, bs=bs: mlp_decode.mlp_decode(x, u, dn, g, block_sizes=bs))
    if ok:
      assert_close(fn(x, gate, up, down), mlp_ref(x, gate, up, down, "silu", dtype), dtype)
    else:
      with pytest.raises(
        ValueError,
        match=r"_mlp_decode_kernel \(num_warps=4, num_stages=5\)"
        r" needs \d+ bytes of shared memory per CTA, more than the 232448",
      ):
        fn.lower(x, gate, up, down)


# block_n_cd 128: wider phase-C/D tiles than A/B's; wide_b: phase B in those tiles, two
# passes; dynamic: tiles claimed from a counter; split_c: phase C's reduction in chunks
# (the per-tile accumulators and chunk counters are reused by later row blocks)
@pytest.mark.parametrize(
  "block_n_cd,wide_b,dynamic,split_c,gated,bias",
  [
    (0, False, False, 1, True, False),
    (128, False, False, 1, True, False),
    (128, True, False, 1, True, False),
    (128, True, True, 3, True, True),
    (0, True, True, 1, False, True),
    (0, False, True, 2, True, False),
    (0, False, False, 4, True, False),
  ],
)
def test_mlp_prefill_ring_reuse(block_n_cd, wide_b, dynamic, split_c, gated, bias):
  from lrjax.custom_calls.triton import mlp_prefill

  dtype = jnp.bfloat16
  m, d, f, r = 700, 328, 640, 136  # r_d and D_out not multiples of 128
  gate, up, down = mlp_params(d, f, r, r, d, dtype, gated, bias)
  x = randn((m, d), dtype)
  bs = mlp_prefill.BlockSizes(64, 64, 64, 2, 2, 4, 3, 11, block_n_cd, wide_b, dynamic, split_c)
  act = "silu" if gated else "gelu_tanh"
  out = jax.jit(
    lambda x, g, u, dn, o: mlp_prefill.mlp_prefill(x, u, dn, g, act=act, out=o, block_sizes=bs)
  )(x, gate, up, down, poisoned((m, d), dtype))
  assert_close(out, mlp_ref(x, gate, up, down, act, dtype), dtype)


def _count_triton_calls(compiled_text):
  from lrjax.custom_calls.triton import launch

  return launch.count_calls(compiled_text)


@pytest.mark.parametrize("m", [1, 300])
def test_lr_primitives_lower_to_triton(m):
  """jax.jit of lrjax.lowering.lr_xuv / lr_mlp on GPU emits the Triton custom calls."""
  import lrjax

  dtype = jnp.bfloat16
  x = randn((m, 512), dtype)
  u, v = lr_factors(512, 128, 768, dtype)
  b = randn((768,), dtype)
  gate, up, down = mlp_params(512, 1024, 128, 128, 512, dtype, True, False)
  with lrjax.lowering.prefer_kernels():  # serve even where measured slower than XLA
    f = jax.jit(lambda x, u, v, b: lrjax.lowering.lr_xuv(x, u, v, b)).lower(x, u, v, b).compile()
    g = (
      jax.jit(lambda x, gate, up, down: lrjax.lowering.lr_mlp(x, up, down, gate))
      .lower(x, gate, up, down)
      .compile()
    )
  assert _count_triton_calls(f.as_text()) == 1, f.as_text()[:2000]
  assert_close(f(x, u, v, b), xuv_ref(x, u, v, b, dtype), dtype)
  assert _count_triton_calls(g.as_text()) == 1
  assert_close(g(x, gate, up, down), mlp_ref(x, gate, up, down, "silu", dtype), dtype)


def test_kernels_launch_through_the_typed_ffi_call(monkeypatch):
  """The kernels lower to jaxlib's command-buffer-compatible triton_kernel_call_ffi;
  LRJAX_TRITON_LEGACY_CALL=1 keeps jax-triton's legacy call. Same results either way."""
  import lrjax
  from lrjax.custom_calls.triton import launch

  dtype = jnp.bfloat16
  x = randn((5, 512), dtype)
  u, v = lr_factors(512, 128, 768, dtype)
  texts, outs = {}, {}
  monkeypatch.setenv("LRJAX_TRITON_LAUNCH", "jaxlib")
  for legacy in ("0", "1"):
    monkeypatch.setenv("LRJAX_TRITON_LEGACY_CALL", legacy)
    with lrjax.lowering.prefer_kernels():
      f = jax.jit(lambda x, u, v: lrjax.lowering.lr_xuv(x, u, v)).lower(x, u, v).compile()
    texts[legacy], outs[legacy] = f.as_text(), f(x, u, v)
  assert texts["0"].count(f'custom_call_target="{launch.FFI_TARGET}"') == 1
  assert f'custom_call_target="{launch.LEGACY_TARGET}"' not in texts["0"]
  assert texts["1"].count(f'custom_call_target="{launch.LEGACY_TARGET}"') == 1
  assert launch.FFI_TARGET not in texts["1"]
  ref = xuv_ref(x, u, v, None, dtype)
  for y in outs.values():
    assert_close(y, ref, dtype)


def test_other_jax_triton_calls_keep_their_own_lowering():
  """Registering lrjax's rule must not change a user's own jax_triton.triton_call."""
  import jax_triton as jt
  import triton
  import triton.language as tl
  from lrjax.custom_calls.triton import launch  # noqa: F401  (registers the rule)

  @triton.jit
  def _double(x_ptr, n, o_ptr, BLOCK: tl.constexpr):  # inputs, then the output
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(o_ptr + i, 2 * tl.load(x_ptr + i, mask=i < n), mask=i < n)

  x = randn((1000,), jnp.float32)
  f = jax.jit(
    lambda x: jt.triton_call(
      x,
      x.size,
      kernel=_double,
      grid=(8,),
      BLOCK=128,
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
    )
  )
  text = f.lower(x).compile().as_text()
  assert 'custom_call_target="triton_kernel_call"' in text and "triton_kernel_call_ffi" not in text
  np.testing.assert_array_equal(np.asarray(f(x)), 2 * np.asarray(x))


def test_many_decode_calls_in_one_jit_each_start_from_zeroed_scratch():
  """The decode kernels' scratch (counters, split-K sums) must be zero at each launch; in
  one jit the twelve independent calls share one chained buffer (launch.py), each zeroing
  the half the call before it used."""
  import lrjax

  dtype = jnp.bfloat16
  x = randn((3, 512), dtype)
  xuvs = [lr_factors(512, 128, 768, dtype) for _ in range(6)]
  mlps = [mlp_params(512, 1024, 128, 128, 512, dtype, True, False) for _ in range(6)]

  def many(x, xuvs, mlps):
    return [lrjax.lowering.lr_xuv(x, u, v) for u, v in xuvs] + [
      lrjax.lowering.lr_mlp(x, up, down, gate) for gate, up, down in mlps
    ]

  with lrjax.lowering.prefer_kernels():
    f = jax.jit(many).lower(x, xuvs, mlps).compile()
  assert _count_triton_calls(f.as_text()) == 12
  for _ in range(2):  # the second run reuses the first one's buffers
    outs = f(x, xuvs, mlps)
    for y, (u, v) in zip(outs[:6], xuvs):
      assert_close(y, xuv_ref(x, u, v, None, dtype), dtype)
    for y, (gate, up, down) in zip(outs[6:], mlps):
      assert_close(y, mlp_ref(x, gate, up, down, "silu", dtype), dtype)


def _scratch_sizes(compiled_text):
  """The f32 scratch output (result 0) of each Triton call in a compiled module, in floats."""
  import re

  targets = "|".join(
    re.escape(t)
    for t in (
      launch_modes.LEGACY_TARGET,
      launch_modes.FFI_TARGET,
      launch_modes.LAUNCH_TARGET,
      launch_modes.XLA_TARGET,
      launch_modes.XLA_TRITON_TARGET,
    )
  )
  return [
    int(n)
    for n in re.findall(
      r"= \(f32\[(\d+)\]\{0\}[^\n]*custom_call_target=\"(?:" + targets + r")\"", compiled_text
    )
  ]


@pytest.mark.parametrize("overlap", ["0", "1"])
@pytest.mark.parametrize("mode", ["jaxlib", "lrjax", "pdl", "xla", "xla_triton"])
def test_launchers_agree(monkeypatch, mode, overlap):
  """LRJAX_TRITON_LAUNCH: jaxlib's handler, lrjax's (pdl_launch.cc) with plain launches,
  lrjax's with the chained decode kernels as programmatic dependents (they then wait on the
  grid dependency first), XLA's own PTX call (each kernel compiled with every scalar a
  constant, launched by XLA), or XLA's Triton call for the persistent X·U·V decode calls
  launch_modes.xla_triton_serves names (here the three V-resident ones; XLA's Triton compiles
  their TTIR; the rest keep the PTX call). A chain of data-dependent decode calls of every
  chained kernel (two calls of one kernel in the chain's two halves; the X·U·V kernel's
  scratch zeroed by its phase-1 CTAs (V-resident) and by its CTAs with no phase-2 tile), an
  independent one, a prefill call (no PDL constexpr) and a call whose scratch jax-triton
  zeroes before the launch (the handler's memset; a plain launch, so under "pdl" the last two
  stay with jaxlib's handler, and under "xla" both calls that take a memset, the prefill
  kernel's counters among them): each output matches the reference on two runs, and the HLO
  names the handler each mode promises. With LRJAX_TRITON_PDL_OVERLAP=1 each kernel launched
  as a programmatic dependent lets the next launch start once its own wait is over and
  prefetches its first tile before it: the same outputs and handlers."""
  import re

  import lrjax
  from lrjax.custom_calls.triton import launch, xuv_decode
  from lrjax.lowering import lr_xuv_group

  monkeypatch.setenv("LRJAX_TRITON_LAUNCH", mode)
  monkeypatch.setenv("LRJAX_TRITON_PDL_OVERLAP", overlap)
  dtype = jnp.bfloat16
  xuvs = [lr_factors(512, r, n, dtype) for r, n in ((128, 512), (200, 1000), (72, 512))]
  group = [lr_factors(512, r, n, dtype) for r, n in ((96, 512), (48, 130), (48, 130))]
  mlp = mlp_params(512, 1408, 128, 96, 512, dtype, True, True)
  big = lr_factors(512, 96, 264, dtype)
  wide = lr_factors(1000, 320, 264, dtype)

  def step(x, xp, xuvs, group, mlp, big, wide, o):
    a = lrjax.lowering.lr_xuv(x, *xuvs[0])
    q, k, v = lr_xuv_group(a, group)
    b = lrjax.lowering.lr_mlp(q, mlp[1], mlp[2], mlp[0])
    c = lrjax.lowering.lr_xuv(b, *xuvs[1])  # N=1000: ragged column blocks
    # 12 phase-2 tiles: the CTAs with none zero the scratch half the next call works in
    g = lrjax.lowering.lr_xuv(c, *wide)
    d = lrjax.lowering.lr_xuv(x, *xuvs[2])  # independent of the others
    e = lrjax.lowering.lr_xuv(xp, *big)  # 300 rows: the prefill kernel
    f = xuv_decode._xuv_decode(
      d, big[0], big[1][:, :200], out=o, persistent=False, xla_zeroing=False
    )  # tiled; jax-triton zeroes its scratch
    return a, q, k, v, b, c, g, d, e, f

  def refs(x, xp):
    a = xuv_ref(x, *xuvs[0], None, dtype)
    q, k, v = (xuv_ref(rnd(a, dtype), u, w, None, dtype) for u, w in group)
    b = mlp_ref(rnd(q, dtype), mlp[0], mlp[1], mlp[2], "silu", dtype)
    c = xuv_ref(rnd(b, dtype), *xuvs[1], None, dtype)
    d = xuv_ref(x, *xuvs[2], None, dtype)
    return (
      a,
      q,
      k,
      v,
      b,
      c,
      xuv_ref(rnd(c, dtype), *wide, None, dtype),
      d,
      xuv_ref(xp, *big, None, dtype),
      xuv_ref(rnd(d, dtype), big[0], big[1][:, :200], None, dtype),
    )

  x, xp = randn((3, 512), dtype), randn((300, 512), dtype)
  with lrjax.lowering.prefer_kernels():
    f = jax.jit(step).lower(x, xp, xuvs, group, mlp, big, wide, poisoned((3, 200), dtype)).compile()
  text = f.as_text()
  ours = text.count(f'custom_call_target="{launch.LAUNCH_TARGET}"')
  jaxlibs = text.count(f'custom_call_target="{launch.FFI_TARGET}"')
  pdl = len(re.findall(r"pdl\s*=\s*true", text))
  xla = text.count(f'custom_call_target="{launch_modes.XLA_TARGET}"')
  xla_triton = text.count(f'custom_call_target="{launch_modes.XLA_TRITON_TARGET}"')
  assert (ours, jaxlibs, pdl, xla, xla_triton) == {
    "jaxlib": (0, 8, 0, 0, 0),
    "lrjax": (8, 0, 0, 0, 0),
    "pdl": (6, 2, 6, 0, 0),
    "xla": (0, 2, 0, 6, 0),
    "xla_triton": (0, 2, 0, 3, 3),
  }[mode], (ours, jaxlibs, pdl, xla, xla_triton)
  for _ in range(2):  # the second run on the first one's buffers
    outs = f(x, xp, xuvs, group, mlp, big, wide, poisoned((3, 200), dtype))
    for got, want in zip(outs, refs(x, xp)):
      assert_close(got, want, dtype, factor=2.0)


@pytest.mark.parametrize(
  "shape",
  [
    (64, 1000, 2560, 8200),
    (100, 320, 256, 384),
    (128, 4096, 1024, 1000),
    (64, 384, 136, 200),
    (100, 4100, 2456, 1000),
  ],
)
def test_wide_decode_plans_through_xlas_triton_call(monkeypatch, shape):
  """LRJAX_TRITON_LAUNCH=xla_triton at 64-128 rows: the wrapper's own plan (phase 1 alone,
  then XLA's GEMM or the ·V launch, where xuv_decode.default_pv says so) goes to XLA's Triton
  call exactly where launch_modes.xla_triton_serves names it (the ·V launch always; phase 1 on 112
  of 128 columns a tile, the last shape, not), and the output (with a bias) matches the
  reference."""
  from lrjax.custom_calls.triton import xuv_decode

  monkeypatch.setenv("LRJAX_TRITON_LAUNCH", "xla_triton")
  m, k, r, n = shape
  dtype = jnp.bfloat16
  x, b = randn((m, k), dtype), randn((n,), dtype)
  u, v = lr_factors(k, r, n, dtype)
  pv, _, launch = xuv_decode.default_persistent_launch(m, k, r, n, True, xuv_decode.num_sms())
  serves = launch_modes.xla_triton_serves(
    xuv_decode._xuv_decode_persistent_kernel.__name__, launch["meta"]
  )
  if r == 2456:  # phase1_balance_cols: XLA's PTX call
    assert launch["meta"]["COLS_R"] == 112 and not serves
  f = jax.jit(lambda x, u, v, b: xuv_decode.xuv_decode(x, u, v, b)).lower(x, u, v, b).compile()
  want = serves + (pv == "launch")  # the ·V launch: XLA's Triton call too
  assert f.as_text().count(f'custom_call_target="{launch_modes.XLA_TRITON_TARGET}"') == want, pv
  for _ in range(2):
    assert_close(f(x, u, v, b), xuv_ref(x, u, v, b, dtype), dtype)


@pytest.mark.parametrize("mode", ["jaxlib", "lrjax"])
@pytest.mark.parametrize(
  "cfg",
  [
    dict(),
    dict(programs=7),
    dict(warps=4, ws=True),
    dict(warps=4, ws=True, programs=5, bn=128, stages=4),
  ],
  ids=["tiles", "persistent", "ws", "ws-persistent"],
)
@pytest.mark.parametrize("mkn", [(1, 136, 264), (333, 520, 1000)], ids=["M1", "ragged"])
def test_tma_and_warp_specialized_kernels_launch_through_lrjax(monkeypatch, mode, cfg, mkn):
  """A kernel that builds TMA descriptors on the device (Triton's global scratch, 128 bytes a
  descriptor a CTA) and one Triton warp-specialized (12 warps launched for num_warps=4): both
  go to lrjax's launcher under every mode, which passes the scratch and the warps; jaxlib's
  could do neither (tma_gemm.gemm_tma, a test helper). The poisoned output matches the f64
  product on fresh inputs, M=1 and sizes no block divides, twice on one executable."""
  import os
  from lrjax.custom_calls.triton import launch

  monkeypatch.syspath_prepend(os.path.dirname(os.path.abspath(__file__)))
  import tma_gemm

  monkeypatch.setenv("LRJAX_TRITON_LAUNCH", mode)
  m, k, n = mkn
  dtype = jnp.bfloat16
  a, b = randn((m, k), dtype), randn((k, n), dtype, k**-0.5)
  f = (
    jax.jit(lambda a, b, o: tma_gemm.gemm_tma(a, b, out=o, **cfg))
    .lower(a, b, poisoned((m, n), dtype))
    .compile()
  )
  text = f.as_text()
  assert text.count(f'custom_call_target="{launch.LAUNCH_TARGET}"') == 1
  image = launch._recorded()[2]  # the kernel this lowering compiled
  assert image.scratch >= 3 * 128 and image.num_warps == (12 if cfg.get("ws") else 8), image
  for _ in range(2):
    got = f(a, b, poisoned((m, n), dtype))
    assert_close(got, f64(a) @ f64(b), dtype)


@pytest.mark.parametrize("min_half", [None, 4096])
def test_decode_calls_share_a_chained_scratch(monkeypatch, min_half):
  """The decode calls of one block run on one chained scratch buffer (launch.py): each
  zeroes the half the call before it used. Data-dependent and independent calls of every
  decode kernel, at 1, 3 and 16 rows, and a loop body (its own chain); with a small half
  (min_half) the calls whose scratch does not fit start new chains. Every output matches
  the reference on two runs, and LRJAX_TRITON_SCRATCH_CHAIN=0 gives each call its own."""
  import lrjax
  from lrjax.lowering import lr_xuv_group

  if min_half:
    monkeypatch.setattr(launch_modes, "SCRATCH_MIN_HALF", min_half)
  dtype = jnp.bfloat16
  xuvs = [lr_factors(512, r, n, dtype) for r, n in ((128, 512), (200, 1000), (72, 512))]
  group = [lr_factors(512, r, n, dtype) for r, n in ((96, 512), (48, 130), (48, 130))]
  mlp = mlp_params(512, 1408, 128, 96, 512, dtype, True, True)

  def step(x, xuvs, group, mlp):
    a = lrjax.lowering.lr_xuv(x, *xuvs[0])
    q, k, v = lr_xuv_group(a, group)
    b = lrjax.lowering.lr_mlp(q, mlp[1], mlp[2], mlp[0])
    c = lrjax.lowering.lr_xuv(b, *xuvs[1])  # N=1000: ragged column blocks
    d = lrjax.lowering.lr_xuv(x, *xuvs[2])  # independent of the others
    return a, q, k, v, b, c, d

  def refs(x):
    a = xuv_ref(x, *xuvs[0], None, dtype)
    q, k, v = (xuv_ref(rnd(a, dtype), u, w, None, dtype) for u, w in group)
    b = mlp_ref(rnd(q, dtype), mlp[0], mlp[1], mlp[2], "silu", dtype)
    c = xuv_ref(rnd(b, dtype), *xuvs[1], None, dtype)
    return a, q, k, v, b, c, xuv_ref(x, *xuvs[2], None, dtype)

  def looped(x, xuvs, group, mlp):  # the step's calls in a loop body: a chain of its own
    return jax.lax.fori_loop(0, 3, lambda i, y: step(y, xuvs, group, mlp)[1], x)

  for m in (1, 3, 16):
    x = randn((m, 512), dtype)
    with lrjax.lowering.prefer_kernels():
      f = jax.jit(step).lower(x, xuvs, group, mlp).compile()
      g = jax.jit(looped).lower(x, xuvs, group, mlp).compile()
    sizes = _scratch_sizes(f.as_text())
    assert len(sizes) == _count_triton_calls(f.as_text()) == 5, sizes
    if min_half is None:  # one chain: one buffer of two default halves
      assert set(sizes) == {2 * launch_modes.SCRATCH_MIN_HALF}, sizes
    else:
      assert all(s % 2048 == 0 and s >= 2 * min_half for s in sizes), sizes
    for _ in range(2):  # the second run on the first one's buffers
      for got, want in zip(f(x, xuvs, group, mlp), refs(x)):
        assert_close(got, want, dtype, factor=2.0)
    y = x
    for _ in range(3):  # the loop, by the step just checked
      y = f(y, xuvs, group, mlp)[1]
    assert_close(g(x, xuvs, group, mlp), f64(y), dtype, factor=2.0)
  monkeypatch.setenv("LRJAX_TRITON_SCRATCH_CHAIN", "0")
  assert launch_modes.chain_scratch() is False
  x = randn((3, 512), dtype)
  with lrjax.lowering.prefer_kernels():  # a new function: jit would reuse step's lowering
    f = jax.jit(lambda *a: step(*a)).lower(x, xuvs, group, mlp).compile()
  sizes = _scratch_sizes(f.as_text())
  assert len(sizes) == 5 and 2 * launch_modes.SCRATCH_MIN_HALF not in sizes, sizes
  for got, want in zip(f(x, xuvs, group, mlp), refs(x)):
    assert_close(got, want, dtype, factor=2.0)


@pytest.mark.parametrize("chain", ["1", "0"])
def test_f32_p_is_read_from_the_calls_own_half_of_the_chain(monkeypatch, chain):
  """Phase 1 alone without p16 (pv="xla"): XLA's GEMM reads the f32 P out of the half of the
  chained scratch the call worked in, and the next call zeroes that half only after the read.
  Three independent calls on one x (both halves, the third back in the first) and one on an
  earlier output, at 64 and 100 rows; two runs; the same with the chain off."""
  from lrjax.custom_calls.triton import xuv_decode

  monkeypatch.setenv("LRJAX_TRITON_SCRATCH_CHAIN", chain)
  dtype = jnp.bfloat16
  facs = [lr_factors(512, r, n, dtype) for r, n in ((128, 512), (200, 1000), (72, 512), (136, 512))]

  def call(x, u, v):
    p = planner.plan_decode_phase1(x.shape[0], *u.shape, v.shape[1])
    return xuv_decode._xuv_decode(x, u, v, persistent=dataclasses.replace(p, p16=False), pv="xla")

  def step(x):
    ys = [call(x, u, v) for u, v in facs[:3]]
    return (*ys, call(ys[0], *facs[3]))

  for m in (64, 100):
    x = randn((m, 512), dtype)
    f = jax.jit(step).lower(x).compile()
    assert _count_triton_calls(f.as_text()) == 4
    for _ in range(2):
      got = f(x)
      want = [xuv_ref(x, u, v, None, dtype) for u, v in facs[:3]]
      want.append(xuv_ref(rnd(want[0], dtype), *facs[3], None, dtype))
      for g, w in zip(got, want):
        assert_close(g, w, dtype, factor=2.0)


def _entry_fusions_with_operands(compiled_text):
  """The fusions (XLA's own kernels) of a compiled module's ENTRY computation that read
  something: all but the zero-filled scratch buffers (``fusion()``, no operands)."""
  entry = compiled_text[compiled_text.index("\nENTRY") :]
  entry = entry[: entry.index("\n}")]
  return entry.count(" fusion(") - entry.count(" fusion()")


@pytest.mark.parametrize("chain", ["1", "0"])
def test_pv_launch_reads_p_where_phase1_left_it(monkeypatch, chain):
  """pv="launch": the ·V launch reads phase 1's f32 P in place, in the chained scratch's half
  (launch._read_in_place) or the call's own scratch: XLA's only kernels are the zero-filled
  scratch buffers (no slice or copy of P). Two data-dependent calls and an independent one
  (both halves of the chain), 64 and 100 rows, a bias; two runs; the same with the chain
  off."""
  from lrjax.custom_calls.triton import xuv_decode

  monkeypatch.setenv("LRJAX_TRITON_SCRATCH_CHAIN", chain)
  dtype = jnp.bfloat16
  facs = [lr_factors(512, r, n, dtype) for r, n in ((128, 512), (200, 1000), (72, 512))]
  b = randn((1000,), dtype)

  def step(x):
    a = xuv_decode._xuv_decode(x, *facs[0], pv="launch")
    c = xuv_decode._xuv_decode(a, *facs[1], b, pv="launch")
    return a, c, xuv_decode._xuv_decode(x, *facs[2], pv="launch")

  for m in (64, 100):
    x = randn((m, 512), dtype)
    f = jax.jit(step).lower(x).compile()
    text = f.as_text()
    assert _count_triton_calls(text) == 6 and _entry_fusions_with_operands(text) == 0, text
    for _ in range(2):
      a, c, d = f(x)
      want_a = xuv_ref(x, *facs[0], None, dtype)
      assert_close(a, want_a, dtype)
      assert_close(c, xuv_ref(rnd(want_a, dtype), *facs[1], b, dtype), dtype, factor=2.0)
      assert_close(d, xuv_ref(x, *facs[2], None, dtype), dtype)


def test_measured_policy_leaves_slower_shapes_to_xla():
  """Where the benchmark measured the kernel slower than XLA, XLA lowers the call (the call
  alone: no whole-model A/B, which at 300 rows would follow the 8B step at batch 128)."""
  import lrjax

  table = policy.current().replace(model_ab=(), model_op_ab=())
  x = randn((300, 512), jnp.bfloat16)
  u, v = lr_factors(512, 128, 768, jnp.bfloat16)
  fn = lambda x, u, v: lrjax.lowering.lr_xuv(x, u, v)
  with policy.use(table.replace(records=(("xuv", 300, 512, 128, 768, 20.0, 10.0),))):
    slow = jax.jit(fn).lower(x, u, v).compile()
  with policy.use(table.replace(records=(("xuv", 300, 512, 128, 768, 10.0, 20.0),))):
    fast = jax.jit(lambda x, u, v: lrjax.lowering.lr_xuv(x, u, v)).lower(x, u, v).compile()
  assert _count_triton_calls(slow.as_text()) == 0
  assert _count_triton_calls(fast.as_text()) == 1
  assert_close(slow(x, u, v), fast(x, u, v), jnp.bfloat16)


def test_fused_model_emits_triton_calls():
  """jax.jit(lrjax.fuse(model)) on a low-rank NNX model: one Triton call per fused op."""
  import lrjax

  nnx = pytest.importorskip("flax.nnx")
  if not hasattr(lrjax, "fuse"):
    pytest.skip("lrjax.fuse is not available")
  from lrjax.nn import LowRankLinear, LowRankMLP

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.mlp = LowRankMLP(
        512, 1408, (128, 128, 128), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs
      )
      self.proj = LowRankLinear(
        512, 768, 96, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs
      )

    def __call__(self, x):
      return self.proj(x + self.mlp(x))

  model = Block(nnx.Rngs(0))
  for m in (1, 200):
    x = randn((m, 512), jnp.bfloat16)
    with lrjax.lowering.prefer_kernels():
      fused = jax.jit(lrjax.fuse(model)).lower(x).compile()
    assert _count_triton_calls(fused.as_text()) == 2, f"M={m}: expected lr_mlp + lr_xuv calls"
    ref = model(x)
    assert_close(fused(x), ref, jnp.bfloat16, factor=2.0)


def test_fuse_group_emits_one_triton_call_for_qkv():
  """jax.jit(lrjax.fuse(f, group=True)) on one GPU: q/k/v sharing x become one grouped call
  (three without group=True); the outputs match the unfused function."""
  import lrjax

  dtype = jnp.bfloat16
  ws = [lr_factors(512, r, n, dtype) for r, n in ((96, 512), (48, 128), (48, 128))]
  x = randn((4, 512), dtype)

  def qkv(x, ws):
    return [x @ u @ v for u, v in ws]

  want = [xuv_ref(x, u, v, None, dtype) for u, v in ws]
  for group, calls in ((True, 1), (False, 3)):
    with lrjax.lowering.prefer_kernels():
      fused = jax.jit(lrjax.fuse(qkv, group=group)).lower(x, ws).compile()
    assert _count_triton_calls(fused.as_text()) == calls, f"{group=}"
    for got, ref in zip(fused(x, ws), want):
      assert_close(got, ref, dtype)


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("sdt", [jnp.bfloat16, jnp.float32])
def test_svd_form_with_sigma_fuses_into_the_kernels(m, sdt):
  """((x @ U) * S) @ Vt on the GPU: lr_xuv with a scale lowers to the decode kernel (phase 1,
  then the scale and ·V by XLA), q/k/v with their own Σ to one grouped call; the results
  match a float64 oracle that rounds as the reference does (x·U to bf16, ·Σ to bf16)."""
  import lrjax

  dtype = jnp.bfloat16
  x = randn((m, 512), dtype)
  ws = [(*lr_factors(512, r, n, dtype), randn((r,), sdt) + 2.0) for r, n in ((96, 512), (48, 128))]

  def oracle(u, v, s):  # with an f32 Σ the scaled product stays f32, and so does y
    p = rnd(f64(x) @ f64(u), dtype)
    return rnd(p * f64(s), jnp.promote_types(dtype, sdt)) @ f64(v)

  def svd(x, ws):
    return [((x @ u) * s) @ v for u, v, s in ws]

  # a group's scales share the factors' dtype: with an f32 Σ the two stay lr_xuv calls
  for group, calls in ((True, 1 if sdt == jnp.bfloat16 else 2), (False, 2)):
    with lrjax.lowering.prefer_kernels():
      fused = jax.jit(lrjax.fuse(svd, group=group)).lower(x, ws).compile()
    assert _count_triton_calls(fused.as_text()) == calls, f"{group=}"
    for got, (u, v, s) in zip(fused(x, ws), ws):
      assert got.dtype == jnp.promote_types(dtype, sdt)
      assert_close(got, oracle(u, v, s), dtype)


@pytest.mark.parametrize("m", [1, 8])
def test_svd_form_mlp_runs_as_its_composed_calls(m):
  """A SwiGLU MLP with Σ between each projection's factors: lr_mlp with scales, served by
  the grouped gate/up launch and the down call (2 Triton calls), equal to the reference."""
  import lrjax

  dtype = jnp.bfloat16
  d, f = 512, 1408
  ranks = {"g": 128, "u": 128, "d": 96}
  shapes = {"g": (d, f), "u": (d, f), "d": (f, d)}
  p = {
    k: (*lr_factors(shapes[k][0], r, shapes[k][1], dtype), randn((r,), dtype) + 2.0)
    for k, r in ranks.items()
  }

  def mlp(x, p):
    proj = lambda a, w: ((a @ w[0]) * w[2]) @ w[1]  # noqa: E731
    return proj(jax.nn.silu(proj(x, p["g"])) * proj(x, p["u"]), p["d"])

  x = randn((m, d), dtype)
  with lrjax.lowering.prefer_kernels():
    fused = jax.jit(lrjax.fuse(mlp)).lower(x, p).compile()
  assert _count_triton_calls(fused.as_text()) == 2
  with lrjax.lowering.force_reference():
    want = jax.jit(lrjax.fuse(mlp))(x, p)
  assert_close(fused(x, p), want, dtype, factor=2.0)


def test_group_above_the_grouped_kernels_rows_is_left_to_xla():
  """Above 64 rows the grouped kernel declines and the group lowers as XLA's reference (no
  Triton call: XLA merges the X·U dots); prefer_kernels() lowers each member as its own
  X·U·V (here phase 1, then the ·V launch: two calls a member)."""
  import lrjax
  from lrjax.lowering import lr_xuv_group

  dtype = jnp.bfloat16
  ws = [lr_factors(512, r, n, dtype) for r, n in ((96, 512), (48, 128), (48, 128))]
  x = randn((80, 512), dtype)
  want = [xuv_ref(x, u, v, None, dtype) for u, v in ws]
  from lrjax.custom_calls.triton import xuv_decode

  per_member = sum(
    2 if xuv_decode.default_pv(80, 512, *v.shape) == "launch" else 1 for _, v in ws
  )  # phase 1, then the ·V launch where V is small
  for prefer, calls in ((False, 0), (True, per_member)):
    ctx = lrjax.lowering.prefer_kernels() if prefer else contextlib.nullcontext()
    with ctx:
      f = jax.jit(lambda x, ws: lr_xuv_group(x, ws)).lower(x, ws).compile()
    assert _count_triton_calls(f.as_text()) == calls, f"{prefer=}"
    for got, ref in zip(f(x, ws), want):
      assert_close(got, ref, dtype)


def test_scratch_memset_switch(monkeypatch):
  """LRJAX_TRITON_SCRATCH_MEMSET=1 moves the scratch zeroing from an XLA zero buffer into the
  call (jax-triton's memset); both give the reference's result."""
  from lrjax.custom_calls.triton import xuv_decode

  x = randn((3, 512), jnp.bfloat16)
  u, v = lr_factors(512, 128, 256, jnp.bfloat16)
  fresh = lambda: lambda x, u, v: xuv_decode.xuv_decode(x, u, v)  # no trace cache reuse
  zeros = lambda: sum(
    e.primitive.name == "broadcast_in_dim" for e in jax.make_jaxpr(fresh())(x, u, v).jaxpr.eqns
  )
  want = xuv_ref(x, u, v, None, jnp.bfloat16)
  assert zeros() == 1
  assert_close(jax.jit(fresh())(x, u, v), want, jnp.bfloat16)
  monkeypatch.setenv("LRJAX_TRITON_SCRATCH_MEMSET", "1")
  assert zeros() == 0
  assert_close(jax.jit(fresh())(x, u, v), want, jnp.bfloat16)


def test_mlp_decode_timing_masks_are_checked():
  from lrjax.custom_calls.triton import mlp_decode

  gate, up, down = mlp_params(256, 512, 64, 64, 256, jnp.bfloat16, True, False)
  x = randn((2, 256), jnp.bfloat16)
  with pytest.raises(ValueError, match="persistent schedule only"):
    mlp_decode._mlp_decode(x, up, down, gate, phases=1)
  with pytest.raises(ValueError, match="must be in 1..7"):
    mlp_decode._mlp_decode(x, up, down, gate, persistent=True, phases=0)
  with pytest.raises(ValueError, match="tiled schedule only"):
    mlp_decode._mlp_decode(x, up, down, gate, persistent=True, s_flush="store")
  with pytest.raises(ValueError, match="must be one of"):
    mlp_decode._mlp_decode(x, up, down, gate, s_flush="skip")
  with pytest.raises(ValueError, match="stage H projects h"):  # parked by default at 33 rows
    mlp_decode._mlp_decode(randn((33, 256), jnp.bfloat16), up, down, gate, s_flush="store")


KV_SHAPES = [  # (B, Hq, Hkv, D, T, r_k, r_v, window, bias)
  (1, 4, 1, 32, 100, 48, 40, None, False),  # one sequence, ragged T and ranks
  (3, 8, 2, 64, 300, 136, 72, 64, True),  # GQA, sliding window, biases
  (2, 32, 8, 128, 1000, 512, 384, None, False),  # Llama-3-8B heads
  (5, 12, 12, 64, 77, 24, 520, None, True),  # MHA, r_v > 512
]


@pytest.mark.parametrize(
  "dtype,tweak", [(jnp.bfloat16, {}), (jnp.float16, {}), (jnp.bfloat16, dict(splits=3))]
)
@pytest.mark.parametrize("shape", KV_SHAPES)
def test_kv_attention_kernel(shape, dtype, tweak):
  """Every program stores its whole split state unconditionally and XLA merges the splits,
  so there is no output buffer to poison; a skipped split would still change the result."""
  from conftest import kv_attention_f64
  from lrjax.custom_calls.triton import kv_attention

  b, hq, hkv, d, t, rk, rv, window, bias = shape
  q = randn((b, hq, d), dtype)
  zk, zv = randn((b, t, rk), dtype), randn((b, t, rv), dtype)
  vk = randn((rk, hkv * d), dtype, rk**-0.5)
  vv = randn((rv, hkv * d), dtype, rv**-0.5)
  bk, bv = (randn((hkv * d,), dtype), randn((hkv * d,), dtype)) if bias else (None, None)
  pos = np.random.default_rng(t).integers(0, t, size=b).astype(np.int32)
  pos[0], pos[-1] = t - 1, (0 if b > 1 else t - 1)  # the whole cache; one key
  inv = 1.0 / (500000.0 ** (np.arange(0, d, 2) / d))
  bs = dataclasses.replace(kv_attention.BlockSizes.get_default(b, hkv, t, d, rk, rv), **tweak)
  out = jax.jit(lambda *a: kv_attention.kv_attention(*a, window=window, block_sizes=bs))(
    q, zk, zv, vk, vv, pos, inv, bk, bv
  )
  assert out.shape == (b, hq * d) and out.dtype == dtype
  assert_close(out, kv_attention_f64(q, zk, zv, vk, vv, pos, inv, bk, bv, window), dtype)


def test_lr_kv_attention_lowers_to_triton():
  """jax.jit(lrjax.lowering.lr_kv_attention) on GPU emits the Triton kernel under
  prefer_kernels() (by default it declines: measured slower than XLA) and agrees with the
  XLA reference lowering."""
  from lrjax.lowering import force_reference, lr_kv_attention, prefer_kernels

  dtype = jnp.bfloat16
  b, hq, hkv, d, t, rk, rv = 2, 8, 2, 64, 256, 96, 80
  q = randn((b, hq, d), dtype)
  zk, zv = randn((b, t, rk), dtype), randn((b, t, rv), dtype)
  vk, vv = randn((rk, hkv * d), dtype, rk**-0.5), randn((rv, hkv * d), dtype, rv**-0.5)
  pos = np.array([t - 1, 100], np.int32)
  inv = 1.0 / (10000.0 ** (np.arange(0, d, 2) / d))
  ops = (q, zk, zv, vk, vv, pos, inv)
  default = jax.jit(lambda *a: lr_kv_attention(*a)).lower(*ops).compile().as_text()
  assert _count_triton_calls(default) == 0
  with prefer_kernels():
    fn = jax.jit(lambda *a: lr_kv_attention(*a)).lower(*ops).compile()
  assert _count_triton_calls(fn.as_text()) == 1
  with force_reference():
    ref = jax.jit(lambda *a: lr_kv_attention(*a))(*ops)
  assert_close(fn(*ops), ref, dtype)
