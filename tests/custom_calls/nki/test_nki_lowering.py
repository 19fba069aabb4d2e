"""The Neuron kernels: light import, guarded registration, would_serve, hardware test."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, randn
from lrjax.custom_calls import kernel_catalog
from lrjax.custom_calls.nki import _api, lowering
from lrjax.lowering import lr_mlp, lr_mlp_reference, lr_xuv, lr_xuv_reference, registry

S = jax.ShapeDtypeStruct
BF = jnp.dtype(jnp.bfloat16)
HAVE_NEURON = lowering.neuron_available()


def xuv_params(dt=BF, has_bias=False):
  return dict(has_bias=has_bias, inter_dtype=jnp.dtype(dt), out_dtype=jnp.dtype(dt))


def test_catalog_lists_nki_kernels_for_neuron():
  kernels = kernel_catalog()["neuron"]
  assert {(k.primitive, k.platform) for k in kernels} == {
    ("lr_xuv", "neuron"),
    ("lr_mlp", "neuron"),
  }


@pytest.mark.skipif(HAVE_NEURON, reason="checks the no-Neuron path")
def test_register_is_a_no_op_without_neuron():
  lowering.register()
  names = {k.name for k in registry.candidates("lr_xuv", "neuron")}
  assert not names & {k.name for k in lowering.KERNELS}


def test_would_serve_xuv():
  av = [S((4, 300, 4096), BF), S((4096, 1000), BF), S((1000, 11008), BF), S((11008,), BF)]
  name, why = lowering.would_serve("lr_xuv", av, xuv_params(has_bias=True))
  assert name == "nki.xuv_trainium_fusion" and "blocks" in why
  f32 = [S(a.shape, jnp.float32) for a in av]
  name, why = lowering.would_serve("lr_xuv", f32, xuv_params(jnp.float32, True))
  assert name is None and "x.dtype=float32" in why
  p = dict(xuv_params(has_bias=True), inter_dtype=jnp.dtype(jnp.float32))
  name, why = lowering.would_serve("lr_xuv", av, p)
  assert name is None and "inter_dtype=float32" in why
  huge = [S((4096, 4096), BF), S((4096, 65536), BF), S((65536, 4096), BF)]
  name, why = lowering.would_serve("lr_xuv", huge, xuv_params())
  assert name is None and "no block choice fits" in why
  assert lowering.would_serve("lr_attention", av, {}) == (None, "no NKI kernel for lr_attention")


def test_would_serve_mlp():
  x = S((2, 77, 2048), BF)
  ops = [
    x,
    S((2048, 500), BF),
    S((500, 8192), BF),
    S((2048, 512), BF),
    S((512, 8192), BF),
    S((8192,), BF),
    S((8192, 400), BF),
    S((400, 2048), BF),
  ]
  params = dict(
    gated=True, act="gelu_tanh", bias_mask=(False, True, False), inter_dtype=BF, out_dtype=BF
  )
  name, why = lowering.would_serve("lr_mlp", ops, params)
  assert name == "nki.mlp_up_gate_down" and "mlp_up_gate" in why and "xuv" in why
  name, why = lowering.would_serve("lr_mlp", ops, dict(params, act="swish"))
  assert name is None and "act='swish'" in why


@pytest.mark.skipif(_api.available(), reason="checks the placeholder used without NKI")
def test_kernel_modules_import_without_nki_and_fail_clearly_when_run():
  from lrjax.custom_calls.nki import xuv

  assert xuv.BlockSizes.get_default(4096, 7168, 4096, 18432, jnp.bfloat16, out_t=True).bm == 1024
  x = np.ones((128, 128), np.float16)
  with pytest.raises(ImportError, match="Neuron SDK"):
    xuv.xuv_kernel(x, x, x, bm=128, bk=128, br=128, bn=128, out_t=False, x_transposed=False)


def test_jax_entry_points_on_the_double():
  """xuv.xuv / mlp.mlp (what load() returns impls around) with jax arrays, run on the double."""
  from nki_helpers import on_double

  d, (xv, ug) = on_double("xuv", "mlp_up_gate")
  dt = jnp.bfloat16
  x, u, v, b = (
    randn((2, 5, 200), dt),
    randn((200, 130), dt, 0.07),
    randn((130, 300), dt, 0.09),
    randn((300,), dt),
  )
  y = xv.xuv(x, u, v, b)
  assert y.shape == (2, 5, 300)
  assert_close(y, lr_xuv_reference(x, u, v, b), dt)
  up, gate, down = (
    (u, randn((130, 256), dt, 0.09)),
    (randn((200, 64), dt, 0.07), randn((64, 256), dt, 0.12)),
    (randn((256, 96), dt, 0.06), randn((96, 200), dt, 0.1), randn((200,), dt)),
  )
  from lrjax.custom_calls.nki import mlp

  z = mlp.mlp(x, up, down, gate, act="silu", up_gate_mod=ug, xuv_mod=xv)
  assert z.shape == (2, 5, 200)
  assert_close(z, lr_mlp_reference(x, up, down, gate), dt)
  assert d.flops > 0 and d.hbm_read_bytes > 0


@pytest.mark.neuron
@pytest.mark.skipif(not HAVE_NEURON, reason="needs Trainium with the Neuron SDK (nki, jax_neuronx)")
@pytest.mark.parametrize("M", [1, 300])
def test_neuron_lowering_matches_reference(M):
  dt = jnp.bfloat16
  x, u, v, b = (
    randn((M, 1000), dt),
    randn((1000, 256), dt, 0.03),
    randn((256, 700), dt, 0.06),
    randn((700,), dt),
  )
  assert_close(jax.jit(lr_xuv)(x, u, v, b), lr_xuv_reference(x, u, v, b), dt)
  up, gate, down = (
    (randn((1000, 256), dt, 0.03), randn((256, 640), dt, 0.06)),
    (randn((1000, 200), dt, 0.03), randn((200, 640), dt, 0.07)),
    (randn((640, 128), dt, 0.04), randn((128, 1000), dt, 0.09)),
  )
  out = jax.jit(lambda *a: lr_mlp(a[0], a[1], a[2], a[3]))(x, up, down, gate)
  assert_close(out, lr_mlp_reference(x, up, down, gate), dt)


def test_pypi_placeholder_nki_falls_back_to_placeholders(tmp_path, monkeypatch):
  """PyPI's `nki` 0.0.1 raises ImportError on import; kernels must still import and say why."""
  pkg = tmp_path / "nki"
  pkg.mkdir()
  (pkg / "__init__.py").write_text('raise ImportError("WRONG PACKAGE")\n')
  monkeypatch.syspath_prepend(str(tmp_path))
  for name in [m for m in list(sys.modules) if m == "nki" or m.startswith("nki.")]:
    monkeypatch.delitem(sys.modules, name)
  assert _api.available()
  nki, nl, nisa = _api.toolchain({})
  assert nki.jit(len) is len
  with pytest.raises(ImportError, match="Neuron SDK"):
    nl.ndarray  # noqa: B018


def test_would_serve_scaled_xuv_and_mlp():
  """A rank-space scale is an operand the NKI kernels apply: it is planned (read once, held in
  SBUF) and must share the input dtype, as every operand does."""
  av = [S((4, 300, 4096), BF), S((4096, 1000), BF), S((1000, 11008), BF), S((1000,), BF)]
  p = dict(xuv_params(), has_scale=True, scaled_dtype=BF)
  name, why = lowering.would_serve("lr_xuv", av, p)
  assert name == "nki.xuv_trainium_fusion" and "blocks" in why
  plan = lowering.xuv_plan(av, p)
  assert plan.traffic.scale == 1024 * 2
  name, why = lowering.would_serve("lr_xuv", av, dict(p, scaled_dtype=jnp.dtype(jnp.float32)))
  assert name is None and "scaled_dtype=float32" in why
  f32s = av[:3] + [S((1000,), jnp.float32)]
  name, why = lowering.would_serve("lr_xuv", f32s, p)
  assert name is None and "operand 3 dtype=float32" in why
  x = S((2, 77, 2048), BF)
  ops = [x, S((2048, 512), BF), S((512, 8192), BF), S((512,), BF)]
  ops += [S((8192, 400), BF), S((400, 2048), BF), S((400,), BF)]
  params = dict(
    gated=False,
    act="relu",
    bias_mask=(False, False),
    inter_dtype=BF,
    out_dtype=BF,
    scale_mask=(True, True),
  )
  name, why = lowering.would_serve("lr_mlp", ops, params)
  assert name == "nki.mlp_up_gate_down"
  mp = lowering.mlp_plan(ops, params)
  assert mp.up_gate.traffic.scale == 512 * 2 and mp.down.traffic.scale == 512 * 2


def test_scaled_jax_entry_points_on_the_double():
  from nki_helpers import on_double

  from lrjax.custom_calls.nki import mlp

  d, (xv, ug) = on_double("xuv", "mlp_up_gate")
  dt = jnp.bfloat16
  x, u, v = randn((2, 5, 200), dt), randn((200, 130), dt, 0.07), randn((130, 300), dt, 0.09)
  s = randn((130,), dt, 2.0)
  assert_close(xv.xuv(x, u, v, None, s), lr_xuv_reference(x, u, v, scale=s), dt)
  up = (u, randn((130, 256), dt, 0.09), None, s)
  down = (randn((256, 96), dt, 0.06), randn((96, 200), dt, 0.1), None, randn((96,), dt))
  z = mlp.mlp(x, up, down, None, act="gelu_tanh", up_gate_mod=ug, xuv_mod=xv)
  assert_close(z, lr_mlp_reference(x, up, down, None, act="gelu_tanh"), dt)
