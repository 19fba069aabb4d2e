"""CPU tests of the Triton kernels' tile planner and ``supports`` decisions (the H200 table)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from lrjax.custom_calls.triton import launch_modes, lowering, planner, policy

H200 = policy.for_device("NVIDIA H200")[0]
T = H200.values("planner")  # the planner's thresholds in the table the tests run under


@pytest.fixture(autouse=True)
def _h200_table():
  """These expectations were written for the H200's tuning table, whatever GPU the host has."""
  with policy.use(H200):
    yield


def test_eq10_intensity_matches_the_paper_formula():
  # eq. 10: 2Mr(K+N) / (s(M(K+N) + M/B_M r(K+N))) = 2r / ((1 + r/B_M) s)
  m, k, r, n, bm, s = 4096, 8192, 4096, 16384, 512, 2
  direct = 2 * m * r * (k + n) / (s * (m * (k + n) + m / bm * r * (k + n)))
  assert planner.xuv_intensity(r, bm, s) == pytest.approx(direct)
  assert planner.xuv_intensity(r, 128) < planner.H200.ridge < planner.xuv_intensity(r, 1024)


def test_eq11_strip_fits_only_at_small_rank():
  assert planner.strip_fits_cta(64, 256, 64, 128, 3)
  assert not planner.strip_fits_cta(64, 4096, 64, 128, 3)
  assert planner.strip_smem_bytes(64, 256, 64, 128, 128) == (64 * 256 + 192 * 128) * 2


@pytest.mark.parametrize("m,r", [(1024, 4096), (32768, 4096), (4096, 1280), (256, 2560)])
def test_prefill_plan_fits_smem_l2_and_clears_ridge(m, r):
  p = planner.plan_prefill(m, r, (r,))
  assert p.smem_bytes <= planner.H200.smem_per_cta
  assert p.ring * p.strip_bytes <= 0.4 * planner.H200.l2_bytes or p.group_m == 1
  n_mb = planner.cdiv(m, p.block_m)
  if p.group_m < n_mb:  # more rows than one super-block: it must be compute-bound
    assert p.intensity >= planner.H200.ridge
  assert "L2" in p.reason


def test_decode_plan_fills_the_machine():
  p = planner.plan_decode(1, 8192, 4096, 16384)
  assert p.block_m == 16
  assert planner.cdiv(4096, p.block_r) * p.split_k >= planner.H200.num_sms
  assert planner.plan_decode(40, 8192, 4096, 16384).block_m == 64


@pytest.mark.parametrize(
  "m,k,r,n",
  [(1, 8192, 4096, 16384), (4, 4096, 2560, 14336), (16, 8192, 2048, 16384), (1, 4096, 1024, 14336)],
)
def test_persistent_decode_plan_gives_each_sm_about_one_tile(m, k, r, n):
  p = planner.plan_decode_persistent(m, k, r, n, stream_k=False)
  g = planner.H200.num_sms
  tiles1 = planner.cdiv(r, p.cols_r) * planner.cdiv(k, p.k_per)
  tiles2 = p.r_chunks * planner.cdiv(n, p.cols_n)
  # one round, and at most 1/8 of the SMs idle, but phase 2 may leave more idle for tiles of
  # whole 128-byte lines (LINE_ALIGN_TOL)
  assert 7 * g // 8 <= tiles1 <= g, (p, tiles1, tiles2)
  assert tiles2 <= g and (tiles2 >= 7 * g // 8 or p.cols_n % 64 == 0), (p, tiles1, tiles2)
  floor_us = planner.hbm_bytes_xuv(m, k, r, n) / 4.0e12 * 1e6
  assert floor_us < p.est_us < floor_us * (1 + T.line_align_tol) + 4 * 1.5


@pytest.mark.parametrize("m", [1, 2, 8, 16])
def test_phase2_tiles_are_whole_lines_within_the_tolerance(m):
  """At N = 14336 the byte model's best V tiles are 112 columns (224-byte rows, most starting
  mid-line); 128-column tiles (two whole lines) cost 14 % more bytes a CTA and are taken."""
  p = planner.plan_decode_persistent(m, 4096, 2560, 14336)
  assert (p.cols_n, p.r_chunks) == (128, 1), p
  q = planner.plan_decode_persistent(m, 4096, 2560, 14336, line_align_tol=-1)
  assert (q.cols_n, q.r_chunks) == (112, 1), q
  assert planner.plan_decode_persistent(m, 4096, 2560, 14336, line_align_tol=0.1).cols_n == 112


@pytest.mark.parametrize("m", [1, 2, 4])
def test_phase1_takes_256_column_tiles_on_a_tie(m):
  """At 8192->2456->8192 the byte model ties 128 phase-1 tiles of 160 columns x 1024 rows with
  130 of 256 x 640 (the same bytes a tile, one round of the grid each); the 256-column tiles,
  whole 128-byte lines, are taken (PHASE1_LINE_TOL)."""
  p = planner.plan_decode_persistent(m, 8192, 2456, 8192, programs=132)
  assert (p.cols_r, p.block_r, p.k_per) == (256, 256, 640), p
  assert planner.cdiv(2456, 256) * planner.cdiv(8192, 640) == 130
  q = planner.plan_decode_persistent(m, 8192, 2456, 8192, programs=132, phase1_line_tol=-1)
  assert (q.cols_r, q.k_per) == (160, 1024), q
  assert q.est_us == pytest.approx(p.est_us)
  # at M=16 the 13 splits' f32 partials cost more than 8 splits': no tie, the 160-column tiles
  assert planner.plan_decode_persistent(16, 8192, 2456, 8192, programs=132).cols_r == 160


@pytest.mark.parametrize(
  "m,k,r,n,rows",
  [
    (2, 4096, 2560, 14336, 64),
    (1, 8192, 4096, 16384, 64),
    (4, 8192, 2432, 8192, 64),
    (16, 4096, 1216, 4096, 64),
    (4, 4096, 512, 1024, 128),
    (4, 8192, 544, 1024, 128),
    (4, 4096, 152, 4096, 0),
  ],
)
def test_phase2_prefetch_rows_follow_the_tile_width(m, k, r, n, rows):
  """Tiles of 128 columns or more prefetch PREFETCH_ROWS_WIDE V rows into L2 before the wait
  (measured faster than PREFETCH_ROWS there), narrower ones PREFETCH_ROWS; a V-resident plan
  holds its whole V tile and prefetches none."""
  p = planner.plan_decode_persistent(m, k, r, n)
  assert p.prefetch == rows, p
  if rows:
    assert rows == (T.prefetch_rows_wide if p.cols_n >= 128 else T.prefetch_rows)
  assert T.prefetch_rows_wide != T.prefetch_rows


@pytest.mark.parametrize(
  "m,k,r,n,split",
  [
    (64, 8192, 4096, 16384, True),
    (64, 4096, 2560, 14336, True),
    (64, 1000, 2560, 8200, True),  # a GPU test shape
    (64, 8192, 2048, 16384, False),
    (32, 8192, 4096, 16384, False),
    (1, 8192, 4096, 16384, False),
  ],
)
def test_persistent_decode_plan_halves_p_per_tile_when_it_is_large(m, k, r, n, split):
  """From P_SPLIT_BYTES of f32 P a phase-2 tile, two r-chunks of tiles twice as wide (the
  one-line-row rule off: it too may take two r-chunks)."""
  p = planner.plan_decode_persistent(m, k, r, n, line_row_tol=-1)
  one = planner.plan_decode_persistent(m, k, r, n, p_split_bytes=float("inf"), line_row_tol=-1)
  assert one.r_chunks == 1
  assert (m * r * 4 >= T.p_split_bytes) == split
  if split:
    assert (p.r_chunks, p.cols_n) == (2, 2 * one.cols_n) and p.block_n >= p.cols_n
    tiles = [q.r_chunks * planner.cdiv(n, q.cols_n) for q in (p, one)]
    assert tiles[0] <= max(tiles[1], planner.H200.num_sms)  # still about one tile per SM
  else:
    assert p == one


@pytest.mark.parametrize(
  "m,k,r,n,programs",
  [
    (1, 200, 72, 130, None),
    (3, 1000, 96, 520, 7),
    (1, 512, 1, 1024, None),
    (5, 300, 8, 200, None),
    (1, 512, 16, 1024, None),  # a TP-8 shard
    (16, 512, 32, 1024, None),
    (2, 512, 33, 64, 7),
    (4, 64, 16, 32, None),
    (2, 40, 1, 48, None),
    (16, 4096, 256, 1024, None),
    (128, 2048, 2304, 1000, None),
  ],
)
def test_persistent_decode_plan_is_well_formed(m, k, r, n, programs):
  p = planner.plan_decode_persistent(m, k, r, n, programs=programs)
  assert p.block_m >= m and p.programs == (programs or planner.H200.num_sms)
  for width, cols in ((p.block_r, p.cols_r), (p.block_n, p.cols_n)):
    assert width & (width - 1) == 0 and cols % 16 == 0 and width // 2 < cols <= width
  assert p.block_n >= 64 or p.prefetch == 0  # the L2 prefetch: one line per 64 columns
  assert p.k_per % p.block_k == 0
  n_rb = planner.cdiv(r, p.cols_r)
  if p.v_resident:  # a CTA for every tile, V's register tile within bounds, one r-chunk
    assert n_rb * planner.cdiv(k, p.k_per) + planner.cdiv(n, p.cols_n) <= p.programs
    assert planner.next_pow2(r) <= T.v_res_max_r and p.block_n <= T.v_res_block_n
    assert p.r_chunks == 1 and not p.p16 and p.block_m <= T.v_res_max_m
  per = planner.cdiv(n_rb, p.r_chunks)
  assert planner.cdiv(n_rb, per) == p.r_chunks
  assert p.r_chunks == 1 or (per * p.cols_r) % p.block_kv == 0  # chunks of whole steps
  if r <= 32:  # small ranks (e.g. TP shards) take 16- or 32-column phase-1 tiles
    assert p.block_r <= 32 and n_rb <= 2


def test_mlp_persistent_plan_serves_small_ranks():
  """A TP shard of a small factor (rank <= 32) still gets a plan (phase A shares the tiles)."""
  for r in (1, 16, 32):
    p = planner.plan_mlp_decode_persistent(1, 512, 1024, r, r, 512)
    assert p.cols_r % 16 == 0 and p.cols_r <= 32 and p.block_r & (p.block_r - 1) == 0


@pytest.mark.parametrize(
  "m,d,f,r", [(1, 4096, 14336, 2560), (16, 2048, 8192, 1280), (4, 4096, 14336, 1024)]
)
def test_persistent_mlp_plan_gives_each_sm_about_one_tile_per_phase(m, d, f, r):
  p = planner.plan_mlp_decode_persistent(m, d, f, r, r, d)
  g = planner.H200.num_sms
  tiles = (
    planner.cdiv(r, p.cols_r) * planner.cdiv(d, p.k_per),
    planner.cdiv(f, p.cols_f),
    p.c_chunks * planner.cdiv(d, p.cols_n),
  )
  assert all(7 * g // 8 <= t <= g for t in tiles), (p, tiles)
  for width, cols in ((p.block_r, p.cols_r), (p.block_f, p.cols_f), (p.block_n, p.cols_n)):
    assert width & (width - 1) == 0 and cols % 16 == 0 and width // 2 < cols <= width
  floor_us = planner.hbm_bytes_mlp(m, d, f, r) / 4.0e12 * 1e6
  assert floor_us < p.est_us < floor_us + 3 * 2 * 1.5


def test_cta_smem_check_names_the_kernel_and_the_limit():
  h200 = planner.H200.smem_per_cta
  assert planner.SMEM_PER_CTA_BY_CAPABILITY[90] == h200 == 232448
  planner.check_cta_smem("_k", h200, 90, 4, 3)  # at the limit: fits
  with pytest.raises(
    ValueError,
    match=r"_mlp_decode_kernel \(num_warps=4, num_stages=5\) "
    r"needs 282624 bytes .* the 232448 that a GPU of compute capability 9\.0",
  ):
    planner.check_cta_smem("_mlp_decode_kernel", 282624, 90, 4, 5)
  with pytest.raises(ValueError, match="101376 that a GPU of compute capability 8.9"):
    planner.check_cta_smem("_k", 147456, 89, 4, 5)  # fits an H200, not an L40S
  planner.check_cta_smem("_k", 10**9, 61, 4, 3)  # an unknown capability is not judged


def test_roofline_counts():
  assert planner.hbm_bytes_xuv(1, 8192, 4096, 16384) == 2 * (
    8192 + 8192 * 4096 + 4096 * 16384 + 16384
  )
  assert planner.flops_xuv(2, 3, 4, 5) == 2 * 2 * 4 * 8
  assert planner.hbm_bytes_mlp(1, 4096, 14336, 2560) == 2 * (2 * 4096 + 3 * 2560 * (4096 + 14336))


def _aval(shape, dtype=jnp.bfloat16):
  return jax.core.ShapedArray(shape, jnp.dtype(dtype))


XUV_PARAMS = dict(
  has_bias=False, inter_dtype=jnp.dtype(jnp.bfloat16), out_dtype=jnp.dtype(jnp.bfloat16)
)


@pytest.fixture
def toolchain(monkeypatch):
  monkeypatch.setattr(lowering, "_toolchain", lambda: None)


def test_supports_without_toolchain_names_the_extra(monkeypatch):
  monkeypatch.setattr(lowering.importlib.util, "find_spec", lambda name: None)
  avals = [_aval((4, 64)), _aval((64, 16)), _aval((16, 32))]
  assert "lrjax[cuda]" in lowering.xuv_decode_supports(avals, XUV_PARAMS)


def test_xuv_supports_decisions(toolchain):
  avals = lambda m, dt=jnp.bfloat16: [
    _aval((m, 512), dt),
    _aval((512, 64), dt),
    _aval((64, 256), dt),
  ]
  assert lowering.xuv_decode_supports(avals(16), XUV_PARAMS) is None
  assert "prefill" in lowering.xuv_decode_supports(avals(1024), XUV_PARAMS)
  assert lowering.xuv_prefill_supports(avals(1024), XUV_PARAMS) is None
  assert "float32" in lowering.xuv_prefill_supports(avals(8, jnp.float32), XUV_PARAMS)
  mixed = [_aval((8, 512)), _aval((512, 64), jnp.float16), _aval((64, 256))]
  assert "dtype" in lowering.xuv_decode_supports(mixed, XUV_PARAMS)
  f32_inter = dict(XUV_PARAMS, inter_dtype=jnp.dtype(jnp.float32))
  assert "inter_dtype" in lowering.xuv_decode_supports(avals(8), f32_inter)
  assert "M=0" in lowering.xuv_decode_supports(avals(0), XUV_PARAMS)


def test_a_scale_is_served_by_the_decode_kernels_only(toolchain):
  """A rank-space scale: the decode X·U·V kernel takes it up to the persistent schedule's rows
  (phase 1 there, the scale and ·V by XLA), the grouped kernel per member, the decode MLP as
  its composed calls; the prefill kernels decline it by name."""
  from lrjax.custom_calls.triton import policy

  scaled = dict(XUV_PARAMS, has_scale=True, scaled_dtype=jnp.dtype(jnp.bfloat16))
  avals = lambda m, sdt=jnp.bfloat16: [  # noqa: E731
    _aval((m, 512)),
    _aval((512, 64)),
    _aval((64, 256)),
    _aval((64,), sdt),
  ]
  assert lowering.xuv_decode_supports(avals(1), scaled) is None
  assert lowering.xuv_decode_supports(avals(8, jnp.float32), scaled) is None  # an f32 Σ
  limit = policy.values("xuv_decode").persistent_max_m
  assert lowering.xuv_decode_supports(avals(limit), scaled) is None
  if limit < lowering.XUV_DECODE_MAX_M:
    assert "persistent" in lowering.xuv_decode_supports(avals(limit + 1), scaled)
  assert "rank-space scale" in lowering.xuv_prefill_supports(avals(1024), scaled)
  group = [_aval((4, 512))] + [a for r in (64, 32) for a in (_aval((512, r)), _aval((r, 128)))]
  group.insert(3, _aval((64,)))  # the first member's scale
  gparams = dict(
    bias_mask=(False, False),
    scale_mask=(True, False),
    inter_dtype=jnp.dtype(jnp.bfloat16),
    out_dtype=jnp.dtype(jnp.bfloat16),
  )
  assert lowering.xuv_group_supports(group, gparams) is None
  mparams = dict(_mlp_params(), scale_mask=(False, True, False))
  mlp = lambda m: _mlp_avals(m)[:5] + [_aval((64,))] + _mlp_avals(m)[5:]  # noqa: E731  up's scale
  assert lowering.mlp_decode_supports(mlp(1), mparams) is None  # the composed calls
  if limit < lowering.MLP_DECODE_MAX_M:
    assert "persistent" in lowering.mlp_decode_supports(mlp(limit + 1), mparams)
  assert "rank-space scale" in lowering.mlp_prefill_supports(mlp(1024), mparams)


def _mlp_avals(m, gated=True, gate_rank=64):
  d, f, r = 256, 704, 64
  ops = [_aval((m, d))]
  if gated:
    ops += [_aval((d, gate_rank)), _aval((gate_rank, f))]
  ops += [_aval((d, r)), _aval((r, f)), _aval((f, r)), _aval((r, d))]
  return ops


def _mlp_params(gated=True, act="silu"):
  return dict(
    gated=gated,
    act=act,
    bias_mask=(False,) * (3 if gated else 2),
    inter_dtype=jnp.dtype(jnp.bfloat16),
    out_dtype=jnp.dtype(jnp.bfloat16),
  )


def test_mlp_supports_decisions(toolchain):
  assert lowering.mlp_decode_supports(_mlp_avals(1), _mlp_params()) is None
  assert lowering.mlp_decode_supports(_mlp_avals(128), _mlp_params()) is None
  assert "prefill" in lowering.mlp_decode_supports(_mlp_avals(4096), _mlp_params())
  assert lowering.mlp_prefill_supports(_mlp_avals(4096), _mlp_params()) is None
  assert lowering.mlp_prefill_supports(_mlp_avals(7, False), _mlp_params(False, "gelu")) is None
  assert "one pass" in lowering.mlp_decode_supports(_mlp_avals(1, gate_rank=32), _mlp_params())
  assert "epilogue" in lowering.mlp_decode_supports(_mlp_avals(1), _mlp_params(act="swish2"))


def _kv_avals(b=2, hq=8, hkv=2, d=64, t=256, rk=96, rv=80, dt=jnp.bfloat16, biases=0):
  ops = [
    _aval((b, hq, d), dt),
    _aval((b, t, rk), dt),
    _aval((b, t, rv), dt),
    _aval((rk, hkv * d), dt),
    _aval((rv, hkv * d), dt),
    _aval((b,), jnp.int32),
    _aval((d // 2,), jnp.float32),
  ]
  return ops + [_aval((hkv * d,), dt)] * biases


def test_kv_attention_supports_decisions(toolchain):
  params = lambda nb=0: dict(has_bk=nb > 0, has_bv=nb > 1, window=None)
  assert lowering.kv_attention_supports(_kv_avals(), params()) is None
  assert lowering.kv_attention_supports(_kv_avals(biases=2), params(2)) is None
  assert "power of two" in lowering.kv_attention_supports(_kv_avals(d=48), params())
  assert "r_v=2048" in lowering.kv_attention_supports(_kv_avals(rv=2048), params())
  assert "float32" in lowering.kv_attention_supports(_kv_avals(dt=jnp.float32), params())
  assert "32-bit" in lowering.kv_attention_supports(_kv_avals(b=64, t=1 << 20, rk=64), params())
  # faster() always declines (measured slower than XLA); prefer_kernels() skips that check
  assert "measured" in lowering.kv_attention_faster(_kv_avals(), params())


def test_kv_splits_fill_whole_waves():
  # 64 (sequence, head) pairs on 132 SMs: 2 splits (one wave), not 5 (2.4 waves)
  assert planner.plan_kv_splits(8, 8, 4096, 128, 8, 132) == 2
  assert planner.plan_kv_splits(1, 8, 4096, 128, 8, 132) == 16  # 128 programs, one wave
  assert planner.plan_kv_splits(32, 8, 4096, 128, 8, 132) == 1  # 256 programs already
  assert planner.plan_kv_splits(1, 1, 100, 128, 8, 132) == 1  # one key block
  for b, hkv, t, warps in ((3, 2, 300, 8), (5, 12, 77, 4), (2, 8, 100_000, 8)):
    s = planner.plan_kv_splits(b, hkv, t, 64, warps, 132)
    assert 1 <= s <= planner.cdiv(t, 64)


def test_cuda_kernels_registered_and_triton_not_imported():
  """In a fresh interpreter (another test may have imported triton on a GPU host)."""
  import subprocess
  import sys

  code = """if True:
    import sys
    import jax, jax.numpy as jnp
    import lrjax
    from lrjax.custom_calls.triton import lowering
    from lrjax.lowering import registry
    names = {k.name for p in ("lr_xuv", "lr_mlp") for k in registry.candidates(p, "cuda")}
    assert {"triton.xuv_decode", "triton.xuv_prefill", "triton.mlp_decode",
            "triton.mlp_prefill"} <= names, names
    assert all(k.platform == "cuda" for k in lowering.KERNELS)
    cpu = jax.devices("cpu")[0]
    ops = [jax.device_put(jnp.ones(s, jnp.bfloat16), cpu) for s in ((4, 64), (64, 16), (16, 32))]
    jax.jit(lrjax.lowering.lr_xuv)(*ops).block_until_ready()
    assert "jax_triton" not in sys.modules and "triton" not in sys.modules
    """
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]


def test_cpu_lowering_never_selects_triton():
  import lrjax

  x = jnp.ones((4, 64), jnp.bfloat16)
  u = jnp.ones((64, 16), jnp.bfloat16)
  v = jnp.ones((16, 32), jnp.bfloat16)
  lowered = (
    jax.jit(lambda x, u, v: lrjax.lowering.lr_xuv(x, u, v))
    .trace(x, u, v)
    .lower(lowering_platforms=("cpu",))
  )
  assert "triton" not in lowered.as_text()


@pytest.mark.parametrize(
  "k,r,n",
  [
    (8192, 4096, 16384),
    (4096, 2560, 14336),
    (8192, 2048, 16384),
    (4096, 1024, 14336),
    (4096, 152, 4096),
    (2048, 640, 2048),
    (200, 72, 130),
    (40, 1, 48),
  ],
)
@pytest.mark.parametrize("m", [64, 128])
def test_phase1_plan_takes_fewest_splits_with_a_tile_per_cta(m, k, r, n):
  """xuv_decode(pv="xla")'s phase-1 tiles: 128 columns (64 at r <= 1024), K ranges of whole
  64-row steps covering K, at most one tile per CTA (unless the columns alone outnumber the
  CTAs), and K ranges as long as that allows: one 64-row step shorter, the tiles would
  outnumber the CTAs; 4 pipeline stages on the 128-column tiles and where K >= 4096 (measured
  faster), 6 where a stage is then only 16 KB (64 rows, 64 columns), else the fused plan's 3;
  P left as f32 sums for XLA to round (no p16)."""
  p = planner.plan_decode_phase1(m, k, r, n, programs=132)
  assert p.cols_r == p.block_r == (64 if r <= 1024 else 128)  # none here gains 0.5 us at 64
  deep = r > 1024 or k >= 4096
  want = (6 if m == 64 and p.cols_r == 64 else 4) if deep else 3
  assert p.stages == want
  assert want != 3 or want == planner.plan_decode_persistent(m, k, r, n).stages
  assert p.k_per % 64 == 0 and p.k_per > 0 and p.r_chunks == 1
  assert not p.p16  # XLA rounds P's f32 sums
  n_rb = planner.cdiv(r, p.cols_r)
  assert n_rb * planner.cdiv(k, p.k_per) <= max(132, n_rb)
  assert p.k_per == 64 or n_rb * planner.cdiv(k, p.k_per - 64) > 132


# Same-weights A/Bs of the phase-1-alone plan, 64-column tiles against 128
# (benchmarks/results/gpu_xuv_decode_phase1_cols_h200.json): us the 64-column tiles took more
PHASE1_COLS_AB = [
  ((128, 4096, 1216, 4096), -1.54),
  ((128, 4096, 1216, 4096), -1.45),
  ((64, 4096, 1216, 4096), -0.65),
  ((128, 4096, 2560, 14336), -0.42),
  ((64, 4096, 2560, 14336), 0.94),
  ((128, 8192, 2048, 16384), 0.44),
  ((128, 8192, 2456, 8192), 1.30),
  ((128, 8192, 2456, 8192), 1.28),
  ((64, 8192, 2456, 8192), 2.52),
  ((128, 8192, 4096, 16384), 3.46),
]


@pytest.mark.parametrize("dims,slower_us", PHASE1_COLS_AB)
def test_phase1_plan_takes_64_column_tiles_where_they_measured_faster(dims, slower_us):
  """Where r > 1024 the phase-1 plan takes 64-column tiles (half the split-K partials, X read
  from L2 twice as often) where its L2 model saves PHASE1_NARROW_MIN_US: it picks the tiles
  that measured faster, or lets a gain under that margin go; as many CTAs either way."""
  m, k, r, n = dims
  p = planner.plan_decode_phase1(m, k, r, n, programs=132)
  if slower_us <= -T.phase1_narrow_min_us:
    assert p.cols_r == p.block_r == 64
  elif slower_us > 0:  # (112 of them read at 8192->2456->8192: PHASE1_BALANCE_COLS)
    assert p.block_r == 128 and p.cols_r in (128, T.phase1_balance_cols)
  # r > 1024: as the 128-column tiles, or 6 on 16-KB stages (64 rows, 64 columns)
  assert p.stages == (6 if p.block_m == p.cols_r == 64 else T.phase1_wide_stages)
  n_rb = planner.cdiv(r, p.cols_r)
  assert n_rb * planner.cdiv(k, p.k_per) <= 132
  assert p.k_per == 64 or n_rb * planner.cdiv(k, p.k_per - 64) > 132


# Same-weights A/Bs of the phase-1-alone plan, 6 pipeline stages against its own
# (benchmarks/results/gpu_xuv_decode_phase1_deep_h200.json): us the 6 stages took more
PHASE1_STAGES_AB = [
  ((64, 4096, 1024, 14336), -0.55),
  ((64, 8192, 2048, 16384), -0.09),
  ((64, 4096, 2560, 14336), 0.04),
  ((64, 8192, 4096, 16384), 0.26),
  ((64, 8192, 2456, 8192), 0.62),
  ((128, 2048, 256, 512), 0.07),
  ((128, 2048, 640, 2048), 0.16),
  ((128, 4096, 152, 4096), -0.01),
  ((128, 4096, 512, 1024), 0.22),
  ((128, 4096, 1024, 14336), 0.06),
  ((128, 4096, 1216, 4096), -0.45),
  ((128, 4096, 2560, 14336), 0.41),
  ((128, 8192, 544, 1024), 0.01),
  ((128, 8192, 2048, 16384), 0.29),
  ((128, 8192, 2456, 8192), 0.84),
  ((128, 8192, 4096, 16384), 0.57),
]


@pytest.mark.parametrize("dims,slower_us", PHASE1_STAGES_AB)
def test_phase1_plan_takes_6_stages_where_they_measured_faster(dims, slower_us):
  """The phase-1 plan deepens its pipeline to 6 stages where that keeps about
  PHASE1_INFLIGHT_BYTES of X and U in flight (16-KB stages: 64 rows, 64 columns): it took 6
  where they measured 0.5 us faster, kept its own where they measured slower, and lets a
  smaller gain go."""
  m, k, r, n = dims
  p = planner.plan_decode_phase1(m, k, r, n, programs=132)
  if slower_us <= -0.5:
    assert p.stages == T.phase1_max_stages == 6
  elif slower_us > 0:
    assert p.stages < 6
  assert p.stages * (p.block_m + p.cols_r) * p.block_k * 2 <= 160 * 1024  # 1 CTA an SM fits


# Same-weights A/Bs of the phase-1-alone plan, fewer columns a tile than its block
# (benchmarks/results/gpu_xuv_decode_phase1_balance_h200.json): (point, columns, us they took more)
PHASE1_BALANCE_AB = [
  ((128, 8192, 2456, 8192), 112, -0.73),
  ((128, 8192, 2456, 8192), 112, -0.97),
  ((64, 8192, 2456, 8192), 112, -0.75),
  ((128, 4096, 2560, 14336), 80, 0.53),
  ((64, 4096, 2560, 14336), 80, 0.93),
  ((128, 4096, 1216, 4096), 48, 0.36),
  ((64, 4096, 1216, 4096), 48, 0.27),
]


@pytest.mark.parametrize("dims,cols,slower_us", PHASE1_BALANCE_AB)
def test_phase1_plan_narrows_its_tiles_only_where_that_measured_faster(dims, cols, slower_us):
  """Where 112 of a 128-column tile's columns cut the largest tile by PHASE1_BALANCE_MIN (more
  tiles, as many as the CTAs), the phase-1 plan reads that many: it narrows where narrower
  tiles measured faster and keeps whole tiles where they measured slower."""
  m, k, r, n = dims
  p = planner.plan_decode_phase1(m, k, r, n, programs=132)
  if slower_us < 0:
    assert (p.block_r, p.cols_r) == (128, cols)
  else:
    assert p.cols_r == p.block_r != cols
  n_rb = planner.cdiv(r, p.cols_r)
  assert n_rb * planner.cdiv(k, p.k_per) <= 132


@pytest.mark.parametrize(
  "m,k,r,n,g,cols,k_per",
  [
    # narrowed: the sweep's point; the kernel tests' ragged shapes (GPU and interpreter). At
    # 8192->2456->8192 on 132 CTAs: 20 blocks of 128 columns x 6 splits of 1408 rows (largest
    # 128 x 1408) against 22 blocks of 112 x 6 splits of 1408 (112 x 1408: 0.875 of it)
    (128, 8192, 2456, 8192, 132, 112, 1408),
    (100, 4100, 2456, 1000, 132, 112, 704),
    (16, 512, 1100, 64, 40, 112, 128),  # 9 x 4 splits of 128 against 10 x 4 of 128: 0.875
    # whole: 112 columns would not shrink the largest tile by 10 %: 8192->2048 16 blocks x 8
    # splits of 1024 against 19 x 6 of 1408 (1.20x); 8192->4096 32 x 4 of 2048 against 37 x 3
    # of 2752 (1.18x); 4096->2560 20 x 6 of 704 against 23 x 5 of 832 (1.03x)
    (128, 8192, 2048, 16384, 132, 128, 1024),
    (64, 8192, 4096, 16384, 132, 128, 2048),
    (128, 4096, 2560, 14336, 132, 128, 704),
  ],
)
def test_phase1_plan_narrows_by_the_largest_tile(m, k, r, n, g, cols, k_per):
  """PHASE1_BALANCE_COLS columns of each 128-column tile exactly where their largest tile (K
  rows x columns of U) is at most (1 - PHASE1_BALANCE_MIN) of the whole tiles' on as many
  CTAs (the tiles worked out by hand above): the kernel tests' shapes run the narrowed tiles."""
  assert (T.phase1_balance_cols, T.phase1_balance_min) == (112, 0.1)
  p = planner.plan_decode_phase1(m, k, r, n, programs=g)
  assert (p.block_r, p.cols_r, p.k_per) == (128, cols, k_per)
  assert planner.cdiv(r, p.cols_r) * planner.cdiv(k, p.k_per) <= g


@pytest.mark.parametrize(
  "k,r,n", [(8192, 4096, 16384), (4096, 2560, 14336), (8192, 2048, 16384), (4096, 1024, 14336)]
)
def test_phase1_plan_adds_fewer_partials_than_the_fused_plan(k, r, n):
  """At M=128 on the sweep's shapes, where it measured 5-24 % faster, the phase-1 plan adds
  fewer f32 split-K partials into P than the fused kernel's plan."""
  p = planner.plan_decode_phase1(128, k, r, n, programs=132)
  fused = planner.plan_decode_persistent(128, k, r, n, programs=132)
  assert planner.cdiv(k, p.k_per) < planner.cdiv(k, fused.k_per)


@pytest.mark.parametrize("m,k,r,n", [(1, 8192, 2456, 8192), (16, 4096, 1216, 4096)])
def test_rows_of_one_line_give_way_to_wider_tiles_of_about_the_same_estimate(m, k, r, n):
  """Llama-3-70B q/o and Llama-3-8B q: the byte model's best V tiles are 64 columns (one
  128-byte line a row); within LINE_ROW_TOL of it the planner takes 128-column tiles."""
  narrow = planner.plan_decode_persistent(m, k, r, n, line_row_tol=-1)
  p = planner.plan_decode_persistent(m, k, r, n)
  assert narrow.cols_n == 64 and p.cols_n == 128
  assert p.est_us <= narrow.est_us * (1 + T.line_row_tol)
  assert p.r_chunks * planner.cdiv(n, p.cols_n) <= planner.H200.num_sms


@pytest.mark.parametrize("m,k,r,n", [(1, 8192, 544, 1024), (1, 2048, 256, 512)])
def test_rows_of_one_line_stay_where_wider_tiles_would_leave_sms_idle(m, k, r, n):
  """Small V (k/v projections): 128-column tiles would give fewer tiles than SMs, an
  estimate far above the narrow tiles', so the 48-column tiles stay."""
  p = planner.plan_decode_persistent(m, k, r, n)
  assert p == planner.plan_decode_persistent(m, k, r, n, line_row_tol=-1) and p.cols_n <= 64


def test_mlp_phase_b_tiles_are_at_most_128_wide():
  """256-wide phase-B tiles overflowed the H200's shared memory (Llama-3-70B's MLP); the
  8B MLP's phase C takes 128-column tiles (its byte model's 64 are one line a row)."""
  big = planner.plan_mlp_decode_persistent(1, 8192, 28672, 3824, 3824, 8192)
  assert big.block_f <= 128 and big.cols_f <= big.block_f
  small = planner.plan_mlp_decode_persistent(1, 4096, 14336, 2560, 2560, 4096)
  assert small.block_f <= 128 and small.cols_n == 128


def test_rows_longer_than_the_widest_tile_are_refused():
  with pytest.raises(ValueError, match="min_row_bytes=1024"):
    planner.plan_decode_persistent(1, 4096, 1024, 14336, min_row_bytes=1024)


def test_wide_tiles_give_way_to_shared_memory_from_32_or_64_rows():
  """The grouped kernel's V tiles are at most 128 columns from 32 rows and the persistent
  SwiGLU kernel's phase-B slices 64 from 64 rows (wider ones asked a CTA for more shared
  memory than the H200 has: test_triton_smem.py); min_row_bytes yields to those caps."""
  qkv = [(2456, 8192), (544, 1024), (544, 1024)]
  assert max(planner.plan_decode_group(16, 8192, qkv).block_n) == 256
  for m in (32, 64):
    for rows in (0, 512):
      assert max(planner.plan_decode_group(m, 8192, qkv, min_row_bytes=rows).block_n) == 128
  assert planner.plan_mlp_decode_persistent(32, 4096, 14336, 2560, 2560, 4096).block_f == 128
  for rows in (0, 256):
    p = planner.plan_mlp_decode_persistent(64, 4096, 14336, 2560, 2560, 4096, min_row_bytes=rows)
    assert p.block_f == 64


def test_group_phase1_counts_the_round_trip_of_narrow_tiles():
  """At Llama-3-70B's q/k/v (ranks 2432/576/576) the byte model alone takes 64-column k/v
  tiles of 4096 rows; those keep 32 KB in flight and streamed slower than 128-column ones
  (39.4 vs 31.7 us at M=4 on the H200). With the round trip counted they are not taken."""
  qkv = [(2432, 8192), (576, 1024), (576, 1024)]
  assert min(planner.plan_decode_group(4, 8192, qkv, round_trip_us=1e-3).cols_r) == 64
  p = planner.plan_decode_group(4, 8192, qkv)
  assert min(p.cols_r) > 64


@pytest.mark.parametrize(
  "k,qkv",
  [
    (8192, [(2432, 8192), (576, 1024), (576, 1024)]),
    (4096, [(1216, 4096), (512, 1024), (512, 1024)]),
    (3584, [(1088, 3584), (256, 512), (256, 512)]),
    (64, [(16, 64), (7, 64)]),
  ],
)
def test_group_phase1_is_one_round_of_tiles_over_the_ctas(k, qkv):
  """The kernel hands phase-1 tiles to its CTAs round-robin; the plan fits them in one round
  and gives members of one rank the same tiles."""
  p = planner.plan_decode_group(4, k, qkv)
  tiles = sum(
    planner.cdiv(r, c) * planner.cdiv(k, kp) for (r, _), c, kp in zip(qkv, p.cols_r, p.k_per)
  )
  assert tiles <= p.programs
  by_rank = {}
  for (r, _), c, kp in zip(qkv, p.cols_r, p.k_per):
    assert by_rank.setdefault(r, (c, kp)) == (c, kp)


def test_group_phase1_alone_on_one_branch_has_one_pipelines_room():
  """The grouped kernel keeps a pipeline in shared memory for each phase-1 call site: two
  without one_branch (3 stages of 32 KB at 128 rows), one with it, which then takes the
  phase-1 plan's 4, as one X·U·V call does; same tiles otherwise. The default takes
  one_branch for members of one rank (the composed MLP's gate and up) and not for members of
  two, which cannot share the call site and are refused if it is asked for."""
  for d, r in ((4096, 2560), (8192, 3824)):
    two = planner.plan_decode_group_phase1(128, d, [(r, 14336)] * 2, one_branch=False)
    one = planner.plan_decode_group_phase1(128, d, [(r, 14336)] * 2, one_branch=True)
    single = planner.plan_decode_phase1(128, d, 2 * r, 14336)
    assert (two.stages, one.stages, single.stages) == (3, 4, 4)
    assert dataclasses.replace(one, stages=3, one_branch=False) == two
    assert planner.plan_decode_group_phase1(128, d, [(r, 14336)] * 2) == one
  mixed = [(2560, 14336), (1024, 14336)]
  assert not planner.plan_decode_group_phase1(64, 4096, mixed).one_branch
  with pytest.raises(ValueError, match="one rank"):
    planner.plan_decode_group_phase1(64, 4096, mixed, one_branch=True)


def test_persistent_phase1_counts_the_round_trip_from_64_kb_of_u_a_cta():
  """8192->2432->8192 (302 KB of U a CTA): 160-column phase-1 tiles, not the byte model's 80
  (6-10 % faster on the H200). 2048->256->512 (8 KB a CTA) keeps its narrow tiles: the wide
  ones were 4-20 % slower on such shapes. (The 160-column tiles then tie with 256-column
  ones, which PHASE1_LINE_TOL takes: test_phase1_takes_256_column_tiles_on_a_tie.)"""
  wide = planner.plan_decode_persistent(4, 8192, 2432, 8192, phase1_line_tol=-1)
  assert (
    planner.plan_decode_persistent(4, 8192, 2432, 8192, round_trip_us=0, phase1_line_tol=-1).cols_r
    == 80
  )
  assert wide.cols_r == 160 and wide.k_per == 1024
  small = planner.plan_decode_persistent(4, 2048, 256, 512)
  assert small == planner.plan_decode_persistent(4, 2048, 256, 512, round_trip_us=0)
  assert small.cols_r == 48


def test_scratch_chain_alternates_halves_and_zeroes_what_the_last_call_used():
  """A chain of decode calls (launch.py): the first starts a zeroed buffer of two halves;
  each next call works in the other half and zeroes the floats its predecessor used; a
  call whose scratch does not fit a half starts a new chain. Offsets and counts are
  multiples of 16 (_common.leave_chain tells Triton so of the zeroed half's offset), never 1
  (jax-triton compiles a 1 in as a constant)."""
  half = launch_modes.SCRATCH_MIN_HALF
  assert launch_modes.next_link(None, 5) == (True, half, 0, 0)
  last, work = None, []
  for need in (5, 700, 17, half, 1):
    fresh, h, parity, clear_n = launch_modes.next_link(last, need)
    assert (fresh, h) == (last is None, half)
    assert clear_n == (0 if last is None else min(half, -(-last[2] // 16) * 16))
    assert clear_n != 1 and clear_n % 16 == 0 and h % 1024 == 0
    work.append(parity)
    last = (h, parity, need)
  assert work == [0, 1, 0, 1, 0]
  big = launch_modes.next_link((half, 1, 10), half + 1)  # too big for the chain: a new one
  assert big == (True, -(-(half + 1) // 1024) * 1024, 0, 0)
  for bad in (((half, 2, 0), 8), ((half, 0, half + 1), 8), (None, 0)):
    with pytest.raises(ValueError, match="expected"):
      launch_modes.next_link(*bad)


@pytest.mark.parametrize(
  "m,k,r,n",
  [
    (8, 4096, 1024, 14336),
    (8, 8192, 4096, 16384),
    (16, 8192, 2048, 16384),
    (16, 4096, 1024, 14336),
  ],
)
def test_fused_plan_bounds_the_split_k_partials_from_8_rows(m, k, r, n):
  """At M=8 and 16 the f32 split-K partials cost about 1 us a MiB beyond 0.5 MiB
  (PARTIAL_BW; 0.3-1.1 us a call measured): the plan takes fewer splits of at most 128
  columns there than at one row, about one tile an SM, and halves the partials at least."""
  p = planner.plan_decode_persistent(m, k, r, n, programs=132, stream_k=False)
  p1 = planner.plan_decode_persistent(1, k, r, n, programs=132)
  splits, splits1 = planner.cdiv(k, p.k_per), planner.cdiv(k, p1.k_per)
  assert 2 * splits <= splits1 and p.cols_r <= 128 < p1.cols_r
  assert 100 <= planner.cdiv(r, p.cols_r) * splits <= 132
  assert splits * m * r * 4 <= 2 * T.partial_free_bytes
  assert planner._partials_us(splits, m, r) < planner._partials_us(splits1, m, r)
  # the cost: nothing up to PARTIAL_FREE_BYTES, then linear
  assert planner._partials_us(1, 1, T.partial_free_bytes // 4) == 0
  assert planner._partials_us(2, 1, T.partial_free_bytes // 4) == pytest.approx(
    T.partial_free_bytes / T.partial_bw * 1e6
  )


def test_fused_plan_leaves_one_row_and_64_rows_alone():
  """The partials are not counted at M=1 (small) nor from 64 rows (PARTIALS_MAX_M; the
  default there is plan_decode_phase1's): the plans are those of a zero cost, unlike M=16's."""
  shapes = [(4096, 1024, 14336), (8192, 4096, 16384)]
  plans = {
    (m, s): planner.plan_decode_persistent(m, *s, programs=132)
    for m in (1, 16, 64, 128)
    for s in shapes
  }
  with policy.use(policy.current().with_values("planner", partial_free_bytes=1 << 40)):
    for (m, s), p in plans.items():
      free = planner.plan_decode_persistent(m, *s, programs=132)
      assert (free == p) == (m != 16), (m, s, p, free)


def test_v_resident_plan_takes_small_ranks_up_to_32_rows():
  """Ranks <= 256 at M <= 32 get the V-resident schedule (2048->256->512: 3.8-4.1 us against
  4.5-4.7 looping on the H200), with a CTA for every tile; larger ranks, 64 rows, wide-row
  requests and v_resident=False keep the looping phase 2."""
  for m, k, r, n in ((1, 2048, 256, 512), (32, 2048, 256, 512), (8, 4096, 152, 4096)):
    p = planner.plan_decode_persistent(m, k, r, n, programs=132)
    tiles = planner.cdiv(r, p.cols_r) * planner.cdiv(k, p.k_per) + planner.cdiv(n, p.cols_n)
    assert p.v_resident and p.prefetch == 0 and tiles <= 132, p
  assert planner.plan_decode_persistent(8, 4096, 152, 4096).cols_r == 80  # 64 + 64 tiles
  for m, k, r, n, kw in (
    (64, 2048, 256, 512, {}),
    (8, 4096, 512, 1024, {}),
    (8, 4096, 2560, 14336, {}),
    (8, 2048, 256, 512, {"v_resident": False}),
    (8, 2048, 256, 512, {"min_row_bytes": 512}),
  ):
    assert not planner.plan_decode_persistent(m, k, r, n, **kw).v_resident, (m, k, r, n, kw)


@pytest.mark.parametrize(
  "m,k,r,n,stream_k",
  [
    (2, 4096, 2560, 14336, True),
    (32, 4096, 1024, 14336, True),
    (1, 4096, 2560, 14336, False),  # one row: measured slower
    (4, 8192, 2048, 16384, False),  # K = 8192: measured slower
    (4, 8192, 2432, 8192, False),  # a rank of part-blocks
    (4, 4096, 1216, 4096, False),
    (4, 2048, 640, 2048, False),  # part-blocks, small ranks
    (64, 4096, 2560, 14336, False),
  ],
)  # P per tile large: two r-chunks
def test_stream_k_phase1_where_it_measured_faster(m, k, r, n, stream_k):
  """The stream-K phase 1 takes K <= 4096, 2-32 rows and ranks of whole 128-column blocks
  from 1024; its steps then cover every CTA, and phase 2 keeps the tiled plan's tiles."""
  p = planner.plan_decode_persistent(m, k, r, n)
  assert p.stream_k == stream_k, p
  if stream_k:
    tiled = planner.plan_decode_persistent(m, k, r, n, stream_k=False)
    assert (p.block_r, p.cols_r, p.r_chunks) == (128, 128, 1)
    assert planner.cdiv(r, 128) * planner.cdiv(k, p.block_k) >= p.programs
    assert (p.block_n, p.cols_n, p.prefetch) == (tiled.block_n, tiled.cols_n, tiled.prefetch)
  assert not planner.plan_decode_phase1(m, k, r, n).stream_k


@pytest.mark.parametrize(
  "m,k,r,n,deep",
  [
    (1, 8192, 4096, 16384, True),
    (2, 8192, 4096, 16384, True),
    (4, 8192, 4096, 16384, True),
    (8, 8192, 4096, 16384, False),  # from 8 rows: measured slower
    (2, 8192, 2048, 16384, False),
    (1, 4096, 2560, 14336, False),  # smaller ranks
    (2, 7168, 4096, 18432, False),  # 144-column (256-wide) V tiles: not measured
    (2, 1000, 4096, 1000, False),
  ],
)  # r-chunks (P per tile large)
def test_deep_phase2_steps_where_they_measured_faster(m, k, r, n, deep):
  """128-row phase-2 steps, 3 stages deep, at r >= 4096 and M <= 4 on one r-chunk of
  128-column V tiles; every other field as the plan without them."""
  p = planner.plan_decode_persistent(m, k, r, n)
  assert (p.block_kv, p.stages) == ((128, 3) if deep else (64, 4)), p
  if deep:
    assert p.r_chunks == 1 and p.block_n == 128 and not p.stream_k and not p.v_resident, p
    assert r % p.block_kv == 0


def test_deep_phase2_plans_estimate_phase1_at_their_own_stages():
  """The DEEP_KV plan's estimate counts phase 1 at its 3 stages: where a CTA's in-flight
  bytes bound its rate (a long DRAM round trip), fewer stages are estimated slower."""
  dims, rt = (2, 8192, 4096, 16384), 10.0
  deep = planner.plan_decode_persistent(*dims, round_trip_us=rt)
  with policy.use(policy.current().with_values("planner", deep_kv_min_r=1 << 30)):
    four = planner.plan_decode_persistent(*dims, round_trip_us=rt)
  assert (deep.stages, four.stages) == (3, 4)
  assert dataclasses.replace(deep, block_kv=64, stages=4, est_us=four.est_us) == four
  assert deep.est_us > 1.1 * four.est_us, (deep.est_us, four.est_us)
  assert planner.plan_decode_persistent(*dims).est_us == pytest.approx(
    planner.plan_decode_persistent(*dims, round_trip_us=0.0).est_us
  )  # share-bound: equal


def test_default_launch_follows_the_verified_jaxlibs(monkeypatch):
  """XLA's PTX and Triton calls are internal XLA mechanisms, verified on jaxlib 0.11.2: on
  0.11.x from 0.11.2 the kernels launch through XLA's Triton call (xla_triton: the persistent
  X·U·V decode kernel's served plans, the rest through the PTX call), on later jaxlibs through
  the PTX call alone (XLA marks its Triton call for removal), before 0.11.2 through jaxlib's
  handler; LRJAX_TRITON_LAUNCH overrides any of them, and a mode that does not exist is named."""
  import jaxlib.version

  for version, want in (
    ((0, 10, 2), "jaxlib"),
    ((0, 11, 1), "jaxlib"),
    ((0, 11, 2), "xla_triton"),
    ((0, 11, 5), "xla_triton"),
    ((0, 12, 0), "xla"),
    ((1, 0, 0), "xla"),
  ):
    monkeypatch.setattr(jaxlib.version, "__version_info__", version)
    assert launch_modes._default_launch() == want, version
  monkeypatch.setattr(launch_modes, "DEFAULT_LAUNCH", "xla")
  monkeypatch.delenv("LRJAX_TRITON_LAUNCH", raising=False)
  assert launch_modes.launch_mode() == "xla"
  monkeypatch.setenv("LRJAX_TRITON_LAUNCH", "jaxlib")
  assert launch_modes.launch_mode() == "jaxlib"
  monkeypatch.setenv("LRJAX_TRITON_LAUNCH", "ptx")
  with pytest.raises(ValueError, match="'ptx'.*xla"):
    launch_modes.launch_mode()


def test_part_len_covers_n_in_whole_steps():
  """planner.part_len, the split every kernel's K and rank ranges use: each part whole steps,
  the parts it implies cover n, one step less would need more parts."""
  for n, parts, step in ((1000, 3, 64), (8192, 13, 64), (64, 5, 64), (14336, 111, 128)):
    size = planner.part_len(n, parts, step)
    assert size % step == 0 and planner.cdiv(n, size) <= parts
    assert size == step or planner.cdiv(n, size - step) > parts
  assert planner.part_len(1000, 3, 64) == 384
  assert [planner.round_up(n, 32) for n in (2456, 152, 2432, 1)] == [2464, 160, 2432, 32]


@pytest.mark.parametrize(
  "m,r,n,block_m",
  [
    # the rows the A/B found fastest (benchmarks/results/gpu_xuv_decode_pv_launch_h200.json)
    (128, 256, 512, 16),
    (64, 256, 512, 16),
    (128, 152, 4096, 64),
    (64, 152, 4096, 64),
    (48, 152, 4096, 64),
    (128, 640, 2048, 32),
    (64, 640, 2048, 32),
    (128, 544, 1024, 32),
    (128, 512, 1024, 32),
    (64, 512, 1024, 16),
    (1, 72, 130, 16),
  ],
)
def test_pv_launch_tiles_take_the_tallest_rows_that_keep_a_wave(m, r, n, block_m):
  """planner.plan_pv_launch: 32-column tiles, the tallest row block of 64/32 whose f32 P tile
  is at most PV_LAUNCH_P_TILE_BYTES and that leaves PV_LAUNCH_MIN_TILES tiles, else 16."""
  p = planner.plan_pv_launch(m, r, n)
  assert (p.block_m, p.block_n) == (block_m, T.pv_launch_cols), p
  tiles = lambda bm: planner.cdiv(m, bm) * planner.cdiv(n, p.block_n)  # noqa: E731
  if block_m > 16:
    assert block_m * r * 4 <= T.pv_launch_p_tile_bytes
    assert tiles(block_m) >= T.pv_launch_min_tiles
  taller = [bm for bm in (64, 32) if bm > block_m]
  assert all(
    bm * r * 4 > T.pv_launch_p_tile_bytes or tiles(bm) < T.pv_launch_min_tiles for bm in taller
  ), p


@pytest.mark.parametrize(
  "fields,names",
  [
    (dict(cols_r=112), "cols_r=112, block_r=64"),  # the kernel would leave 48 columns at 0
    (dict(cols_n=80, block_n=64), "cols_n=80, block_n=64"),
    (dict(k_per=96), "k_per=96, block_k=64"),  # its last K step would overlap the next tile
    (dict(programs=0), "programs=0"),
  ],
)
def test_persistent_plans_outside_the_kernels_bounds_are_refused(fields, names):
  """A PersistentDecodePlan the kernel would run to a wrong P (more columns a tile than its
  registers hold, K ranges that are not whole K steps, no CTAs) is refused where it is built,
  naming the fields: a hand-edited plan (decode_ab.py's variants) once gave P 0.65 off with
  cols_r=112 on a 64-column plan."""
  p = planner.plan_decode_phase1(64, 1408, 2456, 64, programs=132)
  assert (p.block_r, p.block_k) == (64, 64)
  with pytest.raises(ValueError, match=names):
    dataclasses.replace(p, **fields)
