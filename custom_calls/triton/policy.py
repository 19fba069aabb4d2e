"""The Triton kernels' tuning data, one JSON table per GPU model (``tuning/policy_*.json``).

A table holds what was measured on one card:

- ``records``: each benchmarked call, (op, M, K, r, N, kernel µs, XLA µs), and ``model_ab`` /
  ``model_op_ab``: whole decode steps with and without the kernels (or without one op's). The
  registry asks :func:`verdict` before it lowers a primitive with a Triton kernel; where the
  kernel measured slower than XLA around the call's shape, XLA lowers the reference instead.
- ``thresholds``: the measured switches of the kernels and the planner (which schedule, which
  tiles), by section (``dispatch``, ``planner``, ``xuv_decode``, ``mlp_decode``,
  ``decode_attention``), each with its value and a one-line reason.
- ``tiles``: tuned block sizes by shape class, per kernel (``BlockSizes.get_default``).

The table is chosen by the device's name (``jax.devices()[0].device_kind``). A GPU without a
table of its own uses the nearest one (the same model family, else the default table) and
:func:`note` says so, as does ``lrjax.lowering.explain``. ``LRJAX_TRITON_POLICY`` (a table's
path or device name, read once) overrides the choice. ``benchmarks/gpu_lowrank.py
--emit-policy`` writes a table's measured parts from benchmark results.

Light module: json and the standard library; jax only to read the device's name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import json
import math
import os
import statistics
import threading
import types
from collections.abc import Iterator, Mapping

TUNING_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuning")
DEFAULT_DEVICE = "NVIDIA H200"  # the table of a device that is not a GPU, or of no known family
OPS = ("xuv", "xuv_group", "mlp_swiglu")  # the ops the records time (op names of tp_gpu.py)
SECTIONS = ("dispatch", "planner", "xuv_decode", "mlp_decode", "decode_attention")


@dataclasses.dataclass(frozen=True, eq=False)  # compared and hashed by identity
class Table:
  """One card's tuning data (see the module docstring)."""

  device: str  # the card it was measured on, as jax names it
  measured_on: str  # "<device>, <date>" of the kernel records
  sources: Mapping[str, object]  # the benchmark results the measured parts come from
  records: tuple[tuple[str, int, int, int, int, float, float], ...]
  model_ab: tuple[tuple[str, int, int, float, float], ...]  # (model, hidden, batch, ms, XLA ms)
  model_op_ab: tuple[tuple[str, int, int, str, float, float], ...]  # (..., op, ms, ms w/o op)
  thresholds: Mapping[str, Mapping[str, Mapping[str, object]]]  # section -> name -> value, why
  tiles: Mapping[str, Mapping[str, Mapping[str, object]]]  # kernel -> shape class -> fields
  device_kinds: tuple[str, ...] = ()  # other names jax gives this card
  path: str = ""  # the file it was read from

  def __post_init__(self):
    for section, items in self.thresholds.items():
      if section not in SECTIONS:
        raise ValueError(f"{self.path}: threshold section {section!r}, expected one of {SECTIONS}")
      for name, item in items.items():
        if set(item) != {"value", "why"} or not str(item["why"]).strip():
          raise ValueError(
            f"{self.path}: threshold {section}.{name} must be {{'value': ..., 'why': '...'}}, "
            f"got {item}"
          )

  def values(self, section: str) -> types.SimpleNamespace:
    """The thresholds of ``section`` as attributes (``table.values("planner").round_trip_us``)."""
    return _values(self, section)

  def why(self, section: str, name: str) -> str:
    return str(self.thresholds[section][name]["why"])

  def with_values(self, section: str, **values) -> Table:
    """This table with some thresholds of ``section`` replaced (tests and A/B runs)."""
    items = dict(self.thresholds[section])
    for name, value in values.items():
      if name not in items:
        raise KeyError(f"{section}.{name} is not a threshold of {self.path or self.device}")
      items[name] = dict(items[name], value=value)
    return dataclasses.replace(self, thresholds={**self.thresholds, section: items})

  def replace(self, **fields) -> Table:
    return dataclasses.replace(self, **fields)


@functools.lru_cache(maxsize=64)
def _values(table: Table, section: str) -> types.SimpleNamespace:
  return types.SimpleNamespace(**{k: v["value"] for k, v in table.thresholds[section].items()})


def load(path: str) -> Table:
  """The table in the JSON file ``path``."""
  with open(path) as fh:
    return load_text(fh.read(), path)


def load_text(text: str, path: str = "") -> Table:
  """The table in JSON ``text`` (read from ``path``)."""
  d = json.loads(text)
  return Table(
    device=d["device"],
    device_kinds=tuple(d.get("device_kinds", ())),
    measured_on=d["measured_on"],
    sources=d["sources"],
    records=tuple(tuple(r) for r in d["records"]),
    model_ab=tuple(tuple(a) for a in d["model_ab"]),
    model_op_ab=tuple(tuple(a) for a in d["model_op_ab"]),
    thresholds=d["thresholds"],
    tiles=d["tiles"],
    path=path,
  )


@functools.cache
def tables() -> tuple[Table, ...]:
  """Every shipped table (``tuning/policy_*.json``)."""
  return tuple(load(p) for p in sorted(glob.glob(os.path.join(TUNING_DIR, "policy_*.json"))))


def _norm(name: str) -> str:
  return " ".join(name.lower().split())


def _family(name: str) -> str | None:
  """The model family in a device name: "h100" of "NVIDIA H100 80GB HBM3"."""
  for word in _norm(name).replace("-", " ").split():
    if word not in ("nvidia", "tesla") and any(c.isdigit() for c in word):
      return word
  return None


def for_device(device_kind: str | None, gpu: bool = True) -> tuple[Table, str | None]:
  """The table for a device named ``device_kind`` and, where it is not that device's own, a
  note that says which one stands in. ``gpu=False``: not a GPU (the default table, noted)."""
  shipped = tables()
  if not shipped:
    raise FileNotFoundError(f"no tuning table in {TUNING_DIR} (the package data is missing)")
  default = next((t for t in shipped if t.device == DEFAULT_DEVICE), shipped[0])
  if not gpu or not device_kind:
    return default, f"policy: measured on {default.measured_on} (no GPU here)"
  want = _norm(device_kind)
  for t in shipped:
    if want in {_norm(t.device), *map(_norm, t.device_kinds)}:
      return t, None
  fam = _family(device_kind)
  near = next((t for t in shipped if fam is not None and _family(t.device) == fam), default)
  return near, (
    f"policy: measured on {near.measured_on}; this device {device_kind} has no table, "
    "using the nearest"
  )


def _device() -> tuple[str | None, bool]:
  """(name, is a GPU) of this process's first device, or (None, False) without a backend."""
  try:
    import jax

    dev = jax.devices()[0]
  except Exception:  # no backend at all: the default table
    return None, False
  return getattr(dev, "device_kind", None), dev.platform in ("gpu", "cuda", "rocm")


_lock = threading.Lock()
_chosen: tuple[Table, str | None] | None = None
_override = threading.local()


def _choose() -> tuple[Table, str | None]:
  global _chosen
  with _lock:
    if _chosen is None:
      forced = os.environ.get("LRJAX_TRITON_POLICY", "")
      if forced and os.path.isfile(forced):
        _chosen = (load(forced), f"policy: {forced} (LRJAX_TRITON_POLICY)")
      elif forced:
        _chosen = for_device(forced)
      else:
        _chosen = for_device(*_device())
    return _chosen


def current() -> Table:
  """This process's table: the one :func:`use` set in this thread, else the device's."""
  return getattr(_override, "table", None) or _choose()[0]


def note() -> str:
  """Which table serves this process and, where it is not the device's own, why."""
  table = getattr(_override, "table", None)
  if table is not None:
    return f"policy: measured on {table.measured_on} (set by policy.use)"
  t, why = _choose()
  return why or f"policy: measured on {t.measured_on}"


@contextlib.contextmanager
def use(table: Table | None) -> Iterator[Table | None]:
  """Within this context (this thread), ``current()`` is ``table`` (None: the device's own):
  for tests and for A/B runs of a threshold. Kernel choices happen at lowering: wrap the
  first call of a fresh jit."""
  prev = getattr(_override, "table", None)
  _override.table = table
  try:
    yield table
  finally:
    _override.table = prev


def values(section: str) -> types.SimpleNamespace:
  """The current table's thresholds of ``section``."""
  return current().values(section)


def tiles(kernel: str) -> dict:
  """The current table's tuned block sizes of ``kernel``, by shape class."""
  return dict(current().tiles.get(kernel, {}))


# ---------------------------------------------------------------- the dispatch verdict

_OVERRIDE_HINT = "lrjax.lowering.prefer_kernels() or LRJAX_PREFER_KERNELS=1 uses the kernel anyway"


def _weight_elems(op: str, k: int, r: int, n: int) -> int:
  # xuv_group rows hold summed ranks and widths, so r·(K+N) bounds the group's factor size;
  # queries and records use the same measure, which is all the nearest-shape search needs
  return 3 * r * (k + n) if op == "mlp_swiglu" else r * (k + n)


def path(op: str, m: int, table: Table | None = None) -> int:
  """Which of an op's code paths serves M rows, for pooling records: 0 at M = 1 (XLA too
  lowers one row differently: a multiply and a reduce, not a GEMM), 1 up to ``wide_m`` rows;
  for X·U·V, 2 above, where its kernel runs 64- and 128-row blocks and leaves ·V to another
  launch; for the MLP, 2 from ``compose_min_m`` rows, where it runs as X·U·V decode calls."""
  t = (table or current()).values("dispatch")
  if m == 1:
    return 0
  if op == "xuv":
    return 1 if m <= t.wide_m else 2
  if op == "mlp_swiglu":
    return 1 if m < (table or current()).values("mlp_decode").compose_min_m else 2
  return 1


def nearest(op: str, m: int, k: int, r: int, n: int, table: Table | None = None):
  """The benchmarked record of ``op`` nearest to this call, or None: first the benchmarked
  shape nearest to the call's (|log2| ratios of K, r and N summed; ties: factor size), among
  those measured on the call's ``path`` (all, if none was), then that shape's record nearest
  in M. A nearby shape's records guide better than another shape's at the call's very token
  count (Llama-3-8B's SwiGLU at T=8 said nothing of Qwen2.5-7B's)."""
  table = table or current()
  w = _weight_elems(op, k, r, n)
  recs = [q for q in table.records if q[0] == op]
  side = [q for q in recs if path(op, q[1], table) == path(op, m, table)] or recs
  if not side:
    return None
  shape = min(
    {q[2:5] for q in side},
    key=lambda s: (
      sum(abs(math.log2(a / b)) for a, b in zip((k, r, n), s)),
      abs(math.log2(w / _weight_elems(op, *s))),
      s,
    ),
  )
  return min((q for q in side if q[2:5] == shape), key=lambda q: (abs(math.log2(m / q[1])), q[1]))


def _nearest_step(rows: tuple, m: int, k: int, window: float):
  """Of (model, hidden size, batch, ...) rows: the one of the model whose hidden size is
  nearest ``k``, at its nearest batch of 2 or more rows (within ``window`` x of M; ties: the
  larger), or None."""
  if not rows or m < 2:
    return None
  hidden = min({a[1] for a in rows}, key=lambda h: (abs(math.log2(k / h)), h))
  near = [a for a in rows if a[1] == hidden and a[2] >= 2 and a[2] / window <= m <= window * a[2]]
  return min(near, key=lambda a: (abs(math.log2(m / a[2])), -a[2])) if near else None


def _sources(table: Table) -> str:
  return f"{table.measured_on}, {', '.join(table.sources['model_steps'])}"


def _model_verdict(m: int, k: int, op: str | None = None, table: Table | None = None) -> str | None:
  """The reason to leave an M-row call with input width ``k`` to XLA if the whole decode step
  of the model whose hidden size is nearest ``k``, at its nearest batch of 2 or more rows, was
  slower with the kernels (``model_ab``, below ``model_parity``); or, for ``op``, if that step
  was faster with every kernel but op's (``model_op_ab``). Where the op has its own A/B at the
  same step and it did not slow the step, that decides."""
  table = table or current()
  t = table.values("dispatch")
  step = _nearest_step(table.model_ab, m, k, t.window)
  own = _nearest_step(tuple(a for a in table.model_op_ab if a[3] == op), m, k, t.window)
  if own is not None:
    name, hidden, b, _, every, others = own
    if others / every < t.model_parity:
      return (
        f"in the whole decode step of the {name} model (hidden size {hidden}) at batch "
        f"{b} the {op} kernel made the step slower ({every:.2f} ms a step with every "
        f"kernel, {others:.2f} ms with all but {op}'s; {_sources(table)}); {_OVERRIDE_HINT}"
      )
    if step is None or (step[0], step[2]) == (name, b):
      return None  # the op's own A/B at that step decides, not every kernel's together
  if step is not None:
    name, hidden, b, ours, xla = step
    if xla / ours < t.model_parity:
      return (
        f"in the whole decode step of the {name} model (hidden size {hidden}) at batch "
        f"{b} the kernels were slower ({ours:.2f} ms a step, {xla:.2f} ms with XLA's "
        f"lowering; {_sources(table)}); {_OVERRIDE_HINT}"
      )
  return None


def verdict(op: str, m: int, k: int, r: int, n: int, table: Table | None = None) -> str | None:
  """None if the kernel measured at least ``parity`` x XLA's speed around the nearest
  benchmarked shape (or nothing was benchmarked), else the reason to leave this call to XLA.

  A call more than ``extrapolate`` times smaller or larger (factor elements) than every
  benchmarked shape of its op goes to XLA, and so does one at M >= 2 near a batch whose whole
  decode step was slower with the kernels (``model_ab``) or faster with every kernel but this
  op's (``model_op_ab``). "Around": the median speed ratio of that shape's records with M
  within ``window`` x of the nearest record's (one noisy timing does not flip neighbouring
  token counts); the nearest record alone declines below ``clear_loss``, and below ``parity``
  where it is the call's own shape and token count. Only records of one ``path`` are pooled."""
  table = table or current()
  t = table.values("dispatch")
  rec = nearest(op, m, k, r, n, table)
  if rec is None:
    return None
  on = f"{table.measured_on}, {table.sources['kernels']}"
  w = _weight_elems(op, k, r, n)
  gap = min(abs(math.log2(w / _weight_elems(op, *q[2:5]))) for q in table.records if q[0] == op)
  if gap > math.log2(t.extrapolate):
    here = f"D={k} r={r} D_ff={n}" if op == "mlp_swiglu" else f"K={k} r={r} N={n}"
    return (
      f"no benchmarked {op} shape within {t.extrapolate:g}x of this call's factor size "
      f"({here}: {2**gap:.1f}x from the nearest; {on}); {_OVERRIDE_HINT}"
    )
  if (why := _model_verdict(m, k, op, table)) is not None:
    return why
  _, rm, rk, rr, rn, ours, xla = rec
  window = [
    q
    for q in table.records
    if q[0] == op
    and q[2:5] == (rk, rr, rn)
    and rm / t.window <= q[1] <= t.window * rm
    and path(op, q[1], table) == path(op, rm, table)
  ]
  ratio = statistics.median(q[6] / q[5] for q in window)
  dims = f"D={rk} r={rr} D_ff={rn}" if op == "mlp_swiglu" else f"K={rk} r={rr} N={rn}"
  if xla / ours < t.clear_loss:
    return (
      f"XLA measured clearly faster at the nearest benchmarked shape ({op} {dims}, "
      f"M={rm}: {xla / ours:.2f}x XLA's speed; {on}); {_OVERRIDE_HINT}"
    )
  if (rm, rk, rr, rn) == (m, k, r, n) and xla / ours < t.parity:
    return (
      f"XLA measured faster at this very shape ({op} {dims}, M={rm}: {xla / ours:.2f}x "
      f"XLA's speed; {on}); {_OVERRIDE_HINT}"
    )
  if ratio >= t.parity:
    return None
  ms = ", ".join(str(q[1]) for q in window)
  return (
    f"XLA measured faster around the nearest benchmarked shape ({op} {dims}, "
    f"M={ms}: median {ratio:.2f}x XLA's speed; {on}); {_OVERRIDE_HINT}"
  )
