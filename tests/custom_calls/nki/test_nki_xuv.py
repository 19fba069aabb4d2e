"""XUV TrainiumFusion kernel on the NKI test double: numerics, traffic, footprint.

Shapes that are not multiples of 128 are zero-padded by ``xuv.prepare`` (not masked);
the padded output rows/columns are sliced off by ``xuv.finish``.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close
from lrjax.custom_calls.nki import planner
from lrjax.lowering import lr_xuv_reference
from nki_helpers import hbm_total, j, on_double, rand

SHAPES = [  # (M, K, r, N)
  (1, 128, 128, 128),  # decode: one row
  (300, 200, 130, 250),  # nothing a multiple of 128
  (257, 384, 256, 520),
  (512, 256, 384, 640),
]


def run_xuv(M, K, r, N, dtype, *, out_t=False, x_transposed=False, bias=False, blocks=None):
  d, (mod,) = on_double("xuv")
  x = rand((M, K), dtype)
  u = rand((K, r), dtype, scale=K**-0.5)
  v = rand((r, N), dtype, scale=r**-0.5)
  b = rand((N,), dtype) if bias else None
  xin = np.ascontiguousarray(x.T) if x_transposed else x
  bs = (
    mod.BlockSizes(*blocks[:4], x_cache=blocks[4] if len(blocks) > 4 else False) if blocks else None
  )
  args, kw, shape = mod.prepare(
    xin, u, v, b, xp=np, out_t=out_t, x_transposed=x_transposed, block_sizes=bs
  )
  kern = mod.xuv_bias_kernel if bias else mod.xuv_kernel
  out = mod.finish(kern(*args, **kw), shape, out_t)
  ref = lr_xuv_reference(j(x), j(u), j(v), j(b))
  return d, kw, out, ref


LAYOUTS = [(False, False, True), (True, False, False), (True, True, True), (False, True, False)]
CASES = (
  [(s, jnp.bfloat16, lay) for s in SHAPES for lay in LAYOUTS[:2]]
  + [(s, jnp.float16, lay) for s, lay in zip(SHAPES, LAYOUTS[::-1])]
  + [(SHAPES[1], jnp.bfloat16, LAYOUTS[2]), (SHAPES[2], jnp.bfloat16, LAYOUTS[3])]
)


@pytest.mark.parametrize("shape,dtype,layout", CASES)
def test_xuv_matches_reference_and_planner(shape, dtype, layout):
  (M, K, r, N), (out_t, x_transposed, bias) = shape, layout
  d, kw, out, ref = run_xuv(M, K, r, N, dtype, out_t=out_t, x_transposed=x_transposed, bias=bias)
  assert out.dtype == np.dtype(dtype)
  assert_close(out.T if out_t else out, ref, dtype)
  p = planner.evaluate(
    "xuv",
    M,
    K,
    r,
    N,
    dtype,
    planner.Blocks(kw["bm"], kw["bk"], kw["br"], kw["bn"], kw["x_cache"]),
    out_t=out_t,
    x_transposed=x_transposed,
    n_bias=int(bias),
  )
  assert p.fits
  assert d.hbm_read_bytes == p.traffic.reads
  assert d.hbm_write_bytes == p.traffic.writes
  assert d.reads_by_arg["x"] == p.traffic.x
  assert d.reads_by_arg["u"] == p.traffic.u
  assert d.reads_by_arg["v"] == p.traffic.v
  assert d.flops == p.flops
  assert d.peak_sbuf_bytes == p.sbuf_peak_bytes


@pytest.mark.parametrize(
  "blocks", [(128, 128, 128, 128), (256, 128, 128, 512), (128, 384, 384, 256)]
)
def test_xuv_explicit_blocks(blocks):
  M, K, r, N = 256, 384, 384, 512
  bm, bk, br, bn = blocks
  d, kw, out, ref = run_xuv(M, K, r, N, jnp.bfloat16, blocks=blocks)
  assert_close(out, ref, jnp.bfloat16)
  s = 2
  # X is read once per (row strip, rank block); U and V once per row strip; O written once.
  assert d.reads_by_arg["x"] == M * K * s * (r // br)
  assert d.reads_by_arg["u"] == (M // bm) * K * r * s
  assert d.reads_by_arg["v"] == (M // bm) * r * N * s
  assert d.hbm_write_bytes == M * N * s
  assert hbm_total(d) == planner.evaluate("xuv", M, K, r, N, s, blocks).traffic.total


@pytest.mark.parametrize(
  "blocks",
  [
    (256, 256, 256, 512, False),  # B_r = r: one rank block
    (256, 128, 128, 512, True),
  ],
)  # B_r < r, X^T strip cached
def test_xuv_reads_x_and_u_once_per_strip(blocks):
  M, K, r, N = 512, 256, 256, 1024
  d, kw, out, ref = run_xuv(M, K, r, N, jnp.bfloat16, blocks=blocks)
  assert kw["x_cache"] == blocks[4]
  assert_close(out, ref, jnp.bfloat16)
  assert d.reads_by_arg["x"] == M * K * 2  # every element of X exactly once
  assert d.reads_by_arg["u"] == (M // 256) * K * r * 2  # U once per row strip
  p = planner.evaluate("xuv", M, K, r, N, 2, planner.Blocks(*blocks))
  assert hbm_total(d) == p.traffic.total and d.peak_sbuf_bytes == p.sbuf_peak_bytes


def test_planner_rejects_blocks_that_spill():
  with pytest.raises(planner.PlanError, match="SBUF"):
    planner.plan(
      "xuv", 4096, 7168, 4096, 18432, jnp.bfloat16, out_t=True, blocks=(2048, 512, 128, 256)
    )


@pytest.mark.parametrize(
  "shape,dtype,layout",
  [
    ((300, 200, 130, 250), jnp.bfloat16, (False, False, True)),
    ((257, 384, 256, 520), jnp.float16, (True, True, False)),
    ((1, 128, 128, 128), jnp.bfloat16, (False, True, True)),
  ],
)
def test_xuv_rank_space_scale(shape, dtype, layout):
  """((X·U) ⊙ s)·V: the strip is scaled after its rounding, as the reference does it; the
  scale is read once per launch and held in SBUF ([P, r/P]), which the planner counts."""
  (M, K, r, N), (out_t, x_transposed, bias) = shape, layout
  d, (mod,) = on_double("xuv")
  x = rand((M, K), dtype)
  u = rand((K, r), dtype, scale=K**-0.5)
  v = rand((r, N), dtype, scale=r**-0.5)
  s = rand((r,), dtype, scale=3.0)
  b = rand((N,), dtype) if bias else None
  xin = np.ascontiguousarray(x.T) if x_transposed else x
  args, kw, sh = mod.prepare(xin, u, v, b, s, xp=np, out_t=out_t, x_transposed=x_transposed)
  out = mod.finish(mod.kernel_for(bias, True)(*args, **kw), sh, out_t)
  ref = lr_xuv_reference(j(x), j(u), j(v), j(b), scale=j(s))
  assert_close(out.T if out_t else out, ref, dtype)
  unscaled = lr_xuv_reference(j(x), j(u), j(v), j(b))
  assert not np.allclose(np.asarray(ref, np.float32), np.asarray(unscaled, np.float32), rtol=0.1)
  p = planner.evaluate(
    "xuv",
    M,
    K,
    r,
    N,
    dtype,
    planner.Blocks(kw["bm"], kw["bk"], kw["br"], kw["bn"], kw["x_cache"]),
    out_t=out_t,
    x_transposed=x_transposed,
    n_bias=int(bias),
    n_scale=1,
  )
  assert p.traffic.scale == planner.pad128(r) * np.dtype(dtype).itemsize
  assert d.hbm_read_bytes == p.traffic.reads and d.hbm_write_bytes == p.traffic.writes
  assert d.peak_sbuf_bytes == p.sbuf_peak_bytes
