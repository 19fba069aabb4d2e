"""Reading Nsight Compute's text reports (``ncu --section ... --metrics ...``), for the ncu_*
benchmark scripts."""

from __future__ import annotations

import os
import re
import shutil

# a kernel's header line: "  name (grid)x(block), Context 1, Stream 7, Device 0, CC 9.0"
_HEADER = re.compile(r"^  (\S.*?) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\), Context")
# a metric or section row: name, optional unit, value
_ROW = re.compile(r"^ {4}(\S.*?\S) {2,}(\S+ +)?([\d,]+(?:\.\d+)?)\s*$")
HEADER_KEYS = ("kernel", "grid", "block")


def parse_kernels(text: str) -> list[dict]:
  """[{"kernel", "grid", "block", "<row> [<unit>]": value, ...}] of an ncu text report, one
  dict a profiled kernel in launch order (rows before any kernel header go to an unnamed
  kernel)."""
  out = []
  for line in text.splitlines():
    h = _HEADER.match(line)
    if h:
      out.append(
        dict(
          kernel=h.group(1),
          grid=[int(t) for t in h.group(2, 3, 4)],
          block=[int(t) for t in h.group(5, 6, 7)],
        )
      )
      continue
    m = _ROW.match(line)
    if m and m.group(1) != "Metric Name":
      if not out:
        out.append(dict(kernel=None, grid=None, block=None))
      name = m.group(1) + (f" [{m.group(2).strip()}]" if m.group(2) else "")
      out[-1].setdefault(name, float(m.group(3).replace(",", "")))
  if not any(set(k) - set(HEADER_KEYS) for k in out):
    raise ValueError("no ncu metric rows found: expected an `ncu --section ...` text report")
  return out


def ncu_path() -> str:
  """The ncu binary, or SystemExit saying it is missing."""
  ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
  if not os.path.exists(ncu):
    raise SystemExit("ncu (Nsight Compute) not found: run this on a machine with the CUDA toolkit")
  return ncu
