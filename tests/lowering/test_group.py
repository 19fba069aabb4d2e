"""lr_xuv_group (lowering/group.py) and lrjax.fuse's grouping (on by default): X·U·V chains
sharing their input become one primitive; off a single CUDA device it lowers as its members."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lrjax
from conftest import assert_close, randn
from lrjax.lowering import lr_xuv_group, lr_xuv_reference

from test_fuse import lr_params, prims


def qkv(x, p):
  """Three low-rank projections of one input, then a fourth of their combination."""
  q = x @ p[0] @ p[1]
  k = x @ p[2] @ p[3] + p[8]
  v = x @ p[4] @ p[5]
  return (q * k + v) @ p[6] @ p[7]


def qkv_params(dtype=jnp.float32):
  return (
    *lr_params(64, 8, 48, dtype),
    *lr_params(64, 4, 48, dtype),
    *lr_params(64, 6, 48, dtype),
    *lr_params(48, 8, 64, dtype),
    randn((48,), dtype),
  )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_group_equals_its_members(dtype):
  x = randn((3, 5, 64), dtype)
  (u0, v0), (u1, v1) = lr_params(64, 8, 40, dtype), lr_params(64, 3, 24, dtype)
  b1 = randn((24,), dtype)
  outs = jax.jit(lambda x: lr_xuv_group(x, [(u0, v0), (u1, v1, b1)]))(x)
  assert [o.shape for o in outs] == [(3, 5, 40), (3, 5, 24)]
  assert_close(outs[0], lr_xuv_reference(x, u0, v0), dtype)
  assert_close(outs[1], lr_xuv_reference(x, u1, v1, b1), dtype)


def test_group_grad_and_vmap():
  x = randn((4, 64))
  (u0, v0), (u1, v1) = lr_params(64, 8, 40), lr_params(64, 3, 24)

  def loss(x, u0, u1):
    a, b = lr_xuv_group(x, [(u0, v0), (u1, v1)])
    return jnp.sum(a**2) + jnp.sum(jnp.sin(b))

  def ref(x, u0, u1):
    return jnp.sum(lr_xuv_reference(x, u0, v0) ** 2) + jnp.sum(jnp.sin(lr_xuv_reference(x, u1, v1)))

  for got, want in zip(jax.grad(loss, (0, 1, 2))(x, u0, u1), jax.grad(ref, (0, 1, 2))(x, u0, u1)):
    assert_close(got, want, jnp.float32)
  xs = randn((2, 4, 64))
  got = jax.vmap(lambda x: lr_xuv_group(x, [(u0, v0), (u1, v1)]))(xs)
  assert_close(got[1], jax.vmap(lambda x: lr_xuv_reference(x, u1, v1))(xs), jnp.float32)
  us = jnp.stack([u0, u0 * 2])  # batched weights: the members' reference under vmap
  got = jax.vmap(lambda u: lr_xuv_group(x, [(u, v0), (u1, v1)])[0])(us)
  assert_close(got[1], lr_xuv_reference(x, u0 * 2, v0), jnp.float32)


def test_group_checks_its_input():
  x = randn((2, 64))
  (u, v) = lr_params(64, 8, 40)
  with pytest.raises(ValueError, match="2 to 3"):
    lr_xuv_group(x, [(u, v)])
  with pytest.raises(ValueError, match="2 to 3"):
    lr_xuv_group(x, [(u, v)] * 4)
  with pytest.raises(ValueError, match="disagree on K"):
    lr_xuv_group(x, [(u, v), lr_params(32, 4, 8)])
  with pytest.raises(ValueError, match="member 1"):
    lr_xuv_group(x, [(u, v), u])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fuse_groups_projections_that_share_an_input(dtype):
  p, x = qkv_params(dtype), randn((2, 64), dtype)
  names = prims(lrjax.fuse(qkv, group=True), x, p)
  assert names.count("lr_xuv_group") == 1 and names.count("lr_xuv") == 1  # o stays alone
  assert "dot_general" not in names
  assert prims(lrjax.fuse(qkv), x, p) == names  # on by default
  assert prims(lrjax.fuse(qkv, group=False), x, p).count("lr_xuv") == 4
  assert_close(jax.jit(lrjax.fuse(qkv))(x, p), qkv(x, p), dtype)
  eqn = next(
    e
    for e in jax.make_jaxpr(lrjax.fuse(qkv, group=True))(x, p).jaxpr.eqns
    if e.primitive.name == "lr_xuv_group"
  )
  assert eqn.params["bias_mask"] == (False, True, False)  # k's bias absorbed


def test_fuse_groups_at_most_three_and_only_ready_operands():
  x = randn((2, 64))
  ws = [lr_params(64, 4, 32) for _ in range(4)]

  def four(x, ws):
    return sum(x @ u @ v for u, v in ws)

  names = prims(lrjax.fuse(four, group=True), x, ws)
  assert names.count("lr_xuv_group") == 1 and names.count("lr_xuv") == 1

  def late(x, ws, b):  # the second chain's bias is computed after the first chain
    a = x @ ws[0][0] @ ws[0][1]
    b2 = jnp.reshape(b, (1, 32))  # a view of a weight: still a bias
    return a + (x @ ws[1][0] @ ws[1][1] + b2)

  b = randn((32,))
  # the bias view is evaluated early, at the group (NNX and Linen reshape biases at each use)
  names = prims(lrjax.fuse(late, group=True), x, ws, b)
  assert names.count("lr_xuv_group") == 1 and "lr_xuv" not in names
  assert_close(jax.jit(lrjax.fuse(late, group=True))(x, ws, b), late(x, ws, b), jnp.float32)

  def computed(x, ws):  # the second chain's input is not ready at the first chain: no group
    a = x @ ws[0][0] @ ws[0][1]
    return a, (x @ ws[1][0]) @ (ws[1][1] * jnp.sum(a))

  names = prims(lrjax.fuse(computed, group=True), x, ws)
  assert "lr_xuv_group" not in names and names.count("lr_xuv") == 1


def test_fused_model_groups_qkv():
  from flax import nnx
  from lrjax.models import PROJ_NAMES, LlamaForCausalLM, ModelConfig

  cfg = ModelConfig.tiny()
  m = LlamaForCausalLM(cfg, [{p: 8 for p in PROJ_NAMES}] * cfg.num_layers, rngs=nnx.Rngs(0))
  tok = jnp.asarray(np.arange(10).reshape(2, 5) % cfg.vocab_size)
  graphdef, state = nnx.split(m)

  def fwd(state, tok):
    return nnx.merge(graphdef, state)(tok)

  names = prims(lrjax.fuse(fwd, group=True), state, tok)
  per_trace = names.count("lr_mlp")
  assert per_trace >= 1
  assert names.count("lr_xuv_group") == per_trace and names.count("lr_xuv") == per_trace  # o
  assert_close(
    jax.jit(lrjax.fuse(fwd, group=True))(state, tok), jax.jit(fwd)(state, tok), jnp.float32
  )


def test_explain_reports_groups():
  p, x = qkv_params(), randn((2, 64))
  rep = lrjax.explain(qkv, x, p)
  assert len(rep.groups) == 1 and len(rep.groups[0]["members"]) == 3
  assert set(rep.groups[0]["kernels"]) == {"cpu", "cuda", "neuron"}
  assert "GROUP lr_xuv_group (3 of the lr_xuv above" in str(rep)
  assert lrjax.explain(qkv, x, p, group=False).groups == []


@pytest.fixture
def counting_cpu_kernels():
  """A CPU lr_xuv kernel that counts the calls it lowers (its impl is the reference) and a
  CPU grouped kernel that declines every group, as a CUDA group above 64 rows does."""
  from lrjax.lowering import registry
  from lrjax.lowering.primitives import _xuv_ref_ops

  lowered = []

  def load():
    lowered.append(1)
    return _xuv_ref_ops

  ks = [
    registry.register(
      registry.KernelLowering("lr_xuv", "cpu", "test.xuv_counted", lambda a, p: None, load)
    ),
    registry.register(
      registry.KernelLowering(
        "lr_xuv_group", "cpu", "test.group_declines", lambda a, p: "too many rows", lambda: None
      )
    ),
  ]
  yield lowered
  for k in ks:
    registry.unregister(k.primitive, k.platform, k.name)


def test_declined_grouped_kernel_leaves_the_group_to_xla(counting_cpu_kernels):
  """Where a platform's grouped kernel declines, the group lowers as XLA's reference (its dot
  merger batches the members' X·U), not one member kernel each; prefer_kernels() lowers
  the members with their kernels."""
  from lrjax.lowering import registry

  x = randn((2, 64))
  members = [lr_params(64, 8, 40), lr_params(64, 3, 24)]
  f = lambda x: lr_xuv_group(x, members)  # noqa: E731
  want = [lr_xuv_reference(x, u, v) for u, v in members]
  outs = jax.jit(f)(x)
  assert counting_cpu_kernels == []
  for o, w in zip(outs, want):
    assert_close(o, w, jnp.float32)
  with registry.prefer_kernels():
    outs = jax.jit(lambda x: lr_xuv_group(x, members))(x)
  assert len(counting_cpu_kernels) == 2
  for o, w in zip(outs, want):
    assert_close(o, w, jnp.float32)


def test_group_without_a_grouped_kernel_lowers_its_members():
  """No grouped kernel on the platform: each member keeps its own lr_xuv kernel choice."""
  from lrjax.lowering import registry
  from lrjax.lowering.primitives import _xuv_ref_ops

  lowered = []
  k = registry.register(
    registry.KernelLowering(
      "lr_xuv",
      "cpu",
      "test.xuv_counted",
      lambda a, p: None,
      lambda: lowered.append(1) or _xuv_ref_ops,
    )
  )
  try:
    members = [lr_params(64, 8, 40), lr_params(64, 3, 24), lr_params(64, 5, 16)]
    jax.jit(lambda x: lr_xuv_group(x, members))(randn((2, 64)))
  finally:
    registry.unregister(k.primitive, k.platform, k.name)
  assert len(lowered) == 3
