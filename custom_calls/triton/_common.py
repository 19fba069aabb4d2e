"""Triton helpers shared by the lrjax kernels: tile GEMM loops, activations, and the
inter-CTA flags (release/acquire) that let one launch run dependent stages.

Imports triton at module import: only ``load()`` of the CUDA lowering imports this.
"""

import jax
import jax.numpy as jnp
import triton
import triton.language as tl


def unpack_xuv_args(x, u, v, out_dtype):
  """Validates the X·U·V kernels' arguments (shared by xuv_decode and xuv_prefill).

  Returns (x2 [M, K], lead dims, (m, k, r, n), out_dtype)."""
  if u.ndim != 2 or v.ndim != 2 or x.shape[-1] != u.shape[0] or u.shape[1] != v.shape[0]:
    raise ValueError(f"{x.shape=}, {u.shape=}, {v.shape=}: expected x [..., K], u [K, r], v [r, N]")
  if u.dtype != v.dtype or x.dtype != u.dtype:
    raise TypeError(f"{x.dtype=}, {u.dtype=}, {v.dtype=} must match")
  k, r = u.shape
  x2 = x.reshape(-1, k)
  return x2, x.shape[:-1], (x2.shape[0], k, r, v.shape[1]), jnp.dtype(out_dtype or x.dtype)


ACT_CODES = {"silu": 0, "gelu_tanh": 1, "gelu": 2, "relu": 3}  # the MLP kernels' ACT constexpr


def unpack_mlp_args(x, up, down, gate, act):
  """Validates the MLP kernels' arguments (shared by mlp_decode and mlp_prefill).

  Returns (x2 [M, D], lead dims, (d, r, f, rd, d_out), bias_mask, ops) where ``ops`` are the
  ten kernel operands x2, ug, vg, bg, uu, vu, bu, ud, vd, bd (an absent bias is replaced by
  its v factor, which the kernel never reads).
  """
  if act not in ACT_CODES:
    raise ValueError(f"{act=} is not supported; expected one of {sorted(ACT_CODES)}")
  gated = gate is not None
  projs = ((gate,) if gated else ()) + (up, down)
  for p in projs:
    if not isinstance(p, (tuple, list)) or len(p) not in (2, 3):
      raise ValueError("each projection must be (u, v) or (u, v, bias)")
  uu, vu = up[:2]
  ud, vd = down[:2]
  d, r = uu.shape
  f = vu.shape[1]
  rd, d_out = vd.shape
  if x.shape[-1] != d or vu.shape[0] != r or ud.shape != (f, rd):
    raise ValueError(
      f"{x.shape=}, up {uu.shape}x{vu.shape}, down {ud.shape}x{vd.shape}: "
      "expected x [..., D], up [D, r]x[r, F], down [F, r_d]x[r_d, D_out]"
    )
  if gated and (gate[0].shape != uu.shape or gate[1].shape != vu.shape):
    raise ValueError(
      f"gate factors {gate[0].shape}x{gate[1].shape} must match up's "
      f"{uu.shape}x{vu.shape} (one pass computes both)"
    )
  lead = x.shape[:-1]
  x2 = x.reshape(-1, d)
  bias_mask = tuple(len(p) == 3 for p in projs)
  ug, vg, bg = (tuple(gate) + (None,))[:3] if gated else (uu, vu, None)
  bu = up[2] if len(up) == 3 else None
  bd = down[2] if len(down) == 3 else None
  ops = (
    x2,
    ug,
    vg,
    bg if bg is not None else vg,
    uu,
    vu,
    bu if bu is not None else vu,
    ud,
    vd,
    bd if bd is not None else vd,
  )
  return x2, lead, (d, r, f, rd, d_out), bias_mask, ops


def norm_operands(norm, k: int):
  """(weight | None, eps) of a kernel's ``norm=`` argument: None, or (weight [K], eps >= 0)."""
  if norm is None:
    return None, 0.0
  w, eps = norm
  if tuple(w.shape) != (k,):
    raise ValueError(f"norm weight {tuple(w.shape)}: expected ({k},), x's last axis")
  if not float(eps) >= 0:
    raise ValueError(f"norm eps={eps}: expected >= 0")
  return w, float(eps)


# a kernel's HAS_BIAS (HAS_BD) constexpr that makes its bias operand an [M, N] residual added
# to the output (store_out): the add of the layer's residual stream, without a launch of its own
RESIDUAL = tl.constexpr(2)


def residual_operand(residual, bias, lead, n: int, dtype):
  """(the epilogue operand or None, the kernel's HAS_BIAS) for a kernel's ``bias`` and
  ``residual=`` (x's leading dims + [N] in the output dtype): the residual takes the bias's
  operand, so a call takes one of them."""
  if residual is None:
    return bias, bias is not None
  if bias is not None:
    raise ValueError("bias= and residual= share the kernel's epilogue operand: pass one")
  dtype = jnp.dtype(dtype)
  if tuple(residual.shape) != (*lead, n) or residual.dtype != dtype:
    raise ValueError(
      f"residual {tuple(residual.shape)} {residual.dtype}: expected {(*lead, n)} {dtype} "
      "(the output's shape and dtype)"
    )
  return residual.reshape(-1, n), RESIDUAL.value


def residual_reference(y, residual):
  """y, or ``residual + y`` as XLA adds them (y rounded to its dtype first)."""
  return y if residual is None else residual + y


def normed_reference(x, norm):
  """x, or with ``norm`` = (weight, eps) rms_norm(x, weight, eps) in x's dtype: what a
  kernel's norm= computes (within its tolerance: norm_tile)."""
  if norm is None:
    return x
  from lrjax.lowering.rms_norm import rms_norm_reference

  return rms_norm_reference(x, norm[0], eps=float(norm[1]), dtype=x.dtype)


def num_sms() -> int:
  """SMs of the first local GPU (the persistent grids; every CTA must be resident at once);
  0 when the runtime does not say or no GPU is attached (e.g. compiling ahead of time)."""
  try:
    dev = jax.local_devices(backend="gpu")[0]
  except (RuntimeError, IndexError):
    return 0
  return int(getattr(dev, "core_count", 0) or 0)


def check_out(out, shape, dtype):
  """``out=`` (a caller's output buffer, aliased into the call) must be [M, N] of dtype."""
  if out is not None and (tuple(out.shape) != tuple(shape) or out.dtype != dtype):
    raise ValueError(f"{out.shape=} {out.dtype=}: expected {tuple(shape)} {dtype}")


@triton.jit
def k_masks(m_mask, n_mask, kk, K: tl.constexpr, EVEN_K: tl.constexpr):
  """The load masks of one K step of A [BM, BK] @ B [BK, BN]: rows, columns, and K rows kk
  beyond K unless EVEN_K (K a multiple of the step)."""
  if EVEN_K:
    a_m = m_mask[:, None]
    b_m = n_mask[None, :]
  else:
    a_m = m_mask[:, None] & (kk[None, :] < K)
    b_m = (kk[:, None] < K) & n_mask[None, :]
  return a_m, b_m


@triton.jit
def norm_tile(a, g_ptr, kk, k_mask):
  """X·g of a loaded X tile a [BM, BK] (columns kk) and the norm weight g[kk], both in a's
  dtype, the product rounded once to it: rms_norm's input to a GEMM before its per-row scale
  (``row_scale``), which the consumer of the product applies."""
  g = tl.load(g_ptr + kk, mask=k_mask, other=0.0).to(a.dtype)
  return (a.to(tl.float32) * g.to(tl.float32)[None, :]).to(a.dtype)


@triton.jit
def row_scale(sq_ptr, offs_m, m_mask, K: tl.constexpr, EPS: tl.constexpr):
  """[BM] f32 1 / sqrt(mean(x², -1) + EPS) of rows offs_m from their f32 sums of squares at
  sq_ptr (complete once the wait on their producers has ended; read past L1)."""
  ss = tl.load(sq_ptr + offs_m, mask=m_mask, other=0.0, cache_modifier=".cg")
  return tl.math.rsqrt(tl.math.div_rn(ss, tl.full([offs_m.shape[0]], K, tl.float32)) + EPS)


@triton.jit
def mm_acc(
  acc,  # [BM, BN] f32 accumulator
  a_ptr,  # A [*, LDA] row-major, rows offs_m
  b_ptr,  # B [*, LDB] row-major, columns offs_n
  offs_m,  # [BM] rows of A
  offs_n,  # [BN] columns of B
  m_mask,  # [BM]
  n_mask,  # [BN]
  k_start,
  k_end,  # reduction range, k_start a multiple of BK
  K: tl.constexpr,
  LDA: tl.constexpr,
  LDB: tl.constexpr,
  BK: tl.constexpr,
  EVEN_K: tl.constexpr,
  A_CG: tl.constexpr,
  NORM: tl.constexpr = False,
  g_ptr=None,  # with NORM: the norm weight g [K], and where add_sq (a runtime bool) holds,
  sq_ptr=None,  # [M] f32 the tile's squares of A are added to (row_scale reads the sums)
  add_sq=False,
):
  """acc += A[offs_m, k_start:k_end] @ B[k_start:k_end, offs_n], software-pipelined; with
  NORM, A·g (norm_tile) instead of A, and with add_sq the rows' sums of squares of this
  K range added to sq_ptr."""
  offs_k = tl.arange(0, BK)
  sq = tl.zeros([offs_m.shape[0], BK], tl.float32)
  for k0 in range(k_start, k_end, BK):
    kk = k0 + offs_k
    a_ptrs = a_ptr + offs_m[:, None] * LDA + kk[None, :]
    b_ptrs = b_ptr + kk[:, None] * LDB + offs_n[None, :]
    a_m, b_m = k_masks(m_mask, n_mask, kk, K, EVEN_K)
    if A_CG:
      a = tl.load(a_ptrs, mask=a_m, other=0.0, cache_modifier=".cg")
    else:
      a = tl.load(a_ptrs, mask=a_m, other=0.0)
    if NORM:
      sq += a.to(tl.float32) * a.to(tl.float32)
      a = norm_tile(a, g_ptr, kk, kk < K)
    b = tl.load(b_ptrs, mask=b_m, other=0.0)
    acc = tl.dot(a.to(b.dtype), b, acc)
  if NORM:
    if add_sq:
      tl.atomic_add(sq_ptr + offs_m, tl.sum(sq, axis=1), mask=m_mask, sem="relaxed")
  return acc


@triton.jit
def mm_acc2(
  acc1,
  acc2,  # [BM, BN] f32 accumulators
  a1_ptr,
  a2_ptr,  # A1, A2 [*, LDA] row-major
  b1_ptr,
  b2_ptr,  # B1, B2 [*, LDB] row-major
  offs_m,
  offs_n,
  m_mask,
  n_mask,
  k_start,
  k_end,
  K: tl.constexpr,
  LDA: tl.constexpr,
  LDB: tl.constexpr,
  BK: tl.constexpr,
  EVEN_K: tl.constexpr,
  A_CG: tl.constexpr,
  SHARED_A: tl.constexpr,
  NORM: tl.constexpr = False,
  g_ptr=None,  # with NORM (SHARED_A only): as mm_acc's
  sq_ptr=None,
  add_sq=False,
):
  """acc1 += A1 @ B1 and acc2 += A2 @ B2 in one pass (SHARED_A: A1 is A2, loaded once, and
  with NORM taken as mm_acc takes it)."""
  tl.static_assert(SHARED_A or not NORM, "NORM applies to a shared A")
  offs_k = tl.arange(0, BK)
  sq = tl.zeros([offs_m.shape[0], BK], tl.float32)
  for k0 in range(k_start, k_end, BK):
    kk = k0 + offs_k
    a_off = offs_m[:, None] * LDA + kk[None, :]
    b_off = kk[:, None] * LDB + offs_n[None, :]
    a_m, b_m = k_masks(m_mask, n_mask, kk, K, EVEN_K)
    if A_CG:
      a1 = tl.load(a1_ptr + a_off, mask=a_m, other=0.0, cache_modifier=".cg")
    else:
      a1 = tl.load(a1_ptr + a_off, mask=a_m, other=0.0)
    if NORM:
      sq += a1.to(tl.float32) * a1.to(tl.float32)
      a1 = norm_tile(a1, g_ptr, kk, kk < K)
    if SHARED_A:
      a2 = a1
    elif A_CG:
      a2 = tl.load(a2_ptr + a_off, mask=a_m, other=0.0, cache_modifier=".cg")
    else:
      a2 = tl.load(a2_ptr + a_off, mask=a_m, other=0.0)
    b1 = tl.load(b1_ptr + b_off, mask=b_m, other=0.0)
    b2 = tl.load(b2_ptr + b_off, mask=b_m, other=0.0)
    acc1 = tl.dot(a1.to(b1.dtype), b1, acc1)
    acc2 = tl.dot(a2.to(b2.dtype), b2, acc2)
  if NORM:
    if add_sq:
      tl.atomic_add(sq_ptr + offs_m, tl.sum(sq, axis=1), mask=m_mask, sem="relaxed")
  return acc1, acc2


@triton.jit
def activation(x, ACT: tl.constexpr):
  """ACT: 0 silu, 1 gelu_tanh, 2 gelu (erf), 3 relu; x is f32."""
  if ACT == 0:
    y = x * tl.sigmoid(x)
  elif ACT == 1:
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    y = x * tl.sigmoid(2.0 * inner)  # 0.5·(1 + tanh(z)) = sigmoid(2z)
  elif ACT == 2:
    y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
  else:
    y = tl.maximum(x, 0.0)
  return y


@triton.jit
def signal(flag_ptr):
  """Publishes this CTA's prior global writes: CTA barrier, then a gpu-scope release add."""
  tl.debug_barrier()
  tl.atomic_add(flag_ptr, 1, sem="release", scope="gpu")


@triton.jit
def wait_at_least(flag_ptr, target):
  """Spins until *flag_ptr >= target, each read a gpu-scope acquire, then a CTA barrier.
  The poll is ``atomic_add(flag, 0, acquire)`` with its value used: Triton lowers that to
  one ``ld.global.gpu.acquire`` a poll (by one thread, shared with the CTA). A relaxed poll
  followed by an unused acquiring ``atomic_add(flag, 0)`` lost the acquire: Triton 3.6 drops
  the unused no-op atomic (tests/custom_calls/triton/test_triton_sync.py)."""
  while tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu") < target:
    pass
  tl.debug_barrier()


@triton.jit
def stamp(trace_ptr, slot, ON: tl.constexpr):
  """Timing only (ON): this CTA's %globaltimer (ns) into int64 ``trace_ptr[pid * 8 + slot]``,
  at slot 0 also its SM (%smid) into slot 7: a per-CTA clock trace of a launch."""
  if ON:
    t = tl.inline_asm_elementwise(
      "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )
    tl.store(trace_ptr.to(tl.pointer_type(tl.int64)) + tl.program_id(0) * 8 + slot, t)
    if slot == 0:  # and the SM it runs on, in slot 7
      sm = tl.inline_asm_elementwise(
        "mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1
      )
      tl.store(trace_ptr.to(tl.pointer_type(tl.int64)) + tl.program_id(0) * 8 + 7, sm.to(tl.int64))


@triton.jit
def last_arrival(cnt_ptr, n):
  """True in the last of ``n`` CTAs to arrive at a zeroed counter (the split-K paper's
  semaphore): each releases its prior global writes, and the last acquires all of them."""
  tl.debug_barrier()
  ticket = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
  tl.debug_barrier()
  return ticket == n - 1


@triton.jit
def join_chain(scratch_ptr, WORK_OFF: tl.constexpr, PDL: tl.constexpr):
  """A chained kernel's first step: this call's half of the scratch chain's buffer (launch.py).
  The offset of the half is a constexpr: at a runtime offset the scratch's addresses no longer
  fold into the kernel argument, and ptxas gave the kernels at 64 rows up to twice the
  registers.

  PDL: the kernel was launched as a programmatic dependent (launch.py), so its CTAs may
  start before the kernel ahead of it on the stream has finished. ``gdc_wait`` holds them
  until that kernel has completed and its writes are visible; every load of activations or
  scratch after it is ordered as in a plain launch. See ``pdl_join`` for PDL >= 2."""
  pdl_join(PDL)
  return scratch_ptr + WORK_OFF


@triton.jit
def pdl_join(PDL: tl.constexpr):
  """PDL >= 1: wait for the kernel ahead (``gdc_wait``). PDL >= 2 (launch_modes.pdl_overlap):
  then let the next launch start (``gdc_launch_dependents``), so its CTAs take the SMs this
  launch's CTAs leave and fetch their weights (``prefetch_ahead``) while this one ends. After
  the wait, not before: a launch that started early never lets a third start before the
  kernel it waits for has ended. At PDL 1 the next launch starts as this one's CTAs exit."""
  if PDL:
    tl.extra.cuda.gdc_wait()
    if PDL >= 2:
      tl.extra.cuda.gdc_launch_dependents()


AHEAD_ROWS = tl.constexpr(128)  # rows of its first tile a CTA prefetches before its PDL wait


@triton.jit
def prefetch_ahead(ptr, row0, col0, row_end, col_end, LD: tl.constexpr, ON: tl.constexpr):
  """Before a PDL wait (PDL >= 2): the first AHEAD_ROWS rows of a weight tile [row0, row_end)
  x [col0, col_end) (at most 256 columns) into L2. Weights never depend on the kernel ahead, so
  these reads may overlap its end; the tile's loads after the wait then start from L2. A hint:
  nothing reads what it fetches but the same tile's loads."""
  if ON:
    prefetch_l2(
      ptr, row0, col0, tl.minimum(row_end, row0 + AHEAD_ROWS), col_end, LD, AHEAD_ROWS, 256
    )


@triton.jit
def prefetch_splitk_tile(
  u_ptr, t, K: tl.constexpr, R: tl.constexpr, K_PER: tl.constexpr, SPLIT: tl.constexpr,
  COLS: tl.constexpr, ON: tl.constexpr,
):  # fmt: skip
  """``prefetch_ahead`` of split-K tile ``t`` of U [K, R]: column block t // SPLIT (COLS wide),
  K rows [k0, k0 + K_PER) with k0 = (t % SPLIT) * K_PER, as the kernels' phase-1 tiles run."""
  c0 = (t // SPLIT) * COLS
  k0 = (t % SPLIT) * K_PER
  prefetch_ahead(u_ptr, k0, c0, tl.minimum(k0 + K_PER, K), tl.minimum(c0 + COLS, R), R, ON)


@triton.jit
def leave_chain(scratch_ptr, clear_off, clear_n, FIRST: tl.constexpr = 0, COUNT: tl.constexpr = 0):
  """A chained kernel's last step: zeroes this program's share of the half the call before it
  used (``clear_n`` floats at ``clear_off``), for the call after it; nothing in this launch
  reads that half. At the end its stores overlap the other programs' tails; at entry they
  came before the first loads and cost up to 0.4 µs a call.
  COUNT > 0: programs [FIRST, FIRST + COUNT) share the zeroing and the others skip it, where
  those programs are done early and the others end the call."""
  # a tensor either way: for XLA's PTX call (launch.xla_kernel) the two are compiled in
  off = tl.multiple_of(tl.full((), clear_off, tl.int32), 16)
  if COUNT > 0:
    pid = tl.program_id(0)
    if (pid >= FIRST) & (pid < FIRST + COUNT):
      clear_scratch(scratch_ptr + off, clear_n, pid - FIRST, COUNT)
  else:
    clear_scratch(scratch_ptr + off, clear_n, tl.program_id(0), tl.num_programs(0))


@triton.jit
def clear_scratch(ptr, n, pid, programs, BLOCK: tl.constexpr = 512):
  """Zeroes this program's share of f32 ``ptr[0:n]``: the half of a chained scratch buffer
  that the call before this one used (launch.py). Nothing in this launch reads it."""
  per = tl.cdiv(n, programs)
  start = pid * per
  end = tl.minimum(start + per, n)
  for i in range(start, end, BLOCK):
    offs = i + tl.arange(0, BLOCK)
    tl.store(ptr + offs, tl.zeros([BLOCK], tl.float32), mask=offs < end)


@triton.jit
def round_once(src_ptr, dst_ptr, off, mask):
  """dst[off] = src[off]: an f32 split-K sum read from L2, rounded once to dst's dtype (the
  dtype the next stage's dot consumes), so the next stage's tiles read half the bytes."""
  t = tl.load(src_ptr + off, mask=mask, other=0.0, cache_modifier=".cg")
  tl.store(dst_ptr + off, t.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def first_tile(counter_ptr, DYNAMIC: tl.constexpr):
  """A persistent CTA's first tile of a schedule: claimed from a zeroed counter (DYNAMIC;
  every earlier tile is then held by a running CTA, so waits on earlier tiles end), else
  its program id."""
  if DYNAMIC:
    t = tl.atomic_add(counter_ptr, 1, sem="relaxed")
  else:
    t = tl.program_id(0)
  return t


@triton.jit
def next_tile(counter_ptr, t, PROGRAMS: tl.constexpr, DYNAMIC: tl.constexpr):
  """The CTA's next tile after ``t``: the next unclaimed one (DYNAMIC), else t + PROGRAMS."""
  if DYNAMIC:
    t = tl.atomic_add(counter_ptr, 1, sem="relaxed")
  else:
    t += PROGRAMS
  return t


@triton.jit
def splitr_out_tile(
  nb,
  rc,  # output column block, reduction chunk
  a_ptr,  # [M, R] left operand, f32 or V's dtype (complete for chunk rc)
  v_ptr,  # [R, N] right factor
  b_ptr,  # [N] bias (read only if HAS_BIAS)
  acc_ptr,  # [M, N] f32 accumulator, zeroed
  sem_ptr,  # [ceil(N/BLOCK_N)] i32 chunks done per column block, zeroed
  o_ptr,  # [M, N] output
  M,
  R: tl.constexpr,
  N: tl.constexpr,
  R_PER: tl.constexpr,
  N_CHUNKS: tl.constexpr,
  HAS_BIAS: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_N: tl.constexpr,
  BLOCK_KV: tl.constexpr,
  EVEN_R: tl.constexpr,
  COLS_N: tl.constexpr,
  ROW_SCALE: tl.constexpr = False,
  rs=None,  # with ROW_SCALE: [BM] f32 factors of the product's rows (row_scale)
):
  """One chunk of a split-r O = A·V: f32 atomics into acc; the last chunk to arrive for a
  column block (``last_arrival``) adds the bias and writes the output: one launch.
  A column block is COLS_N <= BLOCK_N columns wide; with one chunk the output is stored
  directly (acc and the semaphores are then unused)."""
  offs_m = tl.arange(0, BLOCK_M)
  m_mask = offs_m < M
  offs_n = nb * COLS_N + tl.arange(0, BLOCK_N)
  n_mask = offs_n < N
  if COLS_N < BLOCK_N:
    n_mask = n_mask & (tl.arange(0, BLOCK_N) < COLS_N)
  acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
  acc = mm_acc(
    acc,
    a_ptr,
    v_ptr,
    offs_m,
    offs_n,
    m_mask,
    n_mask,
    rc * R_PER,
    rc * R_PER + R_PER,
    R,
    R,
    N,
    BLOCK_KV,
    EVEN_R,
    True,
  )
  if ROW_SCALE:
    acc = acc * rs[:, None]
  splitr_finish(
    acc, nb, b_ptr, acc_ptr, sem_ptr, o_ptr, offs_m, m_mask, offs_n, n_mask, N, N_CHUNKS, HAS_BIAS
  )


@triton.jit
def splitr_finish(
  acc,  # [BM, BN] f32: this chunk's part of an output tile
  nb,
  b_ptr,
  acc_ptr,
  sem_ptr,
  o_ptr,
  offs_m,
  m_mask,
  offs_n,
  n_mask,
  N: tl.constexpr,
  N_CHUNKS: tl.constexpr,
  HAS_BIAS: tl.constexpr,
):
  """splitr_out_tile's end: with one chunk the tile is stored; else f32 atomics into acc and
  the last chunk to arrive for column block nb adds the bias and writes the output."""
  off = offs_m[:, None] * N + offs_n[None, :]
  mask = m_mask[:, None] & n_mask[None, :]
  if N_CHUNKS == 1:
    store_out(acc, b_ptr, o_ptr, off, mask, offs_n, n_mask, HAS_BIAS)
  else:
    tl.atomic_add(acc_ptr + off, acc, mask=mask, sem="relaxed")
    if last_arrival(sem_ptr + nb, N_CHUNKS):
      store_out(
        tl.load(acc_ptr + off, mask=mask, other=0.0, cache_modifier=".cg"),
        b_ptr,
        o_ptr,
        off,
        mask,
        offs_n,
        n_mask,
        HAS_BIAS,
      )


@triton.jit
def store_out(
  acc,  # [BM, BN] f32 output tile
  b_ptr,
  o_ptr,
  off,
  mask,  # bias [N] (or the residual [M, N]); output and the tile's offsets and mask in it
  offs_n,
  n_mask,
  HAS_BIAS: tl.constexpr,  # 0: none, 1: bias, RESIDUAL: b_ptr is a residual [M, N]
):
  """o[off] = acc (+ bias[offs_n]) in o's dtype: a Y = A·V tile's epilogue. With a residual
  the tile is rounded to o's dtype first, then added to the residual in f32 and rounded
  again: what XLA computes for ``residual + y``."""
  if HAS_BIAS == RESIDUAL:
    y = acc.to(o_ptr.dtype.element_ty).to(tl.float32)
    acc = y + tl.load(b_ptr + off, mask=mask, other=0.0).to(tl.float32)
  elif HAS_BIAS:
    acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
  tl.store(o_ptr + off, acc.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def prefetch_l2(
  ptr,  # [n_rows, LD] row-major 2-byte matrix
  row0,
  col0,
  n_rows,
  n_cols,
  LD: tl.constexpr,
  ROWS: tl.constexpr,
  WIDTH: tl.constexpr,
):
  """Asks L2 to fetch ROWS x WIDTH elements from (row0, col0) (one address per 128-byte
  line), kept at evict_last priority. The asm is impure, so it is not removed."""
  rows = row0 + tl.arange(0, ROWS)
  cols = col0 + tl.arange(0, WIDTH // 64) * 64
  mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
  tl.inline_asm_elementwise(
    "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; "
    "mov.u32 $0, 0; }",
    "=r,l,r",
    [ptr + rows[:, None] * LD + cols[None, :], mask.to(tl.int32)],
    dtype=tl.int32,
    is_pure=False,
    pack=1,
  )


@triton.jit
def swiglu_epilogue(
  acc_g,
  acc_u,
  bg_ptr,
  bu_ptr,
  offs_f,
  f_mask,
  GATED: tl.constexpr,
  ACT: tl.constexpr,
  HAS_BG: tl.constexpr,
  HAS_BU: tl.constexpr,
):
  """h = act(Pg·Vg + bg) ⊙ (Pu·Vu + bu) of one tile of the intermediate (act(Pu·Vu + bu)
  when not GATED), from the f32 accumulators (both MLP kernels)."""
  if GATED:
    if HAS_BG:
      acc_g += tl.load(bg_ptr + offs_f, mask=f_mask, other=0.0).to(tl.float32)[None, :]
  if HAS_BU:
    acc_u += tl.load(bu_ptr + offs_f, mask=f_mask, other=0.0).to(tl.float32)[None, :]
  if GATED:
    h = activation(acc_g, ACT) * acc_u
  else:
    h = activation(acc_u, ACT)
  return h


_PHASE_SHIFT, _M_SHIFT = 28, 14  # a prefill tile code: phase << 28 | row block << 14 | column


def tile_codes(xp, phase: int, mb0: int, g: int, width: int, rows_fastest: bool):
  """Codes of one phase over row blocks [mb0, mb0+g) x column blocks [0, width).

  ``xp`` is numpy or jax.numpy. Under jit, jnp.arange is an iota, so the schedule is
  built from ops rather than captured as an array constant.
  """
  i = xp.arange(g * width, dtype=xp.int32)
  mb, j = (mb0 + i % g, i // g) if rows_fastest else (mb0 + i // width, i % width)
  return (phase << _PHASE_SHIFT) | (mb << _M_SHIFT) | j


@triton.jit
def ring_tile(code, M, G: tl.constexpr, RING: tl.constexpr, BLOCK_M: tl.constexpr):
  """Decodes a persistent-schedule tile code (xuv_prefill.tile_codes: phase << 28 |
  row block << 14 | column block). Returns the phase, the row block, its rows and row mask,
  the rows of its strip in a ring of RING slots of G row blocks, and the column block."""
  phase = code >> 28
  mb = (code >> 14) & 16383
  offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
  rows = ((mb // G) % RING) * (G * BLOCK_M) + (mb % G) * BLOCK_M + tl.arange(0, BLOCK_M)
  return phase, mb, offs_m, offs_m < M, rows, code & 16383


@triton.jit
def xu_tile(
  rb,
  k_start,  # column block of U, first row of K
  x_ptr,
  u_ptr,
  p_ptr,
  flag_ptr,
  offs_m,
  m_mask,
  K: tl.constexpr,
  R: tl.constexpr,
  K_PER: tl.constexpr,
  RB_PER_CHUNK: tl.constexpr,
  BLOCK_K: tl.constexpr,
  BLOCK_R: tl.constexpr,
  COLS_R: tl.constexpr,
  EVEN_K: tl.constexpr,
  STREAM: tl.constexpr,
  P16: tl.constexpr,
  p16_ptr,
  rb_cnt_ptr,
  SPLIT_K: tl.constexpr,
  P_STORE: tl.constexpr = False,
  SIGNAL: tl.constexpr = True,
  NORM: tl.constexpr = False,
  g_ptr=None,  # with NORM: X·g streamed (mm_acc); r-block 0's tiles add X's squares to sq_ptr
  sq_ptr=None,
):
  """One split-K tile of P = X·U (the decode X·U·V kernels' phase 1): f32 atomics into P,
  then its r-chunk's counter (release). P16: the last of the column block's SPLIT_K tiles
  (``last_arrival`` on its counter) rounds the block once into p16 (V's dtype) and alone
  signals the chunk. SIGNAL=False (phase 1 alone: no phase-2 tile waits on the chunk) leaves
  the counter alone, since a release makes the CTA wait for its atomics. Timing probes (the
  output is then wrong): STREAM=False skips the streaming, P_STORE stores the partial
  instead of adding it."""
  offs_r = rb * COLS_R + tl.arange(0, BLOCK_R)
  r_mask = offs_r < R
  if COLS_R < BLOCK_R:
    r_mask = r_mask & (tl.arange(0, BLOCK_R) < COLS_R)
  if STREAM:
    acc = tl.zeros([offs_m.shape[0], BLOCK_R], tl.float32)
    acc = mm_acc(
      acc,
      x_ptr,
      u_ptr,
      offs_m,
      offs_r,
      m_mask,
      r_mask,
      k_start,
      k_start + K_PER,
      K,
      K,
      R,
      BLOCK_K,
      EVEN_K,
      False,
      NORM,
      g_ptr,
      sq_ptr,
      rb == 0,
    )
    if P_STORE:
      tl.store(
        p_ptr + offs_m[:, None] * R + offs_r[None, :], acc, mask=m_mask[:, None] & r_mask[None, :]
      )
    else:
      tl.atomic_add(
        p_ptr + offs_m[:, None] * R + offs_r[None, :],
        acc,
        mask=m_mask[:, None] & r_mask[None, :],
        sem="relaxed",
      )
  if P16:
    if last_arrival(rb_cnt_ptr + rb, SPLIT_K):
      round_once(
        p_ptr, p16_ptr, offs_m[:, None] * R + offs_r[None, :], m_mask[:, None] & r_mask[None, :]
      )
      if SIGNAL:
        signal(flag_ptr + rb // RB_PER_CHUNK)
  elif SIGNAL:
    signal(flag_ptr + rb // RB_PER_CHUNK)


@triton.jit
def pv_tile(
  q,
  n_nb,
  n_rb,
  p_ptr,
  v_ptr,
  b_ptr,
  acc_ptr,
  flag_ptr,
  sem_ptr,
  o_ptr,
  M,
  R: tl.constexpr,
  N: tl.constexpr,
  HAS_BIAS: tl.constexpr,
  SPLIT_K: tl.constexpr,
  R_CHUNKS: tl.constexpr,
  RB_PER_CHUNK: tl.constexpr,
  BLOCK_M: tl.constexpr,
  BLOCK_N: tl.constexpr,
  BLOCK_KV: tl.constexpr,
  EVEN_R: tl.constexpr,
  COLS_R: tl.constexpr,
  COLS_N: tl.constexpr,
  P16: tl.constexpr,
  trace_ptr,
  TRACE: tl.constexpr,
  SIGNALS: tl.constexpr = 0,
):
  """Tile q of Y = P·V (chunk-major; the decode X·U·V kernels' phase 2): waits until its
  r-chunk of P is complete (P16: p_ptr is the rounded copy, one signal per column block, not
  one per split-K tile; SIGNALS > 0: one chunk, complete after that many signals). TRACE:
  ``stamp`` slot 2 when the wait ends (timing only)."""
  rc = q // n_nb
  n_rb_c = tl.minimum(n_rb - rc * RB_PER_CHUNK, RB_PER_CHUNK)
  if SIGNALS > 0:
    wait_at_least(flag_ptr, SIGNALS)
  elif P16:
    wait_at_least(flag_ptr + rc, n_rb_c)
  else:
    wait_at_least(flag_ptr + rc, n_rb_c * SPLIT_K)
  stamp(trace_ptr, 2, TRACE)
  splitr_out_tile(
    q % n_nb,
    rc,
    p_ptr,
    v_ptr,
    b_ptr,
    acc_ptr,
    sem_ptr,
    o_ptr,
    M,
    R,
    N,
    RB_PER_CHUNK * COLS_R,
    R_CHUNKS,
    HAS_BIAS,
    BLOCK_M,
    BLOCK_N,
    BLOCK_KV,
    EVEN_R,
    COLS_N,
  )
