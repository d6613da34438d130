"""Every call of gdkv.Client, good and bad input, on each kind of client (in-process memory and
local store, and through a real gdkvd)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

import gdkv
from conftest import Gdkvd


def test_roundtrip(client):
    client.put(b"alpha", b"one")
    client.put("beta", bytearray(b"two"))
    client.put(b"\x00\xff", memoryview(b"three"))
    assert client.get(b"alpha") == b"one"
    assert client.get("beta") == b"two"
    assert client.exists(b"\x00\xff")
    assert not client.exists(b"gamma")
    assert client.list() == [b"\x00\xff", b"alpha", b"beta"]
    assert client.list(prefix=b"al") == [b"alpha"]
    assert client.delete(b"alpha") is True
    assert client.delete(b"alpha", missing_ok=True) is False
    with pytest.raises(KeyError) as e:
        client.delete(b"alpha")
    assert e.value.status == 0x87 and e.value.key == b"alpha"
    with pytest.raises(gdkv.KeyNotFoundError):
        client.get(b"alpha")
    # Values larger than the size hint, and empty values.
    big = np.random.default_rng(1).integers(0, 255, 3 << 20, dtype=np.uint8)
    client.put(b"big", big)
    assert client.get(b"big") == big.tobytes()
    client.put(b"empty", b"")
    assert client.get(b"empty") == b""


def test_store_options(client):
    client.put(b"k", b"1", must_not_exist=True)
    with pytest.raises(gdkv.KeyExistsError):
        client.put(b"k", b"2", must_not_exist=True)
    client.put(b"k", b"3", must_exist=True)
    with pytest.raises(gdkv.KeyNotFoundError):
        client.put(b"other", b"4", must_exist=True)
    assert client.get(b"k") == b"3"
    with pytest.raises(ValueError):
        client.put(b"k", b"5", must_exist=True, must_not_exist=True)


@pytest.mark.parametrize("key", [b"", b"x" * 17, "", "é" * 9])
def test_bad_key_sizes(client, key):
    for call in (lambda: client.put(key, b"v"), lambda: client.get(key),
                 lambda: client.exists(key), lambda: client.delete(key),
                 lambda: client.get_into(key, bytearray(4)), lambda: client.lookup_prefix([key])):
        with pytest.raises(gdkv.InvalidKeyError) as e:
            call()
        assert isinstance(e.value, ValueError) and e.value.status == 0x86


@pytest.mark.parametrize("key", [None, 5, 1.5, ["k"], object()])
def test_bad_key_types(client, key):
    with pytest.raises(TypeError):
        client.put(key, b"v")
    with pytest.raises(TypeError):
        client.exists_many([b"ok", key])


def test_bad_buffers(client):
    client.put(b"k", b"0123456789")
    with pytest.raises(TypeError, match="read-only"):
        client.get_into(b"k", b"0123456789")
    with pytest.raises(TypeError, match="read-only"):
        ro = np.zeros(10, np.uint8)
        ro.flags.writeable = False
        client.get_into(b"k", ro)
    with pytest.raises(TypeError):
        client.get_into(b"k", 42)
    with pytest.raises(TypeError):
        client.put(b"k", 42)
    with pytest.raises(TypeError):
        client.put(b"k", "text is not bytes")
    with pytest.raises(ValueError, match="contiguous"):
        client.get_into(b"k", np.zeros(20, np.uint8)[::2])
    with pytest.raises(ValueError, match="contiguous"):
        client.get_into(b"k", torch.zeros(20, dtype=torch.uint8)[::2])
    with pytest.raises(ValueError, match="contiguous"):
        client.put(b"k", torch.zeros((4, 4)).t())
    # Too small: an error, unless partial, which gets the first bytes and the full length.
    small = bytearray(4)
    with pytest.raises(gdkv.ValueSizeError) as e:
        client.get_into(b"k", small)
    assert isinstance(e.value, ValueError)
    assert client.get_into(b"k", small, partial=True) == 10
    assert small == b"0123"
    assert client.get(b"k") == b"0123456789"  # nothing was lost


def test_get_into_numpy_torch_and_scatter(client):
    value = np.arange(1024, dtype=np.float32)
    client.put(b"v", value)
    out = np.zeros(1024, np.float32)
    assert client.get_into(b"v", out) == 4096
    assert np.array_equal(out, value)
    t = torch.zeros(1024, dtype=torch.float32)
    client.get_into(b"v", t)
    assert torch.equal(t, torch.from_numpy(value))
    # One value into several buffers, in order.
    parts = [client.empty(100, np.float32), client.empty(900, np.float32),
             client.empty(24, np.float32)]
    assert client.get_into(b"v", parts) == 4096
    assert np.array_equal(np.concatenate(parts), value)
    with pytest.raises(ValueError):
        client.get_into(b"v", [])


def test_lookup_prefix_stops_early_and_delete_many():
    """lookup_prefix asks in rounds of 16, 32, 64... and stops after the round with the first
    missing key (counted by the controller's Exist commands); delete_many deletes in one round,
    a missing key failing only itself."""
    with gdkv.open("memory") as c:
        def exists_sent() -> float:
            return c.metrics()['commands_total{reactor="0",op="exist"}']

        keys = gdkv.chain_keys(range(1000 * 4), 4, "early-stop")
        c.put_many((k, b"v") for k in keys[:3])
        before = exists_sent()
        assert c.lookup_prefix(keys) == 3
        assert exists_sent() - before == 16       # one round, not 1000 Exists
        c.put_many((k, b"v") for k in keys[3:100])
        before = exists_sent()
        assert c.lookup_prefix(keys) == 100
        assert exists_sent() - before == 16 + 32 + 64   # rounds up to the one with key 100
        before = exists_sent()
        assert c.lookup_prefix(keys[:100]) == 100
        assert exists_sent() - before == 100     # every key, the last round cut to what is left
        assert c.delete_many(keys[98:102], missing_ok=True) == [None] * 4
        assert c.lookup_prefix(keys) == 98
        assert c.lookup(keys) == (98, None)
        deleted, missing = c.delete_many([keys[0], keys[500]])
        assert deleted is None and not c.exists(keys[0])
        assert isinstance(missing, gdkv.KeyNotFoundError) and missing.key == keys[500]
        assert c.delete_many([]) == []


def test_a_failed_key_fails_only_itself():
    """put_many stores every value but the one the controller refuses (over its largest value
    size: 85h), which gets its ValueSizeError in its place; raise_first raises it."""
    with gdkv.open("memory", max_value_bytes=1 << 16) as c:
        big = np.zeros((1 << 16) + 1, np.uint8)
        res = c.put_many([(b"a", b"1"), (b"big", big), (b"c", b"3")])
        assert res[0] is None and res[2] is None
        assert isinstance(res[1], gdkv.ValueSizeError) and res[1].status == 0x85
        assert res[1].key == b"big"
        assert c.get(b"a") == b"1" and c.get(b"c") == b"3" and not c.exists(b"big")
        with pytest.raises(gdkv.ValueSizeError):
            gdkv.raise_first(res)
        assert gdkv.raise_first([None, 3]) == [None, 3]


def test_batches(client):
    keys = gdkv.chain_keys(range(8 * 16), 16, "batch-test")
    values = [np.full(1000 + i, i, np.uint8) for i in range(len(keys))]
    assert client.put_many(zip(keys[:6], values[:6])) == [None] * 6
    assert client.exists_many(keys) == [True] * 6 + [False] * 2
    assert client.lookup_prefix(keys) == 6
    assert client.lookup_prefix([]) == 0
    client.delete(keys[2])
    assert client.lookup_prefix(keys) == 2  # the run ends at the first missing block
    got = client.get_many(keys[:4], size_hint=512)  # shorter hint: read again whole
    assert got[2] is None
    assert [got[0], got[1], got[3]] == [values[i].tobytes() for i in (0, 1, 3)]
    outs = [client.empty(2000, np.uint8) for _ in range(4)]
    lens = client.get_many_into(keys[:4], outs)
    assert lens[:2] + lens[3:] == [1000, 1001, 1003]
    assert isinstance(lens[2], gdkv.KeyNotFoundError) and lens[2].key == keys[2]
    assert all(np.all(outs[i][:lens[i]] == i) for i in (0, 1, 3))
    short = [client.empty(10, np.uint8), client.empty(2000, np.uint8)]
    lens = client.get_many_into([keys[0], keys[1]], short)
    assert isinstance(lens[0], gdkv.ValueSizeError) and lens[1] == 1001
    assert client.get_many_into([keys[0]], short[:1], partial=True) == [1000]
    with pytest.raises(gdkv.ValueSizeError):
        gdkv.raise_first(lens)
    with pytest.raises(ValueError):
        client.put_many([(keys[0], b"x")] + [(b"", b"y")])
    with pytest.raises(ValueError):
        client.get_many_into(keys[:2], [bytearray(10)])


def test_closed_client(client):
    client.put(b"k", b"v")
    with client:
        pass
    assert client.closed
    for call in (lambda: client.get(b"k"), lambda: client.put(b"k", b"v"),
                 lambda: client.lookup_prefix([b"k"]), lambda: client.alloc(10)):
        with pytest.raises(gdkv.ClosedError):
            call()
    client.close()  # twice is fine


def test_threads_share_a_client(client):
    errors = []

    def worker(t: int):
        try:
            out = np.zeros(4096, np.uint8)
            for i in range(150):
                k = f"t{t}-{i}".encode()
                v = np.full(4096, (t * 31 + i) % 256, np.uint8)
                client.put(k, v)
                client.get_into(k, out)
                assert np.array_equal(out, v)
                assert client.lookup_prefix([k, b"missing"]) == 1
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(client.list(prefix=b"t")) == 8 * 150


def test_asyncio_forms(client):
    async def main():
        await asyncio.gather(*(client.aput(f"a{i}", bytes([i]) * 100) for i in range(32)))
        outs = [bytearray(100) for _ in range(32)]
        lens = await asyncio.gather(*(client.aget_into(f"a{i}", outs[i]) for i in range(32)))
        assert lens == [100] * 32 and all(o == bytes([i]) * 100 for i, o in enumerate(outs))
        assert await client.aget("a3") == bytes([3]) * 100
        assert await client.alookup_prefix([f"a{i}" for i in range(40)]) == 32
        assert await client.aexists("a0") and not await client.aexists("zz")
        assert await client.aput_many([(b"m1", b"1"), (b"m2", b"2")]) == [None, None]
        assert await client.aget_many([b"m1", b"m2", b"m3"]) == [b"1", b"2", None]
        assert await client.aget_many_into([b"m1"], [bytearray(1)]) == [1]
        assert await client.adelete(b"m1")
        with pytest.raises(KeyError):
            await client.aget(b"m1")

    asyncio.run(main())


def test_empty_gives_numpy_and_torch(client):
    a = client.empty((3, 4), "float16")
    assert a.shape == (3, 4) and a.dtype == np.float16 and a.flags.c_contiguous
    t = client.empty((2, 5), torch.bfloat16)
    assert t.shape == (2, 5) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert client.reaches(a) and client.reaches(t)
    with pytest.raises(ValueError):
        client.alloc(0)


def test_open_errors(tmp_path):
    with pytest.raises(ValueError, match="backend: 'nosuch' is not one of files, local, memory"):
        gdkv.open("nosuch")
    with gdkv.open("local", store=str(tmp_path / "s"), capacity=64 << 20):
        with pytest.raises(gdkv.Error, match="(?i)lock|in use|open"):
            gdkv.open("local", store=str(tmp_path / "s"), capacity=64 << 20)
    with pytest.raises(gdkv.ConnectionError):
        gdkv.connect(str(tmp_path / "no-daemon"))
    with gdkv.open("memory") as c:   # in-process, host memory is reached as it is
        a = np.zeros(4)
        c.register(a)
        assert c.reaches(a)
        c.unregister(a)
        with pytest.raises(ValueError, match="not registered"):
            c.unregister(a)


def test_local_store_persists_across_opens(tmp_path):
    with gdkv.open("local", store=str(tmp_path / "s"), capacity=64 << 20) as c:
        c.put(b"durable", b"value")
    with gdkv.open("local", store=str(tmp_path / "s"), capacity=64 << 20) as c:
        assert c.get(b"durable") == b"value"


def test_gil_is_released_while_waiting(gdkvd):
    """A call waiting on a frozen gdkvd leaves other Python threads running."""
    import signal

    with gdkv.connect(gdkvd.dir, timeout_ms=5000) as c:
        c.put(b"k", b"v")
        gdkvd.signal(signal.SIGSTOP)
        done = threading.Event()
        t = threading.Thread(target=lambda: (c.exists(b"k"), done.set()))
        t.start()
        n, end = 0, time.monotonic() + 0.3
        while time.monotonic() < end:
            n += 1
        gdkvd.signal(signal.SIGCONT)
        t.join(5)
        assert done.is_set()
        assert n > 100_000  # the spinning main thread was never blocked on the GIL


def test_register_shares_host_memory_with_gdkvd_in_place(gdkvd):
    """Memory the caller allocated (numpy, torch) is read and written where it lies once
    registered: no staging copy, the same bytes, and only anonymous memory is accepted."""
    import mmap
    import tempfile

    import torch

    with gdkv.connect(gdkvd.dir) as c:
        pool = np.random.default_rng(1).integers(0, 256, (64, 65536), dtype=np.uint8)
        before = pool.copy()
        assert not c.reaches(pool)
        c.register(pool)
        assert c.reaches(pool) and c.reaches(pool[3])
        assert np.array_equal(pool, before)          # contents kept, same addresses
        assert c.put_many((b"row%d" % i, pool[i]) for i in range(64)) == [None] * 64
        pool[:] = 0
        assert c.get_many_into([b"row%d" % i for i in range(64)], list(pool)) == [65536] * 64
        assert np.array_equal(pool, before)
        # a value spread over rows of the pool (a scatter list) lands in place too
        assert c.get_into(b"row5", [pool[10, :1000], pool[20]], partial=True) == 65536
        assert np.array_equal(pool[10, :1000], before[5, :1000])
        assert c.copies() == (0, 0)
        c.unregister(pool)
        assert not c.reaches(pool)
        c.get_into(b"row7", pool[0])                  # staged again, still right
        assert np.array_equal(pool[0], before[7]) and c.copies()[0] == 1

        kv = torch.zeros((4, 32768), dtype=torch.float16)
        c.register(kv)
        c.register(kv[2])                             # inside: counted again
        c.get_into(b"row1", kv[1])
        assert bytes(kv[1].numpy().tobytes()) == before[1].tobytes()
        c.unregister(kv[2])
        assert c.reaches(kv)
        c.unregister(kv)
        assert c.copies()[0] == 1

        with tempfile.TemporaryFile() as f:
            f.truncate(1 << 16)
            with pytest.raises(ValueError, match="not private anonymous"):
                c.register(mmap.mmap(f.fileno(), 1 << 16))   # a file mapping
        anon = mmap.mmap(-1, 1 << 16)     # shared anonymous memory only this process maps
        anon[:4] = b"gdkv"
        c.register(anon)
        assert c.reaches(memoryview(anon)) and anon[:4] == b"gdkv"
        c.unregister(anon)
        with pytest.raises(ValueError, match="not registered"):
            c.unregister(np.zeros(8))
        with pytest.raises(ValueError, match="empty"):
            c.register(np.zeros(0))


# ---- whole values in one command ----

def _retrieves(c, d) -> float:
    """Retrieve commands the controller completed: in-process from the client, through gdkvd
    from its /metrics."""
    m = d.metrics() if d is not None else c.metrics()
    return sum(v for k, v in m.items() if "commands_total{" in k and 'op="retrieve"' in k
               and not k.startswith("gdkv_command_errors"))


@pytest.fixture(params=["memory", "gdkvd"])
def counted(request):
    """(client, gdkvd or None): a client whose controller's Retrieve commands can be counted."""
    if request.param == "memory":
        with gdkv.open("memory") as c:
            yield c, None
        return
    d = Gdkvd("--backend", "memory", metrics=True)
    try:
        with gdkv.connect(d.dir) as c:
            yield c, d
    finally:
        d.stop()


SIZES = [0, 1, 4096, 65536 + 1, 2 << 20]


def test_get_and_get_view_one_retrieve_whatever_the_length(counted):
    c, d = counted
    values = {n: np.random.default_rng(n).integers(0, 256, n, np.uint8).tobytes() for n in SIZES}
    for n, v in values.items():
        c.put(f"whole-{n}", v)
    copies = c.copies()   # the puts' (bytes objects are staged)
    for n, v in values.items():
        before = _retrieves(c, d)
        assert c.get(f"whole-{n}") == v
        assert _retrieves(c, d) - before == 1, f"{n} bytes"   # 2 before, past the 64 KiB hint
        before = _retrieves(c, d)
        view = c.get_view(f"whole-{n}")
        assert _retrieves(c, d) - before == 1, f"{n} bytes"
        assert isinstance(view, memoryview) and view.readonly and view.nbytes == n
        assert view.tobytes() == v
        view.release()
    with pytest.raises(KeyError):
        c.get(b"missing")
    with pytest.raises(gdkv.KeyNotFoundError):
        c.get_view(b"missing")
    assert c.get(b"whole-1", size_hint=1) == values[1]   # accepted, no longer needed
    if d is not None:
        assert c.copies() == copies   # received where gdkvd wrote it: no staging copy


def test_get_many_and_get_many_view_one_retrieve_per_key(counted):
    c, d = counted
    keys = [f"many-{i}" for i in range(64)]
    values = [np.full(2 << 20, i, np.uint8).tobytes() for i in range(64)]
    gdkv.raise_first(c.put_many(zip(keys, values)))
    keys.insert(5, b"missing")
    values.insert(5, None)
    for _ in range(2):   # the first batch knows no length yet, the second the first's
        before = _retrieves(c, d)
        assert c.get_many(keys) == values
        assert _retrieves(c, d) - before == len(keys)
    before = _retrieves(c, d)
    views = c.get_many_view(keys)
    assert _retrieves(c, d) - before == len(keys)
    assert views[5] is None
    assert all(v.readonly and v.tobytes() == values[i] for i, v in enumerate(views) if v)
    for v in views:
        if v is not None:
            v.release()
    # Mixed lengths: small values after large ones, then a longer one read again.
    c.put(b"short", b"s" * 10)
    assert c.get_many([b"short", keys[0], b"missing"]) == [b"s" * 10, values[0], None]


def test_view_is_read_only_and_outlives_other_calls(gdkvd):
    c = gdkv.connect(gdkvd.dir)
    c.put(b"a", b"first value")
    view = c.get_view(b"a")
    with pytest.raises(TypeError):
        view[0] = 0
    c.put(b"a", b"second value, longer")   # other calls reuse no memory a view holds
    assert c.get(b"a") == b"second value, longer"
    others = c.get_many_view([b"a"] * 8)
    assert view.tobytes() == b"first value"
    assert [o.tobytes() for o in others] == [b"second value, longer"] * 8
    c.close()
    assert view.tobytes() == b"first value"   # valid after close(), released by its owner
    view.release()


def test_views_give_their_shared_memory_back(gdkvd):
    """A view holds its value's shared memory until released; a value larger than the shared
    memory is CapacityError, not a crash."""
    with gdkv.connect(gdkvd.dir, shared_memory_bytes=8 << 20) as c:
        with gdkv.connect(gdkvd.dir) as big:
            big.put(b"3m", bytes(3 << 20))
            big.put(b"9m", bytes(9 << 20))
        v1, v2 = c.get_view(b"3m"), c.get_view(b"3m")   # 6 of the 8 MiB held
        v1.release()
        t = time.monotonic()
        v3 = c.get_view(b"3m")      # v1's memory, at once (held, it would wait 10 s and fail)
        assert time.monotonic() - t < 5
        assert v2.tobytes() == v3.tobytes() == bytes(3 << 20)
        v2.release()
        v3.release()
        with pytest.raises(gdkv.CapacityError, match="shared_memory_bytes"):
            c.get(b"9m")
        with pytest.raises(gdkv.CapacityError):
            c.get_view(b"9m")
        with pytest.raises(gdkv.CapacityError):
            c.get_many([b"3m", b"9m"])
        assert c.get(b"3m") == bytes(3 << 20)   # still usable
