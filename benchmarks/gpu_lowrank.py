"""The Triton kernels against XLA, call by call, side by side in one run (one GPU).

  R=benchmarks/results
  python benchmarks/gpu_lowrank.py --suite all --out $R/gpu_lowrank_h200.json
  python benchmarks/gpu_lowrank.py --suite decode_group --out $R/gpu_xuv_group_h200.json
  python benchmarks/gpu_lowrank.py --suite kv_attention --out $R/gpu_kv_attention_h200.json
  python benchmarks/gpu_lowrank.py --emit-policy $R/gpu_lowrank_h200.json  # the tuning table

Method (docs/benchmarking.md): per shape, L distinct layers' weights (together larger than L2,
so each call streams its weights from HBM) are called inside ONE jit, once (L calls) and
three times over (3L calls), each call chained to the previous one's output. Each
execution's device time is read from jax.profiler's trace: the span from its first kernel's
start to its last kernel's end, so the GPU's idle gaps between launches count and the host's
dispatch does not. Warmed up, the two jits alternated; per-call time = median(span_3L -
span_L) / 2L, which cancels the execution's fixed costs. ``--distinct-weights`` draws 3L
layers and times each call on a layer of its own, as a model step pays it (work XLA does on
a layer's weights alone, such as padding V, is then paid every call). ``--timing host`` times
host wall-clock around each jit instead (the only timing off a GPU).

For every shape: lrjax's kernel (lrjax.lowering.lr_xuv / lr_mlp / lr_kv_attention lowered to
its Triton kernel, under prefer_kernels), XLA's unfused low-rank chain, XLA's dense layer, and the
roofline floor (max of HBM bytes / BW and FLOPs / peak: the card's HBM rate, H200 4.3 TB/s or
H100 3.35 TB/s, and 790 TFLOP/s; this run's own copy and 8192^3 product are measured too and
stored in "meta").
``default_lowering`` / ``default_us`` record what lrjax does without prefer_kernels: the
tuning table (custom_calls/triton/tuning/) may leave the shape to XLA. ``--variants SPEC,,SPEC``
also times kernel variants beside each default record (benchmarks/kernel_variants.py).

``--append`` adds a run's records to ``--out`` (of the same card); ``--resume`` also skips the
points already there, so a sweep longer than one sitting completes over several runs of the
same command.

``--emit-policy RESULTS`` rewrites the card's tuning table from this sweep's results, its
grouped-kernel run beside it and tp_gpu.py's model steps (benchmarks/policy_tables.py).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import glob
import json
import math
import os
import platform
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import kernel_variants
import lrjax
from lrjax.custom_calls.triton import launch_modes, planner
from results_io import roofline_bps, write_json

DT = jnp.bfloat16
# The roofline fractions are stated against the card's HBM rate (results_io.HBM_BPS) and the
# H200's measured bf16 product rate (the H100's GH100 measures the same). This run's own
# measured ceilings go into "meta".
PEAK_ROOF = planner.H200.peak_flops


@functools.cache
def bw_roof() -> float:
  return roofline_bps(jax.devices()[0].device_kind)


VERBOSE = False


def _sync(x):
  jax.tree_util.tree_map(lambda a: a.block_until_ready(), x)


REPS = 15
# "device": per-call times from the profiler's device timeline; "host": host wall-clock around
# each jit. Off a GPU the host timing is used.
TIMING = "device"
# --distinct-weights: each timed call on a layer of its own (per_call_us(distinct=True)), so
# work XLA does on a layer's weights alone (a pad, a concatenation of factors) is paid every
# call instead of once for the chain's three passes over a layer
DISTINCT = False


def _draws() -> int:
  """Layers drawn a timed layer: 3 with --distinct-weights (per_call_us(distinct=True)), else 1."""
  return 3 if DISTINCT else 1


def chained(fn, passes, first=None):
  """One jit of ``passes`` passes over the layers (the ``first`` ones only, if given), each
  call's input chained to the previous call's output through an optimization_barrier (no
  data change, no copy). XLA can therefore neither CSE the passes nor merge calls that share
  an operand (its DotMerger would otherwise batch the decode GEMVs of different passes into
  one read of the weights). Work on a layer's weights alone (XLA's pad of an unaligned V,
  say) is still CSE'd: it runs once a layer, not once a call.
  """

  @jax.jit
  def f(x, layers):
    outs, cur = [], x
    for _ in range(passes):
      for w in layers[:first]:
        y = fn(cur, *w)
        outs.append(y)
        cur = jax.lax.optimization_barrier((x, y))[0]
    return outs

  return f


def per_call_us(fn, x, layers, reps=None, distinct=False):
  """Time of one fn(x, *layer) call: (t(3L chained calls) - t(L calls)) / 2L, the two jits
  alternated, median over ``reps`` pairs; returns (µs, spread = IQR/median).

  t is the device span of one execution (first kernel start to last kernel end, from
  jax.profiler's trace) when TIMING == "device" and ``x`` is on a GPU, else host wall-clock
  around the jit. The difference cancels the execution's fixed costs either way.

  The 3L calls are three passes over the L layers, so work on a layer's weights alone runs
  once a layer and cancels out too. ``distinct``: ``layers`` holds 3L layers, the 3L calls
  take one each and the L calls the first L, so such work is paid every call, as in a model
  step, where each layer's weights are used once.
  """
  reps = reps or REPS
  n = len(layers)
  if distinct:
    if n % 3 or not n:
      raise ValueError(f"distinct=True: expected 3L layers (3 per timed call's layer), got {n}")
    n //= 3
    f1, f3 = chained(fn, 1, first=n), chained(fn, 1)
  else:
    f1, f3 = chained(fn, 1), chained(fn, 3)
  t_start = time.perf_counter()
  for f in (f1, f3, f1, f3):  # compile, then warm up (clocks, allocator)
    _sync(f(x, layers))
  t_compile = time.perf_counter() - t_start
  device = TIMING == "device" and next(iter(x.devices())).platform == "gpu"

  def attempt():
    diffs = (_device_diffs if device else _host_diffs)(f1, f3, x, layers, reps)
    med = statistics.median(diffs)
    q1, q3 = np.percentile(diffs, [25, 75])
    if med <= 0:  # 2L more calls took no longer: noise (host clock, loaded CPU), not a time
      return 1e6 * med / (2 * n), math.inf
    return 1e6 * med / (2 * n), float((q3 - q1) / med)

  t_us, spread, tries = steadiest(attempt)
  if VERBOSE:
    print(
      f"    [compile+warm-up {t_compile:.1f} s, timing ({'device' if device else 'host'}) "
      f"{tries} x {(time.perf_counter() - t_start - t_compile) / tries:.1f} s]",
      flush=True,
    )
  return t_us, spread


def _host_diffs(f1, f3, x, layers, reps):
  diffs = []
  for _ in range(reps):  # alternate, so drift hits both alike
    t0 = time.perf_counter()
    _sync(f1(x, layers))
    t1 = time.perf_counter()
    _sync(f3(x, layers))
    t3 = time.perf_counter()
    diffs.append((t3 - t1) - (t1 - t0))
  return diffs


PAUSE_S = 0.01  # host pause after each profiled execution: an idle gap on the device


def _device_diffs(f1, f3, x, layers, reps):
  """Seconds: span(f3) - span(f1) per alternated pair, spans from one profiler trace."""
  spans = [span_ns(g) for g in profiled_executions([f1, f3] * reps, x, layers)]
  return [1e-9 * (s3 - s1) for s1, s3 in zip(spans[0::2], spans[1::2])]


def profiled_executions(fns, x, layers):
  """Runs each f(x, layers) of ``fns`` in turn under one profiler trace, a host pause after
  each; returns each execution's device events (split_executions)."""
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for f in fns:
        _sync(f(x, layers))
        time.sleep(PAUSE_S)
    return split_executions(device_kernel_events(d), len(fns))


def device_kernel_events(trace_dir):
  """[(start_ns, end_ns, name)] of every kernel, memset and copy on the GPU's streams in
  the one .xplane.pb that jax.profiler.trace wrote under trace_dir."""
  from jax.profiler import ProfileData

  paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  if len(paths) != 1:
    raise RuntimeError(f"expected one .xplane.pb under {trace_dir}, found {paths}")
  data = ProfileData.from_file(paths[0])
  events = [
    (e.start_ns, e.end_ns, e.name)
    for p in data.planes
    if p.name.startswith("/device:GPU")
    for line in p.lines
    if line.name.startswith("Stream")
    for e in line.events
  ]
  if not events:
    raise RuntimeError(
      f"{paths[0]}: no device events on a GPU stream (planes: {[p.name for p in data.planes]})"
    )
  return events


def split_executions(events, n, pause_ns=int(0.9e9 * PAUSE_S)):
  """The ``n`` executions in ``events`` [(start_ns, end_ns, ...)]: a list of n time-sorted
  event lists, cut at the n - 1 longest idle gaps. Each execution was followed by a host
  pause, so those gaps must all be >= ``pause_ns`` and every other gap shorter (a host
  stall inside an execution stays inside it); otherwise (a stray event, a lost one) this
  raises rather than guess."""
  ev = sorted(events)
  if len(ev) < n:
    raise RuntimeError(f"{len(ev)} device events for {n} executions")
  gaps, end = [], ev[0][1]
  for i in range(1, len(ev)):
    gaps.append((ev[i][0] - end, i))
    end = max(end, ev[i][1])
  gaps.sort(reverse=True)
  cut, rest = gaps[: n - 1], gaps[n - 1 :]
  if (cut and cut[-1][0] < pause_ns) or (rest and rest[0][0] >= pause_ns):
    pieces = sum(g >= pause_ns for g, _ in gaps) + 1
    raise RuntimeError(
      f"the trace does not split into the {n} executions that ran: {pieces} pieces at "
      f"idle gaps of >= {pause_ns} ns (longest gaps, ns: {[g for g, _ in gaps[: n + 1]]})"
    )
  bounds = [0] + sorted(i for _, i in cut) + [len(ev)]
  return [ev[a:b] for a, b in zip(bounds, bounds[1:])]


def busy_ns(events):
  """Time covered by at least one of ``events`` [(start_ns, end_ns, ...)]: the union of their
  intervals (the GPU's busy time; overlapping kernels count once)."""
  total, end = 0, None
  for s, e, *_ in sorted(events):
    if end is None or s > end:
      total, end = total + e - s, e
    elif e > end:
      total, end = total + e - end, e
  return total


def kernel_table(executions, calls: int, name_len: int | None = None) -> list[dict]:
  """[{name, per_call, median_us}] of the kernels in ``executions`` (profiled_executions'
  event lists, ``calls`` calls each): launches a call and median duration of each name (cut
  to ``name_len``), the most time a call first."""
  durs = collections.defaultdict(list)
  for execution in executions:
    for s, e, name in execution:
      durs[name[:name_len]].append((e - s) / 1e3)
  rows = [
    dict(name=n, per_call=len(d) / len(executions) / calls, median_us=statistics.median(d))
    for n, d in durs.items()
  ]
  return sorted(rows, key=lambda k: -k["per_call"] * k["median_us"])


def idle_gaps_ns(events, key=lambda name: name):
  """{(previous kernel, next kernel): (idle ns, count)}: the GPU's idle time before each of
  ``events`` [(start_ns, end_ns, name)] (its start less the latest end before it, where
  positive), summed by the ``key``s of the kernel that ended last and the one that starts."""
  out, end, last = {}, None, None
  for s, e, name in sorted(events):
    if end is not None and s > end:
      pair = (key(last), key(name))
      t, n = out.get(pair, (0, 0))
      out[pair] = (t + s - end, n + 1)
    if end is None or e > end:
      end, last = e, name
  return out


def overlaps_ns(events, key=lambda name: name):
  """{(kernel, kernel): ns}: how long each pair of ``events`` [(start_ns, end_ns, name)] ran
  at the same time (concurrent streams or graph branches), summed by their ``key``s (a
  sorted pair; two launches of one kernel make a pair of one name)."""
  out, active = {}, []
  for s, e, name in sorted(events):
    active = [(e2, n2) for e2, n2 in active if e2 > s]
    for e2, n2 in active:
      pair = tuple(sorted((key(name), key(n2))))
      out[pair] = out.get(pair, 0) + min(e, e2) - s
    active.append((e, name))
  return out


def span_ns(execution):
  """Device span of one execution's time-sorted events: first start to last end."""
  return max(ev[1] for ev in execution) - execution[0][0]


def execution_spans(events, n, **kw):
  """Device span (ns) of each execution (split_executions)."""
  return [span_ns(g) for g in split_executions(events, n, **kw)]


MAX_SPREAD, TRIES = 0.5, 3


def steadiest(attempt, max_spread=None, tries=None):
  """Repeats ``attempt() -> (value, spread)`` while its spread (IQR/median) exceeds
  ``max_spread``, at most ``tries`` times; returns the steadiest (value, spread) and the
  number of attempts. One noisy timing once read faster than the phase it contains."""
  max_spread = MAX_SPREAD if max_spread is None else max_spread
  tries = TRIES if tries is None else tries
  best, n = attempt(), 1
  while best[1] > max_spread and n < tries:
    cur, n = attempt(), n + 1
    if cur[1] < best[1]:
      best = cur
  return best[0], best[1], n


def ours_and_default(fn, x, layers, reps):
  """(ours_us, spread, default_lowering, default_us): the Triton kernel forced, then what
  the default policy lowers (timed separately only when it is not the same program)."""
  with lrjax.lowering.prefer_kernels():
    t_ours, spread = per_call_us(fn, x, layers, reps, DISTINCT)
  text = jax.jit(lambda x, w: fn(x, *w)).lower(x, layers[0]).compile().as_text()
  if launch_modes.count_calls(text):
    return t_ours, spread, "triton", t_ours
  return t_ours, spread, "xla", per_call_us(fn, x, layers, reps, DISTINCT)[0]


def rand(key, shape, scale=1.0):
  return (scale * jax.random.normal(key, shape, jnp.float32)).astype(DT)


def n_layers(bytes_per_layer, m, l2=50e6):
  """Distinct layers per jit: > 4x L2 in total, and 12 at decode (M <= 128), whose calls
  are short: 4 layers of a 50 µs call left IQR/median spreads above 1 (host timing jitter
  on a 0.4 ms difference)."""
  if m <= 128:
    return 12
  return int(min(12 if m <= 4096 else 4, max(4, np.ceil(4 * l2 / bytes_per_layer))))


# ------------------------------------------------------------------ ceilings


def measure_ceilings():
  """HBM bandwidth of a device copy (bytes read + written) and of a read-only reduction
  (a decode GEMV's access pattern), and an 8192^3 bf16 product."""
  n = 1 << 28  # 512 MiB of bf16 per buffer
  arrays = [(rand(jax.random.key(i), (n,)),) for i in range(4)]
  t_us, _ = per_call_us(lambda x, a: a * x[0], rand(jax.random.key(9), (1,)), arrays, reps=10)
  bw = 2 * 2 * n / (t_us * 1e-6)
  # the chained input scales the summand, so no pass can reuse another's sum
  t_us, _ = per_call_us(
    lambda x, a: jnp.sum(a * x[0], dtype=jnp.float32, keepdims=True).astype(DT),
    rand(jax.random.key(9), (1,)),
    arrays,
    reps=10,
  )
  read_bw = 2 * n / (t_us * 1e-6)
  del arrays
  k = 8192
  mats = [(rand(jax.random.key(10 + i), (k, k)),) for i in range(4)]
  t_us, _ = per_call_us(lambda x, q: x @ q, rand(jax.random.key(20), (k, k)), mats, reps=5)
  return bw, read_bw, 2 * k**3 / (t_us * 1e-6)


# ------------------------------------------------------------------ X·U·V


def xuv_inputs(m, k, r, n, distinct=False):
  """(x [M, K], [(u [K, r], v [r, N])] for n_layers distinct layers, a key for more) of one
  X·U·V shape, drawn from a key of the shape alone (decode_ab.py times its variants on these);
  ``distinct``: three times as many layers, for per_call_us(distinct=True)."""
  ks = jax.random.split(jax.random.key(m * 7 + k + r + n), 4)
  nl = n_layers(2 * (k * r + r * n), m) * (3 if distinct else 1)
  lr_layers = [
    (
      rand(jax.random.fold_in(ks[1], i), (k, r), k**-0.5),
      rand(jax.random.fold_in(ks[2], i), (r, n), r**-0.5),
    )
    for i in range(nl)
  ]
  return rand(ks[0], (m, k)), lr_layers, ks[3]


def xuv_record(m, k, r, n, bw, peak, kernel="auto", reps=None, baselines=None):
  """One shape: our kernel (``kernel``: "auto" = lrjax's own choice, else a variant of
  kernel_variants.xuv), XLA's (x@u)@v and XLA's dense x@w. ``baselines``: a record of the
  same shape whose XLA times are reused (variants are timed beside it)."""
  x, lr_layers, dense_key = xuv_inputs(m, k, r, n, DISTINCT)
  nl = len(lr_layers) // _draws()
  if kernel == "auto":
    ours = lambda x, u, v: lrjax.lowering.lr_xuv(x, u, v)
    t_ours, spread, low, t_def = ours_and_default(ours, x, lr_layers, reps)
  else:
    ours = kernel_variants.xuv(kernel, m, k, r, n)
    t_ours, spread = per_call_us(ours, x, lr_layers, reps, DISTINCT)
    low, t_def = "triton", t_ours
  if baselines is not None:
    t_xla, t_dense = baselines["xla_lowrank_us"], baselines["xla_dense_us"]
  else:
    t_xla, _ = per_call_us(lambda x, u, v: (x @ u) @ v, x, lr_layers, reps, DISTINCT)
    dense = [
      (rand(jax.random.fold_in(dense_key, i), (k, n), k**-0.5),) for i in range(len(lr_layers))
    ]
    t_dense, _ = per_call_us(lambda x, w: x @ w, x, dense, reps, DISTINCT)
    del dense
  del lr_layers
  bytes_ = planner.hbm_bytes_xuv(m, k, r, n)
  flops = planner.flops_xuv(m, k, r, n)
  floor = max(bytes_ / bw_roof(), flops / PEAK_ROOF) * 1e6
  return dict(
    op="xuv",
    variant=kernel,
    M=m,
    K=k,
    r=r,
    N=n,
    dtype="bfloat16",
    ours_us=t_ours,
    xla_lowrank_us=t_xla,
    xla_dense_us=t_dense,
    default_lowering=low,
    default_us=t_def,
    floor_us=floor,
    hbm_floor_us=bytes_ / bw_roof() * 1e6,
    hbm_roofline_frac=bytes_ / bw_roof() * 1e6 / t_ours,
    tflops=flops / t_ours / 1e6,
    speedup_vs_xla=t_xla / t_ours,
    layers=nl,
    spread=spread,
    **_weights(),
  )


def _weights() -> dict:
  """A record's ``weights`` field where its calls each had a layer of their own."""
  return dict(weights="distinct") if DISTINCT else {}


def group_record(m, k, members, bw, peak, kernel="group", baselines=None):
  """X·U_i·V_i for members [(r_i, N_i)] sharing x (q/k/v): our grouped kernel (``group``,
  one launch) or one persistent decode call per member (``separate``), against XLA's
  [(x@u_i)@v_i] in one function (its dot merger batches the x@u_i) and XLA's dense x@w_i.
  r and N of the record are the members' sums."""
  from lrjax.custom_calls.triton import xuv_decode, xuv_decode_group

  key = jax.random.key(m * 7 + k + sum(r + n for r, n in members))
  ks = jax.random.split(key, 3)
  per_layer = sum(2 * (k * r + r * n) for r, n in members)
  nl = n_layers(per_layer, m)
  x = rand(ks[0], (m, k))

  def facs(i):
    out = []
    for j, (r, n) in enumerate(members):
      out += [
        rand(jax.random.fold_in(ks[1], 16 * i + j), (k, r), k**-0.5),
        rand(jax.random.fold_in(ks[2], 16 * i + j), (r, n), r**-0.5),
      ]
    return tuple(out)

  layers = [facs(i) for i in range(nl)]
  pairs = lambda w: list(zip(w[0::2], w[1::2]))  # noqa: E731
  if kernel == "group":
    ours = lambda x, *w: tuple(xuv_decode_group.xuv_decode_group(x, pairs(w)))
  elif kernel.startswith("group_rows:"):  # V_i's column tiles at least this many bytes a row
    plan = planner.plan_decode_group(m, k, members, min_row_bytes=int(kernel.split(":")[1]))
    bs = xuv_decode_group.BlockSizes("kernel", plan)
    ours = lambda x, *w: tuple(xuv_decode_group.xuv_decode_group(x, pairs(w), block_sizes=bs))
  elif kernel == "separate":
    ours = lambda x, *w: tuple(xuv_decode.xuv_decode(x, u, v) for u, v in pairs(w))
  else:
    raise ValueError(f"{kernel=}")
  t_ours, spread = per_call_us(ours, x, layers)
  if baselines is None:
    t_xla, _ = per_call_us(lambda x, *w: tuple((x @ u) @ v for u, v in pairs(w)), x, layers)
    dense = [
      tuple(
        rand(jax.random.fold_in(ks[1], 100 + 16 * i + j), (k, n), k**-0.5)
        for j, (_, n) in enumerate(members)
      )
      for i in range(nl)
    ]
    t_dense, _ = per_call_us(lambda x, *w: tuple(x @ wi for wi in w), x, dense)
    del dense
  else:
    t_xla, t_dense = baselines["xla_lowrank_us"], baselines["xla_dense_us"]
  del layers
  bytes_ = sum(planner.hbm_bytes_xuv(m, k, r, n) for r, n in members)
  flops = sum(planner.flops_xuv(m, k, r, n) for r, n in members)
  return dict(
    op="xuv_group",
    variant=kernel,
    M=m,
    K=k,
    r=sum(r for r, _ in members),
    N=sum(n for _, n in members),
    members=members,
    dtype="bfloat16",
    ours_us=t_ours,
    xla_lowrank_us=t_xla,
    xla_dense_us=t_dense,
    default_lowering="triton",
    default_us=t_ours,
    floor_us=max(bytes_ / bw_roof(), flops / PEAK_ROOF) * 1e6,
    hbm_floor_us=bytes_ / bw_roof() * 1e6,
    hbm_roofline_frac=bytes_ / bw_roof() * 1e6 / t_ours,
    tflops=flops / t_ours / 1e6,
    speedup_vs_xla=t_xla / t_ours,
    layers=nl,
    spread=spread,
  )


# ------------------------------------------------------------------ MLP


def _swiglu_lowrank(x, ug, vg, uu, vu, ud, vd):
  return (jax.nn.silu((x @ ug) @ vg) * ((x @ uu) @ vu)) @ ud @ vd


def _swiglu_dense(x, wg, wu, wd):
  return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd


def mlp_record(m, d, f, r, bw, peak, kernel="auto", reps=None, baselines=None):
  """One SwiGLU shape: our kernel ("auto", or a variant of kernel_variants.mlp), XLA's unfused
  low-rank MLP and XLA's dense MLP (``baselines``: a record whose XLA times are reused)."""
  key = jax.random.key(m * 13 + d + f + r)
  ks = jax.random.split(key, 8)
  per_layer = 2 * 3 * r * (d + f)
  nl = n_layers(per_layer, m)
  drawn = nl * _draws()
  x = rand(ks[0], (m, d))

  def fac(i, j, a, b):
    return rand(jax.random.fold_in(ks[j], i), (a, b), a**-0.5)

  layers = [
    (
      fac(i, 1, d, r),
      fac(i, 2, r, f),
      fac(i, 3, d, r),
      fac(i, 4, r, f),
      fac(i, 5, f, r),
      fac(i, 6, r, d),
    )
    for i in range(drawn)
  ]
  low = None
  if kernel == "auto":
    ours = lambda x, ug, vg, uu, vu, ud, vd: lrjax.lowering.lr_mlp(x, (uu, vu), (ud, vd), (ug, vg))
    t_ours, spread, low, t_def = ours_and_default(ours, x, layers, reps)
  else:
    ours = kernel_variants.mlp(kernel, m, d, f, r)
  if low is None:
    t_ours, spread = per_call_us(ours, x, layers, reps, DISTINCT)
    low, t_def = "triton", t_ours
  if baselines is None:
    t_xla, _ = per_call_us(_swiglu_lowrank, x, layers, reps, DISTINCT)
  else:
    t_xla = baselines["xla_lowrank_us"]
  with lrjax.lowering.prefer_kernels():
    mem_ours = jax.jit(ours).lower(x, *layers[0]).compile().memory_analysis()
  mem_xla = jax.jit(_swiglu_lowrank).lower(x, *layers[0]).compile().memory_analysis()
  del layers
  if baselines is None:
    dense = [
      (fac(i, 1, d, f), fac(i, 2, d, f), fac(i, 3, f, d)) for i in range(min(nl, 6) * _draws())
    ]
    t_dense, _ = per_call_us(_swiglu_dense, x, dense, reps, DISTINCT)
    del dense
  else:
    t_dense = baselines["xla_dense_us"]
  bytes_ = planner.hbm_bytes_mlp(m, d, f, r)
  flops = planner.flops_mlp(m, d, f, r)
  floor = max(bytes_ / bw_roof(), flops / PEAK_ROOF) * 1e6
  return dict(
    op="mlp_swiglu",
    variant=kernel,
    M=m,
    K=d,
    r=r,
    N=f,
    dtype="bfloat16",
    ours_us=t_ours,
    xla_lowrank_us=t_xla,
    xla_dense_us=t_dense,
    floor_us=floor,
    default_lowering=low,
    default_us=t_def,
    hbm_floor_us=bytes_ / bw_roof() * 1e6,
    hbm_roofline_frac=bytes_ / bw_roof() * 1e6 / t_ours,
    tflops=flops / t_ours / 1e6,
    speedup_vs_xla=t_xla / t_ours,
    temp_bytes_ours=mem_ours.temp_size_in_bytes,
    temp_bytes_xla=mem_xla.temp_size_in_bytes,
    layers=nl,
    spread=spread,
    **_weights(),
  )


# ------------------------------------------------------------------ low-rank KV attention


def _dense_cache_attention(q, k, v, pos):
  """The dense-cache decode attention a user would otherwise run (lrjax.models.llama)."""
  from lrjax.models.llama import _mask, attend

  b, t = k.shape[:2]
  kpos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  return attend(q[:, None], k, v, _mask(pos[:, None], kpos, kpos <= pos[:, None], None))[:, 0]


def _fresh(q, *cache):
  """The cache tied to this call's q: without it XLA hoists the reference's rebuild of K and V
  (which does not depend on q) out of the repeated calls and times only the attention."""
  return jax.lax.optimization_barrier((q,) + cache)[1:]


def kv_attention_record(b, t, r, hq=32, hkv=8, d=128, kernel="auto", baselines=None):
  """One decode step of attention at Llama-3-8B heads over a low-rank KV cache of rank r
  (r_k = r_v): the Triton kernel ("auto": through lr_kv_attention, else
  "kv:BN,BK,warps,stages[,splits]" block sizes), XLA's lowering of the
  reference (rebuild K for the whole cache, then (p·zv)·v_v), and attention over a dense
  K/V cache of the same length."""
  ks = jax.random.split(jax.random.key(b * 7 + t + r), 6)
  q = rand(ks[0], (b, hq, d))
  per_layer = 2 * b * t * 2 * r
  nl = n_layers(per_layer, 1)
  pos = jnp.full((b,), t - 1, jnp.int32)
  inv = jnp.asarray(1.0 / (500000.0 ** (np.arange(0, d, 2) / d)), jnp.float32)
  caches = [
    (
      rand(jax.random.fold_in(ks[1], i), (b, t, r)),
      rand(jax.random.fold_in(ks[2], i), (b, t, r)),
      rand(jax.random.fold_in(ks[3], i), (r, hkv * d), r**-0.5),
      rand(jax.random.fold_in(ks[4], i), (r, hkv * d), r**-0.5),
    )
    for i in range(nl)
  ]
  attn = lambda q, *c: lrjax.lowering.lr_kv_attention(q, *_fresh(q, *c), pos, inv)
  if kernel == "auto":
    t_ours, spread, low, t_def = ours_and_default(attn, q, caches, None)
  else:
    fn = kernel_variants.kv_attention(kernel)
    t_ours, spread = per_call_us(lambda q, *c: fn(q, *_fresh(q, *c), pos, inv), q, caches)
    low, t_def = "triton", t_ours
  if baselines is not None:
    t_xla, t_dense = baselines["xla_lowrank_us"], baselines["xla_dense_us"]
  else:
    with lrjax.lowering.force_reference():
      t_xla, _ = per_call_us(attn, q, caches)
  # a fresh function per lowering: jax would reuse the first lowering of ``attn`` for both
  with lrjax.lowering.prefer_kernels():
    mem_ours = jax.jit(lambda *a: attn(*a)).lower(q, *caches[0]).compile().memory_analysis()
  with lrjax.lowering.force_reference():
    mem_xla = jax.jit(lambda *a: attn(*a)).lower(q, *caches[0]).compile().memory_analysis()
  del caches
  if baselines is None:
    dense = [
      (
        rand(jax.random.fold_in(ks[5], i), (b, t, hkv, d)),
        rand(jax.random.fold_in(ks[5], 1000 + i), (b, t, hkv, d)),
      )
      for i in range(nl)
    ]
    t_dense, _ = per_call_us(
      lambda q, k, v: _dense_cache_attention(q, *_fresh(q, k, v), pos), q, dense
    )
    del dense
  bytes_ = 2 * (b * t * 2 * r + 2 * r * hkv * d + b * hq * d * 2)
  flops = 2 * b * t * hkv * d * r + 2 * 2 * b * hq * t * d + 2 * b * hq * t * r
  floor = max(bytes_ / bw_roof(), flops / PEAK_ROOF) * 1e6
  return dict(
    op="kv_attention",
    variant=kernel,
    M=b,
    K=t,
    r=r,
    N=hq * d,
    dtype="bfloat16",
    heads=(hq, hkv, d),
    ours_us=t_ours,
    xla_lowrank_us=t_xla,
    xla_dense_us=t_dense,
    floor_us=floor,
    default_lowering=low,
    default_us=t_def,
    hbm_floor_us=bytes_ / bw_roof() * 1e6,
    hbm_roofline_frac=bytes_ / bw_roof() * 1e6 / t_ours,
    tflops=flops / t_ours / 1e6,
    roofline_frac=floor / t_ours,
    speedup_vs_xla=t_xla / t_ours,
    speedup_vs_dense=t_dense / t_ours,
    layers=nl,
    spread=spread,
    temp_bytes_ours=mem_ours.temp_size_in_bytes,
    temp_bytes_xla=mem_xla.temp_size_in_bytes,
  )


# ------------------------------------------------------------------ suites

DECODE_M = (1, 2, 4, 8, 16, 32, 64, 128)
# Two shapes at ratio r(K+N)/KN ~0.75-0.8, then two at the 0.3-0.4 ratios lrjax's users
# compress to
XUV_DECODE_SHAPES = (
  (8192, 4096, 16384),
  (4096, 2560, 14336),
  (8192, 2048, 16384),
  (4096, 1024, 14336),
)
# Attention projections at 40 % removed (lrjax.sharding.analysis.compressed_ranks): Llama-3-70B
# q/o and k/v, then Llama-3-8B's, Llama-3.2-1B's and a TP-8 shard of the 8B q_proj. Smaller
# than every shape above (the 70B k/v), or near one but in a model whose XLA GEMMs behave
# differently, so the policy judges them from their own records.
XUV_ATTN_SHAPES_70B = ((8192, 2456, 8192), (8192, 544, 1024))
XUV_ATTN_SHAPES = XUV_ATTN_SHAPES_70B + (
  (4096, 1216, 4096),
  (4096, 512, 1024),
  (2048, 640, 2048),
  (2048, 256, 512),
  (4096, 152, 4096),
)
# q/k/v projections of Llama-3-70B, Llama-3-8B and Llama-3.2-1B at 40 % removed: (K, [(r_i, N_i)])
GROUP_SHAPES = (
  (8192, ((2456, 8192), (544, 1024), (544, 1024))),
  (4096, ((1216, 4096), (512, 1024), (512, 1024))),
  (2048, ((640, 2048), (256, 512), (256, 512))),
  # the ranks the models get (multiples of 64): Llama-3-70B's and Qwen2.5-7B's
  (8192, ((2432, 8192), (576, 1024), (576, 1024))),
  (3584, ((1088, 3584), (256, 512), (256, 512))),
)
PREFILL_M = (1024, 2048, 4096, 8192, 16384, 32768)
MLP_SHAPES = {
  "llama3.2-1b": (2048, 8192, 1280),
  "llama3-8b": (4096, 14336, 2560),
  "llama3-8b-r1024": (4096, 14336, 1024),
  "llama3-70b": (8192, 28672, 3824),
  "qwen2.5-7b": (3584, 18944, 2048),
  # the rank the model benchmark (tp_gpu.py: multiples of 64) gives the 70B MLP;
  # XLA runs it faster than 3824 (T=1: 206.4 against 218.3 us)
  "llama3-70b-r3840": (8192, 28672, 3840),
}
# D_ff in more 128-column slices than the H200's 132 SMs, like Llama-3-70B's (224) and unlike
# the 8B's (112)
MLP_SLICE_SHAPES = {
  "qwen2.5-32b": (5120, 27648, 3072),
  "phi3-medium": (5120, 17920, 2432),
  "yi-34b": (7168, 20480, 3200),
  "gemma-7b": (3072, 24576, 1664),
}
MLP_SHAPES.update(MLP_SLICE_SHAPES)
# in priority order (the JSON is rewritten after every record); the MLP_SLICE_SHAPES at
# T <= 16, so that the policy judges those models by their own records
MLP_TOKENS = (
  ("llama3-8b", (1, 16, 4096, 4, 64)),
  ("llama3.2-1b", (1, 16, 4096)),
  ("llama3-8b-r1024", (1, 16, 4096)),
  ("llama3-8b", (2, 8, 32, 128, 1024)),
  ("llama3.2-1b", (4, 64, 1024)),
  ("llama3-70b", (1, 4, 16, 32, 64, 128)),
  ("qwen2.5-7b", (1, 4, 16)),
  ("llama3-70b-r3840", (1, 4, 16, 32, 64, 128)),
  *((label, (1, 4, 16)) for label in MLP_SLICE_SHAPES),
)
# (batch, cache length, rank) at Llama-3-8B heads
KV_ATTENTION_SHAPES = (
  (1, 4096, 512),
  (8, 4096, 512),
  (8, 16384, 512),
  (8, 16384, 256),
  (32, 4096, 512),
  (1, 32768, 512),
)


def record_key(rec: dict) -> tuple:
  """What makes a record one point of a sweep: (op, variant, M, K, r, N)."""
  return rec["op"], rec["variant"], rec["M"], rec["K"], rec["r"], rec["N"]


def earlier_runs(out: str, machine: str) -> tuple[list, list, str | None]:
  """(records, runs, note) already in ``out`` (none if it does not exist), for a run that adds
  to it; SystemExit if they were measured on another card than ``machine``."""
  if not os.path.exists(out):
    return [], [], None
  with open(out) as fh:
    old = json.load(fh)
  card, theirs = machine.split(" (")[0], old["meta"]["machine"].split(" (")[0]
  if card != theirs:
    raise SystemExit(
      f"{out} holds records of {theirs}; this is {card}: write its records to a file of its "
      "own (gpu_lowrank_<card>.json)"
    )
  return old["records"], old["meta"].get("runs", []), old["meta"].get("note")


def suite(name, bw, peak, args, recs, done=frozenset()):
  """Times the records of suite ``name`` into ``recs``: each default record, then each of
  ``args.variants`` (kernel_variants specs of the suite's op) beside it. A point whose every
  record is in ``done`` (their :func:`record_key`, ``--resume``) is skipped."""
  variants = [v for v in (args.variants or "").split(",,") if v]
  ms = [m for m in DECODE_M if args.min_m <= m <= args.max_m]

  def todo(op, m, k, r, n, names):
    return not all((op, v, m, k, r, n) in done for v in names)

  def xuv_points(points):
    for m, k, r, n, kw in points:
      if not todo("xuv", m, k, r, n, ["auto", *variants]):
        continue
      base = xuv_record(m, k, r, n, bw, peak, **kw)
      recs.append(base)
      for v in variants:
        recs.append(xuv_record(m, k, r, n, bw, peak, v, baselines=base))

  if name in ("decode", "all"):
    xuv_points([(m, k, r, n, {}) for k, r, n in XUV_DECODE_SHAPES for m in ms])
  if name in ("decode_attn", "all"):
    xuv_points([(m, k, r, n, {}) for k, r, n in XUV_ATTN_SHAPES for m in ms])
  if name in ("prefill", "all"):
    big = [(m, 8192, 4096, 16384, dict(reps=7 if m > 4096 else None)) for m in PREFILL_M]
    xuv_points(big + [(m, 7168, 4096, 18432, {}) for m in (1024, 4096)])
  if name in ("mlp", "all"):
    for label, tokens in MLP_TOKENS:
      d, f, r = MLP_SHAPES[label]
      for m in tokens if args.mlp_models is None or label in args.mlp_models else ():
        if args.min_m <= m <= args.max_m and todo("mlp_swiglu", m, d, r, f, ["auto", *variants]):
          base = dict(mlp_record(m, d, f, r, bw, peak), model=label)
          recs.append(base)
          for v in variants:
            recs.append(dict(mlp_record(m, d, f, r, bw, peak, v, baselines=base), model=label))
  if name == "decode_group":  # the grouped q/k/v kernel, then one decode call per member
    for k, members in GROUP_SHAPES:
      r_all, n_all = sum(r for r, _ in members), sum(n for _, n in members)
      for m in (m for m in ms if m <= 64):
        if not todo("xuv_group", m, k, r_all, n_all, ["group", "separate", *variants]):
          continue
        base = group_record(m, k, list(members), bw, peak)
        recs.append(base)
        recs.append(group_record(m, k, list(members), bw, peak, "separate", baselines=base))
        for v in variants:
          recs.append(group_record(m, k, list(members), bw, peak, v, baselines=base))
  if name == "kv_attention":  # decode attention over a low-rank KV cache
    for b, t, r in KV_ATTENTION_SHAPES:
      # N: the query heads' width at kv_attention_record's default heads (32 × 128)
      if not todo("kv_attention", b, t, r, 32 * 128, ["auto", *variants]):
        continue
      base = kv_attention_record(b, t, r)
      recs.append(base)
      for v in variants:
        recs.append(kv_attention_record(b, t, r, kernel=v, baselines=base))
  for spec in args.extra:  # op/M,K,r,N/variant
    op, dims, variant = spec.split("/")
    m, k, r, n = (int(t) for t in dims.split(","))
    if op == "xuv":
      recs.append(xuv_record(m, k, r, n, bw, peak, variant))
    else:
      recs.append(mlp_record(m, k, n, r, bw, peak, variant))
  return recs


def _print(rec):
  print(
    f"{rec['op']:<10} {rec['variant']:<14} M={rec['M']:<6} K={rec['K']:<5} r={rec['r']:<5} "
    f"N={rec['N']:<6} ours {rec['ours_us']:8.1f} us  xla {rec['xla_lowrank_us']:8.1f}  "
    f"dense {rec['xla_dense_us']:8.1f}  floor {rec['floor_us']:7.1f}  "
    f"hbm {100 * rec['hbm_roofline_frac']:5.1f}%  {rec['tflops']:6.1f} TF/s  "
    f"x{rec['speedup_vs_xla']:.2f}  default: {rec['default_lowering']} "
    f"{rec['default_us']:.1f} us",
    flush=True,
  )


def _plot_kv_attention(recs, path_json, plt) -> str:
  """Time and temporary memory per shape: the kernel, XLA's reference lowering, and a
  dense cache."""
  from plotting import save_beside

  labels = [f"B={r['M']}\nT={r['K']}\nr={r['r']}" for r in recs]
  x = np.arange(len(recs))
  fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
  for i, (key, name) in enumerate(
    (
      ("ours_us", "Triton kernel"),
      ("xla_lowrank_us", "XLA: the reference lowering"),
      ("xla_dense_us", "XLA: dense K/V cache"),
    )
  ):
    axes[0].bar(x + (i - 1) * 0.27, [r[key] for r in recs], 0.27, label=name)
  axes[0].set(
    yscale="log",
    ylabel="µs per decode step (one layer)",
    title="attention from a low-rank KV cache",
  )
  for i, (key, name) in enumerate(
    (("temp_bytes_ours", "Triton kernel"), ("temp_bytes_xla", "XLA: the reference lowering"))
  ):
    axes[1].bar(x + (i - 0.5) * 0.4, [r[key] / 1e6 for r in recs], 0.4, label=name)
  axes[1].set(yscale="log", ylabel="temporary memory (MB)", title="temporaries")
  for ax in axes:
    ax.set_xticks(x, labels, fontsize=7)
    ax.legend(fontsize=7)
  return save_beside(fig, path_json)


def _ring_distinct(ax, recs, y):
  """Rings the points of ``recs`` timed with each call on its own layer (``weights``)."""
  rs = [r for r in recs if r.get("weights") == "distinct"]
  if rs:
    ax.scatter(
      [r["M"] for r in rs],
      [y(r) for r in rs],
      s=110,
      facecolors="none",
      edgecolors="black",
      linewidths=1.0,
      zorder=3,
      label="ringed: distinct weights",
    )


def plot(path_json: str) -> str | None:
  """Plots a results JSON beside it (PNG): roofline fractions and speedups vs XLA, of its
  default-kernel ("auto") records; None (no file) where it has none (a variant suite timed
  against another base)."""
  recs = json.load(open(path_json))["records"]
  auto = [r for r in recs if r["variant"] == "auto" and r.get("canonical", True)]
  if not auto:
    return None
  from plotting import pyplot, save_beside

  plt = pyplot()
  if auto and all(r["op"] == "kv_attention" for r in auto):
    return _plot_kv_attention(auto, path_json, plt)
  fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
  ax = axes[0]
  for shape in sorted(
    {(r["K"], r["r"], r["N"]) for r in auto if r["op"] == "xuv" and r["M"] <= 128}
  ):
    rs = sorted(
      (r for r in auto if r["op"] == "xuv" and (r["K"], r["r"], r["N"]) == shape and r["M"] <= 128),
      key=lambda r: r["M"],
    )
    lbl = f"{shape[0]}→{shape[1]}→{shape[2]}"
    ax.plot([r["M"] for r in rs], [r["hbm_roofline_frac"] for r in rs], "o-", label=f"lrjax {lbl}")
    ax.plot(
      [r["M"] for r in rs],
      [r["hbm_floor_us"] / r["xla_lowrank_us"] for r in rs],
      "x--",
      label=f"XLA (x@u)@v {lbl}",
    )
  _ring_distinct(
    ax, [r for r in auto if r["op"] == "xuv" and r["M"] <= 128], lambda r: r["hbm_roofline_frac"]
  )
  ax.axhline(0.85, color="gray", lw=0.8)
  ax.set(
    xscale="log",
    xlabel="tokens M",
    ylabel="fraction of HBM roofline (4.3 TB/s)",
    title="decode X·U·V",
  )
  ax.legend(fontsize=7)
  ax = axes[1]
  rs = sorted(
    (r for r in auto if r["op"] == "xuv" and r["M"] >= 1024 and r["K"] == 8192),
    key=lambda r: r["M"],
  )
  if rs:
    flops = [planner.flops_xuv(r["M"], r["K"], r["r"], r["N"]) for r in rs]
    ax.plot([r["M"] for r in rs], [r["tflops"] for r in rs], "o-", label="lrjax (Triton)")
    ax.plot(
      [r["M"] for r in rs],
      [f / r["xla_lowrank_us"] / 1e6 for f, r in zip(flops, rs)],
      "x--",
      label="XLA (x@u)@v",
    )
    ax.plot(
      [r["M"] for r in rs],
      [f / r["xla_dense_us"] / 1e6 for f, r in zip(flops, rs)],
      "s:",
      label="XLA dense x@w (low-rank FLOPs / time)",
    )
    ax.axhline(670, color="gray", lw=0.8)
  ax.set(xscale="log", xlabel="tokens M", ylabel="TFLOP/s", title="prefill X·U·V 8192→4096→16384")
  ax.legend(fontsize=7)
  ax = axes[2]
  for model in sorted({r.get("model") for r in auto if r["op"] == "mlp_swiglu"} - {None}):
    rs = sorted((r for r in auto if r.get("model") == model), key=lambda r: r["M"])
    ax.plot(
      [r["M"] for r in rs], [r["speedup_vs_xla"] for r in rs], "o-", label=f"{model} vs XLA unfused"
    )
    ax.plot(
      [r["M"] for r in rs],
      [r["xla_dense_us"] / r["ours_us"] for r in rs],
      "x--",
      label=f"{model} vs XLA dense MLP",
    )
  _ring_distinct(
    ax,
    [r for r in auto if r.get("model") and r["op"] == "mlp_swiglu"],
    lambda r: r["speedup_vs_xla"],
  )
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set(
    xscale="log",
    xlabel="tokens T",
    ylabel="speedup (higher is better)",
    title="fused low-rank SwiGLU MLP",
  )
  ax.legend(fontsize=7)
  return save_beside(fig, path_json)


def _launch_label(launch) -> str:
  """The custom-call target (and LRJAX_TRITON_LAUNCH mode) this run's Triton calls lower to;
  calls with a memset before the launch stay with jaxlib's under "xla" and "xla_triton", and
  under "xla_triton" only the persistent X·U·V decode kernel takes XLA's Triton call, on the
  plans launch_modes.xla_triton_serves names (launch.py)."""
  mode = launch.launch_mode()
  if mode == "jaxlib":
    return launch.FFI_TARGET if launch.use_ffi() else launch.LEGACY_TARGET
  if mode == "xla_triton":
    return (
      f"{launch_modes.XLA_TRITON_TARGET} for the persistent X·U·V decode kernel's "
      "launch_modes.xla_triton_serves plans, else "
      f"{launch_modes.XLA_TARGET} ({mode})"
    )
  return f"{launch_modes.XLA_TARGET if mode == 'xla' else launch.LAUNCH_TARGET} ({mode})"


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument(
    "--suite",
    default="all",
    choices=[
      "decode",
      "decode_attn",
      "prefill",
      "mlp",
      "all",
      "decode_group",
      "kv_attention",
      "none",
    ],  # fmt: skip
  )
  ap.add_argument(
    "--variants",
    help="kernel variants to time beside each default record, SPEC,,SPEC "
    "(benchmarks/kernel_variants.py)",
  )
  ap.add_argument("--extra", nargs="*", default=[], help="op/M,K,r,N/variant")
  ap.add_argument("--out", default="benchmarks/results/gpu_lowrank_h200.json")
  ap.add_argument("--plot", metavar="JSON", help="only plot an existing results file")
  ap.add_argument(
    "--emit-policy",
    metavar="JSON",
    help="only rewrite the card's tuning table (custom_calls/triton/tuning/) from a results file",
  )
  ap.add_argument(
    "--choice-report",
    metavar="JSON",
    help="only report how well the tuning table the card of a results file uses chooses "
    "on its records",
  )
  ap.add_argument(
    "--append",
    action="store_true",
    help="keep the records already in --out (a sweep split over several runs); "
    "a shape measured again replaces its old record",
  )
  ap.add_argument(
    "--resume",
    action="store_true",
    help="--append, and skip the points whose records --out already holds: a sweep longer "
    "than one sitting, run again until it is complete",
  )
  ap.add_argument(
    "--max-m", type=int, default=1 << 30, help="only shapes of at most this many rows"
  )
  ap.add_argument("--min-m", type=int, default=0, help="only shapes of at least this many rows")
  ap.add_argument(
    "--mlp-models", nargs="*", choices=sorted(MLP_SHAPES), help="only these models' MLP shapes"
  )
  ap.add_argument("--verbose", action="store_true", help="print compile and timing seconds")
  ap.add_argument("--reps", type=int, default=15, help="alternated repetitions per timing")
  ap.add_argument(
    "--timing",
    choices=["device", "host"],
    default="device",
    help="per-call time from the profiler's device timeline, or host wall-clock",
  )
  ap.add_argument(
    "--distinct-weights",
    action="store_true",
    help="each timed call on a layer of its own (3L layers drawn), so work on a layer's "
    "weights alone is paid every call",
  )
  args = ap.parse_args()
  global VERBOSE, REPS, TIMING, DISTINCT
  VERBOSE, REPS, TIMING = args.verbose, args.reps, args.timing
  DISTINCT = args.distinct_weights
  if args.plot:
    print(plot(args.plot) or "no default-kernel records to plot")
    return
  if args.emit_policy:
    import policy_tables

    print(f"wrote {policy_tables.emit(args.emit_policy)}")
    return
  if args.choice_report:
    import policy_tables

    print(policy_tables.choice_report(args.choice_report))
    return
  import triton

  dev = jax.devices()[0]
  bw, read_bw, peak = measure_ceilings()
  print(
    f"device {dev.device_kind}: copy {bw / 1e12:.2f} TB/s, read {read_bw / 1e12:.2f} TB/s, "
    f"bf16 matmul {peak / 1e12:.0f} TFLOP/s"
  )
  meta = dict(
    machine=f"{dev.device_kind} ({os.cpu_count()} CPU cores, {platform.machine()})",
    jax=jax.__version__,
    triton=triton.__version__,
    jax_triton=__import__("jax_triton").__version__,
    xla_flags=os.environ.get("XLA_FLAGS", ""),
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    measured_hbm_bw=bw,
    measured_read_bw=read_bw,
    measured_bf16_flops=peak,
    roofline_hbm_bw=bw_roof(),
    roofline_bf16_flops=PEAK_ROOF,
    timing=TIMING,
    method=(
      "per-call time = median(t(3L chained calls) - t(L chained calls)) / 2L, "
      "one jit each, alternated, L distinct layers (> L2 in total), after "
      "warm-up; t = "
      + (
        "the execution's device span (first kernel start to last kernel "
        "end) in a jax.profiler trace"
        if TIMING == "device"
        else "host wall-clock around the jit"
      )
      + "; spread = IQR/median of the differences; runs with a "
      "'retry' entry repeat a timing whose spread exceeds it and keep the "
      "steadiest attempt"
    ),
  )
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)

  prior, runs, note = (
    earlier_runs(args.out, meta["machine"]) if args.append or args.resume else ([], [], None)
  )
  if note:  # what was written about the earlier runs stays with them
    meta["note"] = note
  from lrjax.custom_calls.triton import launch

  run = dict(
    index=len(runs),
    suite=args.suite,
    extra=args.extra,
    variants=args.variants,
    timing=TIMING,
    weights="distinct" if DISTINCT else "reused",
    triton_launch=_launch_label(launch),
    retry=dict(max_spread=MAX_SPREAD, tries=TRIES),
    **{
      k: meta[k]
      for k in ("date", "measured_hbm_bw", "measured_read_bw", "measured_bf16_flops", "xla_flags")
    },
  )
  meta["runs"] = runs + [run]

  class Records(list):  # rewrites the JSON after every record (a killed run keeps its data)
    def append(self, rec):
      nonlocal prior
      prior = [p for p in prior if record_key(p) != record_key(rec)]  # re-measured: replaced
      super().append(dict(rec, run=run["index"]))
      _print(rec)
      allrecs = prior + list(self)
      write_json(args.out, dict(meta=meta, records=allrecs))

  recs = Records()
  done = frozenset(map(record_key, prior)) if args.resume else frozenset()
  if done:
    print(f"resuming: {len(done)} records already in {args.out}")
  suite(args.suite, bw, peak, args, recs, done)
  png = plot(args.out)
  print(
    f"wrote {len(recs)} records to {args.out}; "
    + (f"plot {png}" if png else "no default-kernel records to plot")
  )


if __name__ == "__main__":
  main()
