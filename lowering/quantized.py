"""Primitives of the W4A8 quantized path (int4 weights, int8 activations, int32 sums).

Operand order (positional operands; everything else is a static param):

``w4a8_matmul_p``   x, w, scales[, bias]
    x       [..., K]            float32 | bfloat16 | float16 activations
    w       [Np/BW, Kp/8, 4 BW] uint8, the int4 weight packed for ``layout``
    scales  [G, Np]             float32 per-group (or per-channel, G = 1) scales
    bias    [N]                 float32, present iff ``has_bias``
    params: n (N), group (32/64/128/any multiple of 8, or 0 = per channel),
            layout ("x86_vnni" | "arm_sdot4" | "arm_smmla8"), has_bias, out_dtype
    Kp = roundup(K, 8), Np = roundup(N, BW), BW = 16 / 4 / 8 per layout,
    G = ceil(K / group) (1 if per channel).

``lr_xuv_w4a8_p``   x, wu, su, wv, sv[, bias][, scale]
    (wu, su) is U [K -> r] and (wv, sv) is V [r -> N], each packed like ``w`` above;
    scale [r] float32, present iff the optional param ``has_scale`` (absent without one).
    params: r, n, group_u, group_v, layout (shared), has_bias, out_dtype.
    One kernel computes t = x·U in f32 (times the scale, in f32), re-quantizes each row
    of t to int8 and computes t·V (+ bias): the rank-r intermediate never leaves the
    handler.

Numerics (the C++ kernel and the references below agree; see custom_calls/cpu/w4a8.h):
  per row of x: amax = max|x|, xq = clip(round_half_even(x * (127/amax)), -127, 127),
  sa = amax/127; acc = sum over groups g, in order, of f32(int32 dot of the group)
  * scales[g]; y = acc * sa (+ bias), cast to out_dtype. A row holding a NaN or an inf, or
  with 0 < amax < 2^-96, is not quantized: y = x · (q·s) in f32 (+ bias), so NaN and inf
  propagate as f32 math does; in X·U·V the rank-space row follows suit.

Fusion (for the lead's pass). A quantized low-rank layer's plain forward
(``lrjax.quant.QuantizedLowRankLinear``) traces to exactly::

    t = w4a8_matmul[n=r group=gu layout=L has_bias=False out_dtype=float32] x wu su
    y = w4a8_matmul[n=N group=gv layout=L has_bias=True  out_dtype=D] t wv sv b

(``has_bias=False`` and no ``b`` operand when the layer has no bias). When ``t``
has no other use, the pair is rewritten as (a rank-space scale ``t * s`` between them,
s [r] or a scalar, becomes the ``scale`` operand: the unfused second matmul quantizes the
same f32 product)::

    y = lr_xuv_w4a8[**fused_xuv_params(eqn_t.params, eqn_y.params, has_bias)] x wu su wv sv [b]

A separate ``add(y, b)`` after a bias-free second matmul may also be folded in
(operand ``b`` of dtype float32, shape [N]) with ``has_bias=True``.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive

from lrjax.lowering import primitives

LAYOUTS = {"x86_vnni": 0, "arm_sdot4": 1, "arm_smmla8": 2}
BLOCK_WIDTH = {"x86_vnni": 16, "arm_sdot4": 4, "arm_smmla8": 8}
QUANT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def round_up(a: int, b: int) -> int:
  return -(-a // b) * b


def num_groups(k: int, group: int) -> int:
  return 1 if group == 0 else -(-k // group)


def packed_shape(k: int, n: int, layout: str) -> tuple[int, int, int]:
  """Shape of a packed [K, N] int4 weight in ``layout``."""
  bw = BLOCK_WIDTH[layout]
  return (round_up(n, bw) // bw, round_up(k, 8) // 8, 4 * bw)


def scales_shape(k: int, n: int, group: int, layout: str) -> tuple[int, int]:
  return (num_groups(k, group), round_up(n, BLOCK_WIDTH[layout]))


def check_weight(name: str, k: int, n: int, group: int, layout: str, w, s) -> None:
  """Validates one packed weight (w, scales) for a [k, n] projection."""
  if layout not in LAYOUTS:
    raise ValueError(f"{layout=} is not a W4A8 layout; expected one of {sorted(LAYOUTS)}")
  if not isinstance(group, (int, np.integer)) or group < 0 or group % 8:
    raise ValueError(f"{group=} must be 0 (per channel) or a positive multiple of 8")
  if jnp.dtype(w.dtype) != jnp.uint8 or tuple(w.shape) != packed_shape(k, n, layout):
    raise ValueError(
      f"{name}: packed weight {w.shape} {w.dtype} must be uint8 "
      f"{packed_shape(k, n, layout)} for K={k}, N={n}, {layout=}"
    )
  if jnp.dtype(s.dtype) != jnp.float32 or tuple(s.shape) != scales_shape(k, n, group, layout):
    raise ValueError(
      f"{name}: scales {s.shape} {s.dtype} must be float32 "
      f"{scales_shape(k, n, group, layout)} for K={k}, {group=}"
    )


def _check_x(x, bias, n):
  if jnp.dtype(x.dtype) not in QUANT_DTYPES:
    raise TypeError(f"{x.dtype=} is not supported; expected float32, bfloat16 or float16")
  if x.ndim < 1:
    raise ValueError(f"{x.shape=} must have at least one dim [..., K]")
  if bias is not None and (tuple(bias.shape) != (n,) or jnp.dtype(bias.dtype) != jnp.float32):
    raise ValueError(f"{bias.shape=} {bias.dtype} must be float32 ({n},)")


# ------------------------------------------------------------------ references


def unpack_int4(w, k: int, n: int, layout: str):
  """q [k, n] int8 in [-8, 7] from a packed weight (jnp, traceable)."""
  bw = BLOCK_WIDTH[layout]
  nb, kc, _ = w.shape
  w = w.astype(jnp.int32)
  if layout == "arm_smmla8":
    b = w.reshape(nb, kc, 2, 2, 8)  # [nb, kc, h, cc, j]
    u = jnp.stack([b >> 4, b & 15], axis=-1)  # [nb, kc, h, cc, j, p]
    u = u.transpose(1, 4, 0, 2, 5, 3)  # [kc, j, nb, h, p, cc]
  else:
    b = w.reshape(nb, kc, bw, 4)  # [nb, kc, c, j]
    u = jnp.stack([b & 15, b >> 4], axis=-1)  # [nb, kc, c, j, h]
    u = u.transpose(1, 4, 3, 0, 2)  # [kc, h, j, nb, c]
  return (u.reshape(kc * 8, nb * bw)[:k, :n] - 8).astype(jnp.int8)


MIN_ROW_AMAX = 2.0**-96  # rows with 0 < amax below this are not quantized (see below)


def quantize_rows(x2):
  """Per-row abs-max int8 quantization: (xq [M, K] int8, sa [M] f32).

  A row that is not quantized gets xq = 0 and sa = NaN: one holding a NaN or an inf, or with
  0 < amax < ``MIN_ROW_AMAX`` (127/amax or sa would leave the normal f32 range). Its outputs
  come from :func:`_exact_rows`.
  """
  x2 = x2.astype(jnp.float32)
  finite = jnp.all(jnp.isfinite(x2), axis=-1)
  amax = jnp.max(jnp.where(jnp.isfinite(x2), jnp.abs(x2), 0), axis=-1)
  exact = ~finite | ((amax > 0) & (amax < jnp.float32(MIN_ROW_AMAX)))
  amax = jnp.where(exact, 0, amax)
  inv = jnp.where(amax > 0, jnp.float32(127) / jnp.where(amax > 0, amax, 1), 0).astype(jnp.float32)
  xq = jnp.clip(jnp.round(jnp.where(exact[:, None], 0, x2) * inv[:, None]), -127, 127)
  sa = jnp.where(exact, jnp.float32(jnp.nan), amax / jnp.float32(127))
  return xq.astype(jnp.int8), sa


def _w4a8_core(x2, w, s, k, n, group, layout):
  """acc [M, n] f32 and sa [M] (see module docstring), groups summed in order."""
  m = x2.shape[0]
  xq, sa = quantize_rows(x2)
  q = unpack_int4(w, k, n, layout)
  grp = k if group == 0 else group
  g = num_groups(k, group)
  kp = g * grp
  xq = jnp.pad(xq, ((0, 0), (0, kp - k))).reshape(m, g, grp).transpose(1, 0, 2)
  q = jnp.pad(q, ((0, kp - k), (0, 0))).reshape(g, grp, n)

  def step(acc, xs):
    xg, qg, sg = xs
    i = jax.lax.dot(xg, qg, preferred_element_type=jnp.int32)
    return acc + i.astype(jnp.float32) * sg[None, :n], None

  acc, _ = jax.lax.scan(step, jnp.zeros((m, n), jnp.float32), (xq, q, s))
  return acc, sa


def _exact_rows(x2, w, s, k, n, group, layout):
  """y [M, n] = x · (q s) in f32 over the dequantized weights: the outputs of the rows that
  are not quantized. NaN and inf propagate as f32 math does."""
  q = unpack_int4(w, k, n, layout).astype(jnp.float32)
  grp = k if group == 0 else group
  wd = q * s[jnp.arange(k) // grp, :n]
  return jnp.dot(x2, wd, precision=jax.lax.Precision.HIGHEST)


def _w4a8_apply(x, w, s, bias, k, n, group, layout):
  x2 = x.reshape(-1, k).astype(jnp.float32)
  acc, sa = _w4a8_core(x2, w, s, k, n, group, layout)
  y = acc * sa[:, None]
  bad = jnp.isnan(sa)
  y = jax.lax.cond(
    jnp.any(bad),
    lambda: jnp.where(bad[:, None], _exact_rows(x2, w, s, k, n, group, layout), y),
    lambda: y,
  )
  if bias is not None:
    y = y + bias[None, :]
  return y


def _w4a8_ref_ops(x, w, s, *rest, n, group, layout, has_bias, out_dtype):
  k = x.shape[-1]
  y = _w4a8_apply(x, w, s, rest[0] if has_bias else None, k, n, group, layout)
  return y.astype(out_dtype).reshape(x.shape[:-1] + (n,))


def _xuv_w4a8_ref_ops(
  x, wu, su, wv, sv, *rest, r, n, group_u, group_v, layout, has_bias, out_dtype, has_scale=False
):
  k = x.shape[-1]
  t = _w4a8_apply(x, wu, su, None, k, r, group_u, layout)  # f32, never rounded
  if has_scale:
    t = t * rest[-1]  # f32 [r]
  y = _w4a8_apply(t, wv, sv, rest[0] if has_bias else None, r, n, group_v, layout)
  return y.astype(out_dtype).reshape(x.shape[:-1] + (n,))


# ------------------------------------------------------------------ primitives

w4a8_matmul_p = Primitive("w4a8_matmul")
lr_xuv_w4a8_p = Primitive("lr_xuv_w4a8")


@w4a8_matmul_p.def_abstract_eval
def _w4a8_abstract(x, w, s, *rest, n, group, layout, has_bias, out_dtype):
  _check_x(x, rest[0] if has_bias else None, n)
  check_weight("w", x.shape[-1], n, group, layout, w, s)
  return jax.core.ShapedArray(x.shape[:-1] + (n,), out_dtype)


@lr_xuv_w4a8_p.def_abstract_eval
def _xuv_w4a8_abstract(
  x, wu, su, wv, sv, *rest, r, n, group_u, group_v, layout, has_bias, out_dtype, has_scale=False
):
  _check_x(x, rest[0] if has_bias else None, n)
  if has_scale:
    _check_scale(rest[-1], r)
  check_weight("u", x.shape[-1], r, group_u, layout, wu, su)
  check_weight("v", r, n, group_v, layout, wv, sv)
  return jax.core.ShapedArray(x.shape[:-1] + (n,), out_dtype)


primitives.register_reference(w4a8_matmul_p, _w4a8_ref_ops)
primitives.register_reference(lr_xuv_w4a8_p, _xuv_w4a8_ref_ops)


def _check_scale(scale, r: int) -> None:
  if scale.shape != (r,) or jnp.dtype(scale.dtype) != jnp.dtype(jnp.float32):
    raise ValueError(f"scale {scale.shape} {scale.dtype}: expected float32 [{r}], the rank")


def _out_dtype(x, out_dtype):
  dt = jnp.dtype(out_dtype or x.dtype)
  if dt not in QUANT_DTYPES:
    raise TypeError(f"{out_dtype=} is not supported; expected float32, bfloat16 or float16")
  return dt


def w4a8_matmul(x, w, scales, bias=None, *, n: int, group: int, layout: str, out_dtype=None):
  """y [..., n] = W4A8(x [..., K] · W [K, n]) (+ bias): int4 W, per-row int8 x, int32 sums.

  ``w``/``scales`` come from :func:`lrjax.quant.quantize_weight`. On CPU this lowers
  to the C++ XLA FFI kernel; elsewhere (or when it declines) to the jnp reference.
  """
  dt = _out_dtype(x, out_dtype)
  if bias is not None:
    bias = jnp.asarray(bias, jnp.float32)
  ops = (x, w, scales) + ((bias,) if bias is not None else ())
  _check_x(x, bias, n)
  check_weight("w", x.shape[-1], n, group, layout, w, scales)
  return w4a8_matmul_p.bind(
    *ops, n=int(n), group=int(group), layout=layout, has_bias=bias is not None, out_dtype=dt
  )


def lr_xuv_w4a8(
  x,
  wu,
  su,
  wv,
  sv,
  bias=None,
  *,
  r: int,
  n: int,
  group_u: int,
  group_v: int,
  layout: str,
  out_dtype=None,
  scale=None,
):
  """y = W4A8((W4A8(x · U) ⊙ scale) · V) (+ bias) in one kernel; see the module docstring.
  ``scale``: optional [r] (or a scalar), multiplied into the f32 intermediate in f32."""
  dt = _out_dtype(x, out_dtype)
  if bias is not None:
    bias = jnp.asarray(bias, jnp.float32)
  _check_x(x, bias, n)
  check_weight("u", x.shape[-1], r, group_u, layout, wu, su)
  check_weight("v", r, n, group_v, layout, wv, sv)
  ops = (x, wu, su, wv, sv) + ((bias,) if bias is not None else ())
  extra = {}
  if scale is not None:
    scale = jnp.broadcast_to(jnp.asarray(scale, jnp.float32), (int(r),))
    ops, extra = ops + (scale,), {"has_scale": True}
  return lr_xuv_w4a8_p.bind(
    *ops,
    r=int(r),
    n=int(n),
    group_u=int(group_u),
    group_v=int(group_v),
    layout=layout,
    has_bias=bias is not None,
    out_dtype=dt,
    **extra,
  )


def fused_xuv_params(
  params_u: Mapping[str, Any], params_v: Mapping[str, Any], has_bias: bool
) -> dict:
  """Params of ``lr_xuv_w4a8_p`` replacing ``w4a8_matmul(w4a8_matmul(x, *U), *V)``.

  ``params_u``/``params_v`` are the two eqns' params; ``has_bias`` says whether a
  bias operand follows V's (from the second matmul's own bias or a folded add).
  Raises ValueError when the pair cannot be fused.
  """
  if params_u["has_bias"]:
    raise ValueError("the first w4a8_matmul has a bias; lr_xuv_w4a8 adds a bias only after V")
  if params_u["layout"] != params_v["layout"]:
    raise ValueError(f"layouts differ: {params_u['layout']=} vs {params_v['layout']=}")
  return dict(
    r=int(params_u["n"]),
    n=int(params_v["n"]),
    group_u=int(params_u["group"]),
    group_v=int(params_v["group"]),
    layout=params_u["layout"],
    has_bias=bool(has_bias),
    out_dtype=jnp.dtype(params_v["out_dtype"]),
  )


def w4a8_matmul_reference(x, w, scales, bias=None, *, n, group, layout, out_dtype=None):
  """Pure-jnp reference of :func:`w4a8_matmul` (also its default lowering)."""
  dt = _out_dtype(x, out_dtype)
  ops = (x, w, scales) + ((jnp.asarray(bias, jnp.float32),) if bias is not None else ())
  return _w4a8_ref_ops(
    *ops, n=n, group=group, layout=layout, has_bias=bias is not None, out_dtype=dt
  )


def lr_xuv_w4a8_reference(
  x, wu, su, wv, sv, bias=None, *, r, n, group_u, group_v, layout, out_dtype=None, scale=None
):
  """Pure-jnp reference of :func:`lr_xuv_w4a8` (also its default lowering)."""
  dt = _out_dtype(x, out_dtype)
  ops = (x, wu, su, wv, sv) + ((jnp.asarray(bias, jnp.float32),) if bias is not None else ())
  extra = {}
  if scale is not None:
    ops += (jnp.broadcast_to(jnp.asarray(scale, jnp.float32), (int(r),)),)
    extra = {"has_scale": True}
  return _xuv_w4a8_ref_ops(
    *ops,
    r=r,
    n=n,
    group_u=group_u,
    group_v=group_v,
    layout=layout,
    has_bias=bias is not None,
    out_dtype=dt,
    **extra,
  )
