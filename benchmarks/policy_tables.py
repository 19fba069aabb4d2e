"""Writes a card's tuning table (custom_calls/triton/tuning/policy_<card>.json) from results.

The measured parts come from the committed benchmark results of that card:

- ``records``: the default-kernel record of each shape of a ``gpu_lowrank.py`` sweep (the
  ``auto`` variant) and of its ``--suite decode_group`` run (``gpu_xuv_group_<card>.json``
  beside it), as (op, M, K, r, N, kernel µs, XLA µs);
- ``model_ab`` / ``model_op_ab``: one-GPU decode steps of ``tp_gpu.py`` with and without the
  kernels, or without one op's (``model_*1gpu_<card>.json`` beside it).

The ``thresholds`` and ``tiles`` are kept from the card's existing table; a card without one
starts from the nearest table's, which its own measurements should then replace.

  python benchmarks/gpu_lowrank.py --emit-policy benchmarks/results/gpu_lowrank_h200.json

``--choice-report`` tells how well the table a card uses chooses on that card's own records.
"""

from __future__ import annotations

import json
import os
import re

from lrjax.custom_calls.triton import policy

# tp_gpu.py's model-step results a table reads, beside the sweep's file ({card}: its suffix)
MODEL_FILES = ("model_1gpu_{card}.json", "model_70b_1gpu_{card}.json",
               "model_qwen7b_1gpu_{card}.json", "model_1b_1gpu_{card}.json")  # fmt: skip
GROUP_FILE = "gpu_xuv_group_{card}.json"
# the Triton launchers whose model steps are an A/B of the kernels: the default (xla_triton on
# jaxlib 0.11.x), XLA's PTX call and jaxlib's (a record without ``triton_launch`` ran under
# jaxlib's); steps under lrjax's own launcher are an A/B of the launch
MODEL_AB_LAUNCHES = ("jaxlib", "xla", "xla_triton")
OPS = policy.OPS


def card_of(results_path: str) -> str:
  """The card suffix of a results file: "h200" of ``gpu_lowrank_h200.json``."""
  m = re.search(r"_([a-z0-9]+)\.json$", os.path.basename(results_path))
  if m is None:
    raise ValueError(f"{results_path}: expected a results file named like gpu_lowrank_h200.json")
  return m.group(1)


def records_from_results(path: str) -> tuple[str, tuple]:
  """(measured_on, records) from a gpu_lowrank.py results file: the default-kernel ("auto")
  record of each shape; of repeated shapes, the last in the file."""
  with open(path) as fh:
    data = json.load(fh)
  rows = {}
  for r in data["records"]:
    if r["variant"] != "auto" or not r.get("canonical", True):
      continue
    key = (r["op"], r["M"], r["K"], r["r"], r["N"])
    rows[key] = key + (round(r["ours_us"], 1), round(r["xla_lowrank_us"], 1))
  meta = data["meta"]
  return f"{meta['machine'].split(' (')[0]}, {meta['date'][:10]}", tuple(sorted(rows.values()))


def group_records_from_results(path: str) -> tuple:
  """Records of the grouped kernel (its ``group`` records) from a --suite decode_group results
  file; an absent file gives none."""
  if not os.path.exists(path):
    return ()
  with open(path) as fh:
    recs = json.load(fh)["records"]
  return tuple(
    sorted(
      {
        (
          r["op"],
          r["M"],
          r["K"],
          r["r"],
          r["N"],
          round(r["ours_us"], 1),
          round(r["xla_lowrank_us"], 1),
        )  # fmt: skip
        for r in recs
        if r["variant"] == "group"
      }
    )
  )


def policy_records(path: str) -> tuple[str, tuple]:
  """(measured_on, records): the sweep's records and the grouped kernel's (GROUP_FILE beside
  ``path``)."""
  on, recs = records_from_results(path)
  group = os.path.join(os.path.dirname(path), GROUP_FILE.format(card=card_of(path)))
  return on, tuple(sorted(recs + group_records_from_results(group)))


def _default_steps(data: dict) -> list[dict]:
  """The one-GPU low-rank steps of a tp_gpu.py results file under the default lowering:
  q/k/v grouped (not ``--no-group``), no ``--whole-policy`` run (timed with the step rule on),
  the scratch chain on and a launcher of MODEL_AB_LAUNCHES."""
  return [
    r
    for r in data["records"]
    if "step_ms" in r
    and r["strategy"] == "lowrank_tp"
    and r["tp"] == 1
    and r.get("group") is not False
    and not r.get("whole_policy")
    and r.get("scratch_chain") is not False
    and r.get("triton_launch", "jaxlib") in MODEL_AB_LAUNCHES
  ]


def model_ab_from_results(path: str) -> tuple:
  """model_ab rows from a tp_gpu.py results file: (model, hidden size, batch, step ms with the
  kernels, without) of each batch measured both ways; ``--kernels`` runs (only some kernels
  served) are left out; of repeated runs, the last."""
  with open(path) as fh:
    data = json.load(fh)
  recs = [r for r in _default_steps(data) if not r.get("kernels")]
  # fused runs with lrjax.fuse's default grouping replace those from before it existed
  recs.sort(key=lambda r: r.get("group", False))
  steps = {(r["model"], r["batch"], bool(r.get("fuse"))): r["step_ms"] for r in recs}
  return tuple(
    (
      name,
      data["models"][name]["hidden_size"],
      b,
      round(steps[name, b, True], 3),
      round(steps[name, b, False], 3),
    )
    for name, b in sorted({k[:2] for k in steps})
    if (name, b, True) in steps and (name, b, False) in steps
  )


def op_ab_pair(kernels_rec: dict, step_rec: dict) -> bool:
  """Whether a tp_gpu.py step with every kernel, ``step_rec``, is the pair of a ``--kernels``
  step, ``kernels_rec``: the next run (one device call), same model and batch."""
  return (
    bool(kernels_rec.get("kernels"))
    and bool(step_rec.get("fuse"))
    and not step_rec.get("kernels")
    and step_rec.get("run") == kernels_rec.get("run", -2) + 1
    and (step_rec.get("model"), step_rec.get("batch"))
    == (kernels_rec.get("model"), kernels_rec.get("batch"))
  )


def model_op_ab_from_results(path: str) -> tuple:
  """model_op_ab rows from a tp_gpu.py results file: (model, hidden size, batch, op, step ms
  with every kernel, ms with every kernel but op's) of each ``--kernels`` run that serves all
  ops but one and is followed, as the next run, by the step with every kernel at that batch
  (one device call: steps move by up to 2 % between calls); of repeated pairs, the last."""
  with open(path) as fh:
    data = json.load(fh)
  recs = [r for r in _default_steps(data) if r.get("fuse")]
  rows = {}
  for r in recs:
    missing = set(OPS) - set(r.get("kernels") or OPS)
    after = next((a["step_ms"] for a in recs if op_ab_pair(r, a)), None)
    if len(missing) == 1 and after is not None:
      rows[r["model"], r["batch"], missing.pop()] = (round(after, 3), round(r["step_ms"], 3))
  return tuple(
    (name, data["models"][name]["hidden_size"], b, op) + rows[name, b, op]
    for name, b, op in sorted(rows)
  )


def _rows(rows) -> str:
  return "[\n" + ",\n".join(f"    {json.dumps(list(r))}" for r in rows) + "\n  ]"


def render(table: dict) -> str:
  """A table's JSON text: fixed key order, one record a line."""
  parts = [f"  {json.dumps(k)}: {json.dumps(table[k])}" for k in ("device", "device_kinds",
           "measured_on")]  # fmt: skip
  for k in ("sources", "thresholds", "tiles"):
    body = json.dumps(table[k], indent=2).replace("\n", "\n  ")
    parts.append(f"  {json.dumps(k)}: {body}")
  parts += [f"  {json.dumps(k)}: {_rows(table[k])}" for k in ("records", "model_ab", "model_op_ab")]
  return "{\n" + ",\n".join(parts) + "\n}\n"


def build(results_path: str, device: str | None = None, base: dict | None = None) -> dict:
  """The table of the card whose sweep is ``results_path``: its measured parts from the results
  files, its thresholds and tiles from ``base`` (a table's JSON data)."""
  results_path = os.path.abspath(results_path)
  card = card_of(results_path)
  here = os.path.dirname(results_path)
  on, recs = policy_records(results_path)
  models = [os.path.join(here, f.format(card=card)) for f in MODEL_FILES]
  models = [m for m in models if os.path.exists(m)]
  rel = lambda p: os.path.relpath(p, _repo())  # noqa: E731
  base = base or {}
  return dict(
    device=device or on.split(", ")[0],
    device_kinds=base.get("device_kinds", []),
    measured_on=on,
    sources=dict(
      kernels=rel(results_path),
      group=rel(os.path.join(here, GROUP_FILE.format(card=card))),
      model_steps=[rel(m) for m in models],
    ),
    thresholds=base.get("thresholds", {}),
    tiles=base.get("tiles", {}),
    records=[list(r) for r in recs],
    model_ab=[list(a) for m in models for a in model_ab_from_results(m)],
    model_op_ab=[list(a) for m in models for a in model_op_ab_from_results(m)],
  )


def _repo() -> str:
  return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def table_path(card: str) -> str:
  return os.path.join(policy.TUNING_DIR, f"policy_{card}.json")


def _check_coverage(results_path: str, records: list, base: dict) -> None:
  """Refuses a sweep that lacks a kind of call (op and row count) the table it replaces or
  starts from has measured: the new table would serve those calls from the records of other
  row counts (decode records for prefill, say)."""
  have = {(r[0], r[1]) for r in records}
  missing = sorted({(r[0], r[1]) for r in base.get("records", [])} - have)
  if missing:
    shown = ", ".join(f"{op} M={m}" for op, m in missing[:6])
    more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
    raise ValueError(
      f"{results_path}: no record of {shown}{more}, which the {base.get('device')} table has; "
      f"complete the sweep first: python benchmarks/gpu_lowrank.py --suite all --resume "
      f"--out {results_path} (and --suite decode_group into "
      f"{GROUP_FILE.format(card=card_of(results_path))})"
    )


def choice_report(results_path: str, within: float = 0.03) -> str:
  """How well the tuning table the sweep's card uses (its own, else the nearest) chooses on
  that card's records: at each default-kernel record, the lowering the table's verdict picks
  against the faster of the two timed there (kernel forced, XLA's chain; one run). Lists the
  points where the pick was more than ``within`` slower, with the table's reason."""
  with open(results_path) as fh:
    data = json.load(fh)
  card = data["meta"]["machine"].split(" (")[0]
  table, stand_in = policy.for_device(card)
  worse, n = [], 0
  for r in data["records"]:
    if r["variant"] != "auto" or r["op"] not in ("xuv", "mlp_swiglu"):
      continue
    n += 1
    why = policy.verdict(r["op"], r["M"], r["K"], r["r"], r["N"], table)
    chosen = r["xla_lowrank_us"] if why else r["ours_us"]
    loss = chosen / min(r["ours_us"], r["xla_lowrank_us"]) - 1
    if loss > within:
      worse.append((loss, r, why))
  lines = [
    f"{results_path} ({card}; table {os.path.basename(table.path)}"
    f"{', the nearest' if stand_in else ''}): the table's pick is within {within:.0%} of the "
    f"faster lowering at {n - len(worse)} of {n} points"
  ]
  reasons = []  # one line each, the points cite them by number
  for loss, r, why in sorted(worse, key=lambda x: -x[0]):
    if why:
      why = why.removesuffix("; " + policy._OVERRIDE_HINT)
      reasons += [why] if why not in reasons else []
    lines.append(
      f"  {r['op']} M={r['M']} K={r['K']} r={r['r']} N={r['N']}: "
      f"{f'XLA picked [{reasons.index(why) + 1}]' if why else 'the kernel picked'}, kernel "
      f"{r['ours_us']:.1f} us, XLA {r['xla_lowrank_us']:.1f} us ({loss:.1%} slower)"
    )
  lines += [f"  [{i}] {why}" for i, why in enumerate(reasons, 1)]
  return "\n".join(lines)


def emit(results_path: str) -> str:
  """Writes (or rewrites) the table of ``results_path``'s card; returns its path."""
  card = card_of(results_path)
  out = table_path(card)
  if os.path.exists(out):
    with open(out) as fh:
      base = json.load(fh)
  else:  # a new card starts from the nearest table's thresholds and tiles
    on, _ = records_from_results(results_path)
    near, _ = policy.for_device(on.split(", ")[0])
    with open(near.path) as fh:
      base = json.load(fh)
    base["device_kinds"] = []
    print(f"{out}: thresholds and tiles copied from {near.path}; measure them on this card")
  table = build(results_path, base=base)
  _check_coverage(results_path, table["records"], base)
  text = render(table)
  policy.load_text(text, out)  # refuses a malformed table before it is written
  with open(out, "w") as fh:
    fh.write(text)
  return out
