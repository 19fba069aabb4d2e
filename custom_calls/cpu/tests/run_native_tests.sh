#!/usr/bin/env bash
# Builds the W4A8 kernels and their C++ unit test for this x86-64 (or aarch64) host
# and runs every ISA path the CPU has, each compared bit-exactly with the scalar
# path; then checks that LRJAX_W4A8_ISA caps the dispatcher. Then the decode attention's
# test, each body this CPU has against a double reference. Exits non-zero on failure.
set -euo pipefail
HERE="$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)"  # custom_calls/cpu
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
mkdir "$OUT/k"  # the kernels' objects
CXX="${CXX:-g++}"
FLAGS=(-O2 -std=c++17 -ffp-contract=off -Wall -Werror -I"$HERE")
case "$(uname -m)" in
  x86_64)
    FLAGS+=(-DLRJAX_W4A8_X86)
    $CXX "${FLAGS[@]}" -mavx512f -mavx512bw -mavx512vl -mavx512vnni -Wno-maybe-uninitialized \
      -c "$HERE/w4a8_x86_avx512.cc" -o "$OUT/k/avx512.o"
    $CXX "${FLAGS[@]}" -mavx2 -mfma -mavxvnni -c "$HERE/w4a8_x86_avxvnni.cc" -o "$OUT/k/avxvnni.o"
    $CXX "${FLAGS[@]}" -mavx2 -mfma -c "$HERE/w4a8_x86_avx2.cc" -o "$OUT/k/avx2.o"
    $CXX "${FLAGS[@]}" -mavx2 -mfma -c "$HERE/decode_attention_x86_avx2.cc" -o "$OUT/k/attn_avx2.o"
    $CXX "${FLAGS[@]}" -mavx2 -mfma -c "$HERE/attention_x86_avx2.cc" -o "$OUT/k/prefill_avx2.o"
    REQ=scalar
    grep -qw avx2 /proc/cpuinfo && REQ+=",avx2"
    grep -qw avx_vnni /proc/cpuinfo && REQ+=",avxvnni"
    grep -qw avx512_vnni /proc/cpuinfo && REQ+=",avx512vnni"
    CAP=avx2
    ATTN_REQ=""
    grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo && ATTN_REQ=--require=avx2 ;;
  aarch64)
    FLAGS+=(-DLRJAX_W4A8_ARM)
    $CXX "${FLAGS[@]}" -c "$HERE/w4a8_arm_neon.cc" -o "$OUT/k/neon.o"
    $CXX "${FLAGS[@]}" -march=armv8.2-a+dotprod -c "$HERE/w4a8_arm_dotprod.cc" -o "$OUT/k/dotprod.o"
    $CXX "${FLAGS[@]}" -march=armv8.2-a+dotprod+i8mm -c "$HERE/w4a8_arm_i8mm.cc" -o "$OUT/k/i8mm.o"
    REQ=scalar,neon
    CAP=neon
    ATTN_REQ="" ;;
  *) echo "unsupported host $(uname -m)"; exit 1 ;;
esac
$CXX "${FLAGS[@]}" -c "$HERE/w4a8.cc" -o "$OUT/k/w4a8.o"
$CXX "${FLAGS[@]}" -c "$HERE/decode_attention.cc" -o "$OUT/k/attn.o"
$CXX "${FLAGS[@]}" -c "$HERE/attention.cc" -o "$OUT/k/prefill.o"  # compiled and linked here
$CXX "${FLAGS[@]}" -c "$HERE/tests/w4a8_test.cc" -o "$OUT/test.o"
$CXX "${FLAGS[@]}" -c "$HERE/tests/decode_attention_test.cc" -o "$OUT/attn_test.o"
$CXX "$OUT"/k/*.o "$OUT/test.o" -o "$OUT/w4a8_test" -lpthread
$CXX "$OUT"/k/*.o "$OUT/attn_test.o" -o "$OUT/decode_attention_test" -lpthread
echo "== w4a8_test --require=$REQ"
"$OUT/w4a8_test" --require="$REQ"
echo "== LRJAX_W4A8_ISA=$CAP w4a8_test"
LRJAX_W4A8_ISA=$CAP "$OUT/w4a8_test" --require="$REQ"
echo "native W4A8 tests: OK"
echo "== decode_attention_test $ATTN_REQ"
"$OUT/decode_attention_test" $ATTN_REQ
echo "== LRJAX_W4A8_ISA=scalar decode_attention_test"
LRJAX_W4A8_ISA=scalar "$OUT/decode_attention_test"
echo "native decode attention tests: OK"
