"""Run by test_corpus.py in a subprocess with 4 simulated CPU devices; prints one JSON line.

1. A low-rank block under ``shard_map`` (data parallel, and rank-sharded factors with a psum in
   the body): the pass fuses it on its per-device shapes, results equal the unfused function.
2. A kernel selected inside the shard_map body lowers inline (every mesh axis is manual there),
   not through the partitioning wrapper's custom_partitioning.
3. The partitioning wrapper passes a rank-space scale through on sharded layouts (the scale
   split like the rank dim in ``rank`` / ``lr_col``, replicated in ``lr_row`` / ``repl``).
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import collections  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import lrjax  # noqa: E402
from lrjax.lowering import registry  # noqa: E402
from lrjax.lowering.primitives import xuv_operands  # noqa: E402

seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
key = [jax.random.key(seed)]


def rn(*shape, scale=1.0):
  key[0], k = jax.random.split(key[0])
  return scale * jax.random.normal(k, shape, jnp.float32)


out = {"n_devices": jax.device_count()}
mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))  # noqa: E731


def bitwise(a, b) -> bool:
  return bool(np.array_equal(np.asarray(a), np.asarray(b)))


# ------------------------------------------------------------------ 1. model under shard_map
D, F, R = 64, 128, 8
w = {
  "o": (rn(D, R, scale=D**-0.5), rn(R), rn(R, D, scale=R**-0.5)),  # U, Σ, Vt
  "gate": (rn(D, R, scale=D**-0.5), rn(R, F, scale=R**-0.5)),
  "up": (rn(D, R, scale=D**-0.5), rn(R, F, scale=R**-0.5)),
  "down": (rn(F, R, scale=F**-0.5), rn(R, D, scale=R**-0.5)),
}


def block(x, w):  # per device: x [B/4, T, D]
  u, s, vt = w["o"]
  x = x + ((x @ u) * s) @ vt
  g = x @ w["gate"][0] @ w["gate"][1]
  h = jax.nn.silu(g) * (x @ w["up"][0] @ w["up"][1])
  return x + h @ w["down"][0] @ w["down"][1]


dp = jax.shard_map(block, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d"))
x = put(rn(8, 3, D), "d")
rep = lrjax.explain(dp, x, w)
out["dp_matches"] = dict(collections.Counter(m["pattern"] for m in rep.matches))
out["dp_paths"] = sorted({m["path"] for m in rep.matches})
out["dp_near"] = [n["reason"] for n in rep.near_misses]
out["dp_bitwise"] = bitwise(jax.jit(lrjax.fuse(dp))(x, w), jax.jit(dp)(x, w))

# rank-sharded factors, all-reduced in the body: fused on the local rank
u, v = rn(D, 16, scale=D**-0.5), rn(16, 96, scale=0.25)
tp = jax.shard_map(
  lambda x, u, v: jax.lax.psum((x @ u) @ v, "d"),
  mesh=mesh,
  in_specs=(P(), P(None, "d"), P("d", None)),
  out_specs=P(),
)
xr, us, vs = rn(5, D), put(u, None, "d"), put(v, "d", None)
rep = lrjax.explain(tp, xr, us, vs)
out["tp_shapes"] = [m["shapes"] for m in rep.matches]
out["tp_bitwise"] = bitwise(jax.jit(lrjax.fuse(tp))(xr, us, vs), jax.jit(tp)(xr, us, vs))

# ------------------------------------------------------------------ 2./3. a kernel (test double)
calls = []


def kernel_impl(*ops, **params):
  """A CPU 'kernel' for lr_xuv: the reference maths, marked by a sine of zeros in the HLO."""
  x, u, v, b, s = xuv_operands(ops, params)
  calls.append((x.shape, u.shape, None if s is None else s.shape))
  t = jnp.matmul(x, u, preferred_element_type=params["inter_dtype"])
  if s is not None:
    t = (t.astype(s.dtype) * s).astype(params["scaled_dtype"])
  y = jnp.matmul(t, v, preferred_element_type=params["out_dtype"])
  y = y if b is None else y + b
  return jnp.sin(jnp.zeros_like(y)) + y


registry.register(
  registry.KernelLowering(
    "lr_xuv", "cpu", "test.xuv", lambda a, p: None, lambda: kernel_impl, priority=100
  )
)

hlo = jax.jit(lrjax.fuse(tp)).lower(xr, us, vs).as_text()
out["inline_kernel_in_hlo"] = "sine" in hlo
out["inline_custom_partitioning"] = "CustomSPMDPartitioning" in hlo
out["inline_kernel_shapes"] = [list(c[1]) for c in calls]
out["inline_close"] = bool(
  np.allclose(jax.jit(lrjax.fuse(tp))(xr, us, vs), jax.jit(tp)(xr, us, vs), rtol=1e-5, atol=1e-5)
)

# scale through the partitioning wrapper (jit over sharded operands, no shard_map)
lay = {
  "rank": ((None, "d"), ("d", None), ("d",), (None, None)),
  "lr_col": ((None, "d"), (None, "d"), ("d",), (None, None)),
  "lr_row": (("d", None), (None, None), (None,), (None, "d")),
  "repl": ((None, None), (None, None), (None,), (None, None)),
}
xs, s = rn(6, D), rn(16)
want = np.asarray(lrjax.lowering.lr_xuv_reference(xs, u, v, scale=s))
out["layouts"] = {}
for name, (su, sv, ss, sx) in lay.items():
  calls.clear()
  args = (put(xs, *sx), put(u, *su), put(v, *sv), put(s, *ss))
  f = jax.jit(lambda x, u, v, s: lrjax.lowering.lr_xuv(x, u, v, scale=s))
  got = np.asarray(f(*args))
  text = f.lower(*args).as_text()
  out["layouts"][name] = {
    "err": float(np.max(np.abs(got - want)) / np.max(np.abs(want))),
    "kernel_scale_shapes": sorted({tuple(c[2]) for c in calls if c[2] is not None}),
    "kernel_in_hlo": "sine" in text or "CustomSPMDPartitioning" in text,
  }

# lr_mlp with a scale per projection through the wrapper (rank layout: u and Σ split on r)
from lrjax.lowering.primitives import REFERENCES, lr_mlp_p  # noqa: E402

mlp_calls = []


def mlp_kernel(*ops, **params):
  mlp_calls.append(ops[1].shape)
  y = REFERENCES[lr_mlp_p](*ops, **params)
  return jnp.sin(jnp.zeros_like(y)) + y


registry.register(
  registry.KernelLowering(
    "lr_mlp", "cpu", "test.mlp", lambda a, p: None, lambda: mlp_kernel, priority=100
  )
)
proj = lambda k, n: (rn(k, 16, scale=k**-0.5), rn(16, n, scale=0.25), None, rn(16))  # noqa: E731
gate, up, down = proj(D, F), proj(D, F), proj(F, D)
xm = rn(6, D)
want = np.asarray(lrjax.lowering.lr_mlp_reference(xm, up, down, gate))
shard = lambda p: (put(p[0], None, "d"), put(p[1], "d", None), None, put(p[3], "d"))  # noqa: E731
f = jax.jit(lambda x, g, u, d: lrjax.lowering.lr_mlp(x, u, d, g))
calls.clear()
got = np.asarray(f(xm, shard(gate), shard(up), shard(down)))
out["mlp_scaled_err"] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
# per device each projection is an lr_xuv on its rank shard, scale included (test.xuv above)
out["mlp_local_xuv_scale_shapes"] = sorted({tuple(c[2]) for c in calls if c[2] is not None})

print("JSON" + json.dumps(out))
