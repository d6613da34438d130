#!/usr/bin/env python3
"""SGLang HiCache on gdkv (gdkv.sglang.GdkvStorage): prefix lookup and page loads, against a
memcpy of the same bytes in the same run.

An 8B-shaped model (32 layers, 8 KV heads of 128, bf16: 128 KiB of KV per token) in SGLang's
real host pool (MHATokenToKVPoolHost, default layout page_first) with 64-token pages (SGLang's
own default page size is 1; its storage backends are run with --page-size 64, which this takes):
one page is 8 MiB, 64 pages 512 MiB. Measured, through a gdkvd this script starts (memory
backend) and with an in-process gdkv (memory backend):

- batch_exists of a 64-page prefix (one lookup_prefix of 64 keys), back to back and after 20 ms
  idle (a remote client cannot wake gdkvd's sleeping reactor: up to its 5 ms sleep timeout,
  docs/vfio-user.md; --gdkvd-args "--never-sleep --reactors 1" runs its reactor polling);
- batch_get_v1 of those 64 pages into other pages of the host pool (what SGLang's prefetch
  calls), against numpy and torch copies of the same runs within the pool;
- batch_set_v1 of the 64 pages (once: a second set finds them stored and sends nothing).

--unshared: gdkvd is refused the host pool (gdkv.engine.prepare_shared_memory raises, as for a
file mapping), so pages move through the connector's staging (EngineStore.load_staged and
put_gathered for layer_first; the client's own staging for the other layouts).

Usage: sglang_bench.py [--gdkvd build/release/tools/gdkvd/gdkvd] [--pages 64] [--page-size 64]
    [--layout page_first] [--rounds 5] [--gdkvd-args "--never-sleep --reactors 1"] [--unshared]
Prints one line per figure and a JSON object at the end. Runs in the SGLang environment
(~/.cache/gdkv/venv-sglang); well under a minute.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from gdkv.sglang import _PageLayout  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gdkvd_proc import gdkvd  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def median_time(fn: Callable[[], Any], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def host_pool(a) -> MHATokenToKVPoolHost:
    """SGLang's host pool with room for 2 x pages pages (the source and the destination)."""
    dev = MHATokenToKVPool(size=a.page_size, page_size=a.page_size, dtype=torch.bfloat16,
                           head_num=a.heads, head_dim=a.head_dim, layer_num=a.layers,
                           device="cpu", enable_memory_saver=False, start_layer=0,
                           end_layer=a.layers)
    host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, a.page_size,
                                a.layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=dev.size, start_layer=0,
                                end_layer=a.layers,
                                host_token_capacity=2 * a.pages * a.page_size)
    # Every 8 bytes different (cheaper than random bytes for 1 GiB), so a misplaced page shows.
    words = host.kv_buffer.view(-1).view(torch.int64)
    torch.arange(words.numel(), out=words)
    return host


def storage(host, where: dict) -> Any:
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                               attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                               is_page_first_layout=host.layout == "page_first",
                               model_name="bench/8b-shaped",
                               extra_config={"backend_name": "gdkv", "module_path": "gdkv.sglang",
                                             "class_name": "GdkvStorage", "interface_v1": 1,
                                             **where})
    s = StorageBackendFactory.create_backend("dynamic", cfg, host)
    s.register_mem_pool_host(host)
    return s


def measure(a, host, where: dict, name: str) -> dict:
    s = storage(host, where)
    ps, n = a.page_size, a.pages
    tokens = [(7 * i) % 32000 for i in range(n * ps)]
    keys = get_storage_hash_str(tokens, None, page_size=ps)
    src = torch.arange(0, n * ps)
    dst = torch.arange(n * ps, 2 * n * ps)
    nbytes = n * s.layout.page_bytes

    t0 = time.perf_counter()
    assert all(s.batch_set_v1(keys, src)), "batch_set_v1 failed"
    store = time.perf_counter() - t0
    assert s.batch_exists(keys) == n
    exists = median_time(lambda: s.batch_exists(keys), a.rounds * 40)  # back to back
    idle: list[float] = []
    for _ in range(a.rounds * 4):
        time.sleep(0.02)  # gdkvd's reactor goes to sleep after idle_spin_us (200 us) idle
        t0 = time.perf_counter()
        s.batch_exists(keys)
        idle.append(time.perf_counter() - t0)
    exists_idle = statistics.median(idle)
    for p in range(n):  # the destination pages start zeroed (a previous run filled them)
        host.get_data_page((n + p) * ps, flat=False).zero_()
    copies0 = s.copies()
    load = median_time(lambda: s.batch_get_v1(keys, dst), a.rounds)
    copies = [x - y for x, y in zip(s.copies(), copies0)]
    # Every page arrived: the destination pages hold the source pages' bytes.
    for p in (0, n // 2, n - 1):
        a_page = host.get_data_page(p * ps).view(torch.uint8)
        b_page = host.get_data_page((n + p) * ps).view(torch.uint8)
        assert torch.equal(a_page, b_page), f"page {p} differs"
    s.close()
    per_load_copies = copies[1] / a.rounds / nbytes
    print(f"{name}: lookup of a {n}-page prefix {exists * 1e6:.0f} us back to back, "
          f"{exists_idle * 1e6:.0f} us after 20 ms idle; load of {n} pages "
          f"({nbytes / 2**20:.0f} MiB) {load * 1e3:.1f} ms = {nbytes / load / 1e9:.2f} GB/s "
          f"({per_load_copies:.0f} staging copy of each byte); store {store * 1e3:.0f} ms")
    return {"lookup_s": exists, "lookup_after_idle_s": exists_idle, "load_s": load,
            "load_gb_s": nbytes / load / 1e9,
            "store_s": store, "load_copies_per_byte": per_load_copies}


def memcpy_baseline(a, host) -> tuple[float, float]:
    """numpy and torch copies (one thread each, as one gdkv copy is) of the pages' runs to the
    other pages."""
    lay = _PageLayout(host)  # the runs GdkvStorage moves (page_first: each page's K and V)
    pairs = [(lay.run(p, i), lay.run(a.pages + p, i)) for p in range(a.pages)
             for i in range(len(lay.sizes))]
    np_time = median_time(lambda: [np.copyto(d, s) for s, d in pairs], a.rounds)
    tpairs = [(torch.from_numpy(s), torch.from_numpy(d)) for s, d in pairs]
    # One thread: torch's intra-op threads make 4 MiB copies 10-30x slower on a 2-vCPU machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch_time = median_time(lambda: [d.copy_(s) for s, d in tpairs], a.rounds)
    finally:
        torch.set_num_threads(threads)
    return np_time, torch_time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gdkvd", default=str(ROOT / "build" / "release" / "tools" / "gdkvd" / "gdkvd"))
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layout", default="page_first",
                   choices=["page_first", "page_first_direct", "page_head", "layer_first"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--gdkvd-args", default="",
                   help='more gdkvd options, e.g. "--never-sleep --reactors 1" (a polling '
                        'reactor: one core)')
    p.add_argument("--unshared", action="store_true",
                   help="refuse to share the host pool with gdkvd: pages are staged")
    a = p.parse_args()
    if a.unshared:
        import gdkv.engine

        def refuse(buf: Any) -> None:
            raise ValueError("--unshared")

        gdkv.engine.prepare_shared_memory = refuse
    with gdkvd("--backend", "memory", *a.gdkvd_args.split(), binary=a.gdkvd,
               prefix="gdkv-sglang-bench-") as sock:
        host = host_pool(a)
        page_mib = host.get_size_per_token() * a.page_size / 2**20
        print(f"SGLang {a.layout} host pool: {a.layers} layers x {a.heads} KV heads x "
              f"{a.head_dim} bf16, {a.page_size}-token pages of {page_mib:.0f} MiB")
        result: dict[str, Any] = {"layout": a.layout, "pages": a.pages, "unshared": a.unshared,
                                  "gdkvd_args": a.gdkvd_args,
                                  "page_size": a.page_size, "page_bytes": int(page_mib * 2**20)}
        result["gdkvd"] = measure(a, host, {"socket_dir": sock}, "through gdkvd")
        result["in_process"] = measure(a, host, {"backend": "memory"}, "in-process gdkv")
        np_time, torch_time = memcpy_baseline(a, host)
        nbytes = a.pages * page_mib * 2**20
        print(f"memcpy of the same {nbytes / 2**20:.0f} MiB: numpy {np_time * 1e3:.1f} ms "
              f"({nbytes / np_time / 1e9:.2f} GB/s), torch copy_ {torch_time * 1e3:.1f} ms "
              f"({nbytes / torch_time / 1e9:.2f} GB/s)")
        result["memcpy_numpy_s"] = np_time
        result["memcpy_torch_s"] = torch_time
        for where in ("gdkvd", "in_process"):
            r = result[where]
            r["load_vs_numpy_memcpy"] = r["load_s"] / np_time
            r["load_vs_torch_memcpy"] = r["load_s"] / torch_time
            print(f"load {where.replace('_', '-')}: {r['load_vs_numpy_memcpy']:.2f}x the time of "
                  f"the numpy memcpy, {r['load_vs_torch_memcpy']:.2f}x the torch copy")
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
