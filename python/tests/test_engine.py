"""gdkv.engine's transfer layer as the three connectors use it: per-key results (one failed key
fails only itself), where staging is needed and how much of it one batch takes, and the
counters every connector keeps (Stats)."""

from __future__ import annotations

import json
import logging
import threading

import numpy as np
import pytest

import gdkv
from gdkv.engine import EngineStore, Stats, read_config

from conftest import fail_for


def test_a_failed_key_fails_only_itself_in_every_transfer_call(caplog):
    store = EngineStore({"backend": "memory", "max_value_bytes": 4096})
    c = store.client()
    keys = [bytes([i]) * 16 for i in range(4)]
    values = [np.full(1024, i, np.uint8) for i in range(4)]
    values[2] = np.zeros(8192, np.uint8)   # over max_value_bytes: refused, the others stored
    with caplog.at_level(logging.DEBUG, "gdkv.engine"):
        assert store.put(c, keys, lambda i: values[i]) == [True, True, False, True]
    assert [r.levelname for r in caplog.records].count("WARNING") == 1   # noted once
    assert store.present(c, keys) == [True, True, False, True]
    assert store.leading(c, keys) == 2
    outs = [np.zeros(1024, np.uint8) for _ in keys]
    whole, held = store.load(c, keys, outs, [1024, 1024, 1024, 512])
    # The missing one is neither whole nor held; the one of another length is held, a miss.
    assert whole == [True, True, False, False] and held == [3]
    assert all(np.array_equal(outs[i], values[i]) for i in (0, 1))
    assert store.delete(c, keys) == 0 and store.present(c, keys) == [False] * 4
    assert store.put(c, [], lambda i: values[i]) == []


def test_a_key_that_finds_gdkv_unavailable_fails_the_batch(monkeypatch):
    """A key's NotReadyError (82h: the RADOS cluster behind gdkvd is not reachable) says nothing
    of the value: the whole call is a miss and the client is dropped (retried later), as when
    the whole client fails; a key that found no shared memory (CapacityError) is a miss, not
    held (a connector deletes what load() says is held: test_vllm.py's
    test_a_key_gdkv_cannot_serve_now_is_a_miss_and_is_not_deleted). A value of another length
    is held."""
    store = EngineStore({"backend": "memory", "retry_interval_s": 60})
    c = store.client()
    keys = [bytes([i]) * 16 for i in range(3)]
    assert store.put(c, keys, lambda i: np.full(64, i, np.uint8)) == [True] * 3
    outs = [np.zeros(64, np.uint8) for _ in keys]
    with monkeypatch.context() as m:
        fail_for(c, m, "get_many_into", keys[1],
                 gdkv.CapacityError("no shared memory", 0x81, keys[1]))
        whole, held = store.load(c, keys, outs, [64, 64, 32])
    assert whole == [True, False, False] and held == [2]
    not_ready = gdkv.NotReadyError("RADOS is not reachable", 0x82, keys[1])
    for method, call in [("get_many_into", lambda cl: store.load(cl, keys, outs, [64] * 3)),
                         ("exists_many", lambda cl: store.present(cl, keys)),
                         ("put_many", lambda cl: store.put(cl, keys, lambda i: outs[i])),
                         ("lookup", lambda cl: store.leading(cl, keys))]:
        assert store.client() is c
        with monkeypatch.context() as m:
            fail_for(c, m, method, keys[1], not_ready)
            assert store.call(call, "miss") == "miss", method
        assert store.client() is None, method   # dropped: connected again later
        store._client = c               # (this test's shortcut past the retry interval)
    store.close()


def test_settings_out_of_range_are_refused_when_read_and_never_stop_the_connect_thread(caplog):
    for config, why in [({"capacity": 0}, r"capacity=0 .*must be in \[1, "),
                        ({"backend": "memroy"}, "backend='memroy' .*not one of"),
                        ({"cache_policy": "lfu"}, "cache_policy='lfu' .*not one of"),
                        ({"timeout_ms": 0}, r"timeout_ms=0 .*must be in \[1, "),
                        ({"evict_high_percent": "101"}, r"must be in \[1, 100\]")]:
        with pytest.raises(ValueError, match=why):
            read_config(config, {}, "a test config")
    # A store opened with settings open() refuses (EngineStore itself reads no ranges): the
    # connect thread logs it and keeps running without gdkv; it never raises into the engine.
    with caplog.at_level(logging.WARNING, "gdkv.engine"):
        store = EngineStore({"backend": "memory", "capacity": 0, "timeout_ms": 100})
    assert store.client() is None and "capacity" in caplog.text
    store.close()


def test_reaches_and_staging_rows_in_process():
    store = EngineStore({"backend": "memory", "staging_bytes": 10 << 20,
                         "shared_memory_bytes": 1 << 20})
    c = store.client()
    # In-process the controller reaches any host memory: nothing is staged.
    assert store.reaches(c, [np.zeros(64, np.uint8), bytearray(64)])
    # staging_bytes alone bounds a batch in-process (the shared memory is gdkvd's only).
    assert store.staging_rows(c, 1 << 20) == 10
    assert store.staging_rows(c, 3 << 20) == 3
    assert store.staging_rows(c, 64 << 20) == 1   # at least one value a round


def test_reaches_and_staging_rows_through_gdkvd(gdkvd):
    store = EngineStore({"socket_dir": gdkvd.dir, "staging_bytes": 10 << 20,
                         "shared_memory_bytes": 8 << 20})
    try:
        c = store.client()
        plain, shared = np.zeros(4096, np.uint8), c.empty(4096)
        assert store.reaches(c, [shared]) and not store.reaches(c, [shared, plain])
        # Through gdkvd at most half the shared memory, whatever staging_bytes says.
        assert store.staging_rows(c, 1 << 20) == 4
        assert store.staging_rows(c, 16 << 20) == 1
        # Memory shared with gdkvd (share) is reached in place by this client and later ones.
        pool = np.zeros(1 << 20, np.uint8)
        assert store.share(pool) and store.reaches(c, [pool])
    finally:
        store.close()


def test_staged_values_are_gathered_and_scattered_byte_exact_in_rounds(gdkvd, monkeypatch):
    """put_gathered and load_staged: values laid out across buffers gdkvd does not reach move
    through the staging (here three rows: rounds of three), byte-exact both ways; a value that
    is missing, of another length or failing is not copied out, and one failing key fails only
    itself. The staging is reserved once per client and counted in copies()."""
    store = EngineStore({"socket_dir": gdkvd.dir, "staging_bytes": 3 * 1024})
    try:
        c = store.client()
        rng = np.random.default_rng(7)
        pools = [rng.integers(0, 256, 4096, dtype=np.uint8) for _ in range(2)]
        assert not store.reaches(c, pools)

        def parts(pool, i):   # value i: two runs of 256 bytes of each pool, 1024 in all
            return [p[256 * i + 2048 * j:][:256] for p in pool for j in range(2)]

        keys = [bytes([i]) * 16 for i in range(7)]
        assert store.put_gathered(c, keys, lambda i: parts(pools, i), 1024) == [True] * 7
        stage = store.staging(c, 1024)
        assert stage.shape == (3, 1024) and store.reaches(c, [stage])
        assert store.copies() == (7, 7 * 1024)
        for i, k in enumerate(keys):
            assert c.get(k) == np.concatenate(parts(pools, i)).tobytes()
        c.put(keys[5], b"short")
        fail_for(c, monkeypatch, "get_many_into", keys[3])
        outs = [[np.zeros(256, np.uint8) for _ in range(4)] for _ in range(8)]
        whole, held = store.load_staged(c, keys + [b"m" * 16], outs, [1024] * 8)
        assert whole == [True, True, True, False, True, False, True, False]
        assert held == [3, 5]
        for i in (0, 1, 2, 4, 6):
            assert np.array_equal(np.concatenate(outs[i]), np.concatenate(parts(pools, i)))
        for i in (3, 5, 7):
            assert not np.concatenate(outs[i]).any()   # nothing copied out
        # ...and the client's own: the put of b"short" (a bytes object) was staged.
        assert c.copies() == (1, 5) and store.copies() == (13, 12 * 1024 + 5)
        # The engine's own scatter (CUDA pages): the rows of the whole values, and theirs.
        seen = []
        store.load_staged(c, keys[:4], None, [1024] * 4,
                          lambda st, rows, idx: seen.extend(
                              (i, st[r].tobytes()) for r, i in zip(rows, idx)))
        assert [i for i, _ in seen] == [0, 1, 2]
        assert all(v == c.get(keys[i]) for i, v in seen)
        assert store.staging(c, 1024).ctypes.data == stage.ctypes.data   # kept, not reserved again
        # A smaller row takes as many rows of the memory kept as the budget allows; only a row
        # larger than that memory reserves anew. An empty batch reserves nothing.
        smaller = store.staging(c, 700)
        assert smaller.shape == (4, 700) and smaller.ctypes.data == stage.ctypes.data
        assert store.load_staged(c, [], [], []) == ([], [])
        assert store.put_gathered(c, [], lambda i: [], 1024) == []
        assert store.staging(c, 1024).ctypes.data == stage.ctypes.data
        assert store.staging(c, 4096).shape == (1, 4096)
        # A dropped client's staging goes with it (its shared memory is freed once unused).
        store.fail(c, gdkv.ConnectionError("gone", 0))
        assert store._staging is None
    finally:
        store.close()


def test_stats_add_from_many_threads_and_write(tmp_path, caplog):
    stats = Stats(loaded=0, load_s=0.0)
    assert stats["loaded"] == 0 and stats["never_added"] == 0

    def add() -> None:
        for _ in range(5000):
            stats.add(loaded=1, load_s=0.5)

    threads = [threading.Thread(target=add) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stats.snapshot() == {"loaded": 40000, "load_s": 20000.0}
    assert stats.add(loaded=2, other=1) == {"loaded": 40002, "other": 1}
    path = tmp_path / "stats.json"
    stats.write(str(path), rank=3)
    assert json.loads(path.read_text()) == {"loaded": 40002, "load_s": 20000.0, "other": 1,
                                            "rank": 3}
    # A file that cannot be written is logged, not raised (the engine goes on).
    with caplog.at_level(logging.WARNING, "gdkv.engine"):
        stats.write(str(tmp_path / "no" / "such" / "dir.json"))
    assert "cannot write the counters" in caplog.text
