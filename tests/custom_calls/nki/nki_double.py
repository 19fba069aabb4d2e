"""NkiDouble: a numpy TEST DOUBLE of the NKI API subset the lrjax kernels use.

This is not the Neuron compiler, not AWS's ``nki.simulate`` and not hardware. It
executes the kernel functions of ``lrjax.custom_calls.nki`` eagerly in numpy and
enforces the documented NKI rules those kernels rely on (NKI 0.7 / Neuron SDK 2.33
destination-passing API), so dataflow, tile limits and on-chip capacity are checked
on any CPU. It says nothing about timing, instruction scheduling, bank alignment,
engine overlap or whether neuronx-cc accepts the kernel.

Rules enforced (each raises :class:`NkiRuleError`):
  * SBUF/PSUM tensors have >= 2 dims and a partition dim (dim 0) <= 128.
  * ``nc_matmul``: stationary and moving in SBUF, dst in PSUM and float32;
    dst = stationary.T @ moving, i.e. both share the partition dim (the contraction,
    <= 128), stationary free <= 128, moving free <= 512, dst [stat free, moving free];
    accumulates in f32 (one PSUM bank: dst free bytes <= 2 KiB).
  * ``dma_copy`` / ``dma_transpose`` move data only between HBM and SBUF (no PSUM,
    no SBUF->SBUF, no casting); DMA transpose needs a 2-byte dtype.
  * Engine ops (tensor_copy, activation, tensor_tensor, tensor_scalar, memset) work on
    SBUF/PSUM only; tensor_scalar's operand is a scalar or a [partitions, 1] vector tile.
  * Capacity: live SBUF <= 192 KiB per partition (24 MiB), live PSUM <= 8 banks of
    2 KiB per partition (2 MiB). An allocation reserves its free-dim bytes on every
    partition. One buffer per allocation site: a new ``nl.ndarray`` at the same
    source line releases the previous one, and touching the released tile raises
    (what a single-buffered NKI allocation means). Buffers are also released when
    Python drops the last reference.

Counters: HBM bytes read (per kernel argument) and written, tensor-engine flops,
peak SBUF/PSUM bytes. ``execute=False`` runs the same control flow and checks on
zero-stride dummies without arithmetic (to count traffic at the paper's shapes).
"""

from __future__ import annotations

import collections
import functools
import inspect
import itertools
import math
import sys
import types
import weakref

import ml_dtypes
import numpy as np

SBUF, PSUM, HBM = "sbuf", "psum", "hbm"
PMAX = 128
STATIONARY_FMAX = 128
MOVING_FMAX = 512
SBUF_PARTITION_BYTES = 24 * 2**20 // PMAX
PSUM_BANK_BYTES = 2048
PSUM_BANKS = 8
_MATMUL_DTYPES = {np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)}


class NkiRuleError(Exception):
  """A kernel broke one of the NKI rules the double enforces."""


class _Alloc:
  __slots__ = ("id", "buffer", "pp_bytes", "banks", "site", "name", "alive", "__weakref__")

  def __init__(self, id_, buffer, pp_bytes, site, name):
    self.id, self.buffer, self.pp_bytes, self.site, self.name = id_, buffer, pp_bytes, site, name
    self.banks = -(-pp_bytes // PSUM_BANK_BYTES) if buffer == PSUM else 0
    self.alive = True


class Tensor:
  """A tensor (or a view of one) on HBM, SBUF or PSUM."""

  __slots__ = ("arr", "buffer", "alloc")

  def __init__(self, arr, buffer, alloc):
    self.arr, self.buffer, self.alloc = arr, buffer, alloc

  @property
  def shape(self):
    return self.arr.shape

  @property
  def dtype(self):
    return self.arr.dtype

  @property
  def nbytes(self) -> int:
    return int(self.arr.size) * self.arr.dtype.itemsize

  def __getitem__(self, idx):
    return Tensor(self.arr[idx], self.buffer, self.alloc)

  def __repr__(self):
    return (
      f"Tensor({self.buffer}, {self.shape}, {self.dtype}, {self.alloc.name or self.alloc.site})"
    )


def _silu(x):
  return x / (1.0 + np.exp(-x))


def _gelu_tanh(x):
  return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def _gelu(x):
  from math import erf

  return 0.5 * x * (1.0 + np.vectorize(erf, otypes=[np.float64])(x / np.sqrt(2.0)))


def _relu(x):
  return np.maximum(x, 0.0)


def _copy(x):
  return x


class NkiDouble:
  """One double instance = one NeuronCore's worth of counters; ``nki``, ``nl``, ``nisa`` attrs."""

  def __init__(self, execute: bool = True):
    self.execute = execute
    self._ids = itertools.count()
    self._meta: dict[
      int, tuple[str, int, int]
    ] = {}  # live allocation id -> (buffer, bytes/partition, banks)
    self._sites: dict[tuple, weakref.ref] = {}  # allocation site -> its current buffer
    self.reset()
    self.nki = types.SimpleNamespace(jit=self.jit)
    self.nl = types.SimpleNamespace(
      ndarray=self.ndarray,
      sbuf=SBUF,
      psum=PSUM,
      hbm=HBM,
      shared_hbm=HBM,
      private_hbm=HBM,
      affine_range=range,
      sequential_range=range,
      static_range=range,
      float32=np.dtype(np.float32),
      float16=np.dtype(np.float16),
      bfloat16=np.dtype(ml_dtypes.bfloat16),
      tile_size=types.SimpleNamespace(
        pmax=PMAX,
        gemm_stationary_fmax=STATIONARY_FMAX,
        gemm_moving_fmax=MOVING_FMAX,
        psum_fmax=MOVING_FMAX,
      ),
      silu=_silu,
      gelu_apprx_tanh=_gelu_tanh,
      gelu=_gelu,
      relu=_relu,
      copy=_copy,
      multiply=np.multiply,
      add=np.add,
    )
    self.nisa = types.SimpleNamespace(
      nc_matmul=self.nc_matmul,
      dma_copy=self.dma_copy,
      dma_transpose=self.dma_transpose,
      tensor_copy=self.tensor_copy,
      activation=self.activation,
      tensor_tensor=self.tensor_tensor,
      tensor_scalar=self.tensor_scalar,
      memset=self.memset,
    )

  # ------------------------------------------------------------------ counters
  def reset(self):
    """Zeroes the counters (live on-chip buffers are kept)."""
    self.hbm_read_bytes = 0
    self.hbm_write_bytes = 0
    self.reads_by_arg = collections.Counter()
    self.flops = 0
    self.matmuls = 0
    self.live_pp = {SBUF: 0, PSUM: 0}
    self.live_banks = 0
    self.peak_sbuf_pp = 0
    self.peak_psum_banks = 0
    for buffer, pp, banks in self._meta.values():
      self.live_pp[buffer] += pp
      self.live_banks += banks

  @property
  def peak_sbuf_bytes(self) -> int:
    return PMAX * self.peak_sbuf_pp

  # ------------------------------------------------------------------ nki.jit
  def jit(self, fn=None, **_kw):
    if fn is None:
      return functools.partial(self.jit, **_kw)
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def run(*args, **kwargs):
      bound = sig.bind(*args, **kwargs)
      for name, val in list(bound.arguments.items()):
        if isinstance(val, ShapeOnly) or (hasattr(val, "__array__") and hasattr(val, "shape")):
          bound.arguments[name] = self._hbm_input(val, name)  # numpy or jax arrays
      out = fn(*bound.args, **bound.kwargs)
      if isinstance(out, tuple):
        return tuple(self._result(o) for o in out)
      return self._result(out)

    run.double = self
    return run

  def _hbm_input(self, val, name):
    if isinstance(val, ShapeOnly):
      arr = np.broadcast_to(np.zeros((), val.dtype), val.shape)
    else:
      val = np.asarray(val)
      arr = (
        np.ascontiguousarray(val)
        if self.execute
        else np.broadcast_to(np.zeros((), val.dtype), val.shape)
      )
    return Tensor(arr, HBM, _Alloc(next(self._ids), HBM, 0, None, name))

  def _result(self, t):
    if not isinstance(t, Tensor) or t.buffer != HBM:
      raise NkiRuleError(f"a kernel returns HBM tensors; got {t!r}")
    return np.array(t.arr) if self.execute else ShapeOnly(t.shape, t.dtype)

  # ------------------------------------------------------------------ nl.ndarray
  def ndarray(self, shape, dtype, buffer=SBUF, name=""):
    shape = tuple(int(s) for s in shape)
    dtype = np.dtype(dtype)
    if buffer == HBM:
      arr = np.zeros(shape, dtype) if self.execute else np.broadcast_to(np.zeros((), dtype), shape)
      return Tensor(arr, HBM, _Alloc(next(self._ids), HBM, 0, None, name or "out"))
    if buffer not in (SBUF, PSUM):
      raise NkiRuleError(f"unknown buffer {buffer!r}")
    if len(shape) < 2:
      raise NkiRuleError(f"{buffer} tensor {shape=} needs a partition dim and a free dim")
    if not 1 <= shape[0] <= PMAX:
      raise NkiRuleError(f"{buffer} tensor {shape=}: partition dim {shape[0]} must be in 1..{PMAX}")
    frame = sys._getframe(1)
    site = (buffer, frame.f_code.co_filename, frame.f_lineno)
    old = self._sites.get(site)
    old = old() if old is not None else None
    if old is not None:
      old.alive = False
      self._release(old.id)
    alloc = _Alloc(next(self._ids), buffer, math.prod(shape[1:]) * dtype.itemsize, site[1:], name)
    if buffer == SBUF and self.live_pp[SBUF] + alloc.pp_bytes > SBUF_PARTITION_BYTES:
      raise NkiRuleError(
        f"SBUF over capacity: {self.live_pp[SBUF] + alloc.pp_bytes} live bytes per "
        f"partition > {SBUF_PARTITION_BYTES} (24 MiB / 128) when allocating "
        f"{shape} {dtype}"
      )
    if buffer == PSUM and self.live_banks + alloc.banks > PSUM_BANKS:
      raise NkiRuleError(
        f"PSUM over capacity: {self.live_banks + alloc.banks} banks live > "
        f"{PSUM_BANKS} (2 KiB per partition each) when allocating {shape} {dtype}"
      )
    self._meta[alloc.id] = (buffer, alloc.pp_bytes, alloc.banks)
    self._sites[site] = weakref.ref(alloc)
    self.live_pp[buffer] += alloc.pp_bytes
    self.live_banks += alloc.banks
    weakref.finalize(alloc, self._release, alloc.id)
    self.peak_sbuf_pp = max(self.peak_sbuf_pp, self.live_pp[SBUF])
    self.peak_psum_banks = max(self.peak_psum_banks, self.live_banks)
    arr = np.zeros(shape, dtype) if self.execute else np.broadcast_to(np.zeros((), dtype), shape)
    return Tensor(arr, buffer, alloc)

  def _release(self, alloc_id):
    meta = self._meta.pop(alloc_id, None)
    if meta is not None:
      self.live_pp[meta[0]] -= meta[1]
      self.live_banks -= meta[2]

  # ------------------------------------------------------------------ checks
  @staticmethod
  def _t(name, t):
    if not isinstance(t, Tensor):
      raise NkiRuleError(f"{name} must be an NKI tensor, got {type(t).__name__}")
    if t.buffer != HBM and not t.alloc.alive:
      raise NkiRuleError(f"{name} {t!r} is used after its buffer was reallocated or freed")
    return t

  def _on_chip(self, name, t):
    self._t(name, t)
    if t.buffer == HBM:
      raise NkiRuleError(
        f"{name} is on HBM; compute engines read and write SBUF/PSUM only "
        "(load it with dma_copy first)"
      )
    return t

  def _write(self, dst, value):
    if self.execute:
      dst.arr[...] = np.asarray(value).astype(dst.dtype)

  # ------------------------------------------------------------------ nki.isa
  def nc_matmul(
    self,
    dst,
    stationary,
    moving,
    is_stationary_onezero=False,
    is_moving_onezero=False,
    is_transpose=False,
    accumulate=None,
    **_kw,
  ):
    for name, t in (("stationary", stationary), ("moving", moving)):
      self._t(name, t)
      if t.buffer != SBUF:
        raise NkiRuleError(f"nc_matmul {name} must be in SBUF, got {t.buffer}")
      if t.arr.ndim != 2:
        raise NkiRuleError(f"nc_matmul {name} must be a 2-D tile, got {t.shape}")
      if t.dtype not in _MATMUL_DTYPES:
        raise NkiRuleError(f"nc_matmul {name}.dtype={t.dtype} not supported")
    self._t("dst", dst)
    if dst.buffer != PSUM:
      raise NkiRuleError(f"nc_matmul writes PSUM; dst is on {dst.buffer}")
    if dst.dtype != np.float32:
      raise NkiRuleError(f"PSUM accumulates in float32; dst.dtype={dst.dtype}")
    if stationary.dtype != moving.dtype:
      raise NkiRuleError(f"stationary {stationary.dtype} and moving {moving.dtype} differ")
    k, m = stationary.shape
    k2, n = moving.shape
    if k != k2:
      raise NkiRuleError(
        f"nc_matmul contracts over the partition dim: stationary {stationary.shape}"
        f" and moving {moving.shape} must share dim 0 (pass the stationary transposed)"
      )
    if k > PMAX:
      raise NkiRuleError(f"contraction (partition) size {k} > {PMAX}")
    if m > STATIONARY_FMAX:
      raise NkiRuleError(f"stationary free size {m} > {STATIONARY_FMAX}")
    if n > MOVING_FMAX:
      raise NkiRuleError(f"moving free size {n} > {MOVING_FMAX}")
    if dst.shape != (m, n):
      raise NkiRuleError(f"nc_matmul dst {dst.shape} != (stationary free, moving free) {(m, n)}")
    if n * 4 > PSUM_BANK_BYTES:
      raise NkiRuleError(f"dst free bytes {n * 4} exceed one PSUM bank ({PSUM_BANK_BYTES})")
    self.flops += 2 * k * m * n
    self.matmuls += 1
    if self.execute:
      prod = stationary.arr.astype(np.float32).T @ moving.arr.astype(np.float32)
      if accumulate:
        dst.arr[...] += prod
      else:
        dst.arr[...] = prod

  def _dma_check(self, dst, src, what):
    self._t("dst", dst)
    self._t("src", src)
    pair = (src.buffer, dst.buffer)
    if pair not in ((HBM, SBUF), (SBUF, HBM)):
      raise NkiRuleError(
        f"{what}: DMA moves data only between HBM and SBUF; got {src.buffer}->{dst.buffer}"
      )
    if src.dtype != dst.dtype:
      raise NkiRuleError(f"{what}: DMA does not cast ({src.dtype} -> {dst.dtype})")

  def _count(self, src, dst):
    if src.buffer == HBM:
      self.hbm_read_bytes += src.nbytes
      self.reads_by_arg[src.alloc.name] += src.nbytes
    else:
      self.hbm_write_bytes += dst.nbytes

  def dma_copy(self, dst, src, **_kw):
    self._dma_check(dst, src, "dma_copy")
    if dst.shape != src.shape:
      raise NkiRuleError(f"dma_copy shapes differ: dst {dst.shape} src {src.shape}")
    self._count(src, dst)
    self._write(dst, src.arr)

  def dma_transpose(self, dst, src, axes=None, **_kw):
    self._dma_check(dst, src, "dma_transpose")
    if src.arr.ndim != 2 or axes not in (None, (1, 0)):
      raise NkiRuleError(f"the kernels use 2-D dma_transpose only; got {src.shape} {axes=}")
    if dst.shape != src.shape[::-1]:
      raise NkiRuleError(f"dma_transpose dst {dst.shape} != transposed src {src.shape[::-1]}")
    if src.dtype.itemsize != 2:
      raise NkiRuleError(f"DMA transpose moves 2-byte dtypes only; got {src.dtype}")
    self._count(src, dst)
    self._write(dst, src.arr.T)

  def tensor_copy(self, dst, src, **_kw):
    self._on_chip("dst", dst)
    self._on_chip("src", src)
    if dst.shape != src.shape:
      raise NkiRuleError(f"tensor_copy shapes differ: dst {dst.shape} src {src.shape}")
    self._write(dst, src.arr.astype(np.float32))

  def activation(self, dst, op, data, bias=None, scale=1.0, **_kw):
    self._on_chip("dst", dst)
    self._on_chip("data", data)
    if dst.shape != data.shape:
      raise NkiRuleError(f"activation shapes differ: dst {dst.shape} data {data.shape}")
    if self.execute:
      x = data.arr.astype(np.float64) * scale
      if bias is not None:
        self._on_chip("bias", bias)
        x = x + bias.arr.astype(np.float64)
      self._write(dst, op(x))

  def tensor_tensor(self, dst, data1, data2, op, **_kw):
    for name, t in (("dst", dst), ("data1", data1), ("data2", data2)):
      self._on_chip(name, t)
    if not dst.shape == data1.shape == data2.shape:
      raise NkiRuleError(f"tensor_tensor shapes differ: {dst.shape} {data1.shape} {data2.shape}")
    if data1.buffer == PSUM and data2.buffer == PSUM:
      raise NkiRuleError("tensor_tensor cannot read both operands from PSUM")
    if self.execute:
      self._write(dst, op(data1.arr.astype(np.float32), data2.arr.astype(np.float32)))

  def tensor_scalar(self, dst, data, op0, operand0, reverse0=False, **_kw):
    """dst = data <op0> operand0 in f32 (operand0: a scalar, or a [data partitions, 1] tile
    broadcast along the free dim), rounded to dst's dtype."""
    self._on_chip("dst", dst)
    self._on_chip("data", data)
    if dst.shape != data.shape:
      raise NkiRuleError(f"tensor_scalar shapes differ: dst {dst.shape} data {data.shape}")
    if isinstance(operand0, Tensor):
      self._on_chip("operand0", operand0)
      if operand0.shape != (data.shape[0], 1):
        raise NkiRuleError(
          f"tensor_scalar operand0 {operand0.shape} must be a vector ({data.shape[0]}, 1)"
        )
      opnd = operand0.arr.astype(np.float32).reshape((data.shape[0],) + (1,) * (data.arr.ndim - 1))
    else:
      opnd = np.float32(operand0)
    if self.execute:
      a = data.arr.astype(np.float32)
      self._write(dst, op0(opnd, a) if reverse0 else op0(a, opnd))

  def memset(self, dst, value, **_kw):
    self._on_chip("dst", dst)
    if self.execute:
      dst.arr[...] = value


class ShapeOnly:
  """An HBM argument with a shape and dtype but no data (for ``execute=False``)."""

  def __init__(self, shape, dtype):
    self.shape = tuple(shape)
    self.dtype = np.dtype(dtype)
