#!/usr/bin/env python3
"""A soak: a multi-turn chat workload's KV blocks through a real gdkvd for a long time, with the
daemon killed and restarted and every tier evicting, while its resources are watched.

Workload (what an engine in front of gdkv does, without the engine's compute): ``--users``
users, each with a private document of ``--doc-blocks`` blocks; every turn sends the whole
history (the document, every earlier question and answer) plus a new question. Per turn the
client derives the prompt's chained keys (``gdkv.chain_keys``), asks gdkv for the leading run it
holds (``lookup_prefix``), loads those blocks into memory shared with gdkvd (``get_many_into``)
and stores the blocks it had to "recompute" (``put_many``). A block's value is its key repeated to
``--block-bytes``, and before each read its buffer is filled with the complement of that value,
so every value read is checked against the key it was read under: a byte that differs, or a read
that reports success and leaves the buffer as it was, is wrong KV, counted and fatal to the run.
Users reconnect every ``--reconnect-every`` turns (an engine process restarting: connection churn,
shared memory mapped and unmapped).

gdkvd runs on the local store with a capacity below the working set (the store reclaims its
oldest segments) and a small host cache (it evicts); every ``--restart-every`` seconds it is
killed (SIGKILL and SIGTERM in turn) and started again on the same store and socket directory.
A turn that fails because the daemon went away is retried on a new connection once it is back;
a turn that still fails is a failed request.

Lost values (ledger.py): the soak reads gdkvd's ``/removed`` feed (gdkv.engine.RemovalFeed) every
quarter second and keeps every value gdkvd acknowledged and has not reported removed. A user that
finds such a value missing in a life, with no report of it in a read of the feed begun after, has
lost a value. At each restart the soak reads the feed once more, kills gdkvd, starts it and lists
its store before the users come back: an acknowledged value not reported and not listed is lost
when a value acknowledged before it was sent is still listed (the store reclaims oldest first),
or when more are gone than the store could have reclaimed after that last read; otherwise it is
counted as unknown. Any lost value fails the run.

Every ``--sample-every`` seconds the soak reads, from /proc, for gdkvd and for this process (the
client side): private RSS (the Anonymous bytes of every mapping in smaps, where a leak shows),
shared RSS (RssShmem: the clients' memory gdkvd maps), open file descriptors, memfds among them
and the bytes of memfd mappings. After ``--warmup`` seconds of each gdkvd life (of the run, for
the client) private RSS is judged by its least-squares slope against time, which may not pass
``--rss-slope-limit``: judged with every mapping whose address range is unchanged since the
first sample after warm-up counted at its size then (memory reserved before and touched since,
such as gdkvd's cache chain table, 52 MiB of calloc'd slots that fill in over the first minutes
of a life, is bounded by its mapping; a growing heap or arena, or a new mapping, is what a leak
makes); the plain slope is reported beside it. The other resources: the median of the last fifth
of a life's samples may exceed the median of its first fifth by 2 (descriptors, memfds) and one
connection's shared memory (shared RSS, mapped bytes); each life's end may exceed the first
judged life's end by as much, private RSS by 10 % + 16 MiB.

Prints one table and a verdict; ``--json`` adds a JSON object (the last line). Exit 1 on wrong
KV, a lost value, a failed request, growth, or no eviction/reclaim. ``--stop-on-failure`` ends the
run at its first failure. Two test hooks make it fail on purpose (python/tests/test_soak.py):
``--test-leak-bytes-per-s`` (gdkvd leaks that much) and ``--test-roll-back-store`` (the store file
goes back to an older copy between two lives).

    bench/soak/soak.py --seconds 1800 --restart-every 300       # the documented 30-minute run
    bench/soak/soak.py --seconds 175 --restart-every 50         # scripts/test's 3-minute run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
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
from gdkv.engine import RemovalFeed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gdkvd_proc import Gdkvd  # noqa: E402
from ledger import Ledger  # noqa: E402

MiB = 1 << 20
FEED_EVERY_S = 0.25   # how often gdkvd's /removed is read


# ---- resources ---------------------------------------------------------------------------------
def resources(pid: int, ref: Optional[dict[str, int]] = None
              ) -> tuple[dict[str, int], dict[str, int]]:
    """Private resident bytes (RssAnon: the process's own heap, where a leak shows), shared
    resident bytes (RssShmem: the clients' memfd pages gdkvd maps, which follow how much of its
    shared memory a client touches), open descriptors, memfds among them, and bytes mapped from
    memfds; and each mapping's private resident bytes, by address range (/proc/PID/smaps).

    ``rss_judged`` is the private RSS with each mapping that ``ref`` (an earlier sample's
    mappings) has at the same address range counted at its bytes then: memory reserved before
    and touched since (gdkvd's cache chain table is 52 MiB of calloc'd slots that new keys touch at
    random, so its pages fill in over a minute or two) does not count, while a heap or arena that
    grows, or a new mapping, does. Without ``ref`` it is the private RSS."""
    shm = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                shm = int(line.split()[1]) * 1024
    fds = memfds = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        fds += 1
        try:
            memfds += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:")
        except OSError:   # closed while listed
            pass
    mapped = 0
    anon: dict[str, int] = {}
    span = ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                anon[span] = int(line.split()[1]) * 1024
            elif line[0] in "0123456789abcdef":   # a mapping's first line: its range first
                parts = line.split(maxsplit=5)
                span = parts[0]
                if len(parts) == 6 and parts[5].startswith("/memfd:"):
                    lo, hi = (int(x, 16) for x in span.split("-"))
                    mapped += hi - lo
    rss = sum(anon.values())
    judged = rss if ref is None else sum(ref.get(k, v) for k, v in anon.items())
    return ({"rss": rss, "rss_judged": judged, "rss_shmem": shm, "fds": fds, "memfds": memfds,
             "memfd_mapped": mapped}, anon)


# ---- the daemon --------------------------------------------------------------------------------
def start_gdkvd(a: argparse.Namespace, work: Path) -> Gdkvd:
    """gdkvd on the local store in `work`, restartable on the same store and socket directory.
    --test-leak-bytes-per-s sets gdkvd's leak test hook in its environment (Gdkvd passes it no
    GDKVD_* variable of ours, so through `env`)."""
    wrap = ("env", f"GDKVD_TEST_LEAK_BYTES_PER_S={a.test_leak_bytes_per_s}") \
        if a.test_leak_bytes_per_s else ()
    return Gdkvd("--backend", "local", "--store", str(work / "store"),
                 "--capacity", str(a.capacity_mib * MiB), "--cache-bytes", str(a.cache_mib * MiB),
                 "--reactors", "1", *a.gdkvd_arg, metrics=True, prefix="gdkv-soak-", wrap=wrap,
                 config=f"[backend]\nsegment_bytes = {a.segment_mib * MiB}\n")  # no flag for it


class Feed(RemovalFeed):
    """gdkv's reader of gdkvd's /removed, which also says whether its last poll reached gdkvd
    (``failed``): RemovalFeed answers [] both for no removal and for a gdkvd it cannot reach."""

    def poll(self) -> Optional[list[bytes]]:
        self.failed = False
        return super().poll()

    def _get(self, after: Optional[int]) -> Optional[dict]:
        page = super()._get(after)
        self.failed = self.failed or page is None
        return page


def position(feed: Feed) -> None:
    """The feed's first poll of a gdkvd life: its position (a new boot's answer is None)."""
    for _ in range(50):
        feed.poll()
        if not feed.failed:
            return
        time.sleep(0.1)
    raise RuntimeError(f"gdkvd's feed at {feed.url} does not answer")


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


def poison(out: np.ndarray, key: bytes) -> None:
    """Fills a read's buffer with what the read of `key` must overwrite: the complement of the
    key's value, which differs from it in every byte (a read that reports success and writes
    nothing, or only part, fails the check; so does a stale buffer of another key's value or
    poison)."""
    np.bitwise_not(value_of(key, out.size), out=out)


def matches(out: np.ndarray, key: bytes) -> bool:
    return np.array_equal(out, value_of(key, out.size))


class User(threading.Thread):
    def __init__(self, uid: int, args: argparse.Namespace, daemon: Gdkvd, counters: Counters,
                 ledger: Ledger, stop: threading.Event, up: threading.Event):
        super().__init__(name=f"user-{uid}", daemon=True)
        self.uid, self.args, self.gdkvd, self.counters = uid, args, daemon, counters
        self.ledger = ledger
        self.stop_event, self.up = stop, up
        self.rng = np.random.default_rng(1000 + uid)
        self.error: Optional[str] = None

    def connect(self) -> gdkv.Client:
        """A connection once the main thread lets users in (not while it restarts gdkvd and
        lists its store)."""
        while not self.stop_event.is_set():
            if not self.up.wait(0.2):
                continue
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
        if n < len(keys):   # keys[n] is not held: the ledger judges it if it was stored
            self.ledger.missing(keys[n], time.monotonic())
        loaded = n
        if n:
            for k, out in zip(keys[:n], outs[:n]):
                poison(out, k)
            got = c.get_many_into(keys[:n], list(outs[:n]))
            loaded = next((i for i, g in enumerate(got) if g != bb), n)
            if loaded < n:
                miss = got[loaded]
                if isinstance(miss, int):
                    self.counters.add(wrong=1)
                    raise WrongKV(f"{miss} bytes under key {keys[loaded].hex()}")
                if not isinstance(miss, gdkv.KeyNotFoundError):
                    raise miss
                # Gone between the lookup and the read: the run still held is what counts.
                self.ledger.missing(keys[loaded], time.monotonic())
                self.counters.add(raced=1)
            for k, out in zip(keys[:loaded], outs[:loaded]):
                if not matches(out, k):
                    self.counters.add(wrong=1)
                    raise WrongKV(f"the value under key {k.hex()}")
        todo = keys[loaded:]
        nbytes, sent = len(todo) * bb, time.monotonic()
        self.ledger.sending(todo, nbytes, sent)
        try:
            results = c.put_many((k, value_of(k, bb)) for k in todo)
        except BaseException:
            self.ledger.unanswered(nbytes)
            raise
        self.ledger.stored([k for k, r in zip(todo, results) if r is None], nbytes, sent,
                           time.monotonic())
        gdkv.raise_first(results)
        self.counters.add(blocks_loaded=loaded, blocks_stored=len(todo))


# ---- the verdict -------------------------------------------------------------------------------
KEYS = ("rss", "rss_shmem", "fds", "memfds", "memfd_mapped")


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def growth(samples: list[dict], key: str) -> tuple[float, float]:
    """(median of the first fifth, median of the last fifth) of the samples' `key`; a fifth is
    at least three samples, so one sample taken mid-reconnect is not growth."""
    k = max(3, len(samples) // 5)
    return med([s[key] for s in samples[:k]]), med([s[key] for s in samples[-k:]])


def slope(ts: list[float], ys: list[float]) -> float:
    """The least-squares slope of ys against ts."""
    tm, ym = statistics.fmean(ts), statistics.fmean(ys)
    return sum((t - tm) * (y - ym) for t, y in zip(ts, ys)) / sum((t - tm) ** 2 for t in ts)


def allowed(key: str, base: float, shm: int) -> float:
    """What a level may reach from `base`: private RSS 10 % + 16 MiB (lives against the first
    life), shared memory one connection's, descriptors and memfds 2."""
    if key == "rss":
        return base * 1.10 + 16 * MiB
    if key in ("memfd_mapped", "rss_shmem"):
        return base + shm
    return base + 2


def judge(samples: list[dict], times: list[float], shm: int, limit: float, who: str,
          failures: list[str]) -> tuple[str, float, float]:
    """One report row, the judged private RSS slope and the plain one (MiB/s) of a process's
    samples after warm-up. The judged slope past `limit` fails, and so does any other resource
    that grew (first fifth against last fifth) past allowed()."""
    rate = slope(times, [s["rss_judged"] / MiB for s in samples])
    raw = slope(times, [s["rss"] / MiB for s in samples])
    row = [f"rss {fmt('rss', samples[0]['rss'])} -> {fmt('rss', samples[-1]['rss'])} "
           f"({raw:+.3f} MiB/s; judged {rate:+.3f} MiB/s over {len(samples)} samples, "
           f"{times[0]:.0f}-{times[-1]:.0f} s)"]
    if rate > limit:
        failures.append(f"{who}: private RSS grew {rate:.3f} MiB/s after warm-up (limit {limit})")
    for k in KEYS[1:]:
        a, b = growth(samples, k)
        row.append(f"{k} {fmt(k, a)} -> {fmt(k, b)}")
        if b > allowed(k, a, shm):
            failures.append(f"{who}: {k} grew {fmt(k, a)} -> {fmt(k, b)}")
    return ", ".join(row), rate, raw


class Verdict:
    """Each gdkvd life judged when it ends, the client and the lives' ends against each other
    when the run ends."""

    def __init__(self, a: argparse.Namespace):
        self.a, self.shm = a, a.shm_mib * MiB
        self.lines: list[str] = []
        self.failures: list[str] = []
        self.ends: list[dict] = []          # each judged life's last fifth, per resource
        self.slopes: dict[int, float] = {}      # life -> judged private RSS slope (MiB/s)
        self.raw_slopes: dict[int, float] = {}  # life -> private RSS slope (MiB/s)

    def life(self, samples: list[dict], life: int) -> None:
        ss = [s for s in samples if s["life"] == life and s["since_start"] >= self.a.warmup]
        if len(ss) < 5:
            self.lines.append(f"  life {life}: {len(ss)} samples after warm-up (too short to "
                              "judge)")
            return
        gs = [s["gdkvd"] for s in ss]
        row, self.slopes[life], self.raw_slopes[life] = judge(
            gs, [s["since_start"] for s in ss], self.shm, self.a.rss_slope_limit,
            f"gdkvd life {life}", self.failures)
        self.lines.append(f"  gdkvd life {life}: {row}")
        end = {k: growth(gs, k)[1] for k in KEYS}
        if self.ends:
            for k in KEYS:
                if end[k] > allowed(k, self.ends[0][k], self.shm):
                    self.failures.append(f"gdkvd: {k} at life {life}'s end {fmt(k, end[k])} > "
                                         f"the first judged life's {fmt(k, self.ends[0][k])}")
        self.ends.append(end)

    def client(self, samples: list[dict]) -> None:
        ss = [s for s in samples if s["t"] >= self.a.warmup]
        if len(ss) >= 5:
            row, _, _ = judge([s["client"] for s in ss], [s["t"] for s in ss], self.shm,
                              self.a.rss_slope_limit, "client", self.failures)
            self.lines.append(f"  client: {row}")


def fmt(key: str, v: float) -> str:
    return f"{v / MiB:.1f} MiB" if key in ("rss", "rss_shmem", "memfd_mapped") else f"{v:.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=1800)
    ap.add_argument("--restart-every", type=float, default=300, help="seconds per gdkvd life")
    ap.add_argument("--sample-every", type=float, default=2.0)
    ap.add_argument("--warmup", type=float, default=20.0, help="seconds of each life not judged")
    ap.add_argument("--rss-slope-limit", type=float, default=0.25, help="MiB/s of private RSS "
                    "growth after warm-up (least squares over a life) that fails the run")
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
    ap.add_argument("--stop-on-failure", action="store_true", help="end the run at its first "
                    "failure (a life judged at its end, a restart checked, a wrong or lost value)")
    ap.add_argument("--test-leak-bytes-per-s", type=int, default=0, metavar="N",
                    help="test hook: gdkvd leaks N bytes a second (GDKVD_TEST_LEAK_BYTES_PER_S)")
    ap.add_argument("--test-roll-back-store", action="store_true",
                    help="test hook: at every second kill the store file is put back as it was at "
                    "the kill before (a disk that lost what it acknowledged since)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="gdkv-soak-"))
    store_file, snapshot = work / "store" / "store.gdkv", work / "store-at-last-kill.gdkv"
    d = start_gdkvd(a, work)
    feed = Feed(d.url("/removed"))
    position(feed)
    ledger = Ledger(a.segment_mib * MiB, a.block_bytes)
    verdict = Verdict(a)
    counters, stop, up = Counters(), threading.Event(), threading.Event()
    up.set()
    users = [User(u, a, d, counters, ledger, stop, up) for u in range(a.users)]
    for u in users:
        u.start()
    samples: list[dict] = []
    reclaimed = evictions = 0.0
    feed_gaps = 0
    g_ref: Optional[dict[str, int]] = None
    c_ref: Optional[dict[str, int]] = None
    t0 = life_t0 = time.monotonic()
    next_sample, next_read, kills = t0, t0, 0

    def read_feed() -> None:
        nonlocal feed_gaps
        ledger.reading(time.monotonic())
        keys = feed.poll()
        if keys is None:          # records dropped unread, or a gdkvd restarted behind our back
            feed_gaps += 1
            ledger.feed_gap()
        elif not feed.failed:     # unreachable: [] and the cursor kept, read again later
            ledger.removed(keys)

    def failing() -> bool:
        return bool(a.stop_on_failure and (verdict.failures or ledger.lost or feed_gaps))

    try:
        while time.monotonic() - t0 < a.seconds and not stop.is_set() and not failing():
            now = time.monotonic()
            if now - life_t0 >= a.restart_every:
                m = d.metrics()
                reclaimed += m.get("gdkv_local_segments_reclaimed_total", 0)
                evictions += m.get("gdkv_cache_evictions_total", 0)
                up.clear()
                read_feed()   # the last read of this life's feed: what comes after dies with it
                d.kill(signal.SIGKILL if kills % 2 == 0 else signal.SIGTERM)
                kills += 1
                verdict.life(samples, d.starts - 1)
                if failing():
                    break
                if a.test_roll_back_store:
                    if kills % 2 == 1:
                        shutil.copyfile(store_file, snapshot)
                    else:
                        shutil.copyfile(snapshot, work / "store" / "rolled-back")
                        os.replace(work / "store" / "rolled-back", store_file)
                d.start()
                # Position on the new life's feed, then list the store, before any user is back.
                positioned = time.monotonic()
                feed.url = d.url("/removed")   # the port is picked anew at every start
                position(feed)
                with gdkv.connect(d.dir) as c:
                    listed = set(c.list())
                ledger.restarted(d.starts - 2, listed, positioned)
                up.set()
                life_t0 = next_read = time.monotonic()
                g_ref = None
                continue
            if now >= next_read:
                read_feed()
                next_read = now + FEED_EVERY_S
            if now >= next_sample:
                # Each process's mappings at its first sample after warm-up are the reference of
                # its judged RSS (gdkvd's anew in each life).
                g, g_maps = resources(d.pid, g_ref)
                c, c_maps = resources(os.getpid(), c_ref)
                if g_ref is None and now - life_t0 >= a.warmup:
                    g_ref = g_maps
                if c_ref is None and now - t0 >= a.warmup:
                    c_ref = c_maps
                samples.append({"t": now - t0, "life": d.starts - 1, "since_start": now - life_t0,
                                "gdkvd": g, "client": c})
                next_sample += a.sample_every
            time.sleep(0.05)
        if d.proc is not None and d.proc.poll() is None:   # not stopped after a kill
            read_feed()
            m = d.metrics()
            reclaimed += m.get("gdkv_local_segments_reclaimed_total", 0)
            evictions += m.get("gdkv_cache_evictions_total", 0)
            verdict.life(samples, d.starts - 1)
    finally:
        stop.set()
        up.set()
        for u in users:
            u.join(30)
        d.stop()
        shutil.rmtree(work, ignore_errors=True)
    verdict.client(samples)
    failures = verdict.failures + [f"{u.name}: {u.error}" for u in users if u.error]
    if counters.wrong:
        failures.append(f"{counters.wrong} wrong values")
    if counters.failed:
        failures.append(f"{counters.failed} failed requests")
    if ledger.lost:
        key, why = ledger.lost[0]
        failures.append(f"{len(ledger.lost)} values lost (acknowledged, gone, not reported "
                        f"removed); the first, {key.hex()[:16]}...: {why}")
    if feed_gaps:
        failures.append(f"gdkvd's /removed said {feed_gaps} times that removals were missed: "
                        "lost values could not be told from removed ones")
    if not failing():
        if reclaimed == 0:
            failures.append("the local store reclaimed no segment: the working set did not "
                            "outgrow it")
        if evictions == 0:
            failures.append("the host cache evicted nothing")
    elapsed = time.monotonic() - t0
    print(f"soak: {elapsed:.0f} s, {d.starts} gdkvd lives ({kills} kills), {counters.turns} turns "
          f"({counters.turns / elapsed:.1f}/s), {counters.retried} retried after a restart, "
          f"{counters.failed} failed, {counters.wrong} wrong values; blocks loaded "
          f"{counters.blocks_loaded}, stored {counters.blocks_stored}, {counters.raced} "
          f"gone between lookup and read; segments reclaimed {reclaimed:.0f}, cache "
          f"evictions {evictions:.0f}; turn p50 {counters.percentile(50) * 1e3:.1f} ms, p99 "
          f"{counters.percentile(99) * 1e3:.1f} ms")
    print(f"  missing values: {ledger.explained} reported removed by gdkvd, {len(ledger.lost)} "
          f"lost, {ledger.unknown} unknown (found missing or gone at a restart after the last "
          "read of /removed before the kill)")
    for c in ledger.checks:
        print(f"  restart after life {c.life}: {c.expected} values held at the kill, "
              f"{len(c.lost)} lost, {len(c.unknown)} gone without a report (at most "
              f"{c.unknown_allowed} could have been reclaimed after the last read of /removed)")
    for line in verdict.lines:
        print(line)
    print("soak: " + ("OK: flat, no wrong or lost value, no failed request" if not failures else
                      "FAILED: " + "; ".join(failures)))
    if a.json:
        print(json.dumps({"seconds": elapsed, "lives": d.starts, "turns": counters.turns,
                          "retried": counters.retried, "failed": counters.failed,
                          "wrong": counters.wrong, "blocks_loaded": counters.blocks_loaded,
                          "blocks_stored": counters.blocks_stored, "reclaimed": reclaimed,
                          "evictions": evictions, "lost": len(ledger.lost),
                          "explained": ledger.explained, "unknown": ledger.unknown,
                          "restarts": [{"life": c.life, "expected": c.expected,
                                        "lost": len(c.lost), "unknown": len(c.unknown),
                                        "unknown_allowed": c.unknown_allowed}
                                       for c in ledger.checks],
                          "rss_slopes": verdict.slopes, "rss_raw_slopes": verdict.raw_slopes,
                          "failures": failures,
                          "samples": samples}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
