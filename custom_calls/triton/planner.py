"""Tile planner for the Triton low-rank kernels: NeuronMM's eq. 10-11 rewritten for the H200,
and the byte model that cuts the decode kernels' tiles.

Pure Python (no triton import), so the CPU suite tests it and ``supports`` can use it. The
measured constants of the model (bandwidths, tolerances, where a schedule switches on) are
the tuning table's ``planner`` thresholds (policy.py), each with its reason there.

Two levels of on-chip memory matter on a GPU, not one:

* **Shared memory per SM (228 KB).** This is NeuronMM's SBUF (eq. 11). A CTA can keep
  the B_M x r strip of X·U on chip only when
  ``B_M·r·s + stages·(B_M·B_K + B_K·B_N)·s <= smem``.
  At the ranks LLMs use (r >= 1024) that leaves B_M <= 32 rows, and a CTA that owns a
  row block must loop over all of N, so a 1024-token prefill would run on 32 of 132 SMs.
  Splitting N over CTAs instead recomputes X·U once per split (NeuronMM's recomputation
  penalty, Challenge 2).
* **L2 (about 50-60 MB, shared by all SMs).** So when the strip does not fit one CTA, the
  kernels keep it in an L2-sized *ring*: for a super-block of G row blocks the strip
  (G·B_M x r) is computed exactly once, written to a scratch slot, and read back by every
  N-block tile of those rows while it is still L2-resident; no recomputation, and the
  strip's HBM traffic is at most one write (usually none: it is overwritten while cached).

Eq. 10 then decides G: the V factor is streamed from HBM once per super-block, so
``AI = 2r / ((1 + r/(G·B_M))·s)`` must clear the H200 ridge (790 TFLOP/s / 4.3 TB/s =
184 FLOP/B) with margin, while the strip ``G·B_M·r·s`` stays within the L2 budget.
Eq. 11 decides the CTA tile: the pipelined tiles must fit shared memory, and the largest
wgmma-friendly tile that does is the most intense per byte of L2 traffic.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import types

from lrjax.custom_calls.triton import policy


def _t() -> types.SimpleNamespace:
  """The planner's thresholds in this device's tuning table."""
  return policy.values("planner")


@dataclasses.dataclass(frozen=True)
class Hardware:
  name: str = "NVIDIA H200"
  smem_per_sm: int = 228 * 1024  # bytes; 227 KB usable by one CTA
  smem_per_cta: int = 227 * 1024
  l2_bytes: int = 50 * 1024 * 1024  # H100/H200 L2 (torch reports 60 MB incl. reserved)
  hbm_bw: float = 4.3e12  # B/s, measured device-to-device copy
  peak_flops: float = 790e12  # bf16 dense, measured 8192^3 product
  num_sms: int = 132

  @property
  def ridge(self) -> float:
    """FLOP per HBM byte above which a kernel is compute-bound."""
    return self.peak_flops / self.hbm_bw


H200 = Hardware()

# The shared memory one CTA may ask for (CUDA's opt-in maximum per block), in bytes, by compute
# capability (CUDA C++ Programming Guide, technical specifications per compute capability)
SMEM_PER_CTA_BY_CAPABILITY = {
  70: 96 * 1024,
  75: 64 * 1024,
  80: 163 * 1024,
  86: 99 * 1024,
  87: 163 * 1024,
  89: 99 * 1024,
  90: 227 * 1024,
  100: 227 * 1024,
  120: 99 * 1024,
}


def check_prefetch_rows(plan, *fields: str) -> None:
  """Raises a ValueError naming the field where one of ``plan``'s L2 prefetch depths
  (``_common.prefetch_l2``'s rows, a ``tl.arange``) is not 0 or a power of two; Triton would
  only fail deep in its compiler ("arange's range must be a power of 2")."""
  for name in fields:
    rows = getattr(plan, name)
    if rows < 0 or rows & (rows - 1):
      raise ValueError(f"{plan}: {name}={rows} V rows must be 0 or a power of two")


def check_cta_smem(
  kernel: str, shared: int, capability: int, num_warps: int, num_stages: int
) -> None:
  """Raises a ValueError if a compiled kernel asks for more shared memory per CTA than a GPU
  of this compute capability (e.g. 90) allows; CUDA would only refuse the launch. Unknown
  capabilities are not checked."""
  limit = SMEM_PER_CTA_BY_CAPABILITY.get(capability)
  if limit is not None and shared > limit:
    raise ValueError(
      f"Triton kernel {kernel} (num_warps={num_warps}, num_stages={num_stages}) needs "
      f"{shared} bytes of shared memory per CTA, more than the {limit} that a GPU of compute "
      f"capability {capability // 10}.{capability % 10} allows; pass smaller block sizes or "
      "fewer num_stages (block_sizes=None takes the defaults, which fit)"
    )


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def round_up(n: int, step: int) -> int:
  """``n`` rounded up to a multiple of ``step``."""
  return cdiv(n, step) * step


def part_len(n: int, parts: int, step: int) -> int:
  """The length of each of ``parts`` parts of ``n``, rounded up to whole ``step``s (so the
  parts that cover n may be fewer, the last one ragged)."""
  return round_up(cdiv(n, parts), step)


def next_pow2(n: int) -> int:
  return 1 if n <= 1 else 1 << (n - 1).bit_length()


def xuv_intensity(r: int, b_m: int, s: int = 2) -> float:
  """NeuronMM eq. 10: FLOP per HBM byte of X·U·V when U, V are re-read per B_M rows."""
  return 2 * r / ((1 + r / b_m) * s)


def strip_smem_bytes(b_m: int, r: int, b_k: int, b_n: int, b_r: int, s: int = 2) -> int:
  """NeuronMM eq. 11: peak on-chip bytes of one CTA that keeps the B_M x r strip."""
  return (b_m * r + (b_m + b_r) * max(b_k, b_n)) * s


def pipeline_smem_bytes(b_m: int, b_n: int, b_k: int, stages: int, s: int = 2) -> int:
  """Shared memory of a software-pipelined Triton GEMM tile (A and B ring)."""
  return stages * (b_m * b_k + b_k * b_n) * s


def strip_fits_cta(
  b_m: int, r: int, b_k: int, b_n: int, stages: int, s: int = 2, hw: Hardware = H200
) -> bool:
  """Whether a CTA can hold the whole B_M x r strip next to its pipeline buffers."""
  return b_m * r * s + pipeline_smem_bytes(b_m, b_n, b_k, stages, s) <= hw.smem_per_cta


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
  block_m: int
  block_n: int
  block_k: int
  stages: int
  warps: int
  group_m: int  # row blocks per super-block (strip shared through L2)
  ring: int  # super-block slots in the scratch ring
  programs: int  # persistent CTAs
  intensity: float  # eq. 10 at B_M = group_m·block_m
  strip_bytes: int  # one super-block's strip
  smem_bytes: int
  reason: str


# CTA tiles tried, largest first; all are wgmma shapes (B_M multiple of 64).
_PREFILL_TILES = ((128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (64, 128, 64, 4, 4))


def plan_prefill(
  m: int,
  r: int,
  widths: tuple[int, ...],
  s: int = 2,
  ring: int = 2,
  hw: Hardware = H200,
  l2_fraction: float = 0.4,
  margin: float = 2.0,
) -> PrefillPlan:
  """Chooses the CTA tile (eq. 11 on smem) and the L2 super-block (eq. 10 on L2).

  Args:
    m: rows (tokens).
    r: the rank (width of the strip).
    widths: the widths of the strips the kernel keeps per row block (e.g. (r,) for
      X·U·V, (2r, D_ff, r) for a gated MLP: P, H and S).
    ring: super-block slots (2 lets one super-block be written while the last is read).
  """
  for b_m, b_n, b_k, stages, warps in _PREFILL_TILES:  # noqa: B007
    smem = pipeline_smem_bytes(b_m, b_n, b_k, stages, s)
    if smem <= hw.smem_per_cta and (b_m <= max(64, next_pow2(m))):
      break
  n_mb = cdiv(m, b_m)
  per_row = sum(widths) * s
  budget = l2_fraction * hw.l2_bytes
  # Largest group whose ring stays within the L2 budget...
  g_max = max(1, int(budget // (ring * b_m * per_row)))
  # ...but no larger than needed to clear the ridge with margin (keeps tiles in flight
  # of one super-block, so the strip is read back while cached).
  g = 1
  while g < min(g_max, n_mb) and xuv_intensity(r, g * b_m, s) < margin * hw.ridge:
    g *= 2
  g = max(1, min(g, g_max, n_mb))
  ai = xuv_intensity(r, g * b_m, s)
  reason = (
    f"tile {b_m}x{b_n}x{b_k}x{stages} uses {smem // 1024} KB smem; strip "
    f"{b_m}x{r} ({b_m * r * s // 1024} KB) does not fit one CTA next to it, so "
    f"super-blocks of {g} row blocks share the strip through L2 "
    f"(eq.10 AI={ai:.0f} FLOP/B vs ridge {hw.ridge:.0f})"
  )
  return PrefillPlan(
    b_m, b_n, b_k, stages, warps, g, ring, hw.num_sms, ai, g * b_m * per_row, smem, reason
  )


@dataclasses.dataclass(frozen=True)
class DecodePlan:
  block_m: int  # padded token rows (>= 16 for mma)
  block_k: int  # stage-1 K step
  block_r: int  # stage-1 output columns per CTA
  split_k: int  # inter-CTA split of K
  block_n: int  # stage-2 output columns per CTA
  block_kv: int  # stage-2 reduction step
  stages: int
  warps: int


def plan_decode(
  m: int, k: int, r: int, n: int, hw: Hardware = H200, ctas_per_sm: int = 3
) -> DecodePlan:
  """Split-K so stage 1 has about ``ctas_per_sm`` CTAs per SM, each streaming >= 64 rows of U."""
  block_m = max(16, next_pow2(m))
  block_r = 128 if r >= 2048 else 64
  block_k = 64 if block_m <= 32 else 32
  n_r = cdiv(r, block_r)
  want = hw.num_sms * ctas_per_sm
  split_k = max(1, min(cdiv(want, n_r), cdiv(k, 4 * block_k)))
  split_k = 1 << (split_k.bit_length() - 1)  # power of two
  block_n = 64 if cdiv(n, 64) >= hw.num_sms else 32
  stages = 4 if block_m <= 32 else 3
  return DecodePlan(block_m, block_k, block_r, split_k, block_n, 64, stages, 4)


def hbm_bytes_xuv(m: int, k: int, r: int, n: int, s: int = 2, bias: bool = False) -> int:
  """Fewest HBM bytes of X·U·V: each input read once, the output written once."""
  return s * (m * k + k * r + r * n + m * n + (n if bias else 0))


def flops_xuv(m: int, k: int, r: int, n: int) -> int:
  return 2 * m * r * (k + n)


def hbm_bytes_mlp(m: int, d: int, f: int, r: int, gated: bool = True, s: int = 2) -> int:
  n_up = 2 if gated else 1
  return s * (2 * m * d + n_up * r * (d + f) + r * (f + d))


def flops_mlp(m: int, d: int, f: int, r: int, gated: bool = True) -> int:
  n_up = 2 if gated else 1
  return 2 * m * r * (d + f) * (n_up + 1)


@dataclasses.dataclass(frozen=True)
class PersistentDecodePlan:
  block_m: int  # padded token rows (>= 16 for mma)
  block_k: int  # phase-1 K step
  block_r: int  # phase-1 tile width in registers (a power of two)
  cols_r: int  # phase-1 columns of U per tile (<= block_r, a multiple of 16)
  k_per: int  # phase-1 K rows per tile (a multiple of block_k)
  block_n: int  # phase-2 tile width in registers (a power of two, >= 64)
  cols_n: int  # phase-2 columns of V per tile (<= block_n, a multiple of 16)
  block_kv: int  # phase-2 reduction step over r
  r_chunks: int  # phase-2 split of r
  programs: int  # persistent CTAs (all resident at once)
  warps: int
  stages: int
  prefetch: int  # V rows of its first phase-2 tile each CTA prefetches into L2 (0: none)
  est_us: float  # the model's time at ``bw``
  p16: bool = False  # phase 2 reads P rounded once to V's dtype, not the f32 sums
  v_resident: bool = False  # one tile a CTA, phase-2 CTAs hold their V tile before the wait
  stream_k: bool = False  # both phases split evenly by steps (cols_r/cols_n wide blocks)

  def __post_init__(self):
    # the kernel computes block_r (block_n) columns of each cols_r (cols_n) wide block and
    # steps over a tile's K rows block_k at a time: outside these bounds its output is wrong
    bad = [
      f"{f}={getattr(self, f)}"
      for f in (
        "block_m",
        "block_k",
        "block_r",
        "cols_r",
        "k_per",
        "block_n",
        "cols_n",
        "block_kv",
        "r_chunks",
        "programs",
        "warps",
        "stages",
      )
      if getattr(self, f) < 1
    ]
    if bad:
      raise ValueError(f"PersistentDecodePlan: expected positive sizes, got {', '.join(bad)}")
    if self.cols_r > self.block_r or self.cols_n > self.block_n:
      raise ValueError(
        f"PersistentDecodePlan: expected cols_r <= block_r and cols_n <= "
        f"block_n, got cols_r={self.cols_r}, block_r={self.block_r}, "
        f"cols_n={self.cols_n}, block_n={self.block_n}"
      )
    if self.k_per % self.block_k:
      raise ValueError(
        f"PersistentDecodePlan: expected k_per a multiple of block_k, got "
        f"k_per={self.k_per}, block_k={self.block_k}"
      )


def _widths(pow2s):
  """(register width, columns): columns a multiple of 16 in (width/2, width]."""
  return [(w, c) for w in pow2s for c in range(16, w + 1, 16) if c > w // 2]


def _phase_us(n_tiles: int, tile_bytes: float, g: int, bw: float, fill_us: float) -> float:
  """A persistent phase lasts as long as its busiest CTA: ceil(tiles / g) tiles, each its
  bytes over the CTA's share of ``bw`` plus ``fill_us`` (pipeline refill, atomics, flag)."""
  return cdiv(n_tiles, g) * (tile_bytes / (bw / g) * 1e6 + fill_us)


def _cta_rate(
  cols: int, stages: int, share: float, round_trip_us: float, factors: int = 1
) -> float:
  """Bytes/s one phase-1 CTA streams: its ``share`` of the bandwidth, or, if less, its
  in-flight bytes (``stages`` 64-row steps of ``cols`` 2-byte columns of each of ``factors``
  matrices) per round trip (``round_trip_us`` <= 0: no cap)."""
  if round_trip_us <= 0:
    return share
  return min(share, stages * 64 * cols * 2 * factors / (round_trip_us * 1e-6))


def _partials_us(splits: int, m: int, r: int, factors: int = 1) -> float:
  """The split-K partials' cost beyond ``partial_free_bytes`` (m = 0: not counted): each
  split-K tile adds its f32 [M, cols] partial into P with atomics as it ends."""
  T = _t()
  return max(0, splits * m * r * 4 * factors - T.partial_free_bytes) / T.partial_bw * 1e6


def _split_k_us(
  k: int,
  r: int,
  cols: int,
  k_per: int,
  factors: int,
  g: int,
  bw: float,
  fill_us: float,
  stages: int,
  round_trip_us: float,
  m: int,
) -> float:
  """The model's time of a split-K phase of ``cols``-column x ``k_per``-row tiles
  (``_split_k_tiles``' terms)."""
  splits = cdiv(k, k_per)
  phase_bw = g * _cta_rate(cols, stages, bw / g, round_trip_us, factors)
  return _phase_us(
    cdiv(r, cols) * splits, k_per * cols * 2 * factors, g, phase_bw, fill_us
  ) + _partials_us(splits, m, r, factors)


def _split_k_tiles(
  k: int,
  r: int,
  factors: int,
  g: int,
  bw: float,
  fill_us: float,
  stages: int = 4,
  round_trip_us: float = 0.0,
  m: int = 0,
  line_align_tol: float = -1.0,
):
  """(us, block_r, cols_r, k_per) for a split-K phase over ``factors`` [K, r] matrices.
  With ``round_trip_us`` > 0 a CTA streams at most its in-flight bytes (``stages`` 64-row
  steps of its columns) per round trip. With ``m`` rows, the f32 partials count
  (``_partials_us``). Where the best tiles' rows are not whole 128-byte lines, tiles of 256
  columns with as many K splits as fill one round of the grid are taken within
  ``line_align_tol`` of its estimate (the decode plan's ``phase1_line_tol``; negative, the
  default: never)."""
  # ties go to fewer tiles, then to wider ones (longer contiguous rows); ranks <= 32 (e.g. a
  # TP shard of a small factor) take 16- or 32-column tiles; K <= 64 one 64-row step
  widths = (64, 128, 256) if r > 32 else (16, 32)
  steps = [st for st in (2, 4, 8, 16, 32, 64) if st * 64 < k + 64] or [1]

  def cand(w, c, k_per):
    return (
      _split_k_us(k, r, c, k_per, factors, g, bw, fill_us, stages, round_trip_us, m),
      cdiv(r, c) * cdiv(k, k_per),
      -c,
      w,
      c,
      k_per,
    )

  best = min(
    cand(w, c, st * 64) for w, c in _widths(widths) if c <= max(16, r) + 15 for st in steps
  )
  if line_align_tol >= 0 and best[4] % 64 and 256 <= r + 15 and cdiv(r, 256) <= g:
    splits = g // cdiv(r, 256)  # the most that fit one round of the grid
    wide = cand(256, 256, part_len(k, splits, 64))
    if wide[0] <= best[0] * (1 + line_align_tol):
      best = wide
  return best[0], best[3], best[4], best[5]


def _column_tiles(
  n: int,
  n_rb: int,
  rows_rb: int,
  g: int,
  bw: float,
  fill_us: float,
  max_chunks: int = 16,
  min_row_bytes: int = 0,
  line_row_tol: float | None = None,
  line_align_tol: float = -1.0,
  widths=(64, 128, 256),
):
  """(us, block_n, cols_n, chunks) for a phase that streams [n_rb * rows_rb, n] in tiles of
  a chunk of whole row blocks x cols_n columns (2-byte elements), each tile row at least
  ``min_row_bytes`` long where ``n`` allows. Where the fastest tiles by bytes have rows of one
  128-byte line (64 columns), wider tiles within ``line_row_tol`` of their estimate are taken
  instead (None: the table's ``line_row_tol``; negative: never); where their rows span
  several lines but not whole ones, one r-chunk of whole-line tiles within ``line_align_tol``
  (the X·U·V decode plan's ``line_align_tol``; negative, the default: never)."""
  if line_row_tol is None:
    line_row_tol = _t().line_row_tol
  min_cols = min(min_row_bytes // 2, round_up(n, 16))
  cands = []
  for w, c in _widths(widths):
    if c < min_cols:
      continue
    for chunks in range(1, min(n_rb, max_chunks) + 1):
      per = cdiv(n_rb, chunks)
      if cdiv(n_rb, per) != chunks or (chunks > 1 and (per * rows_rb) % 64):
        continue
      n_tiles = chunks * cdiv(n, c)
      cands.append(
        (_phase_us(n_tiles, per * rows_rb * c * 2, g, bw, fill_us), n_tiles, chunks, -c, w, c)
      )
  if not cands:
    raise ValueError(
      f"{min_row_bytes=}: no tile of at most {max(widths)} columns has rows that long"
    )
  best = min(cands)  # ties: fewer chunks (no output atomics at one), then wider
  if best[5] <= 64:  # rows of one 128-byte line
    wide = [t for t in cands if t[5] > 64 and t[0] <= best[0] * (1 + line_row_tol)]
    best = min(wide, default=best)
  elif best[5] % 64 and best[2] == 1:  # rows over several lines, some starting mid-line
    whole = [
      t
      for t in cands
      if t[5] % 64 == 0 and t[5] > 64 and t[2] == 1 and t[0] <= best[0] * (1 + line_align_tol)
    ]
    best = min(whole, default=best)
  return best[0], best[4], best[5], best[2]


def plan_decode_persistent(
  m: int,
  k: int,
  r: int,
  n: int,
  hw: Hardware = H200,
  programs: int | None = None,
  bw: float | None = None,
  fill_us: float | None = None,
  p_split_bytes: float | None = None,
  min_row_bytes: int = 0,
  line_row_tol: float | None = None,
  line_align_tol: float | None = None,
  phase1_line_tol: float | None = None,
  round_trip_us: float | None = None,
  v_resident: bool = True,
  stream_k: bool = True,
) -> PersistentDecodePlan:
  """Tiles for the persistent decode kernel: ``programs`` CTAs stream U (phase 1), then V.

  Each CTA's share of a phase is ceil(tiles / programs) tiles, so the phase lasts as long
  as its busiest CTA (``_phase_us``). Tiles need not be powers of two wide (columns in
  multiples of 16, i.e. whole 32-byte sectors), so the tile count can match the grid. The
  plan minimises the estimate (HBM bytes only). Where a phase-2 tile would read at least
  ``p_split_bytes`` of P from L2, phase 2 takes two r-chunks of tiles twice as wide instead
  of one (the same tile count). Phase 1 counts each CTA's DRAM round trip where its share of
  U is at least ``round_trip_min_bytes``, and up to ``partials_max_m`` rows its f32 split-K
  partials (``_partials_us``). Small ranks (``v_resident``, see ``_v_resident_plan``) take
  the V-resident schedule where it applies and ``min_row_bytes`` allows its 64-column V
  tiles. Where measured faster (``stream_k``: the ``stream_k_*`` thresholds), phase 1 runs as
  stream-K over 128-column blocks. Phase-1 tiles whose rows are not whole 128-byte lines give
  way to 256-column ones that fill one round of the grid within ``phase1_line_tol`` of their
  estimate, and a phase-2 CTA prefetches ``prefetch_rows_wide`` V rows where its tiles are
  at least 128 columns wide, ``prefetch_rows`` where narrower. Arguments left None take the
  tuning table's thresholds of the same names (``policy.values("planner")``).
  """
  T = _t()
  bw = T.stream_bw if bw is None else bw
  fill_us = T.fill_us if fill_us is None else fill_us
  p_split_bytes = T.p_split_bytes if p_split_bytes is None else p_split_bytes
  line_row_tol = T.line_row_tol if line_row_tol is None else line_row_tol
  line_align_tol = T.line_align_tol if line_align_tol is None else line_align_tol
  phase1_line_tol = T.phase1_line_tol if phase1_line_tol is None else phase1_line_tol
  round_trip_us = T.round_trip_us if round_trip_us is None else round_trip_us
  g = programs or hw.num_sms
  block_m = max(16, next_pow2(m))
  if k * r * 2 < T.round_trip_min_bytes * g:
    round_trip_us = 0.0
  if v_resident and min_row_bytes <= 2 * T.v_res_block_n:
    res = _v_resident_plan(m, k, r, n, g, bw, fill_us, round_trip_us)
    if res is not None:
      return res
  m_partials = m if block_m <= T.partials_max_m else 0
  t1, block_r, cols_r, k_per = _split_k_tiles(
    k, r, 1, g, bw, fill_us, 4 if block_m <= 32 else 3, round_trip_us, m_partials, phase1_line_tol
  )
  t2, block_n, cols_n, chunks = _column_tiles(
    n,
    cdiv(r, cols_r),
    cols_r,
    g,
    bw,
    fill_us,
    min_row_bytes=min_row_bytes,
    line_row_tol=line_row_tol,
    line_align_tol=line_align_tol,
  )
  n_rb = cdiv(r, cols_r)
  if (
    chunks == 1
    and m * r * 4 >= p_split_bytes
    and n_rb >= 2
    and 2 * cols_n <= 256
    and (cdiv(n_rb, 2) * cols_r) % 64 == 0
  ):  # chunks of whole 64-row (block_kv) steps
    chunks, cols_n, block_n = 2, 2 * cols_n, next_pow2(2 * cols_n)
  stages = 4 if block_m <= 32 else 3
  # 4 warps hold a [128, 256] f32 phase-1 tile only by spilling (2.6 KB/thread, ptxas sm_90a)
  warps = 8 if block_m >= 128 else 4
  prefetch = T.prefetch_rows_wide if cols_n >= 128 else T.prefetch_rows
  plan = PersistentDecodePlan(
    block_m,
    64,
    block_r,
    cols_r,
    k_per,
    block_n,
    cols_n,
    64,
    chunks,
    g,
    warps,
    stages,
    prefetch,
    t1 + t2,
  )
  if (
    stream_k
    and chunks == 1
    and 2 <= m <= T.stream_k_max_m
    and k <= T.stream_k_max_k
    and r >= T.stream_k_min_r
    and r % T.stream_k_cols == 0
    and cdiv(r, T.stream_k_cols) * cdiv(k, 64) >= g
  ):
    plan = dataclasses.replace(plan, block_r=T.stream_k_cols, cols_r=T.stream_k_cols, stream_k=True)
  if (
    not plan.stream_k
    and chunks == 1
    and m <= T.deep_kv_max_m
    and r >= T.deep_kv_min_r
    and r % T.deep_kv_rows == 0
    and block_n == 128
  ):
    t1 = _split_k_us(
      k, r, cols_r, k_per, 1, g, bw, fill_us, T.deep_kv_stages, round_trip_us, m_partials
    )  # phase 1 at the stages the plan now has
    plan = dataclasses.replace(
      plan, block_kv=T.deep_kv_rows, stages=T.deep_kv_stages, est_us=t1 + t2
    )
  return plan


def _v_resident_plan(
  m: int, k: int, r: int, n: int, g: int, bw: float, fill_us: float, round_trip_us: float
) -> PersistentDecodePlan | None:
  """The V-resident plan, or None where it does not apply (``v_res_*``): every tile on its own
  CTA, phase-2 tiles of ``v_res_block_n`` columns whose CTAs load their whole [r, cols_n] V
  tile into registers before they wait for P, phase 1 the split-K tiles ``_split_k_tiles``
  picks for the CTAs left over; only where phase 2 needs at most half the SMs."""
  T = _t()
  block_m = max(16, next_pow2(m))
  r_p2 = max(16, next_pow2(r))
  if block_m > T.v_res_max_m or r_p2 > T.v_res_max_r:
    return None
  block_n = min(T.v_res_block_n, max(32, next_pow2(n)))
  cols_n = min(block_n, round_up(n, 16))
  n2 = cdiv(n, cols_n)
  if 2 * n2 > g:
    return None
  t1, block_r, cols_r, k_per = _split_k_tiles(k, r, 1, g - n2, bw, fill_us, 4, round_trip_us, m)
  if cdiv(r, cols_r) * cdiv(k, k_per) + n2 > g:
    return None
  return PersistentDecodePlan(
    block_m,
    64,
    block_r,
    cols_r,
    k_per,
    block_n,
    cols_n,
    64,
    1,
    g,
    4,
    4,
    0,
    t1 + fill_us,
    v_resident=True,
  )


def _phase1_tiles(k: int, r: int, cols: int, g: int) -> tuple[int, int]:
  """(column blocks, K rows a tile) of the phase-1 plan at ``cols`` columns: the fewest
  splits of whole 64-row steps that still give every CTA a tile."""
  n_rb = cdiv(r, cols)
  split = max(1, min(g // n_rb, cdiv(k, 64)))
  return n_rb, part_len(k, split, 64)


def _phase1_l2_us(m: int, k: int, r: int, cols: int, k_per: int) -> float:
  """The model's L2 time of a phase-1 plan: its split-K partials (f32 atomics) and the
  re-reads of X, once per column block."""
  T = _t()
  return (
    cdiv(k, k_per) * m * r * 4 / T.phase1_atomic_bw + cdiv(r, cols) * m * k * 2 / T.phase1_x_l2_bw
  ) * 1e6


def plan_decode_phase1(
  m: int, k: int, r: int, n: int, hw: Hardware = H200, programs: int | None = None
) -> PersistentDecodePlan:
  """Tiles for the decode kernel's phase 1 alone (X·U split over K into P; then XLA's GEMM or
  the ·V launch applies V). From 64 rows the f32 partials of split-K (M x r x 4 bytes per
  split, added with atomics) rival U's own bytes, so this takes the fewest splits that still
  give every CTA a tile: 128-column tiles (64 at r <= 1024, or where ``_phase1_l2_us`` has
  them ``phase1_narrow_min_us`` faster; ``phase1_balance_cols`` of a 128-column tile's
  columns where that cuts the largest tile by ``phase1_balance_min``) over K ranges as long
  as that allows, with ``phase1_wide_stages`` pipeline stages where r > 1024 or K >=
  ``phase1_deep_min_k``, more where fewer would keep less than ``phase1_inflight_bytes`` of X
  and U in flight. P is left as f32 sums (no p16): rounding it in the kernel made a tile of
  each column block wait for the block's atomics."""
  T = _t()
  g = programs or hw.num_sms
  cols = 64 if r <= 1024 else 128
  n_rb, k_per = _phase1_tiles(k, r, cols, g)
  if cols == 128:
    n64, k64 = _phase1_tiles(k, r, 64, g)
    if (
      n64 * cdiv(k, k64) <= g
      and _phase1_l2_us(m, k, r, 64, k64)
      <= _phase1_l2_us(m, k, r, 128, k_per) - T.phase1_narrow_min_us
    ):
      cols, n_rb, k_per = 64, n64, k64
  cols_r = cols
  if cols == 128:  # T.phase1_balance_cols of the block's columns where the largest tile shrinks
    n_b, k_b = _phase1_tiles(k, r, T.phase1_balance_cols, g)
    if T.phase1_balance_cols * k_b <= (1 - T.phase1_balance_min) * cols * k_per:
      cols_r, n_rb, k_per = T.phase1_balance_cols, n_b, k_b
  base = plan_decode_persistent(m, k, r, n, hw, programs=g, v_resident=False, stream_k=False)
  est = _phase_us(n_rb * cdiv(k, k_per), k_per * cols_r * 2, g, T.stream_bw, T.fill_us)
  stages = base.stages
  if r > 1024 or k >= T.phase1_deep_min_k:
    stage_bytes = (base.block_m + cols) * base.block_k * 2
    stages = max(
      T.phase1_wide_stages, min(T.phase1_max_stages, cdiv(T.phase1_inflight_bytes, stage_bytes))
    )
  return dataclasses.replace(
    base, block_r=cols, cols_r=cols_r, k_per=k_per, r_chunks=1, p16=False, stages=stages, est_us=est
  )


@dataclasses.dataclass(frozen=True)
class PvLaunchPlan:
  """Tiles of ``xuv_decode``'s ·V launch (``pv="launch"``): Y = P·V from phase 1's f32 P,
  one [block_m, block_n] output tile a CTA over all of r in block_kv steps (no split)."""

  block_m: int  # P rows a tile (>= 16 for the mma)
  block_n: int  # V columns a tile
  block_kv: int  # the reduction step over r
  warps: int
  stages: int

  def __post_init__(self):
    if self.block_m < 16 or self.block_n < 16:
      raise ValueError(f"{self}: block_m and block_n must be >= 16 (the mma's smallest tile)")
    if min(self.block_kv, self.warps, self.stages) < 1:
      raise ValueError(f"{self}: expected block_kv, warps and stages >= 1")


def plan_pv_launch(m: int, r: int, n: int) -> PvLaunchPlan:
  """Output tiles for the ·V launch: ``pv_launch_cols``-column tiles, the tallest row block
  of 64/32 that keeps at least ``pv_launch_min_tiles`` tiles with an f32 P tile of at most
  ``pv_launch_p_tile_bytes``; 16 rows where none does."""
  T = _t()
  n_nb = cdiv(n, T.pv_launch_cols)
  bm = next(
    (
      b
      for b in (64, 32)
      if b * r * 4 <= T.pv_launch_p_tile_bytes and cdiv(m, b) * n_nb >= T.pv_launch_min_tiles
    ),
    16,
  )
  return PvLaunchPlan(bm, T.pv_launch_cols, 64, 4, 3)


@dataclasses.dataclass(frozen=True)
class GroupDecodePlan:
  """Tiles of the grouped X·U·V decode kernel: several X·U_i·V_i sharing X in one launch.
  Per member i: its phase-1 tiles (block_r[i], cols_r[i], k_per[i]) and phase-2 tiles
  (block_n[i], cols_n[i], one r-chunk). ``one_branch``: the members' ranks and phase-1 tiles
  are alike and the kernel runs them through one phase-1 call site (one pipeline in shared
  memory instead of one a member)."""

  block_m: int
  block_r: tuple
  cols_r: tuple
  k_per: tuple
  block_n: tuple
  cols_n: tuple
  programs: int
  warps: int
  stages: int
  prefetch: int
  est_us: float
  one_branch: bool = False


def _shares(sizes, g: int) -> list:
  """``g`` programs split in proportion to ``sizes`` (each member at least one)."""
  tot = sum(sizes)
  return [max(1, round(g * s / tot)) for s in sizes]


@functools.lru_cache(maxsize=256)
def _group_phase1(
  k: int,
  rs: tuple,
  g: int,
  bw: float,
  fill_us: float,
  stages: int,
  round_trip_us: float,
  widths: tuple = (64, 128, 256),
):
  """(us, ((block_r, cols_r, k_per) a member)) for the grouped kernel's phase 1, whose CTAs
  take every member's split-K tiles round-robin (tile t of the concatenated list to CTA
  t mod g). A CTA's time is the sum over its tiles of bytes / min(bw / g, in-flight bytes /
  round trip) + ``fill_us`` (a ragged last tile counts its own columns and rows); the phase
  lasts as long as the busiest CTA. Members of one rank take the same tiles. Plans of one
  round (at most g tiles) come first where there are any: the measured defaults all are, and
  the model is not trusted to rank several short rounds against one long one. Ties go to
  fewer tiles, then to wider ones."""
  steps = [st for st in (2, 4, 8, 16, 32, 64) if st * 64 < k + 64] or [1]
  share = bw / g

  def tile_us(c, kp):
    return kp * c * 2 / _cta_rate(c, stages, share, round_trip_us) * 1e6 + fill_us

  def tiles_us(r, c, kp):  # in the kernel's order: column block-major, then K splits
    return [tile_us(min(c, r - j), min(kp, k - i)) for j in range(0, r, c) for i in range(0, k, kp)]

  ranks = sorted(set(rs))
  options = {
    r: [
      ((w, c, st * 64), tiles_us(r, c, st * 64))
      for w, c in _widths(widths if r > 32 else (16, 32))
      if c <= max(16, r) + 15
      for st in steps
    ]
    for r in ranks
  }
  count = collections.Counter(rs)
  best = None
  for combo in itertools.product(*(options[r] for r in ranks)):
    chosen = dict(zip(ranks, combo))
    n = sum(count[r] * len(chosen[r][1]) for r in ranks)
    if n <= g:  # one round: the longest tile
      us = max(max(chosen[r][1]) for r in ranks)
    else:
      if best is not None and not best[0][0]:
        continue  # a one-round plan exists
      per_cta, t = [0.0] * g, 0
      for r in rs:
        for dt in chosen[r][1]:
          per_cta[t % g] += dt
          t += 1
      us = max(per_cta)
    key = (n > g, round(us, 6), n, -min(opt[0][1] for opt in combo))
    if best is None or key < best[0]:
      best = (key, tuple(chosen[r][0] for r in rs))
  return best[0][1], best[1]


def plan_decode_group(
  m: int,
  k: int,
  members,
  hw: Hardware = H200,
  programs: int | None = None,
  bw: float | None = None,
  fill_us: float | None = None,
  min_row_bytes: int = 0,
  line_row_tol: float | None = None,
  round_trip_us: float | None = None,
) -> GroupDecodePlan:
  """Tiles for the grouped decode kernel: ``members`` is [(r_i, n_i)]. Phase 1 is planned as
  the kernel runs it, every member's split-K tiles round-robin over all ``programs`` CTAs
  (``_group_phase1``, each CTA's DRAM round trip counted at every size). Phase 2 gives each
  member a share of the CTAs in proportion to its V_i bytes and cuts its tiles as
  ``plan_decode_persistent`` does for that many CTAs, with one r-chunk (phase 2 waits for the
  member's whole X·U_i). ``min_row_bytes`` applies to phase 2 as far as its capped width
  allows. Arguments left None take the tuning table's thresholds of the same names."""
  T = _t()
  bw = T.stream_bw if bw is None else bw
  fill_us = T.fill_us if fill_us is None else fill_us
  line_row_tol = T.line_row_tol if line_row_tol is None else line_row_tol
  round_trip_us = T.round_trip_us if round_trip_us is None else round_trip_us
  g = programs or hw.num_sms
  g2 = _shares([r * n for r, n in members], g)
  block_m = max(16, next_pow2(m))
  stages = 4 if block_m <= 32 else 3
  # from 32 rows 256-column V tiles need more shared memory than a CTA has (245760 B at
  # Llama-3-70B's q/k/v), and at 64 rows so do 256-column U tiles
  widths = (64, 128, 256) if block_m <= 16 else (64, 128)
  est1, phase1 = _group_phase1(
    k,
    tuple(r for r, _ in members),
    g,
    bw,
    fill_us,
    stages,
    round_trip_us,
    (64, 128, 256) if block_m <= 32 else (64, 128),
  )
  est2 = 0.0
  block_n, cols_n = [], []
  for (r, n), (_, cr, _), b in zip(members, phase1, g2):
    t2, bn, cn, _ = _column_tiles(
      n,
      cdiv(r, cr),
      cr,
      b,
      bw * b / g,
      fill_us,
      max_chunks=1,
      min_row_bytes=min(min_row_bytes, 2 * widths[-1]),
      line_row_tol=line_row_tol,
      widths=widths,
    )
    block_n.append(bn), cols_n.append(cn)
    est2 = max(est2, t2)
  block_r, cols_r, k_per = (tuple(t) for t in zip(*phase1))
  return GroupDecodePlan(
    block_m,
    block_r,
    cols_r,
    k_per,
    tuple(block_n),
    tuple(cols_n),
    g,
    4 if block_m <= 32 else 8,
    stages,
    128,
    est1 + est2,
  )


def plan_decode_group_phase1(
  m: int,
  k: int,
  members,
  hw: Hardware = H200,
  programs: int | None = None,
  one_branch: bool | None = None,
) -> GroupDecodePlan:
  """Tiles for the grouped kernel's phase 1 alone (``pv="xla"``: XLA's GEMMs then apply each
  V_i): ``plan_decode_phase1``'s tiles for the members' ranks side by side (K splits chosen
  for their summed rank, so the members' tiles together fill the grid once), every member cut
  the same way; no phase-2 tiles. The kernel keeps a phase-1 pipeline in shared memory for
  each call site, and the stages are as many as those pipelines leave room for, at most the
  phase-1 plan's. ``one_branch`` (members of one rank only; None, the default, takes it
  wherever the ranks match): all members through one call site, one pipeline (2-3 % faster
  on the composed MLP's gate and up than a branch a member, which counts as two pipelines:
  262144 B at 128 rows and 4 stages of 32 KB, so 3 stages)."""
  g = programs or hw.num_sms
  one_rank = len({r for r, _ in members}) == 1
  if one_branch is None:
    one_branch = one_rank
  if one_branch and not one_rank:
    raise ValueError(f"one_branch: expected members of one rank, got {[r for r, _ in members]}")
  p = plan_decode_phase1(
    m, k, sum(r for r, _ in members), max(n for _, n in members), hw, programs=g
  )
  stage_bytes = (p.block_m + p.block_r) * p.block_k * 2
  pipelines = 1 if one_branch else 2
  stages = max(1, min(p.stages, hw.smem_per_cta // (pipelines * stage_bytes)))
  c = len(members)
  return GroupDecodePlan(
    p.block_m,
    (p.block_r,) * c,
    (p.cols_r,) * c,
    (p.k_per,) * c,
    (16,) * c,
    (16,) * c,
    g,
    p.warps,
    stages,
    0,
    p.est_us,
    one_branch,
  )


@dataclasses.dataclass(frozen=True)
class PersistentMlpPlan:
  block_m: int
  block_r: int  # phase A (X·Ug, X·Uu split-K): tile width in registers
  cols_r: int  # phase A columns per tile (a multiple of 16)
  k_per: int  # phase A rows of D per tile
  block_f: int  # phase B (one slice of D_ff per tile): width in registers
  cols_f: int  # phase B columns of D_ff per tile
  block_n: int  # phase C (S·Vd): width in registers
  cols_n: int  # phase C output columns per tile
  c_chunks: int  # phase C split of r_d
  programs: int
  warps: int
  stages: int
  prefetch: int  # rows of its first phase-B slices each CTA prefetches into L2 at its start
  prefetch_c: int  # the same for its first phase-C tile (a power of two; rows past it unread)
  est_us: float
  p16: bool = False  # phase B reads Pg, Pu rounded once to the factors' dtype


def plan_mlp_decode_persistent(
  m: int,
  d: int,
  f: int,
  r: int,
  rd: int,
  d_out: int,
  gated: bool = True,
  hw: Hardware = H200,
  programs: int | None = None,
  bw: float | None = None,
  fill_us: float | None = None,
  min_row_bytes: int = 0,
  line_row_tol: float | None = None,
) -> PersistentMlpPlan:
  """Tiles for the persistent MLP decode kernel: phase A streams Ug and Uu (split-K), phase
  B one D_ff slice of Vg, Vu and Ud per tile, phase C Vd; each phase cut as in
  ``plan_decode_persistent`` (``min_row_bytes`` applies to phase B as far as its capped
  width allows; arguments left None take the tuning table's thresholds)."""
  T = _t()
  bw = T.stream_bw if bw is None else bw
  fill_us = T.fill_us if fill_us is None else fill_us
  line_row_tol = T.line_row_tol if line_row_tol is None else line_row_tol
  g = programs or hw.num_sms
  n_up = 2 if gated else 1
  block_m = max(16, next_pow2(m))
  ta, block_r, cols_r, k_per = _split_k_tiles(d, r, n_up, g, bw, fill_us)
  # phase B at most 128 wide, and 64 from 64 rows: 256-wide tiles need 280 KB of shared
  # memory in Llama-3-70B's MLP, 128-wide ones 272 KB at 64 rows (a CTA has 227 KB)
  widths_b = (64, 128) if block_m <= 32 else (64,)
  tb, block_f, cols_f, _ = _column_tiles(
    f,
    1,
    n_up * r + rd,
    g,
    bw,
    fill_us,
    max_chunks=1,
    min_row_bytes=min(min_row_bytes, 2 * widths_b[-1]),
    line_row_tol=line_row_tol,
    widths=widths_b,
  )
  tc, block_n, cols_n, chunks = _column_tiles(
    d_out, cdiv(rd, 64), 64, g, bw, fill_us, min_row_bytes=min_row_bytes, line_row_tol=line_row_tol
  )
  warps = 4 if block_m <= 32 else 8  # two [block_m, block_f] f32 accumulators per CTA
  return PersistentMlpPlan(
    block_m,
    block_r,
    cols_r,
    k_per,
    block_f,
    cols_f,
    block_n,
    cols_n,
    chunks,
    g,
    warps,
    3,
    64,
    64,
    ta + tb + tc,
  )


def plan_kv_splits(
  b: int, hkv: int, t: int, block_n: int, warps: int, sms: int = H200.num_sms
) -> int:
  """Cache splits per (sequence, KV head) for the low-rank KV attention kernel: the count
  that finishes soonest in whole waves.

  A program's time is taken as its keys plus one block (its fixed costs), and the grid runs
  in waves of resident programs: one per SM at 8 warps (255 registers a thread fill the
  register file), two at 4. So 64 (sequence, head) pairs take 2 splits (one wave) rather
  than 5 (2.4 waves, the last one 42 % full)."""
  slots = (sms or H200.num_sms) * max(1, 8 // warps)
  n_blocks = cdiv(t, block_n)
  best = None
  for s in range(1, min(n_blocks, 4 * slots) + 1):
    chunk = cdiv(n_blocks, s) * block_n
    splits = cdiv(t, chunk)
    cost = cdiv(b * hkv * splits, slots) * (chunk + block_n)
    if best is None or cost < best[0]:
      best = (cost, splits)
  return best[1]
