#!/usr/bin/env bash
# Builds the W4A8 kernels and their C++ unit test for this x86-64 (or aarch64) host
# and runs every ISA path the CPU has, each compared bit-exactly with the scalar
# path; then checks that LRJAX_W4A8_ISA caps the dispatcher. Exits non-zero on failure.
set -euo pipefail
HERE="$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)"  # custom_calls/cpu
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
CXX="${CXX:-g++}"
FLAGS=(-O2 -std=c++17 -ffp-contract=off -Wall -Werror -I"$HERE")
case "$(uname -m)" in
  x86_64)
    FLAGS+=(-DLRJAX_W4A8_X86)
    $CXX "${FLAGS[@]}" -mavx512f -mavx512bw -mavx512vl -mavx512vnni -Wno-maybe-uninitialized \
      -c "$HERE/w4a8_x86_avx512.cc" -o "$OUT/avx512.o"
    $CXX "${FLAGS[@]}" -mavx2 -mfma -mavxvnni -c "$HERE/w4a8_x86_avxvnni.cc" -o "$OUT/avxvnni.o"
    $CXX "${FLAGS[@]}" -mavx2 -mfma -c "$HERE/w4a8_x86_avx2.cc" -o "$OUT/avx2.o"
    REQ=scalar
    grep -qw avx2 /proc/cpuinfo && REQ+=",avx2"
    grep -qw avx_vnni /proc/cpuinfo && REQ+=",avxvnni"
    grep -qw avx512_vnni /proc/cpuinfo && REQ+=",avx512vnni"
    CAP=avx2 ;;
  aarch64)
    FLAGS+=(-DLRJAX_W4A8_ARM)
    $CXX "${FLAGS[@]}" -c "$HERE/w4a8_arm_neon.cc" -o "$OUT/neon.o"
    $CXX "${FLAGS[@]}" -march=armv8.2-a+dotprod -c "$HERE/w4a8_arm_dotprod.cc" -o "$OUT/dotprod.o"
    $CXX "${FLAGS[@]}" -march=armv8.2-a+dotprod+i8mm -c "$HERE/w4a8_arm_i8mm.cc" -o "$OUT/i8mm.o"
    REQ=scalar,neon
    CAP=neon ;;
  *) echo "unsupported host $(uname -m)"; exit 1 ;;
esac
$CXX "${FLAGS[@]}" -c "$HERE/w4a8.cc" -o "$OUT/w4a8.o"
$CXX "${FLAGS[@]}" -c "$HERE/tests/w4a8_test.cc" -o "$OUT/test.o"
$CXX "$OUT"/*.o -o "$OUT/w4a8_test" -lpthread
echo "== w4a8_test --require=$REQ"
"$OUT/w4a8_test" --require="$REQ"
echo "== LRJAX_W4A8_ISA=$CAP w4a8_test"
LRJAX_W4A8_ISA=$CAP "$OUT/w4a8_test" --require="$REQ"
echo "native W4A8 tests: OK"
