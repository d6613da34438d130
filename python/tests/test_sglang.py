"""gdkv.sglang.GdkvStorage with SGLang 0.5.23's real classes: its device KV pool
(MHATokenToKVPool / MLATokenToKVPool on device "cpu"), its host pool (MHATokenToKVPoolHost /
MLATokenToKVPoolHost, every layout), its storage backend factory (``dynamic`` with the extra
config), its page hashes, and its HiCacheController (attach, backup and prefetch threads) driving
the backend, against a real gdkvd (conftest's Gdkvd) or an in-process gdkv.

Runs in the SGLang environment (scripts/test: ~/.cache/gdkv/venv-sglang); skipped only where
sglang cannot be imported (the main environment has no SGLang).
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any, Optional

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from conftest import fail_for, hint_gdkvd, hinted, record_hints, until  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

import gdkv  # noqa: E402
from gdkv.sglang import GdkvStorage  # noqa: E402

PAGE = 4          # tokens per page
LAYERS = 3
HEADS, DIM = 2, 8  # MHA: KV heads of DIM; MLA: kv_lora_rank 16 + rope 8
DEVICE_TOKENS = 64  # the host pool holds twice as many (+ a padding page): 33 pages

DYNAMIC = {"backend_name": "gdkv", "module_path": "gdkv.sglang", "class_name": "GdkvStorage",
           "interface_v1": 1}
KINDS = ["mha/layer_first", "mha/page_first", "mha/page_first_direct", "mha/page_head",
         "mla/page_first", "mla/layer_first"]


def device_pool(kind: str):
    if kind == "mla":
        return MLATokenToKVPool(size=DEVICE_TOKENS, page_size=PAGE, dtype=torch.bfloat16,
                                kv_lora_rank=16, qk_rope_head_dim=8, layer_num=LAYERS,
                                device="cpu", enable_memory_saver=False, start_layer=0,
                                end_layer=LAYERS)
    return MHATokenToKVPool(size=DEVICE_TOKENS, page_size=PAGE, dtype=torch.bfloat16,
                            head_num=HEADS, head_dim=DIM, layer_num=LAYERS, device="cpu",
                            enable_memory_saver=False, start_layer=0, end_layer=LAYERS)


def host_pool(spec: str, dev: Any = None):
    """SGLang's host pool of ``spec`` ("mha/page_first"...), built from its device pool as
    SGLang's pool assembler does; pin_memory=False (no CUDA here)."""
    kind, layout = spec.split("/")
    dev = dev if dev is not None else device_pool(kind)
    info = dev.get_device_pool_infos()[0].buffer_info
    common = dict(pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                  start_layer=dev.start_layer, end_layer=dev.end_layer)
    if kind == "mla":
        host = MLATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, target_layer_num=LAYERS,
                                    **common)
    else:
        host = MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, **common)
    fill(host, 1)
    return host


def fill(host, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    raw = host.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def pool_bytes(host) -> torch.Tensor:
    return host.kv_buffer.view(-1).view(torch.uint8).clone()


def page(host, p: int) -> torch.Tensor:
    """Page p's bytes: SGLang's own flat data page (compared as bytes: random bf16 has NaNs)."""
    return host.get_data_page(p * PAGE, flat=True).view(torch.uint8).clone()


def indices(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def hashes(n: int, seed: int = 0) -> list[str]:
    """SGLang's page hashes of n pages of tokens."""
    tokens = [(seed * 7919 + i) % 32000 for i in range(n * PAGE)]
    return get_storage_hash_str(tokens, None, page_size=PAGE)


def storage(host, model: str = "org/model", tp_rank: int = 0, tp_size: int = 1,
            mla: Optional[bool] = None, **extra) -> GdkvStorage:
    """GdkvStorage from SGLang's factory for "dynamic", registered as the controller does."""
    mla = isinstance(host, MLATokenToKVPoolHost) if mla is None else mla
    cfg = HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1,
                               attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
                               enable_storage_metrics=True,
                               is_page_first_layout=host.layout == "page_first",
                               model_name=model, extra_config={**DYNAMIC, **extra})
    s = StorageBackendFactory.create_backend("dynamic", cfg, host)
    assert type(s) is GdkvStorage
    s.register_mem_pool_host(host)
    return s


def memfd_inode(addr: int) -> Optional[int]:
    """The inode of gdkv's in-place memfd mapped at ``addr`` (None: other memory)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        f = line.split()
        lo, hi = (int(x, 16) for x in f[0].split("-"))
        if lo <= addr < hi:
            return int(f[4]) if "gdkv-in-place" in line else None
    return None


# ---- the backend, through gdkvd ----

@pytest.mark.parametrize("spec", KINDS)
def test_set_exists_get_byte_exact(gdkvd, spec):
    host = host_pool(spec)
    s = storage(host, socket_dir=gdkvd.dir)
    keys = hashes(6)
    src = [page(host, p) for p in range(6)]
    assert s.batch_exists(keys) == 0
    assert s.batch_get_v1(keys, indices(list(range(10, 16)))) == [False] * 6
    copies = s.copies()
    assert s.batch_set_v1(keys, indices(list(range(6)))) == [True] * 6
    assert s.batch_exists(keys) == 6
    assert s.batch_exists(keys + hashes(1, seed=9)) == 6
    assert s.batch_set_v1(keys, indices(list(range(6)))) == [True] * 6  # already there

    # Into other pages, in another order: byte-exact, and not one byte elsewhere in the pool.
    fill(host, 2)
    before = pool_bytes(host)
    dst = [10, 12, 11, 20, 13, 31]
    assert s.batch_get_v1(keys, indices(dst)) == [True] * 6
    expected = host_pool(spec)  # a pool of the same geometry to build the expected bytes in
    expected.kv_buffer.view(-1).view(torch.uint8).copy_(before)
    for i, p in enumerate(dst):
        expected.set_from_flat_data_page(p * PAGE, src[i].view(host.dtype))
    assert torch.equal(pool_bytes(host), pool_bytes(expected))
    assert not torch.equal(before, pool_bytes(host))  # it did write

    # Through gdkvd the host pool is shared in place: nothing is staged either way. Only a
    # layer_first page is copied, gathered from its runs into one value to store (a page
    # already stored is not sent again); it is loaded scattered in place.
    c = s.store.client()
    assert c.remote and c.reaches(s.layout.host) and c.copies() == (0, 0)
    gathered = 6 * s.layout.page_bytes if s.layout.scattered else 0
    assert s.copies()[1] - copies[1] == gathered
    stats = s.get_stats()
    assert stats.backup_pgs == [6] and stats.prefetch_pgs == [6]
    assert s.get_stats().prefetch_pgs == []
    s.close()


@pytest.mark.parametrize("spec", ["mha/layer_first", "mla/layer_first"])
def test_an_unshared_pool_moves_through_staging_a_page_a_round(gdkvd, spec, monkeypatch):
    """A host pool gdkvd cannot reach in place (sharing refused here, as for a file mapping)
    moves through staging_bytes of shared memory (here one page: a round per page), byte-exact
    both ways, each page copied once each way by the connector."""
    def refuse(buf):
        raise ValueError("not private memory")

    monkeypatch.setattr(gdkv.engine, "prepare_shared_memory", refuse)
    host = host_pool(spec)
    s = storage(host, socket_dir=gdkvd.dir, staging_bytes=1)
    c, pb = s.store.client(), s.layout.page_bytes
    assert not s.store.reaches(c, [s.layout.host]) and s.store.staging_rows(c, pb) == 1
    keys = hashes(5)
    src = [page(host, p) for p in range(5)]
    assert s.batch_set_v1(keys, indices([0, 1, 2, 3, 4])) == [True] * 5
    fill(host, 3)
    assert s.batch_get_v1(keys, indices([10, 12, 11, 20, 13])) == [True] * 5
    for i, p in enumerate([10, 12, 11, 20, 13]):
        assert torch.equal(page(host, p), src[i])
    assert s.copies() == (10, 10 * pb) and c.copies() == (0, 0)
    s.close()


def test_exists_counts_the_leading_run(gdkvd):
    host = host_pool("mha/page_first")
    s = storage(host, socket_dir=gdkvd.dir)
    keys = hashes(6)
    have = [0, 1, 2, 4, 5]  # a hole at page 3
    assert s.batch_set_v1([keys[p] for p in have], indices(have)) == [True] * 5
    assert s.batch_exists(keys) == 3
    assert s.batch_exists(keys[3:]) == 0
    assert s.batch_exists(keys[4:]) == 2
    assert s.exists(keys[2]) and not s.exists(keys[3])
    # A page is two values here (K and V); the store may evict one and keep the other. Such a
    # page is not found and not loaded, whichever value is gone.
    assert len(s._page_keys(keys[1])) == 2
    with gdkv.connect(gdkvd.dir) as c:
        c.delete(s._page_keys(keys[1])[1])
        assert s.batch_exists(keys) == 1 and not s.exists(keys[1])
        got = s.batch_get_v1(keys[:3], indices([20, 21, 22]))
        assert got == [True, False, True]
        assert torch.equal(page(host, 20), page(host, 0))
        assert torch.equal(page(host, 22), page(host, 2))
        # (Page 21's K may have landed; the page is reported missing, and SGLang stops there.)
        # A set of the page writes it again (its K was there, its V was not).
        assert s.batch_set_v1(keys[1:2], indices([1])) == [True]
        assert s.batch_exists(keys) == 3
        assert s.batch_get_v1(keys[1:2], indices([21])) == [True]
        assert torch.equal(page(host, 21), page(host, 1))
        c.delete(s._page_keys(keys[0])[0])
        assert s.batch_exists(keys) == 0 and not s.exists(keys[0])
    # Host indices that do not start pages are refused without touching the pool.
    before = pool_bytes(host)
    assert s.batch_get_v1(keys[:1], torch.arange(2, 2 + PAGE)) == [False]
    assert s.batch_get_v1(keys[:2], indices([5])) == [False, False]
    assert torch.equal(pool_bytes(host), before)


def test_a_page_is_found_only_once_all_its_values_are_stored(gdkvd, monkeypatch):
    host = host_pool("mha/page_first")
    s = storage(host, socket_dir=gdkvd.dir)
    keys = hashes(3)
    c = s.store.client()
    put_many = c.put_many
    rounds: list[list[bytes]] = []

    def recording(items, **kw):
        items = list(items)
        rounds.append([k for k, _ in items])
        return put_many(items, **kw)

    c.put_many = recording
    assert s.batch_set_v1(keys, indices([0, 1, 2])) == [True] * 3
    assert rounds == [[k for h in keys for k in s._page_keys(h)]]   # one round, K and V

    # A value the store refuses (here: full) fails its page only: the other page is stored,
    # batch_exists stops before the failed one, and the client is kept (only gdkvd being
    # unavailable drops it).
    more = hashes(2, seed=4)
    refused = s._page_keys(more[0])[1]   # page 0's V

    fail_for(c, monkeypatch, "put_many", refused, gdkv.CapacityError("full", 0x81, refused))
    assert s.batch_set_v1(more, indices([3, 4])) == [False, True]
    assert not s.batch_set(more, [host.get_data_page(3 * PAGE)] * 2)
    assert s.batch_exists(more) == 0 and s.batch_exists(more[1:]) == 1
    assert s.batch_exists(keys) == 3
    assert s.store.failures == 0 and s.store.client() is c


@pytest.mark.parametrize("spec", ["mha/page_first", "mha/layer_first"])
def test_generic_interface_is_the_same_values(gdkvd, spec):
    """SGLang without interface_v1 calls batch_set/batch_get with flat data pages (its own
    copies): the same values as the zero-copy path, either way round."""
    host = host_pool(spec)
    s = storage(host, socket_dir=gdkvd.dir)
    keys = hashes(4)
    assert s.batch_set(keys[:2], [host.get_data_page(p * PAGE) for p in range(2)])
    assert s.set(keys[2], host.get_data_page(2 * PAGE))
    assert s.batch_exists(keys) == 3 and s.exists(keys[2]) and not s.exists(keys[3])
    assert s.batch_get_v1(keys[:3], indices([10, 11, 12])) == [True] * 3
    for i in range(3):
        assert torch.equal(page(host, 10 + i), page(host, i))
    assert s.batch_set_v1(keys[3:], indices([3])) == [True]
    outs = [host.get_dummy_flat_data_page() for _ in range(4)]
    got = s.batch_get(keys, outs)
    assert all(g is o for g, o in zip(got, outs))
    for i in range(4):
        assert torch.equal(outs[i].view(torch.uint8), page(host, i))
    one = s.get(keys[3])
    assert one is not None and torch.equal(one.view(torch.uint8), page(host, 3))
    assert s.get(hashes(1, seed=5)[0]) is None
    assert s.batch_get(hashes(2, seed=5)) == [None, None]
    assert not s.batch_set(keys[:1], [torch.zeros(3, dtype=host.dtype)])  # not a page
    # clear() (SGLang's /hicache/storage-backend/clear) empties this connector's namespace.
    assert s.clear() and s.batch_exists(keys) == 0
    assert s.batch_get_v1(keys[:1], indices([10])) == [False]


def test_clear_deletes_its_own_namespace_only(gdkvd):
    """clear() deletes every SGLang key of its namespace (any model's), in batches, and leaves
    other namespaces, other engines' keys and plain keys on the same gdkvd alone."""
    host = host_pool("mha/page_first")
    a = storage(host, socket_dir=gdkvd.dir)
    a_other_model = storage(host, model="org/other", socket_dir=gdkvd.dir)
    b = storage(host, namespace="tenant-b", socket_dir=gdkvd.dir)
    many = hashes(600, seed=3)   # more keys than one delete round
    for start in range(0, len(many), 30):
        chunk = many[start: start + 30]
        assert a.batch_set_v1(chunk, indices(list(range(len(chunk))))) == [True] * len(chunk)
    keys = hashes(3)
    assert a_other_model.batch_set_v1(keys, indices([0, 1, 2])) == [True] * 3
    assert b.batch_set_v1(keys, indices([0, 1, 2])) == [True] * 3
    with gdkv.connect(gdkvd.dir) as c:
        c.put(b"someone-else", b"x")
        from gdkv.engine import KeySpace
        vllm_key = KeySpace("vllm", "org/model", "bf16", "l").key(b"h")
        c.put(vllm_key, b"y")
        before = len(c.list())
        assert a.clear()
        assert a.batch_exists(many) == 0 and a_other_model.batch_exists(keys) == 0
        assert b.batch_exists(keys) == 3
        assert c.get(b"someone-else") == b"x" and c.get(vllm_key) == b"y"
        assert len(c.list()) == before - 2 * (600 + 3)
        assert b.clear() and b.batch_exists(keys) == 0
        assert c.get(b"someone-else") == b"x"


def test_evicted_values_never_count_on_a_full_local_store(tmp_path):
    """The local store frees its oldest values when full, one value at a time, so a page may
    lose its K and keep its V: batch_exists counts a page exactly when batch_get_v1 loads it,
    and the loaded bytes are right."""
    from conftest import Gdkvd
    conf = tmp_path / "gdkvd.toml"   # 4 segments of 256 KiB: the oldest goes when it is full
    conf.write_text(f'[backend]\nkind = "local"\nstore = "{tmp_path / "store"}"\n'
                    f'capacity_bytes = {1 << 20}\nsegment_bytes = {256 << 10}\n')
    d = Gdkvd("--config", str(conf), "--cache-bytes", "0")
    try:
        host = host_pool("mha/page_first")
        s = storage(host, socket_dir=d.dir)
        rounds = [hashes(16, seed=r) for r in range(160)]
        for keys in rounds:
            assert s.batch_set_v1(keys, indices(list(range(16)))) == [True] * 16
        c = s.store.client()
        partial = found = 0
        for keys in rounds:
            for p, h in enumerate(keys):
                have = c.exists_many(s._page_keys(h))
                partial += any(have) and not all(have)
                exists = s.batch_exists([h]) == 1
                assert exists == all(have)
                loaded = s.batch_get_v1([h], indices([20]))[0]
                assert loaded == exists, (p, have)
                if loaded:
                    found += 1
                    assert torch.equal(page(host, 20), page(host, p))
        assert 0 < found < 160 * 16, found   # the store was full and kept some pages
        print(f"pages found {found}, pages with one value evicted {partial}")
    finally:
        d.stop()


def test_models_layouts_and_ranks_do_not_collide(gdkvd):
    host = host_pool("mha/page_first")
    a = storage(host, socket_dir=gdkvd.dir)
    keys = hashes(3)
    assert a.batch_set_v1(keys, indices([0, 1, 2])) == [True] * 3

    # The same model, layout and rank in another SGLang process: the same pages.
    other = host_pool("mha/page_first")
    fill(other, 3)
    same = storage(other, socket_dir=gdkvd.dir)
    assert same.batch_exists(keys) == 3
    assert same.batch_get_v1(keys, indices([7, 8, 9])) == [True] * 3
    for i in range(3):
        assert torch.equal(page(other, 7 + i), page(host, i))

    # Another model, another layout of the same bytes per page, another TP rank, another
    # namespace, MLA's rank-free keys: none of them sees those pages.
    others = [
        storage(host_pool("mha/page_first"), model="org/other-model", socket_dir=gdkvd.dir),
        storage(host_pool("mha/page_first_direct"), socket_dir=gdkvd.dir),
        storage(host_pool("mha/layer_first"), socket_dir=gdkvd.dir),
        storage(host_pool("mha/page_first"), tp_rank=1, tp_size=2, socket_dir=gdkvd.dir),
        storage(host_pool("mha/page_first"), tp_rank=0, tp_size=2, socket_dir=gdkvd.dir),
        storage(host_pool("mha/page_first"), namespace="tenant-b", socket_dir=gdkvd.dir),
        storage(host_pool("mha/page_first"), mla=True, socket_dir=gdkvd.dir),
    ]
    descriptions = {a.keyspace.description} | {o.keyspace.description for o in others}
    assert len(descriptions) == len(others) + 1
    for o in others:
        before = pool_bytes(o.mem_pool_host)
        assert o.batch_exists(keys) == 0, o
        assert o.batch_get_v1(keys, indices([7, 8, 9])) == [False] * 3, o
        assert torch.equal(pool_bytes(o.mem_pool_host), before)


# ---- SGLang's HiCacheController driving the backend ----

@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """The one-rank gloo group a HiCacheController takes as its TP group."""
    created = not dist.is_initialized()
    if created:
        store = tmp_path_factory.mktemp("pg") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


def controller(process_group, layout: str, extra: dict):
    dev = device_pool("mha")
    host = host_pool(f"mha/{layout}", dev)
    allocator = PagedTokenToKVPoolAllocator(DEVICE_TOKENS, PAGE, torch.bfloat16, "cpu", dev, False)
    ctl = HiCacheController(allocator, host, PAGE, process_group, threading.Event(),
                            write_policy="write_through", io_backend="kernel")
    # What SGLang's scheduler publishes for rank 0 of TP 1 (read when the backend attaches).
    with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1,
                                 attn_dcp_rank=0):
        ctl.attach_storage_backend("dynamic", model_name="meta-llama/Llama-3.1-8B",
                                   storage_backend_extra_config={**DYNAMIC, **extra})
    return ctl, host


def backup(ctl, pages: list[int], page_hashes: list[str]) -> int:
    """SGLang's write-through to storage (its backup thread); the tokens it stored."""
    ctl.write_storage(indices(pages), [0] * (len(pages) * PAGE), hash_value=page_hashes)
    return ctl.ack_backup_queue.get(timeout=30).completed_tokens


def prefetch(ctl, tokens: list[int], dst_first_page: int) -> tuple[int, int]:
    """SGLang's prefetch: its hit query (batch_exists on its page hashes), then, as the scheduler
    does, host pages for the hits and the transfer (batch_get_v1). (hit, loaded) tokens."""
    op = ctl.prefetch("req", tokens)
    op = ctl.prefetch_hit_queue.get(timeout=30)
    hit = op.storage_hit_count
    if hit == 0:
        return 0, 0
    first = dst_first_page * PAGE
    op.host_indices = torch.arange(first, first + hit)
    ctl.prefetch_buffer.put(op)
    loaded = 0
    while True:
        ack = ctl.ack_prefetch_queue.get(timeout=30)
        if ack.completed_tokens is not None:
            loaded = ack.completed_tokens
        if ack.completed_req:
            return hit, loaded


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_hicache_controller_backup_and_prefetch(gdkvd, process_group, layout):
    ctl, host = controller(process_group, layout, {"socket_dir": gdkvd.dir})
    try:
        assert isinstance(ctl.storage_backend, GdkvStorage)
        assert ctl.page_get_func == ctl._page_get_zero_copy  # interface_v1: the in-place path
        s = ctl.storage_backend
        assert "meta-llama/Llama-3.1-8B|tp=0/1" in s.keyspace.description
        tokens = list(range(1000, 1000 + 6 * PAGE))
        page_hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
        src = [page(host, p) for p in range(6)]
        # Pages 0-2 and 4-5 written, page 3 not: the prefix stops at the hole.
        assert backup(ctl, [0, 1, 2], page_hashes[:3]) == 3 * PAGE
        assert backup(ctl, [4, 5], page_hashes[4:]) == 2 * PAGE
        assert prefetch(ctl, tokens, 20) == (3 * PAGE, 3 * PAGE)
        for i in range(3):
            assert torch.equal(page(host, 20 + i), src[i])
        assert backup(ctl, [3], page_hashes[3:4]) == PAGE
        assert prefetch(ctl, tokens, 24) == (6 * PAGE, 6 * PAGE)
        for i in range(6):
            assert torch.equal(page(host, 24 + i), src[i])
    finally:
        ctl.detach_storage_backend()


# ---- scheduler hints: the pages a waiting request's prefetch will read ----
def test_prefetch_hints_the_pages_it_reads(process_group, monkeypatch):
    """SGLang's prefetch thread asks batch_exists for a waiting request's pages; the leading run
    found (every value of each page, page after page) reaches gdkvd's cache as a hint before
    SGLang reads it. A lookup that finds nothing, exists() and backups hint nothing."""
    d = hint_gdkvd()
    ctl, host = controller(process_group, "page_first", {"socket_dir": d.dir})
    try:
        s = ctl.storage_backend
        hints = record_hints(s.store.client(), monkeypatch)
        tokens = list(range(3000, 3000 + 6 * PAGE))
        page_hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
        assert backup(ctl, [0, 1, 2], page_hashes[:3]) == 3 * PAGE
        assert backup(ctl, [4, 5], page_hashes[4:]) == 2 * PAGE
        assert hints == [] and hinted(d) == 0
        assert prefetch(ctl, tokens, 20) == (3 * PAGE, 3 * PAGE)   # page 3 is missing
        assert hints == [s._keys(page_hashes[:3])]                  # K and V of pages 0, 1, 2
        assert hinted(d) == 6
        assert backup(ctl, [3], page_hashes[3:4]) == PAGE
        assert prefetch(ctl, tokens, 24) == (6 * PAGE, 6 * PAGE)
        assert hints[1:] == [s._keys(page_hashes)] and hinted(d) == 18
        assert prefetch(ctl, list(range(9000, 9000 + 4 * PAGE)), 24) == (0, 0)
        assert s.exists(page_hashes[0])
        assert len(hints) == 2 and hinted(d) == 18

        # More keys than one hint command takes (64 KiB): sent in chunks, in order.
        many = hashes(2000, seed=7)
        for start in range(0, len(many), 32):
            chunk = many[start: start + 32]
            assert s.batch_set_v1(chunk, indices(list(range(len(chunk))))) == [True] * len(chunk)
        assert s.batch_exists(many) == 2000
        assert [len(h) for h in hints[2:]] == [2048, 4000 - 2048]
        assert hints[2] + hints[3] == s._keys(many)
        assert hinted(d) == 18 + 4000
    finally:
        ctl.detach_storage_backend()
        d.stop()


def test_a_failing_hint_changes_no_answer(process_group, monkeypatch, caplog):
    """A hint gdkvd refuses is logged at debug level, the client is kept and the prefetch loads;
    gdkvd dying between the
    lookup and the hint drops the client, SGLang's hit query still gets its answer (no exception
    in its prefetch thread) and the transfer that follows is a miss."""
    d = hint_gdkvd()
    ctl, host = controller(process_group, "page_first",
                           {"socket_dir": d.dir, "timeout_ms": 2000, "retry_interval_s": 60})
    try:
        s = ctl.storage_backend
        c = s.store.client()
        real = c.hint
        tokens = list(range(4000, 4000 + 4 * PAGE))
        page_hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
        src = [page(host, p) for p in range(4)]
        assert backup(ctl, [0, 1, 2, 3], page_hashes) == 4 * PAGE

        def refused(keys):
            raise gdkv.Error("hint: invalid field", 0x02)

        monkeypatch.setattr(c, "hint", refused)
        with caplog.at_level(logging.DEBUG, logger="gdkv"):
            assert prefetch(ctl, tokens, 20) == (4 * PAGE, 4 * PAGE)
        assert [r.levelname for r in caplog.records if "hint" in r.getMessage()] == ["DEBUG"]
        for i in range(4):
            assert torch.equal(page(host, 20 + i), src[i])
        assert s.store.client() is c and s.store.failures == 0 and hinted(d) == 0

        def dies(keys):
            d.signal(signal.SIGKILL)
            d.proc.wait()
            return real(keys)

        monkeypatch.setattr(c, "hint", dies)
        assert prefetch(ctl, tokens, 24) == (4 * PAGE, 0)
        assert d.proc.poll() is not None and s.store.failures == 1
        assert s.store.client() is None and s.batch_exists(page_hashes) == 0
    finally:
        ctl.detach_storage_backend()
        d.stop()


# ---- failures ----

def test_gdkvd_killed_means_misses_then_a_new_gdkvd_is_used(gdkvd, caplog):
    caplog.set_level(logging.INFO, logger="gdkv")
    host = host_pool("mha/page_first")
    retry = 3.0
    s = storage(host, socket_dir=gdkvd.dir, retry_interval_s=retry, timeout_ms=2000)
    keys = hashes(4)
    src = [page(host, p) for p in range(4)]
    assert s.batch_set_v1(keys, indices([0, 1, 2, 3])) == [True] * 4
    pool_memfd = memfd_inode(s.layout.host.ctypes.data)
    assert pool_memfd is not None   # the host pool was shared in place at registration

    # Loads run in a loop while gdkvd is killed: each either loads exact bytes or reports a
    # miss; nothing raises.
    stop = threading.Event()
    seen = {"hit": 0, "miss": 0, "wrong": 0, "errors": []}

    def loads() -> None:
        while not stop.is_set():
            try:
                got = s.batch_get_v1(keys, indices([10, 11, 12, 13]))
            except Exception as e:  # noqa: BLE001 - any exception is the failure here
                seen["errors"].append(e)
                return
            for i, ok in enumerate(got):
                if ok:
                    seen["hit"] += 1
                    if not torch.equal(page(host, 10 + i), src[i]):
                        seen["wrong"] += 1
                else:
                    seen["miss"] += 1

    t = threading.Thread(target=loads)
    t.start()
    until(lambda: seen["hit"] >= 8 or seen["errors"], "8 hits")
    gdkvd.signal(signal.SIGKILL)
    gdkvd.proc.wait()
    until(lambda: seen["miss"] >= 8 or seen["errors"], "8 misses")
    stop.set()
    t.join(30)
    assert seen["errors"] == [] and seen["wrong"] == 0
    assert seen["hit"] >= 8 and seen["miss"] >= 8, seen
    assert s.store.failures == 1

    # gdkvd gone: every call is a miss or a failed set, answered without a client (the
    # connector makes none before retry_interval_s), so none waits for gdkvd.
    assert s.store.client() is None
    assert s.batch_exists(keys) == 0
    assert s.batch_get_v1(keys, indices([10, 11, 12, 13])) == [False] * 4
    assert s.batch_set_v1(keys, indices([0, 1, 2, 3])) == [False] * 4
    assert not s.exists(keys[0])
    assert s.get(keys[0]) is None and s.batch_get(keys) == [None] * 4
    assert not s.set(keys[0], host.get_data_page(0)) and not s.batch_set(keys, [src[0]] * 4)
    assert not s.clear()
    assert s.store.client() is None and s.store.failures == 1   # no call tried gdkv

    # A new gdkvd on the same socket directory: used once retry_interval_s has passed since
    # the connector gave gdkv up, not before (its log's times).
    gdkvd.start()   # the same command, on the same socket directory
    try:
        until(lambda: s.store.client() is not None, "the connector reconnected", retry + 60)
        gave_up = [r.created for r in caplog.records if "running without it" in r.getMessage()]
        connected = [r.created for r in caplog.records
                     if r.getMessage().startswith("gdkv: connected")]
        assert len(gave_up) == 1 and connected[-1] - gave_up[0] >= retry, (gave_up, connected)
        assert s.batch_exists(keys) == 0  # a new, empty gdkvd
        assert s.batch_set_v1(keys, indices([0, 1, 2, 3])) == [True] * 4
        assert s.batch_exists(keys) == 4
        assert s.batch_get_v1(keys, indices([20, 21, 22, 23])) == [True] * 4
        for i in range(4):
            assert torch.equal(page(host, 20 + i), src[i])
        assert s.store.failures == 1
        # The new client reaches the pool in place, on the same memory: shared again, not
        # copied (a copy would lose what SGLang writes meanwhile).
        c = s.store.client()
        assert c.reaches(s.layout.host) and c.copies() == (0, 0)
        assert memfd_inode(s.layout.host.ctypes.data) == pool_memfd
        s.close()
    finally:
        gdkvd.kill()


def test_no_gdkvd_at_startup_is_no_error(tmp_path):
    host = host_pool("mha/page_first")
    s = storage(host, socket_dir=str(tmp_path), retry_interval_s=60)
    keys = hashes(2)
    assert s.batch_exists(keys) == 0
    assert s.batch_set_v1(keys, indices([0, 1])) == [False, False]
    assert s.batch_get_v1(keys, indices([2, 3])) == [False, False]


def test_an_unknown_extra_config_key_is_an_error(gdkvd):
    """A misspelt key must not fall back to its default in silence; SGLang's own keys of the
    same dict are accepted."""
    host = host_pool("mha/page_first")
    with pytest.raises(ValueError, match="unknown key 'shared_memory_byte'"):
        storage(host, socket_dir=gdkvd.dir, shared_memory_byte=1 << 20)
    with pytest.raises(ValueError, match="nsid='one'"):
        storage(host, socket_dir=gdkvd.dir, nsid="one")
    s = storage(host, socket_dir=gdkvd.dir, prefetch_threshold=256, file_storage_path="/x")
    assert s.batch_set_v1(hashes(1), indices([0])) == [True]
    s.close()


def test_config_without_gdkv_is_an_error(monkeypatch):
    monkeypatch.delenv("GDKV_SOCKET_DIR", raising=False)
    with pytest.raises(ValueError, match="socket_dir"):
        storage(host_pool("mha/page_first"))


# ---- in-process gdkv: zero copy ----

@pytest.mark.parametrize("spec", ["mha/page_first", "mha/page_first_direct", "mha/page_head",
                                  "mla/page_first", "mla/page_first_direct"])
def test_in_process_is_zero_copy(spec):
    host = host_pool(spec)
    s = storage(host, backend="memory")
    keys = hashes(5)
    src = [page(host, p) for p in range(5)]
    assert s.batch_set_v1(keys, indices([0, 1, 2, 3, 4])) == [True] * 5
    assert s.batch_exists(keys) == 5
    assert s.batch_get_v1(keys, indices([15, 16, 17, 18, 19])) == [True] * 5
    for i in range(5):
        assert torch.equal(page(host, 15 + i), src[i])
    c = s.store.client()
    assert c is not None and not c.remote
    assert c.copies() == (0, 0)
    assert s.copies() == (0, 0)
    assert not s.layout.scattered


@pytest.mark.parametrize("spec", ["mha/layer_first", "mla/layer_first"])
def test_in_process_layer_first_loads_in_place_and_gathers_to_store(spec):
    host = host_pool(spec)
    s = storage(host, backend="memory")
    keys = hashes(3)
    src = [page(host, p) for p in range(3)]
    assert s.layout.scattered and len(s._page_keys(keys[0])) == 1
    assert s.batch_set_v1(keys, indices([0, 1, 2])) == [True] * 3
    # Storing gathers each page's runs (2 x layers, or layers for MLA) into one value.
    assert s.copies() == (3, 3 * s.layout.page_bytes)
    assert s.batch_get_v1(keys, indices([5, 6, 7])) == [True] * 3
    for i in range(3):
        assert torch.equal(page(host, 5 + i), src[i])
    assert s.copies() == (3, 3 * s.layout.page_bytes)  # loading scattered in place: no copy
    assert s.store.client().copies() == (0, 0)
