"""GPU tests of the residual epilogue (lowering/residual.py's ``lr_residual`` on CUDA): the
decode X·U·V kernels and the SwiGLU decode kernels given ``residual=`` against a float64 host
reference (the op's output rounded, plus the residual, rounded), with every schedule that
stores an output, and the model's decode step with its residual adds folded in
(``pytest -m gpu``)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, randn, rel_err, tolerance
from test_decode_attention_gpu import _REASON
from test_rms_norm_gpu import SWIGLU_KINDS, _lowrank_decode, _normed, _norm_operands, swiglu_case
from test_triton_kernels_gpu import lr_factors, mlp_params, mlp_ref, poisoned, rnd, xuv_ref
from lrjax.custom_calls.triton import planner

pytestmark = [
  pytest.mark.gpu,
  pytest.mark.skipif(_REASON is not None, reason=f"needs an NVIDIA GPU: {_REASON}"),
]


def _with_residual(y, res, dtype):
  """The op's output rounded to dtype, plus the residual, rounded: XLA's ``res + y``."""
  return rnd(rnd(y, dtype) + np.asarray(jnp.asarray(res, jnp.float32), np.float64), dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
  "shape", [(1, 4096, 1216, 4096), (3, 1000, 200, 300), (16, 4096, 512, 1024), (77, 512, 136, 520)]
)
@pytest.mark.parametrize("kind", ["persistent", "persistent_p16", "pv_xla", "pv_launch", "tiled"])
def test_xuv_decode_adds_the_residual_as_it_stores_y(kind, shape, dtype):
  from lrjax.custom_calls.triton import xuv_decode

  m, k, r, n = shape
  x = randn((m, k), dtype)
  u, v = lr_factors(k, r, n, dtype)
  res = randn((m, n), dtype, 4.0)  # larger than y: a dropped or doubled add shows
  if kind.startswith("persistent"):
    p = planner.plan_decode_persistent(m, k, r, n)
    if kind.endswith("p16"):
      p = dataclasses.replace(p, p16=True, v_resident=False, stream_k=False)
    fn = lambda x, u, v, o, res: xuv_decode._xuv_decode(  # noqa: E731
      x, u, v, out=o, persistent=p, pv="kernel", residual=res
    )
  elif kind == "pv_xla":
    p = planner.plan_decode_phase1(m, k, r, n)
    fn = lambda x, u, v, o, res: xuv_decode._xuv_decode(  # noqa: E731
      x, u, v, persistent=p, pv="xla", residual=res
    )
  elif kind == "pv_launch":
    p = planner.plan_decode_phase1(m, k, r, n)
    fn = lambda x, u, v, o, res: xuv_decode._xuv_decode(  # noqa: E731
      x, u, v, out=o, persistent=p, pv="launch", residual=res
    )
  else:
    fn = lambda x, u, v, o, res: xuv_decode._xuv_decode(  # noqa: E731
      x, u, v, out=o, persistent=False, residual=res
    )
  out = jax.jit(fn)(x, u, v, poisoned((m, n), dtype), res)
  assert_close(out, _with_residual(xuv_ref(x, u, v, None, dtype), res, dtype), dtype)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize(
  "shape",
  [
    (1, 200, 520, 72, 40),
    (5, 512, 1000, 96, 136),
    (16, 4096, 2816, 256, 256),
    (100, 4096, 1400, 256, 192),
  ],
)
@pytest.mark.parametrize("kind", SWIGLU_KINDS)
def test_swiglu_kernels_add_the_residual_as_they_store_y(kind, shape, norm):
  from lrjax.custom_calls.triton import mlp_decode

  dtype = jnp.bfloat16
  m, d = shape[:2]
  gate, up, down, x, kw = swiglu_case(kind, shape, dtype)
  res = randn((m, d), dtype, 4.0)
  w, eps = _norm_operands(d, 1e-5)

  def run(x, g, u, dn, w, o, res):
    nm = (w, eps) if norm else None
    return mlp_decode._mlp_decode(x, u, dn, g, norm=nm, out=o, residual=res, **kw)

  o = None if kind == "compose" else poisoned((m, d), dtype)
  out = jax.jit(run)(x, gate, up, down, w, o, res)
  xn = _normed(x, w, eps) if norm else x
  assert_close(out, _with_residual(mlp_ref(xn, gate, up, down, "silu", dtype), res, dtype), dtype)


def test_model_decode_with_its_residual_adds_in_the_kernels(monkeypatch):
  """The low-rank model's decode step with both residual adds of each layer folded into the
  o_proj and SwiGLU kernels (prefer_kernels: with the norms in the kernels): no add of the hidden
  state left to XLA (four with XLA's lowering: two layers, two adds), and logits as close to
  the f32 model's as XLA's."""
  from lrjax.custom_calls.triton import lowering as cuda_lowering

  seen = {}

  def count(step, toks, cache):  # adds of the [4, 1, hidden] bf16 residual stream
    text = step.lower(toks, cache).as_text()
    seen["adds"] = sum(
      1 for ln in text.splitlines() if "stablehlo.add" in ln and "tensor<4x1x64xbf16>" in ln
    )

  truth = np.asarray(_lowrank_decode("f32"), np.float64)
  xla = _lowrank_decode("xla")
  monkeypatch.setattr(cuda_lowering, "NORM_GPU_VERIFIED", True)
  monkeypatch.setattr(cuda_lowering, "RESIDUAL_GPU_VERIFIED", False)
  _lowrank_decode("kernels", count)
  assert seen["adds"] == 4, seen  # the count sees the adds where XLA does them
  monkeypatch.setattr(cuda_lowering, "RESIDUAL_GPU_VERIFIED", True)
  got = _lowrank_decode("kernels", count)
  assert seen["adds"] == 0, seen
  kernel_err, xla_err = rel_err(got, truth), rel_err(xla, truth)
  assert kernel_err <= max(1.5 * xla_err, tolerance(jnp.bfloat16)), (kernel_err, xla_err)


def test_rank_space_scaled_ops_add_the_residual():
  """With a rank-space scale (phase 1 in the kernel, the scale and ·V by XLA; the MLP as its
  composed calls) the residual is added by XLA or by the down call: the output is the same
  call's without it, plus the residual."""
  from lrjax.custom_calls.triton import mlp_decode, xuv_decode

  dtype = jnp.bfloat16
  m, k, r, n = 4, 1024, 256, 512
  x = randn((m, k), dtype)
  u, v = lr_factors(k, r, n, dtype)
  s = 1.0 + randn((r,), dtype, 0.3)
  res = randn((m, n), dtype, 4.0)
  plain, got = jax.jit(
    lambda x, res: (
      xuv_decode.xuv_decode(x, u, v, scale=s),
      xuv_decode.xuv_decode(x, u, v, scale=s, residual=res),
    )
  )(x, res)
  assert_close(got, _with_residual(np.asarray(plain, np.float64), res, dtype), dtype)
  gate, up, down = mlp_params(k, 1000, 136, 96, k, dtype, True, False)
  sc = [1.0 + randn((p[0].shape[1],), dtype, 0.3) for p in (gate, up, down)]
  gate, up, down = ((*p, None, c) for p, c in zip((gate, up, down), sc))
  res = randn((m, k), dtype, 4.0)
  plain, got = jax.jit(
    lambda x, res: (
      mlp_decode.mlp_decode_scaled(x, up, down, gate),
      mlp_decode.mlp_decode_scaled(x, up, down, gate, residual=res),
    )
  )(x, res)
  assert_close(got, _with_residual(np.asarray(plain, np.float64), res, dtype), dtype)
