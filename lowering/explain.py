"""``lrjax.lowering.explain``: what the pass rewrites, what it refuses, and which kernel serves.

report = lrjax.lowering.explain(f, *args)
print(report)            # readable
report.to_dict()         # data
"""

from __future__ import annotations

import dataclasses
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from lrjax.lowering import _jaxpr as jx
from lrjax.lowering import registry
from lrjax.lowering import rules as rules_lib
from lrjax.lowering.fuse import analyze, normed_call

REPORT_PLATFORMS = ("cpu", "cuda", "neuron")


def platforms_here() -> frozenset[str]:
  """The platforms jax lowers for in this process (its initialised backends)."""
  import jax.extend.backend

  names = set(jax.extend.backend.backends())
  if "gpu" in names:  # an alias of the CUDA backend in some jaxlib builds
    names.add("cuda")
  return frozenset(names)


def kernels_for(primitive: str, avals_in: Sequence[Any], params: Mapping[str, Any]) -> dict:
  """Per platform: the kernel that would serve these operands, and why others decline.

  A platform jax lowers for here is asked through the registry, as its lowering would be (so
  forced-reference mode shows; its kernels register now if they have not yet). Any other
  platform's kernels are asked directly from the custom_calls catalog, without registering
  them or importing their toolchain; kernels registered for it by hand are asked too.
  """
  from lrjax import custom_calls

  catalog = custom_calls.kernel_catalog()
  here = platforms_here()
  out = {}
  for plat in REPORT_PLATFORMS:
    if plat in here:
      sel = registry.select(primitive, plat, avals_in, params)
      out[plat] = {
        "kernel": sel.name,
        "declined": [list(d) for d in sel.declined],
        "registered": True,
      }
      continue
    registered = registry.candidates(primitive, plat, load=False)
    names = {k.name for k in registered}
    unregistered = [
      k
      for k in catalog.get(plat, ())
      if k.primitive == primitive and k.platform == plat and k.name not in names
    ]
    kernel, declined = registry.choose(
      sorted((*registered, *unregistered), key=lambda k: -k.priority), avals_in, params
    )
    chosen = kernel.name if kernel is not None else "reference"
    out[plat] = {
      "kernel": chosen,
      "declined": [list(d) for d in declined],
      "registered": kernel is not None and kernel.name in names,
    }
  if any(k.primitive == primitive for k in catalog.get("cuda", ())):
    from lrjax.custom_calls.triton import policy  # which card's tuning table decides

    out["cuda"]["policy"] = policy.note()
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
  norms: list[dict] = dataclasses.field(default_factory=list)  # rms_norms folded (lr_normed)
  residuals: list[dict] = dataclasses.field(default_factory=list)  # adds folded (lr_residual)

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
      if "policy" in m["kernels"].get("cuda", {}):
        lines.append(f"        cuda {m['kernels']['cuda']['policy']}")
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
    for n in self.norms:
      lines.append(f"  NORM  rms_norm folded into {n['into']} {n['shapes']}")
      lines.append(f"        at {n['location']}  [{n['path']}]")
      ks = ", ".join(f"{p}: {_kernel_note(v)}" for p, v in n["kernels"].items())
      lines.append(f"        kernels: {ks}")
    for r in self.residuals:
      lines.append(f"  ADD   residual add folded into {r['into']} {r['shapes']}")
      lines.append(f"        at {r['location']}  [{r['path']}]")
      ks = ", ".join(f"{p}: {_kernel_note(v)}" for p, v in r["kernels"].items())
      lines.append(f"        kernels: {ks}")
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
    avals, params = _group_call(g)
    groups.append(
      dict(
        members=[m.location for m in g],
        path=g[0].path,
        shapes=[m.shapes for m in g],
        kernels=kernels_for("lr_xuv_group", avals, params),
      )
    )
  norms = []
  for eqn, m, group in analysis.norms:
    avals, params = _group_call(group) if group else (m.avals_in, m.params)
    into = "lr_xuv_group" if group else m.primitive.name
    normed = dict(eps=eqn.params["eps"], inner=into, inner_params=tuple(sorted(params.items())))
    norms.append(
      dict(
        location=jx.location(eqn),
        path=m.path,
        into=into,
        shapes=f"x{list(eqn.invars[0].aval.shape)} {eqn.invars[0].aval.dtype} eps {normed['eps']}",
        kernels=kernels_for(
          "lr_normed", (eqn.invars[0].aval, eqn.invars[1].aval) + tuple(avals[1:]), normed
        ),
      )
    )
  residuals = []
  for eqn, m, norm in analysis.residuals:
    prim, avals, params = m.primitive, m.avals_in, m.params
    if norm is not None:  # the MLP's norm folded in too: the lr_normed fuse binds, on avals
      prim, avals, params = normed_call(norm, lambda a: a.aval, prim, avals, params)
    inner = prim.name
    r = eqn.outvars[0].aval
    residuals.append(
      dict(
        location=jx.location(eqn),
        path=m.path,
        into=inner if norm is None else f"lr_normed({m.primitive.name})",
        shapes=f"{list(r.shape)} {r.dtype}",
        kernels=kernels_for(
          "lr_residual",
          (r,) + tuple(avals),
          dict(inner=inner, inner_params=tuple(sorted(params.items()))),
        ),
      )
    )
  near = [dataclasses.asdict(n) for n in analysis.near_misses]
  used = {m.rule or m.pattern for m in analysis.matches}
  unmatched = [rules_lib.rule_label(r) for r in rules if rules_lib.rule_label(r) not in used]
  return ExplainReport(matches, near, unmatched, groups, norms, residuals)


def _group_call(g) -> tuple:
  """(avals, params) of the lr_xuv_group that lrjax.fuse binds for the matches ``g``."""
  avals = (g[0].avals_in[0],) + tuple(a for m in g for a in m.avals_in[1:])
  params = dict(
    bias_mask=tuple(m.params["has_bias"] for m in g),
    inter_dtype=g[0].params["inter_dtype"],
    out_dtype=g[0].params["out_dtype"],
  )
  if any(m.params.get("has_scale", False) for m in g):
    params["scale_mask"] = tuple(m.params.get("has_scale", False) for m in g)
  return avals, params
