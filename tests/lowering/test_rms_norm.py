"""rms_norm and lr_normed (lowering/rms_norm.py): the primitive is the model's former ops bit
for bit, lrjax.fuse folds a norm into the one op that reads it (and only then), the folded
program computes what the unfolded one does, and CUDA's lr_normed kernel waits for its GPU run
and names why it declines."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_grad_close, randn
from hypothesis import given, settings
from hypothesis import strategies as st

import lrjax
from lrjax.custom_calls.triton import lowering as cuda_lowering
from lrjax.lowering import registry
from lrjax.lowering.rms_norm import lr_normed, lr_normed_reference, rms_norm, rms_norm_reference


def former_ops(x, w, eps, dt):  # the model's RMSNorm before the primitive
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return w.astype(dt) * y.astype(dt)


@settings(max_examples=25, deadline=None)
@given(
  shape=st.sampled_from([(7,), (3, 64), (2, 5, 96), (1, 1, 4096)]),
  dtype=st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16]),
  wdtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
  eps=st.sampled_from([0.0, 1e-6, 1e-5, 0.5]),
  seed=st.integers(0, 2**16),
)
def test_rms_norm_is_the_former_ops_bit_for_bit(shape, dtype, wdtype, eps, seed):
  kx, kw = jax.random.split(jax.random.key(seed))
  x = (jax.random.normal(kx, shape) * 4).astype(dtype)
  w = (1 + 0.3 * jax.random.normal(kw, shape[-1:])).astype(wdtype)
  want = np.asarray(jax.jit(former_ops, static_argnums=(2, 3))(x, w, eps, dtype))
  got = np.asarray(jax.jit(lambda x, w: rms_norm(x, w, eps=eps))(x, w))
  assert got.dtype == want.dtype and np.array_equal(got, want, equal_nan=True)
  assert np.array_equal(np.asarray(rms_norm(x, w, eps=eps)), want, equal_nan=True)  # eager


def test_rms_norm_refuses_bad_input_by_name():
  x, w = randn((2, 8)), randn((8,))
  with pytest.raises(ValueError, match=r"weight \(7,\).*expected a floating \[8\]"):
    rms_norm(x, w[:7], eps=1e-5)
  with pytest.raises(ValueError, match="eps=-1.0: expected a float >= 0"):
    rms_norm(x, w, eps=-1.0)
  with pytest.raises(ValueError, match="expected a floating array"):
    rms_norm(jnp.ones((2, 8), jnp.int32), w, eps=1e-5)


def test_rms_norm_differentiates_and_vmaps_as_its_reference():
  x, w = randn((3, 16)), randn((16,))
  f = lambda x, w: jnp.sum(jnp.sin(rms_norm(x, w, eps=1e-5)))  # noqa: E731
  g = lambda x, w: jnp.sum(jnp.sin(rms_norm_reference(x, w, eps=1e-5, dtype=x.dtype)))  # noqa: E731
  for a, b in zip(jax.grad(f, (0, 1))(x, w), jax.grad(g, (0, 1))(x, w)):
    assert_grad_close(a, b)  # w's entry 12 was 1.2e-6 of max|b| off on one CI CPU
  xs = randn((4, 3, 16))
  np.testing.assert_array_equal(
    jax.vmap(lambda x: rms_norm(x, w, eps=1e-5))(xs), rms_norm(xs, w, eps=1e-5)
  )


def _qkv_mlp(x, w1, w2, qkv, mlp):
  """A pre-norm block's shapes: norm → q/k/v (low-rank), norm → low-rank SwiGLU."""
  h = rms_norm(x, w1, eps=1e-5)
  q, k, v = (h @ u @ vv for u, vv in qkv)
  h2 = rms_norm(x + q, w2, eps=1e-5)
  (ug, vg), (uu, vu), (ud, vd) = mlp
  y = (jax.nn.silu(h2 @ ug @ vg) * (h2 @ uu @ vu)) @ ud @ vd
  return q, k, v, y


def _operands(dtype=jnp.float32):
  def lr(k, r, n):
    return randn((k, r), dtype, k**-0.5), randn((r, n), dtype, r**-0.5)

  qkv = [lr(64, 8, 64), lr(64, 4, 32), lr(64, 4, 32)]
  mlp = [lr(64, 8, 160), lr(64, 8, 160), lr(160, 8, 64)]
  return randn((3, 64), dtype), randn((64,), dtype), randn((64,), dtype), qkv, mlp


def _normed_inners(fn, *args):
  eqns = jax.make_jaxpr(fn)(*args).jaxpr.eqns
  return [e.params["inner"] for e in eqns if e.primitive.name == "lr_normed"], [
    e.primitive.name for e in eqns
  ]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fuse_folds_each_norm_into_the_op_that_reads_it(dtype):
  ops = _operands(dtype)
  inners, names = _normed_inners(lrjax.fuse(_qkv_mlp), *ops)
  assert inners == ["lr_xuv_group", "lr_mlp"] and "rms_norm" not in names, names
  want = jax.jit(_qkv_mlp)(*ops)
  got = jax.jit(lrjax.fuse(_qkv_mlp))(*ops)
  for a, b in zip(got, want):  # the folded program is the same ops on the CPU
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fuse_leaves_a_norm_that_another_op_reads():
  def also_returned(x, w1, w2, qkv, mlp):  # the normalised x is an output too
    return _qkv_mlp(x, w1, w2, qkv, mlp), rms_norm(x, w1, eps=1e-5) * 2

  def two_readers(x, w1, w2, qkv, mlp):  # q/k/v are not one group: the norm stays
    h = rms_norm(x, w1, eps=1e-5)
    return [h @ u @ v for u, v in qkv[:1]] + [jnp.tanh(h)]

  ops = _operands()
  inners, names = _normed_inners(lrjax.fuse(also_returned), *ops)
  assert inners == ["lr_xuv_group", "lr_mlp"] and names.count("rms_norm") == 1, names
  inners, names = _normed_inners(lrjax.fuse(two_readers), *ops)
  assert inners == [] and names.count("rms_norm") == 1, names
  # a norm in another dtype than its input (the kernels normalise in x's dtype): not folded
  x, w1, w2, qkv, mlp = _operands(jnp.float32)

  def cast(x, w1, qkv):
    h = rms_norm(x, w1, eps=1e-5, dtype=jnp.bfloat16)
    return [h @ u.astype(jnp.bfloat16) @ v.astype(jnp.bfloat16) for u, v in qkv]

  inners, names = _normed_inners(lrjax.fuse(cast), x, w1, qkv)
  assert inners == [] and "lr_xuv_group" in names, names


def test_explain_says_why_a_norm_stays():
  x, w1, _, qkv, _ = _operands()

  def read_twice(x, w1, qkv):  # the normalised x is also an output
    h = rms_norm(x, w1, eps=1e-5)
    return [h @ u @ v for u, v in qkv] + [h]

  def cast(x, w1, qkv):
    h = rms_norm(x, w1, eps=1e-5, dtype=jnp.bfloat16)
    return [h @ u.astype(jnp.bfloat16) @ v.astype(jnp.bfloat16) for u, v in qkv]

  for fn, why in (
    (read_twice, "also read by a function output"),
    (cast, "the norm casts float32 to bfloat16"),
  ):
    rep = lrjax.explain(fn, x, w1, qkv)
    misses = [n for n in rep.near_misses if n["pattern"] == "rms_norm"]
    assert not rep.norms and len(misses) == 1 and why in misses[0]["reason"], misses


def test_lr_normed_is_the_norm_then_its_op():
  x, w1, _, qkv, _ = _operands()
  from lrjax.lowering.group import lr_xuv_group

  params = dict(bias_mask=(False,) * 3, inter_dtype=jnp.float32, out_dtype=jnp.float32)
  ops = [a for u, v in qkv for a in (u, v)]
  got = lr_normed(x, w1, *ops, eps=1e-5, inner="lr_xuv_group", inner_params=params)
  want = lr_xuv_group(rms_norm(x, w1, eps=1e-5), qkv)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  f = lambda x: sum(  # noqa: E731
    jnp.sum(y**2)
    for y in lr_normed(x, w1, *ops, eps=1e-5, inner="lr_xuv_group", inner_params=params)
  )
  g = lambda x: sum(jnp.sum(y**2) for y in lr_xuv_group(rms_norm(x, w1, eps=1e-5), qkv))  # noqa: E731
  np.testing.assert_allclose(jax.grad(f)(x), jax.grad(g)(x), rtol=1e-5, atol=1e-6)
  vm = jax.vmap(
    lambda x: lr_normed(x, w1, *ops, eps=1e-5, inner="lr_xuv_group", inner_params=params)
  )(jnp.stack([x, 2 * x]))
  sorted_params = tuple(sorted(params.items()))
  for i, s in enumerate((1, 2)):  # each vmapped row is its own call
    np.testing.assert_allclose(
      vm[0][i],
      lr_normed_reference(
        s * x, w1, *ops, eps=1e-5, inner="lr_xuv_group", inner_params=sorted_params
      )[0],
      rtol=1e-5,
      atol=1e-6,
    )
  with pytest.raises(ValueError, match="inner='lr_xuv': expected one of"):
    lr_normed(x, w1, *ops, eps=1e-5, inner="lr_xuv", inner_params=params)


def test_explain_names_the_folded_norms():
  rep = lrjax.explain(_qkv_mlp, *_operands())
  assert [n["into"] for n in rep.norms] == ["lr_xuv_group", "lr_mlp"]
  assert "NORM  rms_norm folded into lr_xuv_group" in str(rep)
  cuda = rep.norms[0]["kernels"]["cuda"]
  assert cuda["kernel"] == "reference" and cuda["declined"], cuda


def test_normed_kernel_serves_where_verified_and_the_table_says(monkeypatch):
  """On CUDA lr_normed's kernel declines, naming why, unless marked verified on a GPU and
  switched on by the tuning table (``dispatch.norm_in_kernels``: on, measured faster); then it
  serves where the grouped or SwiGLU decode kernel serves the op, and declines (naming the op's
  own reasons) where XLA lowers it."""
  from lrjax.custom_calls.triton import policy

  monkeypatch.setattr(cuda_lowering, "_toolchain", lambda: None)
  sds = jax.ShapeDtypeStruct
  bf = jnp.bfloat16

  def avals(m, dt=bf):
    members = [(4096, 1216, 4096), (4096, 512, 1024), (4096, 512, 1024)]
    ops = [a for k, r, n in members for a in (sds((k, r), dt), sds((r, n), dt))]
    return (sds((m, 4096), dt), sds((4096,), bf), *ops)

  params = dict(
    eps=1e-5,
    inner="lr_xuv_group",
    inner_params=tuple(
      sorted(dict(bias_mask=(False,) * 3, inter_dtype=np.dtype(bf), out_dtype=np.dtype(bf)).items())
    ),
  )
  off = policy.current().with_values("dispatch", norm_in_kernels=False)
  with policy.use(off):
    sel = registry.select("lr_normed", "cuda", avals(1), params)
  assert sel.kernel is None, sel
  assert dict(sel.declined)["triton.normed"] == off.why("dispatch", "norm_in_kernels")
  with policy.use(policy.current().with_values("dispatch", norm_in_kernels=True)):
    assert registry.select("lr_normed", "cuda", avals(1), params).name == "triton.normed"
    monkeypatch.setattr(cuda_lowering, "NORM_GPU_VERIFIED", False)
    sel = registry.select("lr_normed", "cuda", avals(1), params)
    assert sel.kernel is None and "GPU tests" in dict(sel.declined)["triton.normed"]
    monkeypatch.setattr(cuda_lowering, "NORM_GPU_VERIFIED", True)
    sel = registry.select("lr_normed", "cuda", avals(1, jnp.float32), params)
    assert sel.kernel is None and "f32 stays on XLA" in sel.declined[0][1], sel.declined
    sel = registry.select("lr_normed", "cuda", avals(200), params)  # above the grouped kernel
    assert sel.kernel is None and "the grouped kernel serves decode rows" in sel.declined[0][1]
    # where the table measured the op's kernel slower than XLA, the norm stays with XLA too
    (group,) = [k for k in registry.candidates("lr_xuv_group", "cuda") if "group" in k.name]
    registry.register(dataclasses.replace(group, faster=lambda a, p: "measured slower here"))
    try:
      sel = registry.select("lr_normed", "cuda", avals(1), params)
      assert sel.kernel is None and sel.declined == (("triton.normed", "measured slower here"),)
    finally:
      registry.register(group)
  assert not registry.candidates("lr_normed", "cpu")
