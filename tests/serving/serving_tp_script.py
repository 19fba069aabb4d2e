"""Run by test_serving_tp.py with 8 simulated CPU devices: orbax checkpoint → engine on 1 and N
devices, `lrjax generate` on N devices. Prints JSON."""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from lrjax import checkpoint  # noqa: E402
from lrjax.cli import main as cli_main  # noqa: E402
from lrjax.models import LlamaForCausalLM, ModelConfig  # noqa: E402
from lrjax.serving import Request, SamplingParams, load_engine, load_model  # noqa: E402
from lrjax.sharding.analysis import compressed_ranks  # noqa: E402

tmp, seed = sys.argv[1], int(sys.argv[2])
cfg = ModelConfig.tiny(
  hidden_size=64,
  intermediate_size=128,
  num_heads=8,
  num_kv_heads=4,
  head_dim=8,
  num_layers=2,
  vocab_size=128,
)
model = LlamaForCausalLM(cfg, ranks=[compressed_ranks(cfg, 0.4, 8)] * 2, rngs=nnx.Rngs(seed))
ckpt = os.path.join(tmp, "ckpt")
checkpoint.save(model, ckpt)
rng = np.random.default_rng(seed)
ps = [list(map(int, rng.integers(0, 128, size=n))) for n in (3, 9, 1, 6)]
reqs = lambda: [Request(p, SamplingParams(max_new_tokens=5)) for p in ps]  # noqa: E731
kw = dict(max_slots=3, max_len=32, buckets=(16,))
out = {"single": [r.tokens for r in load_engine(ckpt, **kw).generate(reqs())]}
from lrjax.serving import engine as engine_mod  # noqa: E402

compiles = lambda: (
  engine_mod._prefill_jit._cache_size(),  # noqa: E731
  engine_mod._decode_jit._cache_size(),
)
for strategy, tp, lowrank in (
  ("lowrank_tp", 4, False),
  ("naive_tp", 2, False),
  ("lowrank_tp", 4, True),
):
  eng = load_engine(ckpt, tp=tp, strategy=strategy, lowrank_kv=lowrank, **kw)
  eng.warmup()
  before = compiles()
  out[f"{strategy}_{tp}_{lowrank}"] = [r.tokens for r in eng.generate(reqs())]
  out[f"compiled_after_warmup_{strategy}_{tp}_{lowrank}"] = [
    a - b for a, b in zip(compiles(), before)
  ]
# Fused steps with opaque stand-in kernels, partitioned onto local shards.
from lrjax.sharding.testing import callback_kernels  # noqa: E402

with callback_kernels(execute=True):
  eng = load_engine(ckpt, tp=4, fuse=True, **kw)
  out["fused_lowrank_tp_4"] = [r.tokens for r in eng.generate(reqs())]
  eng = load_engine(ckpt, tp=2, strategy="naive_tp", fuse=True, **kw)
  out["fused_naive_tp_2"] = [r.tokens for r in eng.generate(reqs())]
# Params were restored straight into their target shardings.
m = load_model(ckpt, tp=4)
u = m.layers[0].attn.q_proj.u[...]
out["q_u_spec"] = [str(a) for a in u.sharding.spec]
out["q_u_shard_shape"] = list(u.addressable_shards[0].data.shape)
out["q_rank"] = int(u.shape[1])
out["strategy"] = m.tp_plan.strategy
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
  rc = cli_main(
    [
      "generate",
      "--ckpt",
      ckpt,
      "--tp",
      "4",
      "--max-new-tokens",
      "5",
      "--prompt-ids",
      ",".join(map(str, ps[0])),
      "--prompt-ids",
      ",".join(map(str, ps[1])),
    ]
  )
out["cli_rc"], out["cli_out"] = rc, buf.getvalue()
print("JSON" + json.dumps(out))
