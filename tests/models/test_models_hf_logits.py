"""from_hf models against transformers logits on the committed tiny fixtures (no torch needed)."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from flax import nnx

from lrjax.checkpoint import SafetensorsDir
from lrjax.models import ModelConfig, from_hf

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
NAMES = ["llama3", "llama2_bias_tied", "qwen3", "qwen2_bf16", "mistral_f16"]
# Extra roots of fixture dirs (e.g. from ``make_hf_fixtures.py --random N --out DIR``).
EXTRA = [
  os.path.join(root, d)
  for root in filter(None, os.environ.get("LRJAX_EXTRA_HF_FIXTURES", "").split(os.pathsep))
  for d in sorted(os.listdir(root))
  if os.path.exists(os.path.join(root, d, "reference.safetensors"))
]


_fwd = nnx.jit(lambda m, t: m(t))


def _ref(name):
  return load_file(os.path.join(FIXTURES, name, "reference.safetensors"))  # name may be a path


def _rel_max(out, ref):
  return float(np.max(np.abs(np.asarray(out, np.float64) - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("name", NAMES + EXTRA)
def test_from_hf_matches_transformers_logits(name):
  ref = _ref(name)
  model = from_hf(os.path.join(FIXTURES, name), dtype=jnp.float32)
  logits = _fwd(model, ref["tokens"])
  assert logits.shape == ref["logits"].shape
  assert _rel_max(logits, ref["logits"]) <= 1e-4


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_scan_and_loop_forward_agree(name):
  ref = _ref(name)
  model = from_hf(os.path.join(FIXTURES, name), dtype=jnp.float32, with_digest=False)
  assert model.homogeneous()
  scanned = np.asarray(_fwd(model, ref["tokens"]))
  model.scan_layers = False
  looped = np.asarray(_fwd(model, ref["tokens"]))
  assert _rel_max(looped, scanned) <= 1e-5


def _with_config(tmp_path, name, **changes):
  d = tmp_path / name
  shutil.copytree(os.path.join(FIXTURES, name), d)
  cfg = json.loads((d / "config.json").read_text())
  for k, v in changes.items():
    if v is None:
      cfg.pop(k, None)
    else:
      cfg[k] = v
  (d / "config.json").write_text(json.dumps(cfg))
  return d


@pytest.mark.parametrize(
  "name,changes",
  [
    ("llama3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    ("mistral_f16", {"sliding_window": None}),
  ],
)
def test_fixture_features_matter(tmp_path, name, changes):
  """The llama3 RoPE scaling and the sliding window change the logits measurably, so the
  fixtures really test them."""
  ref = _ref(name)
  d = _with_config(tmp_path, name, **changes)
  model = from_hf(d, dtype=jnp.float32, with_digest=False)
  assert _rel_max(_fwd(model, ref["tokens"]), ref["logits"]) > 1e-3


def test_qk_norm_matters():
  ref = _ref("qwen3")
  model = from_hf(os.path.join(FIXTURES, "qwen3"), dtype=jnp.float32, with_digest=False)
  for layer in model.layers:
    layer.attn.q_norm.weight[...] = jnp.ones_like(layer.attn.q_norm.weight[...])
  assert _rel_max(_fwd(model, ref["tokens"]), ref["logits"]) > 1e-3


def test_transformers4_style_config_matches(tmp_path):
  """rope_theta + rope_scaling {"type": "llama3"} (transformers 4.x) loads like rope_parameters."""
  src = json.loads(open(os.path.join(FIXTURES, "llama3", "config.json")).read())
  rp = dict(src["rope_parameters"])
  theta = rp.pop("rope_theta")
  rp["type"] = rp.pop("rope_type")
  d = _with_config(tmp_path, "llama3", rope_parameters=None, rope_scaling=rp, rope_theta=theta)
  assert ModelConfig.from_hf_config(d) == ModelConfig.from_hf_config(
    os.path.join(FIXTURES, "llama3")
  )
  ref = _ref("llama3")
  model = from_hf(d, dtype=jnp.float32, with_digest=False)
  assert _rel_max(_fwd(model, ref["tokens"]), ref["logits"]) <= 1e-4


@pytest.mark.parametrize("name,dtype", [("qwen2_bf16", jnp.bfloat16), ("mistral_f16", jnp.float16)])
def test_half_precision_params_are_the_stored_bits(name, dtype):
  d = os.path.join(FIXTURES, name)
  model = from_hf(d, with_digest=False)  # dtype from config.json
  assert model.embed.embedding.dtype == dtype
  with SafetensorsDir(d) as st:
    w = st.get("model.layers.1.mlp.down_proj.weight")
  assert np.array_equal(
    np.asarray(model.layers[1].mlp.down_proj.kernel[...]).view(np.uint16), w.T.view(np.uint16)
  )
  ref = _ref(name)
  logits = np.asarray(_fwd(model, ref["tokens"]).astype(jnp.float32))
  assert _rel_max(logits, ref["logits"]) <= 5e-2  # half-precision compute vs f32 reference


def test_digest_identifies_checkpoint():
  a = from_hf(os.path.join(FIXTURES, "qwen3"))
  b = from_hf(os.path.join(FIXTURES, "llama3"))
  assert a.source_digest.startswith("sha256:") and a.source_digest != b.source_digest
