#!/usr/bin/env bash
# gdkv's rados backend against `rados bench`, same pool, object size and concurrency, in one run:
# Store vs `rados bench write`, Retrieve vs `rados bench rand` (random reads of the objects the
# write phase left). Prints a markdown table with the IOPS ratios (gdkv / rados, higher is
# better) and each client's CPU time per op (user + system, librados threads included): the
# cluster shares the machine, so throughput moves with everything else running on it, while CPU
# per op is the client's own cost. The two alternate which goes first so neither always meets a
# fresher cluster.
#
# Usage: bench/rados/run.sh [BUILD_DIR]          (default: build)
# Env:   GDKV_CEPH_CONF  cluster config (default /tmp/gdkv-ceph/ceph.conf; scripts/ceph-cluster up)
#        POOLS           default "gdkv-rep3 gdkv-ec21"
#        SIZES           object/value sizes in bytes, default "4096 2097152"
#        THREADS         ops in flight, default "1 16 64"
#        BENCH_SECONDS   per phase, default 5
#        ROUNDS          pairs of runs per row, alternating which goes first; the table shows
#                        each column's median (default 1)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../../build}
bin=$build/bench/rados/gdkv_rados_bench
conf=${GDKV_CEPH_CONF:-/tmp/gdkv-ceph/ceph.conf}
pools=${POOLS:-gdkv-rep3 gdkv-ec21}
sizes=${SIZES:-4096 2097152}
threads=${THREADS:-1 16 64}
secs=${BENCH_SECONDS:-5}
rounds=${ROUNDS:-1}

[[ -x $bin ]] || {
  echo "run.sh: $bin not found: build the gdkv_rados_bench target" >&2
  exit 1
}
[[ -r $conf ]] || {
  echo "run.sh: no cluster config at $conf (scripts/ceph-cluster up)" >&2
  exit 1
}

rados_cmd() { rados -c "$conf" -p "$pool" "$@"; }
field() { awk -v k="$1" 'index($0, k) == 1 { print $NF; exit }'; }
gdkv_field() { sed -n "s/^gdkv $1 .* $2=\([0-9.]*\) .*/\1/p"; }
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }'; }

# Runs `rados bench ARGS`; sets out (its output) and cpu (its user+system seconds).
timed_rados_bench() {
  local TIMEFORMAT='%U %S' times
  times=$({ time rados_cmd bench "$@" >"$tmp" 2>&1; } 2>&1)
  out=$(<"$tmp")
  cpu=$(awk '{ print $1 + $2 }' <<<"$times")
}
per_op_us() { awk -v c="$1" -v n="$2" 'BEGIN { if (n > 0) printf "%.0f", c * 1e6 / n; else print "n/a" }'; }

run_rados() {
  local out cpu
  timed_rados_bench "$secs" write -b "$size" -O "$size" -t "$t" --no-cleanup --run-name gdkv-ref
  r_write=$(field "Average IOPS:" <<<"$out")
  r_write_cpu=$(per_op_us "$cpu" "$(field "Total writes made:" <<<"$out")")
  timed_rados_bench "$secs" rand -t "$t" --run-name gdkv-ref
  r_read=$(field "Average IOPS:" <<<"$out")
  r_read_cpu=$(per_op_us "$cpu" "$(field "Total reads made:" <<<"$out")")
  rados_cmd cleanup --run-name gdkv-ref >/dev/null 2>&1
}
run_gdkv() {
  local out
  out=$("$bin" --ceph-conf "$conf" --pool "$pool" -b "$size" -t "$t" --seconds "$secs")
  g_write=$(gdkv_field store iops <<<"$out")
  g_read=$(gdkv_field retrieve iops <<<"$out")
  g_write_cpu=$(printf '%.0f' "$(gdkv_field store cpu_us_per_op <<<"$out")")
  g_read_cpu=$(printf '%.0f' "$(gdkv_field retrieve cpu_us_per_op <<<"$out")")
}

tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT

echo "# gdkv rados backend vs rados bench ($(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores, ${secs} s per phase, load $(cut -d' ' -f1-3 /proc/loadavg))"
echo "# command: BENCH_SECONDS=$secs ROUNDS=$rounds POOLS='$pools' SIZES='$sizes' THREADS='$threads' bench/rados/run.sh"
echo
echo "IOPS: rados bench / gdkv and the ratio gdkv / rados; CPU: client µs per op, rados bench / gdkv;"
echo "medians of $rounds round(s)."
echo
echo "| pool | size | t | write IOPS | Store IOPS | ratio | rand IOPS | Retrieve IOPS | ratio | CPU write / Store | CPU rand / Retrieve |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
n=0
for pool in $pools; do
  for size in $sizes; do
    for t in $threads; do
      rw="" gw="" rr="" gr="" rwc="" gwc="" rrc="" grc=""
      for ((round = 0; round < rounds; round++)); do
        if ((n++ % 2 == 0)); then
          run_rados
          run_gdkv
        else
          run_gdkv
          run_rados
        fi
        rw+=" $r_write" gw+=" $g_write" rr+=" $r_read" gr+=" $g_read"
        rwc+=" $r_write_cpu" gwc+=" $g_write_cpu" rrc+=" $r_read_cpu" grc+=" $g_read_cpu"
      done
      r_write=$(median <<<"$rw") g_write=$(median <<<"$gw")
      r_read=$(median <<<"$rr") g_read=$(median <<<"$gr")
      printf '| %s | %s | %s | %.0f | %.0f | %s | %.0f | %.0f | %s | %s / %s | %s / %s |\n' \
        "$pool" "$size" "$t" "$r_write" "$g_write" "$(ratio "$g_write" "$r_write")" \
        "$r_read" "$g_read" "$(ratio "$g_read" "$r_read")" \
        "$(median <<<"$rwc")" "$(median <<<"$gwc")" "$(median <<<"$rrc")" "$(median <<<"$grc")"
    done
  done
done
