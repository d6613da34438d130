#!/usr/bin/env python3
"""LMCache over gdkv: looking up and loading a prompt's chunks, against memcpy of the same bytes.

An 8B-shaped model (32 layers, 8 KV heads of 128, bf16) in LMCache's default chunks of 256 tokens:
one chunk is LMCache's MemoryObj ``[2, 32, 256, 1024]`` bf16, 32 MiB. The script stores 64 such
chunks (2 GiB, a 16384-token prompt) through LMCache's own RemoteBackend with the gdkv plugin
(LMCacheEngineConfig with remote_storage_plugins, CreateStorageBackends, LMCache's allocator),
then times, in the same run:

- lookup: LMCache's batched contains of the 64-chunk prefix (``RemoteBackend.batched_contains``,
  one ``lookup_prefix``: back to back, and after 2 ms idle; and ``batched_async_contains``
  through LMCache's event loop);
- load: ``RemoteBackend.batched_get_blocking`` of the 64 chunks into new MemoryObjs from LMCache's
  allocator (one ``get_many_into``);
- memcpy: ``numpy.copyto`` of the same 64 chunks between MemoryObjs of the same allocator (one
  thread, like each of gdkv's copies);

and prints load / memcpy. Two stores: a gdkvd this script starts (``--backend memory``; LMCache's
memory is not shared with gdkvd, so each chunk is staged: one copy in the client, one in gdkvd)
and an in-process controller (``gdkv://?backend=memory``, zero copy in Python: the controller
copies from its memory backend into LMCache's buffer).

Usage: lmcache_bench.py [--chunks 64] [--rounds 5] [--modes gdkvd,in-process]
                        [--gdkvd build/release/tools/gdkvd/gdkvd] [--gdkvd-args '--reactors 1']
Memory: 3 x chunks x 32 MiB in LMCache's allocator (sources, loaded chunks, memcpy's
destinations), chunks x 32 MiB in gdkvd, 1 GiB in-process and gdkv's 1 GiB staging memory: about
10 GiB for 64 chunks. Prints one line per figure and a
JSON object at the end. In-process, gdkv.open's memory backend holds 1 GiB: 31 chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gdkvd_proc import gdkvd  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LAYERS, KV_HEADS, HEAD_DIM, CHUNK_TOKENS = 32, 8, 128, 256
MiB = 1 << 20
IN_PROCESS_MEMORY = 1 << 30  # the memory backend's capacity in gdkv.open (not configurable)


def timed(fn: Callable[[], Any], rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def run_mode(url: str, chunks: int, rounds: int, loop: asyncio.AbstractEventLoop) -> dict:
    import numpy as np
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend import CreateStorageBackends

    chunk_bytes = 2 * LAYERS * CHUNK_TOKENS * KV_HEADS * HEAD_DIM * 2
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_TOKENS, local_cpu=False,
        # sources, the loads' destinations and memcpy's, with room for the allocator's alignment
        max_local_cpu_size=(3 * chunks * chunk_bytes + 256 * MiB) / (1 << 30),
        remote_serde="naive", remote_storage_plugins=["gdkv"],
        extra_config={"remote_storage_plugin.gdkv.module_path": "gdkv.lmcache",
                      "remote_storage_plugin.gdkv.class_name": "GdkvConnectorAdapter",
                      "remote_storage_plugin.gdkv.url": url})
    md = LMCacheMetadata(model_name="bench/llama-8b-shape", world_size=1, local_world_size=1,
                         worker_id=0, local_worker_id=0, kv_dtype=torch.bfloat16,
                         kv_shape=(LAYERS, 2, CHUNK_TOKENS, KV_HEADS, HEAD_DIM),
                         chunk_size=CHUNK_TOKENS)
    backends = CreateStorageBackends(config, md, loop)
    try:
        cpu, rb = backends["LocalCPUBackend"], backends["RemoteBackend-gdkv"]
        conn = rb.connection.getWrappedConnector()
        assert conn.full_chunk_size_bytes == chunk_bytes
        keys = [CacheEngineKey(md.model_name, 1, 0, 0x9E3779B97F4A7C15 * (i + 1) % (1 << 63),
                               torch.bfloat16) for i in range(chunks)]
        # Distinct bytes in every chunk (random values for 2 GiB cost seconds on a small machine).
        src = []
        words = torch.arange(chunk_bytes // 8, dtype=torch.int64)
        for i in range(chunks):
            obj = cpu.allocate(md.get_shapes(), md.get_dtypes(), None)
            assert obj is not None, "LMCache's allocator is full"
            torch.mul(words, 0x9E3779B97F4A7C15 - (1 << 64) + 2 * i,
                      out=obj.raw_data[:chunk_bytes].view(torch.int64))
            src.append(obj)

        # Store through LMCache (its loop, our batched_put), waited for with its callback.
        done = threading.Semaphore(0)
        t0 = time.perf_counter()
        rb.batched_submit_put_task(keys, src, on_complete_callback=lambda k: done.release())
        for _ in keys:
            assert done.acquire(timeout=120), "puts did not finish"
        put_s = time.perf_counter() - t0
        client = conn.client()
        assert client is not None, "gdkv is unavailable"
        copies_after_put = client.copies()
        assert rb.batched_contains(keys) == chunks, "not every chunk was stored"

        # Lookup: many rounds, it is short.
        lookup = timed(lambda: rb.batched_contains(keys), 200)
        alookup = timed(lambda: asyncio.run_coroutine_threadsafe(
            rb.batched_async_contains("bench", keys), loop).result(), 200)

        # A lookup after 2 ms without commands, as a server's lookups arrive: through gdkvd a
        # reactor idle for idle_spin_us sleeps, and a client in another process cannot wake it
        # before its 5 ms timeout (docs/vfio-user.md; gdkvd --idle-spin-us / --never-sleep).
        def idle_lookup() -> None:
            time.sleep(0.002)
            t0 = time.perf_counter()
            rb.batched_contains(keys)
            idle_lookup.s.append(time.perf_counter() - t0)  # type: ignore[attr-defined]

        idle_lookup.s = []  # type: ignore[attr-defined]
        timed(idle_lookup, 40)

        # Load into new MemoryObjs; released between rounds (the allocator reuses the memory).
        def load() -> None:
            objs = rb.batched_get_blocking(keys)
            assert all(o is not None for o in objs), "a chunk was missed"
            load.last = objs  # type: ignore[attr-defined]

        def release(objs) -> None:
            for o in objs:
                o.ref_count_down()

        load()  # warm up: first touch of the destination memory
        ok = all(torch.equal(o.raw_data[:chunk_bytes], s.raw_data[:chunk_bytes])
                 for o, s in zip(load.last, src))  # type: ignore[attr-defined]
        assert ok, "a loaded chunk differs from the stored one"
        release(load.last)  # type: ignore[attr-defined]
        # memcpy of the same bytes between MemoryObjs of the same allocator.
        dst = [cpu.allocate(md.get_shapes(), md.get_dtypes(), None) for _ in range(chunks)]
        assert all(d is not None for d in dst)

        # numpy.copyto: one thread's memcpy, as each of gdkv's copies is (torch's copy_ splits a
        # large copy over its OpenMP threads, which on a small machine fight gdkv's reactor).
        pairs = [(d.raw_data[:chunk_bytes].numpy(), s.raw_data[:chunk_bytes].numpy())
                 for d, s in zip(dst, src)]

        def memcpy() -> None:
            for d, s in pairs:
                np.copyto(d, s)

        memcpy()  # warm up
        # Interleaved, so that both see the same machine (memory bandwidth varies on a VM).
        copies_before = client.copies()
        load_s, memcpy_s = [], []
        for _ in range(rounds):
            load_s += timed(load, 1)
            release(load.last)  # type: ignore[attr-defined]
            memcpy_s += timed(memcpy, 1)
        copies_load = client.copies()[0] - copies_before[0]
        release(dst)
        release(src)
        total = chunks * chunk_bytes
        best_load, best_memcpy = min(load_s), min(memcpy_s)
        return {
            "url": url, "remote": client.remote, "chunks": chunks, "chunk_bytes": chunk_bytes,
            "put_s": put_s, "put_gbps": total / put_s / 1e9,
            "put_staged_copies": copies_after_put[0],
            "lookup_us_median": statistics.median(lookup) * 1e6,
            "async_lookup_us_median": statistics.median(alookup) * 1e6,
            "idle_lookup_us_median": statistics.median(idle_lookup.s) * 1e6,  # type: ignore
            "load_s_best": best_load, "load_s_median": statistics.median(load_s),
            "load_gbps": total / best_load / 1e9,
            "load_staged_copies_per_round": copies_load / rounds,
            "memcpy_s_best": best_memcpy, "memcpy_s_median": statistics.median(memcpy_s),
            "memcpy_gbps": total / best_memcpy / 1e9,
            "load_over_memcpy": best_load / best_memcpy,
        }
    finally:
        for b in reversed(list(backends.values())):
            b.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--modes", default="gdkvd,in-process")
    ap.add_argument("--gdkvd", default=str(ROOT / "build" / "release" / "tools" / "gdkvd" /
                                           "gdkvd"))
    ap.add_argument("--gdkvd-args", default=None,
                    help="more gdkvd options (default: '--reactors 1' on a machine of 2 CPUs or "
                         "fewer, where gdkvd's default 2 reactors fight the client for the cores)")
    ap.add_argument("--verbose", action="store_true", help="keep LMCache's INFO logging")
    args = ap.parse_args()
    if not args.verbose:
        os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    import lmcache  # noqa: F401: after LMCACHE_LOG_LEVEL
    import torch

    if not args.verbose:
        for name in list(logging.root.manager.loggerDict):
            if name.startswith("lmcache"):
                logging.getLogger(name).setLevel(logging.ERROR)

    if args.gdkvd_args is None:
        args.gdkvd_args = "--reactors 1" if (os.cpu_count() or 1) <= 2 else ""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    chunk_bytes = 2 * LAYERS * CHUNK_TOKENS * KV_HEADS * HEAD_DIM * 2
    print(f"LMCache {lmcache.__version__ if hasattr(lmcache, '__version__') else '?'} with gdkv: "
          f"{args.chunks} chunks of {CHUNK_TOKENS} tokens, {LAYERS} layers x {KV_HEADS} KV heads "
          f"x {HEAD_DIM}, bf16 ({chunk_bytes // MiB} MiB a chunk, "
          f"{args.chunks * chunk_bytes / (1 << 30):.2f} GiB in all); torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs")
    results = {}
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        chunks = args.chunks
        if mode == "gdkvd":
            # gdkvd's memory backend sized for the chunks (its default is 1 GiB), no host cache
            # in front (it would hold a second copy of every value).
            config = (f"[backend]\nmemory_capacity_bytes = {chunks * chunk_bytes + 256 * MiB}\n"
                      "[cache]\nbytes = 0\n")
            with gdkvd("--backend", "memory", *args.gdkvd_args.split(), binary=args.gdkvd,
                       config=config) as sock:
                # A long command timeout: on a small machine a group of 32 MiB stores can take
                # seconds, and a timeout would drop the client (the chunks would be missing).
                url = f"gdkv://{sock}?timeout_ms=120000"
                r = run_mode(url, chunks, args.rounds, loop)
        elif mode == "in-process":
            # gdkv.open's memory backend holds 1 GiB (its capacity option sizes only the local
            # store): 31 chunks of 32 MiB.
            chunks = min(chunks, IN_PROCESS_MEMORY // chunk_bytes - 1)
            url = f"gdkv://?backend=memory&max_value_bytes={chunk_bytes}"
            r = run_mode(url, chunks, args.rounds, loop)
        else:
            raise SystemExit(f"unknown mode {mode!r} (gdkvd, in-process)")
        results[mode] = r
        where = f"gdkvd {args.gdkvd_args}".strip() if mode == "gdkvd" else "in-process"
        r["store"] = where
        print(f"  {where}: {url}, {r['chunks']} chunks")
        print(f"    store (LMCache batched put): {r['put_s'] * 1e3:.0f} ms, "
              f"{r['put_gbps']:.2f} GB/s, {r['put_staged_copies']} staged copies")
        print(f"    lookup of the {r['chunks']}-chunk prefix: {r['lookup_us_median']:.0f} us "
              f"(batched_contains back to back), {r['idle_lookup_us_median']:.0f} us (after 2 ms "
              f"idle), {r['async_lookup_us_median']:.0f} us (batched_async_contains through "
              f"LMCache's loop)")
        print(f"    load {r['chunks']} chunks into LMCache MemoryObjs: "
              f"{r['load_s_best'] * 1e3:.0f} ms best, {r['load_s_median'] * 1e3:.0f} ms median, "
              f"{r['load_gbps']:.2f} GB/s, {r['load_staged_copies_per_round']:.0f} staged "
              f"copies a round")
        print(f"    memcpy of the same bytes (numpy.copyto): {r['memcpy_s_best'] * 1e3:.0f} ms "
              f"best, {r['memcpy_s_median'] * 1e3:.0f} ms median, {r['memcpy_gbps']:.2f} GB/s")
        print(f"    load / memcpy (best of {args.rounds} interleaved rounds each): "
              f"{r['load_over_memcpy']:.2f}x")
    loop.call_soon_threadsafe(loop.stop)
    print(json.dumps({"bench": "lmcache", "model": {"layers": LAYERS, "kv_heads": KV_HEADS,
                                                    "head_dim": HEAD_DIM, "dtype": "bfloat16",
                                                    "chunk_tokens": CHUNK_TOKENS},
                      "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
