"""The package on the real Ceph cluster scripts/test starts (in-process RADOS backend)."""

from __future__ import annotations

import numpy as np
import pytest

import gdkv
from conftest import require_ceph


def test_rados_roundtrip_and_batches():
    conf = require_ceph()
    with gdkv.open("rados", pool="gdkv-rep3", ceph_conf=conf) as c:
        keys = gdkv.chain_keys(np.arange(64 * 4), 64, "pytest-rados")
        for k in keys:
            c.delete(k, missing_ok=True)
        vals = [np.full(8192, i, np.uint8) for i in range(4)]
        c.put_many(zip(keys[:3], vals[:3]))
        assert c.lookup_prefix(keys) == 3
        outs = [c.empty(8192, np.uint8) for _ in range(4)]
        assert c.get_many_into(keys, outs) == [8192, 8192, 8192, None]
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
        a.put_many(zip(keys, vals))
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
