"""Variants of lrjax's Triton kernels for A/B timing: the benchmarks' only way past the product
wrappers' defaults (benchmarks only; the library never imports this).

A variant is a spec string; each function returns the call it names. The options it reaches
(other schedules, plans with some fields replaced, the kernels' timing probes, whose output
is wrong) are the kernel modules' internal entry points (``_xuv_decode``, ``_mlp_decode``,
``_mlp_prefill``), not their public signatures.

X·U·V (``xuv(spec, m, k, r, n)`` -> fn(x, u, v)):
  ``persistent``                      the persistent kernel, phase 2 in the launch
  ``persistent:field=value,...``      its plan (``xuv_decode.plan_persistent``), fields replaced
  ``persistent_rows:BYTES``           V's column tiles at least BYTES a row
  ``persistent_probe:BITS``           its PROBE bits (timing only)
  ``pv_xla``, ``pv_xla:field=...``    phase 1 alone, then XLA's GEMM (plan fields replaced)
  ``pv_xla_probe:BITS``               the same with PROBE bits (timing only)
  ``pv_launch``, ``pv_launch:f=v,..`` phase 1 alone, then the ·V launch (its tiles replaced)
  ``decode``, ``decode_xz``           the tiled schedule, scratch zeroed by jax-triton's memset
                                      or by XLA (the default)
  ``decode_stages:1|2``               the tiled schedule streaming one stage (timing only)
  ``decode:BM,BK,BR,split,BN,BKV,chunks,warps,stages``  tiled, these blocks
  ``prefill``, ``prefill:BM,BN,BK,G,ring,warps,stages,programs,dynamic``  the prefill kernel

SwiGLU MLP (``mlp(spec, m, d, f, r)`` -> fn(x, ug, vg, uu, vu, ud, vd)):
  ``fused``                           the fused decode kernel where the default composes calls
  ``compose``, ``compose_separate``   X·U·V decode calls (gate and up in one launch / two)
  ``decode_memset``                   scratch zeroed by jax-triton's memset
  ``decode_kw:field=value,...``       the default blocks, fields replaced (BlockSizes or
                                      mlp_decode.Variant fields)
  ``decode_kw0:field=value,...``      the same over the unparked T <= 16 blocks
  ``decode_s_store``, ``decode_s_none``  stage B's partials of S stored / masked (timing only)
  ``persistent``, ``persistent_kw:field=value,...``  the persistent schedule (plan replaced)
  ``persistent_phases:BITS``          it streaming some phases only (timing only)
  ``prefill:<BlockSizes fields, comma-separated>``, ``prefill_phases:BITS``  the prefill kernel
"""

from __future__ import annotations

import dataclasses

from lrjax.custom_calls.triton import planner


def _fields(spec: str) -> dict:
  """{field: int} of "a=1,b=2" ("" -> {})."""
  return {f: int(v) for f, v in (t.split("=") for t in spec.split(",") if t)}


def xuv(spec: str, m: int, k: int, r: int, n: int):
  """fn(x, u, v) of the X·U·V variant ``spec`` (module docstring) at M rows of K -> r -> N."""
  from lrjax.custom_calls.triton import xuv_decode, xuv_prefill

  dec = xuv_decode._xuv_decode
  name, _, arg = spec.partition(":")
  if spec == "decode":
    return lambda x, u, v: dec(x, u, v, xla_zeroing=False, persistent=False)
  if spec == "decode_xz":
    return lambda x, u, v: dec(x, u, v, xla_zeroing=True, persistent=False)
  if name == "decode_stages":
    return lambda x, u, v: dec(x, u, v, stages=int(arg), persistent=False)
  if name == "decode":
    bs = xuv_decode.TiledBlockSizes(*(int(t) for t in arg.split(",")))
    return lambda x, u, v: dec(x, u, v, block_sizes=bs, persistent=False)
  if spec == "persistent":
    return lambda x, u, v: dec(x, u, v, persistent=True, pv="kernel")
  if name == "persistent_rows":
    p = planner.plan_decode_persistent(m, k, r, n, min_row_bytes=int(arg))
    return lambda x, u, v: dec(x, u, v, persistent=p, pv="kernel")
  if name in ("persistent_probe", "pv_xla_probe"):
    pv = "kernel" if name == "persistent_probe" else "xla"
    return lambda x, u, v: dec(x, u, v, persistent=True, pv=pv, probe=int(arg))
  if name == "pv_launch":
    pp = dataclasses.replace(planner.plan_pv_launch(m, r, n), **_fields(arg))
    return lambda x, u, v: dec(x, u, v, persistent=True, pv="launch", pv_plan=pp)
  if spec == "pv_xla":
    return lambda x, u, v: dec(x, u, v, persistent=True, pv="xla")
  if name in ("persistent", "pv_xla"):
    fields = _fields(arg)
    pv = "xla" if name == "pv_xla" else "kernel"
    p = xuv_decode.plan_persistent(m, k, r, n, pv, fields.pop("programs", None))
    p = dataclasses.replace(p, **fields)
    return lambda x, u, v: dec(x, u, v, persistent=p, pv=pv)
  if spec == "prefill":
    return lambda x, u, v: xuv_prefill.xuv_prefill(x, u, v)
  if name == "prefill":
    bs = xuv_prefill.BlockSizes(*(int(t) for t in arg.split(",")))
    return lambda x, u, v: xuv_prefill.xuv_prefill(x, u, v, block_sizes=bs)
  raise ValueError(f"X·U·V variant {spec!r}: see benchmarks/kernel_variants.py")


def mlp(spec: str, m: int, d: int, f: int, r: int):
  """fn(x, ug, vg, uu, vu, ud, vd) of the SwiGLU variant ``spec`` (module docstring)."""
  from lrjax.custom_calls.triton import mlp_decode, mlp_prefill

  name, _, arg = spec.partition(":")
  kw: dict = {}
  kern = mlp_decode._mlp_decode
  if spec == "fused":
    kw = dict(compose=False)
  elif spec in ("compose", "compose_separate"):
    kw = dict(compose=True, compose_group=spec == "compose")
  elif spec == "decode_memset":
    kw = dict(xla_zeroing=False)
  elif name in ("decode_kw", "decode_kw0"):
    fields = _fields(arg)
    var_names = {x.name for x in dataclasses.fields(mlp_decode.Variant)}
    var = mlp_decode.Variant(**{k: v for k, v in fields.items() if k in var_names})
    fields = {k: v for k, v in fields.items() if k not in var_names}
    bs0 = mlp_decode._default_blocks(m, d, f, r, d, park_small=name == "decode_kw")
    kw = dict(block_sizes=dataclasses.replace(bs0, **fields), variant=var)
  elif spec in ("decode_s_store", "decode_s_none"):
    bs0 = mlp_decode._default_blocks(m, d, f, r, d, park_small=False)
    kw = dict(block_sizes=bs0, s_flush=spec.rpartition("_")[2])
  elif spec == "persistent":
    kw = dict(persistent=True)
  elif name == "persistent_kw":
    plan = planner.plan_mlp_decode_persistent(m, d, f, r, r, d)
    kw = dict(persistent=dataclasses.replace(plan, **_fields(arg)))
  elif name == "persistent_phases":
    kw = dict(persistent=True, phases=int(arg))
  elif name == "prefill_phases":
    kern, kw = mlp_prefill._mlp_prefill, dict(phases=int(arg) or 15, waits=int(arg) != 0)
  elif name == "prefill":
    kern = mlp_prefill._mlp_prefill
    kw = dict(block_sizes=mlp_prefill.BlockSizes(*(int(t) for t in arg.split(","))))
  else:
    raise ValueError(f"MLP variant {spec!r}: see benchmarks/kernel_variants.py")
  return lambda x, ug, vg, uu, vu, ud, vd: kern(x, (uu, vu), (ud, vd), (ug, vg), **kw)


def kv_attention(spec: str):
  """fn(q, zk, zv, vk, vv, pos, inv) of ``kv:BN,BK,warps,stages[,splits]`` block sizes."""
  from lrjax.custom_calls.triton import kv_attention as kv

  name, _, arg = spec.partition(":")
  if name != "kv":
    raise ValueError(f"attention variant {spec!r}: expected kv:BN,BK,warps,stages[,splits]")
  bs = kv.BlockSizes(*(int(v) for v in arg.split(",")))
  return lambda q, zk, zv, vk, vv, pos, inv: kv.kv_attention(
    q, zk, zv, vk, vv, pos, inv, block_sizes=bs
  )
