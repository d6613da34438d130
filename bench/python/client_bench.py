#!/usr/bin/env python3
"""The Python client against the C++ client in the same run.

- get_into of 4 KiB and 2 MiB values at queue depth 1 from Python (gdkv.open("memory")), against
  `gdkv bench --op get --qd 1` (the C++ client on the same in-process memory backend) run by this
  script right before: the ratio of the two, and the per-call cost Python adds at 4 KiB;
- get_many_into of 64 blocks (one submission round) against 64 get_into calls.

With --gdkvd, both clients go through a gdkvd this script starts (Python into client.empty()
memory, the CLI into its shared buffers).

Usage: client_bench.py [--gdkv build/release/tools/gdkv/gdkv] [--seconds 2] [--rounds 3] [--gdkvd]
Prints one line per figure and a JSON object at the end.

With --ratios (the write and staging goals): put and get GB/s of 4 KiB and 2 MiB values,
one call per value (batch 1) and put_many/get_many_into of 64 (batch 64), from shared memory
(client.empty()), from a numpy pool shared in place (client.register, as an engine's KV pool)
and from plain numpy buffers (staged), each as a ratio of a memcpy of the same
bytes measured in the same run, for gdkvd with its host cache, gdkvd --cache-bytes 0 and the
in-process memory backend. Every value read back is checked.

    client_bench.py --ratios [--gdkvd-binary build/h-write/tools/gdkvd/gdkvd] [--seconds 0.5]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import gdkv

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gdkvd_proc import gdkvd  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def cpp_ops(cli: str, size: int, seconds: float, sock: str | None) -> float:
    where = ["--connect", sock] if sock else ["--backend", "memory"]
    out = subprocess.run([cli, *where, "bench", "--op", "get", "--value-size",
                          str(size), "--qd", "1", "--threads", "1", "--keys", "64",
                          "--duration", str(seconds), "--json"],
                         check=True, stdout=subprocess.PIPE).stdout
    return json.loads(out.decode().strip().splitlines()[-1])["ops_per_s"]


def client(sock: str | None) -> gdkv.Client:
    return gdkv.connect(sock) if sock else gdkv.open("memory")


def py_ops(size: int, seconds: float, sock: str | None) -> float:
    with client(sock) as c:
        keys = [f"k{i}".encode() for i in range(64)]
        gdkv.raise_first(c.put_many((k, np.full(size, i, np.uint8)) for i, k in enumerate(keys)))
        out = c.empty(size, np.uint8)  # shared memory through gdkvd: zero copy
        get_into = c.get_into
        n, end = 0, time.perf_counter() + seconds
        t0 = time.perf_counter()
        while True:
            for k in keys:
                get_into(k, out)
            n += len(keys)
            if time.perf_counter() >= end:
                break
        return n / (time.perf_counter() - t0)


def batch_ratio(size: int, sock: str | None, rounds: int = 200) -> tuple[float, float]:
    """Seconds per 64-block get_many_into and per 64 get_into calls."""
    with client(sock) as c:
        keys = gdkv.chain_keys(range(64 * 16), 16, "bench")
        gdkv.raise_first(c.put_many((k, np.full(size, i % 251, np.uint8))
                                    for i, k in enumerate(keys)))
        outs = [c.empty(size, np.uint8) for _ in keys]
        t0 = time.perf_counter()
        for _ in range(rounds):
            gdkv.raise_first(c.get_many_into(keys, outs))
        batch = (time.perf_counter() - t0) / rounds
        t0 = time.perf_counter()
        for _ in range(rounds):
            for k, o in zip(keys, outs):
                c.get_into(k, o)
        single = (time.perf_counter() - t0) / rounds
        return batch, single


# ---- --ratios ----------------------------------------------------------------------------------

RATIO_KEYS = 64  # values per round: 64 x 2 MiB = 128 MiB, more than any cache level


def _stamp(arrs: list, rnd: int) -> None:
    """Makes round `rnd`'s values differ from the last round's (8 bytes each: not timed)."""
    for i, a in enumerate(arrs):
        a[:8] = np.frombuffer((rnd * 1000003 + i).to_bytes(8, "little"), np.uint8)


def _memcpy_gbps(size: int, seconds: float) -> float:
    """A memcpy of RATIO_KEYS distinct values into RATIO_KEYS distinct, already-touched buffers:
    the bytes a put or a get moves, copied once."""
    src = [np.full(size, i % 251, np.uint8) for i in range(RATIO_KEYS)]
    dst = [np.zeros(size, np.uint8) for _ in range(RATIO_KEYS)]
    n, t0 = 0, time.perf_counter()
    while True:
        for s_, d in zip(src, dst):
            np.copyto(d, s_)
        n += 1
        el = time.perf_counter() - t0
        if el >= seconds:
            return n * RATIO_KEYS * size / el / 1e9


def _timed(fn, seconds: float) -> tuple[float, int]:
    fn(0)  # warm: first-touch of every buffer and every stored value
    n, t0 = 0, time.perf_counter()
    while True:
        n += 1
        fn(n)
        el = time.perf_counter() - t0
        if el >= seconds:
            return el / n, n


def _ratio_case(c: gdkv.Client, size: int, batch: int, mem: str, seconds: float,
                tag: str, repeat: int) -> dict:
    """mem: "shared" (client.empty()), "registered" (one numpy pool of the values, shared in
    place with client.register, as an engine's KV pool), "staged"/"numpy" (plain numpy)."""
    keys = [f"{tag[:3]}{size >> 10}.{batch}{mem[:3]}.{i}".encode() for i in range(RATIO_KEYS)]
    n = len(keys)
    if mem == "shared":
        srcs, outs = list(c.empty((n, size), np.uint8)), list(c.empty((n, size), np.uint8))
    elif mem == "registered":
        pool = np.zeros((2, n, size), np.uint8)
        c.register(pool)
        srcs, outs = list(pool[0]), list(pool[1])
    else:
        srcs = [np.empty(size, np.uint8) for _ in keys]
        outs = [np.empty(size, np.uint8) for _ in keys]
    for i, a in enumerate(srcs):
        a[:] = (i * 7 + 3) % 251
    last = [0]

    def put(rnd: int) -> None:
        _stamp(srcs, rnd)  # in the time, but 8 bytes a value
        last[0] = rnd
        if batch == 1:
            for k, v in zip(keys, srcs):
                c.put(k, v)
        else:
            gdkv.raise_first(c.put_many(zip(keys, srcs)))

    def get(rnd: int) -> None:
        if batch == 1:
            for k, o in zip(keys, outs):
                c.get_into(k, o)
        else:
            gdkv.raise_first(c.get_many_into(keys, outs))

    # Best of `repeat` each (the machine is shared), against the best of the memcpys run between
    # them: a figure and its reference are taken within seconds of each other.
    nbytes = RATIO_KEYS * size
    mem_g, put_g, get_g = [], [], []
    copies0 = c.copies()
    for _ in range(repeat):
        mem_g.append(_memcpy_gbps(size, seconds / 2))
        put_g.append(nbytes / _timed(put, seconds)[0] / 1e9)
        get_g.append(nbytes / _timed(get, seconds)[0] / 1e9)
        for i, o in enumerate(outs):  # every value: the last round's bytes
            if not np.array_equal(o, srcs[i]):
                raise SystemExit(f"{tag}: value {i} of {size} bytes read back wrong")
    copies1 = c.copies()
    for k in keys:
        c.delete(k)
    if mem == "registered":
        c.unregister(pool)
    m = max(mem_g)
    return {"memcpy_gbps": m, "put_gbps": max(put_g), "get_gbps": max(get_g),
            "put_ratio": max(put_g) / m, "get_ratio": max(get_g) / m,
            "copied_bytes": copies1[1] - copies0[1]}


def ratios(a) -> int:
    binary = a.gdkvd_binary or (Path(a.gdkv).parents[1] / "gdkvd" / "gdkvd")
    base = ["--backend", "memory", "--reactors", "1", *a.gdkvd_args.split()]
    targets = [("gdkvd+cache", base), ("gdkvd-nocache", [*base, "--cache-bytes", "0"]),
               ("in-process", None)]
    memcpy = {size: _memcpy_gbps(size, a.seconds) for size in (4096, 2 << 20)}
    for size, g in memcpy.items():
        print(f"memcpy {size >> 10} KiB x {RATIO_KEYS}: {g:.2f} GB/s")
    result = {"memcpy_gbps": memcpy, "cases": []}
    for name, args in targets:
        with contextlib.ExitStack() as stack:
            sock = stack.enter_context(gdkvd(*args, binary=binary)) if args else None
            with client(sock) as c:
                for size in (4096, 2 << 20):
                    for batch in (1, 64):
                        for mem in (("shared", "registered", "staged") if sock else ("numpy",)):
                            r = _ratio_case(c, size, batch, mem, a.seconds, name, a.repeat)
                            print(f"{name:14s} {size >> 10:5d} KiB batch {batch:2d} {mem:10s}: "
                                  f"put {r['put_gbps']:6.2f} GB/s ({r['put_ratio']:.2f} of "
                                  f"memcpy)  get {r['get_gbps']:6.2f} GB/s "
                                  f"({r['get_ratio']:.2f} of memcpy {r['memcpy_gbps']:.2f})  staged "
                                  f"{r['copied_bytes'] >> 20} MiB")
                            result["cases"].append({"target": name, "size": size, "batch": batch,
                                                    "memory": mem, **r})
    print(json.dumps(result))
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gdkv", default=str(ROOT / "build" / "release" / "tools" / "gdkv" / "gdkv"))
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gdkvd", action="store_true",
                   help="both clients through a gdkvd (memory backend) this script starts")
    p.add_argument("--ratios", action="store_true",
                   help="put/get GB/s as ratios of memcpy (gdkvd with and without cache, "
                        "in-process; 4 KiB and 2 MiB; batch 1 and 64; shared and staged)")
    p.add_argument("--gdkvd-binary", default=None, help="gdkvd for --ratios (default: beside --gdkv)")
    p.add_argument("--gdkvd-args", default="", help="more gdkvd flags for --ratios, e.g. "
                   "'--idle-spin-us 10000' (keeps the reactor awake between staged calls)")
    p.add_argument("--repeat", type=int, default=3, help="--ratios: best of this many runs")
    a = p.parse_args()
    if a.ratios:
        return ratios(a)
    if not a.gdkvd:
        return run(a, None)
    with gdkvd("--backend", "memory", "--reactors", "1",
               binary=Path(a.gdkv).parents[1] / "gdkvd" / "gdkvd") as sock:
        return run(a, sock)


def run(a, sock: str | None) -> int:
    print("through gdkvd (vfio-user)" if sock else "in-process memory backend")
    result = {}
    for size in (4096, 2 << 20):
        ratios, overheads, pys, cpps = [], [], [], []
        for _ in range(a.rounds):
            cpp = cpp_ops(a.gdkv, size, a.seconds, sock)
            py = py_ops(size, a.seconds, sock)
            pys.append(py)
            cpps.append(cpp)
            ratios.append(py / cpp)
            overheads.append((1 / py - 1 / cpp) * 1e6)
        r = statistics.median(ratios)
        o = statistics.median(overheads)
        name = "4KiB" if size == 4096 else "2MiB"
        print(f"get_into {name}: python {statistics.median(pys):,.0f} ops/s, C++ "
              f"{statistics.median(cpps):,.0f} ops/s, ratio {r:.3f} (per call +{o:.2f} us)")
        result[name] = {"python_ops": statistics.median(pys), "cpp_ops": statistics.median(cpps),
                        "ratio": r, "python_extra_us": o}
    batch, single = batch_ratio(256 << 10, sock)
    print(f"64 x 256 KiB blocks: get_many_into {batch * 1e3:.2f} ms, 64 get_into calls "
          f"{single * 1e3:.2f} ms, ratio {single / batch:.2f}")
    batch4, single4 = batch_ratio(4096, sock)
    print(f"64 x 4 KiB blocks: get_many_into {batch4 * 1e6:.0f} us, 64 get_into calls "
          f"{single4 * 1e6:.0f} us, ratio {single4 / batch4:.2f}")
    result["batch64"] = {"256KiB_batch_s": batch, "256KiB_calls_s": single,
                         "4KiB_batch_s": batch4, "4KiB_calls_s": single4}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
