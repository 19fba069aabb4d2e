"""W4A8-quantized checkpoints: save -> load bit-exact, repacking for another host's layout,
dequantizing where no kernel runs, bad records, and `convert --quantize` -> `generate`."""

import json
import logging
import os

import numpy as np
import pytest
from flax import nnx

from lrjax import bench, checkpoint, cli
from lrjax.checkpoint import quantized as qck
from lrjax.custom_calls.cpu import lowering as cpu_lowering
from lrjax.lowering import quantized as Q
from lrjax.models import LlamaForCausalLM, ModelConfig
from lrjax.nn import Linear, LowRankLinear
from lrjax.quant import QuantizedLinear, QuantizedLowRankLinear, default_layout, pack, quantize
from lrjax.serving import Engine, Request, SamplingParams

pytestmark = pytest.mark.skipif(
  not cpu_lowering.extension_available(), reason="the W4A8 C++ extension is not built"
)

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
RANKS = {"q_proj": 16, "o_proj": 16, "gate_proj": 24, "up_proj": 24, "down_proj": 24}


def _model(tied: bool, bias: bool = False):
  cfg = ModelConfig.tiny(tie_word_embeddings=tied, vocab_size=160, mlp_bias=bias)
  seed = int(np.random.default_rng().integers(1 << 30))
  return LlamaForCausalLM(cfg, [RANKS] * cfg.num_layers, rngs=nnx.Rngs(seed))


def _flat(m):
  return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(m))}


def _assert_bit_equal(a, b):
  fa, fb = _flat(a), _flat(b)
  assert set(fa) == set(fb)
  for k in fa:
    assert fa[k].dtype == fb[k].dtype and fa[k].tobytes() == fb[k].tobytes(), k


@nnx.jit
def _logits(model, tokens):
  return model(tokens)


def _tokens(model, prompt):
  (res,) = Engine(model, max_slots=1, max_len=16, buckets=(8,), fuse=True).generate(
    [Request(prompt, SamplingParams(max_new_tokens=6))]
  )
  return res.tokens


@pytest.mark.parametrize("tied,bias,group", [(True, False, 32), (False, True, 64)])
def test_save_load_is_bit_exact_and_runs_fused(tmp_path, tied, bias, group):
  q = quantize(_model(tied, bias), "w4a8", group=group)
  checkpoint.save(q, tmp_path / "q")
  back = checkpoint.load(tmp_path / "q")
  _assert_bit_equal(q, back)
  assert isinstance(back.layers[1].mlp.up_proj, QuantizedLowRankLinear)
  assert isinstance(back.layers[0].attn.k_proj, QuantizedLinear)
  assert isinstance(back.lm_head, QuantizedLinear)  # a tied model's head too
  assert back.layer_ranks() == q.layer_ranks() == [RANKS] * 2
  meta = json.loads((tmp_path / "q" / checkpoint.METADATA_NAME).read_text())
  rec = meta["quantization"]
  assert rec["scheme"] == "w4a8" and rec["layout"] == default_layout()
  assert group in rec["groups"]
  assert rec["layers"]["layers.0.attn.q_proj"]["u"] == [64, 16, group, default_layout()]
  assert rec["layers"]["lm_head"]["w"][:2] == [64, 160]
  assert meta["params"]["layers.0.attn.q_proj.u_packed"]["dtype"] == "uint8"
  if tied:  # through the engine, fused (once: compiling is the slow part)
    prompt = [int(t) for t in np.random.default_rng().integers(0, 160, 7)]
    assert _tokens(back, prompt) == _tokens(q, prompt)
    kernels = bench.decode_kernels(back)
    assert kernels["lrjax_w4a8_xuv"] == 10 and kernels["lrjax_w4a8_matmul"] == 2 * 2 + 1


def test_other_layout_is_repacked_exactly(tmp_path, caplog):
  other = "arm_sdot4" if default_layout() == "x86_vnni" else "x86_vnni"
  q = quantize(_model(False), "w4a8", group=32, layout=other)
  checkpoint.save(q, tmp_path / "arm")
  with caplog.at_level(logging.WARNING, logger="lrjax.checkpoint"):
    back = checkpoint.load(tmp_path / "arm")
  assert f"packed for {other}" in caplog.text and "repacking" in caplog.text
  a, b = q.layers[0].mlp.gate_proj, back.layers[0].mlp.gate_proj
  assert b.u_meta[3] == default_layout() and a.u_meta[3] == other
  for name in ("u", "v"):
    k, n, g, _ = getattr(a, f"{name}_meta")
    qa = Q.unpack_int4(getattr(a, f"{name}_packed")[...], k, n, other)
    qb = Q.unpack_int4(getattr(b, f"{name}_packed")[...], k, n, default_layout())
    np.testing.assert_array_equal(qa, qb)
    np.testing.assert_array_equal(
      np.asarray(getattr(a, f"{name}_scales")[...])[:, :n],
      np.asarray(getattr(b, f"{name}_scales")[...])[:, :n],
    )
  # every layout's kernel path computes the same sums: identical logits
  tokens = np.random.default_rng().integers(0, 160, (2, 5))
  np.testing.assert_array_equal(np.asarray(_logits(q, tokens)), np.asarray(_logits(back, tokens)))


def test_dequantized_at_load_where_no_kernel_runs(tmp_path, monkeypatch, caplog):
  q = quantize(_model(True), "w4a8", group=32)
  checkpoint.save(q, tmp_path / "q")
  monkeypatch.setattr(qck, "w4a8_kernel_available", lambda: "the default platform is 'gpu'")
  with caplog.at_level(logging.WARNING, logger="lrjax.checkpoint"):
    back = checkpoint.load(tmp_path / "q")
  assert "dequantizing its int4 weights to float32" in caplog.text
  m, ref = back.layers[0].attn.q_proj, q.layers[0].attn.q_proj
  assert type(m) is LowRankLinear and type(back.lm_head) is Linear
  k, n, g, lay = ref.u_meta
  want = pack.dequantize_int4(
    np.asarray(Q.unpack_int4(ref.u_packed[...], k, n, lay)), np.asarray(ref.u_scales[...]), g
  )
  np.testing.assert_array_equal(np.asarray(m.u[...]), want.astype(np.float32))
  assert not qck.is_quantized(back)
  tokens = np.random.default_rng().integers(0, 160, (2, 5))
  y, yq = np.asarray(_logits(back, tokens)), np.asarray(_logits(q, tokens))
  assert np.linalg.norm(y - yq) / np.linalg.norm(yq) < 0.2  # only int8 activations differ


@pytest.mark.parametrize(
  "edit,match",
  [
    (lambda r: r.update(scheme="w8a8"), "quantization scheme"),
    (lambda r: r.update(layout="avx9"), "packed layout 'avx9' is unknown"),
    (lambda r: r.update(version=99), "newer than this lrjax reads"),
  ],
)
def test_bad_quantization_record_is_a_clear_error(tmp_path, edit, match):
  checkpoint.save(quantize(_model(False), "w4a8", group=32), tmp_path / "q")
  mp = tmp_path / "q" / checkpoint.METADATA_NAME
  meta = json.loads(mp.read_text())
  edit(meta["quantization"])
  mp.write_text(json.dumps(meta))
  with pytest.raises(ValueError, match=match):
    checkpoint.load(tmp_path / "q")


def test_quantized_checkpoint_refuses_a_mesh(tmp_path):
  import jax
  from jax.sharding import Mesh

  checkpoint.save(quantize(_model(False), "w4a8", group=32), tmp_path / "q")
  mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
  with pytest.raises(ValueError, match="loads on one device"):
    checkpoint.load(tmp_path / "q", mesh)


def test_convert_quantize_then_generate(tmp_path, capsys):
  out = tmp_path / "lr_q"
  argv = ["convert", "--hf", os.path.join(FIXTURES, "llama3"), "--out", str(out)]
  argv += ["--ratio", "0.3", "--method", "svd", "--block", "8", "--quantize", "w4a8"]
  assert cli.main([*argv, "--group", "32", "--verify"]) == 0
  assert "quantized w4a8 group=32" in capsys.readouterr().out
  back = checkpoint.load(out)
  assert qck.is_quantized(back) and back.compression["ratio"] == 0.3
  assert (
    cli.main(["generate", "--ckpt", str(out), "--prompt-ids", "1,2,3", "--max-new-tokens", "3"])
    == 0
  )
  assert "prompt=[1, 2, 3] ->" in capsys.readouterr().out


def test_convert_group_without_quantize_fails_before_loading(tmp_path, capsys):
  argv = ["convert", "--hf", "/nonexistent", "--out", str(tmp_path / "o"), "--ratio", "0.3"]
  assert cli.main([*argv, "--group", "32"]) == 2
  assert "--group applies with --quantize" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cli.main([*argv, "--quantize", "w4a8", "--group", "12"])
