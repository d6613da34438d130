#!/usr/bin/env python3
"""Benchmarks across a real veth link: gdkvd nodes in network namespaces
(scripts/netns-hosts up 2: h0, h1 and the Ceph cluster in a namespace of its own), driven with the
harness of python/tests/test_multihost.py (Net, Host.start/metric/client/spawn), imported as it is.

1. Retrieve on h1, one client, queue depth 1 (sequential get_into into a buffer from
   client.empty(), so gdkvd writes it in place), 4 KiB and 2 MiB:
   - floor: the same loop on an in-process memory backend (gdkv.open("memory")): the Python
     client's own per-call cost, no gdkvd, no network;
   - DRAM hit: h1's tiered gdkvd (64 MiB host cache), keys read once, then read again;
   - local-tier hit: h1's tiered gdkvd with cache.bytes = 0, keys read once (filling the local
     store), then read again;
   - RADOS fetch: h1's gdkvd with backend.kind = "rados" and cache.bytes = 0, distinct keys h0
     stored, each read once (every read crosses the link);
   - where the RADOS fetch's time goes: the same reads of other distinct keys with the
     controller in the client's process on h1 (gdkv.open("rados"): no gdkvd, no vfio-user hop);
     the C++ backend alone and raw librados reads (plain, and with the gdkv.hdr getxattr the
     backend adds) at one op in flight, from `gdkv_rados_bench -t 1 --reference` in h1's
     namespace (random keys of what its own store phase wrote; mean = 1 / ops/s); with --nospin
     also the gdkvd fetch with controller.idle_spin_us = 0;
   - reference: `rados bench ... write -t 1 --no-cleanup`, then `seq -t 1` (same pool, same
     object size) inside h1's namespace, right before the RADOS fetch of that size.
   Every set of distinct keys is stored by h0 right before h1 reads it, as rados bench seq
   reads what its write phase just wrote. Each case is checked with h1's /metrics (cache hits,
   local-tier hits, RADOS gets) and by the bytes of the last value read.
2. Store throughput of 64 KiB values from h0 (one client, queue depth 1) on a pool with a byte
   quota and backend.evict = true (high 60%, low 40%, every 500 ms), stored well past the quota
   several times, against the same loop on a pool of the same PG count without quota and with
   backend.evict = false.

Every ratio is against a reference measured in the same run. Prints a table (markdown) and, with
--json, one JSON object on the last line. Needs root; the namespaces use the prefix --prefix
(default gdkvbench), are brought up at the start and always brought down at the end.

Usage: $GDKV_PYTHON -P bench/multihost/bench.py [--json] [--seconds 2] [--rados-seconds 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("GDKV_BUILD_DIR", str(ROOT / "build" / "release"))
sys.path.insert(0, str(ROOT / "python" / "tests"))
import conftest  # noqa: E402  (BUILD: $GDKV_BUILD_DIR)
import test_multihost as mh  # noqa: E402  (the harness: Net, Host, PRELUDE, _ceph, ...)

RADOS_BENCH_BIN = conftest.BUILD / "bench" / "rados" / "gdkv_rados_bench"

KIB, MIB = 1 << 10, 1 << 20
POOL = "gdkv-rep3"
PLAIN_POOL = "gdkvbench-plain"  # the Store reference: no quota, eviction off

# Retrieve at queue depth 1: one get_into after another, each timed (perf_counter_ns), into one
# buffer from client.empty() (zero copy through gdkvd). Keys are cycled (a hot set) or, with
# ARGS["once"], each read once in order (distinct keys). The last value read is checked.
GET_LOOP = '''
size = ARGS["size"]
keys = [bytes.fromhex(k) for k in ARGS["keys"]]
if ARGS["open"]:  # an in-process controller: gdkv.open(**ARGS["open"])
    c = gdkv.open(**ARGS["open"])
    if ARGS["open"]["backend"] == "memory":
        gdkv.raise_first(c.put_many([(k, value_for(k, size)) for k in keys]))
        for k in keys:
            expect_match(c, k, size)
else:
    c = connect()
buf = c.empty(size, "uint8")
get_into, pc = c.get_into, time.perf_counter_ns
cap = len(keys) if ARGS["once"] else ARGS["cap"]
lat = np.empty(cap, np.int64)
nk, i = len(keys), 0
end = pc() + int(ARGS["seconds"] * 1e9)
t0 = pc()
while i < cap:
    s = pc()
    n = get_into(keys[i % nk], buf)
    e = pc()
    lat[i] = e - s
    i += 1
    if e >= end:
        break
elapsed = (pc() - t0) / 1e9
last = keys[(i - 1) % nk]
ok = n == size and bool(np.array_equal(buf, value_for(last, size)))
lat = lat[:i] / 1000.0
out({"ops": i, "s": elapsed, "ops_per_s": i / elapsed, "mean_us": float(lat.mean()),
     "p50_us": float(np.percentile(lat, 50)), "p99_us": float(np.percentile(lat, 99)),
     "last_value_ok": ok})
'''

# Stores at queue depth 1 from one buffer in gdkvd's shared memory (zero copy); each value is
# made distinct by its first 16 bytes (the key). Failures are counted, not fatal.
STORE_LOOP = '''
size, count = ARGS["size"], ARGS["count"]
c = connect()
buf = c.empty(size, "uint8")
buf[:] = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
keys = [gdkv.hash128(f"{ARGS['salt']}-{i}".encode()) for i in range(count)]
put, pc = c.put, time.perf_counter_ns
lat = np.empty(count, np.int64)
failed, statuses, first, per_s = 0, {}, [], []  # per_s: [Stores acknowledged, failed] a second
t0 = pc()
for i, k in enumerate(keys):
    buf[:16] = np.frombuffer(k, np.uint8)
    s = pc()
    sec = (s - t0) // 1_000_000_000
    while len(per_s) <= sec:
        per_s.append([0, 0])
    try:
        put(k, buf)
        per_s[sec][0] += 1
    except gdkv.Error as e:
        failed += 1
        per_s[sec][1] += 1
        statuses[f"{e.status:#x}"] = statuses.get(f"{e.status:#x}", 0) + 1
        if len(first) < 3:
            first.append({"i": i, "t_s": round((s - t0) / 1e9, 2),
                          "error": type(e).__name__ + ": " + str(e)[:120]})
    lat[i] = pc() - s
elapsed = (pc() - t0) / 1e9
lat = lat / 1000.0
out({"ops": count, "s": elapsed, "ops_per_s": count / elapsed,
     "ok_per_s": (count - failed) / elapsed, "mean_us": float(lat.mean()),
     "p50_us": float(np.percentile(lat, 50)), "p99_us": float(np.percentile(lat, 99)),
     "failed": failed, "statuses": statuses, "first_failures": first, "per_second": per_s})
'''


def salted_keys(salt: str, tag: str, n: int) -> list[str]:
    return mh.keys_hex(mh.gdkv.hash128(f"{salt}-{tag}-{i}".encode()) for i in range(n))


def delta(host: mh.Host, before: dict, after: dict, name: str, **labels) -> float | None:
    """after - before of one metric, None where the gdkvd has no such metric."""
    try:
        return host.metric(name, after, **labels) - host.metric(name, before, **labels)
    except AssertionError:
        return None


def sample(samples: dict, name: str) -> float | None:
    """The sum of metric name over its label sets, None where there is none."""
    vals = [v for k, v in samples.items() if k.partition("{")[0] == name]
    return round(sum(vals), 3) if vals else None


def timed_get(host: mh.Host, keys: list[str], size: int, seconds: float, *, once=False,
              open_args: dict | None = None) -> dict:
    """GET_LOOP on host, with the /metrics deltas it caused in host's gdkvd; open_args: an
    in-process controller (gdkv.open(**open_args)) instead of the gdkvd."""
    cap = 2_000_000 if size <= 64 * KIB else 100_000
    args = dict(keys=keys, size=size, seconds=seconds, once=once, open=open_args, cap=cap)
    load1 = os.getloadavg()[0]
    if open_args:
        return {**host.client(GET_LOOP, timeout=120, **args), "load1": load1}
    before = host.metrics()
    r = host.client(GET_LOOP, timeout=120, **args)
    r["load1"] = load1
    after = host.metrics()
    r["metrics"] = {
        "cache_hits": delta(host, before, after, "cache_hits_total"),
        "near_hits": delta(host, before, after, "tiered_near_hits_total"),
        "rados_gets": delta(host, before, after, "rados_ops_total", op="get"),
        "atime_updates": delta(host, before, after, "rados_atime_updates_total"),
        # A remote client cannot wake a sleeping reactor: it waits for its 5 ms futex timeout.
        "reactor_sleeps": delta(host, before, after, "reactor_sleeps_total"),
    }
    return r


def fill(host: mh.Host, keys: list[str], size: int) -> None:
    """Reads every key once on host (filling its tiers), checking the bytes."""
    r = host.client(mh.READ_BLOCKS, keys=keys, sizes=[size] * len(keys), timeout=300)
    assert r["matches"] == [True] * len(keys), f"{host.name}: wrong or missing values"


def rados(net: mh.Net, host: mh.Host, *args: str, timeout: float = 120) -> str:
    r = subprocess.run(["ip", "netns", "exec", host.ns, "rados", "-c", net.ceph_conf, *args],
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"rados {' '.join(args)} on {host.name}: {r.stdout}\n{r.stderr}")
    return r.stdout


def parse_rados_bench(text: str) -> dict:
    def num(label: str) -> float:
        m = re.search(r"^" + re.escape(label) + r":\s+([0-9.eE+-]+)", text, re.M)
        if not m:
            raise RuntimeError(f"no '{label}' in rados bench output:\n{text}")
        return float(m.group(1))

    return {"ops_per_s": num("Average IOPS"), "mb_per_s": num("Bandwidth (MB/sec)"),
            "mean_us": num("Average Latency(s)") * 1e6, "s": num("Total time run")}


def rados_bench(net: mh.Net, host: mh.Host, size: int, seconds: int) -> dict:
    """rados bench write (-t 1, --no-cleanup), then seq (-t 1) of those objects, then cleanup,
    inside host's namespace."""
    name = f"gdkvbench-{size}-{uuid.uuid4().hex[:8]}"
    try:
        w = parse_rados_bench(rados(net, host, "-p", POOL, "bench", str(seconds), "write", "-b",
                                    str(size), "-t", "1", "--no-cleanup", "--run-name", name))
        s = parse_rados_bench(rados(net, host, "-p", POOL, "bench", str(seconds), "seq", "-t",
                                    "1", "--run-name", name))
    finally:
        rados(net, host, "-p", POOL, "cleanup", "--run-name", name, timeout=300)
    return {"write": w, "seq": s}


def backend_bench(net: mh.Net, host: mh.Host, size: int, seconds: float) -> dict | None:
    """gdkv_rados_bench -t 1 --reference inside host's namespace: the C++ backend alone (no
    controller, no Python) and raw librados reads (plain; + the gdkv.hdr getxattr), random
    keys of what its store phase wrote. None when the binary is not built."""
    if not RADOS_BENCH_BIN.exists():
        return None
    r = subprocess.run(["ip", "netns", "exec", host.ns, str(RADOS_BENCH_BIN), "--ceph-conf",
                        net.ceph_conf, "--pool", POOL, "-b", str(size), "-t", "1", "--seconds",
                        str(seconds), "--reference"], capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"gdkv_rados_bench on {host.name}: {r.stdout}\n{r.stderr}")
    phases = {}
    for line in r.stdout.splitlines():
        if line.startswith("gdkv "):
            phase, *fields = line.split()[1:]
            phases[phase] = {k: float(v) for k, v in (f.split("=") for f in fields)
                             if k not in ("pool",)}
    return phases


def store_run(net: mh.Net, a: mh.Host, pool: str, evict: bool, count: int, size: int,
              salt: str) -> dict:
    """STORE_LOOP on h0 against pool, h0's gdkvd evicting or not; h0's evictions sampled every
    2 s while it runs."""
    backend = {"kind": "rados", "pool": pool, "evict": evict}
    if evict:
        backend.update(evict_high_percent=60, evict_low_percent=40, evict_interval_ms=500)
    a.start({"backend": backend, "cache": {"bytes": 0}})
    load1 = os.getloadavg()[0]
    before = a.metrics()
    p = a.spawn(STORE_LOOP, salt=salt, count=count, size=size)
    t0, timeline = time.monotonic(), []
    while p.poll() is None:
        time.sleep(2)
        if p.poll() is None:
            m = a.metrics()
            timeline.append([round(time.monotonic() - t0, 1),
                             sample(m, "gdkv_rados_evictions_total"),
                             sample(m, "gdkv_rados_pool_fill_ratio")])
    r = mh.Host.result(p, timeout=600)
    r["load1"] = load1
    time.sleep(1.5)  # the passes after the last Store
    after = a.metrics()
    r["evictions"] = delta(a, before, after, "rados_evictions_total")
    r["evictions_timeline"] = timeline  # [s into the run, evictions so far, fill ratio]
    r["puts"] = delta(a, before, after, "rados_ops_total", op="put")
    if evict:
        objects = mh._pool_objects(net)
        r["pool_objects_end"] = objects
        r["pool_mib_end"] = objects * size / MIB
        r["pool_capacity_bytes"] = a.metric("rados_pool_capacity_bytes", after)
    a.gdkvd.stop()
    a.gdkvd = None
    return r


def run_retrieve(net: mh.Net, a: mh.Host, b: mh.Host, opts, salt: str) -> dict:
    sizes = {"4 KiB": 4 * KIB, "2 MiB": 2 * MIB}
    hot = {4 * KIB: salted_keys(salt, "hot4k", 16), 2 * MIB: salted_keys(salt, "hot2m", 8)}
    n_far = {4 * KIB: opts.far_4k, 2 * MIB: opts.far_2m}
    rados_node = {"backend": {"kind": "rados"}, "cache": {"bytes": 0}}

    def store(keys: list[str], size: int) -> None:  # from h0, into RADOS, 64 MiB a client
        step = max(1, (64 * MIB) // size)
        for i in range(0, len(keys), step):
            part = keys[i:i + step]
            assert a.client(mh.STORE_BLOCKS, keys=part, sizes=[size] * len(part),
                            timeout=300) == {"stored": len(part)}

    # h0 is a rados node (nothing kept on its tiers): it stores what h1 reads.
    a.start(rados_node)
    for size in sizes.values():
        store(hot[size], size)
    ret = {label: {} for label in sizes}

    for label, size in sizes.items():
        ret[label]["floor"] = timed_get(b, hot[size], size, opts.seconds,
                                        open_args={"backend": "memory"})

    b.start()  # tiered, 64 MiB host cache
    for label, size in sizes.items():
        fill(b, hot[size], size)
        ret[label]["dram"] = timed_get(b, hot[size], size, opts.seconds)

    b.start({"cache": {"bytes": 0}})  # tiered, no host cache, a fresh local store
    for label, size in sizes.items():
        fill(b, hot[size], size)
        ret[label]["local"] = timed_get(b, hot[size], size, opts.seconds)

    # RADOS: every set of distinct keys is stored by h0 right before h1 reads it once, as
    # rados bench seq reads what its write phase just wrote.
    for label, size in sizes.items():
        b.start(rados_node)
        ret[label]["rados_bench"] = rados_bench(net, b, size, opts.rados_seconds)
        keys = salted_keys(salt, f"far{size}", n_far[size])
        store(keys, size)
        ret[label]["rados"] = timed_get(b, keys, size, opts.seconds * 4, once=True)
        if opts.nospin:  # gdkvd's reactor sleeping at once instead of spinning 200 µs idle
            b.start({**rados_node, "controller": {"reactors": 1, "idle_spin_us": 0}})
            keys = salted_keys(salt, f"far{size}-nospin", n_far[size])
            store(keys, size)
            ret[label]["rados_nospin"] = timed_get(b, keys, size, opts.seconds * 4, once=True)
        b.cleanup()
        # The controller in the client's own process (no gdkvd, no vfio-user hop), then the
        # C++ backend alone and raw librados.
        keys = salted_keys(salt, f"far{size}-inproc", n_far[size])
        store(keys, size)
        ret[label]["rados_inproc"] = timed_get(
            b, keys, size, opts.seconds * 4, once=True,
            open_args={"backend": "rados", "pool": POOL, "ceph_conf": net.ceph_conf})
        ret[label]["backend"] = backend_bench(net, b, size, opts.seconds)
    a.cleanup()
    return ret


def run_store(net: mh.Net, a: mh.Host, opts, salt: str) -> dict:
    """Store with eviction against without: two pools of the same PG count."""
    mh._ceph(net, "osd", "pool", "create", mh.EVICT_POOL, "8", "8")
    mh._ceph(net, "osd", "pool", "set-quota", mh.EVICT_POOL, "max_bytes",
             str(opts.quota_mib * MIB))
    mh._ceph(net, "osd", "pool", "application", "enable", mh.EVICT_POOL, "rados")
    mh._ceph(net, "osd", "pool", "create", PLAIN_POOL, "8", "8")
    mh._ceph(net, "osd", "pool", "application", "enable", PLAIN_POOL, "rados")
    res = {"count": opts.store_count, "quota_bytes": opts.quota_mib * MIB}
    runs = [("no_evict", PLAIN_POOL, False), ("evict", mh.EVICT_POOL, True)]
    if opts.evict_first:
        runs.reverse()
    for name, pool, evict in runs:
        res[name] = store_run(net, a, pool, evict, opts.store_count, 64 * KIB, f"{salt}-{name}")
    return res


def run(net: mh.Net, opts) -> dict:
    a, b = mh.Host(net, 0), mh.Host(net, 1)
    salt = "bench-" + uuid.uuid4().hex
    res: dict = {"load_before": os.getloadavg(), "retrieve": {}, "store": {}}
    try:
        if "retrieve" in opts.parts:
            res["retrieve"] = run_retrieve(net, a, b, opts, salt)
        if "store" in opts.parts:
            res["store"] = run_store(net, a, opts, salt)
    finally:
        for h in (a, b):
            h.cleanup()
        for pool in (mh.EVICT_POOL, PLAIN_POOL):
            subprocess.run(["ip", "netns", "exec", f"{net.prefix}-ceph", "ceph", "-c",
                            net.ceph_conf, "osd", "pool", "rm", pool, pool,
                            "--yes-i-really-really-mean-it"], capture_output=True, timeout=60)
    res["load_after"] = os.getloadavg()
    return res


def fmt_ops(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def table(res: dict) -> str:
    rows = ["| case | size | ops/s | p50 µs | mean µs | p99 µs | / rados bench seq ops/s | "
            "checked | load |", "|---|---|---|---|---|---|---|---|---|"] if res["retrieve"] else []
    names = {"floor": "floor: in-process memory backend", "dram": "DRAM hit (h1 host cache)",
             "local": "local-tier hit (h1, cache 0)", "rados": "RADOS fetch (h1, kind rados, "
             "cache 0; keys h0 stored)",
             "rados_nospin": "RADOS fetch, as above, gdkvd `idle_spin_us = 0`",
             "rados_inproc": "RADOS fetch, in-process controller on h1 (`gdkv.open(\"rados\")`)"}
    for label, cases in res["retrieve"].items():
        seq = cases["rados_bench"]["seq"]
        for case in ("floor", "dram", "local", "rados", "rados_nospin", "rados_inproc"):
            if case not in cases:
                continue
            r = cases[case]
            m = r.get("metrics", {})
            check = {"floor": "value ok" if r["last_value_ok"] else "WRONG VALUE",
                     "rados_inproc": "value ok" if r["last_value_ok"] else "WRONG VALUE",
                     "dram": f"{m.get('cache_hits') or 0:.0f} cache hits, "
                             f"{m.get('rados_gets') or 0:.0f} RADOS gets",
                     "local": f"{m.get('near_hits') or 0:.0f} local hits, "
                              f"{m.get('cache_hits') or 0:.0f} cache hits, "
                              f"{m.get('rados_gets') or 0:.0f} RADOS gets",
                     "rados": f"{m.get('rados_gets') or 0:.0f} RADOS gets, "
                              f"{m.get('atime_updates') or 0:.0f} atime updates",
                     "rados_nospin": f"{m.get('rados_gets') or 0:.0f} RADOS gets"}[case]
            if case in ("dram", "local", "rados", "rados_nospin"):
                check += f", {m.get('reactor_sleeps') or 0:.0f} reactor sleeps"
                if not r["last_value_ok"]:
                    check += ", WRONG VALUE"
            rows.append(f"| {names[case]} | {label} | {fmt_ops(r['ops_per_s'])} | "
                        f"{r['p50_us']:,.1f} | {r['mean_us']:,.1f} | {r['p99_us']:,.1f} | "
                        f"{r['ops_per_s'] / seq['ops_per_s']:.2f} | {check} ({r['ops']} ops) | "
                        f"{r['load1']:.1f} |")
        bb = cases.get("backend") or {}
        for phase, what in (("retrieve", "C++ backend alone (`gdkv_rados_bench -t 1`), random "
                                         "keys"),
                            ("raw-read+hdr", "raw librados read + getxattr gdkv.hdr (same run)"),
                            ("raw-read", "raw librados read (same run)")):
            if phase in bb:
                x = bb[phase]
                rows.append(f"| {what} | {label} | {fmt_ops(x['iops'])} | {x['p50_us']:,.1f} | "
                            f"{1e6 / x['iops']:,.1f} | {x['p99_us']:,.1f} | "
                            f"{x['iops'] / seq['ops_per_s']:.2f} | {x['ops']:.0f} ops, "
                            f"{x['errors']:.0f} errors | |")
        w = cases["rados_bench"]["write"]
        rows.append(f"| `rados bench seq -t 1` (h1) | {label} | {fmt_ops(seq['ops_per_s'])} | "
                    f"– | {seq['mean_us']:,.1f} | – | 1 | {seq['s']:.1f} s; write -t 1 before it: "
                    f"{fmt_ops(w['ops_per_s'])} ops/s | |")
    st = res["store"]
    if not st:
        return "\n".join(rows)
    q = st["quota_bytes"] >> 20
    rows += ["", f"Store, 64 KiB, {st['count']} values ({st['count'] * 64 / 1024:.0f} MiB), one "
             "client on h0, queue depth 1:", "",
             "| pool | Stores/s (acknowledged) | ratio | p50 µs | mean µs | p99 µs | failed | "
             "evictions | pool at end | load |", "|---|---|---|---|---|---|---|---|---|---|"]
    base = st["no_evict"]["ok_per_s"]
    for name, what in (("no_evict", "no quota, evict = false"),
                       ("evict", f"quota {q} MiB, evict = true (60%/40%, 500 ms)")):
        r = st[name]
        end = (f"{r['pool_mib_end']:.1f} MiB ({r['pool_objects_end']} blocks)"
               if "pool_objects_end" in r else "–")
        fails = f"{r['failed']}" + (f" {r['statuses']}" if r["failed"] else "")
        rows.append(f"| {what} | {fmt_ops(r['ok_per_s'])} | {r['ok_per_s'] / base:.2f} | "
                    f"{r['p50_us']:,.0f} | {r['mean_us']:,.0f} | {r['p99_us']:,.0f} | {fails} | "
                    f"{r['evictions'] or 0:.0f} | {end} | {r['load1']:.1f} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="also print one JSON object")
    ap.add_argument("--seconds", type=float, default=2, help="per timed Retrieve case")
    ap.add_argument("--rados-seconds", type=int, default=3, help="rados bench write/seq")
    ap.add_argument("--far-4k", type=int, default=2000, help="distinct 4 KiB keys h0 stores")
    ap.add_argument("--far-2m", type=int, default=128, help="distinct 2 MiB keys h0 stores")
    ap.add_argument("--store-count", type=int, default=2560, help="64 KiB Stores per pool")
    ap.add_argument("--quota-mib", type=int, default=32, help="the evicting pool's quota")
    ap.add_argument("--evict-first", action="store_true", help="run the evicting pool first")
    ap.add_argument("--nospin", action="store_true",
                    help="also the RADOS fetch with gdkvd's controller.idle_spin_us = 0")
    ap.add_argument("--parts", default="retrieve,store",
                    help="what to run: retrieve, store or both (default)")
    ap.add_argument("--prefix", default="gdkvbench", help="GDKV_NETNS_PREFIX of the namespaces")
    opts = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (network namespaces)", file=sys.stderr)
        return 2
    mh.PREFIX = opts.prefix  # Net.script passes it as GDKV_NETNS_PREFIX
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` brings it down

    t_start = time.monotonic()
    mh.Net.script("down")  # what an interrupted run left
    net_up = False
    try:
        r = mh.Net.script("up", "2")
        if r.returncode != 0:
            raise RuntimeError(f"scripts/netns-hosts up failed:\n{r.stdout}\n{r.stderr}")
        net_up = True
        conf = r.stdout.strip().splitlines()[-1]
        up_s = time.monotonic() - t_start
        net = mh.Net(opts.prefix, Path(tempfile.mkdtemp(prefix="gdkvbench-")), conf)
        res = run(net, opts)
    finally:
        d = mh.Net.script("down")
        if d.returncode != 0:
            print(f"scripts/netns-hosts down failed:\n{d.stdout}\n{d.stderr}", file=sys.stderr)
        elif net_up:
            print("namespaces down", file=sys.stderr)
    res["up_s"] = up_s
    res["total_s"] = time.monotonic() - t_start
    res["date"] = datetime.datetime.now().isoformat(timespec="seconds")
    print(table(res))
    print(f"\nload average {res['load_before'][0]:.2f} before, {res['load_after'][0]:.2f} "
          f"after; netns up {up_s:.0f} s, total {res['total_s']:.0f} s")
    st = res["store"]
    if st:
        print(f"store {st['no_evict']['s']:.1f} s / {st['evict']['s']:.1f} s; evictions over "
              f"time (s, total, fill): {st['evict']['evictions_timeline']}")
    for name in ("no_evict", "evict") if st else ():
        r = st[name]
        print(f"{name}: [acknowledged, failed] Stores per second: {r['per_second']}"
              + (f"; first failures: {r['first_failures']}" if r["failed"] else ""))
    if opts.json:
        print(json.dumps(res))
    failed = sum(st[n]["failed"] for n in ("no_evict", "evict")) if st else 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
