"""Helpers shared by the checkpoint safety, integrity, path and fuzz tests: tiny random models."""

import os
import shutil

import jax
import numpy as np
from conftest import fresh_key
from flax import nnx

from lrjax.models import LlamaForCausalLM, ModelConfig

FIXTURES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf"))

# One layer, hidden 16: saves and loads in tens of milliseconds.
TINY = ModelConfig.tiny(
  num_layers=1, hidden_size=16, intermediate_size=32, vocab_size=32, num_heads=2, head_dim=8,
  num_kv_heads=1,
)  # fmt: skip


def random_model(cfg=TINY, ranks=None):
  """A model with fresh random weights (norm weights too, so no param is all ones)."""
  m = LlamaForCausalLM(
    cfg, ranks, rngs=nnx.Rngs(int(jax.random.randint(fresh_key(), (), 0, 2**30)))
  )
  for path, var in nnx.to_flat_state(nnx.state(m)):
    if path[-1] in ("weight", "bias"):
      var[...] = 1.0 + 0.3 * jax.random.normal(fresh_key(), var.shape)
  return m


def weights(model) -> dict:
  """{param key: host array} of a model."""
  return {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model))}


def bit_equal(a, b) -> bool:
  wa, wb = weights(a), weights(b)
  return wa.keys() == wb.keys() and all(
    wa[k].dtype == wb[k].dtype and wa[k].shape == wb[k].shape and wa[k].tobytes() == wb[k].tobytes()
    for k in wa
  )


def copy_fixture(tmp_path, name="qwen3", dest=None):
  d = tmp_path / (dest or name)
  shutil.copytree(os.path.join(FIXTURES, name), d)
  for extra in ("reference.safetensors",):  # test-only logits, not part of the checkpoint
    if (d / extra).exists():
      (d / extra).unlink()
  return d


def unwritable_dir(tmp_path):
  """A directory path under which nothing can be created (read-only, also for root)."""
  if os.geteuid() == 0:
    return "/sys/lrjax-test-readonly"  # sysfs refuses new entries even for root
  ro = tmp_path / "readonly"
  ro.mkdir()
  ro.chmod(0o555)
  return str(ro / "sub")


def data_files(ckpt_dir) -> list[str]:
  """The orbax array data files of an lrjax checkpoint (``state/ocdbt.process_*/d/*``),
  largest first."""
  out = []
  for d, _, fs in os.walk(os.path.join(ckpt_dir, "state")):
    if os.path.basename(d) == "d" and os.path.basename(os.path.dirname(d)).startswith("ocdbt."):
      out += [os.path.join(d, f) for f in fs]
  return sorted(out, key=os.path.getsize, reverse=True)


def index_files(ckpt_dir) -> list[str]:
  """The orbax files that are not array data (manifests, tree metadata)."""
  data = set(data_files(ckpt_dir))
  return sorted(
    os.path.join(d, f)
    for d, _, fs in os.walk(os.path.join(ckpt_dir, "state"))
    for f in fs
    if os.path.join(d, f) not in data
  )
