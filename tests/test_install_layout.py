"""What installing and importing lrjax exposes: nothing on ``sys.path`` beyond site-packages,
one import name, and no platform toolchain imported while another platform lowers.

Both checks run the installed interpreter (``sys.executable``, the venv ``make test`` installs
into) in a fresh process whose working directory is a temporary directory, so that neither
the checkout nor pytest's own path entries can hide what the install itself adds.
"""

import base64
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[1]
# Neither may be found: the source folders must not import under their own names, and the
# checkout's other folders must not import as lrjax subpackages.
ABSENT = (
  "lowering",
  "custom_calls",
  "tests",
  "examples",
  "benchmarks",
  "lrjax.tests",
  "lrjax.examples",
  "lrjax.benchmarks",
  "lrjax.lrjax",
  "lrjax.scripts",
)
PRESENT = ("lrjax", "lrjax.lowering", "lrjax.custom_calls", "lrjax.custom_calls.cpu._w4a8")
TOOLCHAINS = ("nki", "jax_neuronx", "triton", "jax_triton")
# Bazel runs the base interpreter with site-packages and the runfiles on PYTHONPATH; only an
# interpreter with lrjax installed (make test's venv) shows what the install adds.
needs_install = pytest.mark.skipif(
  "TEST_SRCDIR" in os.environ, reason="under Bazel sys.executable is not the install's venv"
)


def _clean_env(**extra: str) -> dict[str, str]:
  drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH", "PYTHONUSERBASE")
  env = {k: v for k, v in os.environ.items() if k not in drop}
  env["JAX_PLATFORMS"] = "cpu"
  env.update(extra)
  return env


_PROBE = """if True:
  import importlib.util, json, os, sys, sysconfig
  out = {"path": sys.path, "prefix": sys.prefix, "base_prefix": sys.base_prefix,
         "allowed": [sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")]
                    + [os.path.join(sys.base_prefix, "lib",
                                    "python%d%d.zip" % sys.version_info[:2])],
         "specs": {}}
  for name in json.loads(sys.argv[1]):
    spec = importlib.util.find_spec(name)
    out["specs"][name] = None if spec is None else {
      "name": spec.name, "origin": spec.origin,
      "locations": list(spec.submodule_search_locations or [])}
  import lrjax
  out["lrjax_path"] = list(lrjax.__path__)
  print(json.dumps(out))
"""


def _under(path: str, root: str) -> bool:
  path, root = os.path.realpath(path), os.path.realpath(root)
  return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


@needs_install
def test_install_adds_only_site_packages_and_one_import_name(tmp_path):
  """``sys.path`` holds the stdlib and site-packages only; the three packages map to
  ``lrjax``, ``lrjax.lowering``, ``lrjax.custom_calls`` and nothing else imports."""
  r = subprocess.run(
    [sys.executable, "-P", "-c", _PROBE, json.dumps(ABSENT + PRESENT)],
    cwd=tmp_path,
    env=_clean_env(),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  leaked = [p for p in out["path"] if not any(_under(p, a) for a in out["allowed"])]
  assert not leaked, f"sys.path entries outside the stdlib and site-packages: {leaked}"
  for p in out["path"]:  # the checkout, its parent, or any other ancestor
    assert not _under(str(CHECKOUT), p), f"{p} on sys.path exposes the checkout {CHECKOUT}"
  found = {n: out["specs"][n] for n in ABSENT if out["specs"][n] is not None}
  assert not found, f"importable but must not be: {found}"
  for name in PRESENT:
    spec = out["specs"][name]
    assert spec is not None and spec.get("name") == name, (name, spec)
  assert Path(out["specs"]["lrjax.lowering"]["origin"]).parent.name == "lowering"
  assert Path(out["specs"]["lrjax.custom_calls"]["origin"]).parent.name == "custom_calls"
  assert Path(out["specs"]["lrjax.custom_calls.cpu._w4a8"]["origin"]).suffix in (".so", ".pyd")
  for p in out["lrjax_path"]:
    assert Path(p).name == "lrjax", f"lrjax.__path__ holds {p}: {out['lrjax_path']}"


def _plant_toolchains(root: Path, log: Path) -> None:
  """Packages named like the platform toolchains that record, then refuse, being imported."""
  for name in TOOLCHAINS:
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(
      "import os\n"
      f"with open({str(log)!r}, 'a') as f:\n"
      "  f.write(__name__ + '\\n')\n"
      f"raise RuntimeError('planted {name} was imported')\n"
    )


_CPU_WORK = """if True:
  import sys
  import jax, jax.numpy as jnp
  import numpy as np
  import lrjax

  rng = np.random.default_rng(0)
  r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  u, v = r(64, 8), r(8, 96)
  ug, vg, uu, vu, ud, vd = r(96, 8), r(8, 128), r(96, 8), r(8, 128), r(128, 8), r(8, 96)

  def f(x):
    h = (x @ u) @ v
    return ((jax.nn.silu((h @ ug) @ vg) * ((h @ uu) @ vu)) @ ud) @ vd

  x = r(4, 64)
  got = jax.jit(lrjax.fuse(f))(x)
  np.testing.assert_allclose(got, f(x), rtol=1e-4, atol=1e-4)
  report = lrjax.explain(f, x)
  assert len(report.matches) >= 2, str(report)
  text = str(report)
  assert "neuron:" in text and "cuda:" in text, text
  print(sorted(m for m in sys.modules if m.split(".")[0] in %r))
"""


@needs_install
def test_platform_toolchains_not_imported_on_cpu(tmp_path):
  """``import lrjax``, a jitted CPU ``lrjax.fuse`` call and ``lrjax.explain`` with fake
  nki / jax_neuronx / triton / jax_triton packages first on ``sys.path``: none is imported."""
  plant, log = tmp_path / "plant", tmp_path / "imported.log"
  _plant_toolchains(plant, log)
  r = subprocess.run(
    [sys.executable, "-P", "-c", _CPU_WORK % (TOOLCHAINS,)],
    cwd=tmp_path,
    env=_clean_env(PYTHONPATH=str(plant)),
    capture_output=True,
    text=True,
    timeout=300,
  )
  imported = log.read_text().split() if log.exists() else []
  assert not imported, f"imported while lowering for CPU: {imported}\n{r.stderr[-3000:]}"
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout


def _load_backend():
  path = CHECKOUT / "build_backend" / "lrjax_build.py"
  spec = importlib.util.spec_from_file_location("lrjax_build", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _record_hash(data: bytes) -> str:
  return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def test_backend_swaps_the_redirect_for_the_finder_and_keeps_record_valid(tmp_path):
  """The editable wheel rewrite on a wheel laid out like scikit-build-core's."""
  pytest.importorskip("scikit_build_core.build")
  backend = _load_backend()
  files = {
    "_editable_skbc_lrjax.pth": b"import _editable_skbc_lrjax\n/src/lrjax\n/src\n",
    "_editable_skbc_lrjax.py": b"print('redirect')\n",
    "other.pth": b"import other\n/elsewhere\n",
    "only_paths.pth": b"/elsewhere\n",
    "lrjax/custom_calls/cpu/_w4a8.so": b"\x7fELF",
  }
  record = "".join(f"{n},{_record_hash(d)},{len(d)}\n" for n, d in files.items())
  record += "lrjax-0.1.0.dist-info/RECORD,,\n"
  wheel = tmp_path / "lrjax-0.1.0-cp311-cp311-linux_x86_64.whl"
  with zipfile.ZipFile(wheel, "w") as z:
    for n, d in files.items():
      z.writestr(n, d)
    z.writestr("lrjax-0.1.0.dist-info/RECORD", record)
  roots = {"lrjax": "/src/lrjax", "lrjax.lowering": "/src/lowering"}
  add = backend.finder_files(roots)
  changed = backend.rewrite_wheel(str(wheel), add)
  assert changed == [
    "_editable_skbc_lrjax.pth",
    "_editable_skbc_lrjax.py",
    "only_paths.pth",
    "other.pth",
  ]
  with zipfile.ZipFile(wheel) as z:
    names = set(z.namelist())
    assert names == {
      "_lrjax_editable.pth",
      "_lrjax_editable.py",
      "other.pth",
      "lrjax/custom_calls/cpu/_w4a8.so",
      "lrjax-0.1.0.dist-info/RECORD",
    }
    assert z.read("_lrjax_editable.pth") == b"import _lrjax_editable\n"
    assert z.read("other.pth") == b"import other\n"
    assert z.read("_lrjax_editable.py").decode().endswith(f"install({roots!r})\n")
    rows = z.read("lrjax-0.1.0.dist-info/RECORD").decode().splitlines()
    assert {r.rsplit(",", 2)[0] for r in rows} == names
    for row in rows:
      path, digest, size = row.rsplit(",", 2)
      if digest:
        data = z.read(path)
        assert digest == _record_hash(data) and int(size) == len(data), row


def test_editable_finder_maps_only_the_named_packages(tmp_path):
  """The finder on a scratch checkout: the three packages import from their folders, a
  package's built files join its __path__, and the checkout's other folders do not import."""
  src = tmp_path / "src"
  for folder in ("lrjax", "lowering", "custom_calls/cpu", "tests", "examples"):
    (src / folder).mkdir(parents=True)
    (src / folder / "__init__.py").write_text("")
  (src / "lowering" / "fuse.py").write_text("X = 1\n")
  site = tmp_path / "site"
  (site / "lrjax" / "custom_calls" / "cpu").mkdir(parents=True)
  (site / "lrjax" / "custom_calls" / "cpu" / "_ext.py").write_text("BUILT = True\n")
  finder_src = (CHECKOUT / "build_backend" / "_lrjax_editable.py").read_text()
  (site / "_finder.py").write_text(finder_src)
  roots = {"lrjax": str(src / "lrjax"), "lrjax.lowering": str(src / "lowering")}
  roots["lrjax.custom_calls"] = str(src / "custom_calls")
  code = f"""if True:
    import importlib, importlib.util, sys
    sys.path.append({str(site)!r})
    import _finder
    _finder.install({roots!r})
    _finder.install({roots!r})  # a second .pth pass installs no second finder
    assert sum(type(f).__name__ == "LrjaxEditableFinder" for f in sys.meta_path) == 1
    sys.path.remove({str(site)!r})
    import lrjax.lowering.fuse, lrjax.custom_calls.cpu._ext
    assert lrjax.lowering.fuse.X == 1 and lrjax.custom_calls.cpu._ext.BUILT
    assert lrjax.lowering.__file__ == {str(src / "lowering" / "__init__.py")!r}
    for name in ("lowering", "tests", "examples", "lrjax.tests", "lrjax.lrjax", "lrjax.src"):
      assert importlib.util.find_spec(name) is None, name
    print("ok")
  """
  r = subprocess.run(
    [sys.executable, "-S", "-P", "-c", code],
    cwd=tmp_path,
    env=_clean_env(),
    capture_output=True,
    text=True,
  )
  assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
