"""NKI planner predictions for NeuronMM's shapes, next to the paper's measured numbers.

MODEL PREDICTIONS, NOT HARDWARE MEASUREMENTS. No Trainium was used: the numbers come
from lrjax.custom_calls.nki.planner (exact HBM traffic / flops / SBUF footprint of our
kernels, the paper's eq. 10-11, and a roofline bound), which the test suite checks
against the numpy NKI test double. The paper's columns are copied from NeuronMM
(trn1.2xlarge, one NeuronCore) for comparison.

    python benchmarks/nki_planner.py   # writes benchmarks/results/nki_planner.json
"""

from __future__ import annotations

import datetime
import json
import pathlib
import platform

from lrjax.custom_calls.nki import planner

# trn1 NeuronCore-v2 (the paper's hardware): 95 TFLOP/s bf16 and the paper's 222 flop/B
# ridge point give ~428 GB/s of HBM bandwidth per core.
PEAK_FLOPS = 95e12
HBM_BW = PEAK_FLOPS / planner.COMPUTE_BOUND_AI
BF16 = 2

TABLE4_PAPER = {  # B_M -> (total ms, AI flop/B, SBUF %, spill reload MB)
  128: (31.25, 124.12, 19.54, 0),
  256: (16.02, 240.94, 51.69, 0),
  512: (11.02, 455.10, 80.07, 0),
  1024: (10.99, 819.17, 90.05, 0),
  2048: (11.07, 1280.50, 96.35, 29.19),
  4096: (12.50, 512.95, 98.96, 931.00),
}
TABLE3_PAPER = {
  "latency_ms": {"NKI XW": 57.89, "NKI XUV": 37.47, "NeuronMM": 27.63},
  "traffic_GB": {"NKI XW": 9.93, "NKI XUV": 6.52, "NeuronMM": 2.47},
}
TABLE1_PAPER = {
  "sequential": {"ms": 1.57, "GFLOPs": 85.90, "MB": 298.66},
  "naive": {"ms": 18.06, "GFLOPs": 343.60, "MB": 3140.42},
}


def roofline_ms(p) -> float:
  return 1e3 * max(p.flops / PEAK_FLOPS, p.traffic.total / HBM_BW)


def table4():
  M, K, r, N = 4096, 7168, 4096, 18432
  rows = []
  for bm, (ms, ai, sbuf, spill) in TABLE4_PAPER.items():
    p = planner.best_for_bm("xuv", M, K, r, N, BF16, bm, out_t=True)
    rows.append(
      {
        "B_M": bm,
        "paper": {
          "total_ms": ms,
          "arith_intensity": ai,
          "sbuf_pct": sbuf,
          "spill_reload_MB": spill,
          "spills": spill > 0,
        },
        "model": {
          "blocks": p.blocks.as_tuple(),
          "ai_eq10": round(p.ai_eq10, 2),
          "ai_kernel": round(p.ai, 2),
          "hbm_GB": round(p.traffic.total / 1e9, 3),
          "sbuf_eq11_pct": round(100 * p.sbuf_eq11_bytes / planner.SBUF_BYTES, 2),
          "sbuf_pipelined_pct": round(100 * p.sbuf_pipelined_bytes / planner.SBUF_BYTES, 2),
          "predicts_spill": not p.fits,
          "spill_reason": p.spill_reason,
          "roofline_ms": None if not p.fits else round(roofline_ms(p), 2),
        },
      }
    )
  chosen = planner.plan("xuv", M, K, r, N, BF16, out_t=True)
  return {
    "shape": {"M": M, "K": K, "r": r, "N": N, "dtype": "bfloat16", "out": "O^T"},
    "rows": rows,
    "planner_choice": chosen.summary(),
    "planner_choice_roofline_ms": round(roofline_ms(chosen), 2),
    "spill_pattern_matches_paper": all(
      row["paper"]["spills"] == row["model"]["predicts_spill"] for row in rows
    ),
  }


def table3():
  K, r, N = 8192, 4096, 16384
  rows = []
  for M in (1024, 2048, 4096, 8192, 16384, 32768):
    p = planner.plan("xuv", M, K, r, N, BF16, out_t=True)
    rows.append(
      {
        "M": M,
        "blocks": p.blocks.as_tuple(),
        "hbm_GB": round(p.traffic.total / 1e9, 3),
        "hbm_GB_eq10": round(p.traffic_eq10 / 1e9, 3),
        "x_reads": f"{p.shape[2] // p.blocks.br} per strip (B_r={p.blocks.br} < r)"
        if p.blocks.br < p.shape[2]
        else "once",
        "GFLOPs": round(p.flops / 1e9, 1),
        "ai_kernel": round(p.ai, 1),
        "ai_eq10": round(p.ai_eq10, 1),
        "roofline_ms": round(roofline_ms(p), 2),
        "sbuf_pipelined_pct": round(100 * p.sbuf_pipelined_bytes / planner.SBUF_BYTES, 1),
      }
    )
  n = len(rows)
  return {
    "shape": {"M": "1K..32K", "K": K, "r": r, "N": N, "dtype": "bfloat16", "out": "O^T"},
    "rows": rows,
    "paper_average": TABLE3_PAPER,
    "model_average": {
      "hbm_GB": round(sum(x["hbm_GB"] for x in rows) / n, 3),
      "hbm_GB_eq10": round(sum(x["hbm_GB_eq10"] for x in rows) / n, 3),
      "TFLOPs": round(sum(x["GFLOPs"] for x in rows) / n / 1e3, 3),
      "roofline_ms": round(sum(x["roofline_ms"] for x in rows) / n, 2),
    },
  }


def table1():
  M, K, r, N = 2048, 2048, 2048, 8192
  naive = planner.evaluate("xuv_naive", M, K, r, N, BF16, (128, 512, 512, 512))
  same = planner.evaluate("xuv", M, K, r, N, BF16, (128, 512, 512, 512))
  best = planner.plan("xuv", M, K, r, N, BF16)
  f = lambda p: {
    "blocks": p.blocks.as_tuple(),
    "GFLOPs": round(p.flops / 1e9, 2),
    "MB": round(p.traffic.total / 1e6, 2),
    "roofline_ms": round(roofline_ms(p), 3),
  }
  return {
    "shape": {"M": M, "K": K, "r": r, "N": N, "B_N": 512, "dtype": "bfloat16"},
    "paper": TABLE1_PAPER,
    "model": {"naive_alg1": f(naive), "fused_same_blocks": f(same), "fused_planned": f(best)},
    "note": "B_N=512 is the paper's; B_M=128, B_K=B_r=512 for the naive kernel are our "
    "assumption. The paper's 'sequential' baseline (two kernels, Y through HBM) is "
    "not modelled; fused numbers are TrainiumFusion's.",
  }


def llama_mlp():
  # Llama-3.2-1B at compression 0.2 (paper Table 6): K=2048, D_ff=8192, all ranks 1280.
  out = []
  for M in (1, 1024):
    p = planner.plan_mlp(M, 2048, 1280, 8192, 1280, 2048, BF16, gated=True)
    out.append(
      {
        "M": M,
        "up_gate": p.up_gate.summary(),
        "down": p.down.summary(),
        "hbm_MB": round(p.traffic.total / 1e6, 2),
        "roofline_ms": round(roofline_ms(p.up_gate) + roofline_ms(p.down), 3),
      }
    )
  return out


def main():
  result = {
    "kind": "MODEL PREDICTIONS (lrjax NKI planner), NOT hardware measurements",
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "machine": f"{platform.machine()} {platform.system()} (no Trainium; nothing executed on Neuron)",  # noqa: E501
    "python": platform.python_version(),
    "target": "AWS Neuron SDK 2.33 / NKI 0.7 (nki.* namespace), trn1 NeuronCore-v2 constants",
    "constants": {
      "sbuf_bytes": planner.SBUF_BYTES,
      "psum_bytes": planner.PSUM_BYTES,
      "psum_banks": planner.PSUM_BANKS,
      "partitions": planner.P,
      "pipeline_buffers": planner.PIPELINE_BUFFERS,
      "peak_bf16_flops": PEAK_FLOPS,
      "hbm_bytes_per_s": round(HBM_BW),
      "compute_bound_ai": planner.COMPUTE_BOUND_AI,
    },
    "table4_block_size": table4(),
    "table3_xuv": table3(),
    "table1_naive_vs_fused": table1(),
    "llama3.2_1b_mlp_ratio0.2": llama_mlp(),
  }
  path = pathlib.Path(__file__).parent / "results" / "nki_planner.json"
  path.parent.mkdir(exist_ok=True)
  path.write_text(json.dumps(result, indent=1) + "\n")
  print(
    f"{result['kind']}\nTable 4 (DeepSeek-V3 up_proj, M=4096), B_M: paper ms / AI / spill "
    f"| model AI eq10 / kernel AI / SBUF% pipelined / spill / roofline ms"
  )
  for row in result["table4_block_size"]["rows"]:
    pp, m = row["paper"], row["model"]
    print(
      f"  {row['B_M']:5d}: {pp['total_ms']:6.2f} {pp['arith_intensity']:8.2f} {str(pp['spills']):5s}"  # noqa: E501
      f" | {m['ai_eq10']:8.2f} {m['ai_kernel']:8.2f} {m['sbuf_pipelined_pct']:7.2f} "
      f"{str(m['predicts_spill']):5s} {m['roofline_ms']}"
    )
  t3 = result["table3_xuv"]
  print(
    f"Table 3 average HBM traffic: paper NeuronMM {t3['paper_average']['traffic_GB']['NeuronMM']} GB"  # noqa: E501
    f" | model {t3['model_average']['hbm_GB']} GB (eq. 10's traffic: "
    f"{t3['model_average']['hbm_GB_eq10']} GB)"
  )
  t1 = result["table1_naive_vs_fused"]["model"]
  print(
    f"Table 1: naive {t1['naive_alg1']['GFLOPs']} GFLOP {t1['naive_alg1']['MB']} MB | fused "
    f"{t1['fused_planned']['GFLOPs']} GFLOP {t1['fused_planned']['MB']} MB"
  )
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
