"""The installed package: import names, the top-level API, nothing installed at top level."""

import importlib.metadata
import inspect
import os
import subprocess
import sys
import types

import pytest
from jax.extend.core import Primitive

import lrjax

API = {"__version__", "compress", "explain", "fuse", "quantize"}
SUBPACKAGES = {"checkpoint", "models", "nn", "serving", "sharding"}


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
  assert set(lrjax.__all__) == API | SUBPACKAGES
  assert lrjax.__version__ == importlib.metadata.version("lrjax")
  for name in ("fuse", "explain", "compress", "quantize"):
    fn = getattr(lrjax, name)
    assert isinstance(fn, types.FunctionType), (name, type(fn))
    assert inspect.signature(fn).return_annotation is not inspect.Signature.empty, name
  from lrjax.compression import compress
  from lrjax.lowering import explain, fuse
  from lrjax.quant import quantize

  assert (lrjax.compress, lrjax.fuse, lrjax.explain, lrjax.quantize) == (
    compress,
    fuse,
    explain,
    quantize,
  )
  for name in SUBPACKAGES:
    assert getattr(lrjax, name).__name__ == f"lrjax.{name}"
  assert lrjax.models.from_hf is not None
  assert API | SUBPACKAGES <= set(dir(lrjax))


def test_primitives_and_registry_are_not_top_level():
  for name in ("lr_xuv", "lr_mlp", "lr_xuv_p", "registry", "custom_calls_register"):
    assert name not in lrjax.__all__
    try:
      getattr(lrjax, name)
    except AttributeError as e:
      assert repr(name) in str(e)
    else:
      raise AssertionError(f"lrjax.{name} is still an attribute")
  from lrjax.lowering import primitives, registry

  assert isinstance(primitives.lr_xuv_p, Primitive)
  assert callable(registry.select)


def test_lowering_all_lists_what_users_call():
  import lrjax.lowering

  for name in lrjax.lowering.__all__:
    obj = getattr(lrjax.lowering, name)
    assert not isinstance(obj, (Primitive, types.ModuleType)), name
  assert {"fuse", "explain", "lr_xuv", "lr_mlp", "KernelLowering"} <= set(lrjax.lowering.__all__)


def test_import_lrjax_imports_no_jax(tmp_path):
  """``import lrjax`` stays light: jax loads on the first use of the API."""
  heavy = ("jax", "flax", "numpy", "lrjax.lowering", "lrjax.custom_calls")
  code = f"import sys, lrjax; print(sorted(m for m in {heavy!r} if m in sys.modules))"
  r = subprocess.run(
    [sys.executable, "-P", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
  )
  assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-2000:])
  code = "import sys, lrjax; lrjax.fuse; print('jax' in sys.modules)"
  r = subprocess.run(
    [sys.executable, "-P", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
  )
  assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-2000:]


def test_cli_version(tmp_path):
  script = os.path.join(os.path.dirname(sys.executable), "lrjax")
  cmd = [script] if os.path.exists(script) else [sys.executable, "-m", "lrjax.cli"]
  r = subprocess.run([*cmd, "--version"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.strip() == f"lrjax {lrjax.__version__}", r.stdout


@pytest.mark.parametrize(
  "argv, hint",
  [
    (["generate", "ck"], "unexpected argument 'ck': options only; did you mean --ckpt ck?"),
    (["export", "ck", "--out", "o"], "did you mean --ckpt ck?"),
    (["convert", "hf", "--out", "o", "--ratio", "0.3"], "did you mean --hf hf? (or --orbax)"),
    (["eval", "--ckpt", "a", "stray"], "unexpected argument 'stray'"),
  ],
)
def test_a_bare_word_names_the_option_it_was_meant_for(argv, hint, capsys):
  from lrjax import cli

  with pytest.raises(SystemExit) as e:
    cli.main(argv)
  assert e.value.code == 2 and hint in capsys.readouterr().err


def test_options_and_their_values_parse_as_before():
  from lrjax import cli

  ap = cli.build_parser()
  a = ap.parse_args(["generate", "--ckpt", "ck", "--prompt", "x", "--temperature=0", "--stop", "y"])
  assert (a.ckpt, a.prompt, a.temperature, a.stop) == ("ck", ["x"], 0.0, ["y"])
  a = ap.parse_args(["-v", "export", "--ckpt", "ck", "--out", "o", "--overwrite"])
  assert (a.verbose, a.ckpt, a.out, a.overwrite) == (True, "ck", "o", True)
