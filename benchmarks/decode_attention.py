"""Decode attention over a dense KV cache on one GPU: the two kernels that serve
``decode_attention`` on CUDA, jax's Pallas flash-decoding kernel (the first choice) and
lrjax's two-launch kernel (the second), against XLA's lowering of the model's attention and
cuDNN's.

  python benchmarks/decode_attention.py --out benchmarks/results/decode_attention.json

Llama-3-8B heads (32 query, 8 KV, head dim 128), bf16, a cache of ``--ctx`` positions all
filled (each row at position ctx - 1), per batch size:

  xla     the reference (the model's einsum/softmax attention, what XLA runs without lrjax);
  lrjax   lrjax's kernel (custom_calls/triton/decode_attention.py) at its planned splits, with
          the merge it picks for them (``lrjax_merge``), then with each merge forced: "walk"
          (the splits one after another) and "tile" (every split's rows at once);
  pallas  jax's Pallas kernel with XLA's merge of its splits, at its planned split count and
          at each of ``--splits`` (the sweep that justified that plan);
  cudnn   ``jax.nn.dot_product_attention(implementation="cudnn")`` on the cache transposed to
          its [B, T, H, D] layout once, outside the timing (its best case);
  append  (``--append``) the new token's RoPE and cache write with the attention, as a decode
          step runs them: the models' ops around the ``decode_attention`` primitive
          (``append_unfused``: XLA's fusions and the primitive's kernel) against lrjax's
          decode_attention_append (``append_lrjax``; ``append_lrjax_apart``: the new key
          attended apart from the cache loop, NEW_KEY_APART), the caches carried through the
          ``--inner`` calls and donated, so all update them in place.

Each is jitted alone and timed as the median of ``--reps`` calls of ``--inner`` back-to-back
applications (host timer around block_until_ready, divided by ``--inner``). ``read_gbs``: the
K and V bytes the step must read (2 · B · Hkv · ctx · D · 2) over the time;
``hbm_roofline_frac``: that over the card's HBM bandwidth. Records are keyed by device: a run
on another card adds its records and keeps the others.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from results_io import hbm_bps, write_json  # noqa: E402

from lrjax.bench import machine, versions  # noqa: E402
from lrjax.custom_calls.triton import decode_attention as ours  # noqa: E402
from lrjax.custom_calls.triton import decode_attention_pallas as kernel  # noqa: E402
from lrjax.lowering.decode_attention import decode_attention_reference, rope_tables  # noqa: E402


def time_ms(fn, args, inner: int, reps: int) -> float:
  """Median ms of one application of ``fn`` (``inner`` chained calls per timed run)."""

  @jax.jit
  def many(q, k, v, pos):
    def body(_, q):
      return fn(q, k, v, pos).reshape(q.shape).astype(q.dtype)

    return jax.lax.fori_loop(0, inner, body, q)

  jax.block_until_ready(many(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(many(*args))
    times.append((time.perf_counter() - t0) / inner)
  return float(np.median(times) * 1e3)


def time_append_ms(fn, ops, inner: int, reps: int) -> float:
  """Median ms of one ``fn(q, k_new, v_new, k_cache, v_cache, pos, cos, sin)`` -> (out, k_cache,
  v_cache) call, ``inner`` chained in one jit with the caches carried and donated (updated in
  place, as a decode loop runs them)."""
  q, kn, vn, kc, vc, pos, cos, sin = ops

  @functools.partial(jax.jit, donate_argnums=(1, 2))
  def many(q, kc, vc):
    def body(_, c):
      q, kc, vc = c
      out, kc, vc = fn(q, kn, vn, kc, vc, pos, cos, sin)
      return out.reshape(q.shape).astype(q.dtype), kc, vc

    return jax.lax.fori_loop(0, inner, body, (q, kc, vc))

  carry = many(q, jnp.copy(kc), jnp.copy(vc))
  jax.block_until_ready(carry)
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    carry = many(*carry)
    jax.block_until_ready(carry)
    times.append((time.perf_counter() - t0) / inner)
  return float(np.median(times) * 1e3)


def cudnn_fn(hq, hkv):
  def fn(q, k_bthd, v_bthd, pos):
    b, _, d = q.shape
    t = k_bthd.shape[1]
    out = jax.nn.dot_product_attention(
      q[:, None],
      k_bthd,
      v_bthd,
      key_value_seq_lengths=pos + 1,
      implementation="cudnn",
    )
    del t
    return out.reshape(b, hq * d)

  return fn


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
  ap.add_argument("--ctx", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
  ap.add_argument("--splits", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32])
  ap.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("HQ", "HKV", "D"))
  ap.add_argument("--inner", type=int, default=50)
  ap.add_argument("--reps", type=int, default=15)
  ap.add_argument("--no-cudnn", action="store_true")
  ap.add_argument(
    "--append",
    action="store_true",
    help="also time RoPE + cache write + attention: the models' ops (append_unfused) against "
    "lrjax's decode_attention_append (append_lrjax)",
  )
  ap.add_argument("--out", help="results JSON (records of other devices in it are kept)")
  a = ap.parse_args(argv)
  hq, hkv, d = a.heads
  dev = jax.devices()[0].device_kind
  bps = hbm_bps(dev)
  t_start = time.perf_counter()
  records = []
  for b in a.batch:
    for t in a.ctx:
      keys = jax.random.split(jax.random.key(t + b), 3)
      q = jax.random.normal(keys[0], (b, hq, d), jnp.bfloat16)
      k = jax.random.normal(keys[1], (b, hkv, t, d), jnp.bfloat16)
      v = jax.random.normal(keys[2], (b, hkv, t, d), jnp.bfloat16)
      pos = jnp.full((b,), t - 1, jnp.int32)
      nbytes = 2 * b * hkv * t * d * 2
      rec = {"device": dev, "batch": b, "ctx": t, "heads": [hq, hkv, d], "read_bytes": nbytes}
      rec["xla_ms"] = time_ms(decode_attention_reference, (q, k, v, pos), a.inner, a.reps)
      mine = ours.launch_plan(b, hq, hkv, t, d, t, None, ours.BlockSizes())
      rec["lrjax_plan_splits"], rec["lrjax_merge"] = mine["meta"]["S"], mine["merge"]
      rec["lrjax_ms"] = time_ms(ours.decode_attention, (q, k, v, pos), a.inner, a.reps)
      for merge in ours.MERGES:  # each merge at every split count
        bs = ours.BlockSizes(merge=merge)
        fn = lambda q, k, v, p, bs=bs: ours.decode_attention(q, k, v, p, block_sizes=bs)  # noqa: E731
        rec[f"lrjax_{merge}_merge_ms"] = time_ms(fn, (q, k, v, pos), a.inner, a.reps)
      if a.append:  # RoPE and the cache write too, as one decode step's attention runs them
        from lrjax.custom_calls.triton import decode_attention_append as dap

        kn, vn = (jax.random.normal(kk, (b, hkv, d), jnp.bfloat16) for kk in keys[1:])
        inv = 1.0 / (500000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
        ops = (q, kn, vn, k, v, pos, *rope_tables(pos, inv, jnp.bfloat16))
        apart = functools.partial(dap.decode_attention_append, new_key_apart=True)
        for name, fn in (
          ("append_unfused", dap.decode_attention_append_reference),
          ("append_lrjax", functools.partial(dap.decode_attention_append, new_key_apart=False)),
          ("append_lrjax_apart", apart),
        ):
          rec[f"{name}_ms"] = time_append_ms(fn, ops, a.inner, a.reps)
      plan = kernel.plan(b, hkv, t)
      rec["pallas_plan_splits"] = plan.k_splits
      rec["pallas_ms"] = time_ms(kernel.decode_attention, (q, k, v, pos), a.inner, a.reps)
      sweep = {}
      for ks in a.splits:
        if isinstance(kernel.plan(b, hkv, t, ks), str):
          continue
        fn = lambda q, k, v, p, ks=ks: kernel.decode_attention(q, k, v, p, k_splits=ks)  # noqa: E731
        sweep[str(ks)] = time_ms(fn, (q, k, v, pos), a.inner, a.reps)
      rec["pallas_ms_by_splits"] = sweep
      if not a.no_cudnn:
        try:
          kt, vt = k.swapaxes(1, 2), v.swapaxes(1, 2)
          rec["cudnn_ms"] = time_ms(cudnn_fn(hq, hkv), (q, kt, vt, pos), a.inner, a.reps)
        except Exception as e:  # noqa: BLE001 - cuDNN's attention may not take this shape
          rec["cudnn_ms"] = None
          rec["cudnn_error"] = f"{type(e).__name__}: {str(e)[:300]}"
      names = ("xla", "lrjax", "lrjax_walk_merge", "lrjax_tile_merge", "pallas", "cudnn")
      for name in names + ("append_unfused", "append_lrjax", "append_lrjax_apart"):
        ms = rec.get(f"{name}_ms")
        if ms:
          rec[f"{name}_read_gbs"] = nbytes / (ms * 1e-3) / 1e9
          rec[f"{name}_hbm_roofline_frac"] = nbytes / bps / (ms * 1e-3) if bps else None
      rec["pallas_speedup_vs_xla"] = rec["xla_ms"] / rec["pallas_ms"]
      rec["lrjax_speedup_vs_xla"] = rec["xla_ms"] / rec["lrjax_ms"]
      rec["lrjax_speedup_vs_pallas"] = rec["pallas_ms"] / rec["lrjax_ms"]
      records.append(rec)
      cud = rec.get("cudnn_ms")
      print(
        f"b={b:3d} ctx={t:5d}: xla {rec['xla_ms'] * 1e3:8.1f} us  lrjax "
        f"{rec['lrjax_ms'] * 1e3:8.1f} us (S={rec['lrjax_plan_splits']}, "
        f"{rec['lrjax_merge']} merge, {rec.get('lrjax_hbm_roofline_frac') or 0:.2f} of HBM; "
        f"walk {rec['lrjax_walk_merge_ms'] * 1e3:.1f}, tile {rec['lrjax_tile_merge_ms'] * 1e3:.1f}"
        " us)  pallas "
        f"{rec['pallas_ms'] * 1e3:8.1f} us (ks={plan.k_splits}, "
        f"{rec.get('pallas_hbm_roofline_frac') or 0:.2f} of HBM)  cudnn "
        f"{'-' if not cud else f'{cud * 1e3:.1f} us'}  "
        + (
          f"append: unfused {rec['append_unfused_ms'] * 1e3:.1f} us, lrjax "
          f"{rec['append_lrjax_ms'] * 1e3:.1f} us, apart "
          f"{rec['append_lrjax_apart_ms'] * 1e3:.1f} us  "
          if a.append
          else ""
        )
        + "sweep "
        + " ".join(f"{ks}:{ms * 1e3:.1f}" for ks, ms in sweep.items()),
        flush=True,
      )
  if a.out:
    old = json.load(open(a.out)) if os.path.exists(a.out) else {"runs": {}, "records": []}
    doc = {
      "runs": dict(old.get("runs", {})),
      "records": [r for r in old.get("records", []) if r["device"] != dev] + records,
    }
    doc["runs"][dev] = {
      "command": "python benchmarks/decode_attention.py " + " ".join(sys.argv[1:]),
      "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
      "machine": machine(),
      "versions": versions("triton"),
      "hbm_bps": bps,
      "wall_s": time.perf_counter() - t_start,
      "method": __doc__.split("\n\n")[2],
    }
    write_json(a.out, doc)
    print("wrote", a.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
