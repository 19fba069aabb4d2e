"""Block-size planner for the NKI TrainiumFusion kernels (NeuronMM §4.2.1, eq. 10-11).

Pure Python, no toolchain: the Neuron lowering's ``supports`` and the explain report
call it on any machine. Given the (padded) problem shape and dtype it returns the
blocks (B_M, B_K, B_r, B_N), the HBM traffic and tensor-engine flops of *our* kernels
(exact, by construction the same numbers the test double counts), the paper's
arithmetic intensity (eq. 10) and peak-SBUF (eq. 11) models, and whether the plan
fits on one NeuronCore: SBUF 24 MiB = 128 partitions x 192 KiB, PSUM 2 MiB =
128 partitions x 16 KiB in 8 banks of 2 KiB.

Spill model. Eq. 11 counts one copy of every buffer. The NKI compiler keeps
``PIPELINE_BUFFERS`` (=2) copies of loop-local buffers so that DMA of the next
block overlaps compute of this one (the strip of strip m+1 fills while strip m is
drained). With one copy eq. 11 says B_M=2048 fits the DeepSeek-V3 shape of the
paper's Table 4; with two it predicts exactly Table 4's pattern (B_M <= 1024 fine,
2048 and 4096 spill). The factor is an assumption calibrated on that table, not a
measurement; ``plan`` refuses any plan whose pipelined footprint exceeds SBUF.

Layouts. All dims are padded to multiples of 128 by the wrappers (zero padding is
exact for the contractions; padded rows/cols of the output are sliced off); blocks
are multiples of 128 that divide the padded dims.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import numpy as np

P = 128  # partitions (SBUF, PSUM, tensor-engine rows)
STATIONARY_FMAX = 128  # free size of the stationary tile
MOVING_FMAX = 512  # free size of the moving tile
SBUF_BYTES = 24 * 2**20
SBUF_PARTITION_BYTES = SBUF_BYTES // P  # 192 KiB
PSUM_BYTES = 2 * 2**20
PSUM_BANKS = 8
PSUM_BANK_BYTES = PSUM_BYTES // P // PSUM_BANKS  # 2 KiB per partition per bank
PIPELINE_BUFFERS = 2
COMPUTE_BOUND_AI = 222.0  # flops/byte, bf16 NeuronCore (paper §4.2.1)

KERNEL_NAMES = ("xuv", "xuv_naive", "mlp_up_gate")


class PlanError(ValueError):
  """No block choice (or the requested one) fits the NeuronCore."""


def pad128(n: int) -> int:
  return -(-int(n) // P) * P


def itemsize(dtype) -> int:
  return int(np.dtype(dtype).itemsize) if not isinstance(dtype, int) else dtype


def moving_tile(b: int) -> int:
  """Free size of the moving tiles used along a block of size ``b`` (a multiple of 128)."""
  for t in (MOVING_FMAX, 256, P):
    if b % t == 0:
      return t
  raise ValueError(f"{b=} is not a multiple of {P}")


@dataclasses.dataclass(frozen=True)
class Blocks:
  bm: int  # B_M: rows of X per strip
  bk: int  # B_K: contraction block of the first matmul
  br: int  # B_r: rank block
  bn: int  # B_N: output-column block
  x_cache: bool = False  # keep the whole X^T row strip [K, B_M] in SBUF: X read once per strip

  def as_tuple(self):
    return (self.bm, self.bk, self.br, self.bn)


@dataclasses.dataclass(frozen=True)
class Traffic:
  """HBM bytes moved by one kernel call (reads of each operand, writes of the output)."""

  x: int
  u: int
  v: int
  bias: int
  out: int
  scale: int = 0  # rank-space scale vectors, read once per launch

  @property
  def reads(self) -> int:
    return self.x + self.u + self.v + self.bias + self.scale

  @property
  def writes(self) -> int:
    return self.out

  @property
  def total(self) -> int:
    return self.reads + self.writes

  def __add__(self, o: Traffic) -> Traffic:
    return Traffic(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(o))))


@dataclasses.dataclass(frozen=True)
class Plan:
  """One kernel launch: blocks plus the model's predictions."""

  kernel: str  # one of KERNEL_NAMES
  shape: tuple[int, int, int, int]  # padded (M, K, r, N)
  itemsize: int  # bytes per element of x, u, v, bias and the output
  blocks: Blocks
  out_t: bool  # writes O^T [N, M] instead of O [M, N]
  x_transposed: bool  # x arrives as X^T [K, M]
  n_bias: int  # bias rows added on chip (0, 1, or 2 for gate+up)
  gated: bool  # mlp_up_gate only
  traffic: Traffic
  flops: int  # every nc_matmul, incl. the rank-1 bias matmuls
  model_flops: int  # 2·M·r·(K+N) per projection, what the paper counts
  ai_eq10: float  # paper eq. 10 (X read once, U/V once per strip)
  sbuf_eq11_bytes: int  # paper eq. 11
  sbuf_peak_bytes: int  # one copy of every live buffer of our kernel (what the double measures)
  psum_tiles: int  # most PSUM accumulation tiles live at once (each <= one bank)

  @property
  def ai(self) -> float:
    """Arithmetic intensity of our kernel: flops / HBM bytes."""
    return self.flops / self.traffic.total

  @property
  def traffic_eq10(self) -> float:
    """HBM bytes in eq. 10's denominator: X read once, U and V once per strip, O once.

    Our kernel reads X once per (strip, rank block), so it moves more when B_r < r.
    """
    M, K, r, N = self.shape
    return self.itemsize * (M * (K + N) + (M / self.blocks.bm) * r * (K + N))

  @property
  def sbuf_pipelined_bytes(self) -> int:
    return PIPELINE_BUFFERS * self.sbuf_peak_bytes

  @property
  def spill_reason(self) -> str | None:
    if self.psum_tiles > PSUM_BANKS:
      return f"{self.psum_tiles} PSUM accumulation tiles > {PSUM_BANKS} banks"
    if self.sbuf_peak_bytes > SBUF_BYTES:
      return f"SBUF {self.sbuf_peak_bytes / 2**20:.1f} MiB > 24 MiB even single-buffered"
    if self.sbuf_pipelined_bytes > SBUF_BYTES:
      return (
        f"SBUF {self.sbuf_pipelined_bytes / 2**20:.1f} MiB with {PIPELINE_BUFFERS} "
        f"pipeline buffers > 24 MiB (would spill)"
      )
    return None

  @property
  def fits(self) -> bool:
    return self.spill_reason is None

  @property
  def compute_bound(self) -> bool:
    return self.ai >= COMPUTE_BOUND_AI

  def summary(self) -> dict:
    M, K, r, N = self.shape
    return {
      "kernel": self.kernel,
      "M": M,
      "K": K,
      "r": r,
      "N": N,
      "itemsize": self.itemsize,
      "B_M": self.blocks.bm,
      "B_K": self.blocks.bk,
      "B_r": self.blocks.br,
      "B_N": self.blocks.bn,
      "x_cache": self.blocks.x_cache,
      "out_t": self.out_t,
      "x_transposed": self.x_transposed,
      "hbm_bytes": self.traffic.total,
      "hbm_read_bytes": self.traffic.reads,
      "hbm_write_bytes": self.traffic.writes,
      "hbm_bytes_eq10": int(self.traffic_eq10),
      "flops": self.flops,
      "model_flops": self.model_flops,
      "ai": round(self.ai, 2),
      "ai_eq10": round(self.ai_eq10, 2),
      "sbuf_eq11_bytes": self.sbuf_eq11_bytes,
      "sbuf_peak_bytes": self.sbuf_peak_bytes,
      "sbuf_pipelined_bytes": self.sbuf_pipelined_bytes,
      "sbuf_pipelined_pct": round(100 * self.sbuf_pipelined_bytes / SBUF_BYTES, 2),
      "psum_tiles": self.psum_tiles,
      "fits": self.fits,
      "spill_reason": self.spill_reason,
    }


def ai_eq10(M: int, K: int, r: int, N: int, bm: int, s: int) -> float:
  """Paper eq. 10: 2Mr(K+N) / (s·(M(K+N) + (M/B_M)·r(K+N)))."""
  return 2 * M * r * (K + N) / (s * (M * (K + N) + (M / bm) * r * (K + N)))


def sbuf_eq11(r: int, b: Blocks, s: int) -> int:
  """Paper eq. 11: (B_M·r + (B_M + B_r)·max(B_K, B_N))·s."""
  return (b.bm * r + (b.bm + b.br) * max(b.bk, b.bn)) * s


def _check_dims(shape, b: Blocks):
  for name, dim, blk in zip(("M", "K", "r", "N"), shape, b.as_tuple()):
    if dim % P or blk % P or dim % blk:
      raise ValueError(
        f"{name}={dim} and its block {blk} must be multiples of {P} with the "
        f"block dividing the (padded) dim"
      )


def _evaluate(kernel, shape, s, b: Blocks, out_t, x_transposed, n_bias, gated, n_scale=0) -> Plan:
  """Exact footprint and traffic of our kernels for one block choice."""
  _check_dims(shape, b)
  M, K, r, N = shape
  tm = moving_tile(b.bm)
  tn = moving_tile(b.bn)
  strips = M // b.bm
  rblocks = r // b.br
  nblocks = N // b.bn
  proj = 2 if (kernel == "mlp_up_gate" and gated) else 1
  bias_pp = (n_bias * b.bn + b.bm) * s if n_bias else 0  # [1, B_N] bias row(s) + [1, B_M] ones
  strip_pp = proj * (r // P) * b.bm * s
  x_pp = ((K if b.x_cache else b.bk) // P) * b.bm * s
  u_pp = proj * (b.bk // P) * b.br * s
  v_pp = proj * (b.br // P) * b.bn * s
  o_pp = (b.bn // P) * b.bm * s if out_t else (b.bm // P) * b.bn * s
  scale_pp = n_scale * (r // P) * s  # [P, r/P] per scale vector, loaded once per launch
  acc1 = proj * (b.br // P) * (b.bm // tm)
  if out_t:
    acc2 = proj * (b.bn // P) * (b.bm // tm)
  else:
    acc2 = (b.bm // P) * (b.bn // tn)
  x_reads = M * K * s * (1 if b.x_cache else rblocks)
  u_reads = proj * strips * K * r * s
  v_reads = proj * strips * r * N * s
  bias_reads = n_bias * strips * N * s
  model_flops = proj * 2 * M * r * (K + N)
  flops = model_flops + n_bias * 2 * M * N
  if kernel == "xuv":
    peak_pp = max(strip_pp + x_pp + u_pp, strip_pp + v_pp + o_pp + bias_pp) + scale_pp
    psum = max(acc1, acc2)
  elif kernel == "mlp_up_gate":
    if not out_t:
      raise ValueError("mlp_up_gate always writes Y^T (out_t=True)")
    act_pp = tm * 4 if gated else 0  # f32 act(gate) tile
    peak_pp = max(strip_pp + x_pp + u_pp, strip_pp + v_pp + o_pp + bias_pp + act_pp) + scale_pp
    psum = max(acc1, acc2)
  elif kernel == "xuv_naive":
    if out_t or x_transposed or n_bias or n_scale or b.x_cache:
      raise ValueError("xuv_naive (Algorithm 1) writes O from X, without bias or X cache")
    # Algorithm 1: the Y_mp block is recomputed for every output block O_mn.
    y_pp = (b.br // P) * b.bm * s
    peak_pp = x_pp + u_pp + y_pp + v_pp + o_pp
    psum = acc1 + acc2
    x_reads *= nblocks
    u_reads *= nblocks
    flops = 2 * M * K * r * nblocks + 2 * M * r * N
  else:
    raise ValueError(f"{kernel=} is not one of {KERNEL_NAMES}")
  traffic = Traffic(
    x=x_reads, u=u_reads, v=v_reads, bias=bias_reads, out=M * N * s, scale=n_scale * r * s
  )
  eq11 = proj * sbuf_eq11(r, b, s)
  return Plan(
    kernel=kernel,
    shape=(M, K, r, N),
    itemsize=s,
    blocks=b,
    out_t=out_t,
    x_transposed=x_transposed,
    n_bias=n_bias,
    gated=gated,
    traffic=traffic,
    flops=flops,
    model_flops=model_flops,
    ai_eq10=ai_eq10(M, K, r, N, b.bm, s),
    sbuf_eq11_bytes=eq11,
    sbuf_peak_bytes=P * peak_pp,
    psum_tiles=psum,
  )


def _divisor_blocks(dim: int, cap: int) -> list[int]:
  t = dim // P
  return [P * d for d in range(1, t + 1) if t % d == 0 and P * d <= cap]


@functools.lru_cache(maxsize=4096)
def _search(kernel, shape, s, out_t, x_transposed, n_bias, gated, bm_fixed, n_scale=0):
  """Least-traffic fitting plan; with ``bm_fixed`` and nothing fitting, the smallest footprint."""
  M, K, r, N = shape
  best = smallest = None
  caches = (False,) if kernel == "xuv_naive" else (False, True)
  bms = [bm_fixed] if bm_fixed else _divisor_blocks(M, 8192)
  for bm, br, bk, bn, xc in itertools.product(
    bms, _divisor_blocks(r, 4096), _divisor_blocks(K, 4096), _divisor_blocks(N, 4096), caches
  ):
    if xc and br == r:
      continue  # one rank block: X is read once per strip anyway
    blocks = Blocks(bm, bk, br, bn, xc)
    p = _evaluate(kernel, shape, s, blocks, out_t, x_transposed, n_bias, gated, n_scale)
    if p.psum_tiles > PSUM_BANKS:
      continue
    if p.fits:
      # Least HBM traffic; then fewer, larger DMAs; then the smaller footprint.
      key = (p.traffic.total, -(bk * bn), p.sbuf_peak_bytes)
      if best is None or key < best[0]:
        best = (key, p)
    elif smallest is None or p.sbuf_peak_bytes < smallest.sbuf_peak_bytes:
      smallest = p
  if best is not None:
    return best[1]
  return smallest if bm_fixed else None


def plan(
  kernel: str,
  M: int,
  K: int,
  r: int,
  N: int,
  dtype,
  *,
  out_t: bool = False,
  x_transposed: bool = False,
  n_bias: int = 0,
  gated: bool = True,
  blocks: Blocks | tuple | None = None,
  n_scale: int = 0,
) -> Plan:
  """Plans one kernel launch on the shapes padded to multiples of 128.

  Without ``blocks`` it searches every block choice that divides the padded dims and
  returns the one with the least HBM traffic (highest arithmetic intensity) among
  those that fit; with ``blocks`` it evaluates that choice. Raises :class:`PlanError`
  when nothing fits or the requested blocks would spill.
  """
  for name, d in (("M", M), ("K", K), ("r", r), ("N", N)):
    if int(d) < 1:
      raise ValueError(f"{name}={d} must be >= 1")
  shape = tuple(pad128(d) for d in (M, K, r, N))
  s = itemsize(dtype)
  if blocks is not None:
    b = blocks if isinstance(blocks, Blocks) else Blocks(*blocks)
    p = _evaluate(kernel, shape, s, b, out_t, x_transposed, n_bias, gated, n_scale)
    if not p.fits:
      raise PlanError(f"{kernel} blocks {b.as_tuple()} for padded shape {shape}: {p.spill_reason}")
    return p
  p = _search(kernel, shape, s, out_t, x_transposed, n_bias, gated, None, n_scale)
  if p is None:
    raise PlanError(
      f"{kernel}: no block choice fits 24 MiB SBUF / 8 PSUM banks for padded "
      f"shape (M, K, r, N)={shape} with {s}-byte elements; lower the rank r"
    )
  return p


def evaluate(
  kernel: str,
  M: int,
  K: int,
  r: int,
  N: int,
  dtype,
  blocks,
  *,
  out_t=False,
  x_transposed=False,
  n_bias=0,
  gated=True,
  n_scale=0,
) -> Plan:
  """Like :func:`plan` with fixed blocks, but returns spilling plans instead of raising."""
  shape = tuple(pad128(d) for d in (M, K, r, N))
  b = blocks if isinstance(blocks, Blocks) else Blocks(*blocks)
  return _evaluate(kernel, shape, itemsize(dtype), b, out_t, x_transposed, n_bias, gated, n_scale)


def best_for_bm(
  kernel: str,
  M: int,
  K: int,
  r: int,
  N: int,
  dtype,
  bm: int,
  *,
  out_t=False,
  x_transposed=False,
  n_bias=0,
  gated=True,
  n_scale=0,
) -> Plan | None:
  """Least-traffic fitting plan with B_M fixed, else its smallest (spilling) plan; for Table 4."""
  shape = tuple(pad128(d) for d in (M, K, r, N))
  s = itemsize(dtype)
  return _search(kernel, shape, s, out_t, x_transposed, n_bias, gated, int(bm), n_scale)


@dataclasses.dataclass(frozen=True)
class MlpPlan:
  """Algorithm 3: UpGateProjection (writes Y^T) then DownProjection (XUV from Y^T)."""

  up_gate: Plan
  down: Plan

  @property
  def traffic(self) -> Traffic:
    return self.up_gate.traffic + self.down.traffic

  @property
  def flops(self) -> int:
    return self.up_gate.flops + self.down.flops


def plan_mlp(
  M: int,
  K: int,
  r_up: int,
  d_ff: int,
  r_down: int,
  N: int,
  dtype,
  *,
  gated: bool = True,
  up_bias: int = 0,
  down_bias: bool = False,
  up_scale: int = 0,
  down_scale: bool = False,
) -> MlpPlan:
  """Plans both launches of the fused MLP; ``up_bias`` counts gate/up bias rows (0-2) and
  ``up_scale`` their rank-space scale vectors (0-2)."""
  up = plan(
    "mlp_up_gate",
    M,
    K,
    r_up,
    d_ff,
    dtype,
    out_t=True,
    n_bias=up_bias,
    gated=gated,
    n_scale=up_scale,
  )
  down = plan(
    "xuv",
    M,
    d_ff,
    r_down,
    N,
    dtype,
    out_t=False,
    x_transposed=True,
    n_bias=int(bool(down_bias)),
    n_scale=int(bool(down_scale)),
  )
  return MlpPlan(up, down)


def table4_bm_values(M: int) -> list[int]:
  return [P * 2**i for i in range(int(math.log2(max(M // P, 1))) + 1)]
