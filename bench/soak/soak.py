#!/usr/bin/env python3
"""A soak: a multi-turn chat workload's KV blocks through a real gdkvd for a long time, with the
daemon killed and restarted and every tier evicting, while its resources are watched.

Workload (what an engine in front of gdkv does, without the engine's compute): ``--users``
users, each with a private document of ``--doc-blocks`` blocks; every turn sends the whole
history (the document, every earlier question and answer) plus a new question. Per turn the
client derives the prompt's chained keys (``gdkv.chain_keys``), asks gdkv for the leading run it
holds (``lookup_prefix``), loads those blocks into memory shared with gdkvd (``get_many_into``)
and stores the blocks it had to "recompute" (``put_many``). A block's value is its key repeated to
``--block-bytes``, so every value read is checked against the key it was read under: a byte that
differs is wrong KV, counted and fatal to the run. Users reconnect every ``--reconnect-every``
turns (an engine process restarting: connection churn, shared memory mapped and unmapped).

gdkvd runs on the local store with a capacity below the working set (the store reclaims its
oldest segments) and a small host cache (it evicts); every ``--restart-every`` seconds it is
killed (SIGKILL and SIGTERM in turn) and started again on the same store and socket directory.
A turn that fails because the daemon went away is retried on a new connection once it is back;
a turn that still fails is a failed request.

Every ``--sample-every`` seconds the soak reads, from /proc: gdkvd's RSS, open file descriptors,
memfds among them and the bytes of memfd mappings (the client memory gdkvd maps), and the same
for this process (the client side): private RSS (RssAnon, where a leak shows), shared RSS
(RssShmem: the clients' memory gdkvd maps), open file descriptors, memfds and the bytes of
memfd mappings. Resources must be flat after warm-up: per daemon life, the median of the last
fifth of its samples may exceed the median of its first fifth after ``--warmup`` seconds by at
most 10 % + 16 MiB (private RSS), 2 (descriptors, memfds) and one connection's shared memory
(shared RSS, mapped bytes); each life's end may exceed the first life's end by as much; the
client's figures likewise over the whole run.

Prints one table and a verdict; ``--json`` adds a JSON object (the last line). Exit 1 on wrong
KV, a failed request, growth, or no eviction/reclaim.

    bench/soak/soak.py --seconds 1800 --restart-every 300       # the documented 30-minute run
    bench/soak/soak.py --seconds 175 --restart-every 50         # scripts/test's 3-minute run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

import gdkv

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from gdkvd_proc import Gdkvd  # noqa: E402

MiB = 1 << 20


# ---- resources ---------------------------------------------------------------------------------
def resources(pid: int) -> dict[str, int]:
    """Private resident bytes (RssAnon: the process's own heap, where a leak shows), shared
    resident bytes (RssShmem: the clients' memfd pages gdkvd maps, which follow how much of its
    shared memory a client touches), open descriptors, memfds among them, and bytes mapped from
    memfds."""
    rss = shm = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("RssShmem:"):
                shm = int(line.split()[1]) * 1024
    fds = memfds = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        fds += 1
        try:
            memfds += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:")
        except OSError:   # closed while listed
            pass
    mapped = 0
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/memfd:"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                mapped += hi - lo
    return {"rss": rss, "rss_shmem": shm, "fds": fds, "memfds": memfds, "memfd_mapped": mapped}


# ---- the daemon --------------------------------------------------------------------------------
def start_gdkvd(a: argparse.Namespace, work: Path) -> Gdkvd:
    """gdkvd on the local store in `work`, restartable on the same store and socket directory."""
    return Gdkvd("--backend", "local", "--store", str(work / "store"),
                 "--capacity", str(a.capacity_mib * MiB), "--cache-bytes", str(a.cache_mib * MiB),
                 "--reactors", "1", *a.gdkvd_arg, metrics=True, prefix="gdkv-soak-",
                 config=f"[backend]\nsegment_bytes = {a.segment_mib * MiB}\n")  # no flag for it


# ---- the workload ------------------------------------------------------------------------------
class WrongKV(Exception):
    """A value read back is not the one stored under its key (the user stops; the soak fails)."""


class Counters:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.turns = self.retried = self.failed = self.wrong = 0
        self.blocks_loaded = self.blocks_stored = self.raced = 0
        # Turn latencies in 2 % wide buckets from 10 us: constant memory (a list of every turn's
        # float grew the client by 8 MiB over 30 minutes, which is the soak's own growth).
        self.buckets = [0] * 1200

    def add(self, **kw: float) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def latency(self, s: float) -> None:
        i = int(math.log(max(s, 1e-5) / 1e-5) / math.log(1.02))
        with self.lock:
            self.buckets[min(i, len(self.buckets) - 1)] += 1

    def percentile(self, p: float) -> float:
        """The upper edge of the bucket holding the p-th percentile turn (seconds)."""
        want, seen = p / 100 * sum(self.buckets), 0
        for i, n in enumerate(self.buckets):
            seen += n
            if n and seen >= want:
                return 1e-5 * 1.02 ** (i + 1)
        return 0.0


def value_of(key: bytes, block_bytes: int) -> np.ndarray:
    """A block's value: its key repeated (a value under the wrong key, or a changed byte, shows)."""
    reps = -(-block_bytes // len(key))
    return np.frombuffer((key * reps)[:block_bytes], np.uint8)


class User(threading.Thread):
    def __init__(self, uid: int, args: argparse.Namespace, daemon: Gdkvd, counters: Counters,
                 stop: threading.Event, up: threading.Event):
        super().__init__(name=f"user-{uid}", daemon=True)
        self.uid, self.args, self.gdkvd, self.counters = uid, args, daemon, counters
        self.stop_event, self.up = stop, up
        self.rng = np.random.default_rng(1000 + uid)
        self.error: Optional[str] = None

    def connect(self) -> gdkv.Client:
        while not self.stop_event.is_set():
            self.up.wait(1.0)
            try:
                return gdkv.connect(self.gdkvd.dir, shared_memory_bytes=self.args.shm_mib * MiB)
            except gdkv.Error:
                time.sleep(0.05)   # restarting: not listening yet
        raise InterruptedError

    def reconnect(self) -> None:
        """A new connection and its buffers. The old buffers go first: memory from empty()
        keeps its connection open until it is freed, so holding them while connecting would
        make gdkvd hold two connections (and their shared memory) for a while."""
        self.outs = None
        if self.c is not None:
            try:
                self.c.close()
            except gdkv.Error:
                pass
            self.c = None
        self.c = self.connect()
        self.outs = self.c.empty((self.args.max_blocks, self.args.block_bytes), "uint8")

    def run(self) -> None:
        a, tpb = self.args, self.args.tokens_per_block
        self.c: Optional[gdkv.Client] = None
        self.outs = None
        try:
            self.reconnect()
            conversation = turns = 0
            while not self.stop_event.is_set():
                # A conversation: a new document, a few turns over its growing history.
                history = list(self.rng.integers(0, 32000, a.doc_blocks * tpb))
                salt = f"soak-{self.uid}-{conversation}"
                conversation += 1
                for turn in range(a.turns):
                    if self.stop_event.is_set():
                        break
                    history += list(self.rng.integers(0, 32000, a.question_tokens))
                    keys = gdkv.chain_keys(history, tpb, salt=salt)[:a.max_blocks]
                    self.turn(keys)
                    history += list(self.rng.integers(0, 32000, a.answer_tokens))
                    self.stop_event.wait(a.think_ms / 1e3)
                    turns += 1
                    if turns % a.reconnect_every == 0:
                        self.reconnect()
            self.outs = None
            self.c.close()
        except InterruptedError:
            pass
        except Exception as e:   # noqa: BLE001 - reported by the main thread
            self.error = f"{type(e).__name__}: {e}"
            self.stop_event.set()

    def turn(self, keys: list[bytes]) -> None:
        """One request, retried on a new connection while gdkvd restarts."""
        for attempt in range(1000):
            try:
                t0 = time.perf_counter()
                self.serve(self.c, self.outs, keys)
                self.counters.add(turns=1, retried=attempt > 0)
                self.counters.latency(time.perf_counter() - t0)
                return
            except (gdkv.ConnectionError, gdkv.TimeoutError, gdkv.ClosedError) as e:
                # gdkvd went away (killed for the soak): a new connection once it is back.
                if self.stop_event.is_set():
                    raise InterruptedError from e
                self.reconnect()
        self.counters.add(failed=1)

    def serve(self, c: gdkv.Client, outs, keys: list[bytes]) -> None:
        bb = self.args.block_bytes
        n = c.lookup_prefix(keys)
        loaded = n
        if n:
            got = c.get_many_into(keys[:n], list(outs[:n]))
            loaded = next((i for i, g in enumerate(got) if g != bb), n)
            if loaded < n:
                miss = got[loaded]
                if isinstance(miss, int):
                    self.counters.add(wrong=1)
                    raise WrongKV(f"{miss} bytes under key {keys[loaded].hex()}")
                if not isinstance(miss, gdkv.KeyNotFoundError):
                    raise miss
                # Evicted between the lookup and the read: the run still held is what counts.
                self.counters.add(raced=1)
            for k, out in zip(keys[:loaded], outs[:loaded]):
                if not np.array_equal(out, value_of(k, bb)):
                    self.counters.add(wrong=1)
                    raise WrongKV(f"the value under key {k.hex()}")
        gdkv.raise_first(c.put_many((k, value_of(k, bb)) for k in keys[loaded:]))
        self.counters.add(blocks_loaded=loaded, blocks_stored=len(keys) - loaded)


# ---- the verdict -------------------------------------------------------------------------------
def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def growth(samples: list[dict], key: str) -> tuple[float, float]:
    """(median of the first fifth, median of the last fifth) of the samples' `key`; a fifth is
    at least three samples, so one sample taken mid-reconnect is not growth."""
    k = max(3, len(samples) // 5)
    return med([s[key] for s in samples[:k]]), med([s[key] for s in samples[-k:]])


def allowed(key: str, base: float, shm: int) -> float:
    if key == "rss":
        return base * 1.10 + 16 * MiB
    if key in ("memfd_mapped", "rss_shmem"):
        return base + shm
    return base + 2


def verdict(samples: list[dict], lives: int, warmup: float, shm: int) -> tuple[list[str], list[str]]:
    """Report lines and failures."""
    lines, failures = [], []
    keys = ("rss", "rss_shmem", "fds", "memfds", "memfd_mapped")
    ends: list[dict] = []
    for life in range(lives):
        ss = [s for s in samples if s["life"] == life and s["since_start"] >= warmup]
        ss = [{k: s["gdkvd"][k] for k in keys} for s in ss]
        if len(ss) < 5:
            lines.append(f"  life {life}: {len(ss)} samples after warm-up (too short to judge)")
            continue
        lines.append(f"  gdkvd life {life}: " + judge(ss, keys, shm, f"gdkvd life {life}",
                                                        failures))
        ends.append({k: growth(ss, k)[1] for k in keys})
    for i, e in enumerate(ends[1:], 1):
        for k in keys:
            if e[k] > allowed(k, ends[0][k], shm):
                failures.append(f"gdkvd: {k} at a later life's end {fmt(k, e[k])} > first "
                                f"{fmt(k, ends[0][k])}")
    cs = [{k: s["client"][k] for k in keys} for s in samples if s["t"] >= warmup]
    if len(cs) >= 5:
        lines.append("  client: " + judge(cs, keys, shm, "client", failures))
    return lines, failures


def judge(samples: list[dict], keys: tuple[str, ...], shm: int, who: str,
          failures: list[str]) -> str:
    """One report row: each resource's first and last fifth; growth past allowed() fails."""
    row = []
    for k in keys:
        a, b = growth(samples, k)
        row.append(f"{k} {fmt(k, a)} -> {fmt(k, b)}")
        if b > allowed(k, a, shm):
            failures.append(f"{who}: {k} grew {fmt(k, a)} -> {fmt(k, b)}")
    return ", ".join(row)


def fmt(key: str, v: float) -> str:
    return f"{v / MiB:.1f} MiB" if key in ("rss", "rss_shmem", "memfd_mapped") else f"{v:.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=1800)
    ap.add_argument("--restart-every", type=float, default=300, help="seconds per gdkvd life")
    ap.add_argument("--sample-every", type=float, default=2.0)
    ap.add_argument("--warmup", type=float, default=20.0, help="seconds of each life not judged")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--doc-blocks", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--question-tokens", type=int, default=100)
    ap.add_argument("--answer-tokens", type=int, default=60)
    ap.add_argument("--tokens-per-block", type=int, default=64)
    ap.add_argument("--max-blocks", type=int, default=24)
    ap.add_argument("--block-bytes", type=int, default=256 << 10)
    ap.add_argument("--think-ms", type=float, default=20.0, help="a user's pause between turns")
    ap.add_argument("--reconnect-every", type=int, default=25, help="turns between a user's "
                    "reconnects")
    ap.add_argument("--capacity-mib", type=int, default=96, help="the local store's capacity")
    ap.add_argument("--segment-mib", type=int, default=8)
    ap.add_argument("--cache-mib", type=int, default=16, help="gdkvd's host cache")
    ap.add_argument("--shm-mib", type=int, default=32, help="each connection's shared memory")
    ap.add_argument("--gdkvd-arg", action="append", default=[], metavar="ARG",
                    help="one more gdkvd argument (repeat: --gdkvd-arg=--cache-policy "
                    "--gdkvd-arg=lru)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="gdkv-soak-"))
    d = start_gdkvd(a, work)
    counters, stop, up = Counters(), threading.Event(), threading.Event()
    up.set()
    users = [User(u, a, d, counters, stop, up) for u in range(a.users)]
    for u in users:
        u.start()
    samples: list[dict] = []
    reclaimed = evictions = 0.0
    t0 = life_t0 = time.monotonic()
    next_sample, kills = t0, 0
    try:
        while time.monotonic() - t0 < a.seconds and not stop.is_set():
            now = time.monotonic()
            if now - life_t0 >= a.restart_every:
                m = d.metrics()
                reclaimed += m.get("gdkv_local_segments_reclaimed_total", 0)
                evictions += m.get("gdkv_cache_evictions_total", 0)
                up.clear()
                d.kill(signal.SIGKILL if kills % 2 == 0 else signal.SIGTERM)
                kills += 1
                d.start()
                up.set()
                life_t0 = time.monotonic()
                continue
            if now >= next_sample:
                samples.append({"t": now - t0, "life": d.starts - 1, "since_start": now - life_t0,
                                "gdkvd": resources(d.pid), "client": resources(os.getpid())})
                next_sample += a.sample_every
            time.sleep(0.05)
        m = d.metrics()
        reclaimed += m.get("gdkv_local_segments_reclaimed_total", 0)
        evictions += m.get("gdkv_cache_evictions_total", 0)
    finally:
        stop.set()
        up.set()
        for u in users:
            u.join(30)
        d.stop()
    errors = [f"{u.name}: {u.error}" for u in users if u.error]
    lines, failures = verdict(samples, d.starts, a.warmup, a.shm_mib * MiB)
    failures += errors
    if counters.wrong:
        failures.append(f"{counters.wrong} wrong values")
    if counters.failed:
        failures.append(f"{counters.failed} failed requests")
    if reclaimed == 0:
        failures.append("the local store reclaimed no segment: the working set did not outgrow it")
    if evictions == 0:
        failures.append("the host cache evicted nothing")
    elapsed = time.monotonic() - t0
    print(f"soak: {elapsed:.0f} s, {d.starts} gdkvd lives ({kills} kills), {counters.turns} turns "
          f"({counters.turns / elapsed:.1f}/s), {counters.retried} retried after a restart, "
          f"{counters.failed} failed, {counters.wrong} wrong values; blocks loaded "
          f"{counters.blocks_loaded}, stored {counters.blocks_stored}, {counters.raced} "
          f"evicted between lookup and read; segments reclaimed {reclaimed:.0f}, cache "
          f"evictions {evictions:.0f}; turn p50 {counters.percentile(50) * 1e3:.1f} ms, p99 "
          f"{counters.percentile(99) * 1e3:.1f} ms")
    for line in lines:
        print(line)
    print("soak: " + ("OK: flat, no wrong value, no failed request" if not failures else
                      "FAILED: " + "; ".join(failures)))
    if a.json:
        print(json.dumps({"seconds": elapsed, "lives": d.starts, "turns": counters.turns,
                          "retried": counters.retried, "failed": counters.failed,
                          "wrong": counters.wrong, "blocks_loaded": counters.blocks_loaded,
                          "blocks_stored": counters.blocks_stored, "reclaimed": reclaimed,
                          "evictions": evictions, "failures": failures, "samples": samples}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
