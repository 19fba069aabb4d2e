"""The main job (`make demo`): the whole lrjax pipeline on an embedded default.

1. Train (or reuse the cached) small Llama on a synthetic Markov source whose entropy rate is
   known exactly (~2 CPU minutes the first time; cached under ~/.cache/lrjax/quality).
2. Save it as a dense orbax checkpoint and convert it with the CLI:
   ``lrjax convert --orbax dense --out lowrank --ratio 0.2 --method whiten ...``.
3. Compress in memory with whitening + LoRA recovery, save, reload (checked bit-exact).
4. Run the reloaded low-rank model through ``jax.jit(lrjax.fuse(model))``: print what the
   pass rewrote and the agreement with the unfused model.
5. Print a live quality table (excess nats over the entropy floor) and tokens/s, dense vs
   low-rank.

    python examples/demo.py [--workdir DIR] [--ratio 0.2]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import lrjax
from lrjax import checkpoint
from lrjax.cli import main as lrjax_cli
from lrjax.compression import compress, param_counts
from lrjax.quality import MarkovSource, TrainConfig, evaluate, trained_model


def tokens_per_second(fn, model, tokens, iters=10):
  jax.block_until_ready(fn(model, tokens))  # compile and warm up
  t0 = time.perf_counter()
  for _ in range(iters):
    out = fn(model, tokens)
  jax.block_until_ready(out)
  return tokens.size * iters / (time.perf_counter() - t0)


def same_params(a, b) -> bool:
  la, lb = jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))
  return len(la) == len(lb) and all(
    np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)
  )


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--workdir", default=None, help="where checkpoints go (default: a temp dir)")
  ap.add_argument(
    "--ratio", type=float, default=0.2, help="fraction of each projection's weights removed"
  )
  ap.add_argument("--lora-steps", type=int, default=100)
  args = ap.parse_args()
  work = args.workdir or tempfile.mkdtemp(prefix="lrjax_demo_")
  os.makedirs(work, exist_ok=True)

  print("== 1. train (or reuse) the reference model")
  src = MarkovSource()
  model, rec = trained_model(src)
  seq = TrainConfig().seq_len
  eval_tok = src.sample(1024, seq + 1, seed=1)
  calib_tok = src.sample(64, seq, seed=2)
  lora_tok = src.sample(max(1, args.lora_steps) * 32, seq + 1, seed=3)
  how = "reused from cache" if rec["cached"] else f"trained in {rec['seconds']} s"
  print(f"model {how}; entropy floor {src.entropy_rate:.4f} nats/token")

  print("\n== 2. dense orbax checkpoint -> lrjax convert (whitened SVD)")
  dense_dir, cli_dir = os.path.join(work, "dense"), os.path.join(work, "lowrank_cli")
  calib_path = os.path.join(work, "calib.npy")
  np.save(calib_path, np.asarray(calib_tok))
  checkpoint.save(model, dense_dir, overwrite=True)
  cmd = [
    "convert",
    "--orbax",
    dense_dir,
    "--out",
    cli_dir,
    "--ratio",
    str(args.ratio),
    "--method",
    "whiten",
    "--calib",
    calib_path,
    "--block",
    "4",
    "--overwrite",
  ]
  print("lrjax " + " ".join(cmd))
  if lrjax_cli(cmd) != 0:
    raise SystemExit("lrjax convert failed")
  cli_model = checkpoint.load(cli_dir)

  print(f"\n== 3. whitened SVD + {args.lora_steps} LoRA steps in memory, save, reload")
  small = compress(
    nnx.clone(model),
    ratio=args.ratio,
    calib_tokens=calib_tok,
    block=4,
    lora_steps=args.lora_steps,
    lora_batch=32,
    lora_lr=1e-3,
    lora_tokens=lora_tok,
    progress=False,
  )
  lr_dir = os.path.join(work, "lowrank_lora")
  checkpoint.save(small, lr_dir, overwrite=True)
  reloaded = checkpoint.load(lr_dir)
  print(
    f"reload bit-exact: {same_params(small, reloaded)}; ranks (layer 0): "
    f"{reloaded.layer_ranks()[0]}"
  )

  print("\n== 4. jax.jit(lrjax.fuse(model))")
  probe = jnp.asarray(eval_tok[:64, :-1])
  report = lrjax.explain(reloaded, probe)
  print(
    f"{len(report.matches)} rewrites: "
    + ", ".join(f"{m['pattern']} {m['shapes']}" for m in report.matches)
  )
  unfused = nnx.jit(lambda m, t: m(t))
  fused = nnx.jit(lambda m, t: lrjax.fuse(m)(t))
  ref, out = unfused(reloaded, probe), fused(reloaded, probe)
  err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
  print(f"fused vs unfused: max |Δlogit| / max |logit| = {err:.2e}")
  if not (np.isfinite(err) and err < 1e-4):
    raise SystemExit(f"fused model disagrees with the unfused one: {err:.3g}")

  print("\n== 5. quality (excess nats over the entropy floor, 1024 held-out sequences)")
  rows = [
    ("dense", model, param_counts(model)["actual"]),
    ("whitened SVD (lrjax convert)", cli_model, param_counts(cli_model)["actual"]),
    ("whitened + LoRA (reloaded)", reloaded, param_counts(reloaded)["actual"]),
  ]
  print(f"{'variant':<32}{'excess nats':>12}{'proj. weights':>15}")
  for name, m, n in rows:
    print(f"{name:<32}{evaluate(m, src, eval_tok)['excess_nats']:>12.4f}{n:>15}")
  print(
    "full table at ratios 0.1/0.2/0.4: python benchmarks/quality.py "
    "(results in benchmarks/results/quality.json)"
  )

  tok = jnp.asarray(eval_tok[:256, :-1])
  dense_tps = tokens_per_second(unfused, model, tok)
  lr_tps = tokens_per_second(fused, reloaded, tok)
  print(
    f"\nscoring throughput on {jax.devices()[0].device_kind} ({jax.devices()[0].platform}): "
    f"dense {dense_tps:,.0f} tok/s, low-rank fused {lr_tps:,.0f} tok/s "
    f"({lr_tps / dense_tps:.2f}x)"
  )
  print(f"checkpoints in {work}")


if __name__ == "__main__":
  main()
