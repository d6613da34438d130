"""Scheduler hints: Client.hint / ahint on each kind of client (in-process memory and
local store, and through a real gdkvd), good and bad input, and a hint through gdkvd on a tiered
node (local store over the real Ceph cluster) that brings blocks only RADOS holds into DRAM."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import gdkv
from conftest import Gdkvd, require_ceph


def test_hint_then_read(client):
    keys = [b"blk-%04d" % i for i in range(64)]
    for i, k in enumerate(keys):
        client.put(k, bytes([i]) * 4096)
    assert client.hint(keys) is None
    for i, k in enumerate(keys):
        assert client.get(k) == bytes([i]) * 4096
    m = client.metrics()
    if "cache_hint_keys_total" in m:  # in-process clients see the cache's metrics
        assert m["cache_hint_keys_total"] == 64


def test_hint_for_keys_stored_nowhere_changes_nothing(client):
    client.put(b"here", b"v")
    client.hint([b"nowhere-%d" % i for i in range(100)])
    assert not client.exists(b"nowhere-0")
    assert client.get(b"here") == b"v"
    assert client.list() == [b"here"]


def test_hint_bad_input(client):
    with pytest.raises(ValueError):
        client.hint([])
    for bad in (b"", b"x" * 17):
        with pytest.raises(gdkv.InvalidKeyError):
            client.hint([b"ok", bad])
    with pytest.raises(gdkv.Error) as e:
        client.hint([b"k%015d" % i for i in range(5000)])  # 5000 * 20 bytes > 64 KiB
    assert e.value.status == 0x02
    # The client still works after refused hints.
    client.put(b"after", b"1")
    client.hint([b"after"])
    assert client.get(b"after") == b"1"


def test_ahint(client):
    client.put(b"a", b"1")

    async def main():
        await client.ahint([b"a", b"b"])
        return await client.aget(b"a")

    assert asyncio.run(main()) == b"1"


def test_hint_reaches_the_cache():
    with gdkv.open("memory", cache_bytes=1 << 20, prefetch_depth=0) as c:
        c.put(b"warm", b"w" * 4096)
        c.hint([b"warm", b"ghost-1", b"ghost-2"])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            m = c.metrics()
            if m.get("cache_prefetch_failed_total") == 2 and m.get("cache_prefetch_inflight") == 0:
                break
            time.sleep(0.01)
        m = c.metrics()
        assert m["cache_hint_keys_total"] == 3
        assert m["cache_prefetch_failed_total"] == 2  # stored nowhere: one failed read each
        assert not c.exists(b"ghost-1")
        assert c.get(b"warm") == b"w" * 4096


def test_hint_through_gdkvd_on_a_tiered_node_lands_in_dram(tmp_path):
    """Another node stored 16 blocks in RADOS. This node's gdkvd (DRAM cache over a local store
    over the same pool) is told they will be read: they come up from RADOS into DRAM before the
    reads, which are then cache hits, byte-exact."""
    conf = require_ceph()
    keys = gdkv.chain_keys(np.arange(16 * 16), 16, "pytest-hint-tiered")
    vals = [np.random.default_rng(i).integers(0, 256, 65536, dtype=np.uint8) for i in range(16)]
    with gdkv.open("rados", pool="gdkv-rep3", ceph_conf=conf) as a:
        assert a.put_many(zip(keys, vals)) == [None] * 16
    d = Gdkvd("--backend", "tiered", "--store", str(tmp_path / "near"), "--capacity",
              str(64 << 20), "--pool", "gdkv-rep3", "--ceph-conf", conf,
              "--cache-bytes", str(8 << 20), metrics=True)
    try:
        with gdkv.connect(d.dir) as c:
            before = d.metrics()
            assert before["gdkv_cache_entries"] == 0
            c.hint(keys)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                m = d.metrics()
                if m["gdkv_cache_entries"] == 16 and m["gdkv_cache_prefetch_inflight"] == 0:
                    break
                time.sleep(0.02)
            m = d.metrics()
            assert m["gdkv_cache_hint_keys_total"] == 16
            assert m['gdkv_cache_prefetch_issued_total{source="hint"}'] == 16
            assert m["gdkv_cache_entries"] == 16
            for k, v in zip(keys, vals):
                assert np.array_equal(np.frombuffer(c.get(k), np.uint8), v)
            after = d.metrics()
            assert after["gdkv_cache_hits_total"] - m["gdkv_cache_hits_total"] == 16
            assert after["gdkv_cache_misses_total"] == m["gdkv_cache_misses_total"]
            assert after["gdkv_cache_prefetch_used_total"] == 16
    finally:
        d.stop()
        with gdkv.open("rados", pool="gdkv-rep3", ceph_conf=conf) as a:
            gdkv.raise_first(a.delete_many(keys))
