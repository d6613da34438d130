#!/usr/bin/env python3
"""gdkv against Mooncake Store, side by side in one run, every figure a ratio of a memcpy.

Three stores, each with its zero-copy calls and its plain ones, for 4 KiB and 2 MiB values at
batch 1 and batch 64:

- ``gdkvd``: a gdkvd this script starts (memory backend, ``--cache-bytes 0``: the values live in
  the daemon), reached over vfio-user. Zero copy: ``put_many``/``get_many_into`` of
  ``client.empty()`` buffers (memory shared with gdkvd); plain: numpy buffers (the package stages
  them through shared memory, one copy each way) and ``get_many`` (bytes). Also ``get_view`` /
  ``get_many_view``: read-only views of the shared memory the values landed in (no copy).
- ``in-process``: ``gdkv.open("memory")``, the controller in this process (any buffer in place).
- ``mooncake``: Mooncake Store (PyPI ``mooncake-transfer-engine-non-cuda``) with its master and a
  storage client (``mooncake_client``, holding the memory segment) this script starts on
  127.0.0.1 over TCP, as its docs deploy it; this process is a client with no segment of its own.
  Zero copy: ``register_buffer`` + ``batch_put_from``/``batch_get_into`` (``put_from``/``get_into``
  at batch 1); plain: ``put``/``get`` (bytes).

Puts write NEW keys by default, as an inference engine's KV-cache blocks arrive: every put call
names keys never written before, and the keys written two calls earlier are deleted, untimed, so
each store's working set stays bounded (the store's first-touch cost of fresh value memory is
measured, not hidden). ``--rewrite`` puts the same 64 keys again and again instead (Mooncake's
keys are then removed before each put, untimed: it refuses a put to an existing key). Gets read 64
keys written before the get figures.

Every value read back is compared with what was written (untimed), and after each put figure the
last call's keys are read back and compared too. The reference is a numpy copy of the same bytes
into buffers allocated once and reused (memory already faulted in, as a store's prepared value
memory is), measured between the stores' runs (the median of those is the denominator), so a
busy machine moves the ratios less than the raw GB/s.

Usage: peer_bench.py [--seconds 1.0] [--rounds 3] [--rewrite] [--json]
       (scripts/bench-peers runs it in the project's environment; needs build/release)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

import gdkv

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gdkvd_proc import gdkvd  # noqa: E402

SIZES = {"4KiB": 4 << 10, "2MiB": 2 << 20}
BATCHES = (1, 64)
KEYS = 64          # keys the gets read, per size: 64 x 2 MiB = 128 MiB per store
FIGURES = ("put_zero_copy", "put_plain", "get_plain", "get_zero_copy")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def values(size: int) -> list[np.ndarray]:
    rng = np.random.default_rng(size)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(KEYS)]


def rate(fn: Callable[[], tuple[int, float]], seconds: float) -> float:
    """Bytes per second of ``fn``, run for ``seconds``: it returns the bytes it moved and the
    seconds its store calls took (checking the values read is not timed)."""
    fn()   # warm: first-touch of buffers, connections
    moved, spent, t0 = 0, 0.0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        n, dt = fn()
        moved += n
        spent += dt
    return moved / spent


class timed:
    """``with timed() as t: ...`` then ``t.s``: the block's seconds."""

    def __enter__(self) -> "timed":
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.s = time.perf_counter() - self.t0


def groups(batch: int) -> Callable[[], list[int]]:
    """Each call: the next ``batch`` key indices, cycling through the KEYS keys."""
    state = {"at": 0}

    def group() -> list[int]:
        at = state["at"]
        state["at"] = (at + batch) % (KEYS - KEYS % batch or KEYS)
        return list(range(at, at + batch))

    return group


class PutKeys:
    """The names each put call writes: ``batch`` new ones per call (``rewrite``: the next
    ``batch`` of a fixed set of KEYS), and the names written two calls before, for the caller to
    delete untimed. ``last`` is the latest call's names."""

    def __init__(self, prefix: str, batch: int, rewrite: bool):
        self.prefix, self.batch, self.rewrite = prefix, batch, rewrite
        self.made = 0
        self.live: list[list[str]] = []
        self.group = groups(batch)
        self.last: list[str] = []

    def next(self) -> tuple[list[str], list[str]]:
        if self.rewrite:
            self.last = [f"{self.prefix}w{i}" for i in self.group()]
            return self.last, []
        self.last = [f"{self.prefix}n{self.made + j:x}" for j in range(self.batch)]
        self.made += self.batch
        self.live.append(self.last)
        return self.last, self.live.pop(0) if len(self.live) > 2 else []

    def written(self) -> list[str]:
        """Every name still stored (for the clean-up)."""
        if self.rewrite:
            return [f"{self.prefix}w{i}" for i in range(KEYS)]
        return [k for names in self.live for k in names]


def memcpy_rate(size: int, batch: int, seconds: float) -> float:
    """A numpy copy of ``batch`` values into ``batch`` buffers allocated once (prepared memory,
    like a store's value memory), cycling through KEYS sources as the stores cycle through their
    keys (the same working set: 128 MiB at 2 MiB, not one value that stays in the CPU cache)."""
    src = values(size)
    dst = [np.empty(size, np.uint8) for _ in range(batch)]
    group = groups(batch)

    def once() -> tuple[int, float]:
        idx = group()
        with timed() as t:
            for j, i in enumerate(idx):
                np.copyto(dst[j], src[i])
        return size * batch, t.s

    return rate(once, seconds)


class Check:
    """Verifies every value read: the value for key i is vals[i]."""

    def __init__(self, vals: list[np.ndarray]):
        self.vals = vals

    def same(self, i: int, got) -> None:
        arr = np.frombuffer(got, np.uint8) if isinstance(got, (bytes, bytearray, memoryview)) \
            else got
        if arr is None or not np.array_equal(arr, self.vals[i]):
            raise SystemExit(f"peer_bench: value {i} read back wrong")


# ---- gdkv (gdkvd or in-process) ----
def gdkv_figures(c: gdkv.Client, size: int, batch: int, seconds: float,
                 rewrite: bool) -> dict[str, float]:
    vals = values(size)
    check = Check(vals)
    keys = [f"peer-{size}-{i}".encode() for i in range(KEYS)]   # what the gets read
    shared = [c.empty(size, np.uint8) for _ in range(batch)]   # in place through gdkvd
    outs = [c.empty(size, np.uint8) for _ in range(batch)]
    for s, v in zip(shared, vals):
        s[:] = v
    gdkv.raise_first(c.put_many(zip(keys, vals)))
    group = groups(batch)
    names = PutKeys(f"p{size:x}", batch, rewrite)

    def put(sources) -> Callable[[], tuple[int, float]]:
        def once() -> tuple[int, float]:
            ks, old = names.next()
            if old:
                gdkv.raise_first(c.delete_many([k.encode() for k in old], missing_ok=True))
            items = [(k.encode(), src) for k, src in zip(ks, sources)]
            with timed() as t:
                res = c.put_many(items) if batch > 1 else [c.put(*items[0])]
            gdkv.raise_first(res)
            return size * batch, t.s
        return once

    def stored_right() -> None:   # the last put call's keys hold vals[0..batch)
        for j, k in enumerate(names.last):
            check.same(j, c.get(k.encode(), size_hint=size))

    def get_zero_copy() -> tuple[int, float]:
        idx = group()
        ks = [keys[i] for i in idx]
        with timed() as t:
            got = c.get_many_into(ks, outs) if batch > 1 else [c.get_into(ks[0], outs[0])]
        assert got == [size] * batch
        for j, i in enumerate(idx):
            check.same(i, outs[j])
        return size * batch, t.s

    def get_plain() -> tuple[int, float]:
        idx = group()
        ks = [keys[i] for i in idx]
        with timed() as t:
            got = c.get_many(ks) if batch > 1 else [c.get(ks[0])]
        for j, i in enumerate(idx):
            check.same(i, got[j])
        return size * batch, t.s

    def get_view() -> tuple[int, float]:
        idx = group()
        ks = [keys[i] for i in idx]
        with timed() as t:
            got = c.get_many_view(ks) if batch > 1 else [c.get_view(ks[0])]
        for j, i in enumerate(idx):
            check.same(i, got[j])
            got[j].release()
        return size * batch, t.s

    out = {"put_zero_copy": rate(put(shared), seconds)}
    stored_right()
    out["put_plain"] = rate(put(vals[:batch]), seconds)
    stored_right()
    out["get_plain"] = rate(get_plain, seconds)
    out["get_zero_copy"] = rate(get_zero_copy, seconds)
    out["get_view"] = rate(get_view, seconds)
    gdkv.raise_first(c.delete_many(keys + [k.encode() for k in names.written()], missing_ok=True))
    return out


# ---- Mooncake Store ----
@contextlib.contextmanager
def mooncake_cluster() -> Iterator[tuple[str, str]]:
    """Mooncake's master (with its HTTP metadata server) and one storage client holding a 1 GiB
    segment, on 127.0.0.1: yields (master address, metadata URL)."""
    import mooncake

    bin_dir = Path(mooncake.__file__).parent
    rpc, meta, metrics, client_port = free_port(), free_port(), free_port(), free_port()
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    logs = Path(tempfile.mkdtemp(prefix="mooncake-bench-"))
    master_addr, meta_url = f"127.0.0.1:{rpc}", f"http://127.0.0.1:{meta}/metadata"
    procs = []
    try:
        procs.append(subprocess.Popen(
            [str(bin_dir / "mooncake_master"), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={meta}", f"--metrics_port={metrics}"],
            stdout=open(logs / "master.log", "wb"), stderr=subprocess.STDOUT, env=env))
        wait_port(rpc, procs[-1], logs / "master.log")
        procs.append(subprocess.Popen(
            [str(bin_dir / "mooncake_client"), "--host=127.0.0.1", f"--port={client_port}",
             f"--master_server_address={master_addr}", f"--metadata_server={meta_url}",
             "--global_segment_size=1GB", "--local_buffer_size=64MB", "--protocol=tcp"],
            stdout=open(logs / "client.log", "wb"), stderr=subprocess.STDOUT, env=env))
        wait_port(client_port, procs[-1], logs / "client.log")
        os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
        yield master_addr, meta_url
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def wait_port(port: int, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"peer_bench: {proc.args[0]} exited: {log.read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise SystemExit(f"peer_bench: {proc.args[0]} did not listen on {port}")


def mooncake_store(master: str, meta: str):
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", meta, 0, 256 << 20, "tcp", "", master)
    if rc != 0:
        raise SystemExit(f"peer_bench: Mooncake setup returned {rc}")
    return s


def mooncake_figures(s, size: int, batch: int, seconds: float,
                     rewrite: bool) -> dict[str, float]:
    vals = values(size)
    check = Check(vals)
    keys = [f"peer-{size}-{i}" for i in range(KEYS)]   # what the gets read
    # Registered memory for the zero-copy calls: one block for the sources, one for the reads.
    src = np.empty((batch, size), np.uint8)
    dst = np.empty((batch, size), np.uint8)
    for buf in (src, dst):
        if s.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
            raise SystemExit("peer_bench: Mooncake register_buffer failed")
    src[:] = vals[:batch]
    for k, v in zip(keys, vals):
        if s.put(k, v.tobytes()) != 0:
            raise SystemExit("peer_bench: Mooncake put failed")
    ptr_s = [src.ctypes.data + j * size for j in range(batch)]
    ptr_d = [dst.ctypes.data + j * size for j in range(batch)]

    group = groups(batch)
    names = PutKeys(f"p{size:x}", batch, rewrite)

    def ok(rcs, want) -> None:
        if any(r != want for r in rcs):
            raise SystemExit(f"peer_bench: Mooncake returned {rcs[:4]}")

    def next_names() -> list[str]:
        ks, old = names.next()
        # Untimed: the keys two calls old go (new keys), or the ones about to be written
        # (rewrite: Mooncake refuses a put to an existing key, where gdkv replaces).
        gone = ks if rewrite else old
        if gone:
            s.batch_remove(gone, True)
        return ks

    def put_zero_copy() -> tuple[int, float]:
        ks = next_names()
        with timed() as t:
            rcs = s.batch_put_from(ks, ptr_s, [size] * batch) if batch > 1 else \
                [s.put_from(ks[0], ptr_s[0], size)]
        ok(rcs, 0)
        return size * batch, t.s

    def put_plain() -> tuple[int, float]:
        ks = next_names()
        blobs = vals[:batch]   # put takes any buffer: the arrays themselves
        with timed() as t:
            rcs = [s.put(k, b) for k, b in zip(ks, blobs)]
        ok(rcs, 0)
        return size * batch, t.s

    def stored_right() -> None:   # the last put call's keys hold vals[0..batch)
        for j, k in enumerate(names.last):
            check.same(j, s.get(k))

    def get_zero_copy() -> tuple[int, float]:
        idx = group()
        ks = [keys[i] for i in idx]
        with timed() as t:
            rcs = s.batch_get_into(ks, ptr_d, [size] * batch) if batch > 1 else \
                [s.get_into(ks[0], ptr_d[0], size)]
        ok(rcs, size)
        for j, i in enumerate(idx):
            check.same(i, dst[j])
        return size * batch, t.s

    def get_plain() -> tuple[int, float]:
        idx = group()
        ks = [keys[i] for i in idx]
        with timed() as t:
            got = [s.get(k) for k in ks]
        for j, i in enumerate(idx):
            check.same(i, got[j])
        return size * batch, t.s

    out = {"put_zero_copy": rate(put_zero_copy, seconds)}
    stored_right()
    out["put_plain"] = rate(put_plain, seconds)
    stored_right()
    out["get_plain"] = rate(get_plain, seconds)
    out["get_zero_copy"] = rate(get_zero_copy, seconds)
    s.batch_remove(keys + names.written(), True)
    for buf in (src, dst):
        s.unregister_buffer(buf.ctypes.data)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="per figure")
    ap.add_argument("--rounds", type=int, default=3, help="median of this many rounds")
    ap.add_argument("--rewrite", action="store_true",
                    help="puts rewrite the same 64 keys (default: every put writes new keys)")
    ap.add_argument("--json", action="store_true", help="print a JSON object at the end")
    a = ap.parse_args()
    rows: dict[str, dict] = {}
    with gdkvd("--backend", "memory", "--cache-bytes", "0", "--reactors", "1") as sock, \
            mooncake_cluster() as (master, meta):
        remote = gdkv.connect(sock, shared_memory_bytes=1 << 30)
        local = gdkv.open("memory")
        moon = mooncake_store(master, meta)
        stores = {"gdkvd": lambda sz, b: gdkv_figures(remote, sz, b, a.seconds, a.rewrite),
                  "in-process": lambda sz, b: gdkv_figures(local, sz, b, a.seconds, a.rewrite),
                  "mooncake": lambda sz, b: mooncake_figures(moon, sz, b, a.seconds, a.rewrite)}
        print(f"puts write {'the same 64 keys again' if a.rewrite else 'new keys'}", flush=True)
        for name, size in SIZES.items():
            for batch in BATCHES:
                refs, runs = [], {k: [] for k in stores}
                for _ in range(a.rounds):
                    for store, fn in stores.items():
                        refs.append(memcpy_rate(size, batch, a.seconds / 2))
                        runs[store].append(fn(size, batch))
                ref = statistics.median(refs)
                row = {"memcpy_gbps": ref / 1e9}
                for store, results in runs.items():
                    for fig in results[0]:
                        row[f"{store}.{fig}"] = statistics.median(r[fig] for r in results) / ref
                rows[f"{name} batch {batch}"] = row
                print(f"{name} batch {batch}: memcpy {ref / 1e9:.2f} GB/s; ratios of memcpy "
                      "(put zero-copy / plain, get bytes / zero-copy)", flush=True)
                for store in stores:
                    r = [row[f"{store}.{f}"] for f in FIGURES]
                    view = row.get(f"{store}.get_view")
                    print(f"  {store:<11} put {r[0]:.3f} / {r[1]:.3f}   get {r[2]:.3f} / "
                          f"{r[3]:.3f}" + (f"   get_view {view:.3f}" if view else ""),
                          flush=True)
                vs = [row[f"gdkvd.{f}"] / row[f"mooncake.{f}"] for f in FIGURES]
                print(f"  gdkvd / mooncake: put {vs[0]:.2f}x / {vs[1]:.2f}x   get {vs[2]:.2f}x / "
                      f"{vs[3]:.2f}x", flush=True)
        moon.close()
        remote.close()
        local.close()
    if a.json:
        print(json.dumps(rows, sort_keys=True))


if __name__ == "__main__":
    main()
