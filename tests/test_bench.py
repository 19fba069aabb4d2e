"""``lrjax bench`` on a tiny checkpoint: the JSON, the table, quantize-at-load and bad flags."""

import json
import os

import numpy as np
import pytest
from flax import nnx

from lrjax import bench as B
from lrjax import checkpoint
from lrjax.cli import main
from lrjax.custom_calls.cpu import lowering as cpu_lowering
from lrjax.models import LlamaForCausalLM, ModelConfig

RANKS = {p: 16 for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  cfg = ModelConfig.tiny()
  seed = int(np.random.default_rng().integers(1 << 30))
  model = LlamaForCausalLM(cfg, [RANKS] * cfg.num_layers, rngs=nnx.Rngs(seed))
  path = tmp_path_factory.mktemp("bench") / "ck"
  checkpoint.save(model, str(path))
  return path


ARGS = ["--concurrency", "1,2", "--prompt-len", "8", "--gen-len", "5", "--reps", "2"]


def test_bench_writes_json_and_table(ckpt, tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)  # relative --ckpt and --out
  rel = os.path.relpath(ckpt, tmp_path)
  assert main(["bench", "--ckpt", rel, *ARGS, "--out", "r.json"]) == 0
  out, err = capsys.readouterr()
  assert "decode tok/s" in out and "wrote" in out
  # progress on stderr: each level's warm-up and its rounds
  for step in ("c=1: compile and warm up", "c=1: round 2 of 2", "c=2: round 1 of 2"):
    assert f"bench {step}" in err, err
  res = json.loads((tmp_path / "r.json").read_text())
  assert [lv["concurrency"] for lv in res["levels"]] == [1, 2]
  for lv in res["levels"]:
    c = lv["concurrency"]
    assert len(lv["rounds"]) == 2 and lv["slots"] == c
    assert lv["decode_tps"] > 0 and lv["prefill_tps"] > 0
    assert lv["ttft_ms_median"] > 0 and lv["itl_ms_median"] > 0
    assert lv["ttft_ms_max"] >= lv["ttft_ms_median"]
    assert lv["itl_ms_p90"] >= lv["itl_ms_median"]
    for r in lv["rounds"]:  # c tokens per decode step
      assert r["decode_tps"] == pytest.approx(c * r["decode_steps_per_s"], rel=1e-9)
  assert res["model"]["source"]["ckpt"] == str(ckpt)
  assert res["model"]["decode_weight_bytes"] == res["model"]["param_bytes"] - 256 * 64 * 4
  assert res["settings"]["prompt_len"] == 8 and res["versions"]["jax"]
  assert res["command"].startswith("lrjax") and res["machine"]["cpu_count"] >= 1
  roof = res["memory_roofline"]  # this CPU's read rate, measured by the run
  assert roof["bytes_per_s"] > 1e8 and roof["source"].startswith("measured: np.max over 1024 MiB")
  for lv in res["levels"]:
    want = lv["decode_weight_gbs"] * 1e9 / roof["bytes_per_s"]
    assert lv["weight_roofline_frac"] == pytest.approx(want, rel=1e-9) and want > 0
  header = next(line for line in out.splitlines() if line.lstrip().startswith("conc"))
  assert header.split()[-1] == "roofline"
  assert f"roofline: {roof['bytes_per_s'] / 1e9:.1f} GB/s (measured" in out
  png = tmp_path / "r.png"
  assert (res["plot"] == str(png)) == png.exists()
  if res["plot"] is None:
    assert "no plot: matplotlib is not installed" in out


@pytest.mark.skipif(not cpu_lowering.extension_available(), reason="W4A8 extension not built")
def test_bench_quantizes_at_load_and_runs_the_fused_kernel(ckpt, tmp_path, capsys):
  out = tmp_path / "q.json"
  argv = [
    "bench",
    "--ckpt",
    str(ckpt),
    "--quantize",
    "w4a8",
    "--group",
    "32",
    "--concurrency",
    "2",
    *ARGS[2:],
  ]
  assert main([*argv, "--out", str(out), "--no-plot"]) == 0
  res = json.loads(out.read_text())
  assert res["model"]["quantized"]["group"] == 32
  kernels = res["model"]["decode_kernels"]
  assert kernels.get("lrjax_w4a8_xuv", 0) == 6 * 2  # six low-rank projections, two layers
  assert kernels.get("lrjax_w4a8_matmul", 0) == 2 + 1  # the dense down_proj, and the LM head
  # int4 weights: a quarter of the f32 bytes and a little for the scales
  assert res["model"]["decode_weight_bytes"] < 0.4 * B.weight_bytes(checkpoint.load(ckpt))[1]
  assert [lv["concurrency"] for lv in res["levels"]] == [2] and res["levels"][0]["decode_tps"] > 0


def test_bench_random_preset_at_a_ratio():
  model, info = B.load_model_for_bench(preset="tiny", ratio=0.5, block=8)
  assert info["source"] == {"preset": "tiny", "random_weights": True, "ratio": 0.5}
  assert info["ranks_layer0"]["q_proj"] == 16 and info["ranks_layer0"]["gate_proj"] == 16
  # block 128 > the tiny model's budget: compress's own error names the fix
  with pytest.raises(ValueError, match="pass a smaller block"):
    B.load_model_for_bench(preset="tiny", ratio=0.5)


@pytest.mark.parametrize(
  "argv,msg",
  [
    (["--group", "32"], "--group needs --quantize"),
    (["--ratio", "0.4"], "--ratio applies to --preset"),
    (["--dtype", "float32"], "--dtype applies to --hf/--preset"),
  ],
)
def test_bench_rejects_bad_flag_combinations(ckpt, capsys, argv, msg):
  assert main(["bench", "--ckpt", str(ckpt), *argv]) == 2
  assert msg in capsys.readouterr().err


@pytest.mark.parametrize(
  "flag,value", [("--concurrency", "0"), ("--concurrency", "a,b"), ("--group", "12")]
)
def test_bench_rejects_bad_values_before_loading(ckpt, capsys, flag, value):
  with pytest.raises(SystemExit) as e:
    main(["bench", "--ckpt", str(ckpt), flag, value])
  assert e.value.code == 2
  assert value in capsys.readouterr().err


def test_bench_settings_validate():
  for n in (1, 2):  # 2 once crashed in numpy's percentile of no inter-token gaps
    with pytest.raises(ValueError, match=f"gen_len={n} must be >= 3"):
      B.BenchSettings(gen_len=n)
  with pytest.raises(ValueError, match="slots"):
    B.BenchSettings(concurrency=(1, 8), slots=4)
  with pytest.raises(ValueError, match="preset"):
    B.load_model_for_bench(preset="from_dict")


def test_memory_roofline_of_gpus_and_of_this_cpu():
  """A listed card's HBM rate; another accelerator none (the table shows '-'); a CPU its read rate,
  which streams a 16 MiB array faster than it could stream 1 MiB a pass (cache or not)."""
  h100 = B.memory_roofline("NVIDIA H100 80GB HBM3", "gpu")
  assert h100["bytes_per_s"] == 3.35e12 and "H100" in h100["source"]
  assert B.memory_roofline("NVIDIA H200", "gpu")["bytes_per_s"] == 4.3e12
  other = B.memory_roofline("NVIDIA A100-SXM4-80GB", "gpu")
  assert other == {"bytes_per_s": None, "source": "no memory rate listed for NVIDIA A100-SXM4-80GB"}
  assert B.memory_roofline("TPU v5 lite", "tpu")["bytes_per_s"] is None  # not this host's DRAM
  bps = B.measure_read_bps(16 << 20, reps=2, threads=2)
  assert np.isfinite(bps) and bps > 1e8
  with pytest.raises(ValueError, match="at least 4 bytes and 1 rep"):
    B.measure_read_bps(16, reps=0)
  level = dict(
    concurrency=1, decode_tps=10.0, prefill_tps=100.0, ttft_ms_median=5.0, ttft_ms_max=6.0,
    itl_ms_median=100.0, itl_ms_p90=110.0, decode_weight_gbs=1.0,
  )  # fmt: skip
  table = B.format_table({"levels": [dict(level, weight_roofline_frac=None)]})
  assert table.splitlines()[1].split()[-1] == "-" and len(table.splitlines()) == 2
  table = B.format_table(
    {
      "levels": [dict(level, weight_roofline_frac=0.25)],
      "memory_roofline": {"bytes_per_s": 4e9, "source": "measured"},
    }
  )
  assert table.splitlines()[1].split()[-1] == "25%"
  assert table.splitlines()[2] == "roofline: 4.0 GB/s (measured)"


def test_bench_replaces_only_its_own_results(ckpt, tmp_path, capsys, monkeypatch):
  """An existing --out is kept without --overwrite, and a file that is not a bench result is
  kept with it; an earlier bench result (and its plot) is replaced with --overwrite."""
  monkeypatch.chdir(tmp_path)
  run = ["bench", "--ckpt", str(ckpt), "--concurrency", "1", *ARGS[2:]]
  mine = tmp_path / "mine.json"
  mine.write_text('{"mine": 1}')
  assert main([*run, "--out", "mine.json", "--no-plot"]) == 2
  assert "pass --overwrite" in capsys.readouterr().err
  assert main([*run, "--out", "mine.json", "--no-plot", "--overwrite"]) == 2
  assert "is not an lrjax bench result" in capsys.readouterr().err
  assert mine.read_text() == '{"mine": 1}'
  assert main([*run, "--out", "r.json", "--no-plot"]) == 0
  earlier = json.loads((tmp_path / "r.json").read_text())
  (tmp_path / "r.json").write_text(json.dumps({**earlier, "marker": 1}))
  assert main([*run, "--out", "r.json", "--overwrite", "--no-plot"]) == 0
  assert "marker" not in json.loads((tmp_path / "r.json").read_text())  # replaced
  (tmp_path / "s.png").write_text("a plot")
  assert main([*run, "--out", "s.json"]) == 2  # the plot beside it exists
  assert "s.png exists; pass --overwrite" in capsys.readouterr().err
  assert (tmp_path / "s.png").read_text() == "a plot" and not (tmp_path / "s.json").exists()
  assert main([*run, "--out", "missing/r.json"]) == 2
  assert "does not exist" in capsys.readouterr().err
  assert main([*run, "--out", str(ckpt / "r.json")]) == 2  # inside the input checkpoint
  assert "inside an input" in capsys.readouterr().err
