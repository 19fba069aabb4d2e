"""The low-rank model's plain-jnp forward is rewritten by lrjax.fuse into lr_xuv / lr_mlp."""

import collections

import jax
import jax.numpy as jnp
import pytest
from conftest import assert_close, fresh_key, primitive_names
from flax import nnx

from lrjax.lowering import fuse
from lrjax.models import PROJ_NAMES, LlamaForCausalLM, ModelConfig


@pytest.mark.parametrize("scan", [True, False])
def test_fuse_rewrites_every_projection(scan):
  cfg = ModelConfig.tiny()
  m = LlamaForCausalLM(
    cfg,
    [{p: 8 for p in PROJ_NAMES}] * cfg.num_layers,
    rngs=nnx.Rngs(int(jax.random.randint(fresh_key(), (), 0, 2**30))),
  )
  m.scan_layers = scan
  tok = jax.random.randint(fresh_key(), (2, 5), 0, cfg.vocab_size)
  graphdef, state = nnx.split(m)

  def fwd(state, tok):
    return nnx.merge(graphdef, state)(tok)

  counts = collections.Counter(primitive_names(fuse(fwd), state, tok))
  per_trace = 1 if scan else cfg.num_layers  # scan traces the layer body once
  assert counts.get("lr_mlp", 0) == per_trace
  assert counts.get("lr_xuv_group", 0) == per_trace  # q, k, v share the normed input
  assert counts.get("lr_xuv", 0) == per_trace  # o
  # both norms of a layer fold into the ops that read them; the final norm stays
  assert counts.get("lr_normed", 0) == 2 * per_trace and counts.get("rms_norm", 0) == 1
  # and both residual adds into o_proj and the MLP (h + o(a), h + mlp(norm(h)))
  assert counts.get("lr_residual", 0) == 2 * per_trace
  ungrouped = collections.Counter(primitive_names(fuse(fwd, group=False), state, tok))
  assert ungrouped.get("lr_xuv", 0) == 4 * per_trace and "lr_xuv_group" not in ungrouped
  assert_close(jax.jit(fuse(fwd))(state, tok), jax.jit(fwd)(state, tok), jnp.float32)
