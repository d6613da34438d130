#!/usr/bin/env bash
# Two gdkv processes share one pool: while one stores keys, another retrieves each as soon as it
# appears and compares bytes; the stock `rados` tool reads the same bytes; a delete by one is seen
# by the other. On gdkv-rep3 and gdkv-ec21, through the CLI (`gdkv --backend rados`).
#
# Usage: rados_cli_sharing_test.sh PATH_TO_GDKV    (ctest passes the gdkv_cli target's file)
# Exit 77 (ctest: skipped) without $GDKV_CEPH_CONF.
set -euo pipefail

gdkv=$1
if [[ -z ${GDKV_CEPH_CONF:-} ]]; then
  echo "no Ceph cluster: set GDKV_CEPH_CONF (scripts/test does)"
  exit 77
fi
conf=$GDKV_CEPH_CONF
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
n=12
run=s$(printf %x%x $$ $RANDOM) # keys are at most 16 bytes

hex() { printf '%s' "$1" | od -An -tx1 | tr -d ' \n'; }
fail() {
  echo "FAIL: $*" >&2
  exit 1
}

for pool in gdkv-rep3 gdkv-ec21; do
  kv() { "$gdkv" --backend rados --pool "$pool" --ceph-conf "$conf" "$@"; }
  for ((i = 0; i < n; i++)); do
    head -c $((1 + (i * 37813) % 300000)) /dev/urandom >"$tmp/v$i"
  done

  # Process A stores; process B (concurrently) waits for each key and checks its bytes.
  (for ((i = 0; i < n; i++)); do kv put "$run-$i" "$tmp/v$i"; done) &
  writer=$!
  for ((i = 0; i < n; i++)); do
    for ((try = 0; ; try++)); do
      rc=0
      kv get "$run-$i" -o "$tmp/got$i" 2>/dev/null || rc=$?
      [[ $rc == 0 ]] && break
      [[ $rc == 1 ]] || fail "$pool: get $run-$i exited $rc"
      ((try < 200)) || fail "$pool: $run-$i never appeared"
      sleep 0.05
    done
    cmp -s "$tmp/v$i" "$tmp/got$i" || fail "$pool: $run-$i read back different bytes"
  done
  wait "$writer" || fail "$pool: the storing process failed"

  # The stock tool reads the object gdkv stored, byte for byte (object name = key in hex).
  rados -c "$conf" -p "$pool" -N ns1 get "$(hex "$run-3")" "$tmp/rados3"
  cmp -s "$tmp/v3" "$tmp/rados3" || fail "$pool: rados get differs from what gdkv stored"

  kv ls >"$tmp/ls"
  for ((i = 0; i < n; i++)); do grep -qx -- "$run-$i" "$tmp/ls" || fail "$pool: ls lacks $run-$i"; done

  # One process deletes, the other no longer finds the keys (exit 1: not found).
  for ((i = 0; i < n; i++)); do kv del "$run-$i"; done
  rc=0
  kv exists "$run-0" || rc=$?
  [[ $rc == 1 ]] || fail "$pool: exists after delete exited $rc, expected 1"
  echo "$pool: $n keys shared between processes, interop with rados get ok"
done
