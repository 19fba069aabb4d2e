"""The installed package: import names, the top-level API, nothing installed at top level."""

import importlib.metadata

import lrjax


def test_import_names():
  import lrjax.custom_calls
  import lrjax.lowering

  assert lrjax.lowering.__name__ == "lrjax.lowering"
  assert lrjax.custom_calls.__name__ == "lrjax.custom_calls"
  assert set(lrjax.custom_calls.kernel_catalog()) == {"cpu", "cuda", "neuron"}


def test_no_top_level_lowering_or_custom_calls_installed():
  files = importlib.metadata.files("lrjax") or []
  tops = {f.parts[0] for f in files}
  assert not tops & {"lowering", "custom_calls"}, sorted(tops)


def test_top_level_api():
  assert callable(lrjax.fuse) and callable(lrjax.explain) and callable(lrjax.quantize)
  from lrjax.compress import compress  # importing the submodule must not break the spelling

  assert callable(lrjax.compress) and lrjax.compress.compress is compress
  assert lrjax.models.from_hf is not None
