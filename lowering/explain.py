"""``lrjax.lowering.explain``: what the pass rewrites, what it refuses, and which kernel serves.

report = lrjax.lowering.explain(f, *args)
print(report)            # readable
report.to_dict()         # data
"""

from __future__ import annotations

import dataclasses
from typing import Any
from collections.abc import Callable, Sequence

from lrjax.lowering import registry
from lrjax.lowering import rules as rules_lib
from lrjax.lowering.fuse import analyze

REPORT_PLATFORMS = ("cpu", "cuda", "neuron")


def kernels_for(primitive: str, avals_in, params) -> dict:
  """Per platform: the kernel that would serve these operands, and why others decline.

  Registered kernels are asked through the registry (so forced-reference mode
  shows). Kernels of a platform not present here (e.g. Neuron) are asked
  directly from the custom_calls catalog.
  """
  from lrjax import custom_calls

  catalog = [k for ks in custom_calls.kernel_catalog().values() for k in ks]
  out = {}
  for plat in REPORT_PLATFORMS:
    if registry.candidates(primitive, plat):
      sel = registry.select(primitive, plat, avals_in, params)
      out[plat] = {
        "kernel": sel.name,
        "declined": [list(d) for d in sel.declined],
        "registered": True,
      }
      continue
    kernel, declined = registry.choose(
      sorted(
        (k for k in catalog if k.primitive == primitive and k.platform == plat),
        key=lambda k: -k.priority,
      ),
      avals_in,
      params,
    )
    chosen = kernel.name if kernel is not None else "reference"
    out[plat] = {"kernel": chosen, "declined": [list(d) for d in declined], "registered": False}
  if primitive in ("lr_xuv", "lr_mlp") and out["neuron"]["kernel"] != "reference":
    from lrjax.custom_calls.nki.lowering import would_serve

    out["neuron"]["plan"] = would_serve(primitive, avals_in, params)[1]
  return out


def _where(d: dict) -> str:
  """The jaxpr nesting path, and the named scope when there is one."""
  return d["path"] + (f" {d['scope']}" if d.get("scope") else "")


def _kernel_note(v: dict) -> str:
  if v["declined"] and v["kernel"] == "reference":
    name, reason = v["declined"][0]
    return f"reference ({name} declined: {reason})"
  if v["kernel"] == "reference":
    return "reference (no kernel for this primitive)"
  return v["kernel"] + ("" if v["registered"] else " (not registered here)")


@dataclasses.dataclass
class ExplainReport:
  matches: list[dict]
  near_misses: list[dict]
  unmatched_rules: list[str]
  groups: list[dict] = dataclasses.field(default_factory=list)  # lr_xuv_group bindings

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def __str__(self) -> str:
    lines = [f"lrjax.fuse: {len(self.matches)} match(es), {len(self.near_misses)} near-miss(es)"]
    for m in self.matches:
      lines.append(f"  MATCH {m['pattern']:<20} {m['shapes']}")
      lines.append(f"        at {m['location']}  [{_where(m)}]")
      ks = ", ".join(f"{p}: {_kernel_note(v)}" for p, v in m["kernels"].items())
      lines.append(f"        kernels: {ks}")
      if "plan" in m["kernels"].get("neuron", {}):
        lines.append(f"        neuron plan: {m['kernels']['neuron']['plan']}")
    for g in self.groups:
      lines.append(
        f"  GROUP lr_xuv_group ({len(g['members'])} of the lr_xuv above, one input) "
        f"{' | '.join(g['shapes'])}"
      )
      lines.append(f"        at {g['members'][0]}  [{g['path']}]")
      ks = ", ".join(f"{p}: {_kernel_note(v)}" for p, v in g["kernels"].items())
      lines.append(
        f"        kernels: {ks} (as its members under SPMD and on platforms "
        "without a grouped kernel; a declined grouped kernel leaves XLA's reference)"
      )
    for n in self.near_misses:
      lines.append(f"  MISS  {n['pattern']:<20} {n['reason']}")
      lines.append(f"        at {n['location']}  [{_where(n)}]")
    if self.unmatched_rules:
      lines.append(f"  rules that matched nothing: {', '.join(self.unmatched_rules)}")
    return "\n".join(lines)


def explain(
  fn: Callable,
  *args,
  rules: Sequence[Any] | None = None,
  group: bool = True,
  weights: Any = None,
  **kwargs,
) -> ExplainReport:
  """Traces ``fn(*args, **kwargs)`` and reports every match, group (as ``lrjax.fuse`` with
  this ``group`` and ``weights`` binds them), near-miss and idle rule. Every dot → … → dot
  chain through a rank-sized intermediate that is not fused is a near-miss with its reason."""
  rules = tuple(rules if rules is not None else rules_lib.DEFAULT_RULES)
  from lrjax.lowering.fuse import _module_call

  target = _module_call(fn)
  module = target is not fn
  a = ((fn,) + args) if module else args
  _, _, _, _, analysis = analyze(target, a, kwargs, rules, group, weights, module)
  matches = [
    dict(
      pattern=m.pattern,
      location=m.location,
      path=m.path,
      scope=m.scope,
      shapes=m.shapes,
      params={k: str(v) for k, v in m.params.items()},
      kernels=kernels_for(m.primitive.name, m.avals_in, m.params),
    )
    for m in analysis.matches
  ]
  groups = []
  for g in analysis.groups:
    avals = (g[0].avals_in[0],) + tuple(a for m in g for a in m.avals_in[1:])
    params = dict(
      bias_mask=tuple(m.params["has_bias"] for m in g),
      inter_dtype=g[0].params["inter_dtype"],
      out_dtype=g[0].params["out_dtype"],
    )
    if any(m.params.get("has_scale", False) for m in g):
      params["scale_mask"] = tuple(m.params.get("has_scale", False) for m in g)
    groups.append(
      dict(
        members=[m.location for m in g],
        path=g[0].path,
        shapes=[m.shapes for m in g],
        kernels=kernels_for("lr_xuv_group", avals, params),
      )
    )
  near = [dataclasses.asdict(n) for n in analysis.near_misses]
  used = {m.rule or m.pattern for m in analysis.matches}
  unmatched = [rules_lib.rule_label(r) for r in rules if rules_lib.rule_label(r) not in used]
  return ExplainReport(matches, near, unmatched, groups)
