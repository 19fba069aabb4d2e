"""benchmarks/model_step_peer.py's bookkeeping on CPU: the records built from the two sides'
JSON (ratios, the step with XLA's attention, the profile), and a results file that keeps the
records of other cards (and converts the one-run form it had before)."""

import json
import sys
import types

import pytest


def _side(device, kinds, ms, profile=False):
  recs = {}
  for kind in kinds:
    for b in (1, 8):
      recs[f"{kind}/{b}"] = {"ms": ms[kind] * b}
      if profile and kind != "dense":
        span = ms[kind] * b
        recs[f"{kind}/{b}"]["profile"] = {
          "span_ms": span,
          "busy_ms": 0.9 * span,
          "kernels": {"_mlp_decode_kernel_b4a0": [1.0, 900.0 * span]},
        }
  return {"device": device, "jax": "0", "torch": "0", "argv": ["--side"], "records": recs}


def _torch(device, ms):
  recs = {}
  for kind in ("dense", "lowrank"):
    for b in (1, 8):
      recs[f"{kind}/{b}"] = {"eager": {"ms": ms[kind] * b + 1}, "compile": {"ms": ms[kind] * b}}
  return {"device": device, "jax": "0", "torch": "0", "argv": ["--side"], "records": recs}


def _merge(load_benchmark, tmp_path, device, out, lj, pt):
  mod = load_benchmark("model_step_peer")
  t, l = tmp_path / f"t_{device}.json", tmp_path / f"l_{device}.json"
  t.write_text(json.dumps(pt))
  l.write_text(json.dumps(lj))
  args = ["--model", "tiny", "--batch", "1", "8", "--ctx", "64", "--max-len", "128"]
  assert mod.main(args + ["--steps", "4", "--merge", str(t), str(l), "--out", str(out)]) == 0
  return json.loads(out.read_text())


def test_records_ratios_and_cards_kept(load_benchmark, tmp_path):
  out = tmp_path / "peer.json"
  kinds = ("dense", "lowrank", "lowrank_xla_attention")
  ms = {"dense": 6.0, "lowrank": 4.0, "lowrank_xla_attention": 4.5}
  tms = {"dense": 6.0, "lowrank": 5.0}
  # the one-run form an older script wrote: converted, its card's records kept
  old = {"meta": {"device": "NVIDIA H200"}, "records": [{"device": "NVIDIA H200", "ctx": 64}]}
  out.write_text(json.dumps(old))
  doc = _merge(
    load_benchmark,
    tmp_path,
    "H100",
    out,
    _side("NVIDIA H100 80GB HBM3", kinds, ms, profile=True),
    _torch("NVIDIA H100 80GB HBM3", tms),
  )
  assert set(doc["runs"]) == {"NVIDIA H200", "NVIDIA H100 80GB HBM3"}
  h100 = [r for r in doc["records"] if r["device"].startswith("NVIDIA H100")]
  assert [r["batch"] for r in h100] == [1, 8] and len(doc["records"]) == 3
  r1 = h100[0]
  assert r1["lrjax_ms"] == 4.0 and r1["lrjax_xla_attention_ms"] == 4.5
  assert r1["torch_dense_ms"] == 6.0 and r1["speedup_vs_torch_dense"] == 1.5
  assert r1["speedup_vs_torch_lowrank"] == 5.0 / 4.0
  assert r1["targets"]["vs_torch_dense"]["met"] and r1["targets"]["vs_torch_lowrank"]["met"]
  assert set(r1["profile"]) == {"lowrank", "lowrank_xla_attention"}
  classes = r1["profile"]["lowrank"]["classes"]  # computed from the side's kernel list
  assert classes["GEMM-like"]["ms"] == pytest.approx(0.9 * 4.0)
  assert classes["gaps (GPU idle)"]["frac_of_span"] == pytest.approx(0.1)
  assert r1["lrjax_variants_ms"] == ms  # every variant timed, by name
  assert r1["hbm_bps"] == 3.35e12 and 0 < r1["hbm_roofline_frac"]
  # a second run on the same card and context replaces that card's records only
  doc = _merge(
    load_benchmark,
    tmp_path,
    "H100b",
    out,
    _side("NVIDIA H100 80GB HBM3", kinds[:2], ms),
    _torch("NVIDIA H100 80GB HBM3", tms),
  )
  h100 = [r for r in doc["records"] if r["device"].startswith("NVIDIA H100")]
  assert len(h100) == 2 and len(doc["records"]) == 3
  assert h100[0]["lrjax_xla_attention_ms"] is None and h100[0]["profile"] == {}


def test_variants_and_their_compiler_options(load_benchmark):
  mod = load_benchmark("model_step_peer")
  assert set(mod.COMPILER_OPTIONS) <= set(mod.LRJAX_KINDS)
  assert set(mod.PROFILED) <= set(mod.LRJAX_KINDS)
  # a kind that forces lrjax's merge runs lrjax's attention kernel alone
  assert set(mod.MERGE) <= set(mod.LRJAX_KINDS) and set(mod.MERGE.values()) == {"walk", "tile"}
  assert all(mod.WITHOUT[k] == ("pallas.decode_attention",) for k in mod.MERGE)
  assert mod.COMPILER_OPTIONS["lowrank_cmdbuf_off"] == {"xla_gpu_enable_command_buffer": ""}
  with pytest.raises(SystemExit):  # a variant name it does not know
    mod.main(["--model", "tiny", "--kinds", "lowrank_fast", "--side", "lrjax"])


def test_kernel_classes_of_a_profile(load_benchmark):
  mod = load_benchmark("model_step_peer")
  assert mod.kernel_class("mha_forward") == "attention kernel"
  assert mod.kernel_class("_xuv_decode_group_kernel_9b28") == "GEMM-like"
  assert mod.kernel_class("gemm_fusion_dot_1") == "GEMM-like"
  assert mod.kernel_class("memcpy32_post") == "memsets/copies"
  assert mod.kernel_class("input_reduce_fusion_81") == mod.OTHER
  # lrjax's decode attention is two launches; both are the attention's
  assert mod.kernel_class("_decode_attention_kernel_31e8") == "attention kernel"
  assert mod.kernel_class("_merge_kernel_0a1b") == "attention kernel"
  assert mod.kernel_class("_merge_tile_kernel_cc6b") == "attention kernel"


def test_a_stored_profile_is_reclassified_from_its_kernel_list(load_benchmark):
  mod = load_benchmark("model_step_peer")
  stored = {
    "span_ms": 1.0,
    "busy_ms": 0.9,
    "kernels": {  # [launches a step, µs a step]
      "_mlp_decode_kernel_b4a0": [2.0, 500.0],
      "_decode_attention_kernel_31e8": [1.0, 100.0],
      "_merge_tile_kernel_cc6b": [1.0, 50.0],
      "input_reduce_fusion_48": [3.0, 250.0],
    },
    "classes": {"stale": {"ms": 9.0}},
  }
  got = mod.classify(stored)
  assert got["kernels"] == stored["kernels"]
  assert set(got["classes"]) == {"GEMM-like", "attention kernel", mod.OTHER, "gaps (GPU idle)"}
  assert got["classes"]["attention kernel"]["ms"] == pytest.approx(0.15)
  assert got["classes"]["attention kernel"]["launches"] == 2.0
  assert got["classes"][mod.OTHER]["frac_of_span"] == pytest.approx(0.25)
  assert got["classes"]["gaps (GPU idle)"]["ms"] == pytest.approx(0.1)
  assert got["launches_per_step"] == 7.0
  busy = sum(c["ms"] for n, c in got["classes"].items() if n != "gaps (GPU idle)")
  assert busy == pytest.approx(stored["busy_ms"])


def test_sides_of_several_calls_merge(load_benchmark, tmp_path):
  """--merge with JSONs of several calls (here the lrjax side one per batch), in any order:
  each side's records merged; JSONs of two cards, or of one side only, are refused."""
  mod = load_benchmark("model_step_peer")
  ms = {"dense": 6.0, "lowrank": 4.0}
  lj = _side("NVIDIA H200", ("dense", "lowrank"), ms)
  files = []
  for b in (1, 8):
    part = dict(lj, records={k: v for k, v in lj["records"].items() if k.endswith(f"/{b}")})
    files.append(tmp_path / f"l{b}.json")
    files[-1].write_text(json.dumps(part))
  t = tmp_path / "t.json"
  t.write_text(json.dumps(_torch("NVIDIA H200", {"dense": 6.0, "lowrank": 5.0})))
  out = tmp_path / "peer.json"
  args = ["--model", "tiny", "--batch", "1", "8", "--ctx", "64", "--max-len", "128", "--steps", "4"]
  assert mod.main(args + ["--merge", str(files[0]), str(t), str(files[1]), "--out", str(out)]) == 0
  recs = json.loads(out.read_text())["records"]
  assert [(r["batch"], r["lrjax_ms"]) for r in recs] == [(1, 4.0), (8, 32.0)]
  assert [r["torch_dense_ms"] for r in recs] == [6.0, 48.0]
  other = tmp_path / "l_h100.json"
  other.write_text(json.dumps(dict(json.loads(files[1].read_text()), device="NVIDIA H100")))
  for bad in ([t, files[0], other], [files[0], files[1]]):
    with pytest.raises(SystemExit):
      mod.main(args + ["--merge", *map(str, bad), "--out", str(out)])


def test_lrjax_kind_stands_for_the_step(load_benchmark, tmp_path):
  """--lrjax-kind picks the kind whose time is lrjax_ms (and the ratios, the roofline);
  the record names it. A kind the lrjax side did not time leaves the batch out."""
  mod = load_benchmark("model_step_peer")
  kinds = ("lowrank", "lowrank_append_norm_residual")
  ms = {"lowrank": 4.0, "lowrank_append_norm_residual": 3.2}
  t, l = tmp_path / "t.json", tmp_path / "l.json"
  t.write_text(json.dumps(_torch("NVIDIA H200", {"dense": 6.4, "lowrank": 4.8})))
  l.write_text(json.dumps(_side("NVIDIA H200", kinds, ms)))
  args = ["--model", "tiny", "--batch", "1", "8", "--ctx", "64", "--max-len", "128", "--steps", "4"]
  out = tmp_path / "peer.json"
  kind = ["--lrjax-kind", "lowrank_append_norm_residual"]
  assert mod.main(args + kind + ["--merge", str(t), str(l), "--out", str(out)]) == 0
  r1 = json.loads(out.read_text())["records"][0]
  assert r1["lrjax_kind"] == "lowrank_append_norm_residual" and r1["lrjax_ms"] == 3.2
  assert r1["speedup_vs_torch_dense"] == pytest.approx(2.0)
  assert r1["speedup_vs_torch_lowrank"] == pytest.approx(1.5)
  assert r1["lrjax_variants_ms"] == ms
  out2 = tmp_path / "peer2.json"
  kind = ["--lrjax-kind", "lowrank_xla_norms"]  # not timed on the lrjax side
  assert mod.main(args + kind + ["--merge", str(t), str(l), "--out", str(out2)]) == 0
  assert json.loads(out2.read_text())["records"] == []


def test_a_kinds_gated_kernels_are_exactly_its_own(load_benchmark):
  """Within a kind of CHOSEN the table's three switches are on for its kernels and off for
  the others, their GPU flags set; after it, the table and the flags are as they were."""
  from lrjax.custom_calls.triton import lowering as cuda
  from lrjax.custom_calls.triton import policy

  mod = load_benchmark("model_step_peer")
  names = ("attention_append", "norm_in_kernels", "residual_epilogue")

  def switches():
    d = policy.current().values("dispatch")
    return tuple(getattr(d, n) for n in names)

  before = switches(), cuda.NORM_GPU_VERIFIED
  for kind, want in (
    ("lowrank_xla_norms", (False, False, False)),
    ("lowrank_norm_residual", (False, True, True)),
    ("lowrank_append_attention", (True, False, False)),
  ):
    with mod._attention_lowerings(kind):
      assert switches() == want, kind
      assert cuda.NORM_GPU_VERIFIED or not want[1]
  assert (switches(), cuda.NORM_GPU_VERIFIED) == before
  with mod._attention_lowerings("lowrank"):  # not in CHOSEN: the table's own choice
    assert switches() == before[0]


def test_the_append_kinds_choose_how_the_new_key_is_attended(load_benchmark, monkeypatch):
  """lowrank_append_apart / _splice run the append kernel with NEW_KEY_APART True / False,
  every other kind with the kernel's default; after each, the default is back. (The kernel
  module stands in: it imports jax-triton.)"""
  default = object()
  dap = types.ModuleType("decode_attention_append")
  dap.NEW_KEY_APART = default
  monkeypatch.setitem(sys.modules, "lrjax.custom_calls.triton.decode_attention_append", dap)
  mod = load_benchmark("model_step_peer")
  for kind, want in (
    ("lowrank_append_apart", True),
    ("lowrank_append_splice", False),
    ("lowrank_append_norm_residual", default),
  ):
    with mod._attention_lowerings(kind):
      assert dap.NEW_KEY_APART is want, kind
    assert dap.NEW_KEY_APART is default


def test_a_kind_goes_without_its_attention_lowerings_and_gets_them_back(load_benchmark):
  """lowrank_pallas_attention runs without lrjax's attention lowering; after it the
  decode_attention candidates are the same ones, in the same order."""
  from lrjax.lowering import registry

  mod = load_benchmark("model_step_peer")
  registry.load_platform("cuda")
  names = lambda: [k.name for k in registry.candidates("decode_attention", "cuda")]  # noqa: E731
  before = names()
  assert "triton.decode_attention" in before
  with mod._attention_lowerings("lowrank_pallas_attention"):
    assert "triton.decode_attention" not in names()
    assert "pallas.decode_attention" in names()
  assert names() == before


def test_partial_keeps_lrjax_side_of_a_batch_torch_missed(load_benchmark, tmp_path):
  """A torch side that ran out of time before a batch's compiled low-rank step: without
  --partial that batch is left out; with it the record keeps lrjax's side, its torch fields
  and ratios null, and the other batches are whole."""
  mod = load_benchmark("model_step_peer")
  pt = _torch("NVIDIA H100", {"dense": 6.0, "lowrank": 5.0})
  del pt["records"]["lowrank/8"]
  t, l = tmp_path / "t.json", tmp_path / "l.json"
  t.write_text(json.dumps(pt))
  l.write_text(json.dumps(_side("NVIDIA H100", ("lowrank",), {"lowrank": 4.0})))
  args = ["--model", "tiny", "--batch", "1", "8", "--ctx", "64", "--max-len", "128", "--steps", "4"]
  merge = ["--merge", str(t), str(l)]
  out = tmp_path / "peer.json"
  assert mod.main(args + merge + ["--out", str(out)]) == 0
  assert [r["batch"] for r in json.loads(out.read_text())["records"]] == [1]
  assert mod.main(args + merge + ["--partial", "--out", str(out)]) == 0
  r1, r8 = json.loads(out.read_text())["records"]
  assert r1["speedup_vs_torch_lowrank"] == 5.0 / 4.0
  assert r8["lrjax_ms"] == 32.0 and r8["torch_dense_ms"] == 48.0
  assert r8["torch_lowrank_ms"] is None and r8["speedup_vs_torch_lowrank"] is None
  assert r8["speedup_vs_torch_dense"] == 1.5


def test_a_kinds_environment_is_set_for_its_run_alone(load_benchmark, monkeypatch):
  """The *_pdl_overlap and launch kinds lower their kernels with LRJAX_TRITON_PDL_OVERLAP /
  LRJAX_TRITON_LAUNCH set; after the kind, the environment is as it was."""
  import os

  mod = load_benchmark("model_step_peer")
  assert set(mod.ENV) <= set(mod.LRJAX_KINDS)
  monkeypatch.setenv("LRJAX_TRITON_LAUNCH", "xla")
  monkeypatch.delenv("LRJAX_TRITON_PDL_OVERLAP", raising=False)
  with mod._attention_lowerings("lowrank_launch_pdl_overlap"):
    assert os.environ["LRJAX_TRITON_LAUNCH"] == "pdl"
    assert os.environ["LRJAX_TRITON_PDL_OVERLAP"] == "1"
  assert os.environ["LRJAX_TRITON_LAUNCH"] == "xla"
  assert "LRJAX_TRITON_PDL_OVERLAP" not in os.environ
  with mod._attention_lowerings("lowrank_pdl_overlap"):
    assert os.environ["LRJAX_TRITON_LAUNCH"] == "xla"
    assert os.environ["LRJAX_TRITON_PDL_OVERLAP"] == "1"
  with mod._attention_lowerings("lowrank"):
    assert "LRJAX_TRITON_PDL_OVERLAP" not in os.environ


def test_targets_met_or_short_by_how_much(load_benchmark, tmp_path):
  mod = load_benchmark("model_step_peer")
  base = {"device": "NVIDIA H100 80GB HBM3", "lowrank_step_bytes": 3.35e9, "hbm_bps": 3.35e12}
  one = dict(base, batch=1, lrjax_ms=2.0, speedup_vs_torch_dense=1.2,
             speedup_vs_torch_lowrank=1.25, hbm_roofline_frac=0.5)  # fmt: skip
  tg = mod.targets(one)
  assert tg["vs_torch_dense"] == {"target": 1.5, "measured": 1.2, "met": False,
                                  "short_by": pytest.approx(0.2)}  # fmt: skip
  assert tg["vs_torch_lowrank"]["met"] and tg["vs_torch_lowrank"]["short_by"] == 0.0
  assert tg["hbm_roofline"]["short_by"] == pytest.approx(1 - 0.5 / 0.8)
  assert tg["floor_ms"] == pytest.approx(1.0) and tg["above_floor_ms"] == pytest.approx(1.0)
  # batch 8: 1.3x the dense step is the target, no roofline target; a missing torch side: none
  eight = dict(one, batch=8, speedup_vs_torch_dense=1.3, speedup_vs_torch_lowrank=None)
  tg = mod.targets(eight)
  assert tg["vs_torch_dense"]["met"] and "hbm_roofline" not in tg
  assert "vs_torch_lowrank" not in tg
  # --annotate rewrites every record's block from its fields
  path = tmp_path / "peer.json"
  path.write_text(json.dumps({"runs": {}, "records": [one, dict(eight, targets={"stale": 1})]}))
  assert mod.main(["--annotate", str(path)]) == 0
  recs = json.loads(path.read_text())["records"]
  assert recs[0]["targets"]["vs_torch_dense"]["met"] is False
  assert "stale" not in recs[1]["targets"] and recs[1]["targets"]["vs_torch_dense"]["met"]
