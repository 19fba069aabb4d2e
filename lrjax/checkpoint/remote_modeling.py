"""Low-rank causal LMs for transformers, shipped in every ``lrjax export --format hf-lowrank``.

This file runs inside transformers (``trust_remote_code=True``), not inside lrjax: the export
copies it to ``modeling_lrjax_lowrank.py`` and appends the classes of the model's family, e.g.::

  class LowRankLlamaConfig(LlamaConfig):
    model_type = "lrjax_lowrank_llama"

  class LowRankLlamaForCausalLM(LlamaForCausalLM):
    config_class = LowRankLlamaConfig
    def __init__(self, config):
      super().__init__(config)
      make_low_rank(self, config)

The model is transformers' own class for the family, with each low-rank projection ``<p>_proj``
(p in q, k, v, o, gate, up, down) replaced by two linears, ``<p>_u_proj`` [rank, in] and
``<p>_v_proj`` [out, rank] (with the projection's bias, if any), so y = v_proj(u_proj(x)).
Ranks are per layer, from ``config.lrjax_lowrank["ranks"]``. A per-head factorisation stores
its v_proj block diagonal, which this dense [out, rank] linear reproduces exactly.
"""

import torch
from torch import nn

# projection → the attribute of a decoder layer that holds it
SECTIONS = {
  "q_proj": "self_attn",
  "k_proj": "self_attn",
  "v_proj": "self_attn",
  "o_proj": "self_attn",
  "gate_proj": "mlp",
  "up_proj": "mlp",
  "down_proj": "mlp",
}


class LowRankProjection:
  """``v(u(x))``: stands where the dense projection was. Holds no parameters of its own; they
  are the parent's ``<p>_u_proj`` / ``<p>_v_proj`` linears, named as in the checkpoint."""

  def __init__(self, u: nn.Linear, v: nn.Linear):
    self.u, self.v = u, v

  def __call__(self, x: torch.Tensor) -> torch.Tensor:
    return self.v(self.u(x))

  @property
  def rank(self) -> int:
    return self.u.out_features

  def __repr__(self) -> str:
    return (
      f"LowRankProjection(in={self.u.in_features}, rank={self.rank}, out={self.v.out_features})"
    )


def _ranks(config, num_layers: int) -> list:
  spec = getattr(config, "lrjax_lowrank", None)
  ranks = spec.get("ranks") if isinstance(spec, dict) else None
  if not isinstance(ranks, list) or len(ranks) != num_layers:
    raise ValueError(
      f"config.json 'lrjax_lowrank' must hold 'ranks', a list of {num_layers} per-layer "
      "{projection: rank} objects; re-export the model with lrjax export --format hf-lowrank"
    )
  for i, layer in enumerate(ranks):
    if not isinstance(layer, dict) or not all(
      k in SECTIONS and isinstance(r, int) and not isinstance(r, bool) and r > 0
      for k, r in layer.items()
    ):
      raise ValueError(
        f"config.json lrjax_lowrank.ranks[{i}]={layer!r:.100} must map projection names "
        f"{sorted(SECTIONS)} to positive ints"
      )
  return ranks


def make_low_rank(model: nn.Module, config) -> None:
  """Replace, in place, each projection that ``config.lrjax_lowrank["ranks"]`` names by a
  :class:`LowRankProjection` over two new linears (same device and dtype as the dense one)."""
  layers = model.model.layers
  for layer, layer_ranks in zip(layers, _ranks(config, len(layers))):
    for name, rank in layer_ranks.items():
      parent = getattr(layer, SECTIONS[name])
      dense = getattr(parent, name)
      if rank > min(dense.in_features, dense.out_features):
        raise ValueError(
          f"rank {rank} of {name} exceeds min(in, out)="
          f"{min(dense.in_features, dense.out_features)}; config.json and the model disagree"
        )
      kw = dict(device=dense.weight.device, dtype=dense.weight.dtype)
      u = nn.Linear(dense.in_features, rank, bias=False, **kw)
      v = nn.Linear(rank, dense.out_features, bias=dense.bias is not None, **kw)
      short = name[: -len("_proj")]
      delattr(parent, name)
      parent.add_module(f"{short}_u_proj", u)
      parent.add_module(f"{short}_v_proj", v)
      setattr(parent, name, LowRankProjection(u, v))
