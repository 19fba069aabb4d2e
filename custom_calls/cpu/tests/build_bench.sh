#!/usr/bin/env bash
# Builds the native W4A8 micro-benchmark into $1 (default: a temp dir) and runs it.
set -euo pipefail
HERE="$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)"
OUT="${1:-$(mktemp -d)}"; shift || true
mkdir -p "$OUT"
F=(-O3 -std=c++17 -ffp-contract=off -DLRJAX_W4A8_X86 -I"$HERE")
g++ "${F[@]}" -c "$HERE/w4a8.cc" -o "$OUT/w4a8.o"
g++ "${F[@]}" -mavx512f -mavx512bw -mavx512vl -mavx512vnni -Wno-maybe-uninitialized -c "$HERE/w4a8_x86_avx512.cc" -o "$OUT/avx512.o"
g++ "${F[@]}" -mavx2 -mfma -mavxvnni -c "$HERE/w4a8_x86_avxvnni.cc" -o "$OUT/avxvnni.o"
g++ "${F[@]}" -mavx2 -mfma -c "$HERE/w4a8_x86_avx2.cc" -o "$OUT/avx2.o"
g++ "${F[@]}" -c "$HERE/tests/w4a8_bench.cc" -o "$OUT/bench.o"
g++ "$OUT"/*.o -o "$OUT/w4a8_bench" -lpthread
"$OUT/w4a8_bench" "$@"
