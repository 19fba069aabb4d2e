"""How lrjax's Triton kernels are launched: the lowering rule of their jax-triton calls.

jax-triton compiles a kernel and lowers ``jax_triton.triton_call`` to jaxlib's legacy
``triton_kernel_call`` custom call, which XLA does not record into its command buffers (each
call left the GPU idle for 1-2 µs before the next kernel). ``triton_call`` here is
``jax_triton.triton_call`` with a target name that this module's lowering rule recognises:
it lets jax-triton compile and lower the call as usual, then replaces the legacy op with one
of the launchers below (``launch_modes.launch_mode``, ``LRJAX_TRITON_LAUNCH``, read when a
call is lowered). Every other jax-triton call keeps jax-triton's own lowering.

- ``jaxlib``: jaxlib's typed-FFI handler ``triton_kernel_call_ffi`` (command-buffer
  compatible; it parses the kernel-call proto once). ``LRJAX_TRITON_LEGACY_CALL=1`` keeps the
  legacy op; so does a jaxlib without the FFI target (<= 0.10.2).
- ``lrjax`` / ``pdl``: lrjax's own handler, ``lrjax_triton_launch`` (pdl_launch.cc, a small
  C++ library built with the package), which launches the same compiled kernel with
  cuLaunchKernelEx and, under ``pdl``, for kernels that take a ``PDL`` constexpr, as
  programmatic dependents: their CTAs start while the kernel ahead drains and wait in
  ``gdc_wait`` (_common.join_chain). The kernel's PTX, entry, shared memory and warps travel
  as attributes of the custom call with a content hash the handler caches the loaded
  function under, so compiled executables do not depend on the process that built them.
- ``xla``: XLA's own PTX call, ``__gpu$xla.gpu.ptx``. The kernel is compiled with Triton here,
  every scalar argument (the rows M, the chain's offsets) a constant so the entry takes the
  buffers alone, and XLA launches it as one of its own kernels, possibly as a programmatic
  dependent (the chained kernels wait on the grid dependency at entry). Calls with a memset
  before the launch (``zeroed_outputs``) and kernels that need Triton's global scratch stay
  with jaxlib's handler.
- ``xla_triton`` (the default on jaxlib 0.11.x from 0.11.2): as ``xla``, but the kernels and
  plans ``launch_modes.xla_triton_serves`` names go to XLA's Triton call,
  ``__gpu$xla.gpu.triton``, as Triton's frontend TTIR, which XLA compiles with its own Triton.

**The scratch chain.** The decode kernels count and accumulate in an f32 scratch buffer that
must be zero at launch. Zeroed per call by an XLA op, that is one ~1 µs kernel a call.
Instead, calls in one MLIR block share one buffer of two halves: each works in one half and
zeroes the half the call before it used (``_common.leave_chain``, a few stores a CTA at its
end), so the buffer goes from call to call through XLA's in-place aliasing and is zeroed by
XLA once, where a chain starts. A kernel takes part if it has the ``clear_off, clear_n``
arguments (passed as ``UNCHAINED``) and the ``WORK_OFF`` constexpr (a constexpr, not a runtime
offset, which cost the kernels registers), and its zeroed scratch is the input aliased to
output 0. A chained kernel compiles once for each half. ``LRJAX_TRITON_SCRATCH_CHAIN=0``
(``launch_modes.chain_scratch``) zeroes per call. A chained call's scratch output is the
slice of the buffer it worked in; a kernel that takes a ``READ_OFF`` constexpr (the decode
X·U·V's ·V launch) reads such a slice in the buffer itself at that offset
(``_read_in_place``), where XLA would copy it out first.

**Kernels jaxlib's handler cannot launch.** A kernel that builds TMA descriptors on the device
(``tl.make_tensor_descriptor``) needs Triton's global scratch (bytes a CTA), and one whose loop
Triton warp-specialized launches more warps than ``num_warps``. jax-triton drops that part of
Triton's compile metadata; ``_compile_checked`` keeps it (``Image``), and such kernels go to
lrjax's handler under every mode, with the scratch as one more result of the custom call.

jax-triton does not check a compiled kernel's shared memory against the GPU's, so block sizes
that ask for too much would fail only at launch. While it compiles one of our calls, its
compile step is wrapped so that ``planner.check_cta_smem`` raises a ValueError at lowering,
naming the kernel and its needs.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import importlib.metadata
import os
import re
import struct
import threading

import jax
import jax_triton as jt
import jaxlib.version
import numpy as np
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo
from jax.interpreters import mlir
from jax_triton import triton_lib

from lrjax.custom_calls.triton import launch_modes, planner
from lrjax.custom_calls.triton.launch_modes import (  # noqa: F401  (count_calls: re-exported)
  FFI_TARGET,
  LAUNCH_TARGET,
  LEGACY_TARGET,
  XLA_TARGET,
  XLA_TRITON_TARGET,
  count_calls,
)

_REQUEST = "lrjax_triton_kernel_call"  # the name our calls pass; never reaches XLA
PDL = "PDL"  # the constexpr of kernels that may be launched as programmatic dependents
LAUNCHER_LIB = "_pdl_launch.so"
launch_mode = launch_modes.launch_mode


def _launcher_paths() -> list[str]:
  """Where pdl_launch.cc's library may be: $LRJAX_TRITON_LAUNCHER, beside this file (a build
  in the source tree), or among the installed package's files (wheel or editable install)."""
  paths = [
    os.environ.get("LRJAX_TRITON_LAUNCHER", ""),
    os.path.join(os.path.dirname(os.path.abspath(__file__)), LAUNCHER_LIB),
  ]
  try:
    paths += [
      str(f.locate()) for f in importlib.metadata.files("lrjax") or () if f.name == LAUNCHER_LIB
    ]
  except importlib.metadata.PackageNotFoundError:
    pass
  return [p for p in paths if p]


@functools.cache
def launcher():
  """pdl_launch.cc's library (ctypes), its FFI target registered for CUDA; raises a
  RuntimeError naming the places looked in when it is not built."""
  for path in _launcher_paths():
    if os.path.exists(path):
      lib = ctypes.CDLL(path)
      lib.lrjax_triton_launch_driver_error.restype = ctypes.c_char_p
      jax.ffi.register_ffi_target(
        LAUNCH_TARGET, jax.ffi.pycapsule(lib.LrjaxTritonLaunch), platform="CUDA"
      )
      return lib
  raise RuntimeError(
    f"LRJAX_TRITON_LAUNCH={launch_mode()} needs lrjax's Triton launcher ({LAUNCHER_LIB}), "
    f"found in none of {_launcher_paths()}: it is built with the package when Triton's "
    "CUDA headers are importable at build time, so install triton first and then lrjax "
    "with `pip install --no-build-isolation '.[cuda]'` (or point LRJAX_TRITON_LAUNCHER at "
    "a build of custom_calls/triton/pdl_launch.cc)"
  )


def use_ffi() -> bool:
  return jaxlib.version.__version_info__ > (0, 10, 2) and os.environ.get(
    "LRJAX_TRITON_LEGACY_CALL", ""
  ) in ("", "0")


def xla_zeroing() -> bool:
  """Whether a decode kernel's scratch is zeroed by an XLA op aliased into the call (the
  default) or by jax-triton's memset inside it (``LRJAX_TRITON_SCRATCH_MEMSET=1``, read
  when a call is traced). In the Llama-3-8B decode step on the H200 both cost about 1 µs a
  call."""
  return os.environ.get("LRJAX_TRITON_SCRATCH_MEMSET", "") in ("", "0")


def triton_call(*args, kernel, **kwargs):
  """``jax_triton.triton_call``, launched by jaxlib's typed-FFI target where available, or by
  lrjax's own (``launch_mode``)."""
  if "custom_call_target_name" in kwargs:
    raise TypeError("lrjax chooses the custom-call target of its kernels")
  return jt.triton_call(
    *args, kernel=kernel, custom_call_target_name=_REQUEST, **launch_constexprs(kernel, kwargs)
  )


def launch_constexprs(kernel, meta: dict) -> dict:
  """``meta`` with WORK_OFF, PDL and READ_OFF at 0 where the kernel takes them and ``meta``
  does not (unchained, a plain launch; the lowering may move them: _chain, _lowering,
  _read_in_place). Every other constexpr of the kernel must be named: jax-triton passes a
  kernel only what its launch names, never a signature default (Triton reads a missing one as
  None), so one missing is a ValueError here rather than a compile error on the GPU."""
  names = getattr(kernel, "arg_names", ())
  meta = {**{k: 0 for k in (WORK_OFF, PDL, READ_OFF) if k in names}, **meta}
  missing = [p.name for p in getattr(kernel, "params", ()) if p.is_constexpr and p.name not in meta]
  if missing:
    raise ValueError(
      f"{getattr(kernel, '__name__', kernel)}: its launch names no value for "
      f"the constexprs {missing}; jax-triton passes no signature default"
    )
  return meta


SCRATCH_ARGS = ("clear_off", "clear_n")
UNCHAINED = (0, 0)  # those arguments as a call passes them: it zeroes nothing
WORK_OFF = "WORK_OFF"  # the constexpr offset of the call's half (0: the scratch's start)
READ_OFF = "READ_OFF"  # the constexpr offset at which a kernel reads its first operand
_CHAIN_KEY = ("lrjax.custom_calls.triton.launch", "scratch chains")


@dataclasses.dataclass
class _Link:
  block: object  # the MLIR block the chain runs in
  buf: object  # its buffer as the last call left it: f32[2 * half]
  half: int
  parity: int  # the half the last call worked in
  dirty: int  # floats of that half it used


def _chain(ctx, array_args, params):
  """(ctx, args, params, finish) to launch this call on its block's chained scratch, or None
  where it cannot take part (see the module docstring); finish(results) records the call's
  scratch output as the chain's and gives the results the call's own avals, its scratch
  output as the half it worked in (xuv_decode reads its f32 P there)."""
  fn = params["fn"]
  names = getattr(fn, "arg_names", ())
  by_name = {names[k]: k for k, _, _ in params["scalar_args"] if k < len(names)}
  if (
    not launch_modes.chain_scratch()
    or any(a not in by_name for a in SCRATCH_ARGS)
    or WORK_OFF not in params
  ):
    return None
  src = [i for i, o in params["input_output_aliases"] if o == 0]
  if len(src) != 1:  # no aliased scratch: jax-triton's memset zeroes it
    return None
  i = src[0]
  aval = ctx.avals_in[i]
  if aval.dtype != np.float32 or aval.ndim != 1 or ctx.avals_out[0] != aval:
    return None
  # the module's chains live as long as its lowering, in a dict jax keeps for that long
  links = getattr(ctx.module_context, "cached_primitive_lowerings", None)
  if links is None:
    return None
  try:
    block = ir.InsertionPoint.current.block
  except ValueError:  # no insertion point
    return None
  links = links.setdefault(_CHAIN_KEY, [])
  link = next((lk for lk in links if lk.block == block), None)
  need = aval.shape[0]
  fresh, half, parity, clear_n = launch_modes.next_link(
    None if link is None else (link.half, link.parity, link.dirty), need
  )
  big = aval.update(shape=(2 * half,))
  buf = (
    link.buf
    if not fresh
    else hlo.broadcast_in_dim(
      ir.RankedTensorType.get((2 * half,), ir.F32Type.get()),
      mlir.ir_constant(np.float32(0)),
      mlir.dense_int_array([]),
    )
  )
  args = list(array_args)
  args[i] = buf
  avals_in, avals_out = list(ctx.avals_in), list(ctx.avals_out)
  avals_in[i] = avals_out[0] = big
  values = {by_name["clear_off"]: (1 - parity) * half, by_name["clear_n"]: clear_n}
  scalars = tuple((k, t, values.get(k, v)) for k, t, v in params["scalar_args"])
  params = dict(params, scalar_args=scalars, **{WORK_OFF: parity * half})

  def finish(results):
    nonlocal link
    if link is None:
      link = _Link(block, None, half, parity, need)
      links.append(link)
    link.buf, link.half, link.parity, link.dirty = results[0], half, parity, need
    own = hlo.slice(
      results[0],
      mlir.dense_int_array([parity * half]),  # the half it used
      mlir.dense_int_array([parity * half + need]),
      mlir.dense_int_array([1]),
    )
    return [own, *results[1:]]

  return ctx.replace(avals_in=avals_in, avals_out=avals_out), args, params, finish


def _read_in_place(ctx, array_args, params):
  """(ctx, args, params) where a kernel that takes READ_OFF reads its first operand, a
  contiguous slice of a 1-D buffer (a chained call's half, from _chain's finish), in that
  buffer at the slice's offset: XLA would otherwise copy the slice out in a kernel of its own
  (``xuv_decode``'s ·V launch reads phase 1's f32 P so)."""
  if READ_OFF not in params or not array_args:
    return ctx, array_args, params
  owner = array_args[0].owner
  op = getattr(owner, "operation", owner)
  if getattr(op, "name", None) != "stablehlo.slice" or ctx.avals_in[0].ndim != 1:
    return ctx, array_args, params
  src = op.operands[0]
  src_type = ir.RankedTensorType(src.type)
  if src_type.rank != 1 or list(ir.DenseI64ArrayAttr(op.attributes["strides"])) != [1]:
    return ctx, array_args, params
  start = ir.DenseI64ArrayAttr(op.attributes["start_indices"])[0]
  avals_in = list(ctx.avals_in)
  avals_in[0] = avals_in[0].update(shape=(src_type.shape[0],))
  args = [src, *array_args[1:]]
  return ctx.replace(avals_in=avals_in), args, dict(params, **{READ_OFF: int(start)})


_jax_triton_rule = functools.partial(
  triton_lib.triton_kernel_call_lowering, triton_lib.get_cuda_backend
)


_ours = threading.local()  # .active while jax-triton compiles one of our calls
_jax_triton_compile = getattr(triton_lib, "compile_ttir_inplace", None)  # jax-triton 0.3.x
_jax_triton_kernel = getattr(triton_lib, "get_or_create_triton_kernel", None)
# id(jaxlib TritonKernel) -> (that kernel, kept so the id stays its own; jax-triton's compile
# result: PTX, entry name, shared memory; its Image), for lrjax's own calls. jax-triton caches
# kernels, so a call that hits its cache finds its PTX here.
_images: dict[int, tuple] = {}


@dataclasses.dataclass(frozen=True)
class Image:
  """What our launcher needs of a compiled kernel beyond jax-triton's compile result."""

  num_warps: int  # warps launched: more than asked for where Triton warp-specialized a loop
  scratch: int  # bytes of Triton's global scratch per CTA (TMA descriptors built on device)
  scratch_align: int

  def needs_own_launcher(self, num_warps: int) -> bool:
    """jaxlib's handler launches ``num_warps`` warps and passes no global scratch."""
    return self.scratch > 0 or self.num_warps != num_warps


class _MetadataTap:
  """The Triton backend as jax-triton's compile sees it, keeping the metadata dict Triton's
  stages fill (jax-triton drops it; it holds the global scratch and the warps launched)."""

  def __init__(self, backend):
    self._backend, self.metadata = backend, {}

  def __getattr__(self, name):
    return getattr(self._backend, name)

  def make_ttir(self, mod, metadata, *args):
    self.metadata = metadata  # the one dict every later stage fills
    return self._backend.make_ttir(mod, metadata, *args)


def _compile_checked(ttir, backend, options, compute_capability, platform):
  tap = _MetadataTap(backend)
  result = _jax_triton_compile(ttir, tap, options, compute_capability, platform)
  if getattr(_ours, "active", False) and platform == "cuda":
    planner.check_cta_smem(
      result.name,
      result.shared_mem_bytes,
      compute_capability,
      options.num_warps,
      options.num_stages,
    )
  md = tap.metadata
  if platform == "cuda" and "shared" not in md:  # every CUDA compile fills it
    raise RuntimeError(
      "lrjax could not read Triton's compile metadata through jax-triton's "
      "compile step (it no longer calls the backend's make_ttir with it); "
      "this jax-triton release is not supported by launch.py"
    )
  _ours.compiled = (
    result,
    Image(
      int(md.get("num_warps", options.num_warps)),
      int(md.get("global_scratch_size", 0) or 0),
      int(md.get("global_scratch_align", 1) or 1),
    ),
  )
  return result


def _kernel_recorded(*args, **kwargs):
  _ours.compiled = None
  kernel, attrs = _jax_triton_kernel(*args, **kwargs)
  if _ours.compiled is not None and getattr(_ours, "active", False):  # ours only
    _images[id(kernel)] = (kernel, *_ours.compiled)
  _ours.kernel = kernel
  return kernel, attrs


if _jax_triton_compile is not None:
  # jax-triton caches only kernels that compiled, so a refused one is checked again
  triton_lib.compile_ttir_inplace = _compile_checked
if _jax_triton_kernel is not None:
  triton_lib.get_or_create_triton_kernel = _kernel_recorded

_SCALAR_KINDS = {"i32": 1, "u32": 1, "i64": 2, "u64": 2, "fp32": 4}  # pdl_launch.cc's kinds
_BUFFER, _NULL, _SCRATCH = 0, 3, 5


def kernel_params(
  avals_in, avals_out, scalar_args, zeroed_outputs, scratch_align: int = 0
) -> list[int]:
  """The launch's parameters as pdl_launch.cc's (kind, a, b) triples, in the kernel's order:
  jax-triton's arguments (the operands, each scalar at its index, then the results), less
  scalars equal to 1 (Triton specializes them away), then Triton's two scratch pointers: the
  global one null, or with ``scratch_align`` the buffer after the results (rounded up to that
  alignment by the launcher), and the profile one null."""
  scalars = {i: (dtype, v) for i, dtype, v in scalar_args}
  n_in = len(avals_in) + len(scalars)
  zero = {
    n_in + i: int(np.prod(avals_out[i].shape)) * np.dtype(avals_out[i].dtype).itemsize
    for i in zeroed_outputs
  }
  triples, buf = [], 0
  for i in range(n_in + len(avals_out)):
    if i in scalars:
      dtype, v = scalars[i]
      if v == 1:
        continue
      if dtype not in _SCALAR_KINDS:
        raise ValueError(
          f"scalar argument {i} of type {dtype}: lrjax's launcher passes {sorted(_SCALAR_KINDS)}"
        )
      val = struct.unpack("<I", struct.pack("<f", v))[0] if dtype == "fp32" else int(v)
      triples += [_SCALAR_KINDS[dtype], val, 0]
    else:
      triples += [_BUFFER, buf, zero.get(i, 0)]
      buf += 1
  scratch = [_SCRATCH, buf, scratch_align] if scratch_align else [_NULL, 0, 0]
  return triples + scratch + [_NULL, 0, 0]


def ptx_param_count(ptx: str, name: str) -> int:
  """Parameters of the PTX entry ``name``."""
  m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\(([^)]*)\)", ptx)
  if m is None:
    raise ValueError(f"no .entry {name} in the PTX")
  return m.group(1).count(".param")


def _recorded():
  """(kernel, compile result, Image) of the kernel jax-triton just compiled or found in its
  cache for this call, or None where it was compiled before this module was imported."""
  kernel = getattr(_ours, "kernel", None)
  entry = _images.get(id(kernel))
  return entry if entry is not None and entry[0] is kernel else None


def _own_launch(ctx, array_args, params, pdl: bool, entry):
  """Our launcher's custom call for the kernel jax-triton just compiled for this call
  (``entry``: ``_recorded()``)."""
  if entry is None:
    raise RuntimeError(
      "lrjax's launcher found no PTX for this kernel: it was compiled "
      "before lrjax.custom_calls.triton.launch was imported"
    )
  _, compiled, image = entry
  if params["num_ctas"] != 1 or callable(params["zeroed_outputs"]):
    raise ValueError(
      f"{compiled.name}: lrjax's launcher takes num_ctas=1 and a fixed zeroed_outputs"
    )
  grid = triton_lib.normalize_grid(params["grid"], {})
  avals_out = list(ctx.avals_out)
  if image.scratch:  # one more result: the global scratch, image.scratch bytes a CTA
    ctas = int(np.prod(grid))
    avals_out.append(jax.core.ShapedArray((ctas * image.scratch + image.scratch_align,), np.uint8))
  triples = kernel_params(
    ctx.avals_in,
    ctx.avals_out,
    params["scalar_args"],
    params["zeroed_outputs"],
    image.scratch_align if image.scratch else 0,
  )
  want = ptx_param_count(compiled.binary, compiled.name)
  if want != len(triples) // 3:
    raise ValueError(
      f"{compiled.name}: the PTX entry takes {want} parameters, lrjax's "
      f"launcher would pass {len(triples) // 3}"
    )
  digest = hashlib.sha256(compiled.name.encode() + b"\0" + compiled.binary.encode()).digest()
  key_hi, key_lo = struct.unpack("<qq", digest[:16])
  launcher()
  rule = jax.ffi.ffi_lowering(
    LAUNCH_TARGET, api_version=4, operand_output_aliases=dict(params["input_output_aliases"])
  )
  results = rule(
    ctx.replace(avals_out=avals_out),
    *array_args,
    name=compiled.name,
    image=compiled.binary,
    key_hi=np.int64(key_hi),
    key_lo=np.int64(key_lo),
    shared=np.int64(compiled.shared_mem_bytes),
    num_warps=np.int64(image.num_warps),
    grid=np.array(grid, np.int64),
    params=np.array(triples, np.int64),
    pdl=pdl,
  )
  return results[: len(ctx.avals_out)]


_CALL_KEYS = (
  "fn",
  "scalar_args",
  "name",
  "out_shapes",
  "grid",
  "num_warps",
  "num_stages",
  "num_ctas",
  "compute_capability",
  "enable_fp_fusion",
  "input_output_aliases",
  "zeroed_outputs",
  "debug",
  "serialized_metadata",
)
_xla_kernels: dict = {}


@dataclasses.dataclass(frozen=True)
class XlaKernel:
  """A kernel compiled for XLA's own PTX call: every scalar argument a constant, so its entry
  takes the buffers alone, operands first and results after, as XLA passes them."""

  name: str  # the PTX entry, unique to this specialization
  ptx: str
  shared: int  # dynamic shared memory, bytes
  threads: int  # a CTA's threads as launched


def _frontend(
  fn,
  arg_types: list[str],
  scalar_args,
  metaparams: dict,
  num_warps: int,
  num_stages: int,
  compute_capability: int,
  enable_fp_fusion: bool,
):
  """(TTIR module, backend, options) of ``fn`` from Triton's frontend, every scalar argument
  compiled in as a constant and every buffer 16-byte aligned."""
  from triton._C import libtriton
  from triton.backends.compiler import GPUTarget
  from triton.backends.nvidia.compiler import CUDABackend
  from triton.compiler import ASTSource, code_generator

  consts = _constants(fn, scalar_args, metaparams)
  scalars = {i for i, _, _ in scalar_args}
  signature, attrs = {}, {}
  for i, t in enumerate(arg_types):
    signature[fn.arg_names[i]] = t
    if i not in scalars:
      attrs[(i,)] = [["tt.divisibility", 16]]  # XLA's buffers start 16-byte aligned or more
  for name in consts:
    signature[name] = "constexpr"
  # Triton's stages one by one, as jax-triton runs them (triton.compile would need a cache dir)
  backend = CUDABackend(GPUTarget("cuda", compute_capability, 32))
  options = backend.parse_options(
    dict(num_warps=num_warps, num_stages=num_stages, num_ctas=1, enable_fp_fusion=enable_fp_fusion)
  )
  context = libtriton.ir.context()
  libtriton.ir.load_dialects(context)
  backend.load_dialects(context)
  mod = code_generator.ast_to_ttir(
    fn,
    ASTSource(fn, signature=signature, constexprs=consts, attrs=attrs),
    context=context,
    options=options,
    codegen_fns=backend.get_codegen_implementation(options),
    module_map=backend.get_module_map(),
  )
  return mod, backend, options


def _constants(fn, scalar_args, metaparams: dict) -> dict:
  """The kernel's constexprs and its scalar arguments, by name: all compiled in."""
  consts = dict(metaparams)
  consts.update({fn.arg_names[i]: v for i, _, v in scalar_args})
  return consts


def _cache_key(fn, arg_types, scalar_args, metaparams, *rest):
  """One compiled kernel's key in ``_xla_kernels``."""
  return (
    fn,
    tuple(arg_types),
    tuple(sorted(_constants(fn, scalar_args, metaparams).items())),
    *rest,
  )


def xla_kernel(
  fn,
  arg_types: list[str],
  scalar_args,
  metaparams: dict,
  num_warps: int,
  num_stages: int,
  compute_capability: int,
  enable_fp_fusion: bool = True,
) -> XlaKernel | None:
  """``fn`` compiled by Triton with every scalar argument compiled in as a constant, for XLA's
  PTX call; None where XLA cannot launch it (it needs Triton's global scratch: TMA
  descriptors built on the device). ``arg_types``: Triton's type of each argument in order
  (jax-triton's: the operands, each scalar at its index, then the results)."""
  key = _cache_key(
    fn,
    arg_types,
    scalar_args,
    metaparams,
    num_warps,
    num_stages,
    compute_capability,
    enable_fp_fusion,
  )
  if key in _xla_kernels:
    return _xla_kernels[key]
  mod, backend, options = _frontend(
    fn,
    arg_types,
    scalar_args,
    metaparams,
    num_warps,
    num_stages,
    compute_capability,
    enable_fp_fusion,
  )
  md: dict = {}
  for stage in (backend.make_ttir, backend.make_ttgir, backend.make_llir, backend.make_ptx):
    mod = stage(mod, md, options, compute_capability)
  ptx, entry = mod, md["name"]
  planner.check_cta_smem(entry, md["shared"], compute_capability, num_warps, num_stages)
  buffers = len(arg_types) - len(scalar_args)
  kernel = None
  if not md.get("global_scratch_size"):
    # Triton's entry ends with two scratch pointers (global, profile), unused here: drop them
    m = re.search(r"\.entry\s+" + re.escape(entry) + r"\s*\(([^)]*)\)", ptx)
    params = m.group(1).split(",") if m else []
    extra = [p.split()[-1] for p in params[buffers:]]
    if len(params) == buffers + 2 and all(ptx.count(p) == 1 for p in extra):
      ptx = ptx[: m.start(1)] + ",".join(params[:buffers]) + "\n" + ptx[m.end(1) :]
      # one entry name per specialization: a module may hold several (a chain's two halves)
      name = f"{entry}_{hashlib.sha256(ptx.encode()).hexdigest()[:12]}"
      kernel = XlaKernel(
        name, ptx.replace(entry, name), int(md["shared"]), 32 * int(md.get("num_warps", num_warps))
      )
  _xla_kernels[key] = kernel
  return kernel


@dataclasses.dataclass(frozen=True)
class XlaTritonKernel:
  name: str  # the TTIR function XLA's Triton call compiles (XLA renames it)
  ttir: str  # Triton's frontend TTIR (text, no debug locations)


def xla_triton_kernel(
  fn,
  arg_types: list[str],
  scalar_args,
  metaparams: dict,
  num_warps: int,
  num_stages: int,
  compute_capability: int,
  enable_fp_fusion: bool = True,
) -> XlaTritonKernel:
  """``fn`` as Triton's frontend TTIR, every scalar argument a constant (its function takes the
  buffers alone, as XLA's Triton call passes them), for XLA to compile with its own Triton.
  Arguments as ``xla_kernel``'s."""
  key = _cache_key(
    fn,
    arg_types,
    scalar_args,
    metaparams,
    num_warps,
    num_stages,
    compute_capability,
    enable_fp_fusion,
    "ttir",
  )
  if key not in _xla_kernels:
    mod, _, _ = _frontend(
      fn,
      arg_types,
      scalar_args,
      metaparams,
      num_warps,
      num_stages,
      compute_capability,
      enable_fp_fusion,
    )
    _xla_kernels[key] = XlaTritonKernel(mod.get_entry_func_name(), mod.str_nodebug())
  return _xla_kernels[key]


def _xla_custom_call(ctx, array_args, params, target: str, backend_config: dict):
  """The custom call of one of XLA's own kernel targets: operands then results as buffers."""
  layouts = lambda avals: [list(reversed(range(a.ndim))) for a in avals]  # noqa: E731
  from jax._src.interpreters import mlir as jax_mlir  # custom_call is not public

  return jax_mlir.custom_call(
    target,
    result_types=[
      ir.RankedTensorType.get(a.shape, mlir.dtype_to_ir_type(a.dtype)) for a in ctx.avals_out
    ],
    operands=list(array_args),
    backend_config=backend_config,
    api_version=4,
    operand_layouts=layouts(ctx.avals_in),
    result_layouts=layouts(ctx.avals_out),
    operand_output_aliases=dict(params["input_output_aliases"]),
  ).results


def _xla_call(ctx, array_args, params, triton_ir: bool = False):
  """XLA's own PTX call (``__gpu$xla.gpu.ptx``) for this kernel, compiled by Triton with its
  scalars as constants: XLA launches it as one of its own kernels, not through an FFI
  handler traced into its command buffer. ``triton_ir``: XLA's Triton call
  (``__gpu$xla.gpu.triton``) instead, the kernel's frontend TTIR, which XLA compiles with its
  own Triton (launch mode xla_triton). None where neither can carry the call: a memset before
  the launch (jax-triton's ``zeroed_outputs``), more than one CTA a cluster, or (the PTX
  call) a kernel that needs Triton's global scratch."""
  if params["zeroed_outputs"] or params["num_ctas"] != 1:
    return None
  fn = params["fn"]
  metaparams = {k: v for k, v in params.items() if k not in _CALL_KEYS}
  types = [triton_lib.get_triton_type(a) for a in ctx.avals_in]
  for i, dtype, _ in params["scalar_args"]:
    types.insert(i, dtype)
  types += [triton_lib.get_triton_type(a) for a in ctx.avals_out]
  cc = params["compute_capability"]
  if cc is None:
    cc = triton_lib.triton_kernel_call_lib.get_compute_capability(0)
  args = (
    fn,
    types,
    params["scalar_args"],
    metaparams,
    params["num_warps"],
    params["num_stages"],
    cc,
    params["enable_fp_fusion"],
  )
  gx, gy, gz = triton_lib.normalize_grid(params["grid"], metaparams)
  i32 = lambda v: ir.IntegerAttr.get(ir.IntegerType.get_signless(32), int(v))  # noqa: E731
  grid = dict(grid_x=i32(gx), grid_y=i32(gy), grid_z=i32(gz))
  if triton_ir:
    k = xla_triton_kernel(*args)
    return _xla_custom_call(
      ctx,
      array_args,
      params,
      XLA_TRITON_TARGET,
      dict(
        name=ir.StringAttr.get(k.name),
        ir=ir.StringAttr.get(k.ttir),
        num_stages=i32(params["num_stages"]),
        num_warps=i32(params["num_warps"]),
        debug=ir.BoolAttr.get(False),
        **grid,
      ),
    )
  kernel = xla_kernel(*args)
  if kernel is None:
    return None
  return _xla_custom_call(
    ctx,
    array_args,
    params,
    XLA_TARGET,
    dict(
      name=ir.StringAttr.get(kernel.name),
      kernel_type=ir.StringAttr.get("ptx"),
      kernel_data=ir.StringAttr.get(kernel.ptx),
      block_x=i32(kernel.threads),
      block_y=i32(1),
      block_z=i32(1),
      shared_mem_bytes=i32(kernel.shared),
      **grid,
    ),
  )


def _lowering(ctx, *array_args, custom_call_target_name, **params):
  if custom_call_target_name != _REQUEST:  # someone else's jax-triton call
    return _jax_triton_rule(
      ctx, *array_args, custom_call_target_name=custom_call_target_name, **params
    )
  ctx, array_args, params = _read_in_place(ctx, array_args, params)
  chained = _chain(ctx, array_args, params)
  finish = lambda results: results  # noqa: E731
  if chained is not None:
    ctx, array_args, params, finish = chained
  mode = launch_mode()
  if mode in ("xla", "xla_triton"):
    # XLA may launch its kernels as programmatic dependents: wait at entry
    results = _xla_call(
      ctx,
      array_args,
      dict(params, **{PDL: launch_modes.pdl_level()}) if PDL in params else params,
      mode == "xla_triton" and launch_modes.xla_triton_serves(params["fn"].__name__, params),
    )
    if results is not None:
      return finish(results)
  # a launch after a memset (zeroed_outputs) stays plain: the wait covers kernels ahead of it
  pdl = mode == "pdl" and PDL in params and not params["zeroed_outputs"]
  if pdl:
    params = dict(params, **{PDL: launch_modes.pdl_level()})
  _ours.active, _ours.kernel = True, None  # _kernel_recorded sets the kernel of this call
  try:
    legacy = _jax_triton_rule(ctx, *array_args, custom_call_target_name=LEGACY_TARGET, **params)
  finally:
    _ours.active = False
  entry = _recorded()
  own = entry is not None and entry[2].needs_own_launcher(params["num_warps"])
  if own and mode == "jaxlib":
    try:
      launcher()
    except RuntimeError as e:
      raise RuntimeError(
        f"{entry[1].name} builds TMA descriptors on the device or was warp-specialized by "
        "Triton, which only lrjax's own launcher can launch. " + str(e)
      ) from None
  if mode == "jaxlib" and not use_ffi() and not own:
    return finish(legacy)
  op = legacy[0].owner
  op = getattr(op, "operation", op)
  if mode == "lrjax" or pdl or own:
    results = _own_launch(ctx, array_args, params, pdl, entry)
  else:
    opaque = ir.StringAttr(op.attributes["backend_config"]).value_bytes
    rule = jax.ffi.ffi_lowering(
      FFI_TARGET, api_version=4, operand_output_aliases=dict(params["input_output_aliases"])
    )
    results = rule(ctx, *array_args, opaque=opaque)
  op.erase()  # nothing uses the legacy op's results
  return finish(results)


# inline at each use, as lrjax's primitives are: a cached lowering would run once for calls
# of equal operands, and each call in its own function could not join its block's chain
mlir.register_lowering(triton_lib.triton_kernel_call_p, _lowering, platform="cuda", cacheable=False)
