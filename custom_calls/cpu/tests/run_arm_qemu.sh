#!/usr/bin/env bash
# Cross-compiles the W4A8 kernels and their C++ unit test for aarch64 with Debian's
# g++-aarch64-linux-gnu and runs them under qemu-user:
#   -cpu max         : i8mm (smmla) and dotprod (sdot) paths, plus NEON and scalar,
#                      each compared bit-exactly with the scalar path;
#   LRJAX_W4A8_ISA   : the dispatcher honours the cap (dotprod, neon);
#   -cpu cortex-a72  : a CPU without dotprod/i8mm falls back to NEON.
# Then the decode attention's portable body against its double reference (-cpu max).
# Exits non-zero on any failure. Installs the toolchain with apt-get if missing.
set -euo pipefail
HERE="$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)"  # custom_calls/cpu

if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq g++-aarch64-linux-gnu qemu-user >/dev/null
fi

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
CXX=aarch64-linux-gnu-g++
FLAGS=(-O2 -std=c++17 -ffp-contract=off -DLRJAX_W4A8_ARM -Wall -Werror -I"$HERE")
mkdir "$OUT/k"  # the kernels' objects
$CXX "${FLAGS[@]}" -c "$HERE/w4a8.cc" -o "$OUT/k/w4a8.o"
$CXX "${FLAGS[@]}" -c "$HERE/decode_attention.cc" -o "$OUT/k/attn.o"
$CXX "${FLAGS[@]}" -c "$HERE/attention.cc" -o "$OUT/k/prefill.o"  # compiled and linked here
$CXX "${FLAGS[@]}" -c "$HERE/w4a8_arm_neon.cc" -o "$OUT/k/neon.o"
$CXX "${FLAGS[@]}" -march=armv8.2-a+dotprod -c "$HERE/w4a8_arm_dotprod.cc" -o "$OUT/k/dotprod.o"
$CXX "${FLAGS[@]}" -march=armv8.2-a+dotprod+i8mm -c "$HERE/w4a8_arm_i8mm.cc" -o "$OUT/k/i8mm.o"
$CXX "${FLAGS[@]}" -c "$HERE/tests/w4a8_test.cc" -o "$OUT/test.o"
$CXX "${FLAGS[@]}" -c "$HERE/tests/decode_attention_test.cc" -o "$OUT/attn_test.o"
$CXX -static "$OUT"/k/*.o "$OUT/test.o" -o "$OUT/w4a8_test" -lpthread
$CXX -static "$OUT"/k/*.o "$OUT/attn_test.o" -o "$OUT/decode_attention_test" -lpthread

run() {  # run <expected dispatch line> <qemu cpu> [env...] -- <test args>
  local expect="$1" cpu="$2"; shift 2
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  echo "== qemu-aarch64 -cpu $cpu ${envs[*]:-} w4a8_test $*"
  local log; log="$(env "${envs[@]}" qemu-aarch64 -cpu "$cpu" "$OUT/w4a8_test" "$@")"
  echo "$log"
  grep -qx "dispatch arm_sdot4 -> $expect" <<<"$log" || { echo "expected dispatch to $expect"; exit 1; }
}
run dotprod max -- --require=neon,dotprod,i8mm
run dotprod max LRJAX_W4A8_ISA=i8mm -- --require=dotprod,i8mm
run neon max LRJAX_W4A8_ISA=neon -- --require=i8mm
run neon cortex-a72 -- --require=neon
# A CPU without i8mm must not run the smmla path.
if qemu-aarch64 -cpu cortex-a72 "$OUT/w4a8_test" --require=i8mm >/dev/null 2>&1; then
  echo "i8mm path ran on cortex-a72, which lacks i8mm"; exit 1
fi
echo "arm qemu W4A8 tests: OK"
echo "== qemu-aarch64 -cpu max decode_attention_test"
qemu-aarch64 -cpu max "$OUT/decode_attention_test"
echo "arm qemu decode attention tests: OK"
