"""Count the collectives in compiled (post-SPMD-partitioning) HLO text, with their bytes.

Bytes per collective follow DeInfer Table 1's cost model: an all-gather moves its (gathered)
result once; an all-reduce (reduce-sum) costs twice its operand (reduce-scatter + all-gather);
a reduce-scatter moves its operand once; all-to-all and collective-permute their operand once.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

_DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
}
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_COST = {
  "all-reduce": 2.0,
  "all-gather": 1.0,
  "reduce-scatter": 1.0,
  "all-to-all": 1.0,
  "collective-permute": 1.0,
}
# "%name = <result type> <op>(" where op may carry an async "-start" suffix; "-done" ops repeat
# the start's result and are skipped.
_LINE = re.compile(
  r"=\s*(?P<type>\(.*?\)|\S+)\s+(?P<op>" + "|".join(KINDS) + r")(?P<start>-start)?\("
)
_ARRAY = re.compile(r"([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
  kind: str  # one of KINDS
  shapes: tuple[tuple[int, ...], ...]  # result array shapes (several when combined)
  dtypes: tuple[str, ...]
  nbytes: int  # result bytes (the gathered size for an all-gather)

  @property
  def cost_bytes(self) -> float:
    """Bytes in DeInfer's cost model (all-reduce counts double)."""
    return _COST[self.kind] * self.nbytes


def _arrays(type_str: str):
  out = []
  for dt, dims in _ARRAY.findall(type_str):
    if dt not in _DTYPE_BYTES:
      continue
    shape = tuple(int(d) for d in dims.split(",") if d)
    out.append((dt, shape))
  return out


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective in ``hlo_text`` (``compiled.as_text()``)."""
  found = []
  for line in hlo_text.splitlines():
    m = _LINE.search(line)
    if not m:
      continue
    arrs = _arrays(m.group("type"))
    if (
      m.group("start")
      and m.group("op") in ("all-gather", "collective-permute", "all-to-all", "reduce-scatter")
      and len(arrs) > 1
    ):
      arrs = arrs[len(arrs) // 2 :]  # async start: (operands..., results...)
    if not arrs:
      continue
    nbytes = 0
    for dt, shape in arrs:
      n = 1
      for d in shape:
        n *= d
      nbytes += n * _DTYPE_BYTES[dt]
    found.append(
      Collective(m.group("op"), tuple(s for _, s in arrs), tuple(d for d, _ in arrs), nbytes)
    )
  return found


def summarize(colls: Iterable[Collective]) -> dict:
  """{"n": count, "cost_bytes": Σ cost, "by_kind": {kind: {"n", "bytes"}}}."""
  colls = list(colls)
  by = {}
  for c in colls:
    d = by.setdefault(c.kind, {"n": 0, "bytes": 0})
    d["n"] += 1
    d["bytes"] += c.nbytes
  return {"n": len(colls), "cost_bytes": sum(c.cost_bytes for c in colls), "by_kind": by}


def weight_gathers(colls: Iterable[Collective], weight_shapes: Iterable[tuple[int, ...]]):
  """All-gathers whose result has the shape of a whole weight (what must never happen)."""
  ws = {tuple(s) for s in weight_shapes}
  return [c for c in colls if c.kind == "all-gather" and any(s in ws for s in c.shapes)]
