"""Decode X·U·V variants timed side by side on the SAME weights (one GPU): the A/B behind the
tuning table's X·U·V thresholds.

  python benchmarks/decode_ab.py --out ab.json "2,4096,2560,14336|xla,,auto,,persistent:prefetch=64"
  python benchmarks/decode_ab.py --out ab.json --points benchmarks/results/gpu_lowrank_h200.json \\
      --variants "xla,,auto,,env:LRJAX_TRITON_LAUNCH=xla"

``gpu_lowrank.py`` draws fresh weights for every record, and where the weights land in memory
moves a decode call's time by up to ±3 % between records of one shape (XLA's too), more than
many of the changes worth testing. Here each case draws its layers once and times every variant
on them, round-robin, ``--rounds`` times, each time with ``gpu_lowrank.per_call_us`` (L distinct
layers chained in one jit, (t(3L) − t(L)) / 2L from the profiler's device spans); the spread
between rounds is then about ±0.05 µs. The 3L calls reuse each layer three times, so work on
the weights alone (XLA padding V to an aligned rank, say) runs once a layer and cancels;
``--distinct-weights`` draws 3L layers and times each call on its own, as a model step pays it.

A case is ``M,K,r,N|variant,,variant,,...``; a variant is ``xla`` ((x@u)@v), ``auto`` (the
tuning table's plan), one of ``kernel_variants.xuv``'s (``persistent:field=value,...``), or
``env:NAME=VALUE&NAME=VALUE+variant``: that variant traced with those environment variables
set (switches read when a call is traced or lowered, e.g. ``LRJAX_TRITON_LAUNCH``), or
``triton_call+variant``: that variant under launch mode xla_triton with every call of the
persistent X·U·V decode kernel handed to XLA's Triton call, whatever its plan
(``launch_modes.xla_triton_serves`` set aside). ``env:...+triton_call+variant`` combines both.
``--points`` adds every decode X·U·V point of a ``gpu_lowrank.py`` results file (M <=
``--max-m``), each timed with ``--variants``.

Before a case is timed, each variant's output on its first layer is compared with an f32
reference ((x·u)·v at full precision): each record holds its ``rel_err`` and whether it is
within ``REL_TOL`` (bf16's tolerance in tests/conftest.py), and a variant beyond it is printed
as WRONG (the timing probes ``persistent_probe:`` are, by design). A variant that fails to run
(a plan that asks for more shared memory than a CTA has, say) is recorded with its ``error``
and not timed; the other variants and cases go on. ``--kernels`` adds the kernels one call of
each variant ran (names, launches a call, median µs); ``--check-after`` checks the outputs
after the timing, so the timed jits are the process's first GPU work, as in the sweep (XLA
autotunes its GEMMs when they first compile).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import gpu_lowrank as g  # noqa: E402
import kernel_variants  # noqa: E402


TRITON_CALL = "triton_call+"  # variant prefix: XLA's Triton call for every persistent plan
REL_TOL = 1e-2  # ||out - ref|| / ||ref|| a bf16 variant may have (tests/conftest.py's table)


def parse_variant(spec: str) -> tuple[dict, str]:
  """(environment, variant) of ``env:A=1&B=2+variant`` (``auto`` when the variant is left out),
  or ({}, spec)."""
  if not spec.startswith("env:"):
    return {}, spec
  assigns, _, variant = spec[4:].partition("+")
  env = {}
  for a in assigns.split("&"):
    name, eq, value = a.partition("=")
    if not name or not eq:
      raise ValueError(f"{spec!r}: expected env:NAME=VALUE[&NAME=VALUE...][+variant]")
    env[name] = value
  return env, variant or "auto"


@contextlib.contextmanager
def variant_setup(spec: str):
  """The variant of ``spec``, its switches in force until the block ends: its environment set,
  and for ``triton_call+`` launch mode xla_triton with launch_modes.xla_triton_serves
  answering yes for the persistent X·U·V decode kernel. Both restored after."""
  env, variant = parse_variant(spec)
  forced = variant.startswith(TRITON_CALL)
  if forced:
    variant = variant[len(TRITON_CALL) :] or "auto"
    env = dict(env, LRJAX_TRITON_LAUNCH="xla_triton")
    from lrjax.custom_calls.triton import launch_modes

    rule = launch_modes.xla_triton_serves
    name = "_xuv_decode_persistent_kernel"
    launch_modes.xla_triton_serves = lambda kernel, meta: kernel == name or rule(kernel, meta)
  saved = {e: os.environ.get(e) for e in env}
  os.environ.update(env)
  try:
    yield variant
  finally:
    for e, v in saved.items():
      if v is None:
        os.environ.pop(e, None)
      else:
        os.environ[e] = v
    if forced:
      launch_modes.xla_triton_serves = rule


def parse_case(case: str) -> tuple[tuple[int, int, int, int], list[str]]:
  """((M, K, r, N), [variant, ...]) of ``M,K,r,N|variant,,variant``."""
  dims, bar, specs = case.partition("|")
  try:
    m, k, r, n = (int(t) for t in dims.split(","))
  except ValueError:
    raise ValueError(f"{case!r}: expected M,K,r,N|variant,,variant...") from None
  variants = [s for s in specs.split(",,") if s]
  if not bar or not variants:
    raise ValueError(f"{case!r}: expected M,K,r,N|variant,,variant...")
  return (m, k, r, n), variants


def sweep_points(path: str, max_m: int) -> list[tuple[int, int, int, int]]:
  """The (M, K, r, N) of every X·U·V record of a gpu_lowrank.py results file with M <= max_m,
  sorted by shape, then M."""
  with open(path) as fh:
    records = json.load(fh)["records"]
  pts = {
    (r["M"], r["K"], r["r"], r["N"]) for r in records if r.get("op") == "xuv" and r["M"] <= max_m
  }
  return sorted(pts, key=lambda p: (p[1:], p[0]))


def _fn(variant: str, m: int, k: int, r: int, n: int):
  if variant == "xla":
    return lambda x, u, v: (x @ u) @ v
  if variant == "auto":
    from lrjax.custom_calls.triton import xuv_decode  # the CUDA lowering: triton, jax-triton

    return lambda x, u, v: xuv_decode.xuv_decode(x, u, v)
  return kernel_variants.xuv(variant, m, k, r, n)


def xla_triton_serves(m: int, k: int, r: int, n: int, sms: int) -> bool:
  """Whether launch mode xla_triton hands the default plan of x [m, k] · u [k, r] · v [r, n]
  (no bias) on ``sms`` SMs to XLA's Triton call (launch_modes.xla_triton_serves), as
  xuv_decode plans it (the ·V launch, which XLA's Triton call always takes, is not counted)."""
  from lrjax.custom_calls.triton import launch_modes, policy, xuv_decode

  if m > policy.values("xuv_decode").persistent_max_m:
    return False
  launch = xuv_decode.default_persistent_launch(m, k, r, n, False, sms)[2]
  return launch_modes.xla_triton_serves("_xuv_decode_persistent_kernel", launch["meta"])


def time_case(dims, variants, rounds: int, inputs=None, distinct: bool = False) -> dict:
  """{variant: [µs per call, one a round]} on one set of layers: ``inputs`` (x, layers, key),
  else the ones gpu_lowrank.py's record of the shape draws (g.xuv_inputs); ``distinct``:
  each timed call on its own layer (g.per_call_us(distinct=True); ``inputs`` then holds 3L
  layers)."""
  m, k, r, n = dims
  x, layers, _ = inputs or g.xuv_inputs(m, k, r, n, distinct)
  times = {s: [] for s in variants}
  for _ in range(rounds):
    for spec in variants:
      with variant_setup(spec) as variant:
        times[spec].append(g.per_call_us(_fn(variant, m, k, r, n), x, layers, distinct=distinct)[0])
  return times


def kernel_table(fn, x, layers) -> dict:
  """{kernel name: [launches a call, median µs]} of one execution of fn's chain over the
  layers (one pass, so a layer's weight-only work counts once a call; g.kernel_table)."""
  rows = g.kernel_table(g.profiled_executions([g.chained(fn, 1)], x, layers), len(layers))
  return {k["name"]: [round(k["per_call"], 3), round(k["median_us"], 3)] for k in rows}


def check_case(dims, variants, inputs=None) -> dict:
  """{variant: ||out - ref|| / ||ref||, or the error that stopped it (a str: a plan that does
  not lower, e.g. more shared memory than a CTA has)} on the first of the layers time_case
  times (``inputs`` as there), ref the f32 (x·u)·v at full precision."""
  m, k, r, n = dims
  x, layers, _ = inputs or g.xuv_inputs(m, k, r, n)
  u, v = layers[0]
  f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
  hi = jax.lax.Precision.HIGHEST
  ref = np.asarray(
    jnp.matmul(jnp.matmul(f32(x), f32(u), precision=hi), f32(v), precision=hi), np.float64
  )
  errs = {}
  for spec in variants:
    try:
      with variant_setup(spec) as variant:
        out = np.asarray(jax.jit(_fn(variant, m, k, r, n))(x, u, v).astype(jnp.float32), np.float64)
    except Exception as e:  # noqa: BLE001 (recorded with the case; the others still run)
      errs[spec] = f"{type(e).__name__}: {e}".split("\n")[0][:500]
      continue
    errs[spec] = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
  return errs


def _err_text(err) -> str:
  """check_case's verdict on a variant: its relative error, or the error that stopped it."""
  return err if isinstance(err, str) else f"rel err {err:.3g}"


def _default_launch() -> str:
  """The launch mode 'auto' ran under (LRJAX_TRITON_LAUNCH, else the default)."""
  from lrjax.custom_calls.triton import launch_modes

  return launch_modes.launch_mode()


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("cases", nargs="*", help="M,K,r,N|variant,,variant,,...")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--out", required=True, help="JSON file (rewritten after every case)")
  ap.add_argument(
    "--points",
    metavar="JSON",
    help="also each decode X·U·V point of this gpu_lowrank.py results file",
  )
  ap.add_argument("--max-m", type=int, default=32, help="--points' largest M (default 32)")
  ap.add_argument("--variants", default="xla,,auto", help="--points' variants")
  ap.add_argument(
    "--distinct-weights",
    action="store_true",
    help="time each call on its own layer's weights (3L layers drawn), so work "
    "on the weights alone (XLA's pad of an unaligned rank) is paid every "
    "call as in a model step, not once a layer",
  )
  ap.add_argument(
    "--kernels",
    action="store_true",
    help="record the kernels one call of each variant runs (kernel_table)",
  )
  ap.add_argument(
    "--check-after",
    action="store_true",
    help="check outputs after timing, not before (the timed jits compile first; "
    "a variant that fails to run then stops the script)",
  )
  args = ap.parse_args(argv)
  try:  # bad input fails before any timing
    cases = [parse_case(c) for c in args.cases]
    if args.points:
      try:
        pts = sweep_points(args.points, args.max_m)
      except (OSError, ValueError, KeyError) as e:
        raise ValueError(
          f"--points {args.points}: expected a gpu_lowrank.py results JSON ({e})"
        ) from None
      cases += [parse_case(",".join(map(str, p)) + "|" + args.variants) for p in pts]
    if not cases:
      raise ValueError("no cases: give M,K,r,N|variant,,... or --points")
    for _, variants in cases:
      for v in variants:
        parse_variant(v)
  except ValueError as e:
    ap.error(str(e))
  if args.rounds < 1:
    ap.error(f"--rounds {args.rounds}: expected at least 1")
  try:
    import triton

    triton_version = triton.__version__
  except ImportError:
    triton_version = None
  dev = jax.devices()[0]
  sms = int(getattr(dev, "core_count", 0) or 0) if dev.platform == "gpu" else 0
  meta = dict(
    machine=dev.device_kind,
    jax=jax.__version__,
    triton=triton_version,
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    rounds=args.rounds,
    sms=sms or None,
    default_launch=_default_launch(),
    rel_tol=REL_TOL,
    method=__doc__,
    weights="distinct" if args.distinct_weights else "reused",
    checked="after timing" if args.check_after else "before timing",
  )
  records = []
  for dims, variants in cases:
    inputs = g.xuv_inputs(*dims, args.distinct_weights)  # drawn once: checked, then timed
    serves = xla_triton_serves(*dims, sms) if sms else None  # the kernels need a GPU
    if args.check_after:  # a variant that fails to run fails its timing too: stop there
      times = time_case(dims, variants, args.rounds, inputs, args.distinct_weights)
      errs = check_case(dims, variants, inputs)
    else:
      errs = check_case(dims, variants, inputs)
      for spec in variants:
        if isinstance(errs[spec], str):
          records.append(
            dict(
              M=dims[0],
              K=dims[1],
              r=dims[2],
              N=dims[3],
              variant=spec,
              us=None,
              xla_triton_serves=serves,
              error=errs[spec],
            )
          )
          print(
            f"{','.join(map(str, dims)):18s} {spec:50s} FAILED, not timed: {errs[spec]}", flush=True
          )
      times = time_case(
        dims,
        [s for s in variants if not isinstance(errs[s], str)],
        args.rounds,
        inputs,
        args.distinct_weights,
      )
    base = statistics.median(times["xla"]) if "xla" in times else None
    for spec, ts in times.items():
      med = statistics.median(ts)
      ok = not isinstance(errs[spec], str) and errs[spec] <= REL_TOL
      records.append(
        dict(
          M=dims[0],
          K=dims[1],
          r=dims[2],
          N=dims[3],
          variant=spec,
          us=med,
          rounds_us=ts,
          speedup_vs_xla=None if base is None else base / med,
          xla_triton_serves=serves,
          rel_err=errs[spec],
          correct=ok,
        )
      )
      if args.kernels:
        with variant_setup(spec) as variant:
          records[-1]["kernels"] = kernel_table(
            _fn(variant, *dims),
            inputs[0],
            inputs[1][: len(inputs[1]) // 3] if args.distinct_weights else inputs[1],
          )
      print(
        f"{','.join(map(str, dims)):18s} {spec:50s} {med:7.3f} us  "
        f"[{' '.join(f'{t:.2f}' for t in ts)}]"
        + ("" if base is None else f"  x{base / med:.3f} vs xla")
        + ("" if ok else f"  WRONG ({_err_text(errs[spec])} > {REL_TOL})"),
        flush=True,
      )
    g.write_json(args.out, dict(meta=meta, records=records))


if __name__ == "__main__":
  main()
