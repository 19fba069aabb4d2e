"""lr_residual (lowering/residual.py): lrjax.fuse folds the residual add into the low-rank op
whose output it adds (only where the op's output has no other reader and the residual exists
before the op), the folded program computes what the unfolded one does, and CUDA's
lr_residual kernel waits for its GPU run and names why it declines."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_grad_close, randn

import lrjax
from lrjax.custom_calls.triton import lowering as cuda_lowering
from lrjax.lowering import lr_xuv, registry
from lrjax.lowering.residual import lr_residual, lr_residual_reference
from lrjax.lowering.rms_norm import rms_norm


def _lr(k, r, n, dtype=jnp.float32):
  return randn((k, r), dtype, k**-0.5), randn((r, n), dtype, r**-0.5)


def _block(h, w1, w2, o, mlp):
  """A pre-norm block at one token: h += o(norm(h)); h += mlp(norm(h))."""
  a = rms_norm(h, w1, eps=1e-5)
  h = h + a @ o[0] @ o[1]
  x = rms_norm(h, w2, eps=1e-5)
  (ug, vg), (uu, vu), (ud, vd) = mlp
  return h + (jax.nn.silu(x @ ug @ vg) * (x @ uu @ vu)) @ ud @ vd


def _operands(dtype=jnp.float32):
  mlp = [_lr(64, 8, 160, dtype), _lr(64, 8, 160, dtype), _lr(160, 8, 64, dtype)]
  h = randn((3, 1, 64), dtype)
  return h, randn((64,), dtype), randn((64,), dtype), _lr(64, 8, 64, dtype), mlp


def _folded(fn, *args):
  """[(inner, inner's inner)] of each lr_residual fuse(fn) binds, and every primitive's name."""
  eqns = jax.make_jaxpr(lrjax.fuse(fn))(*args).jaxpr.eqns
  res = [
    (e.params["inner"], dict(e.params["inner_params"]).get("inner"))
    for e in eqns
    if e.primitive.name == "lr_residual"
  ]
  return res, [e.primitive.name for e in eqns]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fuse_folds_both_residual_adds_of_a_block(dtype):
  ops = _operands(dtype)
  res, names = _folded(_block, *ops)
  assert res == [("lr_xuv", None), ("lr_normed", "lr_mlp")], res
  assert "add" not in names, names  # no add left at the top level
  want = jax.jit(_block)(*ops)
  got = jax.jit(lrjax.fuse(_block))(*ops)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # the same ops on the CPU


def test_a_folded_block_differentiates_and_vmaps_as_the_unfolded_one():
  h, w1, w2, o, mlp = _operands()

  def loss(block, h, o, mlp):
    return jnp.sum(jnp.sin(block(h, w1, w2, o, mlp)))

  grad = jax.jit(jax.grad(loss, (1, 2, 3)), static_argnums=0)
  want, got = grad(_block, h, o, mlp), grad(lrjax.fuse(_block), h, o, mlp)
  # both compiled; f32 sums XLA's CPU threads may order differently (an eager `want` once
  # differed by 2.4e-5 relative at one element of 512)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  hs = jnp.stack([h, -2 * h])
  got = jax.vmap(lambda h: lrjax.fuse(_block)(h, w1, w2, o, mlp))(hs)
  want = jax.vmap(lambda h: _block(h, w1, w2, o, mlp))(hs)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_fuse_leaves_an_add_it_cannot_fold():
  h, _, _, (u, v), _ = _operands()
  w = randn((64, 64))

  def also_read(h):  # the op's output is read twice
    y = h @ u @ v
    return h + y, y * 2

  def late(h):  # the residual is computed after the op
    y = h @ u @ v
    return jnp.tanh(h @ w) + y

  def broadcast(h):  # a [64] operand is a bias (absorbed into lr_xuv), not a residual
    return h @ u @ v + w[0]

  def twice(h):
    y = h @ u @ v
    return y + y

  def cast(h):  # the add is in another dtype: the op's one reader is the convert
    return h + (h @ u @ v).astype(jnp.bfloat16)

  for fn in (also_read, late, broadcast, twice, cast):
    res, names = _folded(fn, h)
    assert res == [] and "lr_xuv" in names, (fn.__name__, names)
    np.testing.assert_array_equal(
      np.asarray(jax.tree.leaves(jax.jit(lrjax.fuse(fn))(h))[0]),
      np.asarray(jax.tree.leaves(jax.jit(fn)(h))[0]),
    )


def test_lr_residual_is_the_op_then_the_add():
  h, _, _, (u, v), _ = _operands()
  r = randn((3, 1, 64))
  params = dict(has_bias=False, inter_dtype=jnp.float32, out_dtype=jnp.float32)
  got = lr_residual(r, h, u, v, inner="lr_xuv", inner_params=params)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(r + lr_xuv(h, u, v)))

  def f(r, h):
    return jnp.sum(jnp.sin(lr_residual(r, h, u, v, inner="lr_xuv", inner_params=params)))

  def g(r, h):
    return jnp.sum(jnp.sin(r + lr_xuv(h, u, v)))

  for a, b in zip(jax.grad(f, (0, 1))(r, h), jax.grad(g, (0, 1))(r, h)):
    assert_grad_close(a, b)
  vm = jax.vmap(lambda r, h: lr_residual(r, h, u, v, inner="lr_xuv", inner_params=params))(
    jnp.stack([r, 2 * r]), jnp.stack([h, -h])
  )
  sp = tuple(sorted(params.items()))
  for i, s in enumerate((1, 2)):
    want = lr_residual_reference(s * r, (-1) ** i * h, u, v, inner="lr_xuv", inner_params=sp)
    np.testing.assert_allclose(vm[i], want, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match=r"residual \(3, 1, 32\) float32: expected the op's output"):
    lr_residual(r[..., :32], h, u, v, inner="lr_xuv", inner_params=params)
  with pytest.raises(ValueError, match="inner='lr_xuv_group': expected one of"):
    lr_residual(r, h, u, v, inner="lr_xuv_group", inner_params=params)


def test_explain_names_the_folded_adds():
  rep = lrjax.explain(_block, *_operands())
  assert [r["into"] for r in rep.residuals] == ["lr_xuv", "lr_normed(lr_mlp)"]
  assert "ADD   residual add folded into lr_xuv" in str(rep)
  cuda = rep.residuals[0]["kernels"]["cuda"]
  assert cuda["kernel"] == "reference" and cuda["declined"], cuda


def test_residual_kernel_serves_where_verified_and_the_table_says(monkeypatch):
  """On CUDA lr_residual's kernel declines, naming why, unless marked verified on a GPU and
  switched on by the tuning table (``dispatch.residual_epilogue``: on, measured faster);
  then it serves where the decode X·U·V or SwiGLU kernel serves the
  op (an MLP's folded norm applied by the kernel where that is switched on too, else by XLA
  first), and declines where XLA lowers the op or the op's bias takes the epilogue."""
  from lrjax.custom_calls.triton import policy

  monkeypatch.setattr(cuda_lowering, "_toolchain", lambda: None)
  on = policy.current().with_values("dispatch", residual_epilogue=True)
  sds, bf = jax.ShapeDtypeStruct, jnp.bfloat16

  def xuv(m, dt=bf, bias=False):
    avals = (sds((m, 4096), dt), sds((m, 4096), dt), sds((4096, 1216), dt), sds((1216, 4096), dt))
    params = dict(has_bias=bias, inter_dtype=np.dtype(dt), out_dtype=np.dtype(dt))
    return avals + ((sds((4096,), dt),) if bias else ()), dict(
      inner="lr_xuv", inner_params=tuple(sorted(params.items()))
    )

  def mlp(m):  # an lr_normed(lr_mlp) at Llama-3-8B's shapes
    f = [(4096, 1920, 14336), (4096, 1920, 14336), (14336, 1920, 4096)]
    ops = [a for k, r, n in f for a in (sds((k, r), bf), sds((r, n), bf))]
    ip = dict(
      gated=True,
      act="silu",
      bias_mask=(False,) * 3,
      inter_dtype=np.dtype(bf),
      out_dtype=np.dtype(bf),
    )
    normed = dict(eps=1e-5, inner="lr_mlp", inner_params=tuple(sorted(ip.items())))
    avals = (sds((m, 4096), bf), sds((m, 4096), bf), sds((4096,), bf), *ops)
    return avals, dict(inner="lr_normed", inner_params=tuple(sorted(normed.items())))

  off = policy.current().with_values("dispatch", residual_epilogue=False)
  with policy.use(off):
    sel = registry.select("lr_residual", "cuda", *xuv(1))
  assert sel.kernel is None, sel
  assert dict(sel.declined)["triton.residual"] == off.why("dispatch", "residual_epilogue")
  with policy.use(on):
    assert registry.select("lr_residual", "cuda", *xuv(1)).name == "triton.residual"
    monkeypatch.setattr(cuda_lowering, "RESIDUAL_GPU_VERIFIED", False)
    sel = registry.select("lr_residual", "cuda", *xuv(1))
    assert sel.kernel is None and "not yet run on a GPU" in dict(sel.declined)["triton.residual"]
  monkeypatch.setattr(cuda_lowering, "RESIDUAL_GPU_VERIFIED", True)
  with policy.use(on.with_values("dispatch", norm_in_kernels=False)):  # the norm in XLA
    t = cuda_lowering._residual_target(*mlp(1))
  assert t.reason is None and t.kernel.name == "triton.mlp_decode" and not t.norm_in_kernel
  with policy.use(on.with_values("dispatch", norm_in_kernels=True)):
    assert cuda_lowering._residual_target(*mlp(1)).norm_in_kernel
    assert registry.select("lr_residual", "cuda", *mlp(16)).name == "triton.residual"
  for args, why in (
    (xuv(1, jnp.float32), "f32 stays on XLA"),
    (xuv(1, bias=True), "bias takes the kernel's epilogue operand"),
    (xuv(4096), "triton.xuv_prefill serves lr_xuv and has no residual epilogue"),
  ):
    with policy.use(on):
      sel = registry.select("lr_residual", "cuda", *args)
    assert sel.kernel is None and why in sel.declined[0][1], sel.declined
  assert not registry.candidates("lr_residual", "cpu")


def test_kernel_wrappers_refuse_a_residual_they_cannot_add():
  """The kernels' residual= names what was expected: the output's shape and dtype, and no
  bias with it (both take the kernel's one epilogue operand)."""
  pytest.importorskip("triton")
  from lrjax.custom_calls.triton._common import RESIDUAL, residual_operand

  r = jnp.zeros((2, 3, 8), jnp.bfloat16)
  b, mode = residual_operand(r, None, (2, 3), 8, jnp.bfloat16)
  assert b.shape == (6, 8) and mode == RESIDUAL.value
  assert residual_operand(None, None, (2, 3), 8, jnp.bfloat16) == (None, False)
  with pytest.raises(ValueError, match="bias= and residual= share"):
    residual_operand(r, jnp.zeros((8,), jnp.bfloat16), (2, 3), 8, jnp.bfloat16)
  with pytest.raises(ValueError, match=r"residual \(2, 3, 8\) bfloat16: expected \(2, 3, 16\)"):
    residual_operand(r, None, (2, 3), 16, jnp.bfloat16)
  with pytest.raises(ValueError, match="expected .* float32"):
    residual_operand(r, None, (2, 3), 8, jnp.float32)
