"""gdkv.lmcache through LMCache 0.5.6's own machinery, on CPU.

Everything LMCache-side is LMCache's real code: LMCacheEngineConfig read from the YAML the docs
give (or LMCache's environment variables), CreateStorageBackends making its LocalCPUBackend
(its allocator and TensorMemoryObj chunks) and its RemoteBackend, whose ConnectorManager loads
gdkv.lmcache from the plugin lines and creates the connector from the URL, real CacheEngineKeys,
and LMCacheEngine itself for store/lookup/retrieve. The one stand-in is the serving engine's side
of LMCacheEngine (its "GPU connector", here copying to and from a CPU tensor), since there is no
vLLM paged cache on CPU. gdkvd is the real child process of conftest.Gdkvd.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

import pytest

lmcache = pytest.importorskip("lmcache")

import torch  # noqa: E402
from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.exceptions import IrrecoverableException  # noqa: E402
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat, MemoryObj  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend import CreateStorageBackends  # noqa: E402
from lmcache.v1.storage_backend.remote_backend import RemoteBackend  # noqa: E402

import gdkv  # noqa: E402
import gdkv.engine  # noqa: E402
from gdkv import config as gconfig  # noqa: E402
from gdkv.lmcache import GdkvConnector, parse_url  # noqa: E402

from conftest import Gdkvd, hint_gdkvd, hinted, record_hints, until  # noqa: E402

LAYERS, HEADS, HEAD_DIM, CHUNK = 2, 2, 8, 16
# One chunk: [2, layers, chunk tokens, heads * head dim] bf16 = 2 KiB.
CHUNK_BYTES = 2 * LAYERS * CHUNK * HEADS * HEAD_DIM * 2

PLUGIN = """\
remote_storage_plugins: ["gdkv"]
extra_config:
  remote_storage_plugin.gdkv.module_path: gdkv.lmcache
  remote_storage_plugin.gdkv.class_name: GdkvConnectorAdapter
"""


def yaml_config(tmp_path: Path, text: str) -> LMCacheEngineConfig:
    """LMCache's config from a YAML file, as LMCACHE_CONFIG_FILE would load it."""
    path = tmp_path / f"lmcache-{time.monotonic_ns()}.yaml"
    path.write_text(text)
    return LMCacheEngineConfig.from_file(str(path))


def plugin_config(tmp_path: Path, url: str, head: str = "") -> LMCacheEngineConfig:
    """The plugin form: remote_storage_plugins + extra_config with the gdkv URL."""
    return yaml_config(tmp_path, f"""\
chunk_size: {CHUNK}
local_cpu: false
max_local_cpu_size: 0.05
remote_serde: naive
{head}{PLUGIN}  remote_storage_plugin.gdkv.url: "{url}"
""")


def metadata(model: str = "test/model", dtype: torch.dtype = torch.bfloat16,
             worker: int = 0) -> LMCacheMetadata:
    return LMCacheMetadata(model_name=model, world_size=1, local_world_size=1, worker_id=worker,
                           local_worker_id=worker, kv_dtype=dtype,
                           kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM), chunk_size=CHUNK)


def chunk_keys(md: LMCacheMetadata, hashes) -> list[CacheEngineKey]:
    return [CacheEngineKey(md.model_name, md.world_size, md.worker_id, h, md.kv_dtype)
            for h in hashes]


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop in its own thread, as LMCache's StorageManager runs one."""
    lp = asyncio.new_event_loop()
    t = threading.Thread(target=lp.run_forever, daemon=True)
    t.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    t.join(10)
    lp.close()


@pytest.fixture
def stacks(loop):
    """make(config, metadata) -> LMCache's storage backends; all closed at the end."""
    made = []

    def make(config: LMCacheEngineConfig, md: LMCacheMetadata):
        backends = CreateStorageBackends(config, md, loop)
        made.append(backends)
        return backends

    yield make
    for backends in made:
        for b in reversed(list(backends.values())):
            b.close()


def remote(backends, name: str = "RemoteBackend-gdkv") -> tuple[RemoteBackend, GdkvConnector]:
    rb = backends[name]
    assert isinstance(rb, RemoteBackend)
    conn = rb.connection.getWrappedConnector()  # LMCache wraps it in InstrumentedRemoteConnector
    assert isinstance(conn, GdkvConnector)
    return rb, conn


def chunks(backends, md: LMCacheMetadata, n: int, seed: int = 0,
           tokens: Optional[int] = None) -> list[MemoryObj]:
    """n chunks from LMCache's allocator, filled with random bf16 values."""
    cpu = backends["LocalCPUBackend"]
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        obj = cpu.allocate(md.get_shapes(tokens), md.get_dtypes(), None)
        assert obj is not None
        obj.tensor.copy_(torch.randn(obj.get_shape(), generator=g).to(obj.get_dtype()))
        out.append(obj)
    return out


def put(rb: RemoteBackend, keys, objs) -> None:
    """LMCache's batched put (asynchronous on its loop), waited for: LMCache calls
    on_complete_callback for each key once the connector's batched_put returned."""
    done = threading.Semaphore(0)
    rb.batched_submit_put_task(keys, objs, on_complete_callback=lambda key: done.release())
    for _ in keys:
        assert done.acquire(timeout=10), "puts did not finish"


def run(loop, coro):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(30)


def active(backends) -> int:
    """Memory objects LMCache's allocator has handed out and not got back."""
    return backends["LocalCPUBackend"].memory_allocator.pin_allocator.num_active_allocations


def same(a: Optional[MemoryObj], b: MemoryObj) -> bool:
    return (a is not None and a.get_shapes() == b.get_shapes()
            and a.get_dtypes() == b.get_dtypes()
            and a.get_memory_format() == b.get_memory_format()
            and bytes(a.byte_array) == bytes(b.byte_array))


def release(objs) -> None:
    for o in objs:
        if o is not None:
            o.ref_count_down()


# ---- config ----
def test_parse_url():
    def read(url: str, given: dict) -> None:
        """The URL gives these settings, every other connector key its default (gdkv.config)."""
        assert parse_url(url) == {**gconfig.defaults(gconfig.ENGINE_KEYS + gconfig.LMCACHE_KEYS),
                                  **given}

    read("gdkv:///run/gdkvd", {"socket_dir": "/run/gdkvd"})
    read("gdkv://localhost/run/gdkvd?nsid=2&namespace=prod&retry_interval_s=0.5&timeout_ms=100",
         {"socket_dir": "/run/gdkvd", "nsid": 2, "namespace": "prod", "retry_interval_s": 0.5,
          "timeout_ms": 100})
    read("gdkv://?backend=local&store=/var/lib/gdkv&capacity=4096",
         {"backend": "local", "store": "/var/lib/gdkv", "capacity": 4096})
    for bad in ["gdkv://run/gdkvd",                   # two slashes: "run" is a host
                "redis://localhost:6379",
                "gdkv:///run/gdkvd?nsdi=1",           # unknown option
                "gdkv:///run/gdkvd?nsid=one",
                "gdkv:///run/gdkvd?backend=memory",   # both
                "gdkv:///run/gdkvd?threads=0"]:
        with pytest.raises(ValueError, match="gdkv"):
            parse_url(bad)


def test_plugin_yaml_creates_the_gdkv_backend(gdkvd, tmp_path, stacks):
    md = metadata()
    url = f"gdkv://{gdkvd.dir}?nsid=1&namespace=team-a&timeout_ms=2000&threads=2"
    backends = stacks(plugin_config(tmp_path, url), md)
    assert list(backends) == ["LocalCPUBackend", "RemoteBackend-gdkv"]
    rb, conn = remote(backends)
    assert conn.store.socket_dir == gdkvd.dir and conn.store.timeout_ms == 2000
    assert conn.keyspace.description == \
        "gdkv/lmcache/team-a/test/model/bfloat16/KV_2LTD:2x2x16x16"
    assert conn.client() is not None and conn.client().remote


def test_warns_about_per_process_chunk_hashes(gdkvd, tmp_path, stacks, caplog, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    url = f"gdkv://{gdkvd.dir}"
    with caplog.at_level("WARNING", logger="gdkv.lmcache"):
        stacks(plugin_config(tmp_path, url), metadata())
    assert "pre_caching_hash_algorithm: sha256_cbor" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="gdkv.lmcache"):
        stacks(plugin_config(tmp_path, url, "pre_caching_hash_algorithm: sha256_cbor\n"),
               metadata())
    assert "pre_caching_hash_algorithm" not in caplog.text


def test_options_from_the_plugin_extra_config(gdkvd, tmp_path, stacks):
    # No URL: the options are extra_config keys of the plugin.
    config = yaml_config(tmp_path, f"""\
chunk_size: {CHUNK}
local_cpu: false
max_local_cpu_size: 0.05
{PLUGIN}  remote_storage_plugin.gdkv.socket_dir: {gdkvd.dir}
  remote_storage_plugin.gdkv.namespace: ns1
  remote_storage_plugin.gdkv.retry_interval_s: 0.25
""")
    rb, conn = remote(stacks(config, metadata()))
    assert conn.store.socket_dir == gdkvd.dir and conn.store.retry_interval_s == 0.25
    assert "/ns1/" in conn.keyspace.description
    assert rb.batched_contains(chunk_keys(metadata(), [1])) == 0


def test_remote_url_yaml(gdkvd, tmp_path, stacks):
    # remote_url: gdkv://... with the plugin lines that load the adapter. LMCache then makes two
    # RemoteBackends; the plugin's one (no url of its own) stays dormant.
    md = metadata()
    config = yaml_config(tmp_path, f"""\
chunk_size: {CHUNK}
local_cpu: false
max_local_cpu_size: 0.05
remote_url: "gdkv://{gdkvd.dir}?namespace=x"
{PLUGIN}""")
    backends = stacks(config, md)
    assert list(backends) == ["LocalCPUBackend", "RemoteBackend-gdkv", "RemoteBackend"]
    live, conn = remote(backends, "RemoteBackend")
    dormant, idle = remote(backends, "RemoteBackend-gdkv")
    assert conn.store.socket_dir == gdkvd.dir and idle.store is None
    keys = chunk_keys(md, range(3))
    objs = chunks(backends, md, 3)
    put(live, keys, objs)
    put(dormant, chunk_keys(md, [7]), chunks(backends, md, 1))  # dropped
    assert live.batched_contains(keys) == 3 and dormant.batched_contains(keys) == 0
    assert len(conn.client().list()) == 3
    got = live.batched_get_blocking(keys)
    assert all(same(g, o) for g, o in zip(got, objs))
    release(got)


def test_lmcache_environment_variables(gdkvd, monkeypatch, stacks):
    # The same config without a file: LMCache's LMCACHE_* variables (what vLLM reads when
    # LMCACHE_CONFIG_FILE is not set).
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", str(CHUNK))
    monkeypatch.setenv("LMCACHE_LOCAL_CPU", "False")
    monkeypatch.setenv("LMCACHE_MAX_LOCAL_CPU_SIZE", "0.05")
    monkeypatch.setenv("LMCACHE_REMOTE_STORAGE_PLUGINS", "gdkv")
    monkeypatch.setenv("LMCACHE_EXTRA_CONFIG",
                       '{"remote_storage_plugin.gdkv.module_path": "gdkv.lmcache", '
                       '"remote_storage_plugin.gdkv.class_name": "GdkvConnectorAdapter", '
                       f'"remote_storage_plugin.gdkv.url": "gdkv://{gdkvd.dir}"}}')
    config = LMCacheEngineConfig.from_env()
    rb, conn = remote(stacks(config, metadata()))
    assert conn.store.socket_dir == gdkvd.dir


def test_bad_configs_fail_loudly(tmp_path, stacks, gdkvd):
    md = metadata()
    # Plugin form: LMCache logs the error and makes no gdkv backend.
    backends = stacks(plugin_config(tmp_path, f"gdkv://{gdkvd.dir}?nsdi=2"), md)
    assert "RemoteBackend-gdkv" not in backends
    # remote_url form: LMCache's RemoteBackend re-raises the connector's IrrecoverableException.
    for head in [f'remote_url: "gdkv://{gdkvd.dir}?nsdi=2"\n',
                 f'remote_url: "gdkv://{gdkvd.dir}"\nremote_serde: cachegen\n',
                 f'remote_url: "gdkv://{gdkvd.dir}"\nuse_layerwise: true\n']:
        config = yaml_config(tmp_path, f"chunk_size: {CHUNK}\nlocal_cpu: false\n"
                                       f"max_local_cpu_size: 0.05\n{head}{PLUGIN}")
        with pytest.raises(IrrecoverableException, match="gdkv"):
            stacks(config, md)


# ---- values ----
def test_put_contains_get(gdkvd, tmp_path, stacks, loop):
    md = metadata()
    backends = stacks(plugin_config(tmp_path, f"gdkv://{gdkvd.dir}"), md)
    rb, conn = remote(backends)
    keys = chunk_keys(md, [11, 22, 33, 44, 55, 66])
    objs = chunks(backends, md, 6)
    base = active(backends)
    hole = 3
    put(rb, keys[:hole] + keys[hole + 1:], objs[:hole] + objs[hole + 1:])
    assert len(conn.client().list()) == 5

    # batched contains: the leading run, sync and from the loop
    assert rb.batched_contains(keys) == hole
    assert run(loop, rb.batched_async_contains("lookup-1", keys)) == hole
    assert rb.batched_contains(keys[hole + 1:]) == 2
    assert rb.contains(keys[4]) and not rb.contains(keys[hole])

    # gets land in new LMCache memory objects, byte-exact
    got = rb.batched_get_blocking(keys)
    assert got[hole] is None
    for i, (g, o) in enumerate(zip(got, objs)):
        if i != hole:
            assert same(g, o) and g.data_ptr != o.data_ptr and g.get_ref_count() == 1
    assert active(backends) == base + 5
    release(got)
    assert active(backends) == base

    # non-blocking get: the leading run only, the rest released
    prefix = run(loop, rb.batched_get_non_blocking("lookup-1", keys))
    assert len(prefix) == hole and all(same(g, o) for g, o in zip(prefix, objs))
    release(prefix)
    assert active(backends) == base

    one = rb.get_blocking(keys[5])
    assert same(one, objs[5])
    release([one])
    assert rb.get_blocking(keys[hole]) is None

    # single put, and remove
    f = rb.submit_put_task(keys[hole], objs[hole])
    f.result(10)
    assert rb.batched_contains(keys) == 6
    assert rb.remove(keys[0]) and rb.batched_contains(keys) == 0
    assert active(backends) == base


def test_models_layouts_and_namespaces_do_not_collide(gdkvd, tmp_path, stacks):
    url = f"gdkv://{gdkvd.dir}"
    a = metadata("org/model-a")
    b = metadata("org/model-b")
    a16 = metadata("org/model-a", torch.float16)
    ba = stacks(plugin_config(tmp_path, url), a)
    rba, ca = remote(ba)
    rbb, cb = remote(stacks(plugin_config(tmp_path, url), b))
    rb16, c16 = remote(stacks(plugin_config(tmp_path, url), a16))
    rbn, cn = remote(stacks(plugin_config(tmp_path, url + "?namespace=other"), a))

    hashes = [101, 202, 303]
    put(rba, chunk_keys(a, hashes), chunks(ba, a, 3))
    assert rba.batched_contains(chunk_keys(a, hashes)) == 3
    assert rbb.batched_contains(chunk_keys(b, hashes)) == 0
    assert rb16.batched_contains(chunk_keys(a16, hashes)) == 0
    assert rbn.batched_contains(chunk_keys(a, hashes)) == 0
    # Even for one and the same CacheEngineKey, the key spaces give different gdkv keys.
    k = chunk_keys(a, hashes)[0]
    assert len({ca._key(k), cb._key(k), c16._key(k), cn._key(k)}) == 4
    # And two workers of one model (tensor parallel ranks) differ through LMCache's key.
    assert ca._key(k) != ca._key(chunk_keys(metadata("org/model-a", worker=1), hashes)[0])


def test_wrong_size_values_are_misses(gdkvd, tmp_path, stacks):
    md = metadata()
    backends = stacks(plugin_config(tmp_path, f"gdkv://{gdkvd.dir}"), md)
    rb, conn = remote(backends)
    good = chunks(backends, md, 1)[0]
    raw = bytes(good.byte_array)
    keys = chunk_keys(md, range(6))
    values = [raw[:-1],                  # truncated by a byte
              raw[: CHUNK_BYTES // 2],   # truncated at a token boundary (a partial chunk's size)
              raw + b"\0" * 64,          # longer than a chunk
              b"x",
              raw[:-2] + b"\1\2",        # right size: a hit (corruption of this kind is not seen)
              raw]
    c = conn.client()
    for k, v in zip(keys, values):
        c.put(conn._key(k), v)
    base = active(backends)
    got = rb.batched_get_blocking(keys)
    assert [g is not None for g in got] == [False, False, False, False, True, True]
    assert same(got[5], good) and conn.stats["rejected_values"] == 4
    release(got)
    assert active(backends) == base
    # get_blocking and the non-blocking prefix agree
    assert rb.get_blocking(keys[0]) is None
    assert run_prefix(rb, keys[4:]) == 2

    # A partial chunk (fewer tokens than chunk_size) and a chunk of another format are not
    # stored: the key space holds full chunks of the engine's layout only.
    partial = chunks(backends, md, 1, tokens=CHUNK // 2)
    cpu = backends["LocalCPUBackend"]
    other = cpu.allocate(md.get_shapes(), md.get_dtypes(), MemoryFormat.KV_T2D)
    more = chunk_keys(md, [900, 901])
    put(rb, more, partial + [other])
    assert conn.stats["skipped_puts"] == 2 and rb.batched_contains(more[:1]) == 0
    assert not c.exists(conn._key(more[1]))


def test_a_failing_get_releases_its_memory(gdkvd, tmp_path, stacks, monkeypatch):
    # An exception that is not gdkv's (a bug, a MemoryError) reaches the caller, and the chunks
    # allocated for the get go back to LMCache's allocator (they leaked before).
    md = metadata()
    backends = stacks(plugin_config(tmp_path, f"gdkv://{gdkvd.dir}"), md)
    rb, conn = remote(backends)
    keys = chunk_keys(md, range(3))
    put(rb, keys, chunks(backends, md, 3))
    base = active(backends)

    def broken(*args, **kw):
        raise RuntimeError("not a gdkv error")

    monkeypatch.setattr(conn.client(), "get_many_into", broken)
    with pytest.raises(RuntimeError):
        conn._get_sync(keys)
    assert active(backends) == base


def run_prefix(rb: RemoteBackend, keys) -> int:
    objs = run(rb.loop, rb.batched_get_non_blocking("l", keys))
    release(objs)
    return len(objs)


# ---- failures ----
def test_gdkvd_killed_then_replaced(gdkvd, tmp_path, stacks):
    md = metadata()
    url = f"gdkv://{gdkvd.dir}?retry_interval_s=0.5&timeout_ms=3000"
    backends = stacks(plugin_config(tmp_path, url), md)
    rb, conn = remote(backends)
    keys = chunk_keys(md, range(8))
    objs = chunks(backends, md, 8)
    put(rb, keys, objs)
    base = active(backends)

    # A reader keeps looking up and loading while gdkvd is killed under it: every result is a
    # byte-exact chunk or a miss, and nothing raises.
    seen = {"hits": 0, "misses": 0, "errors": []}
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            try:
                n = rb.batched_contains(keys)
                got = rb.batched_get_blocking(keys)
                for g, o in zip(got, objs):
                    if g is None:
                        seen["misses"] += 1
                    elif not same(g, o):
                        seen["errors"].append("wrong bytes")
                    else:
                        seen["hits"] += 1
                release(got)
                assert n in (0, len(keys))
            except Exception as e:  # noqa: BLE001: the test reports any
                seen["errors"].append(repr(e))

    t = threading.Thread(target=reader)
    t.start()
    until(lambda: seen["hits"] > 0 or seen["errors"], "the reader's first hit")
    gdkvd.signal(signal.SIGKILL)
    gdkvd.proc.wait()
    until(lambda: seen["misses"] > 0 or seen["errors"], "the reader's first miss")
    stop.set()
    t.join(30)
    assert seen["errors"] == [] and seen["hits"] > 0 and seen["misses"] > 0
    assert conn.store.failures == 1

    # Down: misses, puts dropped, no exception.
    assert rb.batched_contains(keys) == 0 and rb.get_blocking(keys[0]) is None
    assert rb.batched_get_blocking(keys) == [None] * 8
    put(rb, keys, objs)
    assert active(backends) == base

    # A new gdkvd on the same socket directory is picked up after retry_interval_s.
    gdkvd.start()   # the same command, on the same socket directory
    try:
        until(lambda: conn.store.client() is not None, "the connector reconnected")
        assert rb.batched_contains(keys) == 0  # the memory backend started empty
        put(rb, keys, objs)
        assert rb.batched_contains(keys) == 8
        got = rb.batched_get_blocking(keys)
        assert all(same(g, o) for g, o in zip(got, objs))
        release(got)
        assert conn.store.failures == 1 and active(backends) == base
    finally:
        gdkvd.kill()


def test_frozen_gdkvd_is_a_miss_then_recovers(gdkvd, tmp_path, stacks, loop):
    md = metadata()
    url = f"gdkv://{gdkvd.dir}?retry_interval_s=0.2&timeout_ms=300"
    backends = stacks(plugin_config(tmp_path, url), md)
    rb, conn = remote(backends)
    keys = chunk_keys(md, range(4))
    objs = chunks(backends, md, 4)
    put(rb, keys, objs)
    gdkvd.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert run(loop, rb.batched_async_contains("l", keys)) == 0
        assert time.monotonic() - t0 < 3
        assert rb.batched_get_blocking(keys) == [None] * 4
    finally:
        gdkvd.signal(signal.SIGCONT)
    until(lambda: conn.store.client() is not None, "the connector reconnected")
    assert rb.batched_contains(keys) == 4  # the same gdkvd
    got = rb.batched_get_blocking(keys)
    assert all(same(g, o) for g, o in zip(got, objs))
    release(got)


def test_cancelled_calls_release_their_memory(gdkvd, tmp_path, stacks, loop):
    # LMCache cancels a get that outlives blocking_timeout_secs (asyncio.wait_for) while gdkv
    # still waits for the frozen gdkvd: the chunks loaded later, or not, must go back to LMCache's
    # allocator, and a cancelled put must drop the references it took.
    md = metadata()
    url = f"gdkv://{gdkvd.dir}?timeout_ms=3000&retry_interval_s=0.2&threads=1"
    backends = stacks(plugin_config(tmp_path, url, "blocking_timeout_secs: 1\n"), md)
    rb, conn = remote(backends)
    keys = chunk_keys(md, range(4))
    objs = chunks(backends, md, 4)
    put(rb, keys, objs)
    base = active(backends)
    gdkvd.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert run(loop, rb.batched_get_non_blocking("l", keys)) == []  # LMCache's timeout
        assert time.monotonic() - t0 < 1.4
        # A put queued behind it (one connector thread), cancelled before it ran.
        fut = asyncio.run_coroutine_threadsafe(conn.batched_put(keys, objs), loop)
        until(lambda: objs[0].get_ref_count() == 2, "the put took its reference")
        fut.cancel()
        assert objs[0].get_ref_count() == 2  # ours, held until the put has run
    finally:
        gdkvd.signal(signal.SIGCONT)
    until(lambda: active(backends) == base and all(o.get_ref_count() == 1 for o in objs),
          "LMCache's memory and our references released")


def test_chunks_larger_than_gdkvds_max_value(tmp_path, stacks, caplog):
    # gdkvd refuses values over --max-value (85h): nothing is stored, LMCache sees no error, and
    # the connector says so once.
    d = Gdkvd("--backend", "memory", "--max-value", str(CHUNK_BYTES // 2))
    try:
        md = metadata()
        backends = stacks(plugin_config(tmp_path, f"gdkv://{d.dir}"), md)
        rb, conn = remote(backends)
        keys = chunk_keys(md, range(3))
        with caplog.at_level("DEBUG", logger="gdkv.engine"):
            put(rb, keys, chunks(backends, md, 3))
            put(rb, keys, chunks(backends, md, 3))
        refused = [r for r in caplog.records if "ValueSizeError" in r.getMessage()
                   or "larger" in r.getMessage() or "85h" in r.getMessage()]
        assert [r.levelname for r in refused] == ["WARNING", "DEBUG"]
        assert rb.batched_contains(keys) == 0 and conn.client() is not None
    finally:
        d.stop()


def test_gdkvd_missing_at_start(tmp_path, stacks):
    # LMCache starts fine without gdkvd; it only misses.
    md = metadata()
    backends = stacks(plugin_config(tmp_path, f"gdkv://{tmp_path}/nothing-here"), md)
    rb, conn = remote(backends)
    keys = chunk_keys(md, range(2))
    put(rb, keys, chunks(backends, md, 2))
    assert rb.batched_contains(keys) == 0 and rb.batched_get_blocking(keys) == [None, None]


def test_closed_connector_misses(gdkvd, tmp_path, stacks, loop):
    md = metadata()
    backends = stacks(plugin_config(tmp_path, f"gdkv://{gdkvd.dir}"), md)
    rb, conn = remote(backends)
    keys = chunk_keys(md, range(2))
    objs = chunks(backends, md, 2)
    put(rb, keys, objs)
    run(loop, conn.close())
    base = active(backends)
    assert rb.batched_contains(keys) == 0 and rb.batched_get_blocking(keys) == [None, None]
    put(rb, keys, objs)
    assert active(backends) == base and objs[0].get_ref_count() == 1


# ---- copies ----
def test_in_process_is_zero_copy(tmp_path, stacks):
    md = metadata()
    backends = stacks(plugin_config(tmp_path, "gdkv://?backend=memory"), md)
    rb, conn = remote(backends)
    keys = chunk_keys(md, range(4))
    objs = chunks(backends, md, 4)
    put(rb, keys, objs)
    got = rb.batched_get_blocking(keys)
    c = conn.client()
    assert not c.remote and all(same(g, o) for g, o in zip(got, objs))
    assert all(c.reaches(g.byte_array) for g in got)
    assert c.copies() == (0, 0)
    release(got)


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "unshareable"])
def test_through_gdkvd_copies(gdkvd, tmp_path, stacks, monkeypatch, shared):
    """LMCache's allocator memory is shared with gdkvd in place: chunks are put from it and got
    into it with no staging copy. Memory gdkvd cannot map (here: prepare_shared_memory refuses)
    is staged, one copy per chunk each way. Byte-exact both ways."""
    if not shared:
        def refuse(buf):
            raise ValueError("not private memory")

        monkeypatch.setattr(gdkv.engine, "prepare_shared_memory", refuse)
    md = metadata()
    backends = stacks(plugin_config(tmp_path, f"gdkv://{gdkvd.dir}"), md)
    rb, conn = remote(backends)
    keys = chunk_keys(md, range(4))
    objs = chunks(backends, md, 4)
    put(rb, keys, objs)
    c = conn.client()
    per_way = 0 if shared else 4
    assert c.remote and all(c.reaches(o.byte_array) for o in objs) == shared
    assert c.copies() == (per_way, per_way * CHUNK_BYTES)
    got = rb.batched_get_blocking(keys)
    assert all(same(g, o) for g, o in zip(got, objs))
    assert c.copies() == (2 * per_way, 2 * per_way * CHUNK_BYTES)
    release(got)


# ---- scheduler hints: the lookup hints the chunks LMCache will retrieve ----
def test_lookup_hints_the_chunks_found(tmp_path, stacks, loop, monkeypatch):
    """RemoteBackend's batched contains, sync and from the loop (LMCache's lookup paths): the
    leading run found reaches gdkvd's cache as a hint, in order; a lookup finding nothing and a
    one-key contains hint nothing."""
    d = hint_gdkvd()
    try:
        md = metadata()
        backends = stacks(plugin_config(tmp_path, f"gdkv://{d.dir}"), md)
        rb, conn = remote(backends)
        keys = chunk_keys(md, range(100, 108))
        objs = chunks(backends, md, 8)
        put(rb, keys[:5] + keys[6:], objs[:5] + objs[6:])   # a hole at 5
        hints = record_hints(conn.client(), monkeypatch)
        assert hinted(d) == 0
        assert rb.batched_contains(keys) == 5
        assert hints == [[conn._key(k) for k in keys[:5]]]
        assert hinted(d) == 5
        assert run(loop, rb.batched_async_contains("lookup-1", keys[2:], pin=True)) == 3
        assert hints[1:] == [[conn._key(k) for k in keys[2:5]]] and hinted(d) == 8
        assert rb.batched_contains(keys[5:]) == 0
        assert rb.contains(keys[0]) and len(hints) == 2 and hinted(d) == 8
        got = rb.batched_get_blocking(keys[:5])
        assert all(same(g, o) for g, o in zip(got, objs))
        release(got)
    finally:
        d.stop()


def test_a_failing_hint_changes_no_lookup(tmp_path, stacks, monkeypatch, caplog):
    """A hint gdkvd refuses is logged at debug level and keeps the client; gdkvd dying between
    the lookup and the hint drops it: either way the lookup answers what it found, and nothing
    raises to LMCache."""
    d = hint_gdkvd()
    try:
        md = metadata()
        url = f"gdkv://{d.dir}?retry_interval_s=60&timeout_ms=2000"
        backends = stacks(plugin_config(tmp_path, url), md)
        rb, conn = remote(backends)
        keys = chunk_keys(md, range(4))
        objs = chunks(backends, md, 4)
        put(rb, keys, objs)
        c = conn.client()
        real = c.hint

        def refused(keys):
            raise gdkv.Error("hint: invalid field", 0x02)

        monkeypatch.setattr(c, "hint", refused)
        with caplog.at_level(logging.DEBUG, logger="gdkv"):
            assert rb.batched_contains(keys) == 4
        assert [r.levelname for r in caplog.records if "hint" in r.getMessage()] == ["DEBUG"]
        assert conn.client() is c and conn.store.failures == 0 and hinted(d) == 0
        got = rb.batched_get_blocking(keys)
        assert all(same(g, o) for g, o in zip(got, objs))
        release(got)

        def dies(keys):
            d.signal(signal.SIGKILL)
            d.proc.wait()
            return real(keys)

        monkeypatch.setattr(c, "hint", dies)
        assert conn.batched_contains(keys) == 4
        assert d.proc.poll() is not None and conn.store.failures == 1
        assert conn.client() is None and rb.batched_contains(keys) == 0
        assert rb.batched_get_blocking(keys) == [None] * 4
    finally:
        d.stop()


# ---- LMCache's engine ----
class CpuKVConnector(GPUConnectorInterface):
    """The serving engine's side of LMCacheEngine, on CPU: KV cache ``[2, layers, tokens,
    hidden]`` in kwargs["kvcache"] (vLLM's paged GPU cache is what LMCache's real connectors
    copy from)."""

    def __init__(self, md: LMCacheMetadata):
        self.md = md

    def from_gpu(self, memory_obj, start, end, **kw):
        memory_obj.tensor.copy_(kw["kvcache"][:, :, start:end])

    def to_gpu(self, memory_obj, start, end, **kw):
        kw["kvcache"][:, :, start:end].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs, starts, ends, **kw):
        for o, s, e in zip(memory_objs, starts, ends):
            self.from_gpu(o, s, e, **kw)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kw):
        for o, s, e in zip(memory_objs, starts, ends):
            self.to_gpu(o, s, e, **kw)

    def get_shape(self, num_tokens):
        return self.md.get_shapes(num_tokens)[0]


def engine_config(socket_dir: str) -> str:
    """An LMCache engine's config: a small local CPU cache, gdkv (at socket_dir) as its remote."""
    return f"""\
chunk_size: {CHUNK}
local_cpu: true
max_local_cpu_size: 0.05
pre_caching_hash_algorithm: sha256_cbor
remote_serde: naive
{PLUGIN}  remote_storage_plugin.gdkv.url: "gdkv://{socket_dir}"
"""


def test_lmcache_engine_store_lookup_retrieve(gdkvd, tmp_path):
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    text = engine_config(gdkvd.dir)
    md = metadata()
    ids = [f"gdkv-test-{time.monotonic_ns()}-{i}" for i in range(2)]
    engines = []
    try:
        for i in ids:  # two engines: B has its own (empty) local CPU cache
            e = LMCacheEngineBuilder.get_or_create(i, yaml_config(tmp_path, text), md,
                                                   CpuKVConnector(md), None, None)
            e.post_init()
            engines.append(e)
        a, b = engines
        tokens = torch.arange(100)  # 6 full chunks and a partial one (not stored remotely)
        src = torch.randn(2, LAYERS, 100, HEADS * HEAD_DIM).to(torch.bfloat16)
        a.store(tokens, kvcache=src)  # the remote puts run on LMCache's loop: wait for them
        rb_a, conn_a = remote(a.storage_manager.storage_backends)
        deadline = time.monotonic() + 10
        while len(conn_a.client().list()) < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(conn_a.client().list()) == 6

        rb_b, conn_b = remote(b.storage_manager.storage_backends)
        assert len(b.storage_manager.storage_backends["LocalCPUBackend"].hot_cache) == 0
        assert b.lookup(tokens) == 96
        dst = torch.zeros_like(src)
        mask = b.retrieve(tokens, kvcache=dst)
        assert int(mask.sum()) == 96 and bool(mask[:96].all())
        assert torch.equal(dst[:, :, :96], src[:, :, :96])
        assert not dst[:, :, 96:].any()
        # B's chunks came through gdkvd (its local cache was empty), into LMCache's own memory
        # shared with gdkvd in place: no staging copy.
        assert conn_b.client().remote and conn_b.client().copies() == (0, 0)
        # Another prompt sharing the first 40 tokens: 2 chunks.
        other = torch.cat([tokens[:40], torch.arange(1000, 1060)])
        assert b.lookup(other) == 32
    finally:
        for i in ids:
            LMCacheEngineBuilder.destroy(i)


def test_lmcache_engine_lookup_hints_what_it_retrieves(tmp_path, monkeypatch):
    """LMCacheEngine.lookup asks its local CPU cache first and gdkv for the rest: the chunks
    gdkv holds are hinted (they are what retrieve reads next), and chunks LMCache holds locally
    are not."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    d = hint_gdkvd()
    text = engine_config(d.dir)
    md = metadata()
    ids = [f"gdkv-hint-{time.monotonic_ns()}-{i}" for i in range(2)]
    try:
        a, b = [LMCacheEngineBuilder.get_or_create(i, yaml_config(tmp_path, text), md,
                                                   CpuKVConnector(md), None, None) for i in ids]
        for e in (a, b):
            e.post_init()
        tokens = torch.arange(100)  # 6 full chunks reach gdkv
        src = torch.randn(2, LAYERS, 100, HEADS * HEAD_DIM).to(torch.bfloat16)
        a.store(tokens, kvcache=src)
        rb_a, conn_a = remote(a.storage_manager.storage_backends)
        deadline = time.monotonic() + 10
        while len(conn_a.client().list()) < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(conn_a.client().list()) == 6
        assert a.lookup(tokens) == 96 and hinted(d) == 0   # A's local CPU cache has them all

        rb_b, conn_b = remote(b.storage_manager.storage_backends)
        hints = record_hints(conn_b.client(), monkeypatch)
        assert b.lookup(tokens) == 96
        assert hints[:1] == [[conn_b._key(k) for _, _, k in
                              b.token_database.process_tokens(tokens=tokens)][:6]]
        assert hinted(d) == 6
        dst = torch.zeros_like(src)
        assert int(b.retrieve(tokens, kvcache=dst).sum()) == 96
        assert torch.equal(dst[:, :, :96], src[:, :, :96])
        # retrieve maps its chunks to backends again (get_block_mapping: batched_contains),
        # which hints them once more just before reading them.
        assert hints[1:] == [hints[0]] and hinted(d) == 12
        # Now in B's local CPU cache: LMCache does not ask gdkv, and nothing is hinted.
        assert len(b.storage_manager.storage_backends["LocalCPUBackend"].hot_cache) == 6
        assert b.lookup(tokens) == 96
        assert len(hints) == 2 and hinted(d) == 12
    finally:
        for i in ids:
            LMCacheEngineBuilder.destroy(i)
        d.stop()
