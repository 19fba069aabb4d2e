#!/usr/bin/env bash
# Runs Debian's bazel-bootstrap 4.2.x offline on this repository: points the
# repositories Bazel 4.2 fetches even for C++-only builds at local stand-ins.
#   custom_calls/cpu/bazel/bazel_offline.sh test //custom_calls/cpu:all
# Equivalent WORKSPACE lines (paths relative to the workspace root):
#   local_repository(name = "rules_cc", path = "custom_calls/cpu/bazel/rules_cc")
#   local_repository(name = "rules_java", path = "custom_calls/cpu/bazel/rules_java")
#   local_repository(name = "remote_coverage_tools", path = "custom_calls/cpu/bazel/remote_coverage_tools")
set -euo pipefail
HERE="$(cd "$(dirname "$(readlink -f "$0")")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
[ -f "$ROOT/WORKSPACE" ] || [ -f "$ROOT/WORKSPACE.bazel" ] || { echo "no WORKSPACE at $ROOT (create an empty one)"; exit 1; }
cmd="$1"; shift
cd "$ROOT"
exec bazel "$cmd" \
  --override_repository=rules_cc="$HERE/rules_cc" \
  --override_repository=rules_java="$HERE/rules_java" \
  --override_repository=remote_coverage_tools="$HERE/remote_coverage_tools" "$@"
