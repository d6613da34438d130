#!/usr/bin/env bash
# Builds each layering probe (tests/layering/CMakeLists.txt): layer_probe_right_* must compile,
# layer_probe_wrong_* must fail because the header they include is not on that layer's include
# path ("No such file or directory"), not for any other reason.
# Usage: check.sh BUILD_DIR PROBE_TARGET...
set -uo pipefail
build=$1
shift
fail=0
for target in "$@"; do
  out=$(cmake --build "$build" --target "$target" 2>&1)
  rc=$?
  case $target in
    layer_probe_right_*)
      if ((rc == 0)); then
        echo "ok: $target compiles"
      else
        echo "FAIL: $target should compile:"
        echo "$out"
        fail=1
      fi
      ;;
    *)
      if ((rc != 0)) && grep -q "No such file or directory" <<<"$out"; then
        echo "ok: $target is a build error: $(grep -m1 "No such file or directory" <<<"$out")"
      elif ((rc == 0)); then
        echo "FAIL: $target compiled: a wrong-way include is not a build error"
        fail=1
      else
        echo "FAIL: $target failed for another reason:"
        echo "$out"
        fail=1
      fi
      ;;
  esac
done
exit $fail
