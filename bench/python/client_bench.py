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
"""

from __future__ import annotations

import argparse
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
        c.put_many((k, np.full(size, i, np.uint8)) for i, k in enumerate(keys))
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
        c.put_many((k, np.full(size, i % 251, np.uint8)) for i, k in enumerate(keys))
        outs = [c.empty(size, np.uint8) for _ in keys]
        t0 = time.perf_counter()
        for _ in range(rounds):
            c.get_many_into(keys, outs)
        batch = (time.perf_counter() - t0) / rounds
        t0 = time.perf_counter()
        for _ in range(rounds):
            for k, o in zip(keys, outs):
                c.get_into(k, o)
        single = (time.perf_counter() - t0) / rounds
        return batch, single


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gdkv", default=str(ROOT / "build" / "release" / "tools" / "gdkv" / "gdkv"))
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gdkvd", action="store_true",
                   help="both clients through a gdkvd (memory backend) this script starts")
    a = p.parse_args()
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
