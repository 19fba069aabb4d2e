"""Sharding rules, spec checks and HLO collective parsing (no devices needed)."""

import os
import subprocess
import sys

import pytest
from jax.sharding import PartitionSpec as P

from lrjax import sharding as S
from lrjax.sharding import hlo


@pytest.mark.parametrize("proj", ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"])
def test_first_sublayer_rules(proj):
  grp = "attn" if proj[0] in "qkv" else "mlp"
  key = f"layers.3.{grp}.{proj}"
  ax = ("embed", "rank")
  assert S.param_spec("lowrank_tp", key + ".u", ax, 2) == P(None, "tp")  # rank, all-gathered
  assert S.param_spec("lowrank_tp", key + ".v", ax, 2) == P(None, "tp")  # column-parallel
  assert S.param_spec("naive_tp", key + ".u", ax, 2) == P(None, "tp")
  assert S.param_spec("naive_tp", key + ".v", ax, 2) == P("tp", None)  # row on the rank
  assert S.param_spec("repl_u_tp", key + ".u", ax, 2) == P()
  assert S.param_spec("dense", key + ".kernel", ("embed", "heads"), 2) == P(None, "tp")


@pytest.mark.parametrize("proj,grp", [("o_proj", "attn"), ("down_proj", "mlp")])
def test_second_sublayer_rules(proj, grp):
  key = f"layers.0.{grp}.{proj}"
  assert S.param_spec("lowrank_tp", key + ".u", ("heads", "rank"), 2) == P("tp", None)
  assert S.param_spec("lowrank_tp", key + ".v", ("rank", "embed"), 2) == P()
  assert S.param_spec("naive_tp", key + ".u", ("heads", "rank"), 2) == P(None, "tp")
  assert S.param_spec("naive_tp", key + ".v", ("rank", "embed"), 2) == P("tp", None)
  assert S.param_spec("dense", key + ".kernel", ("heads", "embed"), 2) == P("tp", None)


def test_other_params_and_cache():
  assert S.param_spec("lowrank_tp", "embed.embedding", ("vocab", "embed"), 2) == P()
  assert S.param_spec("naive_tp", "lm_head.kernel", ("embed", "vocab"), 2) == P(None, "tp")
  assert S.param_spec("lowrank_tp", "layers.0.input_layernorm.weight", ("embed",), 1) == P()
  assert S.cache_spec("naive_tp") == P("data")  # replicated attention
  assert S.cache_spec("lowrank_tp") == P("data", "tp")  # local KV heads


def test_spec_errors_name_the_fix():
  with pytest.raises(ValueError, match="sharding strategy"):
    S.param_spec("megatron", "layers.0.attn.q_proj.u", ("embed", "rank"), 2)
  with pytest.raises(ValueError, match="low-rank models"):
    S.param_spec("dense", "layers.0.attn.q_proj.u", ("embed", "rank"), 2)
  with pytest.raises(ValueError, match="multiples of 4"):
    S.spec_for("lowrank_tp", "layers.0.attn.q_proj.u", ("embed", "rank"), (64, 18), 4)
  # lm_head with a vocab that does not divide falls back to replicated.
  assert S.spec_for("lowrank_tp", "lm_head.kernel", ("embed", "vocab"), (64, 257), 4) == P()


def test_make_mesh_errors():
  with pytest.raises(ValueError, match="needs 64 devices"):
    S.make_mesh(64)
  with pytest.raises(ValueError, match="positive int"):
    S.make_mesh(0)


HLO = """
  %all-reduce.1 = (f32[2,5,32]{2,1,0}, bf16[2,5,64]{2,1,0}) all-reduce(%a, %b), channel_id=1
  %ag = f32[2,5,16]{2,1,0} all-gather(f32[2,5,4]{2,1,0} %x), dimensions={2}
  %ags = (bf16[8,4]{1,0}, bf16[8,16]{1,0}) all-gather-start(bf16[8,4]{1,0} %y), dimensions={1}
  %agd = bf16[8,16]{1,0} all-gather-done(%ags)
  %rs = f32[4,8]{1,0} reduce-scatter(f32[16,8]{1,0} %z), dimensions={0}
  %add = f32[4]{0} add(%p, %q)
"""


def test_collective_parsing():
  cs = hlo.collectives(HLO)
  assert [c.kind for c in cs] == ["all-reduce", "all-gather", "all-gather", "reduce-scatter"]
  ar, ag, ags, rs = cs
  assert ar.nbytes == 2 * 5 * 32 * 4 + 2 * 5 * 64 * 2 and ar.cost_bytes == 2 * ar.nbytes
  assert ag.shapes == ((2, 5, 16),) and ag.nbytes == 2 * 5 * 16 * 4
  assert ags.shapes == ((8, 16),) and ags.nbytes == 8 * 16 * 2  # result of the async start
  assert rs.nbytes == 4 * 8 * 4
  s = hlo.summarize(cs)
  assert s["n"] == 4 and s["by_kind"]["all-gather"]["n"] == 2
  assert hlo.weight_gathers(cs, [(8, 16), (3, 3)]) == [ags]


_DEFAULT_DEVICE_CHECK = """
import jax
from lrjax import sharding
from lrjax.checkpoint import placement
d0, d1 = jax.devices()[:2]
assert sharding.default_device() == d0
with jax.default_device(d1):
  assert sharding.default_device() == d1
  assert placement.pick(None, "w", ("embed",), None).device_set == {d1}
with jax.default_device("cpu"):
  assert sharding.default_device() == d0
print("OK")
"""


def test_default_device_follows_jax_default_device():
  """Single-device placement (checkpoint.load, the engine) honours ``jax.default_device`` (in a
  subprocess with 2 simulated devices, so the default is not the first device)."""
  env = {
    **os.environ,
    "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    "JAX_PLATFORMS": "cpu",
  }
  p = subprocess.run(
    [sys.executable, "-c", _DEFAULT_DEVICE_CHECK],
    capture_output=True,
    text=True,
    env=env,
    timeout=120,
  )
  assert p.returncode == 0 and p.stdout.strip() == "OK", p.stderr[-2000:]
