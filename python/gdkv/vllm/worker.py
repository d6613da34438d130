"""The vLLM connector's worker side: registration, loads, staging, scatter and gather, saves and
their counters (docs/integrations.md)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.v1.kv_cache_interface import group_kernel_blocks

from .. import errors
from ..engine import EngineStore, Stats
from ..keys import KeySpace
from .plan import GdkvWorkerMeta, Plan, Transfer, dense


log = logging.getLogger("gdkv.vllm")


@dataclass
class Slot:
    """One gdkv value of each vLLM value on this rank: one KV cache group's layers (or a chunk
    of layers_per_value of them), one unit of heads_per_value KV heads."""

    group: int        # index into the plan's groups (and a Transfer's block ids)
    space: KeySpace
    offset: int       # the unit's byte offset in a block's page
    owns: bool        # this rank saves it (the first rank holding its heads)
    chunk: int = 0    # which layers_per_value layers of the group
    names: list[str] = field(default_factory=list)    # its layers' names
    layers: list[int] = field(default_factory=list)   # its layers' indices in pages
    value_bytes: int = 0                              # [block][layer][unit bytes]


class WorkerSide:
    """Moves values between gdkv and vLLM's paged KV cache: loads on one background thread,
    saves on another."""

    def __init__(self, plan: Plan, store: Optional[EngineStore], pp_rank: int = 0,
                 tp_rank: int = 0):
        self.plan = plan
        self.store = store
        self.rank = pp_rank * plan.tp + tp_rank
        first, units, owns = plan.rank_units(tp_rank)
        self.unit_bytes = plan.heads_per_value * plan.head_bytes
        self.slots = [Slot(gi, plan.keyspace(pp_rank, u, g, c),
                            (u * plan.heads_per_value - first) * plan.head_bytes, own, c, names)
                      for gi, g in enumerate(plan.groups)
                      for c, names in enumerate(g.chunks(plan.layers_per_value))
                      for u, own in zip(units, owns)]
        self.spaces = [sl.space for sl in self.slots]
        self.chunk_slots = [[sl for sl in self.slots if sl.chunk == c]
                            for c in range(plan.chunks)]
        self.save_queue_bytes = plan.extra["save_queue_bytes"]
        self.pages: list[torch.Tensor] = []   # per layer: (num_blocks, page_bytes) uint8 views
        self.value_bytes = 0    # the largest slot's value
        self.device = torch.device("cpu")
        self.gdkv_off = False   # register found a layout gdkv cannot use
        # Loads and saves on threads of their own: a request waiting for its KV never waits
        # behind saves.
        self.load_pool = ThreadPoolExecutor(1, thread_name_prefix="gdkv-vllm-load")
        self.save_pool = ThreadPoolExecutor(1, thread_name_prefix="gdkv-vllm-save")
        self.lock = threading.Lock()
        self.pin_lock = threading.Lock()   # the load and engine threads both reach _stage
        self.finished_loads: set[str] = set()
        self.load_errors: set[int] = set()
        self.reported_errors: set[int] = set()
        self.queued_save_bytes = 0
        self.saved: OrderedDict[bytes, None] = OrderedDict()   # keys this worker put lately
        # Loads and saves in two units: *_values count gdkv values (keys: one slot's part of
        # blocks_per_value blocks), *_blocks the blocks of the request's block table they hold.
        self.stats = Stats(loaded_values=0, failed_values=0, saved_values=0,
                           loaded_blocks=0, failed_blocks=0, saved_blocks=0,
                           skipped_present=0, dropped_saves=0, zero_copy_loads=0,
                           dropped_values=0, loaded_bytes=0, load_s=0.0, sync_wait_s=0.0,
                           gather_s=0.0, save_s=0.0, save_wait_s=0.0, layer_wait_s=0.0,
                           saves_queued=0)
        self._pinned = 0   # the address of the load staging pinned for CUDA copies
        self._staged_for: Optional[tuple[Any, bool]] = None   # (client, _needs_staging)
        self.stored: dict[bytes, int] = {}   # values put since the last report (KV events)
        # load_mode "layerwise": this step's loads, a future per chunk of layers (and by layer
        # index), the layers the forward pass waited for, the layers it computed and the
        # chunks whose saves have started.
        self.layer_index: dict[str, int] = {}
        self.step_loads: Optional[tuple[list[Transfer], list, dict[int, Any]]] = None
        self.waited: set[int] = set()
        self.layerwise_ok = True   # vLLM waits for every layer (see _join_layers)
        self.computed: set[int] = set()
        self.save_chunks: set[int] = set()
        self.save_pending: list = []

    # ---- set-up ----
    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        p = self.plan
        if not p.usable:
            return
        pages = []
        for name in p.layer_names:
            ref = group_kernel_blocks(kv_caches[name], num_blocks)
            block = ref[0]
            # The block's bytes must be one dense run (its axes may be permuted: LBNHC and
            # LBHNC are; LHBNC, heads outside blocks, is not), and so must a value's heads.
            unit = block.narrow(-3, 0, p.heads_per_value) \
                if p.heads_per_value < p.rank_heads and block.dim() >= 3 else block
            if not (dense(block) and dense(unit)) or \
                    block.numel() * block.element_size() > p.page_bytes:
                log.warning("gdkv: layer %s keeps a block's KV, or a head's, in more than one "
                            "piece (layout %s; heads_per_value %d of %d); running without gdkv",
                            name, tuple(ref.stride()), p.heads_per_value, p.rank_heads)
                p.usable = False
                self.gdkv_off = True   # the scheduler learns it from worker_meta()
                return
            stride = ref.stride(0) * ref.element_size()
            view = torch.empty(0, dtype=torch.uint8, device=ref.device)
            view.set_(ref.untyped_storage(), ref.storage_offset() * ref.element_size(),
                      (num_blocks, p.page_bytes), (stride, 1))
            pages.append(view)
        self.pages = pages
        self.np_pages = [pg.numpy() for pg in pages] if pages[0].device.type == "cpu" else []
        index = {n: i for i, n in enumerate(p.layer_names)}
        self.layer_index = index
        for sl in self.slots:
            sl.layers = [index[n] for n in sl.names]
            sl.value_bytes = p.blocks_per_value * len(sl.layers) * self.unit_bytes
        self.value_bytes = max(sl.value_bytes for sl in self.slots)
        self.device = pages[0].device
        if self.device.type == "cpu" and self.store is not None:
            # Through gdkvd, loads then land in the pages where they lie (no staging copy).
            for storage in {kv_caches[n].untyped_storage().data_ptr():
                            kv_caches[n].untyped_storage() for n in p.layer_names}.values():
                flat = torch.empty(0, dtype=torch.uint8)
                flat.set_(storage, 0, (storage.nbytes(),), (1,))
                self.store.share(flat)

    def worker_meta(self) -> Optional[GdkvWorkerMeta]:
        # Every step while gdkv is off (it is tiny), so no step's output can lose it.
        with self.lock:
            stored, self.stored = self.stored, {}
        return GdkvWorkerMeta(self.gdkv_off, stored) if self.gdkv_off or stored else None

    def _ids(self, t: Transfer, v: int, sl: Slot) -> list[int]:
        """Value v's block ids in slot sl's group."""
        g = self.plan.blocks_per_value
        return t.block_ids[v][sl.group * g:(sl.group + 1) * g]

    def _items(self, t: Transfer, slots: list[Slot], save: bool = False) -> list:
        """(value index, slot) of t's gdkv values in ``slots`` to transfer: for a load, those
        with a block to load, value by value; for a save, slot by slot, those whose blocks are
        all there (a value is saved whole or not at all)."""
        if save:
            pairs = [(v, sl) for sl in slots for v in range(len(t.hashes))]
            return [(v, sl) for v, sl in pairs if all(b >= 0 for b in self._ids(t, v, sl))]
        pairs = [(v, sl) for v in range(len(t.hashes)) for sl in slots]
        return [(v, sl) for v, sl in pairs if any(b >= 0 for b in self._ids(t, v, sl))]

    # ---- loads ----
    def start_loads(self, loads: list[Transfer]) -> None:
        """Starts the step's loads; with load_mode "sync" also waits for them (the forward
        pass that follows reads their pages)."""
        t0 = time.perf_counter()
        self._join_layers()   # a step that ended without results() (never, in vLLM 0.32)
        if self.plan.layerwise and self.layerwise_ok and self.pages and loads:
            return self._start_layers(loads)
        pending = []
        for t in loads:
            if not self.pages:   # gdkv is off here: every value failed, reported this step
                self._finish_load(t, list(range(len(t.hashes))))
            else:
                pending.append(self.load_pool.submit(self._load, t))
        if not self.plan.load_async and pending:
            for f in pending:
                f.result()
            self.stats.add(sync_wait_s=time.perf_counter() - t0)

    def _finish_load(self, t: Transfer, failed: list[int]) -> None:
        """Reports t's load: ``failed`` are the indices of its values (hashes) that did not
        arrive whole; vLLM recomputes their blocks, so every gdkv value of them counts failed."""
        per_hash = [0] * len(t.hashes)
        for v, _ in self._items(t, self.slots):
            per_hash[v] += 1
        bad = set(failed)
        bpv = self.plan.blocks_per_value
        with self.lock:
            for v in failed:
                self.load_errors.update(b for b in t.block_ids[v] if b >= 0)
            self.stats.add(failed_values=sum(per_hash[v] for v in bad),
                           loaded_values=sum(n for v, n in enumerate(per_hash) if v not in bad),
                           failed_blocks=len(bad) * bpv,
                           loaded_blocks=(len(t.hashes) - len(bad)) * bpv)
            if self.plan.load_async:   # vLLM waits for these; a sync load is part of its step
                self.finished_loads.add(t.req_id)

    def _start_layers(self, loads: list[Transfer]) -> None:
        """load_mode "layerwise": the step's loads, one chunk of layers after the other (every
        request's values of the first layers first) on the load thread; wait_for_layer_load
        waits for the chunk holding its layer, and results() for all of them."""
        futures: list = []
        by_layer: dict[int, Any] = {}
        for slots in self.chunk_slots:
            if not slots:
                continue
            f = self.load_pool.submit(lambda s=slots: [self._load(t, s, finish=False)
                                                       for t in loads])
            futures.append(f)
            by_layer.update((l, f) for sl in slots for l in sl.layers)
        self.step_loads = (loads, futures, by_layer)
        self.waited = set()

    def wait_for_layer(self, name: str) -> None:
        """The forward pass is about to run layer ``name``'s attention: its chunk's loads must
        have landed."""
        if self.step_loads is None:
            return
        i = self.layer_index.get(name)
        f = self.step_loads[2].get(i)
        if f is None:
            return
        self.waited.add(i)
        if not f.done():
            t0 = time.perf_counter()
            f.result()
            self.stats.add(layer_wait_s=time.perf_counter() - t0)

    def _join_layers(self) -> None:
        """The end of a layerwise step: waits for its loads and reports their failures (vLLM
        then drops the step's output for those requests and recomputes them from the first
        failed block, as for a failed sync load: KV half loaded is never used). A layer the
        forward pass did not wait for may have been read before its KV landed: then every
        value of the step is reported failed, and later steps load as "sync" does."""
        if self.step_loads is None:
            return
        loads, futures, by_layer = self.step_loads
        self.step_loads = None
        failed: list[set[int]] = [set() for _ in loads]
        for f in futures:
            for i, values in enumerate(f.result()):
                failed[i].update(values)
        skipped = set(by_layer) - self.waited
        if skipped:
            log.warning("gdkv: vLLM ran %d layer(s) without waiting for their KV "
                        "(wait_for_layer_load); this step's loads are recomputed and later "
                        "ones load whole before the forward pass (as load_mode \"sync\")",
                        len(skipped))
            self.layerwise_ok = False
            failed = [set(range(len(t.hashes))) for t in loads]
        for t, f in zip(loads, failed):
            self._finish_load(t, sorted(f))
        self.write_stats()

    def _load(self, t: Transfer, slots: Optional[list[Slot]] = None,
              finish: bool = True) -> list[int]:
        """Loads t's values of ``slots`` (default all); returns the values that failed, and
        with ``finish`` reports them (a layerwise step reports once every chunk is in)."""
        t0 = time.perf_counter()
        items = self._items(t, self.slots if slots is None else slots)
        keys = [sl.space.key(t.hashes[v]) for v, sl in items]
        every = list(range(len(keys)))
        try:
            # gdkv unavailable or failing (EngineStore.call's rule): every value failed.
            failed, bad = self.store.call(lambda c: self._load_values(c, t, items, keys),
                                          (every, []), f"load of {t.req_id}")
        except Exception:   # never leave vLLM waiting: the request is reported, its blocks fail
            log.exception("gdkv: load of %s failed", t.req_id)
            failed, bad = every, []
        failed_values = sorted({items[i][0] for i in failed})
        # The engine-side load time: from the load thread's start to the pages.
        self.stats.add(load_s=time.perf_counter() - t0,
                       loaded_bytes=sum(sl.value_bytes for _, sl in items) - sum(
                           items[i][1].value_bytes for i in failed))
        # A value that did not load is no longer one this worker saved (it may have been
        # evicted); one gdkv holds but cannot deliver (of the wrong size, failing) is deleted,
        # so the next save of that prefix puts it again instead of skipping it for ever.
        with self.lock:
            for i in failed:
                self.saved.pop(keys[i], None)
        if bad:
            self.store.call(lambda c: self._drop(c, [keys[i] for i in bad]), None,
                            f"delete of {len(bad)} bad value(s)")
        if finish:
            self._finish_load(t, failed_values)
            self.write_stats()
        return failed_values

    def _drop(self, client, keys: list[bytes]) -> None:
        self.stats.add(dropped_values=len(keys) - self.store.delete(client, keys))

    def _load_values(self, client, t: Transfer, items: list,
                     keys: list[bytes]) -> tuple[list[int], list[int]]:
        """Loads the gdkv values ``items`` of t (``keys`` theirs); returns the indices of those
        that did not arrive whole, and of those among them gdkv holds but could not deliver
        (of the wrong size, or failing)."""
        ub = self.unit_bytes
        sizes = [sl.value_bytes for _, sl in items]
        if self.device.type == "cuda":   # staged, then scattered by the GPU
            self._stage(client)
            whole, held = self.store.load_staged(
                client, keys, None, sizes, lambda stage, rows, idx: self._scatter(
                    torch.from_numpy(stage), rows, [(self._ids(t, *items[i]), items[i][1])
                                                    for i in idx]))
        else:
            # numpy views of the CPU pages: a quarter of the cost of torch views, per page.
            scratch = np.empty(ub, dtype=np.uint8)
            outs = [[self.np_pages[l][b, sl.offset:sl.offset + ub] if b >= 0 else scratch
                     for b in self._ids(t, v, sl) for l in sl.layers] for v, sl in items]
            if self._needs_staging(client):   # pages gdkvd could not map
                whole, held = self.store.load_staged(client, keys, outs, sizes)
            else:
                whole, held = self.store.load(client, keys, outs, sizes)
                self.stats.add(zero_copy_loads=1)
        return [i for i, w in enumerate(whole) if not w], held

    def _needs_staging(self, client) -> bool:
        """Whether loads go through a staging buffer: the pages are CUDA memory (scattered by
        index_copy_), or memory the controller does not reach. Asked once per client: the pages
        are shared at registration, and with each client before it is used."""
        if self._staged_for is None or self._staged_for[0] is not client:
            self._staged_for = (client, self.device.type != "cpu" or not self.store.reaches(
                client, [p for pg in self.np_pages for p in (pg[0], pg[-1])]))
        return self._staged_for[1]

    def _stage(self, client) -> Any:
        """The load staging of this client (EngineStore.staging: rows of the largest value, kept
        for the client), reserved at its first transfer, before any save takes memory shared
        with gdkvd. For CUDA pages the worker pins it (cudaHostRegister, once per reservation),
        so _scatter's host-to-device copy is DMA."""
        stage = self.store.staging(client, self.value_bytes)
        with self.pin_lock:
            if self.device.type == "cuda" and stage.ctypes.data != self._pinned:
                torch.cuda.cudart().cudaHostRegister(stage.ctypes.data, stage.nbytes, 0)
                self._pinned = stage.ctypes.data
        return stage

    def _save_budget(self, client) -> int:
        """Bytes of saves that may wait for gdkv: save_queue_bytes, and through gdkvd no more
        than the shared memory leaves past the load staging and a margin (1/16: the queues,
        the allocator's rounding)."""
        if not client.remote:
            return self.save_queue_bytes
        staged = self._stage(client).nbytes if self._needs_staging(client) else 0
        shm = self.store.shared_memory_bytes
        return max(0, min(self.save_queue_bytes, shm - staged - shm // 16))

    def _scatter(self, stage: torch.Tensor, rows: list[int],
                 targets: list[tuple[list[int], Slot]]) -> None:
        """Copies staged values (rows of ``stage``) into their blocks' CUDA pages: each row's
        target is (its block ids, its slot). The round's rows go to the GPU in one copy of
        pinned memory, and are placed there by index."""
        if not rows:
            return
        ub = self.unit_bytes
        stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            on_gpu = stage[:max(rows) + 1].to(self.device, non_blocking=True)
            for sl in {id(sl): sl for _, sl in targets}.values():
                mine = [(r, ids) for r, (ids, s) in zip(rows, targets) if s is sl]
                pairs = [(n * len(ids) + j, b) for n, (_, ids) in enumerate(mine)
                         for j, b in enumerate(ids) if b >= 0]
                if not pairs:
                    continue
                pick_rows = torch.tensor([r for r, _ in mine], device=self.device)
                src = on_gpu[pick_rows][:, :sl.value_bytes].reshape(-1, len(sl.layers), ub)
                pick = torch.tensor([i for i, _ in pairs], device=self.device)
                dst = torch.tensor([b for _, b in pairs], device=self.device)
                for i, l in enumerate(sl.layers):
                    self.pages[l][:, sl.offset:sl.offset + ub].index_copy_(0, dst, src[pick, i])
        stream.synchronize()

    def _gather(self, t: Transfer, items: list, bufs: list[torch.Tensor]):
        """Copies the pages of t's gdkv values ``items`` into ``bufs`` (one each, [block][layer]
        [unit bytes]); on CUDA returns an event that completes when the copies have landed."""
        ub = self.unit_bytes
        for (v, sl), buf in zip(items, bufs):
            ids = self._ids(t, v, sl)
            if self.device.type == "cpu":
                r = buf.numpy().reshape(len(ids), len(sl.layers), ub)
                for j, b in enumerate(ids):
                    for i, l in enumerate(sl.layers):
                        r[j, i] = self.np_pages[l][b, sl.offset:sl.offset + ub]
                continue
            index = torch.tensor(ids, device=self.device)
            buf.view(len(ids), len(sl.layers), ub).copy_(torch.stack(
                [self.pages[l][index, sl.offset:sl.offset + ub] for l in sl.layers], dim=1),
                non_blocking=True)
        if self.device.type == "cpu":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    # ---- saves ----
    def start_saves(self, saves: list[Transfer]) -> None:
        """Gathers each save's pages into a buffer now (vLLM may reuse the blocks after this
        step) and puts them on the save thread. The load staging is reserved first; saves past
        the budget (_save_budget) are dropped, a save's leading values first kept. A
        kv_producer (a prefill engine) waits for its puts: its step, and so the request's first
        token, ends once the KV is in gdkv, where the decode engine asked next will look."""
        # layerwise: the chunks whose saves started in save_kv_layer are done; the rest now.
        pending, self.save_pending = self.save_pending, []
        started, self.save_chunks, self.computed = self.save_chunks, set(), set()
        t0 = time.perf_counter()
        try:
            self._start_saves(saves, pending, [sl for sl in self.slots
                                               if sl.chunk not in started])
        finally:
            if pending and not self.plan.loads:
                for f in pending:
                    f.result()
                self.stats.add(save_wait_s=time.perf_counter() - t0)

    def save_layer(self, name: str, saves: list[Transfer]) -> None:
        """load_mode "layerwise": layer ``name`` has been computed in this step. Once every
        layer of a chunk has, the saves of that chunk's values start (gathered now, put on the
        save thread while the forward pass goes on)."""
        if not (self.plan.layerwise and saves and self.pages) or name not in self.layer_index:
            return
        self.computed.add(self.layer_index[name])
        for c, slots in enumerate(self.chunk_slots):
            if c not in self.save_chunks and slots and \
                    all(l in self.computed for sl in slots for l in sl.layers):
                self.save_chunks.add(c)
                self._start_saves(saves, self.save_pending, slots)

    def _start_saves(self, saves: list[Transfer], pending: list, slots: list[Slot]) -> None:
        """Gathers and queues the saves of ``slots``' values."""
        if not slots:
            return
        client = self.store.client() if self.store else None
        owned = [sl for sl in slots if sl.owns]
        if self.plan.events and self.pages and not owned:
            chunks = len({sl.chunk for sl in slots})
            with self.lock:   # a rank that saves nothing (the first rank holding its heads does)
                for t in saves:
                    for h in t.hashes:
                        self.stored[h] = self.stored.get(h, 0) + chunks
        if client is None or not self.pages or not saves or not owned:
            return
        try:
            budget = self._save_budget(client)
        except errors.Error as e:   # no room even for the load staging: drop this step's saves
            self.store.note(e, "staging reservation")
            self.stats.add(dropped_saves=sum(len(t.hashes) for t in saves))
            return
        per_value = sum(sl.value_bytes for sl in owned)
        queued = False
        for t in saves:
            with self.lock:
                room = max(0, budget - self.queued_save_bytes) // per_value
                keep = min(len(t.hashes), room)
                # The leading values: a later one is of no use without those before it.
                self.stats.add(dropped_saves=len(t.hashes) - keep)
            if keep == 0:
                continue
            t = Transfer(t.req_id, t.hashes[:keep], t.block_ids[:keep], t.low_priority)
            items = self._items(t, owned, save=True)
            size = sum(sl.value_bytes for _, sl in items)
            if not size:
                continue
            with self.lock:
                self.queued_save_bytes += size
            try:
                flat = client.empty((size,), torch.uint8)
            except errors.Error as e:   # shared memory used up: a dropped save is a later miss
                self.store.note(e, "save staging")
                with self.lock:
                    self.queued_save_bytes -= size
                    self.stats.add(dropped_saves=keep)
                continue
            bufs = list(flat.split([sl.value_bytes for _, sl in items]))
            t0 = time.perf_counter()
            event = self._gather(t, items, bufs)
            # On the engine's step: the forward pass waits for it.
            self.stats.add(gather_s=time.perf_counter() - t0, saves_queued=1)
            pending.append(self.save_pool.submit(self._save, t, items, bufs, event, size))
            queued = True
        if queued:   # before the step's results: a request's response follows its saves' queuing
            self.write_stats()

    def _save(self, t: Transfer, items: list, bufs: list[torch.Tensor], event,
              size: int) -> None:
        t0 = time.perf_counter()
        try:
            if event is not None:
                event.synchronize()
            # A dropped save (gdkv unavailable, the store full...) is a later miss.
            keys = [sl.space.key(t.hashes[v]) for v, sl in items]
            stored = self.store.call(lambda c: self._put(c, keys, bufs, t.low_priority), set(),
                                     f"save of {t.req_id}")
            # A block counts once: by its values of the first layers (a layerwise save puts
            # each chunk of layers apart).
            self.stats.add(saved_blocks=len({v for (v, sl), k in zip(items, keys)
                                             if sl.chunk == 0 and k in stored})
                           * self.plan.blocks_per_value)
            if self.plan.events:
                with self.lock:   # the values whose every part is in gdkv now, per chunk
                    missing = {v for (v, _), k in zip(items, keys) if k not in self.saved}
                    chunks: dict[int, set[int]] = {}
                    for v, sl in items:
                        chunks.setdefault(v, set()).add(sl.chunk)
                    for v, cs in chunks.items():
                        if v not in missing:
                            h = t.hashes[v]
                            self.stored[h] = self.stored.get(h, 0) + len(cs)
        finally:
            with self.lock:
                self.queued_save_bytes -= size
            self.stats.add(save_s=time.perf_counter() - t0, saves_queued=-1)
            self.write_stats()

    def _put(self, client, keys: list[bytes], bufs: list[torch.Tensor],
             low_priority: bool = False) -> set[bytes]:
        """Puts the values ``bufs`` under ``keys`` that neither this worker nor gdkv has yet
        (EngineStore.present, .put): a value whose Exist failed is put again (a Store replaces
        it), and one whose Store failed is saved by a later request. Returns the keys it put."""
        with self.lock:
            fresh = [i for i, k in enumerate(keys) if k not in self.saved]
        have = self.store.present(client, [keys[i] for i in fresh])
        todo = [i for i, there in zip(fresh, have) if not there]
        stored = self.store.put(client, [keys[i] for i in todo], lambda j: bufs[todo[j]],
                                low_priority=low_priority)
        with self.lock:
            done = set(keys) - {keys[i] for i, ok in zip(todo, stored) if not ok}
            for k in keys:
                if k in done:
                    self.saved[k] = None
                    self.saved.move_to_end(k)
            while len(self.saved) > 65536:
                self.saved.popitem(last=False)
        self.stats.add(saved_values=sum(stored), skipped_present=len(keys) - len(todo))
        return {keys[i] for i, ok in zip(todo, stored) if ok}

    # ---- results ----
    def results(self) -> KVConnectorTransferResults:
        self._join_layers()
        with self.lock:
            done, self.finished_loads = self.finished_loads, set()
            # Errors of these loads are reported in this same step, as vLLM requires.
            self.reported_errors |= self.load_errors
            self.load_errors = set()
        return KVConnectorTransferResults(finished_recving=done)

    def take_errors(self) -> set[int]:
        with self.lock:
            out, self.reported_errors = self.reported_errors, set()
        return out

    def drain(self) -> None:
        """Waits for every queued load and save (tests; shutdown)."""
        self._join_layers()
        self.load_pool.submit(lambda: None).result()
        self.save_pool.submit(lambda: None).result()

    def shutdown(self) -> None:
        self.load_pool.shutdown(wait=True)
        self.save_pool.shutdown(wait=True)
        self.write_stats()

    def write_stats(self) -> None:
        """$GDKV_VLLM_STATS: where a worker leaves its counters (the engine's processes are
        vLLM's; benchmarks and tests read them there, with the rank in the name). Written after
        each load and save, since vLLM's multi-process executor may end a worker without
        shutting its connector down, and at shutdown."""
        path = os.environ.get("GDKV_VLLM_STATS")
        if path:
            self.stats.write(f"{path}.rank{self.rank}.json", rank=self.rank,
                             value_bytes=self.value_bytes)
