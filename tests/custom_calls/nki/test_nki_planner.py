"""The block planner against the paper's model (eq. 10-11) and Table 4."""

import jax.numpy as jnp
import pytest

from lrjax.custom_calls.nki import planner

# Table 4: DeepSeek-V3 up_proj, X [4096, 7168], U [7168, 4096], V [4096, 18432], bf16, O^T.
T4 = dict(M=4096, K=7168, r=4096, N=18432)
T4_AI = {128: 124.12, 256: 240.94, 512: 455.10, 1024: 819.17}  # paper, no spill
T4_SPILLS = {128: False, 256: False, 512: False, 1024: False, 2048: True, 4096: True}


@pytest.mark.parametrize("bm,ai", sorted(T4_AI.items()))
def test_eq10_matches_table4_where_nothing_spills(bm, ai):
  assert planner.ai_eq10(T4["M"], T4["K"], T4["r"], T4["N"], bm, 2) == pytest.approx(ai, abs=0.05)


@pytest.mark.parametrize("bm,spills", sorted(T4_SPILLS.items()))
def test_table4_spill_pattern(bm, spills):
  p = planner.best_for_bm("xuv", *T4.values(), jnp.bfloat16, bm, out_t=True)
  assert p is not None and p.psum_tiles <= planner.PSUM_BANKS
  assert (not p.fits) == spills, p.summary()
  if spills:
    with pytest.raises(planner.PlanError):
      planner.plan("xuv", *T4.values(), jnp.bfloat16, out_t=True, blocks=p.blocks)


def test_plan_for_table4_shape_fits_and_is_compute_bound():
  p = planner.plan("xuv", *T4.values(), jnp.bfloat16, out_t=True)
  assert p.fits and p.compute_bound
  assert p.blocks.bm <= 1024
  assert p.sbuf_pipelined_bytes <= planner.SBUF_BYTES
  assert p.sbuf_eq11_bytes == planner.sbuf_eq11(T4["r"], p.blocks, 2)


def test_eq11_is_our_single_buffer_footprint_without_bias():
  b = planner.Blocks(512, 1024, 256, 512)
  p = planner.evaluate("xuv", 1024, 2048, 1024, 4096, jnp.bfloat16, b, out_t=True)
  assert p.sbuf_peak_bytes == p.sbuf_eq11_bytes == (512 * 1024 + (512 + 256) * 1024) * 2


def test_plan_refuses_when_nothing_fits():
  with pytest.raises(planner.PlanError, match="no block choice fits"):
    planner.plan("xuv", 4096, 4096, 65536, 4096, jnp.bfloat16)


def test_bad_blocks_and_dims_raise_value_error():
  with pytest.raises(ValueError, match="multiples of 128"):
    planner.evaluate("xuv", 256, 256, 256, 256, 2, (256, 256, 256, 200))
  with pytest.raises(ValueError, match="M=0"):
    planner.plan("xuv", 0, 128, 128, 128, 2)
  assert planner.pad128(1) == 128 and planner.pad128(129) == 256
