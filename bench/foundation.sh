#!/usr/bin/env bash
# Foundation benchmarks: cached 4 KiB Retrieve through the queue against memcpy and
# against redis-benchmark on loopback, and 2 MiB Retrieve bandwidth against memcpy. Every figure is
# a ratio to a reference measured in this same run.
#   bench/foundation.sh [build dir, default build/release] [seconds per run, default 5]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/release}
secs=${2:-5}
gdkv=$build/tools/gdkv/gdkv
[ -x "$gdkv" ] || { echo "build $gdkv first (scripts/run or scripts/test)" >&2; exit 2; }
command -v redis-server >/dev/null || { echo "redis-server is missing (scripts/test installs it)" >&2; exit 2; }

field() { /usr/bin/python3 -c "import json,sys; print(json.loads(sys.stdin.read())['$1'])"; }

port=$((20000 + RANDOM % 20000))
dir=$(mktemp -d)
redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" \
  --daemonize yes --pidfile "$dir/redis.pid" --logfile "$dir/redis.log"
trap 'kill $(cat "$dir/redis.pid") 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done

redis_gets() {  # clients pipeline
  redis-benchmark -p "$port" -t get -d 4096 -n "$3" -r 1000 -c "$1" -P "$2" -q --csv |
    awk -F, '/"GET"/ {gsub(/"/, "", $2); print $2}'
}
redis-cli -p "$port" set key:__rand_int__ x >/dev/null
redis-benchmark -p "$port" -t set -d 4096 -n 20000 -r 1000 -q >/dev/null

printf '%-44s %12s %12s %8s\n' "workload" "gdkv ops/s" "reference" "ratio"
for qd in 1 32; do
  j=$("$gdkv" --backend memory bench --op get --value-size 4096 --keys 1000 --qd "$qd" \
        --threads 1 --duration "$secs" --json)
  ops=$(echo "$j" | field ops_per_s)
  p50=$(echo "$j" | field p50_us)
  beyond=$(echo "$j" | field ns_per_op_beyond_memcpy)
  if [ "$qd" = 1 ]; then r=$(redis_gets 1 1 100000); else r=$(redis_gets 1 32 400000); fi
  ratio=$(/usr/bin/python3 -c "print(f'{$ops/$r:.1f}')")
  printf '%-44s %12.0f %12.0f %8s\n' "4 KiB get qd $qd vs redis GET (1 conn, pipeline $qd)" "$ops" "$r" "$ratio"
  printf '    p50 %s us, %s ns per op beyond memcpy of 4 KiB\n' "$p50" "$beyond"
done
for qd in 1 4; do
  j=$("$gdkv" --backend memory bench --op get --value-size 2097152 --keys 64 --qd "$qd" \
        --threads 1 --duration "$secs" --json)
  printf '%-44s %9.2f GB/s %7.2f GB/s %8.3f\n' "2 MiB get qd $qd vs memcpy" \
    "$(echo "$j" | field gb_per_s)" "$(echo "$j" | field memcpy_gb_per_s)" \
    "$(echo "$j" | field ratio_to_memcpy)"
done
