#!/usr/bin/env bash
# Local store benchmarks, each figure a ratio to fio run in this same script on the same
# file system with the same sizes, depth and flush policy:
#   - cold random Retrieve, 4 KiB and 2 MiB values, QD 1 and 32, against
#     fio --ioengine=io_uring --direct=1 --rw=randread (same bs, same iodepth) reading the written
#     part of the store's own file (read-only), so both read the same blocks of the same file;
#   - Store throughput at QD 32 against fio --rw=write --direct=1 --fdatasync=B, where B is the
#     records per fdatasync the store's group commit achieved in that round;
#   - index memory per key and rebuild time per million keys.
# The store is driven through the Backend API (bench/local/local_bench.cc): Stores are submitted
# from the bench's own thread (as gdkvd's reactors would; submit_us is the time spent inside
# submit()), Gets from the completion callbacks (one thread doing everything, as fio does).
#
# Shared machines make single runs noisy, so each workload runs ROUNDS times, gdkv and fio
# alternating, and the medians are compared. Latencies are total (submission to completion) on
# both sides: fio's lat, not its clat, which leaves out submission.
#   bench/local/run.sh [build dir, default build/release] [seconds per read run, default 3]
# Data goes to $GDKV_BENCH_DIR (default /var/tmp/gdkv-bench-$$; not a tmpfs: it must be a disk);
# $GDKV_BENCH_ROUNDS sets the rounds (default 3). Takes about two minutes.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build/release}
secs=${2:-3}
rounds=${GDKV_BENCH_ROUNDS:-3}
bench=$build/bench/local/local_bench
[ -x "$bench" ] || { echo "build $bench first (cmake --build $build --target local_bench)" >&2; exit 2; }
command -v fio >/dev/null || { echo "fio is missing (scripts/test installs it)" >&2; exit 2; }
dir=${GDKV_BENCH_DIR:-/var/tmp/gdkv-bench-$$}
mkdir -p "$dir"
trap 'rm -rf "$dir"' EXIT

py() { /usr/bin/python3 -c "$1"; }
field() { py "import json,sys; print(json.loads(sys.stdin.read())['$1'])"; }
median() { py "import statistics; print(statistics.median([$(IFS=,; echo "$*")]))"; }
# fio's JSON: IOPS, bandwidth (bytes/s) or median total latency (us) of one direction.
fio_field() {  # json dir(read|write) what(iops|bw|p50)
  py "
import json
j=json.loads(open('$1').read())['jobs'][0]['$2']
print({'iops': j['iops'], 'bw': j['bw_bytes'], 'p50': j['lat_ns']['percentile'].get('50.000000', 0)/1e3}['$3'])"
}

fstype=$(df -T "$dir" | awk 'NR==2 {print $2}')
echo "local store vs fio, $dir ($fstype), $(nproc) cores, $(uname -r); medians of $rounds rounds"
printf '%-44s %14s %14s %8s\n' "workload" "gdkv" "fio" "ratio"

for size in 4096 2097152; do
  if [ "$size" = 4096 ]; then count=65536; label="4 KiB"; else count=512; label="2 MiB"; fi
  bytes=$((size * count))  # 256 MiB of 4 KiB values, 1 GiB of 2 MiB values

  # Store throughput: the whole data set at QD 32, each value acknowledged only once durable.
  g=() f=() b=() o=()
  for _ in $(seq "$rounds"); do
    w=$("$bench" write --dir "$dir/store" --size "$size" --count "$count" --qd 32 --submit thread)
    g+=("$(echo "$w" | field mb_per_s)")
    b+=("$(echo "$w" | field records_per_flush)")
    o+=("$(echo "$w" | field log_bytes_per_value_byte)")
    rm -f "$dir/fio.dat"
    fio --name=w --filename="$dir/fio.dat" --size="$bytes" --bs="$size" --rw=write \
      --ioengine=io_uring --direct=1 --iodepth=32 --fdatasync="$(py "print(max(1, round(${b[-1]})))")" \
      --lat_percentiles=1 --output-format=json --output="$dir/fio.json" >/dev/null
    f+=("$(py "print($(fio_field "$dir/fio.json" write bw)/1e6)")")
  done
  gm=$(median "${g[@]}") fm=$(median "${f[@]}")
  printf '%-44s %9.0f MB/s %9.0f MB/s %8.2f\n' "$label store qd 32 (fdatasync as group commit)" \
    "$gm" "$fm" "$(py "print($gm/$fm)")"
  printf '    %s records per flush (fio: --fdatasync= the same); log bytes per value byte %s\n' \
    "$(median "${b[@]}")" "$(median "${o[@]}")"
  printf '    rounds: gdkv %s MB/s; fio %s MB/s\n' "$(printf '%.0f ' "${g[@]}")" "$(printf '%.0f ' "${f[@]}")"

  # Cold random Retrieve: O_DIRECT on both sides, so every read reaches the device.
  for qd in 1 32; do
    g=() f=() gl=() fl=() c=()
    for _ in $(seq "$rounds"); do
      r=$("$bench" read --dir "$dir/store" --size "$size" --count "$count" --qd "$qd" --seconds "$secs")
      [ "$(echo "$r" | field checksum_failures)" = 0 ] || { echo "checksum failures!" >&2; exit 1; }
      g+=("$(echo "$r" | field ops_per_s)")
      gl+=("$(echo "$r" | field p50_us)")
      c+=("$(echo "$r" | field cpu_per_op_us)")
      # The written part of the file only: its preallocated tail reads as zeros without I/O.
      fio --name=r --filename="$dir/store/store.gdkv" --readonly \
        --size="$(echo "$r" | field log_end)" --bs="$size" --rw=randread \
        --ioengine=io_uring --direct=1 --iodepth="$qd" --runtime="$secs" --time_based \
        --lat_percentiles=1 --output-format=json --output="$dir/fio.json" >/dev/null
      f+=("$(fio_field "$dir/fio.json" read iops)")
      fl+=("$(fio_field "$dir/fio.json" read p50)")
    done
    gm=$(median "${g[@]}") fm=$(median "${f[@]}")
    printf '%-44s %9.0f IOPS %9.0f IOPS %8.2f\n' "$label retrieve qd $qd" "$gm" "$fm" \
      "$(py "print($gm/$fm)")"
    printf '    p50 latency gdkv %.1f us, fio %.1f us; gdkv CPU per op %.1f us\n' \
      "$(median "${gl[@]}")" "$(median "${fl[@]}")" "$(median "${c[@]}")"
    printf '    rounds: gdkv %s; fio %s\n' "$(printf '%.0f ' "${g[@]}")" "$(printf '%.0f ' "${f[@]}")"
  done
  echo "    index rebuild of this store ($count keys): $(echo "$r" | field rebuild_ms) ms"
  rm -rf "$dir/store" "$dir/fio.dat"
done

rb=$("$bench" rebuild --dir "$dir/rebuild" --count 1000000)
printf 'index: %s bytes per key; rebuild %s s per million keys (1,000,000 small values, %s ms)\n' \
  "$(echo "$rb" | field index_bytes_per_key)" "$(echo "$rb" | field rebuild_s_per_million_keys)" \
  "$(echo "$rb" | field rebuild_ms)"
