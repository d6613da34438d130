"""What the engine connectors (gdkv.vllm, gdkv.sglang, gdkv.lmcache) share, by concern:

- gdkv.config: every connector key, declared once, and :func:`~gdkv.config.read_config`;
- gdkv.keys: :class:`~gdkv.keys.KeySpace`, block hashes to salted gdkv keys;
- gdkv.fingerprint: :func:`~gdkv.fingerprint.weights_fingerprint`, a model folder's weights;
- gdkv.removals: :class:`~gdkv.removals.RemovalFeed`, the keys gdkvd removed (one namespace,
  over a connection; or every namespace, from the metrics port's ``/removed``);
- here: :class:`Stats`, a connector's counters (one convention for all three), and
  :class:`EngineStore`, the connection and the transfers.

:class:`EngineStore` is one gdkv client opened from an engine's config, with the failure rule
every connector follows: a gdkvd that is down, frozen or unreachable means "no hits" and
"nothing saved", never an error for the user. The client is dropped at the first failure (and
closed on a background thread) and opened again, at most once per ``retry_interval_s``.
Connecting runs on a background thread, one at a time, that tries until it succeeds: the
constructor waits for its first try (at engine start-up, at most ``timeout_ms`` and a second);
otherwise :meth:`EngineStore.client` returns None until a connect has succeeded, so a frozen
gdkvd never holds up the caller's thread for more than a lock acquisition. Its transfer calls
(leading, present, load, put, delete, and the staging: reaches, load_staged, put_gathered)
answer per key.

The names of the other modules stay importable from here (``from gdkv.engine import KeySpace``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any, Callable, Iterable, Mapping, Optional, TypeVar

from . import _core, connect, errors, prepare_shared_memory
from . import open as open_client
from .client import Client
from .config import CLIENT_KEYS, ENGINE_KEYS, OPEN_KEYS, STORE_KEYS, defaults, read_config
from .fingerprint import weights_fingerprint
from .keys import KeySpace
from .removals import RemovalFeed

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
        # (An unknown backend is left to gdkv.open, whose error the connect thread logs.)
        if _core.backend_traits().get(self.backend, {}).get("can_time_out"):
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

    def put(self, client: Client, keys: list[bytes], value: Callable[[int], Any], *,
            low_priority: bool = False) -> list[bool]:
        """Stores ``value(i)`` under ``keys[i]`` in one batch; whether each was stored (with
        ``low_priority``: values evicted first, Client.put). (The vLLM and SGLang connectors ask
        :meth:`present` first and put only what is missing; LMCache's sends every chunk.)"""
        if not keys:
            return []
        res = self._noted(client.put_many([(k, value(i)) for i, k in enumerate(keys)],
                                          low_priority=low_priority), "put")
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
