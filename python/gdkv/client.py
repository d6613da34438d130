"""The gdkv client: NVMe-KV commands from Python, values passed by address.

Open one with :func:`gdkv.open` (a controller in this process over a backend) or
:func:`gdkv.connect` (a running gdkvd, over vfio-user)::

    with gdkv.open(backend="memory") as c:
        c.put(b"block-0", b"...")
        c.get(b"block-0")                     # b'...'
        out = c.empty(3, "uint8")              # memory the controller writes in place
        c.get_into(b"block-0", out)            # 3

Zero copy: ``put`` reads the caller's buffer and ``get_into`` writes it where it is (bytes-like
objects, numpy arrays, torch tensors). In-process, any host buffer is reached in place. Through
gdkvd, only memory shared with gdkvd is: allocate it with :meth:`Client.empty`, or share memory you
already have where it lies with :meth:`Client.register` (an engine's KV pool); other buffers are
staged (copied) through shared memory, and :meth:`Client.copies` counts those copies.

A client is safe to use from several threads; every command releases the GIL while it waits, and
close() waits for calls in flight. The ``a``-prefixed methods are awaitable forms for asyncio (each runs in the client's thread pool).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import math
from typing import Any, Iterable, NamedTuple, Optional, Sequence

from . import _core
from .errors import Error

Key = bytes | bytearray | str
#: A buffer: anything with the buffer protocol (bytes, bytearray, memoryview, numpy) or DLPack
#: (torch tensors, CPU or CUDA).
Buffer = Any


class Removed(NamedTuple):
    """One read of gdkvd's removed keys of a namespace (:meth:`Client.removed`)."""

    boot: int          #: the removal log's life: another value means gdkvd restarted
    last: int          #: the cursor to pass as ``after`` next
    lost: bool         #: removals were missed: every key followed may be gone
    keys: list[bytes]  #: the keys removed, oldest first
    more: bool         #: more records follow ``last``: read again at once


class Client:
    """A queue pair to a gdkv controller. Use :func:`gdkv.open` or :func:`gdkv.connect`."""

    def __init__(self, core: _core.Core, async_threads: int = 4):
        self._core = core
        self._async_threads = async_threads
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None

    # ---- life cycle ----
    def close(self) -> None:
        """Waits for calls in flight, then closes. Later calls raise gdkv.ClosedError."""
        self._core.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    @property
    def closed(self) -> bool:
        return self._core.closed

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"nsid {self._core.nsid}"
        return f"<gdkv.Client {self._core.where}, {state}>"

    @property
    def remote(self) -> bool:
        """True for a client of gdkvd (connect), False for an in-process controller (open)."""
        return self._core.remote

    # ---- single keys ----
    def put(self, key: Key, value: Buffer, *, must_exist: bool = False,
            must_not_exist: bool = False, low_priority: bool = False) -> None:
        """Stores ``value`` (read in place) under ``key``.

        >>> c.put(b"block-0", torch.zeros(1024))

        ``must_exist``: only replace (else KeyNotFoundError); ``must_not_exist``: only create
        (else KeyExistsError); ``low_priority``: evicted before ordinary values of its namespace
        (the host cache and the memory backend; a read makes it ordinary).
        """
        _cuda_sync(value)
        self._core.put(key, value, must_exist, must_not_exist, low_priority)

    def get(self, key: Key, *, size_hint: int = 65536) -> bytes:
        """The whole value as bytes (one copy; see get_view and get_into for none). KeyError if
        missing.

        One Retrieve whatever the value's length: it is received into a buffer of the
        controller's largest value size (through gdkvd in the shared memory, where gdkvd writes
        it), then copied into the bytes object. A second happens only when the shared memory has
        no piece that large free and the value is longer than the piece it had; a value the
        shared memory cannot hold at all raises CapacityError. ``size_hint`` is no longer
        needed and is ignored (accepted for compatibility).
        """
        return self._core.get(key, size_hint)

    def get_view(self, key: Key) -> memoryview:
        """The whole value as a read-only memoryview of the memory it was received in: no copy
        at all (through gdkvd, the shared memory gdkvd wrote it to). One Retrieve, as get. The
        view holds that memory until it is released (``view.release()``, or its last reference
        gone), so release views you are done with: through gdkvd they use the connection's
        shared memory (``connect(shared_memory_bytes=...)``). It stays valid after other calls
        and after close(). KeyError if missing.

        >>> with c.get_view(b"block-0") as v:
        ...     np.frombuffer(v, np.float16)      # read in place (copy what you keep)
        """
        return self._core.get_view(key)

    def get_into(self, key: Key, out: Buffer | Sequence[Buffer], *, partial: bool = False) -> int:
        """Writes the value into ``out`` in place and returns its length in bytes.

        ``out`` is one writable contiguous buffer, or a list of them that the value fills in order
        (one Scatter Retrieve: e.g. a block's K and V for every layer straight into each layer's
        cache tensor). A value longer than ``out`` raises ValueSizeError after its first bytes were
        written, unless ``partial``. KeyError if the key does not exist.

        >>> out = c.empty(4096, "uint8")
        >>> c.get_into(b"block-0", out)         # 4096
        >>> c.get_into(b"block-0", [k_layer0, v_layer0, k_layer1, v_layer1])
        """
        _cuda_sync(out)
        return self._core.get_into(key, out, partial)

    def exists(self, key: Key) -> bool:
        return self._core.exists(key)

    def delete(self, key: Key, *, missing_ok: bool = False) -> bool:
        """Deletes the key: True; a missing key raises KeyError, or returns False if missing_ok."""
        return self._core.delete(key, missing_ok)

    def list(self, prefix: Optional[Key] = None) -> list[bytes]:
        """Every key (of this namespace) in byte order, or those starting with ``prefix``."""
        return self._core.list(prefix)

    # ---- batches: one submission round, one result per key ----
    # A key whose command failed gets its gdkv.Error in its place and fails only itself (as
    # RocksDB's MultiGet returns a status per key); gdkv.raise_first(results) raises the first.
    # A client that failed (TimeoutError, ConnectionError) or was closed raises.
    def exists_many(self, keys: Iterable[Key]) -> list[bool | Error]:
        """Whether each key exists; a key whose Exist failed (not missing: failed) is its
        error, which is not a bool: test ``r is True``."""
        return self._core.exists_many(list(keys))

    def lookup(self, keys: Iterable[Key]) -> tuple[int, Optional[Error]]:
        """How many leading keys exist, and why the run ended: None at a missing key (or the
        end), else the error of the key whose Exist failed. Asks in rounds of 16, 32, 64...
        keys and stops after the round that ended the run.

        >>> c.lookup(gdkv.chain_keys(tokens, 16, salt))   # (12, None): blocks 0..11 are stored
        """
        return self._core.lookup(list(keys))

    def lookup_prefix(self, keys: Iterable[Key]) -> int:
        """How many leading keys exist: the reusable prefix of a prompt's chain keys (lookup's
        count). A run ended by a key whose Exist failed raises that error.

        >>> c.lookup_prefix(gdkv.chain_keys(tokens, 16, salt))   # 12: blocks 0..11 are stored
        """
        n, error = self.lookup(keys)
        if error is not None:
            raise error
        return n

    def hint(self, keys: Iterable[Key]) -> None:
        """Tells gdkv these keys will be read soon, in this order (a scheduler hint: the
        requests waiting in an engine's queue). The cache keeps the cached ones from eviction
        until read or until the hint ages out, and fetches the others from its lower tier ahead
        of the read. Keys stored nowhere cost nothing. Returns once the hint is given. An empty
        list raises ValueError, a bad key InvalidKeyError, more than 64 KiB of key list (about
        3,600 16-byte keys) gdkv.Error with status 0x02.

        >>> c.hint(gdkv.chain_keys(tokens, 16, salt))   # None: the blocks are on their way
        """
        keys = list(keys)
        if not keys:
            raise ValueError("hint: no keys")
        self._core.hint(keys)

    def removed(self, after: Optional[int] = None, *, nsid: int = 0,
                max_records: int = 4096) -> Removed:
        """The keys gdkvd's store removed (deleted, evicted) from this client's namespace (or
        ``nsid``, one this connection may use) since the cursor ``after``, read over the
        connection (log page C0h): another tenant's removals are never seen. ``after=None``
        returns no keys, only the position to start from. Through gdkvd only (ValueError
        in-process); a namespace this peer may not use raises gdkv.Error with status 0x0B.

        >>> start = c.removed()            # Removed(boot=..., last=41, lost=False, keys=[], ...)
        >>> c.delete(b"block-0")
        >>> c.removed(start.last).keys     # [b'block-0']
        """
        boot, last, lost, more, keys = self._core.removed(after, nsid, max_records)
        return Removed(boot, last, lost, keys, more)

    def delete_many(self, keys: Iterable[Key], *,
                    missing_ok: bool = False) -> list[Optional[Error]]:
        """Deletes every key in one round: None for each deleted (or missing, if
        ``missing_ok``), else its error (KeyNotFoundError for a missing key)."""
        return self._core.delete_many(list(keys), missing_ok)

    def put_many(self, items: Iterable[tuple[Key, Buffer]], *,
                 low_priority: bool = False) -> list[Optional[Error]]:
        """Stores every (key, value): None for each stored, else its error (a full store's
        CapacityError, say); the others are stored all the same. ``low_priority`` as in put.

        >>> gdkv.raise_first(c.put_many(zip(keys, blocks)))   # raises if any failed
        """
        pairs = list(items)
        values = [v for _, v in pairs]
        _cuda_sync(*values)
        return self._core.put_many([k for k, _ in pairs], values, low_priority)

    def get_many(self, keys: Iterable[Key], *, size_hint: int = 65536) -> list[Optional[bytes]]:
        """Each key's value, None where it does not exist; raises for the first that failed.

        One Retrieve per key in rounds of as many keys as the shared memory has room for at
        once, each into a buffer as long as the longest value of the client's last get (KV
        blocks are uniform); the first, knowing none, of the controller's largest value size.
        A key whose value is longer than what the client saw last is read a second time (at its
        length). ``size_hint`` is no longer needed and is ignored.
        """
        return self._core.get_many(list(keys), size_hint)

    def get_many_view(self, keys: Iterable[Key]) -> list[Optional[memoryview]]:
        """get_many as get_view's read-only memoryviews (no copy), None where a key does not
        exist. Each view holds its memory until released: a batch of views larger than the
        shared memory raises CapacityError (after waiting up to 10 s for memory other calls
        hold)."""
        return self._core.get_many_view(list(keys))

    def get_many_into(self, keys: Iterable[Key], outs: Iterable[Buffer | Sequence[Buffer]], *,
                      partial: bool = False) -> list[int | Error]:
        """Writes each key's value into its out (as get_into): its full length, or its error
        (KeyNotFoundError for a missing key; ValueSizeError for a value longer than its out,
        unless ``partial``, which takes its first bytes and returns its full length)."""
        outs = list(outs)
        _cuda_sync(*outs)
        return self._core.get_many_into(list(keys), outs, partial)

    # ---- memory ----
    def alloc(self, nbytes: int):
        """``nbytes`` of memory the controller reaches in place, as a numpy uint8 array."""
        return self._core.alloc(nbytes)

    def empty(self, shape: int | Sequence[int], dtype: Any = "uint8"):
        """An uninitialised array in memory the controller reaches in place (zero copy).

        ``dtype`` is a numpy dtype (or its name): a numpy array; a torch dtype: a torch tensor.

        >>> k = c.empty((layers, 2, heads, tokens, dim), torch.float16)
        """
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        count = math.prod(shape)
        if _is_torch_dtype(dtype):
            import torch

            itemsize = torch.empty((), dtype=dtype).element_size()
            raw = self._core.alloc(max(count * itemsize, 1))
            return torch.from_numpy(raw[: count * itemsize]).view(dtype).view(shape)
        import numpy as np

        dt = np.dtype(dtype)
        raw = self._core.alloc(max(count * dt.itemsize, 1))
        return raw[: count * dt.itemsize].view(dt).reshape(shape)

    def reaches(self, buffer: Buffer) -> bool:
        """Whether the controller reads and writes this buffer in place (no staging copy)."""
        return self._core.reaches(buffer)

    def register(self, buffer: Buffer) -> None:
        """Makes memory you already have reachable in place (zero copy) until unregister():

        - host memory through gdkvd (a numpy array, a CPU torch tensor, an engine's KV pool):
          shared in place. Its pages are moved onto memory shared with gdkvd at the same
          addresses, contents kept, so the buffer stays what it was and ``reaches()`` becomes
          True for it and for any buffer inside it. Only anonymous memory (malloc, numpy, torch,
          mmap without a file) can be; a file mapping, POSIX shared memory or read-only memory
          raises ValueError. Register
          before the memory is in use: writes by other threads while it is being shared are
          lost. A process forked later shares these pages with this one. In-process, host memory
          is reached already and this changes nothing.
        - a CUDA tensor: joins the controller's copy engines (in-process clients opened with
          cuda_device=N).

        The client keeps a reference to ``buffer`` while it is registered; a buffer registered
        twice needs two unregister() calls.

        >>> kv = torch.zeros((layers, blocks, block_bytes), dtype=torch.uint8)
        >>> c.register(kv)            # gets and puts on kv's pages are now in place
        """
        self._core.register(buffer)

    def unregister(self, buffer: Buffer) -> None:
        """Undoes one register(buffer) (the same object or one at the same address). Through
        gdkvd, once commands on it are done, buffers there are staged again; the memory stays
        yours and keeps its contents."""
        self._core.unregister(buffer)

    def copies(self) -> tuple[int, int]:
        """(buffers, bytes) this client had to copy through staging memory: (0, 0) when every
        buffer was reached in place."""
        return self._core.copies()

    def metrics(self) -> dict[str, float]:
        """The controller's metrics (in-process) and the client's copy counters, by name with
        labels: ``{"client_staged_copies_total": 0.0, 'reactor_ops_total{op="retrieve"}': ...}``.
        """
        out: dict[str, float] = {}
        for name, labels, value in self._core.metrics():
            if labels:
                name += "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}"
            out[name] = value
        return out

    # ---- asyncio ----
    async def _run(self, fn, *args, **kwargs):
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self._async_threads, thread_name_prefix="gdkv")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def aput(self, key: Key, value: Buffer, **kw) -> None:
        return await self._run(self.put, key, value, **kw)

    async def aget(self, key: Key, **kw) -> bytes:
        return await self._run(self.get, key, **kw)

    async def aget_view(self, key: Key) -> memoryview:
        return await self._run(self.get_view, key)

    async def aget_into(self, key: Key, out: Buffer | Sequence[Buffer], **kw) -> int:
        return await self._run(self.get_into, key, out, **kw)

    async def aexists(self, key: Key) -> bool:
        return await self._run(self.exists, key)

    async def adelete(self, key: Key, **kw) -> bool:
        return await self._run(self.delete, key, **kw)

    async def aput_many(self, items: Iterable[tuple[Key, Buffer]], **kw) -> list[Optional[Error]]:
        return await self._run(self.put_many, list(items), **kw)

    async def aget_many(self, keys: Iterable[Key], **kw) -> list[Optional[bytes]]:
        return await self._run(self.get_many, list(keys), **kw)

    async def aget_many_view(self, keys: Iterable[Key]) -> list[Optional[memoryview]]:
        return await self._run(self.get_many_view, list(keys))

    async def aget_many_into(self, keys: Iterable[Key], outs: Iterable[Any], **kw):
        return await self._run(self.get_many_into, list(keys), list(outs), **kw)

    async def alookup_prefix(self, keys: Iterable[Key]) -> int:
        return await self._run(self.lookup_prefix, list(keys))

    async def ahint(self, keys: Iterable[Key]) -> None:
        return await self._run(self.hint, list(keys))


def _cuda_sync(*buffers: Any) -> None:
    """Work PyTorch queued on a CUDA tensor finishes before gdkv's copy engine touches it (the
    copy engine runs on a stream of its own). A call returns once its copies have landed."""
    for b in buffers:
        if isinstance(b, (list, tuple)):
            _cuda_sync(*b)
        elif getattr(b, "is_cuda", False):
            import torch

            torch.cuda.current_stream(b.device).synchronize()


def _is_torch_dtype(dtype: Any) -> bool:
    return type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype"
