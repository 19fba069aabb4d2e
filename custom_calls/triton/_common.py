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
):
  """acc += A[offs_m, k_start:k_end] @ B[k_start:k_end, offs_n], software-pipelined."""
  offs_k = tl.arange(0, BK)
  for k0 in range(k_start, k_end, BK):
    kk = k0 + offs_k
    a_ptrs = a_ptr + offs_m[:, None] * LDA + kk[None, :]
    b_ptrs = b_ptr + kk[:, None] * LDB + offs_n[None, :]
    a_m, b_m = k_masks(m_mask, n_mask, kk, K, EVEN_K)
    if A_CG:
      a = tl.load(a_ptrs, mask=a_m, other=0.0, cache_modifier=".cg")
    else:
      a = tl.load(a_ptrs, mask=a_m, other=0.0)
    b = tl.load(b_ptrs, mask=b_m, other=0.0)
    acc = tl.dot(a.to(b.dtype), b, acc)
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
):
  """acc1 += A1 @ B1 and acc2 += A2 @ B2 in one pass (SHARED_A: A1 is A2, loaded once)."""
  offs_k = tl.arange(0, BK)
  for k0 in range(k_start, k_end, BK):
    kk = k0 + offs_k
    a_off = offs_m[:, None] * LDA + kk[None, :]
    b_off = kk[:, None] * LDB + offs_n[None, :]
    a_m, b_m = k_masks(m_mask, n_mask, kk, K, EVEN_K)
    if A_CG:
      a1 = tl.load(a1_ptr + a_off, mask=a_m, other=0.0, cache_modifier=".cg")
    else:
      a1 = tl.load(a1_ptr + a_off, mask=a_m, other=0.0)
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
  at slot 0 also its SM (%smid) into slot 7 (benchmarks/decode_trace.py reads them)."""
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
  registers (gpu_notes.md, session 18).

  PDL: the kernel was launched as a programmatic dependent (launch.py), so its CTAs may
  start before the kernel ahead of it on the stream has finished. ``gdc_wait`` holds them
  until that kernel has completed and its writes are visible; every load of activations or
  scratch after it is ordered as in a plain launch. The kernel never calls
  ``gdc_launch_dependents``: the next PDL launch starts as this one's CTAs exit, which
  measured better than an early trigger (results/gpu_pdl_probe_h200.json)."""
  if PDL:
    tl.extra.cuda.gdc_wait()
  return scratch_ptr + WORK_OFF


@triton.jit
def leave_chain(scratch_ptr, clear_off, clear_n, FIRST: tl.constexpr = 0, COUNT: tl.constexpr = 0):
  """A chained kernel's last step: zeroes this program's share of the half the call before it
  used (``clear_n`` floats at ``clear_off``), for the call after it; nothing in this launch
  reads that half. At the end its stores overlap the other programs' tails; at entry they
  came before the first loads and cost up to 0.4 µs a call (gpu_notes.md, session 19).
  COUNT > 0: programs [FIRST, FIRST + COUNT) share the zeroing and the others skip it, where
  those programs are done early and the others end the call (gpu_notes.md, session 25)."""
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
  mask,  # bias [N]; output and the tile's offsets and mask in it
  offs_n,
  n_mask,
  HAS_BIAS: tl.constexpr,
):
  """o[off] = acc (+ bias[offs_n]) in o's dtype: a Y = A·V tile's epilogue."""
  if HAS_BIAS:
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
