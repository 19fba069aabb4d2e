"""The Triton kernels on local shards of a multi-GPU mesh (``pytest -m gpu`` on >= 2 GPUs).

The mesh takes every GPU of the host (TP 2, 4 or 8).

lowering/partitioning.py gives each selected kernel a custom_partitioning rule, so under
tensor parallelism every GPU runs the Triton kernel on its own shards of the factors and no
whole weight is gathered. On CPU the same paths are covered with callback kernels
(test_tp_multidevice.py); this runs the real kernels.
"""

import importlib.util

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import assert_close, randn


def _reason():
  if importlib.util.find_spec("jax_triton") is None:
    return "jax-triton is not installed (pip install 'lrjax[cuda]')"
  try:
    n = len(jax.devices("gpu"))
  except RuntimeError as e:
    return f"no CUDA backend: {e}"
  return None if n >= 2 else f"{n} GPU(s); needs 2"


_REASON = _reason()
pytestmark = [
  pytest.mark.gpu,
  pytest.mark.skipif(_REASON is not None, reason=f"needs 2 NVIDIA GPUs: {_REASON}"),
]

DT = jnp.bfloat16
D, F, R = 512, 1024, 128
# (u spec, v spec) per layout (lowering/partitioning.py's table), and whether a Triton kernel
# runs on the shards: a layout that keeps each factor pair's product local runs the kernel;
# lr_col / lr_row put a rank-space collective between x·u and ·v, so those stay two GEMMs.
XUV_LAYOUTS = {
  "rank": ((None, "tp"), ("tp", None), True),
  "col": ((None, None), (None, "tp"), True),
  "lr_col": ((None, "tp"), (None, "tp"), False),
}
MLP_LAYOUTS = {  # up/gate u, v; down u, v; kernel on the shards
  "naive": ((None, "tp"), ("tp", None), (None, "tp"), ("tp", None), True),
  "lowrank": ((None, "tp"), (None, "tp"), ("tp", None), (None, None), False),
  "repl_u": ((None, None), (None, "tp"), (None, None), (None, "tp"), True),
}


def _mesh():
  from lrjax import sharding as S

  return S.make_mesh(len(jax.devices("gpu")))  # D, F, R divide by 2, 4 and 8


def _compiled(f, args):
  import lrjax

  with lrjax.lowering.prefer_kernels():  # kernel on the shards even where XLA measured faster
    return jax.jit(f).lower(*args).compile()


def _check(comp, args, want, weights, kernel):
  from lrjax import sharding as S

  text = comp.as_text()
  from lrjax.custom_calls.triton import launch

  calls = launch.count_calls(text)
  assert calls >= 1 if kernel else calls == 0, text[:3000]
  assert not S.weight_gathers(S.collectives(text), [w.shape for w in weights])
  assert_close(comp(*args), want, DT, factor=2.0)


@pytest.mark.parametrize("m", [1, 200])
@pytest.mark.parametrize("layout", sorted(XUV_LAYOUTS))
def test_lr_xuv_triton_on_shards(layout, m):
  import lrjax

  mesh = _mesh()
  su, sv, kernel = XUV_LAYOUTS[layout]
  x, u, v = randn((m, D), DT), randn((D, R), DT, D**-0.5), randn((R, F), DT, R**-0.5)
  want = lrjax.lowering.lr_xuv_reference(x, u, v)
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, P(*s)))
  args = (put(x, (None, None)), put(u, su), put(v, sv))
  _check(
    _compiled(lambda x, u, v: lrjax.lowering.lr_xuv(x, u, v), args), args, want, (u, v), kernel
  )


@pytest.mark.parametrize("m", [1, 200])
@pytest.mark.parametrize("layout", sorted(MLP_LAYOUTS))
def test_lr_mlp_triton_on_shards(layout, m):
  import lrjax

  mesh = _mesh()
  su1, sv1, su2, sv2, kernel = MLP_LAYOUTS[layout]
  x = randn((m, D), DT)
  ug, uu = randn((D, R), DT, D**-0.5), randn((D, R), DT, D**-0.5)
  vg, vu = randn((R, F), DT, R**-0.5), randn((R, F), DT, R**-0.5)
  ud, vd = randn((F, R), DT, F**-0.5), randn((R, D), DT, R**-0.5)
  want = lrjax.lowering.lr_mlp_reference(x, (uu, vu), (ud, vd), gate=(ug, vg))
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, P(*s)))
  args = (
    put(x, (None, None)),
    put(ug, su1),
    put(vg, sv1),
    put(uu, su1),
    put(vu, sv1),
    put(ud, su2),
    put(vd, sv2),
  )
  f = lambda x, ug, vg, uu, vu, ud, vd: lrjax.lowering.lr_mlp(x, (uu, vu), (ud, vd), gate=(ug, vg))
  _check(_compiled(f, args), args, want, (ug, vg, ud, vd), kernel)
