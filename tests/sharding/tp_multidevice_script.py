"""Run by test_tp_multidevice.py in a subprocess with 8 simulated CPU devices; prints JSON."""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import lrjax  # noqa: E402
from lrjax import sharding as S  # noqa: E402
from lrjax.lowering import lr_mlp, lr_mlp_reference, partitioning  # noqa: E402
from lrjax.models import LlamaForCausalLM, ModelConfig  # noqa: E402
from lrjax.sharding import analysis as A  # noqa: E402
from lrjax.sharding import testing as T  # noqa: E402

part = sys.argv[1]  # "logits" | "fused" | "mlp"
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
out = {"n_devices": jax.device_count()}
cfg = ModelConfig.tiny(
  hidden_size=64, intermediate_size=128, num_heads=8, num_kv_heads=8, head_dim=8, num_layers=1
)
ranks = [A.compressed_ranks(cfg, 0.4, 8)]
mk = lambda: LlamaForCausalLM(cfg, ranks=ranks, rngs=nnx.Rngs(seed))  # noqa: E731


def part_logits():
  """Logits equal single device; collectives of one layer."""
  recs = []
  for strategy, tp in (("naive_tp", 8), ("lowrank_tp", 2), ("lowrank_tp", 8), ("repl_u_tp", 4)):
    recs.append(A.measure(mk, cfg, strategy, tp, batch=2, seq=5, seed=seed))
  out["records"] = recs


def part_fused():
  """Fused kernels (opaque custom calls) run on local shards: no whole-weight all-gather."""
  h = jax.random.normal(jax.random.key(seed + 7), (2, 5, cfg.hidden_size))
  tok = jax.random.randint(jax.random.key(seed + 3), (2, 5), 0, cfg.vocab_size)
  fused = {}
  for strategy in ("naive_tp", "lowrank_tp", "repl_u_tp"):
    ref = np.asarray(mk()(tok))
    m = S.shard(mk(), S.make_mesh(4), strategy)
    shapes = A.weight_shapes(m.layers[0])
    with T.callback_kernels():
      txt = A.layer_hlo(m.layers[0], cfg, h, fused=True)
      with partitioning.disabled():
        txt_off = A.layer_hlo(m.layers[0], cfg, h, fused=True)
    with T.callback_kernels(execute=True):
      got = np.asarray(nnx.jit(lambda mm, t: lrjax.fuse(lambda a, b: a(b))(mm, t))(m, tok))
    cc = S.collectives(txt)
    fused[strategy] = {
      "custom_calls": txt.count("custom-call("),
      "whole_weight_gathers": len(S.weight_gathers(cc, shapes)),
      "whole_weight_gathers_unpartitioned": len(S.weight_gathers(S.collectives(txt_off), shapes)),
      "bytes": S.summarize(cc)["cost_bytes"],
      "rel_err": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
    }
  out["fused"] = fused


def part_mlp():
  """lr_mlp partitioned directly (the model's MLP may not fuse into lr_mlp)."""
  mesh = S.make_mesh(4)
  k = jax.random.split(jax.random.key(seed + 11), 8)
  d, m_, r = 32, 64, 16
  x = jax.random.normal(k[0], (3, d))
  ug, vg = jax.random.normal(k[1], (d, r)) / 6, jax.random.normal(k[2], (r, m_)) / 4
  uu, vu = jax.random.normal(k[3], (d, r)) / 6, jax.random.normal(k[4], (r, m_)) / 4
  ud, vd = jax.random.normal(k[5], (m_, r)) / 8, jax.random.normal(k[6], (r, d)) / 4
  bu = jax.random.normal(k[7], (m_,))
  ref = np.asarray(lr_mlp_reference(x, (uu, vu, bu), (ud, vd), gate=(ug, vg)))
  layouts = {
    "naive": ((None, "tp"), ("tp", None), (None, "tp"), ("tp", None)),
    "lowrank": ((None, "tp"), (None, "tp"), ("tp", None), (None, None)),
    "repl_u": ((None, None), (None, "tp"), (None, None), (None, "tp")),
  }
  mlp = {}
  for name, (su1, sv1, su2, sv2) in layouts.items():
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, P(*s)))  # noqa: E731
    bspec = ("tp",) if sv1[1] == "tp" else (None,)
    args = (
      put(x, (None, None)),
      put(ug, su1),
      put(vg, sv1),
      put(uu, su1),
      put(vu, sv1),
      put(bu, bspec),
      put(ud, su2),
      put(vd, sv2),
    )
    f = lambda x, ug, vg, uu, vu, bu, ud, vd: lr_mlp(x, (uu, vu, bu), (ud, vd), gate=(ug, vg))  # noqa: E731
    with T.callback_kernels():
      txt = jax.jit(f).lower(*args).compile().as_text()
    with T.callback_kernels(execute=True):  # a fresh function: not the compile-only executable
      got = np.asarray(jax.jit(lambda *a: f(*a))(*args))
    cc = S.collectives(txt)
    mlp[name] = {
      "rel_err": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
      "whole_weight_gathers": len(S.weight_gathers(cc, [a.shape for a in (ug, vg, ud, vd)])),
      "kinds": sorted({c.kind for c in cc}),
    }
  out["mlp"] = mlp


{"logits": part_logits, "fused": part_fused, "mlp": part_mlp}[part]()
print("JSON" + json.dumps(out))
