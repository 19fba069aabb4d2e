"""``lrjax generate``: serve an lrjax orbax checkpoint on 1 or N devices and print the tokens."""

from __future__ import annotations

import argparse
import os
import time

from lrjax.cli import subcommand

# lrjax.sharding.STRATEGIES and "auto", spelled here so the CLI imports no jax before
# --cpu-devices sets XLA_FLAGS (tests/sharding checks the two agree)
STRATEGY_CHOICES = (
  "auto",
  "lowrank_tp",
  "lowrank_split",
  "lowrank_megatron",
  "naive_tp",
  "repl_u_tp",
  "dense",
)


def _ids(s: str) -> list[int]:
  try:
    out = [int(t) for t in s.split(",") if t.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"{s!r}: expected comma-separated token ids like 1,2,3")  # noqa: B904
  return out


@subcommand("generate", help="generate tokens from an lrjax checkpoint (optionally with TP)")
def generate(p: argparse.ArgumentParser):
  p.add_argument("--ckpt", required=True, metavar="DIR", help="lrjax orbax checkpoint dir")
  p.add_argument(
    "--prompt-ids",
    type=_ids,
    action="append",
    required=True,
    metavar="IDS",
    help="comma-separated prompt token ids; repeat for concurrent requests",
  )
  p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (devices)")
  p.add_argument(
    "--strategy",
    choices=STRATEGY_CHOICES,
    help="default: lowrank_tp for low-rank checkpoints, dense otherwise; auto: the one the "
    "cost model predicts fastest here (lrjax.sharding.explain)",
  )
  p.add_argument("--max-new-tokens", type=int, default=32)
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--top-k", type=int, default=0)
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--stop-ids", type=_ids, default=[], metavar="IDS")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--max-len", type=int, default=512, help="KV cache length per slot")
  p.add_argument("--slots", type=int, default=8, help="concurrent decode slots")
  p.add_argument("--lowrank-kv", action="store_true", help="cache x·U_k, x·U_v (rank space)")
  p.add_argument("--no-warmup", action="store_true", help="time the first (compiling) run")
  p.add_argument(
    "--cpu-devices",
    type=int,
    default=0,
    help="simulate this many CPU devices (for --tp on a CPU-only host)",
  )

  def run(a):
    if a.cpu_devices:
      os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={a.cpu_devices}"
      )
      os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from lrjax.serving import Request, SamplingParams, load_engine

    sp = SamplingParams(
      temperature=a.temperature,
      top_k=a.top_k,
      top_p=a.top_p,
      max_new_tokens=a.max_new_tokens,
      stop_tokens=tuple(a.stop_ids),
      seed=a.seed,
    )
    engine = load_engine(
      a.ckpt,
      tp=a.tp,
      strategy=a.strategy,
      max_slots=a.slots,
      max_len=a.max_len,
      lowrank_kv=a.lowrank_kv,
    )
    reqs = [Request(ids, sp) for ids in a.prompt_ids]
    plan = engine.plan
    print(
      f"model {engine.cfg.model_type} layers={engine.cfg.num_layers} "
      f"strategy={plan.strategy if plan else 'single-device'} tp={plan.tp if plan else 1}"
    )
    if not a.no_warmup:  # compile every prompt bucket and the decode step before timing
      t0 = time.perf_counter()
      engine.generate(
        [
          Request(ids, SamplingParams(max_new_tokens=2))
          # a prompt no bucket holds keys on its length: the engine then rejects it clearly
          for ids in {
            next((b for b in engine.buckets if b >= len(ids)), len(ids)): ids
            for ids in a.prompt_ids
          }.values()
        ]
      )
      print(f"compiled in {time.perf_counter() - t0:.2f} s")
    t0 = time.perf_counter()
    results = engine.generate(reqs)
    dt = time.perf_counter() - t0
    n = sum(len(r.tokens) for r in results)
    for r in results:
      print(
        f"[{r.id}] prompt={r.prompt} -> {','.join(map(str, r.tokens))} "
        f"({r.finish_reason}, ttft {r.ttft_s * 1e3:.1f} ms)"
      )
    note = " (includes compilation)" if a.no_warmup else ""
    print(f"{n} tokens in {dt:.3f} s: {n / dt:.1f} tokens/s{note}")
    t_first = min(r.token_times[0] for r in results)
    t_last = max(r.token_times[-1] for r in results)
    if n > len(results) and t_last > t_first:
      print(f"decode after the first token: {(n - len(results)) / (t_last - t_first):.1f} tokens/s")
    return 0

  return run
