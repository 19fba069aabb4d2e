"""Offline int4 quantization and packing of weights into the W4A8 kernel layouts.

Layouts (byte-level definition in custom_calls/cpu/w4a8.h; the jnp inverse is
:func:`lrjax.lowering.quantized.unpack_int4`). A weight q [K, N] in [-8, 7] is
stored as u = q + 8 nibbles, K padded to Kp = roundup(K, 8), N to a block width:

- ``x86_vnni`` (16 columns): per 8 k, 64 bytes; byte 4c+j holds k=j (low nibble)
  and k=4+j (high nibble) of column c, so one load + and/shift gives the two
  vpdpbusd operands (4 k per int32 lane) without shuffles.
- ``arm_sdot4`` (4 columns, the paper's pack 4 for sdot): the same interleave on
  16-byte chunks.
- ``arm_smmla8`` (8 columns, the paper's pack 8 for smmla): per 8 k, 32 bytes;
  bytes 16h+8cc+j hold k=j of column 4h+cc (high nibble) and 4h+2+cc (low
  nibble): each nibble plane is one [2 x 8] smmla operand.
"""

from __future__ import annotations

import logging
import platform

import numpy as np

from lrjax.lowering.quantized import BLOCK_WIDTH, LAYOUTS, num_groups, round_up

log = logging.getLogger("lrjax.quant")


def default_layout() -> str:
  """The layout this machine's fastest kernel reads."""
  mach = platform.machine().lower()
  if mach in ("aarch64", "arm64"):
    try:
      from lrjax.custom_calls.cpu import _w4a8

      if "i8mm" in _w4a8.cpu_isas():
        return "arm_smmla8"
    except ImportError:
      log.debug("W4A8 extension not built; packing for sdot")
    return "arm_sdot4"
  return "x86_vnni"


# A group's scale is its signed abs-max divided by one of these; the one with the least squared
# error wins. -8 is llama.cpp Q4_0's choice (the abs-max lands on -8, so all 16 levels are
# used); +7 is plain abs-max / 7, so the search is never worse than that.
SCALE_CANDIDATES = (-8.0, -7.5, -8.5, -7.0, 7.0, 7.5)
_COLUMN_CHUNK = 512  # columns quantized at a time: the temporaries stay in cache


def _quantize_groups(wg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """wg [G, grp, n] f32 -> (q [G, grp, n] int8 in [-8, 7], scales [G, n] f32)."""
  idx = np.abs(wg).argmax(axis=1)
  mx = np.take_along_axis(wg, idx[:, None, :], axis=1)[:, 0, :]  # signed abs-max
  q, r = np.empty_like(wg), np.empty_like(wg)
  best_q = best_s = best_e = None
  for c in SCALE_CANDIDATES:
    s = mx / np.float32(c)
    s = np.where(s != 0, s, np.float32(1)).astype(np.float32)
    np.divide(wg, s[:, None, :], out=q)
    np.rint(q, out=q)
    np.clip(q, -8, 7, out=q)
    np.multiply(q, s[:, None, :], out=r)
    np.subtract(wg, r, out=r)
    np.square(r, out=r)
    e = r.sum(axis=1)
    if best_e is None:
      best_q, best_s, best_e = q.copy(), s, e
    else:
      better = e < best_e
      np.copyto(best_q, q, where=better[:, None, :])
      best_s = np.where(better, s, best_s)
      best_e = np.minimum(e, best_e)
  return best_q.astype(np.int8), best_s.astype(np.float32)


def quantize_int4(w, group: int):
  """Symmetric int4: q [K, N] int8 in [-8, 7] and scales [G, N] f32 (may be negative).

  ``group`` is 32/64/128 (any multiple of 8) rows of K per scale, or 0 for one
  scale per output channel. Each scale is the group's signed abs-max over the
  entry of ``SCALE_CANDIDATES`` with the least squared error (w ~ q * scale).
  """
  w = np.asarray(w, dtype=np.float32)
  if w.ndim != 2:
    raise ValueError(f"{w.shape=} must be 2-D [K, N]")
  if group < 0 or group % 8:
    raise ValueError(f"{group=} must be 0 (per channel) or a positive multiple of 8")
  bad = ~np.isfinite(w)
  if bad.any():
    k0, n0 = np.argwhere(bad)[0]
    raise ValueError(
      f"weight [{w.shape[0]}, {w.shape[1]}] has {int(bad.sum())} NaN/inf values (first at "
      f"[{k0}, {n0}]); int4 scales need finite weights: fix or drop them before quantizing"
    )
  k, n = w.shape
  grp = k if group == 0 else group
  g = num_groups(k, group)
  q = np.empty((k, n), np.int8)
  scales = np.empty((g, n), np.float32)
  for j0 in range(0, n, _COLUMN_CHUNK):
    j1 = min(n, j0 + _COLUMN_CHUNK)
    wp = np.zeros((g * grp, j1 - j0), np.float32)
    wp[:k] = w[:, j0:j1]
    qc, sc = _quantize_groups(wp.reshape(g, grp, j1 - j0))
    q[:, j0:j1] = qc.reshape(g * grp, j1 - j0)[:k]
    scales[:, j0:j1] = sc
  return q, scales


def dequantize_int4(q, scales, group: int):
  """float64 [K, N] = q * scale of its group (the weight the kernel multiplies by)."""
  q = np.asarray(q, np.float64)
  k = q.shape[0]
  grp = k if group == 0 else group
  rows = np.arange(k) // grp
  return q * np.asarray(scales, np.float64)[rows, : q.shape[1]]


def pack_int4(q, layout: str) -> np.ndarray:
  """Packs q [K, N] int8 in [-8, 7] into ``layout``: uint8 [Np/BW, Kp/8, 4 BW]."""
  if layout not in LAYOUTS:
    raise ValueError(f"{layout=} is not a W4A8 layout; expected one of {sorted(LAYOUTS)}")
  q = np.asarray(q)
  if q.ndim != 2 or q.min(initial=0) < -8 or q.max(initial=0) > 7:
    raise ValueError(f"q must be 2-D int4 values in [-8, 7]; got shape {q.shape}")
  k, n = q.shape
  bw = BLOCK_WIDTH[layout]
  kp, np_ = round_up(k, 8), round_up(n, bw)
  u = np.full((kp, np_), 8, np.uint8)
  u[:k, :n] = (q.astype(np.int16) + 8).astype(np.uint8)
  kc, nb = kp // 8, np_ // bw
  if layout == "arm_smmla8":
    t = u.reshape(kc, 8, nb, 2, 2, 2).transpose(2, 0, 3, 5, 1, 4)  # [nb, kc, h, cc, j, p]
    packed = (t[..., 0] << 4) | t[..., 1]
  else:
    t = u.reshape(kc, 2, 4, nb, bw).transpose(3, 0, 4, 2, 1)  # [nb, kc, c, j, h]
    packed = t[..., 0] | (t[..., 1] << 4)
  return np.ascontiguousarray(packed.reshape(nb, kc, 4 * bw).astype(np.uint8))


def pad_scales(scales, layout: str) -> np.ndarray:
  """scales [G, N] -> [G, Np] f32, zero in the padded columns."""
  s = np.asarray(scales, np.float32)
  np_ = round_up(s.shape[1], BLOCK_WIDTH[layout])
  out = np.zeros((s.shape[0], np_), np.float32)
  out[:, : s.shape[1]] = s
  return out
