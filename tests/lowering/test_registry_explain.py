"""Kernel registry: selection, reference fallback with logged reasons, and the explain report."""

import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import lrjax
from conftest import assert_close, randn
from lrjax.lowering import registry
from lrjax.lowering.explain import kernels_for
from lrjax.lowering.primitives import _xuv_ref_ops


def _count_in_hlo(fn, *args, needle):
  return jax.jit(fn).lower(*args).as_text().count(needle)


@pytest.fixture
def even_kernel():
  """A real (if simple) CPU kernel: XUV computed as x·(u·v), serving only even N."""
  calls = []

  def impl(x, u, v, *rest, has_bias, inter_dtype, out_dtype):
    calls.append(x.shape)
    w = jnp.matmul(u.astype(jnp.float32), v.astype(jnp.float32))
    y = jnp.matmul(x.astype(jnp.float32), w)
    y = y + rest[0].astype(jnp.float32) if has_bias else y
    return jnp.sin(jnp.zeros_like(y)) + y.astype(out_dtype)  # sin marks our lowering in HLO

  def supports(avals, params):
    n = avals[2].shape[1]
    return None if n % 2 == 0 else f"N={n} is odd"

  k = registry.register(
    registry.KernelLowering("lr_xuv", "cpu", "test.xuv_even", supports, lambda: impl, priority=100)
  )
  yield calls
  registry.unregister("lr_xuv", "cpu", k.name)


def test_registered_kernel_is_selected_and_agrees(even_kernel):
  x, u, v = randn((3, 32)), randn((32, 4)), randn((4, 48))
  f = lambda x: lrjax.lowering.lr_xuv(x, u, v)
  assert _count_in_hlo(f, x, needle="sine") == 1
  assert_close(
    jax.jit(f)(x),
    _xuv_ref_ops(x, u, v, has_bias=False, inter_dtype=jnp.float32, out_dtype=jnp.float32),
    jnp.float32,
    factor=10,
  )
  assert even_kernel, "the kernel's impl was never traced"


def test_declined_shape_falls_back_to_reference_and_logs(even_kernel, caplog):
  x, u, v = randn((3, 32)), randn((32, 4)), randn((4, 47))
  f = lambda x: lrjax.lowering.lr_xuv(x, u, v)
  with caplog.at_level(logging.DEBUG, logger="lrjax.lowering"):
    assert _count_in_hlo(f, x, needle="sine") == 0
  assert any("test.xuv_even declined: N=47 is odd" in r.getMessage() for r in caplog.records)
  assert_close(jax.jit(f)(x), x @ u @ v, jnp.float32)


def test_force_reference(even_kernel):
  x, u, v = randn((3, 32)), randn((32, 4)), randn((4, 48))
  with registry.force_reference():
    assert _count_in_hlo(lambda x: lrjax.lowering.lr_xuv(x, u, v), x, needle="sine") == 0


def test_measured_slower_kernel_declines_unless_kernels_preferred(monkeypatch):
  """``faster`` is asked after ``supports``; prefer_kernels() / the env var skip it."""
  x, u, v = randn((3, 32)), randn((32, 4)), randn((4, 48))
  slow = lambda avals, params: "XLA measured faster" if avals[0].shape[0] < 8 else None
  k = registry.register(
    registry.KernelLowering(
      "lr_xuv",
      "cpu",
      "test.slow",
      lambda a, p: None,
      lambda: lambda x, u, v, *r, **kw: jnp.sin(x @ u @ v),
      priority=300,
      faster=slow,
    )
  )
  try:
    f = lambda x: lrjax.lowering.lr_xuv(x, u, v)
    g = lambda x: lrjax.lowering.lr_xuv(x, u, v)  # a fresh function: lowerings are cached per jaxpr
    sel = registry.select("lr_xuv", "cpu", (x, u, v), {})
    assert sel.name != "test.slow" and ("test.slow", "XLA measured faster") in sel.declined
    assert registry.select("lr_xuv", "cpu", (randn((9, 32)), u, v), {}).name == "test.slow"
    assert _count_in_hlo(f, x, needle="sine") == 0
    with registry.prefer_kernels():
      assert registry.select("lr_xuv", "cpu", (x, u, v), {}).name == "test.slow"
      assert _count_in_hlo(g, x, needle="sine") == 1
    assert registry.select("lr_xuv", "cpu", (x, u, v), {}).name != "test.slow"
    monkeypatch.setenv("LRJAX_PREFER_KERNELS", "1")
    assert registry.select("lr_xuv", "cpu", (x, u, v), {}).name == "test.slow"
    with registry.force_reference():  # forcing the reference still wins
      assert registry.select("lr_xuv", "cpu", (x, u, v), {}).name == "reference"
  finally:
    registry.unregister("lr_xuv", "cpu", k.name)


def test_raising_predicate_is_a_decline():
  k = registry.register(
    registry.KernelLowering(
      "lr_xuv", "cpu", "test.broken", lambda a, p: 1 / 0, lambda: None, priority=200
    )
  )
  try:
    with pytest.warns(RuntimeWarning, match="test.broken falls back.*ZeroDivisionError"):
      sel = registry.select("lr_xuv", "cpu", (), {})
    assert sel.kernel is None or sel.kernel.name != "test.broken"
    assert any(n == "test.broken" and "ZeroDivisionError" in r for n, r in sel.declined)
  finally:
    registry.unregister("lr_xuv", "cpu", k.name)


def test_bad_platform_rejected():
  with pytest.raises(ValueError, match="platform"):
    registry.KernelLowering("lr_xuv", "tpu9", "x", lambda a, p: None, lambda: None)


def test_explain_report_data_and_text(even_kernel):
  u, v = randn((64, 8)), randn((8, 96))
  u2, v2 = randn((64, 60)), randn((60, 64))

  def f(x):
    return x @ u @ v, x @ u2 @ v2

  rep = lrjax.explain(f, randn((2, 64)))
  d = rep.to_dict()
  assert len(d["matches"]) == 1 and d["matches"][0]["pattern"] == "lr_xuv"
  assert d["matches"][0]["kernels"]["cpu"]["kernel"] == "test.xuv_even"
  assert "test_registry_explain.py" in d["matches"][0]["location"]
  assert len(d["near_misses"]) == 1 and "not low-rank" in d["near_misses"][0]["reason"]
  assert set(d["unmatched_rules"]) == {"lr_mlp(gated)", "lr_mlp(non-gated)", "lr_xuv_w4a8"}
  text = str(rep)
  assert "MATCH lr_xuv" in text and "MISS" in text and "cpu: test.xuv_even" in text


def test_explain_asks_unregistered_platforms_from_the_catalog(even_kernel):
  """A platform jax does not lower for here: explain asks its catalog kernels and any kernel
  registered for it by hand, and says which of them is registered."""
  x, u, v = randn((2, 64)), randn((64, 8)), randn((8, 96))
  avals = (x, u, v)
  params = dict(has_bias=False, inter_dtype=jnp.float32, out_dtype=jnp.float32)
  k = registry.register(
    registry.KernelLowering("lr_xuv", "neuron", "test.neuron_xuv", lambda a, p: None, None, 99)
  )
  try:
    got = kernels_for("lr_xuv", avals, params)
    assert got["neuron"]["kernel"] == "test.neuron_xuv" and got["neuron"]["registered"]
    assert got["cpu"] == {"kernel": "test.xuv_even", "declined": [], "registered": True}
  finally:
    registry.unregister("lr_xuv", "neuron", k.name)
  got = kernels_for("lr_xuv", avals, params)["neuron"]
  assert got["kernel"] == "reference" and not got["registered"]
  assert [d[0] for d in got["declined"]] == ["nki.xuv_trainium_fusion"]  # f32: NKI takes bf16


_LAZY_REGISTRATION = """if True:
  import sys, threading, time
  import jax, jax.numpy as jnp
  from lrjax import custom_calls
  from lrjax.lowering import lr_xuv, registry
  assert registry.loaded_platforms() == frozenset(), registry.loaded_platforms()
  assert not [m for m in sys.modules if m.startswith("lrjax.custom_calls.")], "imported early"

  calls, real = [], custom_calls.register
  def slow_register(platform):
    calls.append(platform)
    time.sleep(0.2)  # the other threads arrive while this one registers
    real(platform)
  custom_calls.register = slow_register
  seen = []
  def ask():
    seen.append({k.name for k in registry.candidates("lr_xuv_w4a8", "cpu")})
  threads = [threading.Thread(target=ask) for _ in range(8)]
  for t in threads: t.start()
  for t in threads: t.join()
  assert calls == ["cpu"], calls
  assert seen == [{"cpu.lr_xuv_w4a8"}] * 8, seen

  x, u, v = jnp.ones((4, 64)), jnp.ones((64, 8)), jnp.ones((8, 32))
  jax.jit(lr_xuv)(x, u, v).block_until_ready()
  assert registry.loaded_platforms() == {"cpu"}, registry.loaded_platforms()
  assert calls == ["cpu"], calls
  assert "lrjax.custom_calls.nki.lowering" not in sys.modules
  print("ok")
"""


def test_kernels_register_on_first_lowering_once_per_platform():
  """Nothing registers at import; the first lowering for a platform registers that platform's
  kernels only, once, however many threads ask at the same time."""
  r = subprocess.run(
    [sys.executable, "-c", _LAZY_REGISTRATION],
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
