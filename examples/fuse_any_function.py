"""lrjax.fuse on a plain-JAX low-rank block that lrjax has never seen.

    .venv/bin/python examples/fuse_any_function.py

Prints the rewritten jaxpr, the explain report and the agreement with the
unfused function.
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


if __name__ == "__main__":
  main()
