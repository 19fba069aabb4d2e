"""lr_mlp_rank: reference against float64, the composition lr_mlp = (x·U, lr_mlp_rank, ·Vd),
vmap, gradients, the registry lowering and input validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from conftest import assert_close, randn, tolerance
from lrjax.lowering import lr_mlp_reference, registry
from lrjax.lowering.mlp_rank import lr_mlp_rank, lr_mlp_rank_reference

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
ACTS = {
  "silu": lambda h: h / (1 + np.exp(-h)),
  "relu": lambda h: np.maximum(h, 0),
}


def _operands(lead, rg, ru, f, rd, dtype, bias):
  pg, pu = randn(lead + (rg,), dtype), randn(lead + (ru,), dtype)
  vg, vu = randn((rg, f), dtype, rg**-0.5), randn((ru, f), dtype, ru**-0.5)
  b = lambda: (randn((f,), dtype, 0.1),) if bias else ()  # noqa: E731
  ud = randn((f, rd), dtype, f**-0.5)
  return pg, (vg, *b()), pu, (vu, *b()), ud


def _f64(p, vb):
  y = np.asarray(p, np.float64) @ np.asarray(vb[0], np.float64)
  return y + np.asarray(vb[1], np.float64) if len(vb) == 2 else y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
  "gated,act,bias,lead,rg,ru,f,rd",
  [
    (True, "silu", True, (2, 3), 12, 20, 40, 9),
    (True, "silu", False, (1,), 7, 7, 33, 5),
    (False, "relu", True, (17,), 5, 5, 24, 3),
  ],
)
def test_matches_f64(dtype, gated, act, bias, lead, rg, ru, f, rd):
  pg, gate, pu, up, ud = _operands(lead, rg, ru, f, rd, dtype, bias)
  kw = dict(pg=pg, gate=gate) if gated else {}
  y = jax.jit(lambda: lr_mlp_rank(pu, up, ud, act=act, **kw))()
  assert y.shape == lead + (rd,) and y.dtype == dtype
  h = _f64(pu, up)
  h = ACTS[act](_f64(pg, gate)) * h if gated else ACTS[act](h)
  ud64 = np.asarray(ud, np.float64)
  # relative to the sum of the terms' magnitudes: the intermediate is rounded to the dtype, so
  # an output whose terms cancel carries their rounding, not its own size's
  err = np.linalg.norm(np.asarray(y, np.float64) - h @ ud64)
  assert err <= 2 * tolerance(dtype) * np.linalg.norm(np.abs(h) @ np.abs(ud64)), err


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_composes_lr_mlp(dtype):
  """lr_mlp = x·U of gate and up → lr_mlp_rank → ·Vd, with the roundings lr_mlp makes."""
  d, f, r = 24, 56, 8
  x = randn((5, d), dtype)
  ug, uu = randn((d, r), dtype, d**-0.5), randn((d, r), dtype, d**-0.5)
  pg, gate, pu, up, ud = _operands((5,), r, r, f, r, dtype, True)
  vd = randn((r, d), dtype, r**-0.5)
  ref = lr_mlp_reference(x, (uu, *up), (ud, vd), gate=(ug, *gate))
  p = lambda u: jnp.matmul(x, u, preferred_element_type=dtype)  # noqa: E731
  s = lr_mlp_rank(p(uu), up, ud, pg=p(ug), gate=gate, inter_dtype=dtype, out_dtype=dtype)
  assert_close(jnp.matmul(s, vd, preferred_element_type=dtype), ref, dtype)


def test_vmap_and_grads():
  pg, gate, pu, up, ud = _operands((4,), 6, 6, 20, 5, jnp.float32, True)
  f = lambda pg, pu: lr_mlp_rank(pu, up, ud, pg=pg, gate=gate)  # noqa: E731
  pgs, pus = randn((3, 4, 6)), randn((3, 4, 6))
  out = jax.vmap(f)(pgs, pus)
  want = jnp.stack([lr_mlp_rank_reference(pus[i], up, ud, pg=pgs[i], gate=gate) for i in range(3)])
  assert_close(out, want, jnp.float32)
  # weights batched too: the rule falls back to vmapping the reference
  vus = randn((3,) + up[0].shape)
  out = jax.vmap(lambda v, p: lr_mlp_rank(p, (v, up[1]), ud, pg=pg, gate=gate))(vus, pus)
  want = jnp.stack(
    [lr_mlp_rank_reference(pus[i], (vus[i], up[1]), ud, pg=pg, gate=gate) for i in range(3)]
  )
  assert_close(out, want, jnp.float32)
  # central differences at 1e-3, not check_grads' f32 default of 1e-4, whose rounding error
  # on fresh random operands failed about 1 run in 100 (0 in 300 at 1e-3)
  check_grads(lambda pg, pu, u: lr_mlp_rank(pu, up, u, pg=pg, gate=gate), (pg, pu, ud), 1, eps=1e-3)


def test_kernel_lowering_is_selected_on_one_device():
  """A registered kernel serves lr_mlp_rank on a single device (the registry's usual path)."""
  calls = []

  def load():
    def impl(*ops, **params):
      calls.append(tuple(o.shape for o in ops))
      from lrjax.lowering.mlp_rank import _reference

      return _reference(*ops, **params) * 2.0

    return impl

  k = registry.KernelLowering("lr_mlp_rank", "cpu", "test.mlp_rank_x2", lambda a, p: None, load)
  registry.register(k)
  try:
    pg, gate, pu, up, ud = _operands((3,), 4, 4, 8, 2, jnp.float32, False)
    y = jax.jit(lambda: lr_mlp_rank(pu, up, ud, pg=pg, gate=gate))()
  finally:
    registry.unregister("lr_mlp_rank", "cpu", "test.mlp_rank_x2")
  assert calls == [((3, 4), (4, 8), (3, 4), (4, 8), (8, 2))]
  assert_close(y, 2.0 * lr_mlp_rank_reference(pu, up, ud, pg=pg, gate=gate), jnp.float32)


def test_errors_name_the_fix():
  pg, gate, pu, up, ud = _operands((3,), 4, 4, 8, 2, jnp.float32, False)
  with pytest.raises(ValueError, match="together"):
    lr_mlp_rank(pu, up, ud, pg=pg)
  with pytest.raises(ValueError, match="intermediate width"):
    lr_mlp_rank(pu, up, randn((9, 2)), pg=pg, gate=gate)
  with pytest.raises(ValueError, match="disagree on the rank"):
    lr_mlp_rank(randn((3, 5)), up, ud)
  with pytest.raises(ValueError, match="not supported"):
    lr_mlp_rank(pu, up, ud, act="tanh")
  with pytest.raises(TypeError, match="dtype"):
    lr_mlp_rank(pu.astype(jnp.int32), up, ud)
