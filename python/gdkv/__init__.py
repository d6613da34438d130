"""gdkv: a KV-cache store for LLM inference, from Python.

Store a prompt's KV-cache blocks under chain keys and find the longest stored prefix of another
prompt, with values moved in place between gdkv and numpy arrays or torch tensors::

    import gdkv
    with gdkv.connect("/run/gdkvd") as c:                  # or gdkv.open(backend="local")
        keys = gdkv.chain_keys(token_ids, 64, salt="my-model")
        n = c.lookup_prefix(keys)                          # leading blocks stored
        buf = c.empty((n, block_bytes), "uint8")           # memory gdkvd writes in place
        c.get_many_into(keys[:n], list(buf))

Entry points: :func:`open`, :func:`connect`, :class:`Client`, :func:`chain_keys`,
:func:`hash128`; the exceptions in :mod:`gdkv.errors` (all under :class:`Error`). The demos live
outside the package (demo/ in the repository). docs/python.md has the whole API and its memory rules.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from . import _core, errors
from .client import Client
from .errors import (CapacityError, ClosedError, ConnectionError, Error, InvalidKeyError,
                     KeyExistsError, KeyNotFoundError, NotReadyError, TimeoutError, ValueSizeError,
                     raise_first)

_core._set_error_factory(errors._make)

# gdkv.TimeoutError and gdkv.ConnectionError are left out, so `from gdkv import *` does not
# shadow the builtins (they subclass them: `except TimeoutError` still catches gdkv's).
__all__ = [
    "open", "connect", "settings", "Client", "chain_keys", "hash128", "backends", "cuda_build",
    "features", "prepare_shared_memory", "raise_first",
    "Error", "KeyNotFoundError", "KeyExistsError", "InvalidKeyError", "ValueSizeError",
    "CapacityError", "NotReadyError", "ClosedError",
]
__version__ = "0.1.0"

#: Whether this build has CUDA copy engines (nvcc was found when it was built).
cuda_build: bool = _core.cuda_build


def backends() -> list[str]:
    """The backends this build has: ``['memory', 'local', 'rados', 'tiered']`` (the last two with
    librados)."""
    return _core.backends()


def backend_traits() -> dict[str, dict[str, Any]]:
    """Each backend's traits, by name, as its registration declares them
    (``include/gdkv/backend_registry.h``): ``can_time_out`` (ops fail with NotReadyError when a
    remote service stalls), ``needs_directory`` (and ``directory_setting``, the setting naming
    it), ``can_be_far_tier``, ``needs_cluster``, ``has_far_tier``, and ``help``.

    >>> gdkv.backend_traits()["rados"]["can_time_out"]
    True
    """
    return _core.backend_traits()


def settings(kind: Optional[str] = None) -> list[dict[str, Any]]:
    """gdkv's settings, declared once in C++ (``include/gdkv/settings.h``), in the order the docs
    list them: ``kind`` ``"store"`` (gdkv.open's and gdkvd's store), ``"client"``
    (gdkv.connect's), ``"daemon"`` (gdkvd's own), ``"namespace"`` (the keys of a gdkvd
    namespace), or None for all. Each is a dict: ``name`` (the keyword, a connector's key),
    ``kind``, ``type`` (``"int"``, ``"bool"``, ``"str"`` or ``"list"`` of ids),
    ``default``, ``unit``, ``help``, gdkvd's TOML key (``toml``, "" for a client's) and flag
    (``flag``), and ``min``/``max`` (int) or ``choices`` (str, empty: any).

    >>> {s["name"]: s["default"] for s in gdkv.settings("store")}["ceph_timeout_ms"]
    5000
    """
    return [s for s in _core.settings() if kind is None or s["kind"] == kind]


def open(backend: str = "local", *, nsid: int = 1, queue_depth: Optional[int] = None,
         cuda_device: Optional[int] = None, **settings: Any) -> Client:
    """A client with a controller in this process, over ``backend``.

    - ``"local"``: the embedded local store in directory ``store`` (default ``$GDKV_STORE``,
      else ``~/.local/share/gdkv``) of ``capacity`` bytes. One process at a time.
    - ``"memory"``: values in this process's memory, ``memory_capacity`` bytes; once full it
      evicts the least recently used values.
    - ``"rados"``: the Ceph pool ``pool`` (``ceph_conf``, ``ceph_client``, ``ceph_keyring``;
      a dead cluster fails calls with NotReadyError after ``ceph_timeout_ms``).
    - ``"tiered"``: the local store (``store``, ``capacity``) in front of the RADOS pool (the
      rados settings): misses are read from RADOS and kept locally, Stores written through.

    ``settings`` are the store's settings by name (:func:`settings` lists each with its type,
    default and range; docs/python.md too): ``cache_bytes`` > 0 puts a host cache in front
    (``cache_policy``, ``prefetch_depth``), ``reactors``, ``max_value_bytes`` and the backend's.
    A setting given as None keeps its default. An unknown name or a value of the wrong type
    raises TypeError, a value out of range ValueError. ``cuda_device``: CUDA copy engines for
    CUDA tensors (CUDA builds). Raises gdkv.Error with the reason when the backend cannot be
    opened.

    >>> c = gdkv.open("memory", cache_bytes=1 << 30)
    """
    settings["backend"] = backend
    cuda = -1 if cuda_device is None else cuda_device
    # The in-process queue's depth is a connection's (gdkv.connect's queue_depth).
    depth = _core.effective_settings({"queue_depth": queue_depth}, "client")["queue_depth"]
    return Client(_core.open(settings, nsid, depth, cuda))


def connect(socket_dir: str, *, nsid: int = 1, **settings: Any) -> Client:
    """A client of the gdkvd serving ``socket_dir`` (its socket is ``socket_dir/cntrl``).

    ``settings`` are a connection's settings by name (``settings("client")`` lists each with its
    type, default and range; docs/settings.md too); None keeps a default. ``shared_memory_bytes``
    of memory are shared with gdkvd (committed only when used): queues, :meth:`Client.empty`
    arrays and staged buffers. A command gdkvd does not complete within ``timeout_ms`` raises
    gdkv.TimeoutError (connecting and closing wait as long, at most ``admin_timeout_ms``); a gdkvd
    that exits or dies raises gdkv.ConnectionError within about 10 ms. Either way the client stays
    unusable: connect again. An unknown name or a value of the wrong type raises TypeError, a
    value out of range ValueError.

    >>> c = gdkv.connect("/run/gdkvd", timeout_ms=2000)
    """
    return Client(_core.connect(socket_dir, settings, nsid))


def chain_keys(token_ids: Iterable[int], block_tokens: int, salt: str | bytes = "",
               parent: Optional[bytes] = None) -> list[bytes]:
    """The 16-byte key of every full block of ``token_ids`` (a trailing partial block has none).

    Block i's key hashes block i-1's key, the block's token ids and ``salt`` (name the model and
    KV layout there, so different models never share keys); equal to the C++ gdkv::chain_keys.
    ``parent`` continues a chain from the key of the block before ``token_ids[0]``.

    >>> gdkv.chain_keys(range(32), 16, "m")     # two keys
    [b'...', b'...']
    """
    ids = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)
    return _core.chain_keys(ids, block_tokens, salt, parent)


def features() -> dict:
    """What this build of gdkv has: its backends (``rados`` and ``tiered`` only when librados
    was found at build time), CUDA copy engines, and the paths of the ``gdkvd`` daemon and the
    ``gdkv`` CLI installed with it (next to this Python, else the first on PATH; None if none).

    >>> gdkv.features()
    {'backends': ['memory', 'local', 'rados', 'tiered'], 'rados': True, 'cuda': False,
     'gdkvd': '/venv/bin/gdkvd', 'gdkv': '/venv/bin/gdkv'}

    A missing backend is an error when it is opened (gdkv.Error naming it), not at import.
    """
    from . import server

    have = backends()
    return {"backends": have, "rados": "rados" in have, "cuda": cuda_build,
            "gdkvd": server.installed("gdkvd"), "gdkv": server.installed("gdkv")}


def prepare_shared_memory(buffer) -> None:
    """Readies host memory you already have (a numpy array, a CPU torch tensor, an engine's KV
    pool) to be shared with gdkvd in place: its pages move onto memory gdkvd can map, at the
    same addresses, contents kept. Every later :meth:`Client.register` of it, by any client
    (one opened after gdkvd restarted too), then copies nothing, so it is safe while other
    threads use the memory. Call it once, before the memory is in use: writes by other threads
    during this call are lost. The rules of :meth:`Client.register` apply (only private memory;
    a file mapping, shared or read-only memory raises ValueError); no gdkvd is needed.

    >>> kv = torch.zeros((layers, blocks, block_bytes), dtype=torch.uint8)
    >>> gdkv.prepare_shared_memory(kv)     # at start-up; c.register(kv) whenever a client opens
    """
    _core.prepare_shared_memory(buffer)


def hash128(data) -> bytes:
    """128-bit XXH3 of a bytes-like object, as 16 bytes (gdkv's key hash)."""
    return _core.hash128(data)
