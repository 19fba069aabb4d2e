"""Both export formats load in transformers and compute what lrjax computes.

For Llama (biases, tied embeddings), Qwen2 (q/k/v biases), Qwen3 (q/k norms) and Mistral
(sliding window) fixtures, compressed with per-layer ranks, MLP-only and per head: the
``hf-lowrank`` export loads through ``AutoModelForCausalLM(trust_remote_code=True)`` as its own
low-rank class and the ``hf-dense`` export as the plain class, with logits within 1e-4 relative
of lrjax's in float32 and the same greedy tokens as lrjax's prefill/decode loop. No network.
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fresh_key, rel_err
from flax import nnx

import lrjax
from lrjax import checkpoint
from lrjax.models import KVCache, decode_step, prefill_step

torch = pytest.importorskip("torch", reason="the [test] extra installs CPU torch")
transformers = pytest.importorskip("transformers", reason="the [test] extra installs it")

FIXTURES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf"))
TOL = 1e-4  # relative, float32
NEW_TOKENS = 6

# fixture: compress() settings (method "svd"); each keeps some structure the export must carry.
CASES = {
  # per-layer ranks on every projection
  "llama3": dict(
    ranks=[
      {"q_proj": 8, "k_proj": 12, "v_proj": 4, "o_proj": 20, "gate_proj": 16, "up_proj": 24},
      {"q_proj": 24, "k_proj": 4, "v_proj": 16, "o_proj": 8, "gate_proj": 40, "down_proj": 12},
    ]
  ),
  # attention and MLP biases (MLP ones on low-rank v_proj), tied embeddings; attention dense
  "llama2_bias_tied": dict(ratio=0.5, mlp_only=True, block=4),
  # q/k/v biases on per-head low-rank projections (stored on v_proj), per-layer ranks
  "qwen2_bf16": dict(
    per_head=True,
    ranks=[{"q_proj": 12, "k_proj": 8, "v_proj": 12}, {"q_proj": 20, "k_proj": 4, "v_proj": 8}],
  ),
  # q/k norms; q/k/v factorised per (kv) head
  "qwen3": dict(ratio=0.4, block=4, per_head=True),
  # sliding window (5, shorter than the prompt); per head with per-layer ranks
  "mistral_f16": dict(
    per_head=True,
    ranks=[{"q_proj": 16, "k_proj": 8, "v_proj": 12}, {"q_proj": 8, "k_proj": 12, "v_proj": 4}],
  ),
}


def fresh_seed() -> int:
  return int(jax.random.randint(fresh_key(), (), 0, 2**31 - 1))


def _compressed(name):
  m = checkpoint.load_hf(os.path.join(FIXTURES, name), dtype=jnp.float32)
  kw = dict(CASES[name])
  kw.setdefault("ratio", 0.3)
  kw.setdefault("block", 4)
  return lrjax.compress(m, method="svd", progress=False, **kw)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """name → (lrjax model, {format: export dir}, lrjax reference); built once per fixture."""
  cache = {}
  rng = np.random.default_rng(fresh_seed())

  def get(name):
    if name not in cache:
      m = _compressed(name)
      root = tmp_path_factory.mktemp(name)
      dirs = {}
      for fmt in ("hf-lowrank", "hf-dense"):
        dirs[fmt] = root / f"{name}_{fmt}"  # distinct names: transformers caches remote code
        checkpoint.export_hf(m, dirs[fmt], format=fmt)
      tokens = rng.integers(0, m.cfg.vocab_size, (2, 9))
      cache[name] = (m, dirs, (tokens, *_lrjax_greedy(m, tokens, NEW_TOKENS)))
    return cache[name]

  return get


def _hf(path, fmt):
  kw = dict(trust_remote_code=True) if fmt == "hf-lowrank" else {}
  m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
  return m.eval()


def _lrjax_greedy(model, prompt, n):
  """lrjax's prefill logits [B, S, vocab], greedy tokens [B, n] and the logits [B, n, vocab]
  each step chose from (jitted prefill, then decode steps through the KV cache)."""
  b, s = prompt.shape
  cache = KVCache.init(model.cfg, b, s + n)
  logits, cache = prefill_step(model, jnp.asarray(prompt), cache)
  full = np.asarray(logits)
  step, decode = full[:, -1], nnx.cached_partial(decode_step, model)
  toks, steps = [], []
  for _ in range(n):
    steps.append(step)
    toks.append(step.argmax(-1))
    if len(toks) < n:
      logits, cache = decode(jnp.asarray(toks[-1], jnp.int32), cache)
      step = np.asarray(logits)
  return full, np.stack(toks, 1), np.stack(steps, 1)


def _stored_params(model) -> int:
  """lrjax's parameter count with each per-head v [h, r, d] counted as its block-diagonal
  [h·d, h·r] HF weight."""
  n = 0
  for path, v in nnx.to_flat_state(nnx.state(model)):
    shape = v.shape
    n += (
      shape[0] ** 2 * shape[1] * shape[2] if path[-1] == "v" and len(shape) == 3 else np.prod(shape)
    )
  return int(n)


def _assert_same_greedy(got, want, want_logits):
  """Tokens equal, except that a row may part ways where lrjax's top two logits tie within
  the tolerance (then the rest of the row is not compared)."""
  for row in range(want.shape[0]):
    for i in range(want.shape[1]):
      if got[row, i] == want[row, i]:
        continue
      top2 = np.sort(want_logits[row, i])[-2:]
      gap = top2[1] - top2[0]
      assert gap <= TOL * np.abs(want_logits[row, i]).max(), (
        f"row {row} step {i}: transformers chose {got[row, i]}, lrjax {want[row, i]} "
        f"(top-2 gap {gap:.3g}, not a tie)"
      )
      break


@pytest.mark.parametrize("fmt", ["hf-lowrank", "hf-dense"])
@pytest.mark.parametrize("name", list(CASES))
def test_export_loads_in_transformers_with_lrjax_logits_and_tokens(exported, name, fmt):
  model, dirs, (tokens, want, want_tok, want_logits) = exported(name)
  hm = _hf(dirs[fmt], fmt)
  cfg = json.loads((dirs[fmt] / "config.json").read_text())
  if fmt == "hf-lowrank":
    assert type(hm).__name__ == cfg["architectures"][0]
    assert type(hm).__name__.startswith("LowRank") and cfg["model_type"].startswith("lrjax_")
    # every low-rank projection is factored in transformers too, with lrjax's ranks
    for i, ranks in enumerate(model.layer_ranks()):
      layer = hm.model.layers[i]
      for p, r in ranks.items():
        sec = layer.self_attn if p in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp
        assert getattr(sec, p[:-5] + "_u_proj").weight.shape[0] == r
        assert not isinstance(getattr(sec, p), torch.nn.Linear)
    assert sum(p.numel() for p in hm.parameters()) == _stored_params(model)
  else:
    assert type(hm) is getattr(transformers, cfg["architectures"][0])
    assert type(hm).__module__.startswith("transformers.models.")
    assert not any("_u_proj" in n for n, _ in hm.named_parameters())

  with torch.no_grad():
    got = hm(torch.as_tensor(tokens)).logits.numpy()
  assert rel_err(got, want) <= TOL, (name, fmt, rel_err(got, want))

  with torch.no_grad():
    out = hm.generate(
      torch.as_tensor(tokens),
      attention_mask=torch.ones(tokens.shape, dtype=torch.long),
      max_new_tokens=NEW_TOKENS,
      min_new_tokens=NEW_TOKENS,
      do_sample=False,
      output_logits=True,
      return_dict_in_generate=True,
    )
  got_tok = out.sequences[:, tokens.shape[1] :].numpy()
  assert got_tok.shape == want_tok.shape
  _assert_same_greedy(got_tok, want_tok, want_logits)
  first = out.logits[0].numpy()  # the prompt's last position, before any choice
  assert rel_err(first, want_logits[:, 0]) <= TOL


def test_lowrank_export_never_claims_a_plain_architecture(exported):
  """Without remote code transformers refuses the low-rank export instead of building the plain
  model with randomly initialised projections (what a plain architecture name would do)."""
  _, dirs, _ = exported("llama3")
  cfg = json.loads((dirs["hf-lowrank"] / "config.json").read_text())
  assert not hasattr(transformers, cfg["architectures"][0])
  assert cfg["model_type"] not in transformers.CONFIG_MAPPING
  assert cfg["lrjax_lowrank"]["base_architecture"] == "LlamaForCausalLM"
  assert (
    (dirs["hf-lowrank"] / cfg["auto_map"]["AutoModelForCausalLM"].split(".")[0])
    .with_suffix(".py")
    .is_file()
  )
  for cls in (transformers.AutoModelForCausalLM, transformers.AutoConfig):
    with pytest.raises(ValueError, match="trust_remote_code"):
      cls.from_pretrained(dirs["hf-lowrank"], trust_remote_code=False)


@pytest.mark.parametrize("name", ["qwen2_bf16", "mistral_f16"])
def test_lrjax_reads_both_formats_back(exported, name):
  model, dirs, (tokens, want, _, _) = exported(name)
  back = checkpoint.load_hf(dirs["hf-lowrank"])
  assert back.layer_ranks() == model.layer_ranks() and back.layer_heads() == model.layer_heads()
  a, b = nnx.to_flat_state(nnx.state(model)), dict(nnx.to_flat_state(nnx.state(back)))
  for k, v in a:
    assert np.asarray(v[...]).tobytes() == np.asarray(b[k][...]).tobytes(), k
  dense = checkpoint.load_hf(dirs["hf-dense"])
  assert not any(dense.layer_ranks()) and dense.cfg == model.cfg
  assert rel_err(dense(jnp.asarray(tokens)), want) <= TOL
  cfg = json.loads((dirs["hf-dense"] / "config.json").read_text())
  assert "lrjax_lowrank" not in cfg and "auto_map" not in cfg
  assert cfg["lrjax_merged_from"]["ranks"] == model.layer_ranks()


@pytest.mark.parametrize(("dtype", "per_head"), [(jnp.float32, True), (jnp.bfloat16, False)])
def test_dense_export_multiplies_in_float32_then_casts(tmp_path, dtype, per_head):
  m = checkpoint.load_hf(os.path.join(FIXTURES, "qwen3"), dtype=dtype)
  lrjax.compress(m, ratio=0.4, block=4, method="svd", per_head=per_head, progress=False)
  checkpoint.export_hf(m, tmp_path / "ex", format="hf-dense")
  from safetensors.numpy import load_file

  t = load_file(str(tmp_path / "ex" / "model.safetensors"))
  q = m.layers[1].attn.q_proj
  u, v = (
    np.asarray(np.asarray(q.u[...], np.float32), np.float64),
    np.asarray(q.v[...], np.float32),
  )
  if per_head:
    h, r, d = v.shape
    w = np.concatenate([u[:, i * r : (i + 1) * r] @ v[i] for i in range(h)], axis=1)
  else:
    w = u @ v
  got = t["model.layers.1.self_attn.q_proj.weight"]
  assert got.dtype == np.dtype(dtype) and got.shape == w.T.shape
  # rounded once to the stored dtype (half an ulp <= 2^-24 / 2^-8 of the value for f32 / bf16)
  # from a product accurate to f32
  half_ulp = 2.0**-8 if dtype == jnp.bfloat16 else 2.0**-24
  err = np.abs(got.astype(np.float64) - w.T)
  assert np.all(err <= half_ulp * np.abs(w.T) + 1e-6 * np.abs(w).max())
  assert not any("_u_proj" in n or "_v_proj" in n for n in t)


def test_dense_model_exports_its_plain_architecture_in_either_format(tmp_path):
  m = checkpoint.load_hf(os.path.join(FIXTURES, "llama3"), dtype=jnp.float32)
  for fmt in ("hf-lowrank", "hf-dense"):
    checkpoint.export_hf(m, tmp_path / fmt, format=fmt)
    cfg = json.loads((tmp_path / fmt / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert not (tmp_path / fmt / "modeling_lrjax_lowrank.py").exists()
  with pytest.raises(ValueError, match="export format 'gguf' is not one of"):
    checkpoint.export_hf(m, tmp_path / "x", format="gguf")
  assert not (tmp_path / "x").exists()


def test_modeling_file_rejects_ranks_that_do_not_fit(exported, tmp_path):
  """An edited config.json gets an error naming the key, not a half-built model."""
  import shutil

  _, dirs, _ = exported("llama3")
  bad = tmp_path / "llama3_bad_ranks"
  shutil.copytree(dirs["hf-lowrank"], bad)
  cfg = json.loads((bad / "config.json").read_text())
  cfg["lrjax_lowrank"]["ranks"] = cfg["lrjax_lowrank"]["ranks"][:1]
  (bad / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match=r"'lrjax_lowrank' must hold 'ranks', a list of 2"):
    _hf(bad, "hf-lowrank")


@pytest.mark.parametrize(
  ("name", "fmt"), [("llama3", "hf-lowrank"), ("llama2_bias_tied", "hf-dense")]
)
def test_w4a8_checkpoint_exports_its_dequantized_weights(tmp_path, capsys, name, fmt):
  """convert --quantize w4a8 -> export: transformers loads the int4 weights dequantized, with
  the logits of lrjax's model over the same (q · scale) weights; a tied W4A8 head is dropped
  so the export ties to the float table again."""
  from lrjax import cli
  from lrjax.checkpoint import quantized as qck
  from lrjax.custom_calls.cpu import lowering as cpu_lowering

  if not cpu_lowering.extension_available():
    pytest.skip("the W4A8 C++ extension is not built")
  src = os.path.join(FIXTURES, name)
  ck, out = tmp_path / "ck", tmp_path / "ex"
  argv = ["convert", "--hf", src, "--out", str(ck), "--ratio", "0.3", "--method", "svd"]
  assert cli.main([*argv, "--block", "8", "--quantize", "w4a8", "--group", "32"]) == 0
  assert cli.main(["export", "--ckpt", str(ck), "--out", str(out), "--format", fmt]) == 0
  assert "dequantized" in capsys.readouterr().out
  want = qck.for_export(checkpoint.load(ck))
  assert not qck.is_quantized(want)
  hf = _hf(out, fmt)
  tokens = np.random.default_rng(fresh_seed()).integers(0, want.cfg.vocab_size, (2, 9))
  got = hf(torch.tensor(tokens)).logits.detach().numpy()
  ref = np.asarray(want(jnp.asarray(tokens)), np.float32)
  err = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
  assert err < 1e-4, err
