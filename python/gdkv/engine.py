"""What the engine connectors (gdkv.vllm, gdkv.sglang, gdkv.lmcache) share.

- :class:`KeySpace`: the engine's block hashes become gdkv keys, salted with the engine, the
  model, the KV dtype and the KV layout (and an optional namespace), so two engines, two models
  or two layouts of one model never share a key. The salt hashes the list of those fields (JSON),
  so no field's text can run into the next one's.
- :func:`weights_fingerprint`: a cheap digest of a model folder's weight files (names, sizes,
  content, sampled in large files), cached per file by its stat; connectors put it in the model
  they name in the salt, so two checkpoints at one path never share KV.
- :class:`Stats`: a connector's counters, one convention for all three.
- :class:`EngineStore`: one gdkv client opened from an engine's config, with the failure rule
  every connector follows: a gdkvd that is down, frozen or unreachable means "no hits" and
  "nothing saved", never an error for the user. The client is dropped at the first failure (and
  closed on a background thread) and opened again, at most once per ``retry_interval_s``.
  Connecting runs on a background thread, one at a time, that tries until it succeeds: the
  constructor waits for its first try (at engine start-up, at most ``timeout_ms`` and a second);
  otherwise :meth:`EngineStore.client` returns None until a connect has succeeded, so a frozen
  gdkvd never holds up the caller's thread for more than a lock acquisition.

Config: each engine passes its own extra-config dict, read by :func:`gdkv.config.read_config`;
the keys are the same everywhere (:data:`gdkv.config.ENGINE_KEYS`, listed in docs/settings.md).

Environment: ``GDKV_CACHE_DIR`` (default ``~/.cache/gdkv``) holds weights_fingerprint's cache,
``weights-fingerprints.json``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from typing import Any, Callable, Iterable, Mapping, Optional, TypeVar

from . import _core, connect, errors, hash128, prepare_shared_memory
from . import open as open_client
from .client import Client
from .config import CLIENT_KEYS, ENGINE_KEYS, OPEN_KEYS, STORE_KEYS, defaults, read_config

__all__ = ["EngineStore", "KeySpace", "RemovalFeed", "Stats", "read_config",
           "weights_fingerprint"]

log = logging.getLogger("gdkv.engine")
_IN_PROCESS: dict[tuple, Client] = {}
_IN_PROCESS_LOCK = threading.Lock()
T = TypeVar("T")

#: Keys per hint command (EngineStore.hint).
HINT_BATCH = 2048
#: The failures that mean "gdkv is not there right now": the caller falls back to recompute.
UNAVAILABLE = (errors.ConnectionError, errors.TimeoutError, errors.ClosedError,
               errors.NotReadyError)

def _as_bytes(h: Any) -> bytes:
    if isinstance(h, (bytes, bytearray, memoryview)):
        return bytes(h)
    if isinstance(h, str):
        return h.encode()
    if isinstance(h, int):
        return h.to_bytes(32, "little", signed=True)
    raise TypeError(f"a block hash must be bytes, str or int, not {type(h).__name__}")


class KeySpace:
    """Engine block hashes to 16-byte gdkv keys: ``prefix || XXH3-128(salt || hash)[:12]``.

    ``salt`` is the XXH3-128 of the JSON list ``["gdkv", engine, namespace, model, dtype,
    layout]``: each field is quoted and escaped, so two different field lists never give one salt
    (``description``, ``gdkv/<engine>/<namespace>/<model>/<dtype>/<layout>``, is the readable form,
    for logs; it is not what is hashed). The engine hash already names the block's tokens and its
    whole prefix (vLLM, SGLang and LMCache chain their hashes), so the key names "this prefix's KV,
    in this engine's layout, of this model".

    ``prefix``, the first 4 bytes of every key, is the XXH3-128 of ``["gdkv", engine,
    namespace]`` (its first 4 bytes): ``client.list(prefix)`` finds one engine's keys in one
    namespace (SGLang's ``clear``), and 96 bits of hash stay for the blocks.
    """

    PREFIX_BYTES = 4

    def __init__(self, engine: str, model: str, dtype: str, layout: str, namespace: str = ""):
        fields = ["gdkv", engine, namespace, model, dtype, layout]
        self.description = "/".join(fields)
        self.salt = hash128(json.dumps(fields).encode())
        self.prefix = hash128(json.dumps(fields[:3]).encode())[: self.PREFIX_BYTES]

    def key(self, block_hash: Any) -> bytes:
        return self.prefix + hash128(self.salt + _as_bytes(block_hash))[: 16 - self.PREFIX_BYTES]

    def keys(self, block_hashes) -> list[bytes]:
        return [self.key(h) for h in block_hashes]


# ---- removals: what gdkvd stopped holding ----
class RemovalFeed:
    """Follows gdkvd's feed of removed keys, ``GET /removed?after=SEQ`` on its metrics port
    (docs/integrations.md, "KV events"): the keys its store stopped holding (deleted, evicted by
    the local store, the memory backend or this node's RADOS eviction), in order.

    :meth:`poll` returns the keys removed since the previous call, reading every page there is.
    The first successful call only takes the feed's current position and returns ``[]``. It
    returns None when removals may have been missed: gdkvd restarted (its ``boot`` changed), the
    feed dropped records before they were read, or a RADOS watch broke (a record with nsid 0); the
    caller then treats every key it follows as possibly gone. An unreachable gdkvd is ``[]`` (with
    a warning once) and the cursor is kept. ``nsid`` limits the keys to one backend namespace
    (None: all). Not thread-safe: one poller."""

    PAGE = 4096  # gdkvd's records per answer

    def __init__(self, url: str, nsid: Optional[int] = None, timeout_s: float = 2.0):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"gdkv: removals_url must be an http:// URL, not {url!r}")
        self.url = url.split("?", 1)[0]
        self.nsid = nsid
        self.timeout_s = timeout_s
        self.boot: Optional[int] = None
        self.cursor: Optional[int] = None
        self._warned = False

    def _get(self, after: Optional[int]) -> Optional[dict]:
        import urllib.error
        import urllib.request
        url = self.url if after is None else f"{self.url}?after={after}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as r:
                page = json.loads(r.read())
        except (OSError, ValueError, urllib.error.URLError) as e:
            if not self._warned:
                log.warning("gdkv: cannot read gdkvd's removals at %s (%s); retrying", url, e)
                self._warned = True
            return None
        self._warned = False
        return page

    def poll(self) -> Optional[list[bytes]]:
        page = self._get(self.cursor)
        if page is None:
            return []
        if self.cursor is None or page["boot"] != self.boot:
            restarted = self.boot is not None
            self.boot, self.cursor = page["boot"], page["last"]
            return None if restarted else []
        missed = bool(page["lost"])
        keys: list[bytes] = []
        while True:
            for seq, nsid, key in page["removed"]:
                self.cursor = seq
                if nsid == 0:
                    missed = True
                elif self.nsid is None or nsid == self.nsid:
                    keys.append(bytes.fromhex(key))
            if len(page["removed"]) < self.PAGE:
                break
            page = self._get(self.cursor)
            if page is None or page["boot"] != self.boot:
                missed = True
                break
            missed = missed or bool(page["lost"])
        if missed:
            if page is not None and page["boot"] == self.boot:
                self.cursor = max(self.cursor, page["last"])  # the caller starts over anyway
            return None
        return keys


# ---- weights fingerprint ----
#: What a model folder's weights are stored in.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: Files up to this size are hashed whole; larger ones are sampled (_file_digest).
FULL_HASH_BYTES = 64 << 20
_EDGE_BYTES = 1 << 20          # a sampled file: its first and last MiB,
_SAMPLES, _SAMPLE_BYTES = 64, 64 << 10   # and 64 evenly spaced 64 KiB pieces
_CACHE_FILE = "weights-fingerprints.json"
_CACHE_LOCK = threading.Lock()


def cache_dir() -> str:
    """Where gdkv keeps small per-user caches: $GDKV_CACHE_DIR, else ~/.cache/gdkv."""
    return os.environ.get("GDKV_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                            "gdkv")


def _file_digest(path: str, size: int) -> str:
    """The digest of one weight file's content: all of it up to FULL_HASH_BYTES; above, a
    safetensors header in full (it names every tensor, its dtype, shape and offsets), the first
    and last MiB and 64 evenly spaced 64 KiB samples."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        if size <= FULL_HASH_BYTES:
            while chunk := f.read(1 << 20):
                h.update(chunk)
            return h.hexdigest()
        fd = f.fileno()
        if path.endswith(".safetensors"):
            n = int.from_bytes(os.pread(fd, 8, 0), "little")
            h.update(os.pread(fd, min(n, size - 8, 256 << 20), 8))
        h.update(os.pread(fd, _EDGE_BYTES, 0))
        h.update(os.pread(fd, _EDGE_BYTES, size - _EDGE_BYTES))
        step = (size - _SAMPLE_BYTES) // (_SAMPLES - 1)
        for i in range(_SAMPLES):
            h.update(os.pread(fd, _SAMPLE_BYTES, i * step))
    return h.hexdigest()


def _load_cache(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_cache(path: str, entries: dict) -> None:
    """Merges ``entries`` into the cache file and replaces it atomically (a temporary file
    renamed over it: a reader sees the old file or the new one, never half of one). A cache
    that cannot be written is only slower next time."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with _CACHE_LOCK:
            data = _load_cache(path)   # another process may have added files meanwhile
            data.update(entries)
            fd, tmp = tempfile.mkstemp(prefix=".weights-", dir=os.path.dirname(path))
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, sort_keys=True)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
    except OSError as e:
        log.debug("gdkv: cannot write %s (%s)", path, e)


def weights_fingerprint(model: str) -> str:
    """A digest naming the weights of the model at ``model``: a local folder (its weight files:
    *.safetensors, *.bin, *.pt, *.pth, *.gguf, not recursing) or one weight file (a .gguf). ""
    when ``model`` is not local (a hub name) or holds no weight file.

    Each file's name, size and content (:func:`_file_digest`: whole up to 64 MiB, sampled above)
    go in. A file's digest is cached in $GDKV_CACHE_DIR/weights-fingerprints.json under its real
    path, keyed by its size, mtime, ctime and inode: a re-touched file is read again (and gives
    the same digest if its content did not change), an unchanged one is not read at all.
    """
    if os.path.isdir(model):
        names = sorted(n for n in os.listdir(model) if n.endswith(WEIGHT_SUFFIXES))
        files = [os.path.join(model, n) for n in names]
    elif os.path.isfile(model):
        names, files = [os.path.basename(model)], [model]
    else:
        return ""
    files_and_names = [(f, n) for f, n in zip(files, names) if os.path.isfile(f)]
    if not files_and_names:
        return ""
    cache_path = os.path.join(cache_dir(), _CACHE_FILE)
    cache = _load_cache(cache_path)
    fresh: dict[str, dict] = {}
    h = hashlib.blake2b(digest_size=16)
    try:
        for f, name in files_and_names:
            real = os.path.realpath(f)
            st = os.stat(real)
            stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
            entry = cache.get(real)
            if isinstance(entry, dict) and entry.get("stat") == stamp:
                digest = entry["digest"]
            else:
                digest = _file_digest(real, st.st_size)
                fresh[real] = {"stat": stamp, "digest": digest}
            h.update(json.dumps([name, st.st_size, digest]).encode())
    except OSError as e:   # unreadable: the weights go unnamed (the path and config still are)
        log.warning("gdkv: cannot fingerprint the weights in %s (%s); set model_id to name "
                    "them", model, e)
        return ""
    if fresh:
        _save_cache(cache_path, fresh)
    return h.hexdigest()


class Stats:
    """A connector's counters (counts, bytes, seconds), safe across its threads: ``add()``,
    ``stats[name]`` (0 for one never added), :meth:`snapshot`, and :meth:`write` to a JSON file
    (where benchmarks and tests read an engine's counters: its processes are the engine's)."""

    def __init__(self, **start: float):
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._values: dict[str, float] = dict(start)

    def add(self, **counts: float) -> dict[str, float]:
        """Adds each count to its counter; the counters' new values."""
        with self._lock:
            for k, v in counts.items():
                self._values[k] = self._values.get(k, 0) + v
            return {k: self._values[k] for k in counts}

    def __getitem__(self, name: str) -> float:
        with self._lock:
            return self._values.get(name, 0)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)

    def write(self, path: str, **extra: Any) -> None:
        """The counters (and ``extra``) as JSON at ``path``, replaced whole; a failure to write
        is logged. Writes from several threads are one at a time, each of the counters as they
        are when it starts: the last one written is the latest."""
        with self._write_lock:
            try:
                with open(f"{path}.tmp", "w") as f:
                    json.dump({**self.snapshot(), **extra}, f)
                os.replace(f"{path}.tmp", path)
            except OSError as e:
                log.warning("gdkv: cannot write the counters to %s: %s", path, e)


def _copy(row: Any, pieces: Any, into_row: bool) -> None:
    """Copies between a staging row and the buffer, or list of buffers, a value is laid out
    across (numpy uint8 arrays): into the row (a gather), or out of it (a scatter)."""
    at = 0
    for piece in pieces if isinstance(pieces, (list, tuple)) else [pieces]:
        if into_row:
            row[at:at + piece.size] = piece
        else:
            piece[:] = row[at:at + piece.size]
        at += piece.size


def _close_quietly(client: Client) -> None:
    try:
        client.close()
    except errors.Error:
        pass


_ENGINE_DEFAULTS = defaults(ENGINE_KEYS)
_OPEN_NAMES = [k.name for k in STORE_KEYS if k.name != "backend"] + list(OPEN_KEYS)


class EngineStore:
    """A gdkv client opened from an engine connector's config, and dropped when it fails."""

    def __init__(self, config: Optional[Mapping[str, Any]] = None):
        given = {k: v for k, v in (config or {}).items() if v is not None}
        c = {**_ENGINE_DEFAULTS, **given}
        self.socket_dir = str(c["socket_dir"] or os.environ.get("GDKV_SOCKET_DIR", ""))
        self.backend = c["backend"]
        self.nsid = int(c["nsid"])
        self.timeout_ms = int(c["timeout_ms"])
        self.shared_memory_bytes = int(c["shared_memory_bytes"])
        self.staging_bytes = int(c["staging_bytes"])
        self.retry_interval_s = float(c["retry_interval_s"])
        # gdkv.connect's settings, and gdkv.open's: the store's settings given, and its own.
        self.connect_options = {k.name: c[k.name] for k in CLIENT_KEYS}
        self.open_options = {k: given[k] for k in _OPEN_NAMES if k in given}
        if self.backend and _core.backend_traits()[self.backend]["can_time_out"]:
            # In-process calls wait for the backend; RADOS ops fail after ceph_timeout_ms with
            # NotReadyError (gdkv unavailable). The local store and memory backends do not time
            # out: see "Timeouts" in docs/integrations.md.
            self.open_options.setdefault("ceph_timeout_ms", self.timeout_ms)
        if not self.socket_dir and not self.backend:
            raise ValueError("gdkv: set socket_dir (a running gdkvd) or backend (in-process) in "
                             "the connector's config, or $GDKV_SOCKET_DIR")
        self._client: Optional[Client] = None
        self._lock = threading.Lock()
        # Engine memory gdkvd reaches in place (share()), registered with every client opened;
        # _share_lock orders share() against a connect publishing its client.
        self._shared: list[Any] = []
        self._share_lock = threading.Lock()
        self._connecting: Optional[threading.Event] = None   # set once its first try ended
        self._closed = threading.Event()
        self.failures = 0
        # The staging (load_staged, put_gathered): (client, memory), reserved at first use and
        # kept until a call with another client; _staging_use, one staged batch at a time.
        self._staging: Optional[tuple[Client, Any]] = None
        self._staging_lock = threading.Lock()
        self._staging_use = threading.Lock()
        self.copied = Stats(values=0, bytes=0)   # what load_staged and put_gathered copied
        self._errors_seen: set[tuple[str, int]] = set()
        # The first connect, awaited here (engine start-up) so the first request finds gdkv; a
        # gdkvd that does not answer in time is left to the background thread.
        with self._lock:
            first_try = self._start_connect(0.0)
        first_try.wait(self.timeout_ms / 1000 + 1)

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
        return connect(self.socket_dir, nsid=self.nsid, **self.connect_options)

    def _start_connect(self, delay: float) -> threading.Event:
        """Starts the background thread that connects (the caller holds the lock): after
        ``delay`` seconds, then every ``retry_interval_s`` until it succeeds or the store is
        closed. One at a time: returns the running one's event if there is one."""
        if self._connecting is None:
            self._connecting = threading.Event()
            threading.Thread(target=self._connect, args=(self._connecting, delay),
                             name="gdkv-connect", daemon=True).start()
        return self._connecting

    def _connect(self, first_try: threading.Event, delay: float) -> None:
        """The connect thread: tries until a client is open (or the store is closed), and sets
        ``first_try`` once its first try has ended."""
        warned = False
        while not self._closed.wait(delay):
            try:
                client = self._open()
            except (errors.Error, ValueError, TypeError) as e:   # or settings open() refused
                # Said once per outage; the retries are logged at debug level.
                log.log(logging.DEBUG if warned else logging.WARNING,
                        "gdkv: %s is unavailable (%s); running without it, retrying every "
                        "%.1f s", self, e, self.retry_interval_s)
                warned = True
                first_try.set()
                delay = self.retry_interval_s
                continue
            with self._share_lock:
                if not self.backend:
                    for buf in self._shared:
                        self._register(client, buf)
                with self._lock:
                    closed = self._closed.is_set()
                    if not closed:
                        self._client = client
                    self._connecting = None
            if not closed:
                log.info("gdkv: connected to %s", self)
            elif not self.backend:   # closed meanwhile
                _close_quietly(client)
            first_try.set()
            return
        with self._lock:
            self._connecting = None
        first_try.set()

    def share(self, buffer: Any) -> bool:
        """Engine-owned host memory (a KV pool: a CPU torch tensor, a numpy array) that gdkv
        should read and write where it lies: through gdkvd, its pages are moved onto memory
        gdkvd can map now (:func:`gdkv.prepare_shared_memory`, so call this at registration,
        before the engine uses the memory) and registered with this client and every client
        opened later, so transfers on it are not staged. In-process the controller reaches host
        memory already. Whether gdkv reaches it in place; memory that cannot be shared (a file
        mapping, pinned CUDA host memory) is logged and stays staged."""
        if self.backend:
            return True
        try:
            prepare_shared_memory(buffer)
        except (ValueError, TypeError) as e:
            log.warning("gdkv: the engine's memory cannot be shared with gdkvd (%s); its "
                        "transfers are staged (one copy each way)", e)
            return False
        with self._share_lock:
            self._shared.append(buffer)
            c = self._client
            if c is not None:
                self._register(c, buffer)
        return True

    @staticmethod
    def _register(client: Client, buffer: Any) -> None:
        """Registers shared engine memory with ``client``; a refusal (gdkvd out of maps) leaves
        it staged through that client."""
        try:
            client.register(buffer)
        except (errors.Error, ValueError) as e:
            log.warning("gdkv: gdkvd did not map the engine's memory (%s); its transfers are "
                        "staged", e)

    def client(self) -> Optional[Client]:
        """The open client, or None while gdkv is unavailable (then try again later). Never
        waits for gdkvd: connecting runs on a background thread (started by the constructor and
        after each failure), and until it has succeeded this returns None."""
        with self._lock:
            if self._client is None and self._connecting is None and \
                    not self._closed.is_set():
                self._start_connect(0.0)
            return self._client

    def fail(self, client: Client, error: BaseException) -> None:
        """Drop ``client`` after ``error``; the connect thread tries again ``retry_interval_s``
        later. A gdkvd client is closed on a background thread (closing waits for a frozen
        gdkvd as long as a command does)."""
        with self._staging_lock:   # its shared memory goes with it (a call in flight keeps it)
            if self._staging is not None and self._staging[0] is client:
                self._staging = None
        with self._lock:
            if self._client is client:
                self._client = None
                self.failures += 1
                log.warning("gdkv: %s failed (%s); running without it for %.1f s", self, error,
                            self.retry_interval_s)
                if not self._closed.is_set():
                    self._start_connect(self.retry_interval_s)
        if not self.backend:
            threading.Thread(target=_close_quietly, args=(client,), name="gdkv-close",
                             daemon=True).start()

    def note(self, error: errors.Error, what: str = "gdkv call") -> None:
        """Logs a gdkv error that leaves the client usable (a full store, a value gdkvd refuses,
        shared memory used up, one key's command failing): a warning the first time for each
        kind, then at debug level."""
        kind = (type(error).__name__, error.status)
        with self._lock:
            first = kind not in self._errors_seen
            self._errors_seen.add(kind)
        log.log(logging.WARNING if first else logging.DEBUG, "gdkv: %s failed: %s", what, error)

    def call(self, fn: Callable[[Client], T], default: T, what: str = "gdkv call") -> T:
        """``fn(client)``, or ``default`` when gdkv is unavailable or fails on the way: the
        client is dropped when it is unavailable (and opened again later); any other gdkv error
        (a full store, a value gdkvd refuses, shared memory used up) keeps it, and is logged
        once per kind (:meth:`note`)."""
        c = self.client()
        if c is None:
            return default
        try:
            return fn(c)
        except UNAVAILABLE as e:
            self.fail(c, e)
            return default
        except errors.Error as e:
            self.note(e, what)
            return default

    # ---- transfers: the batch calls every connector makes, with one failure rule ----
    # A key whose command failed fails only itself: it is noted (logged once per kind) and
    # counts as not stored, so it is recomputed, and put again. gdkv unavailable raises (call()
    # drops the client): the whole client failing, or one key's NotReadyError (82h: the store
    # behind gdkv, a RADOS cluster, is not reachable now), which says nothing of the value.
    def _noted(self, results: list, what: str) -> list:
        """Notes the first error of each kind in a batch's results (a missing key is none);
        raises the first that means gdkv is unavailable (UNAVAILABLE)."""
        kinds = set()
        for r in results:
            if isinstance(r, UNAVAILABLE):
                raise r
            if isinstance(r, errors.Error) and not isinstance(r, errors.KeyNotFoundError):
                kind = (type(r), r.status)
                if kind not in kinds:
                    kinds.add(kind)
                    self.note(r, what)
        return results

    def leading(self, client: Client, keys: list[bytes], hint: bool = False,
                per: int = 1) -> int:
        """How many leading groups of ``per`` keys (a page's or a block's values, in order) are
        stored whole (:meth:`Client.lookup`): the run ends at a missing key or at one whose
        Exist failed. ``hint``: the keys of those groups are hinted to gdkv, in order (a load of
        them follows)."""
        n, error = client.lookup(keys)
        self._noted([error], "lookup")
        n //= per
        if hint and n:
            self.hint(client, keys[:n * per])
        return n

    def present(self, client: Client, keys: list[bytes]) -> list[bool]:
        """Whether each key is stored; one whose Exist failed counts as not."""
        return [r is True for r in self._noted(client.exists_many(keys), "exists")]

    def load(self, client: Client, keys: list[bytes], outs: list,
             sizes: list[int]) -> tuple[list[bool], list[int]]:
        """Each value into its out (a buffer, or the buffers it is laid out across), in one
        batch. Returns (whole, held): whole[i] when value i arrived exactly ``sizes[i]`` bytes
        long; held, the indices of values gdkv holds but cannot deliver (of another length: not
        this engine's layout, never used; or whose Retrieve failed for the value itself). A
        missing value is neither, nor one that failed for want of shared memory (CapacityError),
        and gdkv unavailable raises (_noted)."""
        got = self._noted(client.get_many_into(keys, outs, partial=True), "load")
        whole = [n == size for n, size in zip(got, sizes)]
        held = [i for i, n in enumerate(got) if not whole[i] and
                not isinstance(n, (errors.KeyNotFoundError, errors.CapacityError))]
        for i in held:
            if isinstance(got[i], int):
                self.note(errors.ValueSizeError(
                    f"the value of {keys[i].hex()} has {got[i]} bytes, not {sizes[i]}: a miss",
                    0x85, keys[i]), "load")
        return whole, held

    def put(self, client: Client, keys: list[bytes], value: Callable[[int], Any]) -> list[bool]:
        """Stores ``value(i)`` under ``keys[i]`` in one batch; whether each was stored. (The vLLM
        and SGLang connectors ask :meth:`present` first and put only what is missing; LMCache's
        sends every chunk.)"""
        if not keys:
            return []
        res = self._noted(client.put_many([(k, value(i)) for i, k in enumerate(keys)]), "put")
        return [r is None for r in res]

    def reaches(self, client: Client, buffers: Iterable[Any]) -> bool:
        """Whether the controller reads and writes every one of ``buffers`` where it lies (no
        staging copy): host memory in-process, memory shared with gdkvd (:meth:`share`)
        through it; CUDA memory only where the controller has the GPU's copy engines."""
        return all(client.reaches(b) for b in buffers)

    def staging_rows(self, client: Client, row_bytes: int) -> int:
        """How many values of ``row_bytes`` one batch copies through, where gdkv does not reach
        the engine's memory: ``staging_bytes``, and through gdkvd at most half the shared
        memory (the rest is for the values gdkv reaches in place); at least one."""
        budget = self.staging_bytes
        if client.remote:
            budget = min(budget, self.shared_memory_bytes // 2)
        return max(1, budget // max(1, row_bytes))

    def staging(self, client: Client, row_bytes: int) -> Any:
        """``client``'s staging as rows of ``row_bytes`` (a numpy uint8 array, in memory gdkv
        reaches in place): one budget (:meth:`staging_rows`), reserved at the first call (so
        call it before saves take the memory shared with gdkvd) and kept for later calls with
        that client, as many rows of their size as it holds; only a row larger than the memory
        kept, or another client, reserves it anew."""
        rows = self.staging_rows(client, row_bytes)
        with self._staging_lock:
            if self._staging is None or self._staging[0] is not client or \
                    self._staging[1].nbytes < row_bytes:
                self._staging = (client, client.alloc(rows * row_bytes))
            rows = min(rows, self._staging[1].nbytes // row_bytes)
            return self._staging[1][: rows * row_bytes].reshape(rows, row_bytes)

    def load_staged(self, client: Client, keys: list[bytes], outs: Optional[list],
                    sizes: list[int], scatter: Optional[Callable[[Any, list[int], list[int]],
                                                             None]] = None
                    ) -> tuple[list[bool], list[int]]:
        """As :meth:`load`, for engine memory gdkv does not reach in place: the values arrive in
        rounds in :meth:`staging`, a row each, and the whole ones are copied to their outs (a
        numpy uint8 array, or the arrays a value is laid out across, in order); or, where only
        the engine can copy (CUDA memory), ``scatter(stage, rows, indices)`` copies them: row
        ``rows[n]`` of ``stage`` holds value ``indices[n]``. One staged batch at a time (the
        staging is one)."""
        whole = [False] * len(keys)
        held: list[int] = []
        if not keys:
            return whole, held
        with self._staging_use:
            stage = self.staging(client, max(sizes, default=1))
            for start in range(0, len(keys), len(stage)):
                n = min(len(stage), len(keys) - start)
                got, bad = self.load(client, keys[start:start + n],
                                     [stage[r][:sizes[start + r]] for r in range(n)],
                                     sizes[start:start + n])
                held += [start + r for r in bad]
                rows = [r for r in range(n) if got[r]]
                if scatter is not None:
                    scatter(stage, rows, [start + r for r in rows])
                for r in rows:
                    whole[start + r] = True
                    if scatter is None:
                        _copy(stage[r], outs[start + r], into_row=False)
                self.copied.add(values=len(rows), bytes=sum(sizes[start + r] for r in rows))
        return whole, held

    def put_gathered(self, client: Client, keys: list[bytes], parts: Callable[[int], list],
                     row_bytes: int) -> list[bool]:
        """As :meth:`put`, for values laid out across several buffers (``parts(i)``, numpy uint8
        arrays of ``row_bytes`` in all, in order): a Store reads one run of memory, so each value
        is gathered into a row of :meth:`staging` first, a round of rows at a time."""
        stored: list[bool] = []
        if not keys:
            return stored
        with self._staging_use:
            stage = self.staging(client, row_bytes)
            for start in range(0, len(keys), len(stage)):
                n = min(len(stage), len(keys) - start)
                for r in range(n):
                    _copy(stage[r], parts(start + r), into_row=True)
                self.copied.add(values=n, bytes=n * row_bytes)
                stored += self.put(client, keys[start:start + n], lambda r: stage[r])
        return stored

    def copies(self) -> tuple[int, int]:
        """(buffers, bytes) copied on the way: by :meth:`load_staged` and :meth:`put_gathered`,
        and by the open client's own staging (:meth:`Client.copies`). (0, 0) when every value
        moved in place."""
        own = self.copied.snapshot()
        with self._lock:
            c = self._client
        by_client = c.copies() if c is not None and not c.closed else (0, 0)
        return int(own["values"]) + by_client[0], int(own["bytes"]) + by_client[1]

    def delete(self, client: Client, keys: list[bytes]) -> int:
        """Deletes ``keys`` (missing ones are fine); how many could not be deleted."""
        res = self._noted(client.delete_many(keys, missing_ok=True), "delete")
        return sum(r is not None for r in res)

    def hint(self, client: Client, keys: list[bytes]) -> None:
        """Tells gdkv ``keys`` will be read next, in order (:meth:`Client.hint`), in commands of
        at most HINT_BATCH keys (a hint's key list is at most 64 KiB: about 3,600 keys).
        Advisory: a failure is logged at debug level and returns; gdkv unavailable drops
        ``client``, as for any command."""
        try:
            for start in range(0, len(keys), HINT_BATCH):
                client.hint(keys[start: start + HINT_BATCH])
        except UNAVAILABLE as e:
            log.debug("gdkv: hint of %d keys failed: %s", len(keys), e)
            self.fail(client, e)
        except errors.Error as e:
            log.debug("gdkv: hint of %d keys failed: %s", len(keys), e)

    def close(self) -> None:
        """Closes a gdkvd connection (in-process controllers live as long as the process), for
        good: no connect follows."""
        with self._lock:
            c, self._client = self._client, None
            self._closed.set()   # ends the connect thread; a connect in flight closes its client
        if c is not None and not self.backend:
            c.close()
