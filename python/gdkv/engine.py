"""What the engine connectors (gdkv.vllm, gdkv.sglang, gdkv.lmcache) share.

- :class:`KeySpace`: the engine's block hashes become gdkv keys, salted with the engine, the
  model, the KV dtype and the KV layout (and an optional namespace), so two engines, two models
  or two layouts of one model never share a key.
- :class:`EngineStore`: one gdkv client opened from an engine's config, with the failure rule
  every connector follows: a gdkvd that is down, frozen or unreachable means "no hits" and
  "nothing saved", never an error for the user. The client is dropped at the first failure and
  opened again, at most once per ``retry_interval_s``.

Config (each engine passes its own extra-config dict; keys are the same everywhere)::

    socket_dir            gdkvd's socket directory (default $GDKV_SOCKET_DIR); or
    backend               an in-process controller: "local" | "memory" | "rados", with
                          gdkv.open's options as further keys (store, capacity, pool, ceph_conf...)
    nsid                  NVMe namespace (default 1)
    namespace             a string mixed into every key (default ""): separate key spaces
    timeout_ms            a command gdkvd does not complete in time fails (default 5000)
    shared_memory_bytes   memory shared with gdkvd for transfers (default 1 GiB, used on demand)
    retry_interval_s      after a failure, how long to wait before connecting again (default 5)
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Mapping, Optional, TypeVar

from . import connect, errors, hash128
from . import open as open_client
from .client import Client

log = logging.getLogger("gdkv.engine")
_IN_PROCESS: dict[tuple, Client] = {}
_IN_PROCESS_LOCK = threading.Lock()
T = TypeVar("T")

#: The failures that mean "gdkv is not there right now": the caller falls back to recompute.
UNAVAILABLE = (errors.ConnectionError, errors.TimeoutError, errors.ClosedError,
               errors.NotReadyError)

_OPEN_OPTIONS = ("store", "capacity", "pool", "ceph_conf", "ceph_client", "ceph_keyring",
                 "ceph_timeout_ms", "cache_bytes", "cache_policy", "prefetch_depth", "reactors",
                 "max_value_bytes", "queue_depth", "cuda_device")


def _as_bytes(h: Any) -> bytes:
    if isinstance(h, (bytes, bytearray, memoryview)):
        return bytes(h)
    if isinstance(h, str):
        return h.encode()
    if isinstance(h, int):
        return h.to_bytes(32, "little", signed=True)
    raise TypeError(f"a block hash must be bytes, str or int, not {type(h).__name__}")


class KeySpace:
    """Engine block hashes to 16-byte gdkv keys: ``XXH3-128(salt || hash)``.

    ``salt`` is the XXH3-128 of ``gdkv/<engine>/<namespace>/<model>/<dtype>/<layout>``. The engine
    hash already names the block's tokens and its whole prefix (vLLM, SGLang and LMCache chain
    their hashes), so the key names "this prefix's KV, in this engine's layout, of this model".
    """

    def __init__(self, engine: str, model: str, dtype: str, layout: str, namespace: str = ""):
        self.description = f"gdkv/{engine}/{namespace}/{model}/{dtype}/{layout}"
        self.salt = hash128(self.description.encode())

    def key(self, block_hash: Any) -> bytes:
        return hash128(self.salt + _as_bytes(block_hash))

    def keys(self, block_hashes) -> list[bytes]:
        return [self.key(h) for h in block_hashes]


class EngineStore:
    """A gdkv client opened from an engine connector's config, and dropped when it fails."""

    def __init__(self, config: Optional[Mapping[str, Any]] = None):
        config = dict(config or {})
        self.socket_dir = str(config.get("socket_dir") or os.environ.get("GDKV_SOCKET_DIR", ""))
        self.backend = config.get("backend")
        self.nsid = int(config.get("nsid", 1))
        self.timeout_ms = int(config.get("timeout_ms", 5000))
        self.shared_memory_bytes = int(config.get("shared_memory_bytes", 1 << 30))
        self.retry_interval_s = float(config.get("retry_interval_s", 5.0))
        self.open_options = {k: config[k] for k in _OPEN_OPTIONS if k in config}
        if not self.socket_dir and not self.backend:
            raise ValueError("gdkv: set socket_dir (a running gdkvd) or backend (in-process) in "
                             "the connector's config, or $GDKV_SOCKET_DIR")
        self._client: Optional[Client] = None
        self._next_try = 0.0
        self._lock = threading.Lock()
        self.failures = 0
        self._errors_seen: set[tuple[str, int]] = set()

    def __repr__(self) -> str:
        where = self.socket_dir or f"{self.backend} (in-process)"
        return f"EngineStore({where}, nsid={self.nsid})"

    def _open(self) -> Client:
        if self.backend:
            # One in-process controller per process and settings: an engine's scheduler and
            # worker sides (and two connectors in one process) see the same store, and a local
            # store directory is opened once.
            ident = (self.backend, self.nsid, tuple(sorted(self.open_options.items())))
            with _IN_PROCESS_LOCK:
                if ident not in _IN_PROCESS:
                    _IN_PROCESS[ident] = open_client(self.backend, nsid=self.nsid,
                                                     **self.open_options)
                return _IN_PROCESS[ident]
        return connect(self.socket_dir, nsid=self.nsid, timeout_ms=self.timeout_ms,
                       shared_memory_bytes=self.shared_memory_bytes)

    def client(self) -> Optional[Client]:
        """The open client, or None while gdkv is unavailable (then try again later)."""
        with self._lock:
            if self._client is not None:
                return self._client
            now = time.monotonic()
            if now < self._next_try:
                return None
            try:
                self._client = self._open()
                log.info("gdkv: connected to %s", self)
            except errors.Error as e:
                self._next_try = now + self.retry_interval_s
                log.warning("gdkv: %s is unavailable (%s); running without it", self, e)
            return self._client

    def fail(self, client: Client, error: BaseException) -> None:
        """Drop ``client`` after ``error``; the next :meth:`client` waits ``retry_interval_s``."""
        with self._lock:
            if self._client is client:
                self._client = None
                self._next_try = time.monotonic() + self.retry_interval_s
                self.failures += 1
                log.warning("gdkv: %s failed (%s); running without it for %.1f s", self, error,
                            self.retry_interval_s)
        if not self.backend:
            try:
                client.close()
            except errors.Error:
                pass

    def call(self, fn: Callable[[Client], T], default: T, what: str = "gdkv call") -> T:
        """``fn(client)``, or ``default`` when gdkv is unavailable or fails on the way: the
        client is dropped when it is unavailable (and opened again later); any other gdkv error
        (a full store, a value gdkvd refuses, shared memory used up) keeps it, and is logged
        once per kind."""
        c = self.client()
        if c is None:
            return default
        try:
            return fn(c)
        except UNAVAILABLE as e:
            self.fail(c, e)
            return default
        except errors.Error as e:
            kind = (type(e).__name__, e.status)
            with self._lock:
                first = kind not in self._errors_seen
                self._errors_seen.add(kind)
            log.log(logging.WARNING if first else logging.DEBUG, "gdkv: %s failed: %s", what, e)
            return default

    def close(self) -> None:
        """Closes a gdkvd connection (in-process controllers live as long as the process)."""
        with self._lock:
            c, self._client = self._client, None
        if c is not None and not self.backend:
            c.close()
