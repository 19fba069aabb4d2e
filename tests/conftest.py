"""Shared test helpers: the per-dtype tolerance table, fresh random inputs, fuzz summaries and
the tiny chat fixture (compressed) with its tokenizer."""

import itertools
import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # tokenizers' thread pool
# the commands the tests run (in process and in subprocesses) keep out of the user's cache
os.environ.setdefault("LRJAX_COMPILE_CACHE", "off")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Relative tolerance on ||out - ref|| / ||ref||, per compute dtype.
TOLERANCES = {
  jnp.dtype(jnp.float32): 1e-5,
  jnp.dtype(jnp.float16): 2e-3,
  jnp.dtype(jnp.bfloat16): 1e-2,
}

_seed = itertools.count(
  int.from_bytes(np.random.SeedSequence().entropy.to_bytes(16, "little")[:4], "little")
)


def tolerance(dtype) -> float:
  return TOLERANCES[jnp.dtype(dtype)]


def rel_err(out, ref) -> float:
  out = np.asarray(out).astype(np.float64)
  ref = np.asarray(ref).astype(np.float64)
  assert out.shape == ref.shape, f"shape {out.shape} != {ref.shape}"
  assert np.all(np.isfinite(out)), "output has NaN/Inf"
  return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def assert_close(out, ref, dtype, factor: float = 1.0):
  err = rel_err(out, ref)
  tol = factor * tolerance(dtype)
  assert err <= tol, f"relative error {err:.3g} > {tol:.3g} for {jnp.dtype(dtype)}"


def assert_grad_close(got, want, rtol: float = 1e-5, scale: float = 1e-5):
  """f32 gradients: each entry sums terms that may cancel, so reordering error scales with the
  array's largest entry, not each entry's own size (atol = scale * max|want|)."""
  want = np.asarray(want)
  atol = scale * float(np.abs(want).max(initial=0.0))
  np.testing.assert_allclose(np.asarray(got), want, rtol=rtol, atol=atol)


def cpu_kernel_bodies(isa_of) -> list[str]:
  """The bodies a CPU attention kernel has on this machine: "scalar" always, "avx2" where
  ``isa_of(_w4a8)`` says the CPU takes it; none without the extension."""
  from lrjax.custom_calls.cpu import lowering as cpu_lowering

  if not cpu_lowering.extension_available():
    return []
  from lrjax.custom_calls.cpu import _w4a8

  return ["scalar"] + (["avx2"] if isa_of(_w4a8) == "avx2" else [])


def cpu_body_env(body: str):
  """A context in which the CPU kernels take ``body`` (LRJAX_W4A8_ISA=scalar forces the
  portable one)."""
  import os
  from unittest import mock

  env = {k: v for k, v in os.environ.items() if k != "LRJAX_W4A8_ISA"}
  if body == "scalar":
    env["LRJAX_W4A8_ISA"] = "scalar"
  return mock.patch.dict(os.environ, env, clear=True)


def fresh_key():
  """A new PRNG key per call: every test draws fresh random inputs."""
  return jax.random.key(next(_seed) % (2**31))


def randn(shape, dtype=jnp.float32, scale=1.0, key=None):
  key = fresh_key() if key is None else key
  return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def primitive_names(fn, *args) -> list[str]:
  """Names of every primitive in the jaxpr of fn(*args), nested jaxprs included (walked here,
  independently of the pass's own walker); an lr_normed or lr_residual is listed as itself
  and as the op it folds its norm or add into (and that op's inner op)."""
  out = []

  def inner(params):
    out.append(params["inner"])
    if params["inner"] in ("lr_normed", "lr_residual"):
      inner(dict(params["inner_params"]))

  def walk(j):
    for e in j.eqns:
      out.append(e.primitive.name)
      if e.primitive.name in ("lr_normed", "lr_residual"):
        inner(e.params)
      for v in e.params.values():
        for s in v if isinstance(v, (tuple, list)) else (v,):
          if isinstance(s, jax.extend.core.ClosedJaxpr):
            walk(s.jaxpr)
          elif isinstance(s, jax.extend.core.Jaxpr):
            walk(s)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return out


def decode_attention_f64(q, k, v, pos, window=None):
  """decode_attention in float64 numpy: each query head over its KV head's visible keys."""
  q, k, v = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (q, k, v))
  b, hq, d = q.shape
  hkv = k.shape[1]
  out = np.zeros((b, hq, d))
  for i in range(b):
    p = int(pos[i])
    lo = 0 if window is None else max(0, p - window + 1)
    for j in range(hq):
      kh = j // (hq // hkv)
      s = k[i, kh, lo : p + 1] @ q[i, j] / np.sqrt(d)
      w = np.exp(s - s.max())
      out[i, j] = (w / w.sum()) @ v[i, kh, lo : p + 1]
  return out.reshape(b, hq * d)


def decode_attention_operands(b, hq, hkv, t, d, dtype, pos=None):
  """q [b,hq,d], k/v [b,hkv,t,d] and positions with the first row at 0, the last at t-1."""
  q, k, v = randn((b, hq, d), dtype), randn((b, hkv, t, d), dtype), randn((b, hkv, t, d), dtype)
  if pos is None:
    pos = np.random.default_rng().integers(0, t, b)
    pos[0], pos[-1] = 0, t - 1  # the first and the last key
  return q, k, v, jnp.asarray(pos, jnp.int32)


@pytest.fixture
def rng():
  return np.random.default_rng(next(_seed))


def kv_attention_f64(q, zk, zv, vk, vv, pos, inv_freq, bk=None, bv=None, window=None):
  """float64 host reference of lrjax.lowering.lr_kv_attention (no intermediate rounding)."""
  f = lambda a: None if a is None else np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  q, zk, zv, vk, vv, bk, bv = map(f, (q, zk, zv, vk, vv, bk, bv))
  b, hq, d = q.shape
  t = zk.shape[1]
  hkv = vk.shape[1] // d
  k = zk @ vk + (0 if bk is None else bk)  # [B, T, Hkv*D]
  v = zv @ vv + (0 if bv is None else bv)
  k, v = k.reshape(b, t, hkv, d), v.reshape(b, t, hkv, d)
  ang = np.arange(t)[:, None] * np.asarray(inv_freq, np.float64)[None, :]
  cos, sin = np.cos(np.concatenate([ang, ang], 1)), np.sin(np.concatenate([ang, ang], 1))
  rot = np.concatenate([-k[..., d // 2 :], k[..., : d // 2]], -1)  # rotate-half
  k = k * cos[None, :, None] + rot * sin[None, :, None]
  out = np.zeros((b, hq, d))
  for i in range(b):
    keys = np.arange(t)
    vis = keys <= pos[i]
    if window is not None:
      vis &= pos[i] - keys < window
    for j in range(hq):
      kh = j // (hq // hkv)
      s = (k[i, :, kh] @ q[i, j]) / np.sqrt(d)
      s = np.where(vis, s, -np.inf)
      p = np.exp(s - s.max())
      out[i, j] = (p / p.sum()) @ v[i, :, kh]
  return out.reshape(b, hq * d)


@pytest.fixture(autouse=True)
def _no_jax_triton_stub_after_the_test():
  """A test that installs kernel_resources' jax-triton stub in this process (to
  plan or compile kernels without jax-triton) takes it out again: left in sys.modules it made
  later tests on the same worker see a jax_triton without a spec (the registry's toolchain
  check raised, and the Triton kernels fell back with a warning instead of a reason)."""
  import sys

  before = sys.modules.get("jax_triton")
  yield
  after = sys.modules.get("jax_triton")
  if after is not before and getattr(after, "__spec__", None) is None:
    del sys.modules["jax_triton"]


@pytest.fixture(scope="module")
def load_benchmark():
  """Loads a script of benchmarks/ as a module (the scripts are not a package), with
  benchmarks/ on sys.path as when it runs as a script (it imports its siblings)."""
  import importlib.util
  import os
  import sys

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if os.path.join(root, "benchmarks") not in sys.path:
    sys.path.insert(0, os.path.join(root, "benchmarks"))

  def load(name: str):
    spec = importlib.util.spec_from_file_location(
      name, os.path.join(root, "benchmarks", f"{name}.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

  return load


@pytest.fixture(autouse=True)
def _cpu_device_unless_gpu_test(request):
  """Tests not marked ``gpu`` are the CPU suite: on a GPU host they run on its CPU device, so
  they lower and compile for the platform their expectations were written for."""
  if request.node.get_closest_marker("gpu") or jax.default_backend() == "cpu":
    yield
    return
  with jax.default_device(jax.devices("cpu")[0]):
    yield


# ---- fuzz summaries: case and crash counts printed at the end of the run (xdist or not) ------
_FUZZ: dict[str, list[int]] = {}


@pytest.fixture(scope="session")
def fuzz_report():
  """``report(name, cases, crashes)`` adds a fuzzer's counts to the end-of-run summary."""

  def report(name: str, cases: int, crashes: int):
    c = _FUZZ.setdefault(name, [0, 0])
    c[0] += cases
    c[1] += crashes

  return report


def pytest_sessionfinish(session):
  out = getattr(session.config, "workeroutput", None)  # an xdist worker: hand counts up
  if out is not None:
    out["lrjax_fuzz"] = dict(_FUZZ)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
  for name, (cases, crashes) in getattr(node, "workeroutput", {}).get("lrjax_fuzz", {}).items():
    c = _FUZZ.setdefault(name, [0, 0])
    c[0] += cases
    c[1] += crashes


def pytest_terminal_summary(terminalreporter):
  """Prints the fuzzers' case and crash counts: those reported through ``fuzz_report`` and
  those recorded with ``record_property("fuzz", ...)`` (which travel with the test report,
  also under xdist)."""
  lines = [
    f"{r.nodeid}: {v}"
    for reports in terminalreporter.stats.values()
    for r in reports
    for k, v in getattr(r, "user_properties", ())
    if k == "fuzz" and getattr(r, "when", "call") == "call"
  ]
  if _FUZZ or lines:
    terminalreporter.section("fuzz")
    for name, (cases, crashes) in sorted(_FUZZ.items()):
      terminalreporter.write_line(f"{name}: {cases} cases, {crashes} crashes")
    for line in lines:
      terminalreporter.write_line(line)


# ---- the tiny chat fixture (a 2-layer Llama with a BPE tokenizer and a chat template) ---------
CHAT = os.path.join(os.path.dirname(__file__), "fixtures", "hf", "llama_chat")


@pytest.fixture(scope="session")
def chat_model():
  """The llama_chat fixture with 30 % of its projection params removed (SVD, deterministic)."""
  import lrjax
  from lrjax.models import from_hf

  return lrjax.compress(from_hf(CHAT), ratio=0.3, method="svd", block=8, progress=False)


@pytest.fixture(scope="session")
def chat_text():
  from lrjax import text

  return text.load_text(CHAT)


def split_plan_violations(splits, b, hkv, t, max_keys, target, most, min_keys) -> str:
  """What is wrong with ``splits`` as a decode attention kernel's split count: the fewest
  powers of two giving ``target`` programs (b·hkv·splits) and at most ``max_keys`` keys a split
  (0: no bound), short of the caps (``most`` splits, ``min_keys`` keys a split); "" if
  nothing."""
  wants_more = b * hkv * splits < target or (max_keys and t > splits * max_keys)
  capped = 2 * splits > most or t // (2 * splits) < min_keys
  half = splits // 2
  if wants_more and not capped:
    return f"{splits} splits: too few"
  if half and b * hkv * half >= target and not (max_keys and t > half * max_keys):
    return f"{splits} splits: {half} would do"
  return ""
