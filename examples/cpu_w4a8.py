"""Quantize a small low-rank model to W4A8 and run it on CPU through the C++ kernel.

  python examples/cpu_w4a8.py

Prints the W4A8 custom calls in the compiled HLO, the error against the float
model, and the error against an f64 reference that uses the same int4 weights.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lrjax.lowering import quantized as Q
from lrjax.nn import Linear, LowRankLinear, LowRankMLP
from lrjax.quant import QuantizedLowRankLinear, dequantize_int4, quantize


class TinyLowRank(nnx.Module):
  def __init__(self, *, rngs):
    self.proj = LowRankLinear(512, 512, 128, use_bias=True, rngs=rngs)
    self.mlp = LowRankMLP(512, 1536, (192, 192, 192), gated=True, rngs=rngs)
    self.head = Linear(512, 256, rngs=rngs)

  def __call__(self, x):
    return self.head(self.mlp(self.proj(x)))


def main():
  model = TinyLowRank(rngs=nnx.Rngs(0))
  qmodel = quantize(model, "w4a8", group=64)
  graphdef, state = nnx.split(qmodel)
  forward = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
  x = jax.random.normal(jax.random.key(1), (4, 512), jnp.float32)

  hlo = forward.lower(state, x).compile().as_text()
  calls = [line.strip() for line in hlo.splitlines() if 'custom_call_target="lrjax_w4a8' in line]
  print(f"{len(calls)} W4A8 custom calls in the compiled HLO, e.g.:\n  {calls[0][:160]}...")

  y = forward(state, x)
  ref = model(x)
  print(
    f"relative error vs the float model: "
    f"{float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)):.3f} "
    "(random-init model, 9 int4 matmuls in series)"
  )

  # One layer against f64 with the same int4 weights: only activation rounding remains.
  layer = qmodel.proj
  assert isinstance(layer, QuantizedLowRankLinear)

  def deq(name):
    k, n, group, layout = getattr(layer, f"{name}_meta")
    q = np.asarray(Q.unpack_int4(getattr(layer, f"{name}_packed")[...], k, n, layout))
    return dequantize_int4(q, np.asarray(getattr(layer, f"{name}_scales")[...]), group)

  x64 = np.asarray(x, np.float64)
  ref64 = (x64 @ deq("u")) @ deq("v") + np.asarray(layer.bias[...], np.float64)
  y1 = np.asarray(jax.jit(lambda x: layer(x))(x), np.float64)
  print(
    f"proj layer NMSE vs f64 with the same int4 weights: "
    f"{np.mean((y1 - ref64) ** 2) / np.mean(ref64**2):.2e} (bound 5e-4)"
  )


if __name__ == "__main__":
  main()
