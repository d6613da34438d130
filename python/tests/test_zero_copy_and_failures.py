"""Zero copy asserted (the copy counter and the destination's own memory), and a gdkvd that dies
or freezes mid-call (an exception within the timeout, never a hang or a crash)."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest
import torch

import gdkv
from conftest import Gdkvd, until


def test_in_process_reaches_any_host_buffer():
    with gdkv.open("memory") as c:
        v = torch.arange(4096, dtype=torch.int32)
        c.put(b"k", v)
        out = torch.zeros(4096, dtype=torch.int32)
        ptr = out.data_ptr()
        assert c.get_into(b"k", out) == 4 * 4096
        assert out.data_ptr() == ptr and torch.equal(out, v)  # written where it is
        arr = np.zeros(4096, np.int32)
        c.get_into(b"k", arr)
        assert np.array_equal(arr, v.numpy())
        assert c.reaches(arr) and c.copies() == (0, 0)
        assert c.metrics()["client_staged_copies_total"] == 0


def test_through_gdkvd_shared_memory_is_zero_copy(gdkvd):
    with gdkv.connect(gdkvd.dir) as c:
        src = c.empty(1 << 20, torch.uint8)
        src.copy_(torch.randint(0, 255, (1 << 20,), dtype=torch.uint8))
        c.put(b"big", src)
        dst = c.empty((1024, 1024), torch.uint8)
        dst.fill_(7)
        ptr = dst.data_ptr()
        assert c.get_into(b"big", dst) == 1 << 20
        assert dst.data_ptr() == ptr and torch.equal(dst.flatten(), src)
        parts = [c.empty(1 << 19, np.uint8), c.empty(1 << 19, np.uint8)]
        c.get_into(b"big", parts)
        assert np.array_equal(np.concatenate(parts), src.numpy())
        dst.fill_(0)
        assert c.get_many_into([b"big"], [dst]) == [1 << 20]
        assert torch.equal(dst.flatten(), src)
        assert c.copies() == (0, 0)
        # A buffer outside shared memory is staged: it works, and is counted.
        plain = bytearray(1 << 20)
        assert not c.reaches(plain)
        c.get_into(b"big", plain)
        assert plain == src.numpy().tobytes()
        assert c.copies() == (1, 1 << 20)
        # Spreading a value over plain buffers cannot be done in place: a clear error.
        with pytest.raises(ValueError, match="empty"):
            c.get_into(b"big", [bytearray(10), bytearray(10)])


def test_empty_memory_outlives_the_client(gdkvd):
    c = gdkv.connect(gdkvd.dir)
    a = c.empty(4096, np.uint8)
    c.put(b"k", b"x" * 4096)
    c.get_into(b"k", a)
    c.close()
    assert bytes(a[:4]) == b"xxxx"  # still mapped while the array lives
    del a


def test_daemon_killed_mid_call_raises_in_bounded_time(gdkvd):
    c = gdkv.connect(gdkvd.dir, timeout_ms=60000)
    c.put(b"k", b"v" * 4096)
    gdkvd.signal(signal.SIGSTOP)  # the next call is in flight when gdkvd dies
    result = {}

    def call():
        t0 = time.monotonic()
        try:
            c.get(b"k")
        except Exception as e:  # noqa: BLE001 - checked below
            result["error"] = e
        result["done"] = time.monotonic()
        result["start"] = t0

    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.2)
    killed = time.monotonic()
    gdkvd.signal(signal.SIGKILL)
    t.join(10)
    assert not t.is_alive()
    assert isinstance(result["error"], gdkv.ConnectionError)
    assert isinstance(result["error"], ConnectionError)
    assert result["done"] >= killed  # the call waited until gdkvd died...
    assert result["done"] - killed < 2.0  # ...and not much longer
    t0 = time.monotonic()
    with pytest.raises(gdkv.ConnectionError):
        c.exists(b"k")
    with pytest.raises(gdkv.ConnectionError):
        c.lookup_prefix([b"k", b"j"])
    with pytest.raises(gdkv.ConnectionError):  # a batch of a failed client raises, not per key
        c.put_many([(b"k", b"v"), (b"j", b"w")])
    assert time.monotonic() - t0 < 0.5
    c.close()


def test_staged_reads_deliver_only_the_value(gdkvd):
    """A buffer outside shared memory gets the value's bytes, nothing of what the stand-in held
    before, and nothing at all when the key is missing."""
    with gdkv.connect(gdkvd.dir) as c:
        c.put(b"long", b"S" * 4096)
        c.get(b"long")  # leaves S bytes in the staging memory
        c.put(b"short", b"ab")
        buf = bytearray(b"Z" * 4096)
        assert c.get_into(b"short", buf) == 2
        assert buf == b"ab" + b"Z" * 4094
        buf = bytearray(b"Z" * 4096)
        with pytest.raises(KeyError):
            c.get_into(b"missing", buf)
        assert buf == b"Z" * 4096
        [missing] = c.get_many_into([b"missing"], [buf])
        assert isinstance(missing, gdkv.KeyNotFoundError)
        assert buf == b"Z" * 4096


def test_batch_larger_than_the_shared_memory(gdkvd):
    """Staged buffers beyond the shared memory go in several rounds, not a wait for itself."""
    with gdkv.connect(gdkvd.dir, shared_memory_bytes=4 << 20) as c:
        vals = [bytes([i]) * (2 << 20) for i in range(3)]
        t0 = time.monotonic()
        assert c.put_many([(f"big{i}", v) for i, v in enumerate(vals)]) == [None] * 3
        outs = [bytearray(2 << 20) for _ in range(3)]
        assert c.get_many_into([f"big{i}" for i in range(3)], outs) == [2 << 20] * 3
        assert [bytes(o) for o in outs] == vals
        assert time.monotonic() - t0 < 5
        # A buffer that can never fit: CapacityError at once, naming the setting.
        t0 = time.monotonic()
        with pytest.raises(gdkv.CapacityError, match="shared_memory_bytes"):
            c.put(b"huge", bytes(8 << 20))
        assert time.monotonic() - t0 < 5


def test_close_while_gdkvd_is_frozen(gdkvd):
    c = gdkv.connect(gdkvd.dir, timeout_ms=300)
    c.put(b"k", b"v")
    a = c.empty(4096, np.uint8)
    gdkvd.signal(signal.SIGSTOP)
    with pytest.raises(gdkv.TimeoutError, match="unusable"):
        c.get_into(b"k", a)
    t0 = time.monotonic()
    with pytest.raises(gdkv.TimeoutError):  # failed for good, at once, nothing staged
        c.put(b"k2", bytes(1 << 20))
    with pytest.raises(gdkv.Error):  # no more shared memory is handed out
        c.empty(4096, np.uint8)
    c.close()
    del a
    assert time.monotonic() - t0 < 2
    gdkvd.signal(signal.SIGCONT)


def test_a_read_a_timeout_left_behind_never_writes():
    """A client that gave up on gdkvd is not written any more: the read it timed out on sat in
    the frozen gdkvd's queue, and when gdkvd runs again it must not land in the client's memory
    (in a KV cache shared in place, the engine has put other KV in those pages by then). The
    client marks its connection revoked in the doorbell page before it raises. Without that,
    gdkvd's reactor (here one that never sleeps) fetched the read before the connection's
    teardown stopped it in about a third of the rounds: ten rounds."""
    d = Gdkvd("--backend", "memory", "--never-sleep", metrics=True)
    try:
        value = bytes([7]) * 65536
        with gdkv.connect(d.dir) as w:
            w.put(b"k", value)
        for _ in range(10):
            c = gdkv.connect(d.dir, timeout_ms=300)
            out = c.empty(65536, np.uint8)
            out[:] = 0
            until(lambda: d.metrics()["gdkv_vfio_user_clients"] == 1, "one connection: c's")
            fetched = d.metrics()["gdkv_vfio_user_io_commands_total"]
            d.signal(signal.SIGSTOP)
            with pytest.raises(gdkv.TimeoutError):
                c.get_into(b"k", out)
            d.signal(signal.SIGCONT)
            # gdkvd tears a connection down only once every command of it that started has
            # completed: with the connection gone, a late write would have landed by now.
            until(lambda: d.metrics()["gdkv_vfio_user_clients"] == 0,
                  "gdkvd tore the abandoned connection down", timeout_s=60)
            assert not out.any(), f"{int(np.count_nonzero(out))} bytes written after the timeout"
            assert d.metrics()["gdkv_vfio_user_io_commands_total"] == fetched, "read fetched"
            c.close()
        with gdkv.connect(d.dir) as c2:   # gdkvd serves on
            assert c2.get(b"k") == value
    finally:
        d.stop()


def test_close_of_an_idle_client_while_gdkvd_is_frozen(gdkvd):
    """No call failed before: closing still must not wait for ever on the frozen daemon."""
    c = gdkv.connect(gdkvd.dir, timeout_ms=300)
    c.put(b"k", b"v")
    gdkvd.signal(signal.SIGSTOP)
    t0 = time.monotonic()
    c.close()
    assert time.monotonic() - t0 < 3
    gdkvd.signal(signal.SIGCONT)


def test_close_waits_for_calls_in_flight(gdkvd):
    c = gdkv.connect(gdkvd.dir)
    errors = []
    resumed = []

    def call():
        try:
            c.put(b"k", b"v")  # waits while gdkvd is stopped
        except Exception as e:  # noqa: BLE001 - checked below
            errors.append(e)

    def resume():
        resumed.append(True)
        gdkvd.signal(signal.SIGCONT)

    gdkvd.signal(signal.SIGSTOP)
    t = threading.Thread(target=call)
    t.start()
    # The put stages its value (a copy into shared memory) inside the call, before it waits.
    until(lambda: c.copies()[0] == 1, "the put waiting inside the client")
    threading.Timer(0.5, resume).start()
    c.close()  # waits for the put, which completes once gdkvd runs again
    assert resumed, "close returned while gdkvd was stopped, with the put still waiting"
    t.join(60)
    assert not t.is_alive()
    assert errors == []   # the put completed: close did not cut it off
    with pytest.raises(gdkv.ClosedError):
        c.get(b"k")
    with gdkv.connect(gdkvd.dir) as c2:
        assert c2.get(b"k") == b"v"


def test_frozen_daemon_times_out(gdkvd):
    c = gdkv.connect(gdkvd.dir, timeout_ms=300)
    c.put(b"k", b"v")
    gdkvd.signal(signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(gdkv.TimeoutError) as e:
        c.get_many([b"k", b"k2"])
    waited = time.monotonic() - t0
    assert isinstance(e.value, TimeoutError)
    assert 0.3 <= waited < 3.0
    with pytest.raises(gdkv.TimeoutError):  # the client stays failed
        c.exists(b"k")
    c.close()
    gdkvd.signal(signal.SIGCONT)
    with gdkv.connect(gdkvd.dir) as c2:  # a new connection works
        assert c2.get(b"k") == b"v"
