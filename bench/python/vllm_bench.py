#!/usr/bin/env python3
"""gdkv.vllm.GdkvConnector on vLLM's own scheduler and KV cache layout (CPU), against memcpy.

An 8B-shaped model (32 layers, 8 KV heads of 128, bf16; vLLM blocks of 16 tokens: 64 KiB per
layer, 2 MiB per block). Instance one stores a 64-block prompt; instance two (another vLLM,
empty prefix cache) then measures:

- lookup: the scheduler side's get_num_new_matched_tokens for the 64-block prompt (one
  lookup_prefix of 64 keys), against a 2 MiB memcpy;
- load: the worker side loading those 64 blocks into vLLM's paged KV tensors (every layer's
  page of every block), against a memcpy of the same 128 MiB (one contiguous copy).

Through a gdkvd (the values are staged through gdkvd's shared memory, then copied into the
pages) and in-process (written straight into the pages). Median of --rounds.

Usage: vllm_bench.py [--rounds 5] [--gdkvd build/release/tools/gdkvd/gdkvd]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python" / "tests"))
sys.path.insert(0, str(ROOT / "bench" / "python"))
from gdkvd_proc import gdkvd  # noqa: E402
from vllm_instance import BS, Instance, llama_dir  # noqa: E402

from gdkv.vllm import Transfer  # noqa: E402

BLOCKS = 64


def measure(model: str, extra: dict, rounds: int) -> dict:
    prompt = list(range(1000, 1000 + BLOCKS * BS + 1))
    one = Instance(model, extra, dtype=torch.bfloat16, kv_bytes_total=640 << 20, max_len=2048)
    one.add("a", prompt)
    one.run()
    assert one.worker.stats["saved_values"] == BLOCKS, one.worker.stats
    two = Instance(model, extra, dtype=torch.bfloat16, kv_bytes_total=640 << 20, max_len=2048)
    r = two.add("b", prompt)
    sched = two.scheduler.connector.scheduler
    w = two.worker
    value_bytes = w.value_bytes
    load = Transfer("b", [sched.plan.value_hash(r, v) for v in range(BLOCKS)],
                    [[i] for i in range(BLOCKS)])
    src = torch.ones(BLOCKS * value_bytes, dtype=torch.uint8)
    dst = torch.zeros(BLOCKS * value_bytes, dtype=torch.uint8)
    small_src, small_dst = torch.empty(value_bytes, dtype=torch.uint8), torch.empty(
        value_bytes, dtype=torch.uint8)
    src_np, dst_np = src.numpy(), dst.numpy()
    out = {"lookup_s": [], "lookup_memcpy_s": [], "load_s": [], "load_memcpy_s": [],
           "load_numpy_memcpy_s": []}
    for _ in range(rounds):
        t = time.perf_counter()
        n, _ = sched.matched_tokens(r, 0)
        out["lookup_s"].append(time.perf_counter() - t)
        assert n == BLOCKS * BS, n
        t = time.perf_counter()
        small_dst.copy_(small_src)
        out["lookup_memcpy_s"].append(time.perf_counter() - t)
        t = time.perf_counter()
        w._load(load)
        out["load_s"].append(time.perf_counter() - t)
        assert w.stats["failed_values"] == 0, w.stats
        t = time.perf_counter()
        dst.copy_(src)
        out["load_memcpy_s"].append(time.perf_counter() - t)
        t = time.perf_counter()
        np.copyto(dst_np, src_np)   # one thread, as the other engines' benches measure memcpy
        out["load_numpy_memcpy_s"].append(time.perf_counter() - t)
    res = {k: statistics.median(v) for k, v in out.items()}
    res["bytes"] = BLOCKS * value_bytes
    res["zero_copy"] = w.stats["zero_copy_loads"] > 0
    one.close()
    two.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gdkvd", default=str(ROOT / "build/release/tools/gdkvd/gdkvd"))
    a = ap.parse_args()
    model = llama_dir(Path(tempfile.mkdtemp(prefix="vllm-bench-model-")), layers=32,
                      kv_heads=8, head_dim=128)
    results = {}
    with gdkvd("--backend", "memory", "--reactors", "1", binary=a.gdkvd) as sock:
        results["gdkvd"] = measure(model, {"socket_dir": sock}, a.rounds)
    results["in-process"] = measure(model, {"backend": "memory", "namespace": "bench"}, a.rounds)
    for where, r in results.items():
        gbs = r["bytes"] / r["load_s"] / 1e9
        print(f"{where:10s} lookup of {BLOCKS} blocks: {r['lookup_s'] * 1e6:7.0f} us "
              f"({r['lookup_s'] / r['lookup_memcpy_s']:.1f}x a 2 MiB memcpy)")
        print(f"{where:10s} load of {BLOCKS} blocks ({r['bytes'] >> 20} MiB) into vLLM's pages: "
              f"{r['load_s'] * 1e3:6.1f} ms, {gbs:5.2f} GB/s, "
              f"{r['load_memcpy_s'] / r['load_s']:.2f} of torch's copy_ (threaded), "
              f"{r['load_numpy_memcpy_s'] / r['load_s']:.2f} of a numpy memcpy"
              f" ({'zero copy' if r['zero_copy'] else 'staged'})")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
