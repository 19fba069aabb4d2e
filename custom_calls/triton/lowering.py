"""CUDA lowerings of lr_xuv, lr_mlp, lr_xuv_group, lr_normed, lr_residual and lr_kv_attention
(Triton kernels called through jax-triton), and of decode_attention: jax's Pallas
flash-decoding kernel, and lrjax's Triton kernel for the cache lengths the Pallas kernel
declines.

Light module: it imports neither triton nor jax_triton. ``load()`` imports the kernel
module only when the registry selects the kernel for a CUDA lowering, so CPU installs
never import triton. ``supports`` declines (with the reason) what the kernels do not serve,
and ``*_faster`` declines shapes where the kernels measured slower than XLA (the device's
tuning table, policy.py); the registry then lowers the XLA reference.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import math

import numpy as np

from lrjax.custom_calls.triton import policy
from lrjax.lowering.registry import KernelLowering, register as _register

log = logging.getLogger("lrjax.custom_calls.triton")

_KERNEL_DTYPES = ("bfloat16", "float16")
_OUT_DTYPES = ("bfloat16", "float16", "float32")
_INT32_MAX = 2**31 - 1
# Token counts up to which the decode kernels serve (their row tiles); above them the
# persistent prefill kernels do. The kernel modules take their limits from here
# (xuv_decode.MAX_M, mlp_decode.MAX_M), so the registry reads them without triton.
XUV_DECODE_MAX_M = 128
MLP_DECODE_MAX_M = 128


def _dt(a) -> str:
  return np.dtype(a.dtype).name


def _rows(x) -> int:
  return math.prod(x.shape[:-1])


def _toolchain() -> str | None:
  if importlib.util.find_spec("jax_triton") is None or importlib.util.find_spec("triton") is None:
    return "jax-triton/triton not installed (pip install 'lrjax[cuda]')"
  return None


def _scale_reason(params) -> str | None:
  """Why a kernel without the scale's XLA epilogue (the prefill kernels) declines."""
  if params.get("has_scale") or any(params.get("scale_mask", ())):
    return (
      "rank-space scale between the factors: applied only by the decode kernels (phase 1 in "
      "the kernel, the scale and ·V by XLA; the MLP as its composed calls)"
    )
  return None


def _persistent_rows_reason(m: int) -> str | None:
  """Why a scaled decode X·U·V (persistent schedule, pv='xla' only) cannot take ``m`` rows."""
  limit = policy.values("xuv_decode").persistent_max_m
  if m > limit:
    return f"M={m} with a rank-space scale: the persistent schedule serves M <= {limit}"
  return None


def _common_checks(x, factors, params) -> str | None:
  if (reason := _toolchain()) is not None:
    return reason
  if _dt(x) not in _KERNEL_DTYPES:
    return f"x dtype {_dt(x)} not in {_KERNEL_DTYPES} (f32 stays on XLA for exact f32 math)"
  for i, a in enumerate(factors):
    if _dt(a) != _dt(x):
      return f"factor {i} dtype {_dt(a)} != x dtype {_dt(x)}"
  if np.dtype(params["out_dtype"]).name not in _OUT_DTYPES:
    return f"out_dtype {np.dtype(params['out_dtype']).name} not in {_OUT_DTYPES}"
  inter = np.dtype(params["inter_dtype"]).name
  if inter != _dt(x):
    return (
      f"inter_dtype {inter} != {_dt(x)}: the kernel rounds the rank-space "
      f"intermediate to {_dt(x)} for the tensor cores"
    )
  if _rows(x) == 0:
    return "no rows (M=0)"
  for a in (x,) + tuple(factors):
    if math.prod(a.shape) > _INT32_MAX:
      return f"operand of shape {a.shape} has more than 2^31-1 elements (int32 offsets)"
  if _rows(x) > (1 << 14) * 128:
    return f"M={_rows(x)} rows exceed the 14-bit row-block field of the tile schedule"
  return None


# ---------------------------------------------------------------- lr_xuv


def _xuv_checks(avals, params) -> str | None:
  x, u, v = avals[:3]
  return _common_checks(x, (u, v), params)


def xuv_decode_supports(avals, params) -> str | None:
  if (reason := _xuv_checks(avals, params)) is not None:
    return reason
  m = _rows(avals[0])
  if m > XUV_DECODE_MAX_M:
    return f"M={m} > {XUV_DECODE_MAX_M}: prefill kernel serves"
  if params.get("has_scale"):
    return _persistent_rows_reason(m)
  return None


def xuv_prefill_supports(avals, params) -> str | None:
  if (reason := _scale_reason(params)) is not None:
    return reason
  if (reason := _xuv_checks(avals, params)) is not None:
    return reason
  n = avals[2].shape[1]
  r = avals[1].shape[1]
  if max(r, n) > (1 << 14) * 64:
    return f"r={r} or N={n} exceed the 14-bit column-block field of the tile schedule"
  return None


def xuv_faster(avals, params) -> str | None:
  x, u, v = avals[:3]
  return policy.verdict("xuv", _rows(x), u.shape[0], u.shape[1], v.shape[1])


def _xuv_impl(mod: str, fn: str):
  def load():
    kernel = getattr(importlib.import_module(f"lrjax.custom_calls.triton.{mod}"), fn)

    def impl(
      *ops, has_bias, inter_dtype, out_dtype, has_scale=False, scaled_dtype=None, residual=None
    ):
      del inter_dtype  # checked equal to the factor dtype in supports
      bias = ops[3] if has_bias else None
      # only xuv_decode takes a scale or a residual (the prefill kernel declines them)
      kw = {} if residual is None else {"residual": residual}
      if has_scale:
        kw.update(scale=ops[-1], scaled_dtype=scaled_dtype)
      return kernel(ops[0], ops[1], ops[2], bias, out_dtype=out_dtype, **kw)

    return impl

  return load


# ---------------------------------------------------------------- lr_xuv_group

GROUP_MAX_M = 64  # rows the grouped kernel serves with its phase 2 (its register tiles)


def _group(avals, params):
  from lrjax.lowering.group import members_of

  return avals[0], members_of(avals, params["bias_mask"], params.get("scale_mask", ()))


def xuv_group_supports(avals, params) -> str | None:
  x, members = _group(avals, params)
  if (
    reason := _common_checks(x, tuple(a for u, v, _ in members for a in (u, v)), params)
  ) is not None:
    return reason
  if _rows(x) > GROUP_MAX_M:
    return f"M={_rows(x)} > {GROUP_MAX_M}: the grouped kernel serves decode rows"
  return None


def xuv_group_faster(avals, params) -> str | None:
  x, members = _group(avals, params)
  return policy.verdict(
    "xuv_group",
    _rows(x),
    x.shape[-1],
    sum(u.shape[1] for u, _, _ in members),
    sum(v.shape[1] for _, v, _ in members),
  )


def _group_impl():
  from lrjax.custom_calls.triton.xuv_decode_group import xuv_decode_group
  from lrjax.lowering.group import members_with_scales

  def impl(*ops, bias_mask, inter_dtype, out_dtype, scale_mask=(), norm=None):
    del inter_dtype  # checked equal to the factor dtype in supports
    members = [
      (u, v, b, s) if s is not None else (u, v) if b is None else (u, v, b)
      for u, v, b, s in members_with_scales(ops, bias_mask, scale_mask)
    ]
    return xuv_decode_group(ops[0], members, out_dtype=out_dtype, norm=norm)

  return impl


# ---------------------------------------------------------------- lr_mlp


def _mlp_checks(avals, params) -> str | None:
  from lrjax.lowering.primitives import mlp_operands

  d = mlp_operands(avals, params["gated"], params["bias_mask"], params.get("scale_mask", ()))
  if params["act"] not in ("silu", "gelu_tanh", "gelu", "relu"):
    return f"activation {params['act']!r} has no Triton epilogue"
  factors = [d["up"][0], d["up"][1], d["down"][0], d["down"][1]]
  if params["gated"]:
    g = d["gate"]
    if g[0].shape != d["up"][0].shape or g[1].shape != d["up"][1].shape:
      return (
        f"gate factors {g[0].shape}x{g[1].shape} differ from up's "
        f"{d['up'][0].shape}x{d['up'][1].shape}; the kernel computes both in one pass"
      )
    factors += [g[0], g[1]]
  return _common_checks(d["x"], tuple(factors), params)


def mlp_decode_supports(avals, params) -> str | None:
  if (reason := _mlp_checks(avals, params)) is not None:
    return reason
  m = _rows(avals[0])
  if m > MLP_DECODE_MAX_M:
    return f"M={m} > {MLP_DECODE_MAX_M}: prefill kernel serves"
  if any(params.get("scale_mask", ())):  # composed: down's scale needs xuv_decode's schedule
    return _persistent_rows_reason(m)
  return None


def mlp_prefill_supports(avals, params) -> str | None:
  if (reason := _scale_reason(params)) is not None:
    return reason
  return _mlp_checks(avals, params)


def mlp_faster(avals, params) -> str | None:
  from lrjax.lowering.primitives import mlp_operands

  d = mlp_operands(avals, params["gated"], params["bias_mask"])
  u, v = d["up"][0], d["up"][1]
  return policy.verdict("mlp_swiglu", _rows(d["x"]), u.shape[0], u.shape[1], v.shape[1])


def _mlp_impl(mod: str, fn: str):
  def load():
    kernel = getattr(importlib.import_module(f"lrjax.custom_calls.triton.{mod}"), fn)
    takes_norm = fn == "mlp_decode"  # the prefill kernel and the scaled schedule take none

    def impl(
      *ops, gated, act, bias_mask, inter_dtype, out_dtype, scale_mask=(), norm=None, residual=None
    ):
      del inter_dtype
      from lrjax.custom_calls.triton._common import normed_reference
      from lrjax.lowering.primitives import mlp_operands

      d = mlp_operands(ops, gated, bias_mask, scale_mask)
      fn, proj = kernel, lambda p, name: (p[0], p[1]) if p[2] is None else p
      x, kw = d["x"], {"norm": norm} if norm is not None else {}
      if any(scale_mask):  # only mlp_decode is asked (the prefill kernel declines scales)
        from lrjax.custom_calls.triton.mlp_decode import mlp_decode_scaled

        fn, proj = mlp_decode_scaled, lambda p, name: (*p, d["scales"][name])
      if kw and (not takes_norm or any(scale_mask)):  # XLA normalises x first
        x, kw = normed_reference(x, norm), {}
      if residual is not None:  # only mlp_decode is asked (triton.residual's supports)
        kw["residual"] = residual
      return fn(
        x,
        proj(d["up"], "up"),
        proj(d["down"], "down"),
        proj(d["gate"], "gate") if gated else None,
        act=act,
        out_dtype=out_dtype,
        **kw,
      )

    return impl

  return load


# ---------------------------------------------------------------- lr_normed

# kernels that apply an rms_norm to X in their GEMMs (their impls take norm=(weight, eps))
NORM_KERNELS = ("triton.xuv_decode_group", "triton.mlp_decode")
# lr_normed's kernels are not chosen until their norm has passed its GPU tests; then the
# tuning table's dispatch.norm_in_kernels decides
NORM_GPU_VERIFIED = True


def _first_kernel(inner, inner_avals, ip):
  """(kernel, declined) for the op ``inner`` on these avals and params: the first CUDA kernel
  that serves it (None: none does), with each one passed over and why."""
  from lrjax import custom_calls
  from lrjax.lowering import registry

  kernels = registry.candidates(inner, "cuda", load=False) or sorted(
    (k for k in custom_calls.kernel_catalog().get("cuda", ()) if k.primitive == inner),
    key=lambda k: -k.priority,
  )
  declined = []
  for k in kernels:
    reason = k.supports(inner_avals, ip)
    if reason is None:
      return k, declined
    declined.append((k.name, reason))
  return None, declined


def _normed_inner(avals, params):
  """(kernel, declined, avals, params) of the op an lr_normed call folds its norm into
  (``_first_kernel``'s)."""
  ip = dict(params["inner_params"])
  inner_avals = (avals[0],) + tuple(avals[2:])
  return *_first_kernel(params["inner"], inner_avals, ip), inner_avals, ip


def _normed_reason(kernel, declined, inner: str) -> str | None:
  """Why lr_normed's kernel cannot serve where ``kernel`` (``_normed_inner``'s) serves the op
  ``inner`` (None: it can)."""
  if kernel is None:
    why = "; ".join(f"{n}: {r}" for n, r in declined) or "no kernel"
    return f"no kernel serves {inner} ({why}), so the norm stays XLA's"
  if kernel.name not in NORM_KERNELS:
    return f"{kernel.name} serves {inner} and takes no norm"
  if not NORM_GPU_VERIFIED:
    return "its norm has not yet passed its GPU tests (lowering.NORM_GPU_VERIFIED)"
  return None


def _switch_off(switch: str) -> str | None:
  """Why the current tuning table's ``dispatch.<switch>`` is off (None: it is on)."""
  table = policy.current()
  return None if getattr(table.values("dispatch"), switch) else table.why("dispatch", switch)


def _gated_verdict(switch: str, kernel, inner_avals, ip) -> str | None:
  """The tuning table's ``dispatch.<switch>``, then the verdict of ``kernel``, which would
  serve the op: measured slower than XLA there, it leaves the op (and what is folded into
  it) to XLA."""
  reason = _switch_off(switch)
  if reason is not None:
    return reason
  if kernel is None or kernel.faster is None:
    return None
  return kernel.faster(inner_avals, ip)


def normed_supports(avals, params) -> str | None:
  kernel, declined, _, _ = _normed_inner(avals, params)
  return _normed_reason(kernel, declined, params["inner"])


def normed_faster(avals, params) -> str | None:
  kernel, _, inner_avals, ip = _normed_inner(avals, params)
  return _gated_verdict("norm_in_kernels", kernel, inner_avals, ip)


def _normed_impl():
  def impl(x, w, *ops, eps, inner, inner_params):
    params = dict(eps=eps, inner=inner, inner_params=inner_params)
    avals = [getattr(a, "aval", a) for a in (x, w, *ops)]
    kernel, _, _, ip = _normed_inner(avals, params)
    from lrjax.lowering.rms_norm import inner_primitive

    out = kernel.load()(x, *ops, norm=(w, eps), **ip)
    return list(out) if inner_primitive(inner).multiple_results else [out]

  return impl


# ---------------------------------------------------------------- lr_residual

# kernels that add a residual as they store their output (their impls take residual=)
RESIDUAL_KERNELS = ("triton.xuv_decode", "triton.mlp_decode")
# lr_residual's kernels are not chosen until their residual epilogue has passed its GPU tests
# (it has, on an H100); then the tuning table's dispatch.residual_epilogue decides
RESIDUAL_GPU_VERIFIED = True


@dataclasses.dataclass(frozen=True)
class _ResidualTarget:
  """What serves an lr_residual call's inner op on CUDA."""

  kernel: KernelLowering | None  # the kernel that serves the op (None: XLA)
  reason: str | None  # why it cannot add the residual (None: it can)
  avals: tuple  # the op's avals and params, as that kernel takes them
  params: dict
  eps: float | None = None  # through an lr_normed: its eps...
  norm_in_kernel: bool = False  # ...and whether the kernel applies the norm (else XLA first)


def _residual_target(avals, params) -> _ResidualTarget:
  """The kernel that would serve an lr_residual call's inner op (through an lr_normed: the
  op its norm folds into) and whether it can add the residual."""
  inner, ip = params["inner"], dict(params["inner_params"])
  inner_avals, eps, in_kernel = tuple(avals[1:]), None, False
  if inner == "lr_normed":  # the norm in the kernel where lr_normed's kernel would serve
    from lrjax.lowering import registry

    inner, eps = ip["inner"], ip["eps"]
    kernel, declined, inner_avals, ip = _normed_inner(inner_avals, ip)
    in_kernel = _normed_reason(kernel, declined, inner) is None and (
      registry.kernels_preferred()
      or _gated_verdict("norm_in_kernels", kernel, inner_avals, ip) is None
    )
  else:
    kernel, declined = _first_kernel(inner, inner_avals, ip)

  def target(reason):
    return _ResidualTarget(kernel, reason, inner_avals, ip, eps, in_kernel)

  if kernel is None:
    why = "; ".join(f"{n}: {r}" for n, r in declined) or "no kernel"
    return target(f"no kernel serves {inner} ({why}), so the add stays XLA's")
  if kernel.name not in RESIDUAL_KERNELS:
    return target(f"{kernel.name} serves {inner} and has no residual epilogue")
  if ip.get("has_bias") or (inner == "lr_mlp" and ip["bias_mask"][-1]):
    return target("the op's output bias takes the kernel's epilogue operand")
  if not RESIDUAL_GPU_VERIFIED:
    return target("its residual epilogue has not yet run on a GPU (lowering.RESIDUAL_GPU_VERIFIED)")
  return target(None)


def residual_supports(avals, params) -> str | None:
  return _residual_target(avals, params).reason


def residual_faster(avals, params) -> str | None:
  t = _residual_target(avals, params)
  return _gated_verdict("residual_epilogue", t.kernel, t.avals, t.params)


def _residual_impl():
  def impl(r, *ops, inner, inner_params):
    params = dict(inner=inner, inner_params=inner_params)
    t = _residual_target([getattr(a, "aval", a) for a in (r, *ops)], params)
    kernel = t.kernel.load()
    if t.eps is None:
      return kernel(*ops, residual=r, **t.params)
    x, w, rest = ops[0], ops[1], ops[2:]  # lr_normed's: x, the norm weight, the op's operands
    if t.norm_in_kernel:
      return kernel(x, *rest, norm=(w, t.eps), residual=r, **t.params)
    from lrjax.custom_calls.triton._common import normed_reference

    return kernel(normed_reference(x, (w, t.eps)), *rest, residual=r, **t.params)

  return impl


KV_MAX_RV = 1024  # the kernel's value-rank accumulator [16+, r_v] lives in registers
KV_MAX_GROUP = 64  # query heads per KV head


def kv_attention_shape_reason(d: int, rv: int, group: int) -> str | None:
  """Why the attention kernel cannot take head dim ``d``, value rank ``rv`` and ``group``
  query heads per KV head (None: it can). Shared by ``supports`` and the kernel's wrapper."""
  if d < 32 or d & (d - 1):
    return f"head dim {d} is not a power of two >= 32"
  if rv > KV_MAX_RV or group > KV_MAX_GROUP:
    return (
      f"r_v={rv} (at most {KV_MAX_RV}) or {group} query heads per KV head "
      f"(at most {KV_MAX_GROUP}) unsupported"
    )
  return None


def kv_attention_supports(avals, params) -> str | None:
  from lrjax.lowering.kv_attention import split_operands

  if (reason := _toolchain()) is not None:
    return reason
  q, zk, zv, vk, vv, _, _, bk, bv = split_operands(avals, params["has_bk"], params["has_bv"])
  if _dt(q) not in _KERNEL_DTYPES:
    return f"q dtype {_dt(q)} not in {_KERNEL_DTYPES}"
  for name, a in (("zk", zk), ("zv", zv), ("vk", vk), ("vv", vv)):
    if _dt(a) != _dt(q):
      return f"{name} dtype {_dt(a)} != q dtype {_dt(q)} (cast the cache to the model dtype)"
  if reason := kv_attention_shape_reason(
    q.shape[2], zv.shape[2], q.shape[1] // (vk.shape[1] // q.shape[2])
  ):
    return reason
  if zk.shape[0] * zk.shape[1] * max(zk.shape[2], zv.shape[2]) > _INT32_MAX:
    return "cache too large for 32-bit offsets"
  return None


def kv_attention_faster(avals, params) -> str | None:
  del avals, params
  return _switch_off("kv_attention")


def _kv_attention_impl():
  from lrjax.custom_calls.triton.kv_attention import kv_attention
  from lrjax.lowering.kv_attention import split_operands

  def impl(*ops, has_bk, has_bv, window):
    q, zk, zv, vk, vv, pos, inv, bk, bv = split_operands(ops, has_bk, has_bv)
    return kv_attention(q, zk, zv, vk, vv, pos, inv, bk, bv, window=window)

  return impl


def decode_attention_shape_reason(q_shape, dtypes) -> str | None:
  """Why lrjax's decode-attention kernel cannot take these operands (None: it can)."""
  d = q_shape[2]
  # f32 stays on XLA (the kernels' dots would run on TF32)
  if any(dt not in _KERNEL_DTYPES for dt in dtypes) or len(set(dtypes)) != 1:
    return f"dtypes {dtypes}: q, k and v must share one of {_KERNEL_DTYPES}"
  if d < 16 or d > 256 or d & (d - 1):
    return f"head dim {d} is not a power of two in [16, 256]"
  return None


def decode_attention_supports(avals, params) -> str | None:
  del params
  q, k, v, _ = avals
  return _toolchain() or decode_attention_shape_reason(q.shape, (_dt(q), _dt(k), _dt(v)))


def pallas_decode_attention_supports(avals, params) -> str | None:
  from lrjax.custom_calls.triton.decode_attention_pallas import PALLAS_MODULE, shape_reason

  # jax 0.11 deprecates the Pallas Triton backend; a later jax may not have it
  if importlib.util.find_spec(PALLAS_MODULE) is None:
    return f"this jax has no {PALLAS_MODULE}"

  q, k, v, _ = avals
  return shape_reason(q.shape, k.shape, (_dt(q), _dt(k), _dt(v)), params.get("length"))


# decode_attention_append's kernel passed its GPU tests on an H100 (test_decode_attention_gpu.py
# -k append, compiled without FP contraction); False declines it
APPEND_GPU_VERIFIED = True


def decode_attention_append_supports(avals, params) -> str | None:
  del params
  q, kn, vn, kc, vc, _, cos, _ = avals
  dts = (_dt(q), _dt(kc), _dt(vc))
  reason = _toolchain() or decode_attention_shape_reason(q.shape, dts)
  if reason is None and len({*dts, _dt(kn), _dt(vn), _dt(cos)}) > 1:
    reason = f"q, k_new, v_new, the caches and cos/sin must share one dtype, got {dts}"
  if reason is None and not APPEND_GPU_VERIFIED:
    reason = "its kernel has not yet run on a GPU (lowering.APPEND_GPU_VERIFIED)"
  return reason


def decode_attention_faster(avals, params) -> str | None:
  del avals, params
  return _switch_off("decode_attention")


def decode_attention_append_faster(avals, params) -> str | None:
  """The attention kernels' switch (``dispatch.decode_attention``), then the table's
  ``dispatch.attention_append``: RoPE and the cache writes in the attention's launches."""
  return decode_attention_faster(avals, params) or _switch_off("attention_append")


def _decode_attention_impl():
  from lrjax.custom_calls.triton.decode_attention import decode_attention

  return decode_attention


def _decode_attention_append_impl():
  from lrjax.custom_calls.triton.decode_attention_append import decode_attention_append

  return decode_attention_append


def _pallas_decode_attention_impl():
  from lrjax.custom_calls.triton.decode_attention_pallas import decode_attention

  return decode_attention


KERNELS = [
  KernelLowering(
    "lr_xuv",
    "cuda",
    "triton.xuv_decode",
    xuv_decode_supports,
    _xuv_impl("xuv_decode", "xuv_decode"),
    priority=20,
    faster=xuv_faster,
  ),
  KernelLowering(
    "lr_xuv",
    "cuda",
    "triton.xuv_prefill",
    xuv_prefill_supports,
    _xuv_impl("xuv_prefill", "xuv_prefill"),
    priority=10,
    faster=xuv_faster,
  ),
  KernelLowering(
    "lr_mlp",
    "cuda",
    "triton.mlp_decode",
    mlp_decode_supports,
    _mlp_impl("mlp_decode", "mlp_decode"),
    priority=20,
    faster=mlp_faster,
  ),
  KernelLowering(
    "lr_mlp",
    "cuda",
    "triton.mlp_prefill",
    mlp_prefill_supports,
    _mlp_impl("mlp_prefill", "mlp_prefill"),
    priority=10,
    faster=mlp_faster,
  ),
  KernelLowering(
    "lr_xuv_group",
    "cuda",
    "triton.xuv_decode_group",
    xuv_group_supports,
    _group_impl,
    priority=20,
    faster=xuv_group_faster,
  ),
  KernelLowering(
    "lr_normed",
    "cuda",
    "triton.normed",
    normed_supports,
    _normed_impl,
    priority=20,
    faster=normed_faster,
  ),
  KernelLowering(
    "lr_residual",
    "cuda",
    "triton.residual",
    residual_supports,
    _residual_impl,
    priority=20,
    faster=residual_faster,
  ),
  KernelLowering(
    "lr_kv_attention",
    "cuda",
    "triton.kv_attention",
    kv_attention_supports,
    _kv_attention_impl,
    priority=10,
    faster=kv_attention_faster,
  ),
  KernelLowering(
    "decode_attention",
    "cuda",
    "pallas.decode_attention",
    pallas_decode_attention_supports,
    _pallas_decode_attention_impl,
    priority=20,
    faster=decode_attention_faster,
  ),
  KernelLowering(
    "decode_attention",
    "cuda",
    "triton.decode_attention",
    decode_attention_supports,
    _decode_attention_impl,
    priority=10,
    faster=decode_attention_faster,
  ),
  KernelLowering(
    "decode_attention_append",
    "cuda",
    "triton.decode_attention_append",
    decode_attention_append_supports,
    _decode_attention_append_impl,
    priority=10,
    faster=decode_attention_append_faster,
  ),
]


def register() -> None:
  """Registers the CUDA kernels (cheap: nothing is imported until a kernel is chosen)."""
  for k in KERNELS:
    _register(k)
