"""Where a CPU decode step's time goes: the projection matmuls, XLA's other ops, the host loop.

For a Llama-3.2-1B-shaped model with random weights (``--variants``: dense f32, dense bf16,
low-rank f32 at ``--ratio``, low-rank W4A8), at batch ``--batch``:

- step:     the fused one-token decode step, jitted as the engine runs it (cache donated),
            median over ``--steps`` calls;
- matmuls:  the same projections and LM head alone, in one jit, on activations of the step's
            shapes (the W4A8 custom calls for the quantized model; XLA dots otherwise);
- other:    step - matmuls (attention over the cache, norms, RoPE, cache writes, the argmax);
- with ``--attention-ab``: the step with the attention in the CPU decode-attention kernel
            (custom_calls/cpu/decode_attention.py, the default) and left to XLA, alternating;
- engine:   ``Engine.step()`` wall time with ``--batch`` requests decoding, median over steps;
            engine - step is the host loop (Python, dispatch, the token's copy to the host).

Usage: python benchmarks/cpu_decode_profile.py [--variants lowrank_w4a8,dense_f32] [--batch 1]
Writes benchmarks/results/cpu_decode_profile.json.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import lrjax
from lrjax import bench as B
from lrjax.lowering import quantized as Q
from lrjax.models import KVCache, ModelConfig
from lrjax.nn import Linear, LowRankLinear
from lrjax.quant import QuantizedLinear, QuantizedLowRankLinear, quantize

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from results_io import write_json  # noqa: E402


def build(variant: str, ratio: float, group: int, layers: int | None):
  cfg = ModelConfig.llama3_2_1b()
  if layers:
    cfg = ModelConfig.from_dict({**cfg.to_dict(), "num_layers": layers})
  dt = jnp.bfloat16 if variant.endswith("bf16") else jnp.float32
  model = B.random_model(cfg, ratio=ratio if variant.startswith("lowrank") else None, dtype=dt)
  if variant.endswith("w4a8"):
    model = quantize(model, "w4a8", group=group)
  model.scan_layers = False
  return model


def _median_time(fn, n: int) -> float:
  fn()
  ts = []
  for _ in range(n):
    t = time.perf_counter()
    fn()
    ts.append(time.perf_counter() - t)
  return float(np.median(ts))


def time_step(model, batch: int, max_len: int, steps: int, attend: int = 128) -> float:
  gdef, state = nnx.split(model)
  # as the engine runs it: attention over the first attend bucket (--attend), rows at its middle
  attend = min(attend, max_len)
  fused = lrjax.fuse(functools.partial(type(model).decode, attend_len=attend))

  def step(state, tokens, cache):
    logits, cache = fused(nnx.merge(gdef, state), tokens, cache)
    return jnp.argmax(logits, -1).astype(jnp.int32), cache

  step = jax.jit(step, donate_argnums=(2,))
  cache = KVCache.init(model.cfg, batch, max_len, model.embed.embedding[...].dtype)
  pos = jnp.full((batch,), attend // 2, jnp.int32)
  cache = KVCache(cache.k, cache.v, pos)
  box = [jnp.zeros((batch,), jnp.int32), cache]

  def once():
    tok, c = step(state, box[0], box[1])
    tok.block_until_ready()
    box[0], box[1] = tok, KVCache(c.k, c.v, jnp.full((batch,), attend // 2, jnp.int32))

  return _median_time(once, steps)


def attention_ab(model, a) -> dict:
  """The step with the model's attention in the CPU decode-attention kernel and with it left
  to XLA (``LRJAX_CPU_DECODE_ATTENTION=0``, read when the step is traced), ``--ab-rounds``
  rounds, alternating; medians."""
  from lrjax.custom_calls.cpu import decode_attention as cda

  on, off = [], []
  for _ in range(a.ab_rounds):
    for env, out in (("1", on), ("0", off)):
      with mock.patch.dict(os.environ, {cda.ENV: env}):
        out.append(time_step(model, a.batch, a.max_len, a.steps, a.attend))
  on_ms, off_ms = float(np.median(on)) * 1e3, float(np.median(off)) * 1e3
  print(
    f"  attention: CPU kernel {on_ms:.2f} ms a step, XLA {off_ms:.2f} ms ({off_ms / on_ms:.2f}x)"
  )
  return dict(
    step_cpu_attention_ms=on_ms,
    step_xla_attention_ms=off_ms,
    attention_rounds_ms={"cpu_kernel": [x * 1e3 for x in on], "xla": [x * 1e3 for x in off]},
  )


def projections(model) -> list:
  out = []
  for layer in model.layers:
    for part in (layer.attn, layer.mlp):
      for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        if hasattr(part, name):
          out.append(getattr(part, name))
  out.append(model.lm_head if model.lm_head is not None else model.embed)
  return out


def time_matmuls(model, batch: int, steps: int) -> float:
  mods = projections(model)
  gdef, state = nnx.split(mods)
  dt = model.embed.embedding[...].dtype
  rng = np.random.default_rng(0)

  def k_of(m):
    if isinstance(m, QuantizedLowRankLinear):
      return m.u_meta[0]
    if isinstance(m, QuantizedLinear):
      return m.meta[0]
    if isinstance(m, (Linear, LowRankLinear)):
      return m.in_features if hasattr(m, "in_features") else m.kernel[...].shape[0]
    return model.cfg.hidden_size  # the tied head

  xs = [jnp.asarray(rng.standard_normal((batch, 1, _k(m, k_of))), dt) for m in mods]

  def run(state, xs):
    ms = nnx.merge(gdef, state)
    ys = []
    for m, x in zip(ms, xs):
      if ys:  # one after another, as in the step (XLA would run independent calls at once)
        x = x.at[..., 0].add(ys[-1][..., 0].astype(x.dtype))
      if isinstance(m, QuantizedLowRankLinear):  # as the pass fuses it
        b = m.bias[...] if m.bias is not None else None
        ys.append(
          Q.lr_xuv_w4a8(
            x,
            m.u_packed[...],
            m.u_scales[...],
            m.v_packed[...],
            m.v_scales[...],
            b,
            r=m.u_meta[1],
            n=m.v_meta[1],
            group_u=m.u_meta[2],
            group_v=m.v_meta[2],
            layout=m.u_meta[3],
          )
        )
      elif hasattr(m, "attend"):
        ys.append(m.attend(x))
      else:
        ys.append(m(x))
    return ys[-1]

  f = jax.jit(lrjax.fuse(run))
  return _median_time(lambda: jax.block_until_ready(f(state, xs)), steps)


def _k(m, k_of) -> int:
  return int(k_of(m))


def time_engine(model, batch: int, steps: int, prompt_len: int = 16) -> float:
  from lrjax.serving import Engine, Request, SamplingParams

  e = Engine(
    model, max_slots=batch, max_len=prompt_len + steps + 8, buckets=(prompt_len,), fuse=True
  )
  e.warmup()
  rng = np.random.default_rng(1)
  sp = SamplingParams(max_new_tokens=steps + 4)
  for _ in range(batch):
    e.submit(Request([int(t) for t in rng.integers(0, model.cfg.vocab_size, prompt_len)], sp))
  e.step()  # admits (prefills) every request, then one decode step
  ts = []
  for _ in range(steps):
    t = time.perf_counter()
    e.step()
    ts.append(time.perf_counter() - t)
  while e.busy:
    e.step()
  return float(np.median(ts[1:]))


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--variants", default="lowrank_w4a8,dense_f32")
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--ratio", type=float, default=0.4)
  ap.add_argument("--group", type=int, default=128)
  ap.add_argument("--layers", type=int, default=None, help="fewer layers (default: the 16)")
  ap.add_argument("--max-len", type=int, default=256)
  ap.add_argument("--attend", type=int, default=128, help="the attend bucket (rows at half of it)")
  ap.add_argument("--steps", type=int, default=30)
  ap.add_argument(
    "--attention-ab",
    action="store_true",
    help="also time the step with the attention left to XLA (LRJAX_CPU_DECODE_ATTENTION=0)",
  )
  ap.add_argument("--ab-rounds", type=int, default=3)
  ap.add_argument("--out", default=os.path.join(HERE, "results", "cpu_decode_profile.json"))
  a = ap.parse_args()
  rows = []
  load0 = os.getloadavg()
  for v in a.variants.split(","):
    t0 = time.perf_counter()
    model = build(v, a.ratio, a.group, a.layers)
    built = time.perf_counter() - t0
    step = time_step(model, a.batch, a.max_len, a.steps, a.attend)
    ab = attention_ab(model, a) if a.attention_ab else None
    mm = time_matmuls(model, a.batch, a.steps)
    eng = time_engine(model, a.batch, a.steps)
    kernels = B.decode_kernels(model)
    _, dbytes = B.weight_bytes(model)
    row = dict(
      variant=v,
      batch=a.batch,
      step_ms=step * 1e3,
      matmuls_ms=mm * 1e3,
      other_ms=(step - mm) * 1e3,
      engine_step_ms=eng * 1e3,
      host_loop_ms=(eng - step) * 1e3,
      decode_weight_bytes=dbytes,
      step_weight_gbs=dbytes / step / 1e9,
      matmul_weight_gbs=dbytes / mm / 1e9,
      decode_kernels=kernels,
      build_s=built,
    )
    if ab:
      row.update(ab)
    rows.append(row)
    print(
      f"{v:14s} B={a.batch}: step {row['step_ms']:.1f} ms = matmuls {row['matmuls_ms']:.1f} + "
      f"other {row['other_ms']:.1f}; engine step {row['engine_step_ms']:.1f} ms "
      f"(host loop {row['host_loop_ms']:.1f}); weights {dbytes / 1e9:.2f} GB -> "
      f"{row['step_weight_gbs']:.1f} GB/s per step, {row['matmul_weight_gbs']:.1f} GB/s matmuls"
    )
    del model
  write_json(
    a.out,
    dict(
      benchmark="cpu_decode_profile",
      command=" ".join([os.path.basename(sys.executable)] + sys.argv),
      date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
      machine=B.machine(),
      versions={"jax": jax.__version__, "lrjax": lrjax.__version__},
      load_average=dict(start=load0, end=os.getloadavg()),
      settings=vars(a),
      kernel_env={
        k: v for k, v in sorted(os.environ.items()) if k.startswith(("LRJAX_W4A8_", "LRJAX_CPU_"))
      },
      rows=rows,
    ),
  )
  print("wrote", a.out)


if __name__ == "__main__":
  main()
