"""gdkv as LMCache's remote storage: a remote storage plugin for LMCache 0.5.6.

LMCache's RemoteBackend stores each full chunk (one MemoryObj of ``chunk_size`` tokens, named by
a CacheEngineKey) in a remote connector and looks chunks up there; this module is that connector
over a gdkv store, configured in LMCache's YAML as ``remote_storage_plugins: ["gdkv"]`` with
``remote_storage_plugin.gdkv.module_path: gdkv.lmcache``, ``...class_name:
GdkvConnectorAdapter`` and ``...url: "gdkv:///run/gdkvd?namespace=prod"``. The URL's path is
gdkvd's socket directory (``gdkv://?backend=memory``: an in-process controller); its query
parameters, or ``remote_storage_plugin.<name>.<option>`` keys (the URL wins), are
gdkv.engine's keys and ``threads`` (default 4).

Contract: a value is a chunk's bytes exactly, and one that is not exactly one full chunk of the
engine's layout is a miss, so a truncated, padded or foreign value never reaches the model (only
full chunks are stored; ``remote_serde`` must be ``naive`` and ``use_layerwise`` false). A gdkvd
that is down, dies or freezes means misses and dropped puts, never an exception to LMCache and
never wrong bytes. Set ``pre_caching_hash_algorithm: sha256_cbor`` so that chunk hashes agree
across processes. The full config, keys, copies, hints and what is not implemented (``ping``):
docs/integrations.md ("LMCache").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import urllib.parse
from typing import Any, Callable, List, Optional, TypeVar

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.exceptions import IrrecoverableException
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector import (ConnectorAdapter, ConnectorContext,
                                                  extract_plugin_type)
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from .client import Client
from .config import LMCACHE_KEYS, defaults, read_config
from .engine import EngineStore, Stats
from .keys import KeySpace

__all__ = ["GdkvConnectorAdapter", "GdkvConnector", "parse_url", "PLUGIN_TYPE"]

log = logging.getLogger("gdkv.lmcache")
T = TypeVar("T")

#: The plugin type: ``remote_storage_plugins: ["gdkv"]`` (or ``"gdkv.<instance>"``).
PLUGIN_TYPE = "gdkv"
SCHEME = "gdkv://"

# extra_config keys of a plugin that LMCache (module_path, class_name) or we (url) read.
_PLUGIN_KEYS = {"module_path", "class_name", "url"}


def parse_url(url: str) -> dict[str, Any]:
    """The options a ``gdkv://`` URL names: ``socket_dir`` (its path) and its query parameters.

    >>> parse_url("gdkv:///run/gdkvd?nsid=2&namespace=prod")
    {'nsid': 2, 'namespace': 'prod', 'socket_dir': '/run/gdkvd'}
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != PLUGIN_TYPE:
        raise ValueError(f"gdkv: {url!r} is not a gdkv:// URL")
    if parts.netloc not in ("", "localhost"):
        raise ValueError(
            f"gdkv: {url!r} names a host ({parts.netloc!r}); gdkvd is reached through its local "
            "socket directory, the URL's path: gdkv:///run/gdkvd (three slashes)")
    if parts.fragment:
        raise ValueError(f"gdkv: {url!r} has a fragment (#...)")
    options: dict[str, Any] = {}
    if parts.query:
        for name, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True,
                                                  strict_parsing=True):
            options[name] = value
    path = urllib.parse.unquote(parts.path)
    if path:
        if "socket_dir" in options:
            raise ValueError(f"gdkv: {url!r} names the socket directory twice (path and query)")
        options["socket_dir"] = path
    return _typed(options, url)


def _typed(options: dict[str, Any], where: str) -> dict[str, Any]:
    """``options`` read as EngineStore's settings and ``threads`` (engine.read_config: text,
    as in a URL's query, is converted to each option's type)."""
    out = read_config(options, LMCACHE_KEYS, where)
    if out.get("socket_dir") and out.get("backend"):
        raise ValueError(f"gdkv: {where} sets both a socket directory (gdkvd) and backend="
                         f"{out['backend']} (in-process): one or the other")
    return out


def _settings(context: ConnectorContext) -> Optional[dict[str, Any]]:
    """The connector's options, or None for a dormant one: a plugin without a url while
    LMCache's remote_url is a gdkv:// URL (LMCache's own RemoteBackend serves that URL)."""
    config = context.config
    assert config is not None
    extra = dict(config.extra_config or {})
    remote_url = config.remote_url or ""
    if context.plugin_name is None:
        # LMCache's remote_url: the URL alone configures the connector.
        return parse_url(context.url)
    prefix = f"remote_storage_plugin.{context.plugin_name}."
    own = {k[len(prefix):]: v for k, v in extra.items() if k.startswith(prefix)}
    url = own.get("url")
    if url is None and remote_url.startswith(SCHEME):
        log.info("gdkv: plugin %s has no url; LMCache's remote_url %s is served by its own "
                 "RemoteBackend, this one stays idle", context.plugin_name, remote_url)
        return None
    if url is not None and remote_url.startswith(SCHEME):
        log.warning("gdkv: both remote_url (%s) and %surl (%s) are set: LMCache makes two remote "
                    "backends and stores every chunk in both", remote_url, prefix, url)
    settings = _typed({k: v for k, v in own.items() if k not in _PLUGIN_KEYS},
                      f"extra_config {prefix}*")
    if url is not None:
        from_url = parse_url(str(url))
        if "backend" in from_url:
            settings.pop("socket_dir", None)
        if "socket_dir" in from_url:
            settings.pop("backend", None)
        settings.update(from_url)  # the URL wins
    return settings


def _check_supported(config: LMCacheEngineConfig) -> None:
    """Configs whose values this connector cannot hold as fixed-layout chunks."""
    if config.use_layerwise:
        raise IrrecoverableException(
            "gdkv: use_layerwise is not supported (chunks are stored whole); set "
            "use_layerwise: false")
    if (config.remote_serde or "naive") != "naive":
        raise IrrecoverableException(
            f"gdkv: remote_serde {config.remote_serde!r} is not supported (values are stored as "
            "raw chunks of the engine's layout); set remote_serde: naive")


def _check_hashes(config: LMCacheEngineConfig) -> None:
    """A warning for LMCache's default chunk hash, which makes a shared store useless."""
    if (getattr(config, "pre_caching_hash_algorithm", "") == "builtin"
            and "PYTHONHASHSEED" not in os.environ):
        # Python's hash() of the chunk's tokens: on Python 3.11 it differs in every process
        # (hash(None) is an address) unless PYTHONHASHSEED is set. Not wrong KV, but no chunk
        # stored by one vLLM process is ever found by another, or after a restart.
        log.warning("gdkv: LMCache hashes chunks with Python's hash() (pre_caching_hash_algorithm:"
                    " builtin) and PYTHONHASHSEED is not set: chunk keys differ in every process,"
                    " so other processes (and restarts) find nothing; set "
                    "pre_caching_hash_algorithm: sha256_cbor (or PYTHONHASHSEED=0)")


class GdkvConnectorAdapter(ConnectorAdapter):
    """What ``remote_storage_plugin.<name>.class_name`` names: LMCache's ConnectorManager asks it
    whether it parses a URL (``gdkv://...``, or ``plugin://gdkv[.instance]``) and to create the
    connector."""

    def __init__(self) -> None:
        super().__init__(SCHEME)

    def can_parse(self, url: str) -> bool:
        if url.startswith(SCHEME):
            return True
        if url.startswith("plugin://"):
            return extract_plugin_type(url[len("plugin://"):]) == PLUGIN_TYPE
        return False

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        if context.config is None or context.metadata is None:
            raise IrrecoverableException("gdkv: LMCache created the connector without its config "
                                         "or metadata")
        _check_supported(context.config)
        try:
            settings = _settings(context)
            if settings is not None:
                _check_hashes(context.config)
            return GdkvConnector(context.loop, context.local_cpu_backend, context.config,
                                 context.metadata, settings)
        except ValueError as e:  # a config error: LMCache reports it and does not retry
            raise IrrecoverableException(str(e)) from e


class GdkvConnector(RemoteConnector):
    """LMCache's RemoteConnector over a gdkv store (see the module's docstring).

    LMCache calls the coroutines on its storage event loop (``loop``); each runs its gdkv
    commands in this connector's threads, so the loop never waits for gdkv. ``exists_sync`` and
    ``batched_contains`` run in the caller's thread. ``settings`` None: dormant (no store; every
    lookup misses, puts are dropped).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any,
                 config: LMCacheEngineConfig, metadata: Optional[LMCacheMetadata] = None,
                 settings: Optional[dict[str, Any]] = None):
        if metadata is None:
            raise IrrecoverableException(
                "gdkv: name GdkvConnectorAdapter (not GdkvConnector) in "
                "remote_storage_plugin.<name>.class_name")
        # Sets meta_shapes, meta_dtypes, meta_fmt (the full chunk) and full_chunk_size_bytes.
        super().__init__(config, metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.metadata = metadata
        # The key: LMCache's CacheEngineKey.to_string() (model, world size, worker id, chunk hash,
        # dtype, tags: what LMCache gives each chunk, its hash chained over the prefix), salted
        # with the model, dtype and layout of the full chunk and the namespace.
        dtype = "+".join(str(d).removeprefix("torch.") for d in self.meta_dtypes)
        layout = self.meta_fmt.name + ":" + "+".join(
            "x".join(str(n) for n in shape) for shape in self.meta_shapes)
        self.keyspace = KeySpace("lmcache", metadata.model_name, dtype, layout,
                                 (settings or {}).get("namespace", ""))
        self.store: Optional[EngineStore] = EngineStore(settings) if settings is not None else None
        # LMCache's CPU memory (its allocator's one buffer, allocated before its backends are
        # created): through gdkvd, chunks then move where they lie in it (no staging copy).
        pool = getattr(getattr(local_cpu_backend, "memory_allocator", None), "buffer", None)
        if (self.store is not None and isinstance(pool, torch.Tensor)
                and pool.device.type == "cpu" and pool.numel() > 0):
            self.store.share(pool)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            (settings or defaults(LMCACHE_KEYS))["threads"], thread_name_prefix="gdkv-lmcache")
        self._closed = False
        #: skipped_puts: chunks put() did not store (partial chunks, other layouts), logged
        #: once; rejected_values: values gdkv held that get() turned into misses (of the wrong
        #: length, or whose read failed).
        self.stats = Stats(skipped_puts=0, rejected_values=0)
        log.info("gdkv: LMCache connector %r, key space %s", self, self.keyspace.description)

    def __repr__(self) -> str:
        return f"<GdkvConnector {self.store if self.store is not None else 'dormant'}>"

    # ---- plumbing ----
    def client(self) -> Optional[Client]:
        """The gdkv client in use (None while gdkv is unavailable, or dormant)."""
        return self.store.client() if self.store is not None and not self._closed else None

    def _key(self, key: CacheEngineKey) -> bytes:
        return self.keyspace.key(key.to_string())

    def _call(self, fn: Callable[[Client], T], default: T) -> T:
        """``fn(client)`` through EngineStore.call: gdkv unavailable is ``default`` (and the
        client is dropped); any other gdkv error (a full store, a value gdkvd refuses) is
        ``default`` too, logged."""
        if self.store is None or self._closed:
            return default

        return self.store.call(fn, default, "LMCache transfer (a miss / not stored)")

    async def _offload(self, fn: Callable[..., T], *args: Any,
                       release: Optional[Callable[[T], None]] = None) -> T:
        """``fn(*args)`` in the connector's threads. If the awaiting coroutine is cancelled
        (LMCache's timeouts), ``fn`` still runs to its end (shielded: a put releases the
        references it holds, a get's chunks go to ``release``)."""
        try:
            future = self._pool.submit(fn, *args)
        except RuntimeError:
            # The pool is shut down: close() ran, so fn returns its "nothing" at once (and
            # releases what it was handed), here on the loop.
            return fn(*args)
        try:
            return await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            if release is not None:
                def done(f: concurrent.futures.Future) -> None:
                    if f.exception() is None:
                        release(f.result())
                future.add_done_callback(done)
            raise

    # ---- values ----
    def _value(self, memory_obj: MemoryObj) -> Optional[memoryview]:
        """The bytes to store for ``memory_obj`` (in place), or None if it is not a full chunk
        of this engine's layout (those are not stored: the key space holds one layout)."""
        try:
            if (memory_obj.get_memory_format() != self.meta_fmt
                    or list(memory_obj.get_dtypes()) != list(self.meta_dtypes)
                    or list(memory_obj.get_shapes()) != list(self.meta_shapes)
                    or memory_obj.get_size() != self.full_chunk_size_bytes):
                return None
        except (AssertionError, AttributeError, TypeError):
            return None
        view = memory_obj.byte_array
        return view if isinstance(view, memoryview) else memoryview(view)

    def _skip(self, memory_obj: MemoryObj) -> None:
        if self.stats.add(skipped_puts=1)["skipped_puts"] == 1:
            log.warning("gdkv: not storing a chunk of %d bytes, format %s (only full chunks of "
                        "%d bytes, %s, are stored remotely); counted in skipped_puts",
                        memory_obj.get_size(), memory_obj.get_memory_format().name,
                        self.full_chunk_size_bytes, self.meta_fmt.name)

    def _allocate(self) -> Optional[MemoryObj]:
        """A full-chunk MemoryObj from LMCache's allocator, or None when it has no room (never
        waits for other requests: a miss is always safe)."""
        try:
            return self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes,
                                                   self.meta_fmt, eviction=True, busy_loop=False)
        except Exception as e:  # the scheduler's stand-in allocator raises
            log.debug("gdkv: no memory for a chunk: %s", e)
            return None

    def _put_sync(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]) -> None:
        try:
            items = []
            for key, obj in zip(keys, memory_objs, strict=True):
                value = self._value(obj)
                if value is None:
                    self._skip(obj)
                else:
                    items.append((self._key(key), value))
            if items:
                gkeys = [k for k, _ in items]
                # Every chunk is sent, with no Exist round first.
                self._call(lambda c: self.store.put(c, gkeys, lambda i: items[i][1]), None)
        finally:
            for obj in memory_objs:  # the references put()/batched_put() took
                obj.ref_count_down()

    def _get_sync(self, keys: List[CacheEngineKey]) -> list[Optional[MemoryObj]]:
        """Each key's chunk in a new MemoryObj, None where missing or invalid (one round)."""
        results: list[Optional[MemoryObj]] = [None] * len(keys)
        if self.store is None or self._closed or not keys:
            return results
        objs: list[MemoryObj] = []
        for _ in keys:  # stops where LMCache's memory runs out: the rest are misses
            obj = self._allocate()
            if obj is None:
                break
            objs.append(obj)
        if not objs:
            return results
        gkeys = [self._key(k) for k in keys[: len(objs)]]
        outs = [obj.byte_array for obj in objs]
        # A value of another length than a chunk, or one whose read failed, is a miss (load()).
        sizes = [self.full_chunk_size_bytes] * len(objs)
        try:
            whole, held = self._call(lambda c: self.store.load(c, gkeys, outs, sizes),
                                     ([False] * len(objs), []))
        except BaseException:   # not a gdkv error (those are misses): give LMCache its memory
            self._release(objs)
            raise
        self.stats.add(rejected_values=len(held))
        for i, obj in enumerate(objs):
            if whole[i]:
                results[i] = obj
            else:
                obj.ref_count_down()
        return results

    @staticmethod
    def _release(objs: list[Optional[MemoryObj]]) -> None:
        for obj in objs:
            if obj is not None:
                obj.ref_count_down()

    # ---- RemoteConnector ----
    async def exists(self, key: CacheEngineKey) -> bool:
        return await self._offload(self.exists_sync, key)

    def exists_sync(self, key: CacheEngineKey) -> bool:
        k = self._key(key)
        return self._call(lambda c: c.exists(k), False)

    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return (await self.batched_get([key]))[0]

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]) -> None:
        """Stores full chunks with one put_many; LMCache releases ``memory_objs`` when this
        returns. gdkv reads them in place, so we hold our own reference until it is done, even
        if this coroutine is cancelled."""
        if self.store is None or self._closed:
            return
        for obj in memory_objs:
            obj.ref_count_up()
        await self._offload(self._put_sync, list(keys), list(memory_objs))

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        return await self._offload(self._get_sync, list(keys), release=self._release)

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str,
                                       keys: List[CacheEngineKey]) -> List[MemoryObj]:
        """The leading run of chunks found (LMCache's contract); the rest are released."""
        objs = await self.batched_get(keys)
        out: list[MemoryObj] = []
        for i, obj in enumerate(objs):
            if obj is None:
                self._release(objs[i:])
                break
            out.append(obj)
        return out

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[CacheEngineKey]) -> int:
        """How many leading keys are stored: one lookup (EngineStore.leading). The
        chunks found are what LMCache retrieves next: they are hinted to gdkv, in order."""
        gkeys = [self._key(k) for k in keys]
        if not gkeys:
            return 0
        return self._call(lambda c: self.store.leading(c, gkeys, hint=True), 0)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey],
                                     pin: bool = False) -> int:
        """As batched_contains (the hint included), from the event loop. ``pin`` is ignored: gdkv
        cannot pin a value. The hint keeps the chunks found in gdkv's DRAM cache until read or
        until it ages out, but the local store frees its oldest values when full and a RADOS
        pool evicts by watermarks, so a chunk found here can be gone by the time it is read;
        that read is a miss (a short or missing value is never returned as a chunk)."""
        return await self._offload(self.batched_contains, list(keys))

    def remove_sync(self, key: CacheEngineKey) -> bool:
        k = self._key(key)
        return self._call(lambda c: c.delete(k, missing_ok=True), False)

    async def list(self) -> List[str]:
        """The gdkv keys of the store's namespace, in hex. They are hashes: not LMCache's key
        strings, and every engine's keys in that NVMe namespace are listed."""
        keys = await self._offload(lambda: self._call(lambda c: c.list(), []))
        return [k.hex() for k in keys]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True  # new calls return at once; those running finish first
        self._pool.shutdown(wait=True)
        if self.store is not None:
            self.store.close()
        log.info("gdkv: closed %r", self)
