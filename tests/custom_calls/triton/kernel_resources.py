"""What the Triton kernels' default tiles ask of one H200 CTA, found without a GPU (a helper
of the CPU tests that compile the kernels: test_triton_smem.py, test_triton_sync.py,
test_triton_launch.py).

Each kernel is compiled for sm_90 by Triton, with the 16-byte pointer alignment that
jax-triton declares (without it Triton does not pipeline the loads and reports a quarter to
a third of the shared memory). Triton's metadata gives the shared memory; ``ptxas -v`` (the
ptxas bundled with Triton) gives registers, spills and its C7515 warning that wgmma
instructions run serialized; from shared memory, registers and warps, the CTAs that fit on
one SM at once. The chained decode kernels can be compiled as lrjax's default launch builds
them for XLA's PTX call (M and the chain's offsets constants, launch.xla_kernel). On the GPU
the PTX is assembled by the driver's or XLA's ptxas, so registers and spills there may
differ; the shared memory is Triton's own number. Without jax-triton the kernel modules
import against a stub (nothing here launches).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import types

H200_SMEM_OPTIN = 232448  # bytes a CTA may ask for (cudaDevAttrMaxSharedMemoryPerBlockOptin)
H200_SMEM_PER_SM = 233472  # bytes an SM holds for all its CTAs, 1024 of them reserved per CTA
H200_REGS_PER_SM, H200_THREADS_PER_SM, H200_CTAS_PER_SM = 65536, 2048, 32


def ctas_per_sm(shared: int, registers: int, warps: int) -> int:
  """CTAs of one kernel resident on an H200 SM at once: the least of what its shared memory
  (plus 1 KB reserved per CTA), its registers (per warp, in 256-register units), its threads
  and the CTA limit allow."""
  regs_per_warp = -(-registers * 32 // 256) * 256
  return min(
    H200_SMEM_PER_SM // (shared + 1024),
    H200_REGS_PER_SM // regs_per_warp // warps,
    H200_THREADS_PER_SM // (32 * warps),
    H200_CTAS_PER_SM,
  )


def install_jax_triton_stub() -> None:
  """The kernel modules import jax-triton; where it is absent, a stub stands in (calling it
  raises). Nothing that only compiles or interprets the kernels launches through it."""
  if "jax_triton" in sys.modules or importlib.util.find_spec("jax_triton") is not None:
    return
  from jax.extend.core import Primitive

  def absent(*_, **__):
    raise NotImplementedError("jax-triton stub")

  stub = types.ModuleType("jax_triton")
  stub.triton_call = absent
  stub.triton_lib = types.SimpleNamespace(
    triton_kernel_call_p=Primitive("stub_triton_kernel_call"),
    triton_kernel_call_lowering=absent,
    get_cuda_backend=absent,
  )
  sys.modules["jax_triton"] = stub


def _pointer(name: str) -> str:
  """The element type of a kernel's pointer argument, by the kernels' naming."""
  if name.startswith(("scratch", "s_in", "sacc", "part")):
    return "*fp32"
  return "*i32" if name.startswith(("sched", "flag", "pos")) else "*bf16"


def compile_for_sm90(kernel, meta: dict, warps: int, stages: int):
  """Triton's compiled kernel for sm_90 (its ``asm`` and ``metadata``), with these constexprs
  and the argument types jax-triton gives it; the constexprs completed and checked as
  ``launch.triton_call`` does (``launch.launch_constexprs``: no signature default)."""
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource

  from lrjax.custom_calls.triton import launch

  meta = launch.launch_constexprs(kernel, meta)
  sig, consts, attrs = {}, {}, {}
  for i, p in enumerate(kernel.params):
    if p.is_constexpr:
      consts[p.name] = meta[p.name]
      sig[p.name] = "constexpr"
    elif p.name in ("M", "clear_off", "clear_n"):  # the runtime scalars
      sig[p.name] = "i32"
    else:
      sig[p.name] = _pointer(p.name)
      attrs[(i,)] = [["tt.divisibility", 16]]
  src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
  return triton.compile(
    src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages)
  )


def ptxas_info(ptx: str, shared: int, warps: int, entry: str | None = None) -> dict:
  """``ptxas -v`` (Triton's) on ``ptx`` for sm_90a: registers, spill bytes, whether wgmma runs
  serialized, and how many CTAs of ``shared`` bytes and ``warps`` warps fit on one SM; of
  ``entry`` alone where given (a module of several kernels), else the largest over all."""
  import triton

  exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "k.ptx")
    with open(path, "w") as fh:
      fh.write(ptx)
    res = subprocess.run(
      [exe, "-arch=sm_90a", "-v", path, "-o", os.devnull],
      capture_output=True,
      text=True,
      check=True,
    )
  log = res.stdout + res.stderr
  if entry is not None:  # its section: from "Compiling entry function 'entry'" to the next
    sections = log.split("Compiling entry function '")
    log = next((t for t in sections[1:] if t.startswith(entry + "'")), "")
    if not log:
      raise ValueError(f"ptxas compiled no entry {entry!r}")
  regs = [
    int(line.split("Used ")[1].split(" registers")[0])
    for line in log.splitlines()
    if "Used " in line and " registers" in line
  ]
  spills = [
    int(line.split("bytes spill stores")[0].split(",")[-1])
    for line in log.splitlines()
    if "bytes spill stores" in line
  ]
  return dict(
    registers=max(regs),
    spill_store_bytes=max(spills),
    wgmma_serialized="C7515" in log,
    ctas_per_sm=ctas_per_sm(shared, max(regs), warps),
  )


def compile_sm90(kernel, meta: dict, warps: int, stages: int, ptxas: bool = True) -> dict:
  """Compiles ``kernel`` with these constexprs for sm_90 as jax-triton does (M and the
  chain's offsets runtime): its shared memory, and with ``ptxas`` its registers, spill bytes,
  whether wgmma runs serialized and how many CTAs fit on one SM."""
  c = compile_for_sm90(kernel, meta, warps, stages)
  out = dict(shared=c.metadata.shared, warps=warps, stages=stages)
  if ptxas:
    out.update(ptxas_info(c.asm["ptx"], out["shared"], warps))
  return out


def xla_args(kernel, rows: int, clear_n: int = 4096):
  """(Triton's argument types, scalar arguments) jax-triton hands a chained decode kernel, as
  lrjax's XLA calls compile them in (launch.xla_kernel, launch.xla_triton_kernel): M = ``rows``
  and the chain's offsets (a call clearing ``clear_n`` floats at 0); every other argument a
  buffer."""
  types, scalars = [], []
  for p in kernel.params:
    if p.is_constexpr:
      continue
    if p.name in ("M", "clear_off", "clear_n"):
      types.append("i32")
      scalars.append((len(types) - 1, "i32", {"M": rows, "clear_off": 0}.get(p.name, clear_n)))
    else:
      types.append(_pointer(p.name))
  return types, scalars


def offset_constexpr(kernel) -> str:
  """The constexpr a kernel's scratch offset compiles in: WORK_OFF (a chained kernel's half)
  or READ_OFF (where the ·V launch reads phase 1's P)."""
  return "WORK_OFF" if "WORK_OFF" in kernel.arg_names else "READ_OFF"


def compile_xla_sm90(kernel, meta: dict, warps: int, stages: int, rows: int) -> dict:
  """``compile_sm90`` for the kernel as lrjax's default launch builds it for XLA's PTX call
  (launch.xla_kernel): M = ``rows`` and the chain's offsets compiled in, PDL set."""
  from lrjax.custom_calls.triton import launch

  types, scalars = xla_args(kernel, rows)
  k = launch.xla_kernel(
    kernel, types, scalars, {offset_constexpr(kernel): 0, **meta, "PDL": 1}, warps, stages, 90
  )
  return dict(shared=k.shared, warps=warps, stages=stages, **ptxas_info(k.ptx, k.shared, warps))


# Llama-3 8B / 70B and 3.2-1B shapes at 40 % removed (as benchmarks/gpu_lowrank.py's sweep;
# the MLP also at Qwen2.5-7B's, more stage-B slices than SMs)
GROUP_SHAPES = (
  (8192, ((2456, 8192), (544, 1024), (544, 1024))),
  (4096, ((1216, 4096), (512, 1024), (512, 1024))),
  (2048, ((640, 2048), (256, 512), (256, 512))),
  # the ranks the models get (multiples of 64): Llama-3-70B's and Qwen2.5-7B's
  (8192, ((2432, 8192), (576, 1024), (576, 1024))),
  (3584, ((1088, 3584), (256, 512), (256, 512))),
)
XUV_SHAPES = ((8192, 4096, 16384), (4096, 1024, 14336), (8192, 2456, 8192))
MLP_SHAPES = ((4096, 14336, 2560), (8192, 28672, 3824), (2048, 8192, 1280), (3584, 18944, 2048))
PREFILL_XUV_SHAPES = ((8192, 4096, 16384), (7168, 4096, 18432))
PV_LAUNCH_SHAPES = ((256, 512), (152, 4096), (640, 2048))  # (r, N) where the launch serves
PREFILL_MLP_SHAPES = ((4096, 14336, 2560), (2048, 8192, 1280), (4096, 14336, 1024))


def planned():
  """(name, kernel, meta, warps, stages) of every kernel's default tiles at the shapes above:
  decode at 1-128 rows (the grouped kernel to its 64, its phase 1 alone at 64 and 128),
  prefill at 1024 and 4096 tokens."""
  install_jax_triton_stub()
  from lrjax.custom_calls.triton import (
    decode_attention,
    decode_attention_append,
    mlp_decode,
    mlp_prefill,
    planner,
    xuv_decode,
    xuv_decode_group,
    xuv_decode_pv,
    xuv_prefill,
  )

  kw = dict(gated=True, act="silu", bias_mask=(False,) * 3)
  for m in (1, 16, 32, 64):
    for k, members in GROUP_SHAPES:
      p = planner.plan_decode_group(m, k, members)
      meta = xuv_decode_group.launch_plan(m, k, [(r, n, False) for r, n in members], p)["meta"]
      ranks = "/".join(str(r) for r, _ in members)  # two shapes share K=8192
      kernel = xuv_decode_group._xuv_decode_group_kernel
      yield f"group M={m} K={k} r={ranks}", kernel, meta, p.warps, p.stages
  for m in (1, 16, 32, 64, 128):
    for k, r, n in XUV_SHAPES:
      _, p, launch = xuv_decode.default_persistent_launch(m, k, r, n, False, None)
      yield (
        f"xuv decode M={m} {k}->{r}->{n}",
        xuv_decode._xuv_decode_persistent_kernel,
        launch["meta"],
        p.warps,
        p.stages,
      )
    for d, f, r in MLP_SHAPES:
      bs = mlp_decode.BlockSizes.get_default(m, d, f, r, d)
      meta = mlp_decode.launch_plan(m, d, r, f, r, d, bs=bs, **kw)["meta"]
      yield (
        f"mlp decode T={m} D={d} F={f} r={r}",
        mlp_decode._mlp_decode_kernel,
        meta,
        bs.num_warps,
        bs.num_stages,
      )
      if m <= mlp_decode.PERSISTENT_MAX_M:
        p = planner.plan_mlp_decode_persistent(m, d, f, r, r, d)
        meta = mlp_decode.persistent_launch_plan(m, d, r, f, r, d, p=p, **kw)["meta"]
        yield (
          f"mlp decode persistent T={m} D={d} F={f} r={r}",
          mlp_decode._mlp_decode_persistent_kernel,
          meta,
          p.warps,
          p.stages,
        )
  for m in (64, 128):  # the grouped kernel's phase 1 alone: the composed MLP's gate and up
    for d, f, r in MLP_SHAPES:  # (also through its one phase-1 call site: one_branch)
      members = [(r, f, False), (r, f, False)]
      for one in (False, True):
        p = planner.plan_decode_group_phase1(m, d, [(r, f), (r, f)], one_branch=one)
        meta = xuv_decode_group.launch_plan(m, d, members, p, phase2=False)["meta"]
        yield (
          f"group phase 1{' one branch' if one else ''} M={m} D={d} r={r}",
          xuv_decode_group._xuv_decode_group_kernel,
          meta,
          p.warps,
          p.stages,
        )
  for m in (32, 64, 128):  # the ·V launch after phase 1 alone (xuv_decode's pv="launch")
    for r, n in PV_LAUNCH_SHAPES:
      pp = planner.plan_pv_launch(m, r, n)
      yield (
        f"xuv pv launch M={m} {r}->{n}",
        xuv_decode_pv._xuv_decode_pv_kernel,
        xuv_decode_pv.launch_meta(r, n, False, pp),
        pp.warps,
        pp.stages,
      )
  for b, t in ((1, 1024), (1, 8192), (16, 1024), (64, 4096)):  # decode attention, Llama-3-8B
    for merge in decode_attention.MERGES:
      bs = decode_attention.BlockSizes(merge=merge)
      plan = decode_attention.launch_plan(b, 32, 8, t, 128, t, None, bs)
      if merge == decode_attention.MERGES[0]:  # the flash-decoding launches, once
        append = decode_attention_append._decode_attention_append_kernel
        for label, kernel, extra in (
          ("", decode_attention._decode_attention_kernel, {}),
          (" append", append, {"APART": False}),
          (" append apart", append, {"APART": True}),
        ):
          yield (
            f"decode attention{label} B={b} T={t}",
            kernel,
            {**plan["meta"], **extra},
            bs.num_warps,
            bs.num_stages,
          )
      kernel = (
        decode_attention._merge_tile_kernel if merge == "tile" else decode_attention._merge_kernel
      )
      yield f"decode attention merge {merge} B={b} T={t}", kernel, plan["meta"], 4, 1
  for m in (1024, 4096):
    for k, r, n in PREFILL_XUV_SHAPES:
      bs = xuv_prefill.BlockSizes.get_default(m, k, r, n)
      meta = xuv_prefill.launch_plan(m, k, r, n, False, bs)["meta"]
      yield (
        f"xuv prefill M={m} {k}->{r}->{n}",
        xuv_prefill._xuv_prefill_kernel,
        meta,
        bs.num_warps,
        bs.num_stages,
      )
    for d, f, r in PREFILL_MLP_SHAPES:
      bs = mlp_prefill.BlockSizes.get_default(m, d, f, r, r, True)
      meta = mlp_prefill.launch_plan(m, d, r, f, r, d, bs=bs, **kw)["meta"]
      yield (
        f"mlp prefill T={m} D={d} F={f} r={r}",
        mlp_prefill._mlp_prefill_kernel,
        meta,
        bs.num_warps,
        bs.num_stages,
      )
  for m in (1, 16):  # the norm in the kernels (NORM): Llama-3-8B's q/k/v and SwiGLU
    k, members = GROUP_SHAPES[1]
    p = planner.plan_decode_group(m, k, members)
    plan = xuv_decode_group.launch_plan(m, k, [(r, n, False) for r, n in members], p)
    meta = dict(plan["meta"], NORM=1, EPS=1e-5)
    yield (
      f"group norm M={m} K={k}",
      xuv_decode_group._xuv_decode_group_kernel,
      meta,
      p.warps,
      p.stages,
    )
    d, f, r = MLP_SHAPES[0]
    bs = mlp_decode.BlockSizes.get_default(m, d, f, r, d)
    meta = dict(mlp_decode.launch_plan(m, d, r, f, r, d, bs=bs, **kw)["meta"], NORM=1, EPS=1e-5)
    yield (
      f"mlp decode norm T={m} D={d}",
      mlp_decode._mlp_decode_kernel,
      meta,
      bs.num_warps,
      bs.num_stages,
    )
  for m in (1, 16):  # the residual epilogue (RESIDUAL): Llama-3-8B's o_proj and SwiGLU
    from lrjax.custom_calls.triton._common import RESIDUAL

    _, p, launch = xuv_decode.default_persistent_launch(m, 4096, 1216, 4096, RESIDUAL.value, None)
    yield (
      f"xuv decode residual M={m} 4096->1216->4096",
      xuv_decode._xuv_decode_persistent_kernel,
      launch["meta"],
      p.warps,
      p.stages,
    )
    d, f, r = MLP_SHAPES[0]
    bs = mlp_decode.BlockSizes.get_default(m, d, f, r, d)
    plan = mlp_decode.launch_plan(
      m, d, r, f, r, d, bs=bs, **dict(kw, bias_mask=(False, False, RESIDUAL.value))
    )
    yield (
      f"mlp decode norm residual T={m} D={d}",
      mlp_decode._mlp_decode_kernel,
      dict(plan["meta"], NORM=1, EPS=1e-5),
      bs.num_warps,
      bs.num_stages,
    )


def rope_bf16_ops(**options) -> list[str]:
  """The bf16 mul/add/fma instructions of decode_attention_append's RoPE (``_rope_rows`` on
  one row of 128) compiled for sm_90 with these compile options."""
  import re

  import triton
  import triton.language as tl
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource

  from lrjax.custom_calls.triton import decode_attention_append as dap

  @triton.jit
  def rope(x_ptr, cos_ptr, sin_ptr, o_ptr, D: tl.constexpr):
    offs = tl.arange(0, D)
    row = tl.arange(0, 1)
    cos, sin = tl.load(cos_ptr + offs), tl.load(sin_ptr + offs)
    y = dap._rope_rows(x_ptr, row, offs, cos, sin, D, True)
    tl.store(o_ptr + row[:, None] * D + offs[None, :], y)

  sig = {n: "*bf16" for n in ("x_ptr", "cos_ptr", "sin_ptr", "o_ptr")} | {"D": "constexpr"}
  src = ASTSource(fn=rope, signature=sig, constexprs={"D": 128})
  opts = dict(num_warps=4, num_stages=1, **options)
  ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
  return sorted(set(re.findall(r"\b(?:fma|mul|add)\.[a-z.]*bf16\b", ptx)))
