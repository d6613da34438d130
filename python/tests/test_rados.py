"""The package on the real Ceph cluster scripts/test starts (in-process RADOS backend)."""

from __future__ import annotations

import subprocess
import time

import numpy as np
import pytest

import gdkv
from conftest import ROOT, require_ceph
from gdkv.engine import EngineStore


def test_rados_roundtrip_and_batches():
    conf = require_ceph()
    with gdkv.open("rados", pool="gdkv-rep3", ceph_conf=conf) as c:
        keys = gdkv.chain_keys(np.arange(64 * 4), 64, "pytest-rados")
        for k in keys:
            c.delete(k, missing_ok=True)
        vals = [np.full(8192, i, np.uint8) for i in range(4)]
        assert c.put_many(zip(keys[:3], vals[:3])) == [None] * 3
        assert c.lookup_prefix(keys) == 3
        outs = [c.empty(8192, np.uint8) for _ in range(4)]
        got = c.get_many_into(keys, outs)
        assert got[:3] == [8192] * 3 and isinstance(got[3], gdkv.KeyNotFoundError)
        assert all(np.array_equal(outs[i], vals[i]) for i in range(3))
        with pytest.raises(KeyError):
            c.get(keys[3])
        for k in keys[:3]:
            assert c.delete(k)


def test_rados_missing_pool_is_a_clear_error():
    conf = require_ceph()
    with pytest.raises(gdkv.Error, match="gdkv-no-such-pool"):
        gdkv.open("rados", pool="gdkv-no-such-pool", ceph_conf=conf)


def test_tiered_node_reads_what_another_node_stored_and_keeps_it_locally(tmp_path):
    """Node A (RADOS only) stores blocks; node B (local store in front of the same pool) reads
    them byte-exact from RADOS the first time and keeps them in its local tier."""
    conf = require_ceph()
    keys = gdkv.chain_keys(np.arange(64 * 3), 64, "pytest-tiered")
    vals = [np.random.default_rng(i).integers(0, 256, 65536, dtype=np.uint8) for i in range(3)]
    with gdkv.open("rados", pool="gdkv-rep3", ceph_conf=conf) as a:
        for k in keys:
            a.delete(k, missing_ok=True)
        assert a.put_many(zip(keys, vals)) == [None] * 3
    with gdkv.open("tiered", store=str(tmp_path / "b"), capacity=64 << 20, pool="gdkv-rep3",
                   ceph_conf=conf) as b:
        assert b.lookup_prefix(keys) == 3
        for k, v in zip(keys, vals):
            assert np.array_equal(np.frombuffer(b.get(k), np.uint8), v)
    # The local tier alone now holds them.
    with gdkv.open("local", store=str(tmp_path / "b"), capacity=64 << 20) as local:
        for k, v in zip(keys, vals):
            assert np.array_equal(np.frombuffer(local.get(k), np.uint8), v)
    with gdkv.open("rados", pool="gdkv-rep3", ceph_conf=conf) as a:
        for k in keys:
            assert a.delete(k)


def _cluster(*args: str) -> None:
    subprocess.run([str(ROOT / "scripts" / "ceph-cluster"), *args], check=True,
                   stdout=subprocess.DEVNULL)


def test_engine_store_in_process_rados_frozen_cluster_is_a_miss():
    """An in-process RADOS backend under a connector: every daemon SIGSTOPped, a call returns the
    miss within the connector's timeout_ms (the backend's op timeout, which EngineStore sets
    from it), not after librados' default; after SIGCONT the same store serves again."""
    conf = require_ceph()
    store = EngineStore({"backend": "rados", "pool": "gdkv-rep3", "ceph_conf": conf,
                         "timeout_ms": 1000, "retry_interval_s": 0.2})
    assert store.open_options["ceph_timeout_ms"] == 1000
    key, value = b"pytest-frozen", np.arange(4096, dtype=np.uint8)
    assert store.call(lambda c: c.put(key, value), False) is None
    try:
        _cluster("freeze")
        t0 = time.monotonic()
        assert store.call(lambda c: c.get(key), None) is None
        waited = time.monotonic() - t0
        # (librados rounds the op timeout up to whole seconds; the backend's default is 5 s)
        assert waited < 3.5, f"a call on a frozen cluster took {waited:.1f} s"
        assert store.failures == 1
    finally:
        _cluster("thaw")
    _cluster("wait-clean", "120")
    deadline = time.monotonic() + 30
    got = None
    while got is None and time.monotonic() < deadline:
        got = store.call(lambda c: c.get(key), None)
        time.sleep(0.1)
    assert got == value.tobytes()
    assert store.call(lambda c: c.delete(key), False)
    store.close()
