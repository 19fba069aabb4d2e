"""HF checkpoints: load config.json + safetensors into an NNX model, and export a (low-rank) model.

Tensor names follow transformers (``model.layers.{i}.self_attn.q_proj.weight`` [out, in], etc.).
A low-rank projection ``<p>_proj`` (p in q, k, v, o, gate, up, down) is stored as two torch-layout
linears ``<p>_u_proj.weight`` [rank, in] and ``<p>_v_proj.weight`` [out, rank] (bias, if any, as
``<p>_v_proj.bias``), so y = v_proj(u_proj(x)); ``config.json`` carries the ranks under
``lrjax_lowrank``. Such an export (format ``hf-lowrank``) has a model type of its own and ships
the modeling file transformers loads it with (``trust_remote_code=True``); format ``hf-dense``
multiplies U·V back into the plain architecture (see :mod:`lrjax.checkpoint.hf_export`).

An export also writes ``lrjax_export.json``: the format, and each tensor's file and sha256 (of
its bytes as stored). :func:`load_hf` verifies those checksums when the file is present, and
``export_hf(..., overwrite=True)`` replaces only a directory that holds one.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from lrjax.checkpoint import hf_export
from lrjax.checkpoint.atomic import atomic_dir, resolve
from lrjax.checkpoint.placement import logical_sharding, param_axes, param_key, pick
from lrjax.checkpoint.safetensors_io import (
  INDEX_NAME,
  SINGLE_NAME,
  SafetensorsDir,
  confined,
  plan_shards,
  write_safetensors,
)
from lrjax.files import one_line, read_json_object
from lrjax.models.config import ModelConfig
from lrjax.models.families import Family, get_family
from lrjax.models.llama import LlamaForCausalLM

log = logging.getLogger("lrjax.checkpoint")

LOWRANK_KEY = "lrjax_lowrank"
COMPRESSION_KEY = "lrjax_compression"
MERGED_KEY = "lrjax_merged_from"
EXPORT_NAME = "lrjax_export.json"
EXPORT_FORMAT = "lrjax-hf-export"
EXPORT_VERSION = 1
_FLOAT_TAGS = ("F32", "F16", "BF16", "F64")
_DTYPE_NAMES = {
  "float32": jnp.float32,
  "float16": jnp.float16,
  "bfloat16": jnp.bfloat16,
  "float64": jnp.float64,
}


def hf_name(path: tuple, model_type: str = "llama") -> tuple[str, bool]:
  """(HF tensor name, stored transposed?) of the NNX param at ``path`` in ``model_type``."""
  return get_family(model_type).tensor_name(path)


def _bias_name(path: tuple, state_paths: set, fam: Family) -> str:
  """Bias of a low-rank projection lives on its v_proj."""
  name, _ = fam.tensor_name(path)
  if path[:-1] + ("v",) in state_paths:
    return name.replace("_proj.bias", "_v_proj.bias")
  return name


def _param_names(flat, fam: Family) -> dict[tuple, tuple[str, str]]:
  """{path: (HF name, layout)}; layout "id", "T" (transposed) or "bd" (per-head v, see below)."""
  paths = {p for p, _ in flat}
  out = {}
  for p, var in flat:
    name, tr = fam.tensor_name(p)
    if p[-1] == "bias":
      name = _bias_name(p, paths, fam)
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


def _ignorable(name: str, cfg: ModelConfig, fam: Family) -> bool:
  return name.endswith(fam.ignored_tensors) or (
    cfg.tie_word_embeddings and name == fam.tensor_name(("lm_head", "kernel"))[0]
  )


def digest(path: str | os.PathLike, progress: bool = False) -> str:
  """sha256 over config.json and the safetensors files (sorted names, streamed)."""
  path = os.fspath(resolve(path, "checkpoint path"))
  files = sorted(
    f
    for f in os.listdir(path)
    if f == "config.json" or f.endswith(".safetensors") or f == INDEX_NAME
  )
  for f in files:
    confined(path, f, os.path.join(path, f))
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


def _dtype_from(cfg_json: dict, dtype, cfg_path: str):
  if dtype is not None:
    return jnp.dtype(dtype)
  name = cfg_json.get("dtype") or cfg_json.get("torch_dtype") or "float32"
  if not isinstance(name, str) or name not in _DTYPE_NAMES:
    raise ValueError(
      f"{cfg_path}: dtype {name!r} is not supported; expected one of {sorted(_DTYPE_NAMES)} "
      "(or pass dtype= / --dtype explicitly)"
    )
  return jnp.dtype(_DTYPE_NAMES[name])


def abstract_model(
  cfg: ModelConfig, ranks=None, param_dtype=jnp.float32, heads=None
) -> LlamaForCausalLM:
  """A model with ShapeDtypeStruct params (no memory), to be filled by a loader."""
  return nnx.eval_shape(
    lambda: LlamaForCausalLM(cfg, ranks, heads, param_dtype=param_dtype, rngs=nnx.Rngs(0))
  )


def read_hf_config(path: str | os.PathLike) -> tuple[str, dict]:
  """(path of config.json, its dict) for an HF checkpoint dir; errors name the file."""
  path = os.fspath(resolve(path, "checkpoint path"))
  cfg_path = os.path.join(path, "config.json")
  if not os.path.exists(cfg_path):
    raise FileNotFoundError(f"{cfg_path} does not exist; expected an HF checkpoint directory")
  confined(path, "config.json", cfg_path)
  cfg_json = read_json_object(cfg_path)
  return cfg_path, cfg_json


def _layer_ints(cfg_path: str, key: str, v, n: int, optional: bool) -> list[dict] | None:
  if v is None and optional:
    return None
  if not isinstance(v, list) or len(v) != n:
    raise ValueError(f"{cfg_path}: {LOWRANK_KEY}.{key} must be a list of {n} per-layer objects")
  for i, d in enumerate(v):
    if not isinstance(d, dict) or not all(
      isinstance(k, str) and isinstance(r, int) and not isinstance(r, bool) and r > 0
      for k, r in d.items()
    ):
      raise ValueError(
        f"{cfg_path}: {LOWRANK_KEY}.{key}[{i}] must map projection names to positive ints, "
        f"got {d!r:.100}"
      )
  return v


def read_export_record(path: str | os.PathLike) -> dict | None:
  """The validated ``lrjax_export.json`` of an export dir, or None if it has none."""
  path = os.fspath(resolve(path, "checkpoint path"))
  rp = os.path.join(path, EXPORT_NAME)
  if not os.path.lexists(rp):
    return None
  confined(path, EXPORT_NAME, rp)
  rec = read_json_object(rp)
  if rec.get("format") != EXPORT_FORMAT:
    raise ValueError(f"{rp}: expected an object with format {EXPORT_FORMAT!r}")
  ver = rec.get("format_version")
  if not isinstance(ver, int) or isinstance(ver, bool) or not 1 <= ver <= EXPORT_VERSION:
    raise ValueError(f"{rp}: format_version={ver!r} is not readable (reads <= {EXPORT_VERSION})")
  tensors = rec.get("tensors")
  if not isinstance(tensors, dict) or not all(
    isinstance(k, str)
    and isinstance(v, dict)
    and isinstance(v.get("file"), str)
    and isinstance(v.get("sha256"), str)
    for k, v in tensors.items()
  ):
    raise ValueError(f"{rp}: 'tensors' must map tensor names to {{file, sha256}} objects")
  return rec


def is_export(path: str | os.PathLike) -> str | None:
  """None if ``path`` is a directory :func:`export_hf` wrote, else the reason."""
  try:
    rec = read_export_record(path)
  except (OSError, ValueError) as e:
    return f"is not an lrjax export ({one_line(e)})"
  return None if rec is not None else f"is not an lrjax export (no {EXPORT_NAME})"


def _sha256(a: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(a).reshape(-1).view(np.uint8)).hexdigest()


def abstract_split(cfg: ModelConfig, ranks=None, param_dtype=jnp.float32, heads=None):
  """(graphdef, flat abstract state) of :func:`abstract_model`; cached per architecture, since
  tracing a model's construction costs more than loading a small checkpoint."""
  return _abstract_split(cfg, json.dumps(ranks), jnp.dtype(param_dtype).name, json.dumps(heads))


@functools.lru_cache(maxsize=8)
def _abstract_split(cfg: ModelConfig, ranks: str, dtype: str, heads: str):
  model = abstract_model(cfg, json.loads(ranks), jnp.dtype(dtype), json.loads(heads))
  gdef, state = nnx.split(model)
  return gdef, tuple(nnx.to_flat_state(state))


def load_hf(
  path: str | os.PathLike,
  dtype=None,
  *,
  with_digest: bool = True,
  progress: bool = False,
  mesh=None,
  shardings=None,
  rules=None,
  verify: bool = True,
) -> LlamaForCausalLM:
  """Load an HF checkpoint dir (config.json + model.safetensors or an index and shards).

  Tensors are read one at a time (bf16, f16, f32 or f64 on disk), cast to ``dtype`` (default:
  the config's ``dtype``/``torch_dtype``, else float32) and placed straight into their target
  sharding (``mesh``/``shardings``/``rules`` as in :func:`lrjax.checkpoint.load`; default: the
  first device). Low-rank exports of :func:`export_hf` (``hf-lowrank``, and the earlier
  layout under the plain model type) load back as low-rank projections.
  Raises ``ValueError`` naming the tensor for missing, unexpected, mis-shaped or truncated
  tensors. An lrjax export's tensors are checked against the sha256 sums in its
  ``lrjax_export.json`` unless ``verify=False``. Every file read stays inside ``path``.
  """
  path = os.fspath(resolve(path, "checkpoint path"))
  cfg_path, cfg_json = read_hf_config(path)
  cfg_json = hf_export.plain_model_type(cfg_json, cfg_json.get(LOWRANK_KEY), cfg_path)
  try:
    cfg = ModelConfig.from_hf_config(cfg_json)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{cfg_path}: {one_line(e)}") from None
  dt = _dtype_from(cfg_json, dtype, cfg_path)
  ranks = heads = None
  if LOWRANK_KEY in cfg_json:
    lr = cfg_json[LOWRANK_KEY]
    if not isinstance(lr, dict):
      raise ValueError(f"{cfg_path}: {LOWRANK_KEY} must be an object with 'ranks'")
    ranks = _layer_ints(cfg_path, "ranks", lr.get("ranks"), cfg.num_layers, optional=False)
    heads = _layer_ints(cfg_path, "heads", lr.get("heads"), cfg.num_layers, optional=True)
  comp = cfg_json.get(COMPRESSION_KEY)
  if comp is not None and not isinstance(comp, dict):
    raise ValueError(f"{cfg_path}: {COMPRESSION_KEY} must be an object")
  record = read_export_record(path) if verify else None
  st = SafetensorsDir(path)  # headers only; checked before the model is built
  fam = get_family(cfg.model_type)
  last = fam.tensor_name(("layers", cfg.num_layers - 1, "input_layernorm", "weight"))[0]
  if last not in st:
    raise ValueError(
      f"missing tensor {last!r}: expected shape [{cfg.hidden_size}] for the last of the "
      f"{cfg.num_layers} layers that {cfg_path} declares (num_hidden_layers)"
    )
  try:
    gdef, flat = abstract_split(cfg, ranks, dt, heads)
  except (ValueError, TypeError, KeyError) as e:
    raise ValueError(
      f"{cfg_path}: {LOWRANK_KEY} ranks/heads do not fit the model ({one_line(e)})"
    ) from None
  names = _param_names(flat, fam)
  if shardings is None and mesh is not None:
    shardings = logical_sharding(mesh, rules)
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
  skipped = sorted(n for n in st.names if n not in expected and _ignorable(n, cfg, fam))
  if skipped:
    log.info("ignoring %d tensors the model does not use: %s", len(skipped), skipped[:3])
  extra = sorted(n for n in st.names if n not in expected and not _ignorable(n, cfg, fam))
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
    raw = st.get(name)
    if record is not None:
      want_sum = record["tensors"].get(name, {}).get("sha256")
      if want_sum != _sha256(raw):
        raise ValueError(
          f"{os.path.join(path, st.file_of(name))}: tensor {name!r} fails its sha256 check "
          f"against {EXPORT_NAME}; the export is corrupt: re-export it (verify=False skips "
          "the check)"
        )
    arr = _from_hf(raw, layout, var.shape, name)
    where = pick(shardings, param_key(p), param_axes(var), mesh)
    values[p] = jax.device_put(np.ascontiguousarray(arr, dtype=var.dtype), where)
    del arr
  st.close()
  state = nnx.from_flat_state([(p, var.replace(values[p])) for p, var in flat])
  model = nnx.merge(gdef, state)
  model.compression = comp
  sd = cfg_json.get(LOWRANK_KEY, {}).get("source_digest")
  model.source_digest = (sd if isinstance(sd, str) else None) or (
    digest(path, progress) if with_digest else None
  )
  log.info("loaded %s (%s, %d layers, %s)", path, cfg.model_type, cfg.num_layers, dt)
  return model


def export_hf(
  model: LlamaForCausalLM,
  out: str | os.PathLike,
  *,
  format: str = hf_export.DEFAULT_FORMAT,
  extra_files: Sequence[str | os.PathLike] = (),
  max_shard_bytes: int = 4 << 30,
  overwrite: bool = False,
  progress: bool = False,
) -> None:
  """Write ``model`` as an HF checkpoint dir (config.json + safetensors, atomically).

  ``format``:

  - ``"hf-lowrank"`` (default): low-rank projections stay factored as ``<p>_u_proj`` /
    ``<p>_v_proj`` (see module docstring) under a model type of their own
    (``lrjax_lowrank_<type>``, architecture ``LowRank<Family>ForCausalLM``), with the
    ``modeling_lrjax_lowrank.py`` that transformers loads with ``trust_remote_code=True``. A
    model with no low-rank projection is written in its plain architecture.
  - ``"hf-dense"``: U·V multiplied back (float32, cast to the param dtype) into the plain
    architecture, which transformers loads with no remote code.

  ``extra_files`` (tokenizer.json, generation_config.json, ...) are copied in. Files over
  ``max_shard_bytes`` are split with a ``model.safetensors.index.json``. Params are fetched to
  the host one at a time. ``overwrite`` replaces only a directory an earlier export wrote (one
  with ``lrjax_export.json``). :func:`load_hf` reads both formats back.
  """
  hf_export.check_format(format)
  if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool):
    raise TypeError(f"{max_shard_bytes=} must be an int (bytes per safetensors file)")
  if max_shard_bytes <= 0:
    raise ValueError(f"{max_shard_bytes=} must be > 0 (bytes per safetensors file)")
  out = resolve(out, "export path")
  fam = get_family(model.cfg.model_type)
  _, state = nnx.split(model)
  flat = list(nnx.to_flat_state(state))
  try:
    _param_names(flat, fam)
  except ValueError as e:
    raise ValueError(
      f"{one_line(e)}: an HF export holds float weights of transformers' layout only "
      "(a quantized model cannot be exported; export the checkpoint it was quantized from)"
    ) from None
  ranks = model.layer_ranks()
  lowrank = any(ranks) and format == "hf-lowrank"
  merge = any(ranks) and format == "hf-dense"
  specs, source = _export_plan(flat, fam, merge)
  cfg_json = model.cfg.to_hf_config()
  cfg_json["dtype"] = np.dtype(model.embed.embedding.dtype).name
  if lowrank:
    cfg_json = hf_export.remote_config(cfg_json, fam)
    cfg_json[LOWRANK_KEY] = {
      "format": "lrjax-uv-v1",
      "naming": "<p>_u_proj.weight [rank, in], <p>_v_proj.weight [out, rank] (+ bias); "
      "y = v_proj(u_proj(x)); p in q,k,v,o,gate,up,down; per-head projections "
      "(heads) store v_proj block diagonal",
      "base_model_type": fam.model_type,
      "base_architecture": fam.architecture,
      "ranks": ranks,
      "heads": model.layer_heads(),
      "source_digest": getattr(model, "source_digest", None),
    }
  if getattr(model, "compression", None):
    if merge:  # the weights are dense now: the record says where they came from
      cfg_json[MERGED_KEY] = {"ranks": ranks, "compression": model.compression}
    else:
      cfg_json[COMPRESSION_KEY] = model.compression
  texts = hf_export.check_text_files(extra_files, model.cfg.vocab_size)
  shards = plan_shards(specs, max_shard_bytes)
  files = (
    [SINGLE_NAME]
    if len(shards) == 1
    else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  )

  sums: dict[str, dict] = {}

  def tensors(f, group) -> Iterator[tuple[str, np.ndarray]]:
    for name in group:
      a = np.ascontiguousarray(source[name]())
      sums[name] = {"file": f, "sha256": _sha256(a)}
      yield name, a

  with atomic_dir(out, overwrite, replaceable=is_export, protect=texts) as tmp:
    with tqdm(total=len(specs), desc="export", disable=not progress) as bar:
      for f, group in zip(files, shards):
        write_safetensors(
          os.path.join(tmp, f),
          {n: specs[n] for n in group},
          _counting(tensors(f, group), bar.update),
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
    if lowrank:
      with open(os.path.join(tmp, hf_export.MODELING_FILE), "w") as fh:
        fh.write(hf_export.modeling_source(fam))
    copied = hf_export.copy_text_files(texts, tmp)
    _write_export_record(tmp, sums, format if any(ranks) else "hf-dense", copied)
  log.info(
    "exported %s as %s (%d tensors, dtypes %s, %d file(s))",
    out,
    cfg_json["architectures"][0],
    len(specs),
    sorted({d.name for d, _ in specs.values()}),
    len(files),
  )


def _export_plan(flat, fam: Family, merge: bool):
  """({HF name: (dtype, shape)}, {HF name: () -> array}) of an export; with ``merge`` every
  low-rank projection is one dense weight (U·V in float32, cast to its param dtype)."""
  names = _param_names(flat, fam)
  specs, source = {}, {}
  if not merge:
    for p, var in flat:
      name, layout = names[p]
      specs[name] = (np.dtype(var.dtype), _hf_shape(var.shape, layout))
      source[name] = functools.partial(_host_hf, var, layout)
    return specs, source
  by_path = dict(flat)
  for p, var in flat:
    if p[-1] == "v":
      continue
    if p[-1] == "u":
      v = by_path[p[:-1] + ("v",)]
      name = fam.tensor_name(p[:-1] + ("kernel",))[0]
      out_dim = v.shape[0] * v.shape[2] if len(v.shape) == 3 else v.shape[1]
      specs[name] = (np.dtype(var.dtype), (out_dim, var.shape[0]))
      source[name] = functools.partial(_host_merged, var, v)
    else:
      name, layout = fam.tensor_name(p)[0], "T" if fam.tensor_name(p)[1] else "id"
      specs[name] = (np.dtype(var.dtype), _hf_shape(var.shape, layout))
      source[name] = functools.partial(_host_hf, var, layout)
  return specs, source


def _host(var) -> np.ndarray:
  return np.asarray(jax.device_get(var[...]))


def _host_hf(var, layout: str) -> np.ndarray:
  return _to_hf(_host(var), layout)


def _host_merged(u, v) -> np.ndarray:
  return hf_export.merged_weight(_host(u), _host(v), np.dtype(u.dtype))


def _write_export_record(tmp: str | Path, sums: dict[str, dict], layout: str, files: dict):
  import lrjax

  rec = {
    "format": EXPORT_FORMAT,
    "format_version": EXPORT_VERSION,
    "layout": layout,
    "lrjax_version": lrjax.__version__,
    "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "tensors": sums,
    "files": files,
  }
  with open(os.path.join(tmp, EXPORT_NAME), "w") as fh:
    json.dump(rec, fh, indent=1)


def _counting(it, tick: Callable[[int], object]):
  for x in it:
    yield x
    tick(1)
