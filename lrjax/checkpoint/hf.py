"""HF checkpoints: load config.json + safetensors into an NNX model, and export a (low-rank) model.

Tensor names follow transformers (``model.layers.{i}.self_attn.q_proj.weight`` [out, in], etc.).
A low-rank projection ``<p>_proj`` (p in q, k, v, o, gate, up, down) is stored as two torch-layout
linears ``<p>_u_proj.weight`` [rank, in] and ``<p>_v_proj.weight`` [out, rank] (bias, if any, as
``<p>_v_proj.bias``), so y = v_proj(u_proj(x)); ``config.json`` carries the ranks under
``lrjax_lowrank``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from lrjax.checkpoint.atomic import atomic_dir
from lrjax.checkpoint.placement import logical_sharding, param_axes, param_key, pick
from lrjax.checkpoint.safetensors_io import (
  INDEX_NAME,
  SINGLE_NAME,
  SafetensorsDir,
  plan_shards,
  write_safetensors,
)
from lrjax.models.config import ModelConfig
from lrjax.models.llama import LlamaForCausalLM

log = logging.getLogger("lrjax.checkpoint")

LOWRANK_KEY = "lrjax_lowrank"
COMPRESSION_KEY = "lrjax_compression"
_FLOAT_TAGS = ("F32", "F16", "BF16", "F64")
_DTYPE_NAMES = {
  "float32": jnp.float32,
  "float16": jnp.float16,
  "bfloat16": jnp.bfloat16,
  "float64": jnp.float64,
}
_SECTION = {"attn": "self_attn", "mlp": "mlp"}


def hf_name(path: tuple) -> tuple[str, bool]:
  """(HF tensor name, stored transposed?) of the NNX param at ``path``."""
  p = tuple(str(x) for x in path)
  if p == ("embed", "embedding"):
    return "model.embed_tokens.weight", False
  if p == ("norm", "weight"):
    return "model.norm.weight", False
  if p == ("lm_head", "kernel"):
    return "lm_head.weight", True
  if p[0] == "layers":
    pre = f"model.layers.{p[1]}."
    if p[2] in ("input_layernorm", "post_attention_layernorm"):
      return pre + f"{p[2]}.weight", False
    sec = pre + _SECTION[p[2]] + "."
    if p[3] in ("q_norm", "k_norm"):
      return sec + f"{p[3]}.weight", False
    proj, leaf = p[3], p[4]
    short = proj[: -len("_proj")]
    if leaf == "kernel":
      return sec + f"{proj}.weight", True
    if leaf == "u":
      return sec + f"{short}_u_proj.weight", True
    if leaf == "v":
      return sec + f"{short}_v_proj.weight", True
    if leaf == "bias":
      return sec + f"{proj}.bias", False
  raise ValueError(f"no HF tensor name for param {'.'.join(p)}")


def _bias_name(path: tuple, state_paths: set) -> str:
  """Bias of a low-rank projection lives on its v_proj."""
  name, _ = hf_name(path)
  if path[:-1] + ("v",) in state_paths:
    return name.replace("_proj.bias", "_v_proj.bias")
  return name


def _param_names(flat) -> dict[tuple, tuple[str, str]]:
  """{path: (HF name, layout)}; layout "id", "T" (transposed) or "bd" (per-head v, see below)."""
  paths = {p for p, _ in flat}
  out = {}
  for p, var in flat:
    name, tr = hf_name(p)
    if p[-1] == "bias":
      name = _bias_name(p, paths)
    out[p] = (name, "bd" if p[-1] == "v" and len(var.shape) == 3 else ("T" if tr else "id"))
  return out


def _hf_shape(shape: tuple, layout: str) -> tuple:
  if layout == "T":
    return tuple(shape[::-1])
  if layout == "bd":  # v [H, r, d] ↔ block-diagonal v_proj.weight [H·d, H·r]
    h, r, d = shape
    return (h * d, h * r)
  return tuple(shape)


def _to_hf(a: np.ndarray, layout: str) -> np.ndarray:
  if layout == "T":
    return a.T
  if layout == "bd":
    h, r, d = a.shape
    w = np.zeros((h * d, h * r), a.dtype)
    for i in range(h):
      w[i * d : (i + 1) * d, i * r : (i + 1) * r] = a[i].T
    return w
  return a


def _from_hf(w: np.ndarray, layout: str, shape: tuple, name: str) -> np.ndarray:
  if layout == "T":
    return w.T
  if layout == "bd":
    h, r, d = shape
    v = np.stack([w[i * d : (i + 1) * d, i * r : (i + 1) * r].T for i in range(h)])
    if np.count_nonzero(w) != np.count_nonzero(v):
      raise ValueError(
        f"tensor {name!r} of a per-head projection must be block diagonal "
        f"({h} blocks of [{d}, {r}]) but has entries off the diagonal blocks"
      )
    return v
  return w


def _ignorable(name: str, cfg: ModelConfig) -> bool:
  return name.endswith("rotary_emb.inv_freq") or (
    cfg.tie_word_embeddings and name == "lm_head.weight"
  )


def digest(path: str | os.PathLike, progress: bool = False) -> str:
  """sha256 over config.json and the safetensors files (sorted names, streamed)."""
  path = os.fspath(path)
  files = sorted(
    f
    for f in os.listdir(path)
    if f == "config.json" or f.endswith(".safetensors") or f == INDEX_NAME
  )
  h = hashlib.sha256()
  total = sum(os.path.getsize(os.path.join(path, f)) for f in files)
  with tqdm(total=total, unit="B", unit_scale=True, desc="digest", disable=not progress) as bar:
    for f in files:
      h.update(f.encode() + b"\0")
      with open(os.path.join(path, f), "rb") as fh:
        while chunk := fh.read(1 << 24):
          h.update(chunk)
          bar.update(len(chunk))
  return "sha256:" + h.hexdigest()


def _dtype_from(cfg_json: dict, dtype):
  if dtype is not None:
    return jnp.dtype(dtype)
  name = cfg_json.get("dtype") or cfg_json.get("torch_dtype") or "float32"
  if name not in _DTYPE_NAMES:
    raise ValueError(f"config dtype {name!r} is not supported; pass dtype= explicitly")
  return jnp.dtype(_DTYPE_NAMES[name])


def abstract_model(
  cfg: ModelConfig, ranks=None, param_dtype=jnp.float32, heads=None
) -> LlamaForCausalLM:
  """A model with ShapeDtypeStruct params (no memory), to be filled by a loader."""
  return nnx.eval_shape(
    lambda: LlamaForCausalLM(cfg, ranks, heads, param_dtype=param_dtype, rngs=nnx.Rngs(0))
  )


def load_hf(
  path: str | os.PathLike,
  dtype=None,
  *,
  with_digest: bool = True,
  progress: bool = False,
  mesh=None,
  shardings=None,
  rules=None,
) -> LlamaForCausalLM:
  """Load an HF checkpoint dir (config.json + model.safetensors or an index and shards).

  Tensors are read one at a time (bf16, f16, f32 or f64 on disk), cast to ``dtype`` (default:
  the config's ``dtype``/``torch_dtype``, else float32) and placed straight into their target
  sharding (``mesh``/``shardings``/``rules`` as in :func:`lrjax.checkpoint.load`; default: the
  first device). Low-rank exports of :func:`export_hf` load back as low-rank projections.
  Raises ``ValueError`` naming the tensor for missing, unexpected, mis-shaped or truncated
  tensors.
  """
  path = os.fspath(path)
  cfg_path = os.path.join(path, "config.json")
  if not os.path.exists(cfg_path):
    raise FileNotFoundError(f"{cfg_path} does not exist; expected an HF checkpoint directory")
  with open(cfg_path) as fh:
    cfg_json = json.load(fh)
  cfg = ModelConfig.from_hf_config(cfg_json)
  dt = _dtype_from(cfg_json, dtype)
  ranks = heads = None
  if LOWRANK_KEY in cfg_json:
    lr = cfg_json[LOWRANK_KEY]
    ranks = [{k: int(r) for k, r in layer.items()} for layer in lr["ranks"]]
    heads = lr.get("heads")
  model = abstract_model(cfg, ranks, dt, heads)
  gdef, state = nnx.split(model)
  flat = list(nnx.to_flat_state(state))
  names = _param_names(flat)
  if shardings is None and mesh is not None:
    shardings = logical_sharding(mesh, rules)
  st = SafetensorsDir(path)
  expected = {n for n, _ in names.values()}
  missing = [(p, n) for p, (n, _) in names.items() if n not in st]
  if missing:
    p, n = missing[0]
    shape = _hf_shape(dict(flat)[p].shape, names[p][1])
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    raise ValueError(
      f"missing tensor {n!r}{more}: expected shape {list(shape)} for "
      f"{'.'.join(map(str, p))} of a {cfg.model_type} model from {cfg_path}"
    )
  skipped = sorted(n for n in st.names if n not in expected and _ignorable(n, cfg))
  if skipped:
    log.info("ignoring %d tensors the model does not use: %s", len(skipped), skipped[:3])
  extra = sorted(n for n in st.names if n not in expected and not _ignorable(n, cfg))
  if extra:
    raise ValueError(
      f"checkpoint has {len(extra)} tensors that config.json does not describe, "
      f"e.g. {extra[:3]}; config.json and the tensors disagree "
      f"(num_hidden_layers={cfg.num_layers}, model_type={cfg.model_type!r})"
    )
  values = {}
  for p, var in tqdm(flat, desc="load", disable=not progress):
    name, layout = names[p]
    tag, shape = st.info(name)
    want = _hf_shape(var.shape, layout)
    if shape != want:
      raise ValueError(
        f"tensor {name!r} has shape {list(shape)}, expected {list(want)} from "
        "config.json; config.json and the tensors disagree"
      )
    if tag not in _FLOAT_TAGS:
      raise ValueError(
        f"tensor {name!r} has dtype {tag}; expected one of {_FLOAT_TAGS} "
        "(quantized checkpoints are not supported)"
      )
    arr = _from_hf(st.get(name), layout, var.shape, name)
    where = pick(shardings, param_key(p), param_axes(var), mesh)
    values[p] = jax.device_put(np.ascontiguousarray(arr, dtype=var.dtype), where)
    del arr
  st.close()
  state = nnx.from_flat_state([(p, var.replace(values[p])) for p, var in flat])
  model = nnx.merge(gdef, state)
  model.compression = cfg_json.get(COMPRESSION_KEY)
  model.source_digest = cfg_json.get(LOWRANK_KEY, {}).get("source_digest") or (
    digest(path, progress) if with_digest else None
  )
  log.info("loaded %s (%s, %d layers, %s)", path, cfg.model_type, cfg.num_layers, dt)
  return model


def export_hf(
  model: LlamaForCausalLM,
  out: str | os.PathLike,
  *,
  max_shard_bytes: int = 4 << 30,
  overwrite: bool = False,
  progress: bool = False,
) -> None:
  """Write ``model`` as an HF-style checkpoint dir (config.json + safetensors, atomically).

  Dense projections keep transformers' names; low-rank ones become ``<p>_u_proj`` /
  ``<p>_v_proj`` (see module docstring). Files over ``max_shard_bytes`` are split with a
  ``model.safetensors.index.json``. Params are fetched to the host one at a time.
  """
  _, state = nnx.split(model)
  flat = list(nnx.to_flat_state(state))
  names = _param_names(flat)
  specs, source = {}, {}
  for p, var in flat:
    name, layout = names[p]
    specs[name] = (np.dtype(var.dtype), _hf_shape(var.shape, layout))
    source[name] = (var, layout)
  dtypes = {np.dtype(v.dtype).name for _, v in flat}
  cfg_json = model.cfg.to_hf_config()
  cfg_json["dtype"] = np.dtype(model.embed.embedding.dtype).name
  ranks = model.layer_ranks()
  if any(ranks):
    cfg_json[LOWRANK_KEY] = {
      "format": "lrjax-uv-v1",
      "naming": "<p>_u_proj.weight [rank, in], <p>_v_proj.weight [out, rank] (+ bias); "
      "y = v_proj(u_proj(x)); p in q,k,v,o,gate,up,down; per-head projections "
      "(heads) store v_proj block diagonal",
      "ranks": ranks,
      "heads": model.layer_heads(),
      "source_digest": getattr(model, "source_digest", None),
    }
  if getattr(model, "compression", None):
    cfg_json[COMPRESSION_KEY] = model.compression
  shards = plan_shards(specs, max_shard_bytes)
  files = (
    [SINGLE_NAME]
    if len(shards) == 1
    else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  )

  def tensors(group) -> Iterator[tuple[str, np.ndarray]]:
    for name in group:
      var, layout = source[name]
      yield name, _to_hf(np.asarray(jax.device_get(var[...])), layout)

  with atomic_dir(out, overwrite) as tmp:
    with tqdm(total=len(specs), desc="export", disable=not progress) as bar:
      for f, group in zip(files, shards):
        write_safetensors(
          os.path.join(tmp, f),
          {n: specs[n] for n in group},
          _counting(tensors(group), bar.update),
          metadata={"format": "pt"},
        )
    if len(shards) > 1:
      total = sum(int(np.prod(s, dtype=np.int64)) * d.itemsize for d, s in specs.values())
      with open(os.path.join(tmp, INDEX_NAME), "w") as fh:
        json.dump(
          {
            "metadata": {"total_size": total},
            "weight_map": {n: f for f, g in zip(files, shards) for n in g},
          },
          fh,
          indent=1,
        )
    with open(os.path.join(tmp, "config.json"), "w") as fh:
      json.dump(cfg_json, fh, indent=1)
  log.info(
    "exported %s (%d tensors, dtypes %s, %d file(s))", out, len(specs), sorted(dtypes), len(files)
  )


def _counting(it, tick: Callable[[int], object]):
  for x in it:
    yield x
    tick(1)
