"""Matrix-level pieces of the compression pipeline (NeuronMM §4.1, eq. 2-8), in f64 numpy.

Layout: a dense kernel ``w`` is [K, N] (``y = x·w``, lrjax's ``Linear`` layout). The
activation-aware factorisation minimises ‖X·w − X·u·v‖_F over the calibration inputs X [T, K]:
with XᵀX = L·Lᵀ (Cholesky, L lower), ‖X·Δ‖_F = ‖Lᵀ·Δ‖_F, so the optimum is the truncated SVD
of Lᵀ·w mapped back with a triangular solve: u = L⁻ᵀ·U_r·√Σ_r, v = √Σ_r·V_rᵀ (the √Σ split of
eq. 6-8; NeuronMM's W·S with S = L in torch's [out, in] layout).

``ratio`` is the fraction of a projection's weight parameters removed: a projection with K·N
weights keeps at most (1 − ratio)·K·N of them, i.e. r·(K + N) ≤ (1 − ratio)·K·N (biases are kept
and not counted).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np
import scipy.linalg

log = logging.getLogger("lrjax.compression")

# Cholesky pivots below this fraction of the mean diagonal count as "not positive definite".
PIVOT_RTOL = 1e-12
# Jitter tried before eigenvalue clipping, as fractions of the mean diagonal of XᵀX.
JITTERS = (1e-10, 1e-8, 1e-6, 1e-4)
# Eigenvalue floor of the clipping fallback, as a fraction of the largest eigenvalue.
EIG_FLOOR = 1e-6


def check_ratio(ratio) -> float:
  if isinstance(ratio, bool) or not isinstance(ratio, (int, float, np.floating, np.integer)):
    raise TypeError(f"{ratio=} must be a float in (0, 1): the fraction of parameters removed")
  if not (0.0 < float(ratio) < 1.0) or not math.isfinite(float(ratio)):
    raise ValueError(
      f"{ratio=} must be in the open interval (0, 1): the fraction of each "
      "compressed projection's weight parameters removed (0.2 keeps 80%)"
    )
  return float(ratio)


def lowrank_params(k: int, n: int, rank: int, heads: int = 1) -> int:
  """Weight parameters of a rank-``rank`` factorisation of a [k, n] kernel.

  ``heads`` > 1 is the per-head form: u [k, rank], v block-diagonal [heads, rank/heads, n/heads].
  """
  return rank * (k + n // heads)


class RankBudgetError(ValueError):
  """``block`` leaves no block-aligned rank within the ratio budget of some projections;
  ``cap`` is the largest rank the (tightest) budget allows over ``heads`` heads."""

  def __init__(self, msg: str, cap: float, heads: int):
    super().__init__(msg)
    self.cap, self.heads = cap, heads


def _budget_cap(k: int, n: int, ratio: float, heads: int) -> float:
  """The largest total rank r with r·(k + n/heads) ≤ (1 − ratio)·k·n that can be factorised."""
  cap = (1.0 - ratio) * k * n / (k + n // heads)
  return min(cap, heads * min(k, n // heads))


def _fitting_block(cap: float, heads: int, below: int) -> int | None:
  """The largest power-of-two block under ``below`` whose alignment fits within ``cap``."""
  fits = [b for b in (2**i for i in range(12)) if b < below and math.lcm(b, heads) <= cap + 1e-9]
  return fits[-1] if fits else None


def budget_rank(k: int, n: int, ratio: float, block: int, *, heads: int = 1, name: str = "") -> int:
  """Largest block-aligned rank within the ratio budget (NeuronMM eq. 5 with α = 0).

  eq. 5 with α = 0 rounds the number of blocks down, so r·(k + n/heads) ≤ (1 − ratio)·k·n always
  holds. For ``heads`` > 1 the total rank (summed over heads) is a multiple of lcm(block, heads)
  so every head gets the same rank. :class:`RankBudgetError` when no such rank is positive.
  """
  ratio = check_ratio(ratio)
  if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block <= 0:
    raise ValueError(f"{block=} must be a positive int (the rank alignment, e.g. 128)")
  if heads <= 0 or n % heads:
    raise ValueError(f"{name}: out features {n=} must split into {heads=} equal heads")
  step = math.lcm(block, heads)
  cap = _budget_cap(k, n, ratio, heads)
  rank = int(math.floor(cap / step + 1e-9)) * step
  if rank <= 0:
    fit = _fitting_block(cap, heads, block)
    fix = f"pass a smaller block (block={fit} fits)" if fit else "pass a smaller ratio"
    raise RankBudgetError(
      f"{name}: {block=} exceeds the rank budget of a [{k}, {n}] kernel at {ratio=} "
      f"(r·(K + N{'/heads' if heads > 1 else ''}) ≤ (1 − ratio)·K·N allows r ≤ {cap:.1f}"
      f"{f' over {heads} heads' if heads > 1 else ''}); {fix}",
      cap,
      heads,
    )
  return rank


def budget_errors(errors: Sequence[RankBudgetError], block: int) -> RankBudgetError:
  """One error for the projections ``block`` misses: the tightest one's reason and a block
  that fits every one (else: a smaller ratio)."""
  if len(errors) == 1:
    return errors[0]
  tight = min(errors, key=lambda e: e.cap)
  fits = [_fitting_block(e.cap, e.heads, block) for e in errors]
  fix = (
    "pass a smaller ratio"
    if None in fits
    else f"pass a smaller block (block={min(fits)} fits every one) or a smaller ratio"
  )
  why = str(tight).split("; pass ")[0]
  return RankBudgetError(
    f"{len(errors)} projections have no rank within the budget; {why}; {fix}",
    tight.cap,
    tight.heads,
  )


def check_rank(k: int, n: int, rank: int, *, heads: int = 1, name: str = "") -> int:
  if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank <= 0:
    raise ValueError(f"{name}: {rank=} must be a positive int")
  if heads > 1:
    if rank % heads:
      raise ValueError(f"{name}: {rank=} must be a multiple of {heads=} (same rank per head)")
    if rank // heads > min(k, n // heads):
      raise ValueError(
        f"{name}: per-head rank {rank // heads} > min(K, head_dim)="
        f"{min(k, n // heads)} for a [{k}, {n}] kernel with {heads} heads"
      )
  elif rank > min(k, n):
    raise ValueError(
      f"{name}: {rank=} > min(K, N)={min(k, n)} for a [{k}, {n}] kernel; "
      "a rank above min(K, N) cannot be factorised"
    )
  return int(rank)


def cholesky_factor(gram, *, name: str = "") -> tuple[np.ndarray, str]:
  """Lower Cholesky factor L of XᵀX [K, K] (f64), repairing a non-PD matrix.

  Returns (L, how) where how is "cholesky", "jitter=<eps>" or "eigclip". A matrix is repaired when
  Cholesky fails or a pivot is below PIVOT_RTOL × mean(diag): first by adding jitter
  eps·mean(diag)·I for eps in JITTERS, then by clipping eigenvalues to EIG_FLOOR × the largest.
  Each repair is logged as a warning naming ``name``.
  """
  g = np.asarray(gram, dtype=np.float64)
  if g.ndim != 2 or g.shape[0] != g.shape[1]:
    raise ValueError(f"{name}: gram.shape={g.shape} must be square [K, K]")
  if not np.all(np.isfinite(g)):
    raise ValueError(f"{name}: XᵀX has NaN/Inf entries; check the calibration activations")
  g = 0.5 * (g + g.T)
  scale = float(np.mean(np.diag(g)))
  if not scale > 0:
    scale = 1.0

  def attempt(m):
    try:
      l = np.linalg.cholesky(m)
    except np.linalg.LinAlgError:
      return None
    return l if np.min(np.diag(l)) ** 2 > PIVOT_RTOL * scale else None

  l = attempt(g)
  if l is not None:
    return l, "cholesky"
  eye = np.eye(g.shape[0])
  for eps in JITTERS:
    l = attempt(g + (eps * scale) * eye)
    if l is not None:
      log.warning(
        "%s: XᵀX is not positive definite; repaired with jitter %.0e × mean diag (%.3g)",
        name,
        eps,
        eps * scale,
      )
      return l, f"jitter={eps:g}"
  w, q = np.linalg.eigh(g)
  floor = EIG_FLOOR * max(float(w[-1]), scale)
  n_clip = int(np.sum(w < floor))
  g2 = (q * np.maximum(w, floor)) @ q.T
  l = np.linalg.cholesky(0.5 * (g2 + g2.T))
  log.warning(
    "%s: XᵀX is not positive definite even with jitter; clipped %d of %d eigenvalues "
    "to %.3g (%.0e × the largest)",
    name,
    n_clip,
    len(w),
    floor,
    EIG_FLOOR,
  )
  return l, "eigclip"


def factorize(w, rank: int, chol=None, *, heads: int = 1, name: str = ""):
  """Rank-``rank`` factors of ``w`` [K, N] with the √Σ split; whitened when ``chol`` (L) is given.

  heads == 1: returns u [K, rank], v [rank, N].
  heads > 1:  per-head (FlashSVD multi-head): head h owns columns [h·d, (h+1)·d) of ``w``
              (d = N/heads) and gets rank/heads; returns u [K, rank] (heads concatenated) and
              v [heads, rank/heads, d].
  """
  w = np.asarray(w, dtype=np.float64)
  if w.ndim != 2:
    raise ValueError(f"{name}: kernel shape {w.shape} must be 2-D [in, out]")
  k, n = w.shape
  if heads <= 0 or n % heads:
    raise ValueError(f"{name}: out features {n} must split into {heads=} equal heads")
  rank = check_rank(k, n, rank, heads=heads, name=name)
  if not np.all(np.isfinite(w)):
    raise ValueError(f"{name}: kernel has NaN/Inf entries")
  if chol is not None and np.shape(chol) != (k, k):
    raise ValueError(f"{name}: Cholesky factor shape {np.shape(chol)} must be ({k}, {k})")
  a = w if chol is None else chol.T @ w
  r_h, d = rank // heads, n // heads
  us, vs = [], []
  for h in range(heads):
    uu, s, vt = np.linalg.svd(a[:, h * d : (h + 1) * d], full_matrices=False)
    rs = np.sqrt(s[:r_h])
    us.append(uu[:, :r_h] * rs)
    vs.append(rs[:, None] * vt[:r_h])
  u = np.concatenate(us, axis=1)
  if chol is not None:
    u = scipy.linalg.solve_triangular(chol.T, u, lower=False)
  v = vs[0] if heads == 1 else np.stack(vs)
  return u, v


def reconstruct(u, v):
  """Dense [K, N] kernel of factors from :func:`factorize` (joint or per-head)."""
  u, v = np.asarray(u), np.asarray(v)
  if v.ndim == 2:
    return u @ v
  h, r_h, d = v.shape
  return np.concatenate([u[:, i * r_h : (i + 1) * r_h] @ v[i] for i in range(h)], axis=1)
