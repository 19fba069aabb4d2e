"""CPU tests of benchmarks/xla_p_handover.py: its points, the forms of P it hands XLA (each
the same product) and its list of a module's ENTRY kernels (the timing itself needs a GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest


@pytest.fixture(scope="module")
def ph(load_benchmark):
  return load_benchmark("xla_p_handover")


def test_points_are_three_positive_integers(ph):
  assert ph.parse_point("128,256,512") == (128, 256, 512)
  for bad in ("128,256", "128,256,x", "0,256,512", "128,256,512,1"):
    with pytest.raises(ValueError, match="M,r,N|positive"):
      ph.parse_point(bad)


def test_every_form_computes_the_rounded_product(ph):
  m, r, n = 5, 24, 40
  kp, kv = jax.random.split(jax.random.key(0))
  p = jax.random.normal(kp, (m, r), jnp.float32)
  v = jax.random.normal(kv, (r, n), jnp.float32).astype(jnp.bfloat16)
  want = np.asarray(p.astype(jnp.bfloat16), np.float64) @ np.asarray(v, np.float64)
  held = {
    "bf16": p.astype(jnp.bfloat16),
    "f32": p,
    "f32_slice": jnp.concatenate([p.reshape(-1), jnp.full((m * r,), jnp.nan)]),
    "f32_flat": p.reshape(-1),
    "f32_rows": jnp.concatenate([jnp.full_like(p, jnp.nan), p, jnp.full_like(p, jnp.nan)]),
  }
  for form in ph.FORMS:
    got = np.asarray(ph.form_fn(form, m, r)(jnp.zeros(1), held[form], v), np.float64)
    np.testing.assert_allclose(
      got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max(), err_msg=form
    )  # the slice forms never read their NaN rows


def test_entry_kernels_lists_fusions_and_custom_calls_in_order(ph):
  hlo = "\n".join(
    [
      "%fused_convert (p: f32[128,256]) -> bf16[128,256] {",
      "  %c = bf16[128,256]{1,0} fusion(f32[128,256]{1,0} %p), kind=kLoop, calls=%x",
      "}",
      "ENTRY %main (a: f32[65536], b: bf16[256,512]) -> bf16[128,512] {",
      "  %s = bf16[128,256]{1,0} fusion(f32[65536]{0} %a), kind=kLoop, calls=%fused_convert",
      "  %g = f32[4,128,512]{2,1,0} fusion(bf16[128,256]{1,0} %s, bf16[256,512]{1,0} %b), "
      'kind=kCustom, calls=%gemm, backend_config={"fusion_backend_config":'
      '{"kind":"__triton_nested_gemm_fusion"}}',
      '  %cc = (f32[1]{0}) custom-call(f32[1]{0} %z), custom_call_target="__gpu$xla.gpu.triton"',
      "  ROOT %r = bf16[128,512]{1,0} fusion(f32[4,128,512]{2,1,0} %g), kind=kInput, calls=%red",
      "}",
    ]
  )
  assert ph.entry_kernels(hlo) == [
    "fusion:kLoop",
    "fusion:kCustom/__triton_nested_gemm_fusion",
    "custom-call:__gpu$xla.gpu.triton",
    "fusion:kInput",
  ]
