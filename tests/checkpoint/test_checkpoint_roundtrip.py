"""Orbax save/load and HF export round trips are bit-exact; writes are atomic."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_key
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors import safe_open

import lrjax
from lrjax import checkpoint
from lrjax.checkpoint import hf as hf_mod
from lrjax.compression import HeadwiseLowRankLinear
from lrjax.models import LlamaForCausalLM, ModelConfig, from_hf, set_proj

FIXTURES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf"))


def _random_model(cfg, ranks=None, dtype=jnp.float32):
  m = LlamaForCausalLM(
    cfg, ranks, param_dtype=dtype, rngs=nnx.Rngs(int(jax.random.randint(fresh_key(), (), 0, 2**30)))
  )
  for path, var in nnx.to_flat_state(nnx.state(m)):
    if path[-1] in ("weight", "bias"):
      var[...] = (1.0 + 0.3 * jax.random.normal(fresh_key(), var.shape)).astype(dtype)
  return m


def _assert_bit_equal(a, b):
  fa, fb = dict(nnx.to_flat_state(nnx.state(a))), dict(nnx.to_flat_state(nnx.state(b)))
  assert set(fa) == set(fb)
  for k in fa:
    x, y = np.asarray(fa[k][...]), np.asarray(fb[k][...])
    assert x.dtype == y.dtype and x.shape == y.shape, k
    assert x.tobytes() == y.tobytes(), k
  assert type(a.layers[0].attn.q_proj) is type(b.layers[0].attn.q_proj)


def _hetero(cfg, dtype=jnp.float32):
  """Heterogeneous ranks plus a per-head q projection in layer 1."""
  m = _random_model(cfg, [{"q_proj": 8, "down_proj": 16}, {"gate_proj": 24, "o_proj": 12}], dtype)
  hw = HeadwiseLowRankLinear(
    cfg.hidden_size,
    cfg.num_heads,
    cfg.head_dim,
    4,
    use_bias=cfg.qkv_bias,
    axes=("embed", "heads"),
    param_dtype=dtype,
    rngs=nnx.Rngs(1),
  )
  set_proj(m, 1, "q_proj", hw)
  return m


_fwd = nnx.jit(lambda m, t: m(t))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_orbax_round_trip_low_rank_bit_exact(tmp_path, dtype):
  cfg = ModelConfig.tiny(model_type="qwen2", qkv_bias=True)
  m = _hetero(cfg, dtype)
  m.compression = {
    "method": "whiten",
    "ratio": 0.2,
    "calibration": {"tokens": 512},
    "lora": {"steps": 3, "rank": 8},
  }
  m.source_digest = "sha256:" + "ab" * 32
  checkpoint.save(m, tmp_path / "ck")
  back = checkpoint.load(tmp_path / "ck")
  _assert_bit_equal(m, back)
  tok = jax.random.randint(fresh_key(), (2, 5), 0, cfg.vocab_size)
  assert np.asarray(_fwd(m, tok)).tobytes() == np.asarray(_fwd(back, tok)).tobytes()
  meta = checkpoint.read_metadata(tmp_path / "ck")
  assert (
    meta["ranks"]
    == m.layer_ranks()
    == [{"q_proj": 8, "down_proj": 16}, {"q_proj": 16, "o_proj": 12, "gate_proj": 24}]
  )
  assert meta["heads"] == [{}, {"q_proj": 4}]
  assert meta["compression"] == m.compression == back.compression
  assert meta["source_digest"] == back.source_digest == m.source_digest
  assert meta["lrjax_version"] == lrjax.__version__
  assert ModelConfig.from_dict(meta["config"]) == cfg
  assert meta["params"]["layers.0.attn.q_proj.u"]["axes"] == ["embed", "rank"]


def test_orbax_round_trip_from_hf_fixture(tmp_path):
  m = from_hf(os.path.join(FIXTURES, "qwen2_bf16"))
  checkpoint.save(m, tmp_path / "ck", compression={"method": "none"})
  back = checkpoint.load(tmp_path / "ck")
  _assert_bit_equal(m, back)
  assert back.source_digest == m.source_digest and back.compression == {"method": "none"}


def test_load_into_named_shardings(tmp_path):
  cfg = ModelConfig.tiny()
  m = _hetero(cfg)
  checkpoint.save(m, tmp_path / "ck")
  mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
  back = checkpoint.load(tmp_path / "ck", mesh=mesh, rules={"mlp": "tp", "heads": "tp"})
  k = back.layers[0].mlp.gate_proj.kernel[...]
  assert k.sharding == NamedSharding(mesh, PartitionSpec(None, "tp"))
  emb = back.embed.embedding[...]
  assert emb.sharding == NamedSharding(mesh, PartitionSpec(None, None))
  one = NamedSharding(mesh, PartitionSpec())
  back2 = checkpoint.load(tmp_path / "ck", shardings=one)
  assert back2.layers[1].attn.q_proj.v[...].sharding == one
  _assert_bit_equal(m, back2)
  h = checkpoint.load_hf(os.path.join(FIXTURES, "qwen3"), mesh=mesh, rules={"kv_heads": "tp"})
  assert h.layers[1].attn.v_proj.kernel[...].sharding == NamedSharding(
    mesh, PartitionSpec(None, "tp")
  )
  _assert_bit_equal(h, from_hf(os.path.join(FIXTURES, "qwen3")))


def test_load_shards_across_two_devices(tmp_path):
  """Restore straight into a 2-device NamedSharding (fresh process with 2 CPU devices)."""
  checkpoint.save(_hetero(ModelConfig.tiny()), tmp_path / "ck")
  code = textwrap.dedent(f"""
    import jax, numpy as np
    from jax.sharding import Mesh, PartitionSpec
    from lrjax import checkpoint
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    m = checkpoint.load({str(tmp_path / "ck")!r}, mesh=mesh, rules={{"mlp": "tp"}})
    k = m.layers[1].mlp.gate_proj.v[...]
    assert len(k.addressable_shards) == 2, k.sharding
    assert k.addressable_shards[0].data.shape == (24, 64), k.addressable_shards[0].data.shape
    assert tuple(k.sharding.spec) == (None, "tp"), k.sharding.spec
    h = checkpoint.load_hf({FIXTURES!r} + "/llama3", mesh=mesh, rules={{"heads": "tp"}})
    q = h.layers[0].attn.q_proj.kernel[...]
    assert tuple(q.sharding.spec) == (None, "tp") and q.addressable_shards[0].data.shape == (64, 32)
    print("ok")
  """)
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
  r = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
  )
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.strip() == "ok"


@pytest.mark.parametrize("name", ["llama3", "qwen2_bf16", "mistral_f16"])
def test_export_dense_round_trip_bit_exact(tmp_path, name):
  m = from_hf(os.path.join(FIXTURES, name))
  checkpoint.export_hf(m, tmp_path / "ex", max_shard_bytes=120_000)
  files = os.listdir(tmp_path / "ex")
  assert "model.safetensors.index.json" in files and len(files) > 3
  back = from_hf(tmp_path / "ex")
  _assert_bit_equal(m, back)
  assert back.cfg == m.cfg


def test_export_low_rank_round_trip_and_format(tmp_path):
  cfg = ModelConfig.tiny(model_type="qwen2", qkv_bias=True)
  m = _hetero(cfg)
  m.compression = {"method": "svd", "ratio": 0.4}
  checkpoint.export_hf(m, tmp_path / "ex")
  back = from_hf(tmp_path / "ex")
  _assert_bit_equal(m, back)
  assert back.compression == m.compression
  c = json.loads((tmp_path / "ex" / "config.json").read_text())
  assert c["lrjax_lowrank"]["ranks"] == m.layer_ranks()
  with safe_open(str(tmp_path / "ex" / "model.safetensors"), "numpy") as f:
    names = set(f.keys())
    u = f.get_tensor("model.layers.0.self_attn.q_u_proj.weight")
    v = f.get_tensor("model.layers.0.self_attn.q_v_proj.weight")
    vb = f.get_tensor("model.layers.1.self_attn.q_v_proj.bias")
    hv = f.get_tensor("model.layers.1.self_attn.q_v_proj.weight")
  assert "model.layers.0.self_attn.q_proj.weight" not in names
  assert "model.layers.1.self_attn.k_proj.weight" in names  # dense stays dense
  assert u.shape == (8, 64) and v.shape == (64, 8) and vb.shape == (64,)
  # torch-layout reading: y = v_proj(u_proj(x)) reproduces the module.
  x = np.asarray(jax.random.normal(fresh_key(), (3, 64)))
  want = np.asarray(m.layers[0].attn.q_proj(jnp.asarray(x)))
  np.testing.assert_allclose(
    (x @ u.T) @ v.T + np.asarray(m.layers[0].attn.q_proj.bias[...]), want, rtol=1e-5, atol=1e-5
  )
  want1 = np.asarray(m.layers[1].attn.q_proj(jnp.asarray(x)))
  u1 = back.layers[1].attn.q_proj.u[...]
  np.testing.assert_allclose((x @ np.asarray(u1)) @ hv.T + vb, want1, rtol=1e-5, atol=1e-5)


def test_export_rejects_config_hf_cannot_express(tmp_path):
  m = _random_model(ModelConfig.tiny(qkv_bias=True))  # llama biases q/k/v/o together
  with pytest.raises(ValueError, match="qkv_bias=True with o_bias=False"):
    checkpoint.export_hf(m, tmp_path / "ex")
  _no_partial(tmp_path, "ex")


def test_export_rejects_non_block_diagonal_headwise(tmp_path):
  m = _hetero(ModelConfig.tiny())
  checkpoint.export_hf(m, tmp_path / "ex")
  from safetensors.numpy import load_file, save_file

  f = str(tmp_path / "ex" / "model.safetensors")
  t = load_file(f)
  t["model.layers.1.self_attn.q_v_proj.weight"][0, -1] = 1.0
  save_file(t, f)
  with pytest.raises(ValueError, match="q_v_proj.weight' fails its sha256 check"):
    from_hf(tmp_path / "ex")
  with pytest.raises(ValueError, match="must be block diagonal"):
    from_hf(tmp_path / "ex", verify=False)


def _no_partial(parent, name):
  left = [p for p in os.listdir(parent) if name in p]
  assert left == [], left


def test_failed_export_leaves_nothing(tmp_path, monkeypatch):
  m = _random_model(ModelConfig.tiny())
  real = hf_mod.write_safetensors
  calls = []

  def failing(path, specs, tensors, metadata=None):
    calls.append(path)
    if len(calls) == 2:  # first shard written, fail in the second

      def partial():
        for i, t in enumerate(tensors):
          if i == 2:
            raise OSError("disk full (simulated)")
          yield t

      return real(path, specs, partial(), metadata)
    return real(path, specs, tensors, metadata)

  monkeypatch.setattr(hf_mod, "write_safetensors", failing)
  with pytest.raises(OSError, match="simulated"):
    checkpoint.export_hf(m, tmp_path / "ex", max_shard_bytes=60_000)
  assert len(calls) == 2
  _no_partial(tmp_path, "ex")


def test_failed_orbax_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
  cfg = ModelConfig.tiny()
  old, new = _random_model(cfg), _random_model(cfg)
  checkpoint.save(old, tmp_path / "ck")
  with pytest.raises(FileExistsError, match="overwrite=True"):
    checkpoint.save(new, tmp_path / "ck")
  import lrjax.checkpoint.orbax_io as oio

  real_dump = json.dump

  def failing_dump(obj, fh, **kw):
    if "format" in obj:
      fh.write('{"format": "lrjax-orb')
      raise KeyboardInterrupt("interrupted (simulated)")
    return real_dump(obj, fh, **kw)

  monkeypatch.setattr(oio.json, "dump", failing_dump)
  with pytest.raises(KeyboardInterrupt):
    checkpoint.save(new, tmp_path / "ck", overwrite=True)
  monkeypatch.setattr(oio.json, "dump", real_dump)
  assert sorted(os.listdir(tmp_path)) == ["ck"]
  _assert_bit_equal(old, checkpoint.load(tmp_path / "ck"))
  checkpoint.save(new, tmp_path / "ck", overwrite=True)
  _assert_bit_equal(new, checkpoint.load(tmp_path / "ck"))
  assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_killed_process_leaves_no_checkpoint(tmp_path):
  """A process killed mid-export (os._exit, no cleanup) leaves no directory at the target."""
  code = textwrap.dedent(f"""
    import os
    from flax import nnx
    from lrjax import checkpoint
    from lrjax.checkpoint import hf
    from lrjax.models import LlamaForCausalLM, ModelConfig
    real = hf.write_safetensors
    def dying(path, specs, tensors, metadata=None):
      def gen():
        for i, t in enumerate(tensors):
          if i == 3:
            os._exit(17)
          yield t
      return real(path, specs, gen(), metadata)
    hf.write_safetensors = dying
    m = LlamaForCausalLM(ModelConfig.tiny(), rngs=nnx.Rngs(0))
    checkpoint.export_hf(m, {str(tmp_path / "ex")!r})
  """)
  r = subprocess.run(
    [sys.executable, "-c", code],
    capture_output=True,
    text=True,
    timeout=120,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert r.returncode == 17, r.stderr[-2000:]
  assert not (tmp_path / "ex").exists()
  assert all(p.startswith((".ex.tmp-", ".ex.lock")) for p in os.listdir(tmp_path))


def test_load_rejects_non_lrjax_dir_and_bad_metadata(tmp_path):
  with pytest.raises(FileNotFoundError, match="not an lrjax checkpoint"):
    checkpoint.load(os.path.join(FIXTURES, "qwen3"))
  m = _random_model(ModelConfig.tiny())
  checkpoint.save(m, tmp_path / "ck")
  meta_p = tmp_path / "ck" / checkpoint.METADATA_NAME
  meta = json.loads(meta_p.read_text())
  meta["ranks"][0]["q_proj"] = 8
  meta_p.write_text(json.dumps(meta))
  with pytest.raises(ValueError, match="metadata params differ"):
    checkpoint.load(tmp_path / "ck")
  meta["format_version"] = 99
  meta_p.write_text(json.dumps(meta))
  with pytest.raises(ValueError, match="version=99 is not readable"):
    checkpoint.load(tmp_path / "ck")


def test_a_file_given_as_a_checkpoint_is_named_as_one(tmp_path):
  f = tmp_path / "weights.bin"
  f.write_bytes(b"\0")
  with pytest.raises(NotADirectoryError, match="weights.bin is a file; expected an lrjax"):
    checkpoint.load(f)
  assert "is a file" in checkpoint.is_checkpoint(f)
