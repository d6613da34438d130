"""gdkv as SGLang's HiCache storage (L3): ``gdkv.sglang.GdkvStorage``, an SGLang ``HiCacheStorage``,
loaded by SGLang 0.5.23's ``--hicache-storage-backend dynamic`` with ``module_path: gdkv.sglang``,
``class_name: GdkvStorage`` and ``interface_v1: 1`` (pages move straight between gdkv and
SGLang's host pool; without it SGLang's copying batch_get/batch_set path is used) in its extra
config, with gdkv.engine's keys.

Contract: a page is reported stored or loaded only when every one of its values is (the store
may evict one value of a page and keep another); ``batch_exists`` gives the leading run of such
pages and hints it to gdkv, in order. A gdkvd that is down, killed or frozen means misses
(``False``/``0``/``None``) and failed sets (``False``), never an exception to SGLang and never
wrong bytes; a value whose command fails fails its page only. The full launch command, keys,
how pages map to values (per layout), zero copy, hints and ``clear()``: docs/integrations.md
("SGLang").
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Mapping, Optional, Sequence, TypeVar

import numpy as np
import torch

from sglang.srt.mem_cache.hicache_storage import (HiCacheStorage, HiCacheStorageConfig,
                                                  HiCacheStorageExtraInfo)

from .client import Client
from .config import Key, read_config
from .engine import EngineStore
from .keys import KeySpace

log = logging.getLogger("gdkv.sglang")
# SGLang's own keys of the extra config that may reach the backend (0.5.23: the dynamic
# loader's, the controller's interface_v1, and those its parser pops but a config built by hand
# keeps); with every connector's (gdkv.config.ENGINE_KEYS) they are all it accepts.
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "file_storage_path",
               "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
               "hicache_storage_pass_prefix_keys", "tp_lcm_size")
_PASSED_THROUGH = [Key(k, None, None, "SGLang's own") for k in SGLANG_KEYS]
T = TypeVar("T")

#: A page of at most this many contiguous runs stores one value per run (zero copy both ways);
#: more (layer_first) is one value spread over its runs.
MAX_VALUES_PER_PAGE = 2
#: clear() deletes this many keys per submission round.
CLEAR_BATCH = 512


def _runs(view: torch.Tensor) -> list[torch.Tensor]:
    """``view``'s maximal C-contiguous sub-tensors along its leading dims, in C order."""
    if view.is_contiguous():
        return [view]
    return [r for sub in view.unbind(0) for r in _runs(sub)]


class _PageLayout:
    """Where each page's bytes lie in the host pool, and how they map to gdkv values.

    Found from the pool's own ``get_data_page(index, flat=False)`` views of three pages (first,
    second, last): a page's runs move by one fixed stride from one page to the next, which is
    checked, so any host pool whose data pages are views into one contiguous ``kv_buffer`` works
    (MHA and MLA, every layout SGLang's CLI offers).
    """

    def __init__(self, pool: Any):
        base = pool.kv_buffer
        if not isinstance(base, torch.Tensor) or not base.is_contiguous() or base.is_cuda:
            raise ValueError(f"gdkv: {type(pool).__name__} keeps no single contiguous host "
                             "kv_buffer; its pages cannot be moved in place")
        self.page_size = int(pool.page_size)
        self.nbytes = base.numel() * base.element_size()
        self.base_ptr = base.data_ptr()
        # The whole pool as bytes: runs are slices of it (cheaper than torch views).
        self.host = base.view(-1).view(torch.uint8).numpy()
        first = self._page_runs(pool, 0)
        self.sizes = [n for _, n in first]
        self.offsets = [o for o, _ in first]
        self.page_bytes = sum(self.sizes)
        self.end = max(o + n for o, n in first)  # page 0's last byte + 1
        page_num = int(pool.size) // self.page_size
        if page_num < 2:
            raise ValueError("gdkv: the host pool has fewer than 2 pages")
        second = self._page_runs(pool, self.page_size)
        self.stride = second[0][0] - first[0][0]
        last_page = page_num - 1
        last = self._page_runs(pool, last_page * self.page_size)
        for runs, page in ((second, 1), (last, last_page)):
            if [n for _, n in runs] != self.sizes or [o for o, _ in runs] != [
                    o + page * self.stride for o in self.offsets]:
                raise ValueError(f"gdkv: {type(pool).__name__} ({pool.layout}) pages do not "
                                 "repeat with one stride; this layout is not supported")
        # Values: one per run, or one for the whole page spread over its runs.
        if len(self.sizes) <= MAX_VALUES_PER_PAGE:
            self.parts = [[i] for i in range(len(self.sizes))]
        else:
            self.parts = [list(range(len(self.sizes)))]
        self.part_sizes = [sum(self.sizes[i] for i in p) for p in self.parts]
        # Where each value starts in SGLang's flat data page (the runs' bytes, in order).
        self.part_flat_offsets = [sum(self.part_sizes[:j]) for j in range(len(self.parts))]
        self.scattered = any(len(p) > 1 for p in self.parts)

    def _page_runs(self, pool: Any, index: int) -> list[tuple[int, int]]:
        view = pool.get_data_page(index, flat=False)
        out = []
        for r in _runs(view):
            off = r.data_ptr() - self.base_ptr
            n = r.numel() * r.element_size()
            if off < 0 or off + n > self.nbytes:
                raise ValueError(f"gdkv: {type(pool).__name__}.get_data_page is not a view of "
                                 "its kv_buffer")
            out.append((off, n))
        return out

    def page(self, index: int) -> Optional[int]:
        """The page number of host token index ``index`` (None unless a page starts there)."""
        page, rest = divmod(index, self.page_size)
        if rest or page < 0 or page * self.stride + self.end > self.nbytes:
            return None
        return page

    def run(self, page: int, i: int) -> np.ndarray:
        off = self.offsets[i] + page * self.stride
        return self.host[off: off + self.sizes[i]]

    def part_runs(self, page: int, part: int) -> list[np.ndarray]:
        return [self.run(page, i) for i in self.parts[part]]


class GdkvStorage(HiCacheStorage):
    """SGLang HiCache storage on gdkv. Built by SGLang's backend factory for
    ``--hicache-storage-backend dynamic``: ``GdkvStorage(storage_config, kwargs)`` (``kwargs``:
    the factory's extra arguments, none today); then SGLang calls :meth:`register_mem_pool_host`
    with its host KV pool before any other call. Until then every call is a miss."""

    def __init__(self, storage_config: HiCacheStorageConfig,
                 kwargs: Optional[Mapping[str, Any]] = None):
        self.storage_config = storage_config
        config = read_config(storage_config.extra_config or {}, _PASSED_THROUGH,
                             "SGLang's --hicache-storage-backend-extra-config")
        self.store = EngineStore(config)
        self.namespace = config["namespace"]
        self.enable_metrics = bool(storage_config.enable_storage_metrics)
        if not config.get("interface_v1"):
            log.warning("gdkv: \"interface_v1\" is not set in the extra config: SGLang will use "
                        "its copying batch_get/batch_set path instead of the in-place one")
        self.mem_pool_host: Any = None
        self.keyspace: Optional[KeySpace] = None
        self.layout: Optional[_PageLayout] = None
        self._lock = threading.Lock()
        self._metrics: dict[str, list] = {"prefetch_pgs": [], "backup_pgs": [],
                                          "prefetch_bandwidth": [], "backup_bandwidth": []}
        self.store.client()  # connect now (logged); a gdkvd that is down is retried later

    def __repr__(self) -> str:
        space = self.keyspace.description if self.keyspace else "no host pool yet"
        return f"GdkvStorage({self.store}, {space})"

    # ---- setup ----
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang's host KV pool: the page layout, and the key space (its dtype and layout)."""
        super().register_mem_pool_host(mem_pool_host)
        layout = _PageLayout(mem_pool_host)
        cfg = self.storage_config
        model = cfg.model_name or ""
        if not model:
            log.warning("gdkv: SGLang passed no model name; keys are salted with the host "
                        "pool's geometry only (set --served-model-name)")
        shard = [] if cfg.is_mla_model else [f"tp={cfg.tp_rank}/{cfg.tp_size}"]
        if cfg.pp_size > 1:
            shard.append(f"pp={cfg.pp_rank}/{cfg.pp_size}")
        if cfg.attn_cp_size > 1:
            shard.append(f"cp={cfg.attn_cp_rank}/{cfg.attn_cp_size}")
        dtype = str(mem_pool_host.dtype).removeprefix("torch.")
        pool_layout = (f"{mem_pool_host.layout}/{type(mem_pool_host).__name__}"
                       f"/page_size={layout.page_size}/layers={mem_pool_host.layer_num}"
                       f"/page_bytes={layout.page_bytes}")
        self.keyspace = KeySpace("sglang", "|".join([model, *shard]), dtype, pool_layout,
                                 self.namespace)
        # Through gdkvd, pages then move where they lie in the pool (no staging copy). SGLang
        # registers the pool before its first transfer, so nothing writes it during the share.
        self.store.share(layout.host)
        self.layout = layout
        log.info("gdkv: %s; %d value(s) per page of %d bytes (%s)", self, len(layout.parts),
                 layout.page_bytes, "scattered" if layout.scattered else "in place")

    def close(self) -> None:
        self.store.close()

    # ---- keys ----
    def _page_keys(self, page_hash: str) -> list[bytes]:
        """A page's value keys: the page hash's own key, then one per further value."""
        assert self.keyspace is not None and self.layout is not None
        first = self.keyspace.key(page_hash)
        return [first] + [self.keyspace.key(f"{page_hash}#{j}")
                          for j in range(1, len(self.layout.parts))]

    def _keys(self, page_hashes: Sequence[str]) -> list[bytes]:
        """Every page's value keys, page after page."""
        return [k for h in page_hashes for k in self._page_keys(h)]

    def _missing(self, c: Client, keys: list[bytes]) -> list[int]:
        """The pages (indices) of ``keys`` (as from _keys) with a value that is not stored (the
        store evicts values one by one, so a page may have lost one and kept another)."""
        nparts = len(self.layout.parts)
        present = self.store.present(c, keys)
        return [i for i in range(len(keys) // nparts)
                if not all(present[i * nparts: (i + 1) * nparts])]

    def _put_values(self, c: Client, keys: list[bytes], todo: list[int],
                    value: Callable[[int, int], Any]) -> list[bool]:
        """Stores ``value(i, j)`` under page i's j-th key for every page i of ``todo``, in one
        round; whether each page of ``todo`` had every value stored."""
        nparts = len(self.layout.parts)
        idx = [(i, j) for i in todo for j in range(nparts)]
        ok = self.store.put(c, [keys[i * nparts + j] for i, j in idx], lambda n: value(*idx[n]))
        return [all(ok[n * nparts:(n + 1) * nparts]) for n in range(len(todo))]

    # ---- the failure rule ----
    def _call(self, fn: Callable[[Client], T], default: T, what: str) -> T:
        """``fn(client)``; ``default`` when gdkv is unavailable (the client is dropped and retried
        later) or a command fails (the store is full, shared memory is used up...)."""
        return default if self.layout is None else self.store.call(fn, default, what)

    def copies(self) -> tuple[int, int]:
        """(buffers, bytes) copied on the way (EngineStore.copies): layer_first pages gathered to
        be stored, pages staged where gdkv does not reach the pool. (0, 0) when every page moved
        in place."""
        return self.store.copies()

    def _record(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        if self.enable_metrics and pages:
            with self._lock:
                self._metrics[f"{kind}_pgs"].append(pages)
                self._metrics[f"{kind}_bandwidth"].append(nbytes / max(seconds, 1e-9) / 1e9)

    # ---- moving pages ----
    def _get_pages(self, c: Client, keys: list[bytes], pages: list[int]) -> list[bool]:
        """Loads each page's values into the host pool; a page is True once all arrived whole."""
        lay = self.layout
        nparts = len(lay.parts)
        outs = [runs[0] if len(runs) == 1 else runs
                for p in pages for runs in (lay.part_runs(p, j) for j in range(nparts))]
        # A page spread over runs gdkvd does not reach (layer_first, the pool not shared) is
        # staged; one run is staged by the client if need be.
        load = self.store.load_staged if lay.scattered and not self.store.reaches(
            c, [lay.host]) else self.store.load
        got, _ = load(c, keys, outs, lay.part_sizes * len(pages))
        return [all(got[i * nparts:(i + 1) * nparts]) for i in range(len(pages))]

    def _put_pages(self, c: Client, keys: list[bytes], pages: list[int]) -> tuple[list[bool], int]:
        """Stores each page's values from the host pool: (stored, how many were written);
        pages already stored are not written again."""
        lay = self.layout
        todo = self._missing(c, keys)
        stored = [True] * len(pages)
        if not todo:
            return stored, 0
        if not lay.scattered:  # each value is one run of the pool, read in place
            ok = self._put_values(c, keys, todo, lambda i, j: lay.run(pages[i], j))
        else:  # layer_first: a page is one value, gathered from its runs
            ok = self.store.put_gathered(c, [keys[i] for i in todo],
                                         lambda n: lay.part_runs(pages[todo[n]], 0),
                                         lay.page_bytes)
        for i, page_ok in zip(todo, ok):
            stored[i] = page_ok
        return stored, len(todo)

    def _pages_of(self, host_indices: torch.Tensor, count: int) -> Optional[list[int]]:
        """The page number of each of ``count`` pages from their host token indices; None when
        there is nothing to move (no pages, no host pool registered) or the indices are bad."""
        lay = self.layout
        if count == 0 or lay is None:
            return None
        idx = host_indices.reshape(-1)
        if idx.numel() != count * lay.page_size:
            log.error("gdkv: %d host indices for %d pages of %d tokens", idx.numel(), count,
                      lay.page_size)
            return None
        pages = [lay.page(int(i)) for i in idx[:: lay.page_size].tolist()]
        if any(p is None for p in pages):
            log.error("gdkv: host indices that do not start pages of the host pool")
            return None
        return pages  # type: ignore[return-value]

    # ---- SGLang's zero-copy interface (extra config "interface_v1": 1) ----
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> list[bool]:
        """Loads page ``keys[i]`` into the host pool at ``host_indices[i*page_size:
        (i+1)*page_size]``; whether each page was loaded."""
        pages = self._pages_of(host_indices, len(keys))
        if pages is None:
            return [False] * len(keys)
        t0 = time.perf_counter()
        ok = self._call(lambda c: self._get_pages(c, self._keys(keys), pages),
                        [False] * len(keys), "batch_get_v1")
        self._record("prefetch", sum(ok), sum(ok) * self.layout.page_bytes,
                     time.perf_counter() - t0)
        return ok

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> list[bool]:
        """Stores the host pool's pages at ``host_indices`` under ``keys``; whether each was."""
        pages = self._pages_of(host_indices, len(keys))
        if pages is None:
            return [False] * len(keys)
        t0 = time.perf_counter()
        ok, written = self._call(lambda c: self._put_pages(c, self._keys(keys), pages),
                                 ([False] * len(keys), 0), "batch_set_v1")
        self._record("backup", written, written * self.layout.page_bytes,
                     time.perf_counter() - t0)
        return ok

    def batch_exists(self, keys: list[str],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many leading pages of ``keys`` have every value stored: one ``lookup_prefix``
        over all the pages' values, page after page. SGLang's prefetch thread asks this for a
        waiting request's pages and then reads the pages found: their values are hinted to gdkv,
        in order (module docstring)."""
        return self._leading_pages(keys, hint=True)

    def exists(self, key: str) -> bool:
        return self._leading_pages([key], hint=False) == 1

    def _leading_pages(self, page_hashes: list[str], hint: bool) -> int:
        if not page_hashes or self.layout is None or self.keyspace is None:
            return 0
        keys = self._keys(page_hashes)
        return self._call(lambda c: self.store.leading(c, keys, hint, len(self.layout.parts)), 0,
                          "batch_exists")

    # ---- SGLang's generic interface: flat data pages (its own copies) ----
    def _flat(self, t: torch.Tensor) -> Optional[np.ndarray]:
        """A contiguous CPU tensor of one page, as its bytes (a view)."""
        if not isinstance(t, torch.Tensor) or t.is_cuda or not t.is_contiguous() or \
                t.numel() * t.element_size() != self.layout.page_bytes:
            log.error("gdkv: a data page must be a contiguous CPU tensor of %d bytes",
                      self.layout.page_bytes)
            return None
        return t.reshape(-1).view(torch.uint8).numpy()

    def _flat_parts(self, flat: np.ndarray) -> list[np.ndarray]:
        lay = self.layout
        return [flat[o: o + n] for o, n in zip(lay.part_flat_offsets, lay.part_sizes)]

    def batch_get(self, keys: list[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> list[Optional[torch.Tensor]]:
        """Each page into its flat tensor (``target_locations[i]``, else a new one); None where
        it is not stored."""
        if not keys or self.layout is None:
            return [None] * len(keys)
        targets = list(target_locations) if target_locations is not None else [
            self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        flats = [self._flat(t) for t in targets]
        if any(f is None for f in flats):
            return [None] * len(keys)
        nparts = len(self.layout.parts)
        lay = self.layout

        def get(c: Client) -> list[Optional[torch.Tensor]]:
            outs = [part for f in flats for part in self._flat_parts(f)]
            got, _ = self.store.load(c, self._keys(keys), outs, lay.part_sizes * len(keys))
            return [t if all(got[i * nparts:(i + 1) * nparts]) else None
                    for i, t in enumerate(targets)]

        t0 = time.perf_counter()
        out = self._call(get, [None] * len(keys), "batch_get")
        hits = sum(t is not None for t in out)
        self._record("prefetch", hits, hits * lay.page_bytes, time.perf_counter() - t0)
        return out

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_set(self, keys: list[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Stores each flat data page ``values[i]`` under ``keys[i]``; True if all were."""
        if not keys or self.layout is None or values is None or len(values) != len(keys):
            return False
        flats = [self._flat(v) for v in values]
        if any(f is None for f in flats):
            return False
        all_keys = self._keys(keys)
        parts = [self._flat_parts(f) for f in flats]

        def put(c: Client) -> tuple[bool, int]:
            todo = self._missing(c, all_keys)
            if not todo:
                return True, 0
            ok = self._put_values(c, all_keys, todo, lambda i, j: parts[i][j])
            return all(ok), len(todo)

        t0 = time.perf_counter()
        ok, written = self._call(put, (False, 0), "batch_set")
        self._record("backup", written, written * self.layout.page_bytes,
                     time.perf_counter() - t0)
        return ok

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    # ---- the rest ----
    def clear(self) -> bool:
        """Deletes every SGLang key of this connector's ``namespace`` (every model's, as SGLang's
        other backends empty their whole store), in batches of :data:`CLEAR_BATCH`; the keys of
        other engines and namespaces on the same gdkv stay."""
        if self.keyspace is None:
            return False
        prefix = self.keyspace.prefix

        def wipe(c: Client) -> bool:
            keys = c.list(prefix)
            failed = 0
            for start in range(0, len(keys), CLEAR_BATCH):
                failed += self.store.delete(c, keys[start: start + CLEAR_BATCH])
            return failed == 0

        return self._call(wipe, False, "clear")

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics (pages and GB/s of each load and store) since the last call;
        None unless SGLang runs with --enable-metrics (HiCacheStorageConfig.enable_storage_metrics).
        """
        if not self.enable_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        with self._lock:
            for name, values in self._metrics.items():
                getattr(m, name).extend(values)
                values.clear()
        return m
