"""Measured speed of the Triton lowerings against XLA's, per benchmarked shape (H200).

The registry asks ``faster`` before it lowers a primitive with a Triton kernel: the
verdict of the benchmarked shape nearest to the call's (|log2| ratios of K, r and N, same
op), at its token count nearest the call's, smoothed over that shape's neighbouring token
counts. Calls whose factors are more than EXTRAPOLATE times smaller or larger than every
benchmarked shape's go to XLA (e.g. TP shards of small factors). Where the kernel measured
slower than XLA's unfused chain there (median ratio below PARITY), the call is declined and
XLA lowers the reference; ``lrjax.lowering.prefer_kernels()`` overrides that. Non-gated MLPs
use the SwiGLU measurements. Measured on one H200; other NVIDIA GPUs get the same verdicts.

A benchmarked shape is a call alone. In a whole decode step the kernels can lose where their
calls win alone (XLA merges the dots that share an input): MODEL_AB holds the decode steps of
Llama-3-8B, Llama-3-70B (8 of its layers), Qwen2.5-7B and Llama-3.2-1B on one H200 with and
without the kernels, and at M >= 2 a call is left to XLA
when the step of the model whose hidden size is nearest the call's K, at the nearest batch
(of 2 or more rows), was slower with them (below MODEL_PARITY). MODEL_OP_AB holds the same
steps with every kernel but one op's, timed in the same device call as the step with all:
an op's calls are left to XLA where that step was faster without its kernel (Qwen2.5-7B's
SwiGLU kernel, about 7 % faster than XLA's MLP alone at 4-16 tokens, made its step 1.4 / 1.0 %
slower at batch 4 / 16 in session 33; in session 34, with f32 Pg/Pu after a one-wave stage A,
1.9 / 1.9 / 1.1 % faster at batch 4 / 8 / 16), and served, whatever MODEL_AB says of that
step, where it was slower without it.

RECORDS (the sweep's and the grouped q/k/v kernel's, GROUP_SOURCE), MODEL_AB and MODEL_OP_AB
are generated from the committed benchmark results, never edited by hand:
``python benchmarks/gpu_lowrank.py --emit-policy benchmarks/results/gpu_lowrank_h200.json``
(tests/custom_calls/triton/test_triton_policy.py checks that they agree).
"""
from __future__ import annotations

import json
import math
import os
import re
import statistics

from lrjax.custom_calls.triton.lowering import MLP_COMPOSE_MIN_M
from lrjax.custom_calls.triton.planner import MODEL_AB_LAUNCHES

SOURCE = "benchmarks/results/gpu_lowrank_h200.json"
MODEL_SOURCES = ("benchmarks/results/model_1gpu_h200.json",
                 "benchmarks/results/model_70b_1gpu_h200.json",
                 "benchmarks/results/model_qwen7b_1gpu_h200.json",
                 "benchmarks/results/model_1b_1gpu_h200.json")
# the grouped X·U·V kernel (op "xuv_group": K, then r and N summed over the members)
GROUP_SOURCE = "benchmarks/results/gpu_xuv_group_h200.json"
# At or above this fraction of XLA's speed the kernel serves. It was 0.97 (XLA's own time for
# one shape moves by a few percent between runs), but a kernel at parity gains nothing and in
# the decode step it lost: Llama-3-70B's SwiGLU kernel at 8 tokens took 216.5 us a layer
# against 211.1 for XLA's MLP (a 0.97-0.98x call), and the step was 2.6 % slower
# (benchmarks/results/model_70b_profile_h200.json, gpu_notes.md session 14).
PARITY = 1.0
# The same for a whole decode step (MODEL_AB): a step's time moves far less between runs
# (Llama-3-70B at batch 16, XLA: 3.193-3.228 ms over four runs; one run's repetitions within
# 0.3 %), and before session 14's planner fixes the 70B step was 0.96-0.99x with the kernels
# at every batch from 4 to 64. Between device calls a step still moves by up to 2 % (the 70B's
# XLA step at batch 8: 2.997-3.063 ms), so only same-call pairs are compared.
MODEL_PARITY = 0.99
# Records of the nearest shape with M within this factor of the nearest record's M are
# pooled (median speed ratio): at least three token counts for the end points of a sweep.
WINDOW = 4
# ...but a nearest record this far behind XLA declines on its own (beyond the noise: the
# pooled median once kept a 0.61x record at the end of a sweep). A call at the very shape and
# token count of a record follows that record at PARITY: the pooled median (0.98) kept the
# SwiGLU kernel on Llama-3-70B's MLP at T=16, a 0.96x record, and the 70B step at batch 16
# was 3.7 % slower with it (benchmarks/results/model_70b_1gpu_h200.json).
CLEAR_LOSS = 0.9
# X·U·V records from this many rows up pool only with each other: 4096->512->1024 at 64 / 128
# rows (phase 1, then XLA's GEMM: 0.93 / 0.96x XLA) were pooled with 16 / 32 (1.13 / 1.11x),
# and the median served 65-90-row calls that run the 64 / 128-row path
# (benchmarks/gpu_notes.md, sessions 35-36).
WIDE_M = 32
# A call whose factors are more than this many times smaller or larger than every benchmarked
# shape's is not judged from them: XLA lowers it. On 8 H200s the kernels on TP shards 4-15x
# smaller than any benchmarked shape made naive_tp's decode step up to 6 % slower
# (benchmarks/gpu_notes.md, session 7).
EXTRAPOLATE = 4.0

# (op, M, K, r, N, ours_us, xla_us); mlp rows: K = D, N = D_ff. MODEL_AB: (model, hidden
# size, batch, decode step ms with the kernels, ms without) (benchmarks/tp_gpu.py --fuse).
# MODEL_OP_AB: (model, hidden size, batch, op, step ms with every kernel, ms with every kernel
# but op's) (tp_gpu.py --fuse --kernels <the others>, then --fuse).
# BEGIN GENERATED
MEASURED_ON = 'NVIDIA H200, 2026-11-29'
RECORDS: tuple[tuple[str, int, int, int, int, float, float], ...] = (
    ('mlp_swiglu', 1, 2048, 1280, 8192, 29.3, 57.5),
    ('mlp_swiglu', 1, 3072, 1664, 24576, 74.3, 122.8),
    ('mlp_swiglu', 1, 3584, 2048, 18944, 74.7, 134.4),
    ('mlp_swiglu', 1, 4096, 1024, 14336, 38.1, 70.2),
    ('mlp_swiglu', 1, 4096, 2560, 14336, 74.0, 82.1),
    ('mlp_swiglu', 1, 5120, 2432, 17920, 88.9, 95.5),
    ('mlp_swiglu', 1, 5120, 3072, 27648, 146.9, 153.0),
    ('mlp_swiglu', 1, 7168, 3200, 20480, 131.2, 136.6),
    ('mlp_swiglu', 1, 8192, 3824, 28672, 200.5, 205.9),
    ('mlp_swiglu', 1, 8192, 3840, 28672, 198.2, 202.7),
    ('mlp_swiglu', 2, 4096, 2560, 14336, 74.6, 80.1),
    ('mlp_swiglu', 4, 2048, 1280, 8192, 30.1, 38.3),
    ('mlp_swiglu', 4, 3072, 1664, 24576, 75.1, 80.8),
    ('mlp_swiglu', 4, 3584, 2048, 18944, 75.3, 80.2),
    ('mlp_swiglu', 4, 4096, 2560, 14336, 75.2, 80.9),
    ('mlp_swiglu', 4, 5120, 2432, 17920, 90.0, 94.0),
    ('mlp_swiglu', 4, 5120, 3072, 27648, 148.2, 151.5),
    ('mlp_swiglu', 4, 7168, 3200, 20480, 132.9, 135.9),
    ('mlp_swiglu', 4, 8192, 3824, 28672, 202.8, 208.7),
    ('mlp_swiglu', 4, 8192, 3840, 28672, 200.3, 203.3),
    ('mlp_swiglu', 8, 4096, 2560, 14336, 76.2, 82.9),
    ('mlp_swiglu', 16, 2048, 1280, 8192, 31.3, 40.9),
    ('mlp_swiglu', 16, 3072, 1664, 24576, 77.7, 84.6),
    ('mlp_swiglu', 16, 3584, 2048, 18944, 77.9, 83.2),
    ('mlp_swiglu', 16, 4096, 1024, 14336, 39.8, 45.3),
    ('mlp_swiglu', 16, 4096, 2560, 14336, 77.5, 85.2),
    ('mlp_swiglu', 16, 5120, 2432, 17920, 93.1, 98.5),
    ('mlp_swiglu', 16, 5120, 3072, 27648, 152.2, 154.8),
    ('mlp_swiglu', 16, 7168, 3200, 20480, 134.6, 142.0),
    ('mlp_swiglu', 16, 8192, 3824, 28672, 208.4, 215.0),
    ('mlp_swiglu', 16, 8192, 3840, 28672, 203.0, 209.1),
    ('mlp_swiglu', 32, 4096, 2560, 14336, 86.4, 91.4),
    ('mlp_swiglu', 32, 8192, 3824, 28672, 221.8, 328.0),
    ('mlp_swiglu', 32, 8192, 3840, 28672, 214.6, 223.6),
    ('mlp_swiglu', 64, 2048, 1280, 8192, 44.8, 45.2),
    ('mlp_swiglu', 64, 4096, 2560, 14336, 93.6, 106.7),
    ('mlp_swiglu', 64, 8192, 3824, 28672, 235.3, 338.4),
    ('mlp_swiglu', 64, 8192, 3840, 28672, 227.1, 230.1),
    ('mlp_swiglu', 128, 4096, 2560, 14336, 109.1, 118.1),
    ('mlp_swiglu', 128, 8192, 3824, 28672, 258.8, 318.0),
    ('mlp_swiglu', 128, 8192, 3840, 28672, 248.5, 257.0),
    ('mlp_swiglu', 1024, 2048, 1280, 8192, 245.5, 153.5),
    ('mlp_swiglu', 1024, 4096, 2560, 14336, 544.5, 427.0),
    ('mlp_swiglu', 4096, 2048, 1280, 8192, 630.9, 487.1),
    ('mlp_swiglu', 4096, 4096, 1024, 14336, 921.1, 691.6),
    ('mlp_swiglu', 4096, 4096, 2560, 14336, 1842.3, 1573.9),
    ('xuv', 1, 2048, 256, 512, 3.6, 7.1),
    ('xuv', 1, 2048, 640, 2048, 7.1, 11.9),
    ('xuv', 1, 4096, 152, 4096, 4.2, 9.7),
    ('xuv', 1, 4096, 512, 1024, 6.3, 13.1),
    ('xuv', 1, 4096, 1024, 14336, 13.4, 26.4),
    ('xuv', 1, 4096, 1216, 4096, 10.1, 30.2),
    ('xuv', 1, 4096, 2560, 14336, 26.5, 27.4),
    ('xuv', 1, 8192, 544, 1024, 8.7, 9.7),
    ('xuv', 1, 8192, 576, 1024, 8.6, 10.1),
    ('xuv', 1, 8192, 2048, 16384, 27.1, 28.1),
    ('xuv', 1, 8192, 2432, 8192, 23.8, 24.9),
    ('xuv', 1, 8192, 2456, 8192, 24.5, 25.5),
    ('xuv', 1, 8192, 4096, 16384, 49.3, 50.1),
    ('xuv', 2, 2048, 256, 512, 3.5, 4.2),
    ('xuv', 2, 2048, 640, 2048, 7.1, 7.9),
    ('xuv', 2, 4096, 152, 4096, 4.2, 4.4),
    ('xuv', 2, 4096, 512, 1024, 6.2, 7.2),
    ('xuv', 2, 4096, 1024, 14336, 13.1, 14.0),
    ('xuv', 2, 4096, 1216, 4096, 10.0, 14.9),
    ('xuv', 2, 4096, 2560, 14336, 26.9, 27.7),
    ('xuv', 2, 8192, 544, 1024, 8.7, 9.8),
    ('xuv', 2, 8192, 2048, 16384, 27.3, 28.1),
    ('xuv', 2, 8192, 2432, 8192, 24.0, 26.2),
    ('xuv', 2, 8192, 2456, 8192, 25.0, 25.2),
    ('xuv', 2, 8192, 4096, 16384, 49.5, 50.0),
    ('xuv', 4, 2048, 256, 512, 3.6, 4.2),
    ('xuv', 4, 2048, 640, 2048, 7.2, 8.1),
    ('xuv', 4, 4096, 152, 4096, 4.3, 4.8),
    ('xuv', 4, 4096, 512, 1024, 6.3, 7.4),
    ('xuv', 4, 4096, 1024, 14336, 13.2, 14.3),
    ('xuv', 4, 4096, 1216, 4096, 10.1, 14.9),
    ('xuv', 4, 4096, 2560, 14336, 26.9, 27.4),
    ('xuv', 4, 8192, 544, 1024, 8.8, 10.9),
    ('xuv', 4, 8192, 576, 1024, 8.9, 10.7),
    ('xuv', 4, 8192, 2048, 16384, 27.5, 28.2),
    ('xuv', 4, 8192, 2432, 8192, 24.2, 24.7),
    ('xuv', 4, 8192, 2456, 8192, 25.1, 26.1),
    ('xuv', 4, 8192, 4096, 16384, 49.8, 52.2),
    ('xuv', 8, 2048, 256, 512, 3.5, 4.2),
    ('xuv', 8, 2048, 640, 2048, 7.4, 7.8),
    ('xuv', 8, 4096, 152, 4096, 4.4, 4.6),
    ('xuv', 8, 4096, 512, 1024, 6.7, 7.7),
    ('xuv', 8, 4096, 1024, 14336, 13.4, 14.5),
    ('xuv', 8, 4096, 1216, 4096, 10.3, 13.3),
    ('xuv', 8, 4096, 2560, 14336, 27.5, 27.8),
    ('xuv', 8, 8192, 544, 1024, 8.9, 10.5),
    ('xuv', 8, 8192, 2048, 16384, 27.6, 28.6),
    ('xuv', 8, 8192, 2432, 8192, 24.3, 25.0),
    ('xuv', 8, 8192, 2456, 8192, 26.3, 26.4),
    ('xuv', 8, 8192, 4096, 16384, 50.3, 52.4),
    ('xuv', 16, 2048, 256, 512, 3.8, 4.9),
    ('xuv', 16, 2048, 640, 2048, 7.6, 8.7),
    ('xuv', 16, 4096, 152, 4096, 4.5, 4.8),
    ('xuv', 16, 4096, 512, 1024, 6.7, 7.6),
    ('xuv', 16, 4096, 1024, 14336, 14.0, 14.5),
    ('xuv', 16, 4096, 1216, 4096, 10.8, 14.1),
    ('xuv', 16, 4096, 2560, 14336, 28.1, 29.3),
    ('xuv', 16, 8192, 544, 1024, 9.1, 9.7),
    ('xuv', 16, 8192, 576, 1024, 9.3, 9.6),
    ('xuv', 16, 8192, 2048, 16384, 28.1, 29.3),
    ('xuv', 16, 8192, 2432, 8192, 25.1, 26.4),
    ('xuv', 16, 8192, 2456, 8192, 27.5, 56.0),
    ('xuv', 16, 8192, 4096, 16384, 50.9, 54.1),
    ('xuv', 32, 2048, 256, 512, 4.5, 4.9),
    ('xuv', 32, 2048, 640, 2048, 7.8, 8.8),
    ('xuv', 32, 4096, 152, 4096, 5.3, 6.6),
    ('xuv', 32, 4096, 512, 1024, 8.0, 8.3),
    ('xuv', 32, 4096, 1024, 14336, 15.4, 16.7),
    ('xuv', 32, 4096, 1216, 4096, 12.8, 14.8),
    ('xuv', 32, 4096, 2560, 14336, 30.3, 31.5),
    ('xuv', 32, 8192, 544, 1024, 10.6, 10.9),
    ('xuv', 32, 8192, 2048, 16384, 30.1, 31.3),
    ('xuv', 32, 8192, 2432, 8192, 28.1, 28.7),
    ('xuv', 32, 8192, 2456, 8192, 30.2, 59.2),
    ('xuv', 32, 8192, 4096, 16384, 54.2, 58.4),
    ('xuv', 64, 2048, 256, 512, 4.7, 5.5),
    ('xuv', 64, 2048, 640, 2048, 9.2, 10.0),
    ('xuv', 64, 4096, 152, 4096, 6.7, 7.8),
    ('xuv', 64, 4096, 512, 1024, 8.1, 9.0),
    ('xuv', 64, 4096, 1024, 14336, 15.5, 16.4),
    ('xuv', 64, 4096, 1216, 4096, 15.4, 16.0),
    ('xuv', 64, 4096, 2560, 14336, 37.1, 37.8),
    ('xuv', 64, 8192, 544, 1024, 10.4, 11.8),
    ('xuv', 64, 8192, 2048, 16384, 31.8, 33.8),
    ('xuv', 64, 8192, 2456, 8192, 39.6, 61.5),
    ('xuv', 64, 8192, 4096, 16384, 60.9, 63.5),
    ('xuv', 128, 2048, 256, 512, 5.9, 6.3),
    ('xuv', 128, 2048, 640, 2048, 11.0, 12.6),
    ('xuv', 128, 4096, 152, 4096, 8.5, 10.0),
    ('xuv', 128, 4096, 512, 1024, 9.6, 10.9),
    ('xuv', 128, 4096, 1024, 14336, 19.3, 21.6),
    ('xuv', 128, 4096, 1216, 4096, 22.5, 23.3),
    ('xuv', 128, 4096, 2560, 14336, 36.2, 39.2),
    ('xuv', 128, 8192, 544, 1024, 12.1, 16.1),
    ('xuv', 128, 8192, 2048, 16384, 36.8, 36.9),
    ('xuv', 128, 8192, 2456, 8192, 64.7, 65.4),
    ('xuv', 128, 8192, 4096, 16384, 60.5, 61.4),
    ('xuv', 1024, 7168, 4096, 18432, 305.1, 272.3),
    ('xuv', 1024, 8192, 4096, 16384, 273.8, 263.1),
    ('xuv', 2048, 8192, 4096, 16384, 545.5, 519.0),
    ('xuv', 4096, 7168, 4096, 18432, 1150.9, 1065.2),
    ('xuv', 4096, 8192, 4096, 16384, 1110.7, 1026.0),
    ('xuv', 8192, 8192, 4096, 16384, 2204.2, 2015.6),
    ('xuv', 16384, 8192, 4096, 16384, 4939.4, 4100.6),
    ('xuv', 32768, 8192, 4096, 16384, 10254.6, 9482.5),
    ('xuv_group', 1, 2048, 1152, 3072, 7.8, 25.9),
    ('xuv_group', 1, 3584, 1600, 4608, 12.0, 47.1),
    ('xuv_group', 1, 4096, 2240, 6144, 14.4, 54.1),
    ('xuv_group', 1, 8192, 3544, 10240, 31.9, 46.6),
    ('xuv_group', 1, 8192, 3584, 10240, 31.3, 46.1),
    ('xuv_group', 2, 2048, 1152, 3072, 8.2, 14.1),
    ('xuv_group', 2, 3584, 1600, 4608, 12.3, 19.6),
    ('xuv_group', 2, 4096, 2240, 6144, 14.4, 22.9),
    ('xuv_group', 2, 8192, 3544, 10240, 32.3, 40.4),
    ('xuv_group', 2, 8192, 3584, 10240, 31.7, 39.5),
    ('xuv_group', 4, 2048, 1152, 3072, 8.2, 13.1),
    ('xuv_group', 4, 3584, 1600, 4608, 12.4, 19.9),
    ('xuv_group', 4, 4096, 2240, 6144, 14.6, 23.0),
    ('xuv_group', 4, 8192, 3544, 10240, 33.1, 40.1),
    ('xuv_group', 4, 8192, 3584, 10240, 31.6, 39.1),
    ('xuv_group', 8, 2048, 1152, 3072, 8.3, 13.7),
    ('xuv_group', 8, 3584, 1600, 4608, 12.6, 21.1),
    ('xuv_group', 8, 4096, 2240, 6144, 14.8, 23.5),
    ('xuv_group', 8, 8192, 3544, 10240, 34.7, 41.1),
    ('xuv_group', 8, 8192, 3584, 10240, 32.0, 39.2),
    ('xuv_group', 16, 2048, 1152, 3072, 8.6, 15.7),
    ('xuv_group', 16, 3584, 1600, 4608, 13.0, 21.7),
    ('xuv_group', 16, 4096, 2240, 6144, 15.3, 26.1),
    ('xuv_group', 16, 8192, 3544, 10240, 35.9, 40.7),
    ('xuv_group', 16, 8192, 3584, 10240, 33.0, 44.5),
    ('xuv_group', 32, 2048, 1152, 3072, 10.2, 17.7),
    ('xuv_group', 32, 3584, 1600, 4608, 15.0, 23.9),
    ('xuv_group', 32, 4096, 2240, 6144, 17.7, 27.4),
    ('xuv_group', 32, 8192, 3544, 10240, 43.3, 46.1),
    ('xuv_group', 32, 8192, 3584, 10240, 38.1, 51.7),
    ('xuv_group', 64, 2048, 1152, 3072, 13.0, 19.3),
    ('xuv_group', 64, 3584, 1600, 4608, 20.1, 25.9),
    ('xuv_group', 64, 4096, 2240, 6144, 24.9, 32.3),
    ('xuv_group', 64, 8192, 3544, 10240, 55.6, 51.0),
    ('xuv_group', 64, 8192, 3584, 10240, 48.4, 57.9),
)
MODEL_AB: tuple[tuple[str, int, int, float, float], ...] = (
    ('8b', 4096, 1, 4.359, 8.225),
    ('8b', 4096, 4, 4.222, 4.704),
    ('8b', 4096, 8, 4.411, 4.702),
    ('8b', 4096, 16, 5.041, 5.417),
    ('8b', 4096, 32, 6.649, 6.861),
    ('8b', 4096, 64, 9.139, 9.468),
    ('8b', 4096, 128, 14.763, 14.574),
    ('70b', 8192, 1, 2.846, 2.953),
    ('70b', 8192, 4, 2.864, 2.919),
    ('70b', 8192, 8, 3.034, 3.045),
    ('70b', 8192, 16, 3.139, 3.24),
    ('70b', 8192, 32, 3.647, 3.691),
    ('70b', 8192, 48, 4.109, 4.132),
    ('70b', 8192, 64, 4.496, 4.458),
    ('70b', 8192, 128, 6.175, 6.143),
    ('qwen2.5-7b', 3584, 1, 3.65, 6.667),
    ('qwen2.5-7b', 3584, 4, 3.799, 4.191),
    ('qwen2.5-7b', 3584, 8, 3.934, 4.208),
    ('qwen2.5-7b', 3584, 16, 4.517, 4.905),
    ('qwen2.5-7b', 3584, 64, 6.698, 6.777),
    ('1b', 2048, 1, 1.428, 2.216),
    ('1b', 2048, 4, 1.478, 1.685),
    ('1b', 2048, 8, 1.375, 1.596),
    ('1b', 2048, 16, 1.534, 1.677),
)
MODEL_OP_AB: tuple[tuple[str, int, int, str, float, float], ...] = (
    ('8b', 4096, 4, 'mlp_swiglu', 4.222, 4.255),
    ('8b', 4096, 16, 'mlp_swiglu', 5.041, 5.124),
    ('8b', 4096, 64, 'mlp_swiglu', 9.272, 9.433),
    ('70b', 8192, 4, 'mlp_swiglu', 2.862, 2.901),
    ('70b', 8192, 16, 'mlp_swiglu', 3.181, 3.184),
    ('70b', 8192, 64, 'mlp_swiglu', 4.538, 4.51),
    ('qwen2.5-7b', 3584, 4, 'mlp_swiglu', 3.799, 3.872),
    ('qwen2.5-7b', 3584, 4, 'xuv', 4.046, 4.102),
    ('qwen2.5-7b', 3584, 4, 'xuv_group', 4.108, 4.202),
    ('qwen2.5-7b', 3584, 8, 'mlp_swiglu', 3.934, 4.01),
    ('qwen2.5-7b', 3584, 8, 'xuv', 4.093, 4.145),
    ('qwen2.5-7b', 3584, 8, 'xuv_group', 4.178, 4.32),
    ('qwen2.5-7b', 3584, 16, 'mlp_swiglu', 4.517, 4.567),
    ('qwen2.5-7b', 3584, 16, 'xuv', 4.711, 4.704),
    ('qwen2.5-7b', 3584, 16, 'xuv_group', 4.785, 4.911),
    ('qwen2.5-7b', 3584, 64, 'mlp_swiglu', 6.698, 6.828),
    ('1b', 2048, 4, 'mlp_swiglu', 1.478, 1.613),
    ('1b', 2048, 8, 'mlp_swiglu', 1.375, 1.504),
    ('1b', 2048, 16, 'mlp_swiglu', 1.534, 1.678),
)
# END GENERATED


def records_from_results(path: str) -> tuple[str, tuple]:
  """(MEASURED_ON, RECORDS) from a gpu_lowrank.py results file: the default-kernel
  ("auto") record of each shape; of repeated shapes, the last in the file."""
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
  """RECORDS rows of the grouped kernel (its ``group`` records) from a --suite decode_group
  results file; an absent file gives none."""
  if not os.path.exists(path):
    return ()
  with open(path) as fh:
    recs = json.load(fh)["records"]
  return tuple(sorted({(r["op"], r["M"], r["K"], r["r"], r["N"], round(r["ours_us"], 1),
                        round(r["xla_lowrank_us"], 1)) for r in recs if r["variant"] == "group"}))


def policy_records(path: str) -> tuple[str, tuple]:
  """(MEASURED_ON, RECORDS): the sweep's records and the grouped kernel's (GROUP_SOURCE's
  file name beside ``path``)."""
  on, recs = records_from_results(path)
  group = os.path.join(os.path.dirname(path), os.path.basename(GROUP_SOURCE))
  return on, tuple(sorted(recs + group_records_from_results(group)))


def model_ab_from_results(path: str) -> tuple:
  """MODEL_AB rows from a tp_gpu.py results file: (model, hidden size, batch, step ms with the
  kernels, without) of each batch of the one-GPU low-rank model measured both ways (with the
  kernels: lrjax.fuse's default, grouping q/k/v; ``--no-group`` runs are not the default and
  are left out, and so are ``--whole-policy`` runs, timed with this rule on, ``--kernels``
  runs, with only some kernels served, runs with the scratch chain off and runs under a
  Triton launcher that is an A/B of the launch, not of the kernels (not in
  planner.MODEL_AB_LAUNCHES; a record without ``triton_launch`` ran under jaxlib's, the
  default before session 24); of repeated runs, the last."""
  with open(path) as fh:
    data = json.load(fh)
  recs = [r for r in data["records"]
          if "step_ms" in r and r["strategy"] == "lowrank_tp" and r["tp"] == 1
          and r.get("group") is not False and not r.get("whole_policy")
          and not r.get("kernels") and r.get("scratch_chain") is not False
          and r.get("triton_launch", "jaxlib") in MODEL_AB_LAUNCHES]
  # fused runs with lrjax.fuse's default grouping replace those from before it existed
  recs.sort(key=lambda r: r.get("group", False))
  steps = {(r["model"], r["batch"], bool(r.get("fuse"))): r["step_ms"] for r in recs}
  return tuple((name, data["models"][name]["hidden_size"], b, round(steps[name, b, True], 3),
                round(steps[name, b, False], 3))
               for name, b in sorted({k[:2] for k in steps})
               if (name, b, True) in steps and (name, b, False) in steps)


OPS = ("xuv", "xuv_group", "mlp_swiglu")  # the policy's ops, as tp_gpu.py --kernels names them


def op_ab_pair(kernels_rec: dict, step_rec: dict) -> bool:
  """Whether a tp_gpu.py step with every kernel, ``step_rec``, is the pair of a ``--kernels``
  step, ``kernels_rec``: the next run (one device call), same model and batch. tp_gpu.py's
  record dedupe keeps such pairs."""
  return (bool(kernels_rec.get("kernels")) and bool(step_rec.get("fuse"))
          and not step_rec.get("kernels") and step_rec.get("run") == kernels_rec.get("run", -2) + 1
          and (step_rec.get("model"), step_rec.get("batch"))
          == (kernels_rec.get("model"), kernels_rec.get("batch")))


def model_op_ab_from_results(path: str) -> tuple:
  """MODEL_OP_AB rows from a tp_gpu.py results file: (model, hidden size, batch, op, step ms
  with every kernel, ms with every kernel but op's) of each ``--kernels`` run that serves all
  ops but one and is followed, as the next run, by the step with every kernel at that batch
  (one device call, so steps that move by up to 2 % between calls are not compared); of
  repeated pairs, the last."""
  with open(path) as fh:
    data = json.load(fh)
  recs = [r for r in data["records"]
          if "step_ms" in r and r["strategy"] == "lowrank_tp" and r["tp"] == 1 and r.get("fuse")
          and r.get("group") is not False and not r.get("whole_policy")
          and r.get("scratch_chain") is not False
          and r.get("triton_launch", "jaxlib") in MODEL_AB_LAUNCHES]
  rows = {}
  for r in recs:
    missing = set(OPS) - set(r.get("kernels") or OPS)
    after = next((a["step_ms"] for a in recs if op_ab_pair(r, a)), None)
    if len(missing) == 1 and after is not None:
      rows[r["model"], r["batch"], missing.pop()] = (round(after, 3), round(r["step_ms"], 3))
  return tuple((name, data["models"][name]["hidden_size"], b, op) + rows[name, b, op]
               for name, b, op in sorted(rows))


def render(path: str, module_text: str, model_paths: tuple[str, ...] | None = None) -> str:
  """``module_text`` with its generated block replaced by the records of ``path`` (and of
  ``model_paths``, default: MODEL_SOURCES' file names beside ``path``)."""
  on, recs = policy_records(path)
  model_paths = model_paths or tuple(os.path.join(os.path.dirname(path), os.path.basename(m))
                                     for m in MODEL_SOURCES)
  ab = sum((model_ab_from_results(m) for m in model_paths), ())
  op_ab = sum((model_op_ab_from_results(m) for m in model_paths), ())
  body = "\n".join(f"    {r!r}," for r in recs)
  block = (f"# BEGIN GENERATED\nMEASURED_ON = {on!r}\n"
           f"RECORDS: tuple[tuple[str, int, int, int, int, float, float], ...] = (\n"
           f"{body}\n)\nMODEL_AB: tuple[tuple[str, int, int, float, float], ...] = (\n"
           + "".join(f"    {a!r},\n" for a in ab) + ")\n"
           "MODEL_OP_AB: tuple[tuple[str, int, int, str, float, float], ...] = (\n"
           + "".join(f"    {a!r},\n" for a in op_ab) + ")\n# END GENERATED")
  return re.sub(r"^# BEGIN GENERATED$.*?^# END GENERATED$", lambda _: block, module_text,
                flags=re.S | re.M)


def _weight_elems(op: str, k: int, r: int, n: int) -> int:
  # xuv_group rows hold summed ranks and widths, so r·(K+N) bounds the group's factor size;
  # queries and records use the same measure, which is all the nearest-shape search needs
  return 3 * r * (k + n) if op == "mlp_swiglu" else r * (k + n)


def nearest(op: str, m: int, k: int, r: int, n: int):
  """The benchmarked record of ``op`` nearest to this call, or None: first the benchmarked
  shape nearest to the call's (|log2| ratios of K, r and N summed; ties: factor size), among
  those measured on the call's ``path`` (all, if none was), then that shape's record nearest
  in M on it. A nearby shape's records guide better than another shape's at the call's very
  token count: Llama-3-8B's SwiGLU at T=8 (1.03x alone) said nothing of Qwen2.5-7B's (0.94x
  at T=4, 0.91x at T=16), and served there it made the Qwen step at batch 8 3 % slower."""
  w = _weight_elems(op, k, r, n)
  recs = [q for q in RECORDS if q[0] == op]
  side = [q for q in recs if path(op, q[1]) == path(op, m)] or recs
  if not side:
    return None
  shape = min({q[2:5] for q in side},
              key=lambda s: (sum(abs(math.log2(a / b)) for a, b in zip((k, r, n), s)),
                             abs(math.log2(w / _weight_elems(op, *s))), s))
  return min((q for q in side if q[2:5] == shape), key=lambda q: (abs(math.log2(m / q[1])), q[1]))


def _nearest_step(rows: tuple, m: int, k: int):
  """Of (model, hidden size, batch, ...) rows: the one of the model whose hidden size is
  nearest ``k``, at its nearest batch of 2 or more rows (within WINDOW x of M; ties: the
  larger), or None."""
  if not rows or m < 2:
    return None
  hidden = min({a[1] for a in rows}, key=lambda h: (abs(math.log2(k / h)), h))
  near = [a for a in rows if a[1] == hidden and a[2] >= 2 and a[2] / WINDOW <= m <= WINDOW * a[2]]
  return min(near, key=lambda a: (abs(math.log2(m / a[2])), -a[2])) if near else None


def _model_verdict(m: int, k: int, op: str | None = None) -> str | None:
  """The reason to leave an M-row call with input width ``k`` to XLA if the whole decode step
  of the model whose hidden size is nearest ``k``, at its nearest batch of 2 or more rows
  (within WINDOW x of M; ties: the larger), was slower with the kernels (below
  MODEL_PARITY); or, for ``op``, if that step was faster with every kernel but op's
  (MODEL_OP_AB). Where the op has its own A/B at the same step and it did not slow the step,
  that decides: the step with every kernel can lose because of another op's kernel (Qwen2.5-7B
  at batch 8-16: the SwiGLU kernel's), and the grouped q/k/v kernel made it faster there."""
  sources = f"{MEASURED_ON}, {', '.join(MODEL_SOURCES)}"
  override = "lrjax.lowering.prefer_kernels() or LRJAX_PREFER_KERNELS=1 uses the kernel anyway"
  step = _nearest_step(MODEL_AB, m, k)
  own = _nearest_step(tuple(a for a in MODEL_OP_AB if a[3] == op), m, k)
  if own is not None:
    name, hidden, b, _, every, others = own
    if others / every < MODEL_PARITY:
      return (f"in the whole decode step of the {name} model (hidden size {hidden}) at batch "
              f"{b} the {op} kernel made the step slower ({every:.2f} ms a step with every "
              f"kernel, {others:.2f} ms with all but {op}'s; {sources}); {override}")
    if step is None or (step[0], step[2]) == (name, b):
      return None  # the op's own A/B at that step decides, not every kernel's together
  if step is not None:
    name, hidden, b, ours, xla = step
    if xla / ours < MODEL_PARITY:
      return (f"in the whole decode step of the {name} model (hidden size {hidden}) at batch "
              f"{b} the kernels were slower ({ours:.2f} ms a step, {xla:.2f} ms with XLA's "
              f"lowering; {sources}); {override}")
  return None


def path(op: str, m: int) -> int:
  """Which of an op's code paths serves M rows, for pooling records: 0 at M = 1 (XLA too
  lowers one row differently), 1 up to WIDE_M rows; for X·U·V, 2 from WIDE_M + 1 rows, where
  its kernel runs 64- and 128-row blocks and, from 64 rows, leaves ·V to XLA's GEMM; for the
  MLP, 2 from MLP_COMPOSE_MIN_M rows, where it runs as X·U·V decode calls."""
  if m == 1:
    return 0
  if op == "xuv":
    return 1 if m <= WIDE_M else 2
  if op == "mlp_swiglu":
    return 1 if m < MLP_COMPOSE_MIN_M else 2
  return 1


def verdict(op: str, m: int, k: int, r: int, n: int) -> str | None:
  """None if the kernel measured at least PARITY x XLA's speed around the nearest
  benchmarked shape (or nothing was benchmarked), else the reason to leave this call to XLA.
  A call more than EXTRAPOLATE times smaller or larger (factor elements) than every
  benchmarked shape of its op goes to XLA, and so does one at M >= 2 near a batch whose
  whole decode step was slower with the kernels (MODEL_AB, measured with q/k/v grouped, so
  the grouped kernel follows it too: the 70B step at batch 16 was 1.4 % slower with only the
  group served) or faster with every kernel but this op's (MODEL_OP_AB).

  "Around": the median speed ratio of that shape's records with M within a factor WINDOW
  of the nearest record's, so one noisy timing does not flip the choice between
  neighbouring token counts; the nearest record alone declines below CLEAR_LOSS, and below
  PARITY where it is the call's own shape and token count. Only records of one ``path`` are
  pooled: M = 1 only with M = 1 (XLA lowers a one-row product differently, a multiply and a
  reduce fusion, not a GEMM: benchmarks/results/gpu_timeline_h200.json, so its speed there
  says nothing about M = 2), and X·U·V's records above WIDE_M rows only with each other."""
  rec = nearest(op, m, k, r, n)
  if rec is None:
    return None
  w = _weight_elems(op, k, r, n)
  gap = min(abs(math.log2(w / _weight_elems(op, *q[2:5]))) for q in RECORDS if q[0] == op)
  if gap > math.log2(EXTRAPOLATE):
    here = f"D={k} r={r} D_ff={n}" if op == "mlp_swiglu" else f"K={k} r={r} N={n}"
    return (f"no benchmarked {op} shape within {EXTRAPOLATE:g}x of this call's factor size "
            f"({here}: {2 ** gap:.1f}x from the nearest; {MEASURED_ON}, {SOURCE}); "
            f"lrjax.lowering.prefer_kernels() or LRJAX_PREFER_KERNELS=1 uses the kernel anyway")
  if (why := _model_verdict(m, k, op)) is not None:
    return why
  _, rm, rk, rr, rn, ours, xla = rec
  window = [q for q in RECORDS if q[0] == op and q[2:5] == (rk, rr, rn)
            and rm / WINDOW <= q[1] <= WINDOW * rm and path(op, q[1]) == path(op, rm)]
  ratio = statistics.median(q[6] / q[5] for q in window)
  dims = f"D={rk} r={rr} D_ff={rn}" if op == "mlp_swiglu" else f"K={rk} r={rr} N={rn}"
  if xla / ours < CLEAR_LOSS:
    return (f"XLA measured clearly faster at the nearest benchmarked shape ({op} {dims}, "
            f"M={rm}: {xla / ours:.2f}x XLA's speed; {MEASURED_ON}, {SOURCE}); "
            f"lrjax.lowering.prefer_kernels() or LRJAX_PREFER_KERNELS=1 uses the kernel anyway")
  if (rm, rk, rr, rn) == (m, k, r, n) and xla / ours < PARITY:
    return (f"XLA measured faster at this very shape ({op} {dims}, M={rm}: {xla / ours:.2f}x "
            f"XLA's speed; {MEASURED_ON}, {SOURCE}); "
            f"lrjax.lowering.prefer_kernels() or LRJAX_PREFER_KERNELS=1 uses the kernel anyway")
  if ratio >= PARITY:
    return None
  ms = ", ".join(str(q[1]) for q in window)
  return (f"XLA measured faster around the nearest benchmarked shape ({op} {dims}, "
          f"M={ms}: median {ratio:.2f}x XLA's speed; {MEASURED_ON}, {SOURCE}); "
          f"lrjax.lowering.prefer_kernels() or LRJAX_PREFER_KERNELS=1 uses the kernel anyway")
