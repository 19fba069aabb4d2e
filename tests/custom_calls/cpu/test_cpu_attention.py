"""The CPU prefill-attention FFI kernel (custom_calls/cpu/attention.cc, its body
attention_block.inc compiled with the baseline flags and with AVX2) against the primitive's
reference on fresh random inputs, each body the CPU has: head groups of 1-7, head dims under 8,
not a multiple of 8 and 128, both cache layouts, causal prompts, chunks against a longer cache,
random masks with rows that see nothing; the primitive's lowering to it on CPU, its
derivative and vmap; its refusals; the FFI's shape checks."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_body_env, cpu_kernel_bodies
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lrjax.custom_calls.cpu import attention as C
from lrjax.custom_calls.cpu import lowering as cpu_lowering
from lrjax.lowering import registry
from lrjax.lowering.attention import attention, attention_reference

pytestmark = pytest.mark.skipif(
  not cpu_lowering.extension_available(),
  reason="the CPU C++ extension is not built (pip install -e .)",
)

TOL = {"float32": (2e-5, 1e-5)}  # f32 sums in another order than XLA's dots; outputs O(1)


BODIES = cpu_kernel_bodies(lambda ext: ext.prefill_attention_isa())


def _inputs(rng, b, s, t, hq, hkv, d, heads_first):
  q = jnp.asarray(rng.standard_normal((b, s, hq, d)) * 2, jnp.float32)
  kshape = (b, hkv, t, d) if heads_first else (b, t, hkv, d)
  k = jnp.asarray(rng.standard_normal(kshape), jnp.float32)
  v = jnp.asarray(rng.standard_normal(kshape), jnp.float32)
  return q, k, v


def _causal(b, s, t, start):
  """Query i of a chunk starting at position ``start`` sees keys [0, start + i]."""
  qpos = start + np.arange(s)[:, None]
  return jnp.asarray(np.broadcast_to(np.arange(t)[None, :] <= qpos, (b, s, t)))


def _check(q, k, v, mask, heads_first):
  got = jax.jit(lambda *a: C.attention(*a, heads_first=heads_first))(q, k, v, mask)
  want = jax.jit(lambda *a: C.attention_reference(*a, heads_first=heads_first))(q, k, v, mask)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), *TOL["float32"])


# (B, S, T, Hq, Hkv, D, heads_first): G = 4, 7, 1; D 64, not a multiple of 8, under 8, 128
SHAPES = [
  (1, 40, 40, 32, 8, 64, False),
  (2, 13, 29, 14, 2, 20, True),
  (3, 9, 9, 3, 3, 3, False),
  (1, 17, 50, 8, 2, 128, True),
]


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_the_reference(shape, body, rng):
  b, s, t, hq, hkv, d, hf = shape
  q, k, v = _inputs(rng, b, s, t, hq, hkv, d, hf)
  with cpu_body_env(body):
    _check(q, k, v, _causal(b, s, t, t - s), hf)  # a prompt (S = T) or its last chunk
    _check(q, k, v, _causal(b, s, t, 0), hf)  # a first chunk in a longer buffer
    rand = rng.random((b, s, t)) < 0.3
    rand[0, 0] = False  # a query that sees nothing: the mean of v over all T
    rand[-1, -1] = False
    _check(q, k, v, jnp.asarray(rand), hf)
    _check(q, k, v, jnp.zeros((b, s, t), bool), hf)


@pytest.mark.parametrize("body", BODIES)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
  b=st.integers(1, 2),
  s=st.integers(1, 19),
  extra=st.integers(0, 12),
  hkv=st.integers(1, 3),
  g=st.integers(1, 5),
  d=st.one_of(st.integers(1, 20), st.sampled_from([32, 64, 72])),
  hf=st.booleans(),
  data=st.data(),
)
def test_kernel_matches_the_reference_on_any_shape(body, b, s, extra, hkv, g, d, hf, data):
  t = s + extra
  seed = data.draw(st.integers(0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  density = data.draw(st.sampled_from([0.0, 0.2, 0.7, 1.0]))
  mask = jnp.asarray(rng.random((b, s, t)) < density)
  with cpu_body_env(body):
    _check(*_inputs(rng, b, s, t, hkv * g, hkv, d, hf), mask, hf)


def test_the_primitive_lowers_to_the_kernel_differentiates_and_vmaps(rng):
  q, k, v = _inputs(rng, 2, 6, 10, 8, 2, 16, False)
  mask = _causal(2, 6, 10, 4)
  avals = [jax.typeof(x) for x in (q, k, v, mask)]
  sel = registry.select("attention", "cpu", avals, {"heads_first": False})
  assert sel.kernel is not None and sel.kernel.name == "cpu.attention"
  assert C.TARGET in jax.jit(attention).lower(q, k, v, mask).as_text()
  np.testing.assert_allclose(
    jax.jit(attention)(q, k, v, mask), attention_reference(q, k, v, mask), *TOL["float32"]
  )
  loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, mask)))  # noqa: E731
  for a, w in zip(
    jax.grad(loss(attention), (0, 1, 2))(q, k, v),
    jax.grad(loss(attention_reference), (0, 1, 2))(q, k, v),
  ):
    np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()))
  got = jax.vmap(attention)(q[None], k[None], v[None], mask[None])[0]
  np.testing.assert_allclose(got, attention_reference(q, k, v, mask), *TOL["float32"])


def test_refusals_name_why(monkeypatch):
  f32 = jax.ShapeDtypeStruct((1, 4, 2, 8), jnp.float32)
  bf = jax.ShapeDtypeStruct((1, 4, 2, 8), jnp.bfloat16)
  m = jax.ShapeDtypeStruct((1, 4, 4), jnp.bool_)
  assert C.supports([f32, f32, f32, m], {}) is None
  assert "float32" in C.supports([bf, bf, bf, m], {})
  monkeypatch.setenv(C.ENV, "0")
  assert C.ENV in C.supports([f32, f32, f32, m], {})
  with pytest.raises(ValueError, match="mask .*expected bool"):
    attention(jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 2, 8)),
              jnp.zeros((1, 4, 5), bool))  # fmt: skip


@pytest.mark.parametrize(
  "shapes, match",
  [
    (((1, 2, 4, 8), (1, 3, 3, 8), (1, 3, 3, 8), (1, 2, 3)), "dividing Hq=4"),
    (((1, 2, 4, 8), (1, 3, 2, 8), (1, 3, 2, 9), (1, 2, 3)), "must equal k's"),
    (((1, 2, 4, 8), (1, 3, 2, 8), (1, 3, 2, 8), (1, 2, 4)), r"mask \(1, 2, 4\) must be \[1,"),
  ],
)
def test_the_ffi_call_checks_its_shapes(shapes, match):
  impl = C.load()
  q, k, v, m = (jnp.zeros(s, bool if i == 3 else jnp.float32) for i, s in enumerate(shapes))
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(impl(q, k, v, m, heads_first=False))


def test_example_runs_the_kernel_against_the_reference():
  import re
  import subprocess
  import sys

  here = os.path.abspath(__file__)  # tests/custom_calls/cpu/
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(here))))
  res = subprocess.run(
    [sys.executable, os.path.join(repo, "examples", "prefill_attention.py")],
    capture_output=True,
    text=True,
    timeout=600,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert res.returncode == 0, res.stderr
  lines = res.stdout.splitlines()
  assert lines[0] == "on cpu: attention -> cpu.attention"
  err = re.fullmatch(r"out \(1, 512, 2048\) float32; relative difference .*: (\S+)", lines[1])
  assert err and float(err.group(1)) < 1e-5, lines
