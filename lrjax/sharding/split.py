"""The ``lowrank_split`` layer program: no factor replicated, the hidden state split over "tp".

Per device (n = TP; E, F, H·D, KV·D split n ways; every factor holds 1/n of its params):

  h_l [.., E/n]                              the residual stream, split on hidden
  t = [hw_l·Uq_l | hw_l·Uk_l | hw_l·Uv_l | Σ h_l²]       hw = h ⊙ w_norm (the scale deferred)
  psum(t)                                    ① one all-reduce: q/k/v rank-space partial sums and
                                               the RMSNorm's sum of squares, in f32
  q = (tq·s)·Vq_l, k, v likewise             s = rsqrt(Σh²/E + eps); local heads (GQA local)
  attention on the local heads (and the KV cache's local heads)
  to = a_l·Uo_l; psum(to)                    ② o's rank-space partial sums
  h_l += to·Vo_l                             back to the split residual, no gather
  psum([hw2_l·Ug_l | hw2_l·Uu_l | Σ h_l²])   ③ gate/up partial sums and the second norm's
  s_d = lr_mlp_rank(pg, Vg_l, pu, Vu_l, Ud_l)   the SwiGLU on the F/n local columns and down's
                                               first factor (a kernel where one serves)
  psum(s_d); h_l += s_d·Vd_l                 ④ down's rank-space partial sums

Four all-reduces a layer, all in rank space; Megatron runs two of hidden width. RMSNorm
commutes with the first factor up to the per-token scale s: (h ⊙ w ⊙ s)·U = s ⊙ ((h ⊙ w)·U),
so the norm's reduction rides in the same collective as the projection's partial sums.

:func:`install` gives each decoder layer of a model this program as its ``__call__`` (the layer
becomes a :class:`SplitDecoderLayer`; params, their paths and checkpoints are unchanged), which
:func:`lrjax.sharding.shard` does for ``lowrank_split``. The program binds ``lr_mlp_rank`` on
local shapes (``lrjax.fuse`` leaves shard_map bodies to lrjax.sharding), and a decode step's
``decode_attention`` on the local heads; every other product is an XLA GEMM, since a
collective sits between the two factors of every pair.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lrjax.models.llama import DecoderLayer, rope_and_attend
from lrjax.sharding.rules import param_spec

log = logging.getLogger("lrjax.sharding")

STRATEGY = "lowrank_split"
AX = "tp"
_F32 = jnp.float32


class SplitDecoderLayer(DecoderLayer):
  """A :class:`~lrjax.models.llama.DecoderLayer` whose forward is the ``lowrank_split`` program
  (module docstring) over the mesh in ``self.tp_mesh``. Made by :func:`install`, never built."""

  def __call__(
    self, h, positions, inv_freq, mask, kv=None, write_pos=None, taps=None, attend_cache=True
  ):
    if taps is not None:
      raise ValueError(
        "taps (calibration inputs) are not collected under lowrank_split; calibrate the "
        "unsharded model (or shard with another strategy)"
      )
    return forward(self, h, positions, inv_freq, mask, kv, write_pos, attend_cache)


def install(model, mesh: Mesh) -> None:
  """Makes every decoder layer of ``model`` run the lowrank_split program on ``mesh``."""
  for i, layer in enumerate(model.layers):
    if type(layer) not in (DecoderLayer, SplitDecoderLayer):
      raise ValueError(
        f"layer {i} is a {type(layer).__name__}; lowrank_split runs lrjax's DecoderLayer "
        "(use another strategy for other layer types)"
      )
    check_layer(layer, i)
    layer.__class__ = SplitDecoderLayer
    layer.tp_mesh = mesh


def uninstall(model) -> None:
  """Undoes :func:`install` (when a model is sharded again with another strategy)."""
  for layer in model.layers:
    if type(layer) is SplitDecoderLayer:
      layer.__class__ = DecoderLayer
      del layer.tp_mesh


def check_layer(layer, index: int = 0) -> None:
  """ValueError naming the fix if ``layer`` has a projection the program cannot run."""
  for grp, names in (
    (layer.attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
    (layer.mlp, ("gate_proj", "up_proj", "down_proj")),
  ):
    for name in names:
      m = getattr(grp, name)
      if _kind(m) == "headwise" and name in ("o_proj", "gate_proj", "up_proj", "down_proj"):
        raise ValueError(
          f"layer {index} {name}: per-head factors are supported on q/k/v only under "
          "lowrank_split (use lowrank_tp)"
        )


def _kind(m) -> str:
  if hasattr(m, "kernel"):
    return "dense"
  if getattr(m, "v", None) is not None and m.v.ndim == 3:
    return "headwise"
  return "lowrank"


def _arrays_and_specs(layer):
  """{path: array}, {path: PartitionSpec} of the layer's params under lowrank_split."""
  _, state = nnx.split(layer)
  arrays, specs = {}, {}
  for path, var in nnx.to_flat_state(state):
    key = ".".join(str(p) for p in path)
    axes = tuple(var.get_metadata().get("out_sharding") or ())
    arrays[key] = var[...]
    specs[key] = param_spec(STRATEGY, key, axes, var.ndim)
  return arrays, specs


def _proj_static(layer, grp: str, name: str) -> dict:
  m = getattr(getattr(layer, grp), name)
  out = {"kind": _kind(m), "dtype": m.dtype, "bias": m.bias is not None}
  if out["kind"] == "headwise":
    out["heads"] = m.heads
  return out


def forward(layer, h, positions, inv_freq, mask, kv, write_pos, attend_cache):
  """The layer on the mesh ``layer.tp_mesh``: (h, kv) like ``DecoderLayer.__call__``, h split on
  hidden (in and out)."""
  mesh = layer.tp_mesh
  cfg = layer.attn.cfg
  arrays, specs = _arrays_and_specs(layer)
  static = {
    "cfg": cfg,
    "n1": (layer.input_layernorm.eps, layer.input_layernorm.dtype),
    "n2": (layer.post_attention_layernorm.eps, layer.post_attention_layernorm.dtype),
    "qk_norm": None
    if layer.attn.q_norm is None
    else (layer.attn.q_norm.eps, layer.attn.q_norm.dtype),
    "projs": {
      n: _proj_static(layer, "attn" if n[0] in "qkvo" else "mlp", n)
      for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    },
    "attend_cache": attend_cache,
  }
  act = P("data", None, AX)
  row = P("data", None)
  kv_spec = P("data", AX, None, None)
  args = (arrays, h, positions, inv_freq, mask)
  in_specs = (specs, act, row, P(), P("data", None, None))
  out_specs = (act, (kv_spec, kv_spec) if kv is not None else None)
  if kv is not None:
    args += (tuple(kv), write_pos)
    in_specs += ((kv_spec, kv_spec), P("data"))
  body = functools.partial(_local_layer, static=static)
  out = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
    *args
  )
  return out[0], (None if kv is None else tuple(out[1]))


def _rms_scale(ss, dim: int, eps: float):
  """1/rms from the all-reduced sum of squares ss [.., 1] (f32)."""
  return jax.lax.rsqrt(ss / dim + eps)


def _rmsnorm(x, w, eps, dtype):
  """lrjax.models.llama.RMSNorm on a whole last axis (the q/k norms over head_dim)."""
  dt = dtype or x.dtype
  x32 = x.astype(_F32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return w.astype(dt) * y.astype(dt)


def _weighted(h, w, dtype):
  """h ⊙ w in the norm's output dtype (the norm's 1/rms is applied after the first factor),
  and the local sum of squares [.., 1] in f32."""
  dt = dtype or h.dtype
  h32 = h.astype(_F32)
  return w.astype(dt) * h.astype(dt), jnp.sum(h32 * h32, axis=-1, keepdims=True)


def _first(x, a, prefix, st):
  """This device's partial sum of the projection's first product [.., r] (f32): x·u_l for a
  low-rank pair, x·W_l (the whole output width) for a dense kernel split on its input."""
  dt = st["dtype"] or x.dtype
  w = a[prefix + ".kernel"] if st["kind"] == "dense" else a[prefix + ".u"]
  return jnp.matmul(x.astype(dt), w.astype(dt), preferred_element_type=_F32)


def _second(t, a, prefix, st, scale, n_out_local):
  """The projection's local output columns from its all-reduced first product ``t`` [.., r]
  (f32), times the per-token ``scale`` if given: as LowRankLinear, (x·u) rounded to the
  projection's dtype, then ·v_l (+ b_l)."""
  if scale is not None:
    t = t * scale
  dt = st["dtype"] or st["x_dtype"]
  p = t.astype(dt)
  if st["kind"] == "dense":  # the whole width was reduced: keep this device's columns
    i = jax.lax.axis_index(AX)
    y = jax.lax.dynamic_slice_in_dim(p, i * n_out_local, n_out_local, axis=p.ndim - 1)
  elif st["kind"] == "headwise":
    v = a[prefix + ".v"].astype(dt)  # [H/n, r_h, d]
    hl, rh, _ = v.shape
    i = jax.lax.axis_index(AX)
    z = jax.lax.dynamic_slice_in_dim(p, i * hl * rh, hl * rh, axis=p.ndim - 1)
    z = z.reshape(*z.shape[:-1], hl, rh)
    y = jnp.einsum("...hr,hrd->...hd", z, v).reshape(*z.shape[:-2], -1)
  else:
    y = jnp.matmul(p, a[prefix + ".v"].astype(dt))
  if st["bias"]:
    y = y + a[prefix + ".bias"].astype(dt)
  return y


def _psum_concat(parts):
  """One all-reduce over the last-axis concatenation of ``parts``; returns them split again."""
  widths = [p.shape[-1] for p in parts]
  t = jax.lax.psum(jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0], AX)
  out, o = [], 0
  for w in widths:
    out.append(t[..., o : o + w])
    o += w
  return out


def _local_layer(a, h, positions, inv_freq, mask, kv=None, write_pos=None, *, static):
  from lrjax.lowering.mlp_rank import lr_mlp_rank

  cfg = static["cfg"]
  projs = static["projs"]
  n = jax.lax.axis_size(AX)
  e = cfg.hidden_size
  hq, hkv, d = cfg.num_heads // n, cfg.num_kv_heads // n, cfg.head_dim
  b, s = h.shape[:2]

  # ① q/k/v partial sums and the input norm's sum of squares: one all-reduce
  eps1, dt1 = static["n1"]
  x, ss = _weighted(h, a["input_layernorm.weight"], dt1)
  names = ("q_proj", "k_proj", "v_proj")
  st = {k: dict(projs[k], x_dtype=x.dtype) for k in projs}
  parts = [_first(x, a, f"attn.{k}", st[k]) for k in names]
  *ts, ss = _psum_concat(parts + [ss])
  scale = _rms_scale(ss, e, eps1)
  out_w = {"q_proj": hq * d, "k_proj": hkv * d, "v_proj": hkv * d}
  q, k, v = (_second(t, a, f"attn.{nm}", st[nm], scale, out_w[nm]) for nm, t in zip(names, ts))
  q, k, v = q.reshape(b, s, hq, d), k.reshape(b, s, hkv, d), v.reshape(b, s, hkv, d)
  if static["qk_norm"] is not None:
    eps_qk, dt_qk = static["qk_norm"]
    q = _rmsnorm(q, a["attn.q_norm.weight"], eps_qk, dt_qk)
    k = _rmsnorm(k, a["attn.k_norm.weight"], eps_qk, dt_qk)
  # RoPE and attention on the local heads (as DecoderLayer.__call__)
  att, kv = rope_and_attend(
    q, k, v, positions, inv_freq, mask, kv, write_pos, static["attend_cache"],
    window=cfg.sliding_window,
  )  # fmt: skip

  # ② o's rank-space partial sums
  st_o = dict(projs["o_proj"], x_dtype=att.dtype)
  (to,) = _psum_concat([_first(att, a, "attn.o_proj", st_o)])
  h = h + _second(to, a, "attn.o_proj", st_o, None, e // n)

  # ③ gate/up partial sums and the second norm's sum of squares: one all-reduce
  eps2, dt2 = static["n2"]
  x2, ss2 = _weighted(h, a["post_attention_layernorm.weight"], dt2)
  st_g = dict(projs["gate_proj"], x_dtype=x2.dtype)
  st_u = dict(projs["up_proj"], x_dtype=x2.dtype)
  st_d = dict(projs["down_proj"], x_dtype=x2.dtype)
  tg, tu, ss2 = _psum_concat(
    [_first(x2, a, "mlp.gate_proj", st_g), _first(x2, a, "mlp.up_proj", st_u), ss2]
  )
  scale2 = _rms_scale(ss2, e, eps2)
  f_l = cfg.intermediate_size // n
  if st_g["kind"] == st_u["kind"] == st_d["kind"] == "lowrank":
    dt = st_u["dtype"] or x2.dtype
    pg, pu = (tg * scale2).astype(dt), (tu * scale2).astype(dt)
    vb = lambda nm: (
      (a[f"mlp.{nm}.v"].astype(dt),)
      + (  # noqa: E731
        (a[f"mlp.{nm}.bias"].astype(dt),) if projs[nm]["bias"] else ()
      )
    )
    sd = lr_mlp_rank(
      pu,
      vb("up_proj"),
      a["mlp.down_proj.u"].astype(dt),
      pg=pg,
      gate=vb("gate_proj"),
      act="silu",
      inter_dtype=dt,
      out_dtype=_F32,
    )
  else:  # a dense projection among them: the same maths in jnp
    g = _second(tg, a, "mlp.gate_proj", st_g, scale2, f_l)
    u = _second(tu, a, "mlp.up_proj", st_u, scale2, f_l)
    sd = _first(jax.nn.silu(g) * u, a, "mlp.down_proj", dict(st_d, x_dtype=g.dtype))

  # ④ down's rank-space partial sums
  (td,) = _psum_concat([sd])
  st_d = dict(st_d, x_dtype=st_u["dtype"] or x2.dtype)  # down's input: silu(g)·u's dtype
  h = h + _second(td, a, "mlp.down_proj", st_d, None, e // n)
  return h, kv
