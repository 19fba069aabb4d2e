"""lrjax.fuse on plain-JAX low-rank code that lrjax has never seen.

    .venv/bin/python examples/fuse_any_function.py

Part 1 prints the rewritten jaxpr of a residual block, the explain report and the agreement
with the unfused function. Part 2 fuses the SVD storage form U·Σ·Vᵀ (Σ kept as its own
vector) and per-head factors written with einsum, shows what explain says about code it
refuses (a nonlinearity between the factors, a factor cut from the input itself), and states
the weights with ``weights=``.
"""

import jax
import jax.numpy as jnp
import numpy as np

import lrjax


def block(x, p):
  """A residual block: low-rank q/k/v (sharing x: one lr_xuv_group) mixed into a low-rank
  attention-out projection, plus a low-rank SwiGLU MLP."""
  q, k, v = (x @ p[f"{n}_u"] @ p[f"{n}_v"] for n in "qkv")
  x = x + (jax.nn.sigmoid(q * k) * v) @ p["o_u"] @ p["o_v"]
  gate = jax.nn.silu(x @ p["g_u"] @ p["g_v"])
  up = x @ p["u_u"] @ p["u_v"]
  return x + (gate * up) @ p["d_u"] @ p["d_v"]


def main():
  d, f, r = 256, 704, 64
  keys = iter(jax.random.split(jax.random.key(0), 16))
  shapes = {
    "q_u": (d, r),
    "q_v": (r, d),
    "k_u": (d, r // 2),
    "k_v": (r // 2, d),
    "v_u": (d, r // 2),
    "v_v": (r // 2, d),
    "o_u": (d, r),
    "o_v": (r, d),
    "g_u": (d, r),
    "g_v": (r, f),
    "u_u": (d, r),
    "u_v": (r, f),
    "d_u": (f, r),
    "d_v": (r, d),
  }
  p = {k: jax.random.normal(next(keys), s) * s[0] ** -0.5 for k, s in shapes.items()}
  x = jax.random.normal(next(keys), (4, 32, d))

  jaxpr = jax.make_jaxpr(lrjax.fuse(block))(x, p)
  print(jaxpr)
  names = [e.primitive.name for e in jaxpr.jaxpr.eqns]
  print({n: names.count(n) for n in ("lr_xuv_group", "lr_xuv", "lr_mlp")})
  print(lrjax.explain(block, x, p))
  y = jax.jit(lrjax.fuse(block))(x, p)
  ref = jax.jit(block)(x, p)
  err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
  print(f"relative error fused vs unfused: {err:.2e}")
  assert np.isfinite(err) and err < 1e-5
  svd_and_heads()


def svd_and_heads():
  """Part 2: U·Σ·Vᵀ, per-head factors, refusals, weights=."""
  keys = iter(jax.random.split(jax.random.key(1), 8))
  d, r, h = 256, 32, 4
  u = jax.random.normal(next(keys), (d, r)) * d**-0.5
  sigma = jnp.abs(jax.random.normal(next(keys), (r,)))  # SVD-LLM / ASVD keep Σ apart
  vt = jax.random.normal(next(keys), (r, d)) * r**-0.5
  uh = jax.random.normal(next(keys), (h, d // h, r // h)) * (d // h) ** -0.5
  vh = jax.random.normal(next(keys), (h, r // h, d // h)) * (r // h) ** -0.5
  x = jax.random.normal(next(keys), (2, 8, d))

  def layer(x, u, sigma, vt, uh, vh):
    y = ((x @ u) * sigma) @ vt  # -> lr_xuv with a rank-space scale operand
    xh = y.reshape(2, 8, h, d // h).transpose(0, 2, 1, 3)  # [b, heads, s, d/h]
    t = jnp.einsum("bhsd,hdr->bhsr", xh, uh)  # per-head factors -> lr_xuv_batched
    z = jnp.einsum("bhsr,hrn->bhsn", t, vh)
    bad = jnp.tanh(x @ u) @ vt  # a nonlinearity between the factors: refused, reported
    self_ = (x[0] @ x[0, :8].T) @ x[0, :8]  # factors cut from the input: not weights
    return z, bad, self_

  args = (x, u, sigma, vt, uh, vh)
  print("\n== U·Σ·Vt, per-head factors, and what is refused")
  print(lrjax.explain(layer, *args))
  # State the weights (positional args 1-5): x is then never taken for one.
  print("\n== with weights=(1, 2, 3, 4, 5)")
  print(lrjax.explain(layer, *args, weights=(1, 2, 3, 4, 5)))
  fused = jax.jit(lrjax.fuse(layer, weights=(1, 2, 3, 4, 5)))(*args)
  for got, want in zip(fused, jax.jit(layer)(*args)):
    err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    print(f"relative error fused vs unfused: {err:.2e}")
    assert err < 1e-5


if __name__ == "__main__":
  main()
