"""The README's quickstart and `make demo`, end to end on CPU: an HF directory -> `lrjax convert
--calib-text` (float and W4A8) -> `lrjax eval` -> `lrjax generate` (text, W4A8 kernels) ->
`lrjax serve` with a chat completion streamed through the openai client, SIGTERM -> `lrjax
export` in both formats, loaded by transformers with lrjax's logits."""

import importlib.util
import math
import os

import pytest

pytest.importorskip("transformers", reason="the [test] extra installs it")
pytest.importorskip("openai", reason="the [test] extra installs it")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _demo():
  spec = importlib.util.spec_from_file_location(
    "lrjax_demo", os.path.join(REPO, "examples", "demo.py")
  )
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.mark.slow
def test_user_journey_runs_end_to_end(tmp_path, monkeypatch):
  from lrjax.custom_calls.cpu import lowering as cpu_lowering

  if not cpu_lowering.extension_available():
    pytest.skip("the W4A8 C++ extension is not built")
  monkeypatch.chdir(tmp_path)  # a user's working directory, not the checkout
  got = _demo().journey(["--workdir", str(tmp_path / "work")])
  labels = [r["label"] for r in got["eval"]]
  assert len(labels) == 3, labels  # the HF model, the low-rank and the W4A8 checkpoint
  for r in got["eval"]:
    assert math.isfinite(r["perplexity"]) and r["perplexity"] > 1.0, r
  assert got["generated"].strip(), "generate printed no text"
  assert got["chat"]["exit_code"] == 0 and got["chat"]["finish_reason"] in ("stop", "length")
  assert set(got["exports"]) == {"hf-lowrank", "hf-dense"}
  for fmt, err in got["exports"].items():
    assert err < 1e-4, (fmt, err)
