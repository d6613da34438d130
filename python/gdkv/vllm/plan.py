"""The vLLM connector's plan: its KV cache groups and layout, the values and keys a request's
blocks map to, and what travels from the scheduler to the workers (docs/integrations.md)."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorMetadata,
                                                               KVConnectorWorkerMetadata)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

from ..config import VLLM_KEYS, read_config
from ..fingerprint import weights_fingerprint
from ..keys import KeySpace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


log = logging.getLogger("gdkv.vllm")


# The `ownership` of the connector's KV events: vLLM's field naming the offloading tier that
# generated them (its own tiers name theirs, e.g. "kvcr"). Their medium and locality are the
# connector keys kv_events_medium and kv_events_locality (gdkv.config.VLLM_KEYS).
OWNERSHIP = "gdkv"
# How often gdkvd's removals are read.
REMOVALS_POLL_S = 0.5
REMOVALS_PENDING_KEYS = 1 << 16   # removed keys waiting for take_events, at most
# How long a planned save's event waits for the workers' reports before it is given up.
EVENT_WAIT_S = 10.0
# A request's caching choices, in its kv_transfer_params: "gdkv_save": false saves none of its
# values; "gdkv_priority": "low" saves them to be evicted first (Client.put's low_priority).
PRIORITIES = ("normal", "low")


def caching_choices(request: "Request") -> tuple[bool, bool]:
    """(save, low_priority) from the request's kv_transfer_params. A value of the wrong type or
    an unknown priority is logged and the default (save, normal) kept: a request is never failed
    for it."""
    params = getattr(request, "kv_transfer_params", None) or {}
    save, priority = params.get("gdkv_save", True), params.get("gdkv_priority", "normal")
    if not isinstance(save, bool):
        log.warning("gdkv: request %s: gdkv_save must be true or false, not %r: saved",
                    request.request_id, save)
        save = True
    if priority not in PRIORITIES:
        log.warning("gdkv: request %s: gdkv_priority must be one of %s, not %r: normal",
                    request.request_id, ", ".join(PRIORITIES), priority)
        priority = "normal"
    return save, priority == "low"


@dataclass
class Transfer:
    """Values of one request to load or save: the vLLM block hash naming each value, and each
    value's block ids (``blocks_per_value`` of them in each KV cache group, group by group; -1
    marks a block not transferred: vLLM's own prefix cache already holds it, or it lies outside a
    sliding window)."""

    req_id: str
    hashes: list[bytes] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)
    low_priority: bool = False   # a save the request asked to be evicted first


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


def dense(t: torch.Tensor) -> bool:
    """Whether a tensor's elements are one run of memory (in any order of its axes)."""
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) == t.numel()


@dataclass
class Group:
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


class Plan:
    """What both sides derive from the vLLM config: value geometry and the key salt."""

    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig"):
        extra = read_config(vllm_config.kv_transfer_config.kv_connector_extra_config or {},
                            VLLM_KEYS, "the gdkv connector's kv_connector_extra_config")
        self.extra = extra
        groups = kv_cache_config.kv_cache_groups
        spec = groups[0].kv_cache_spec if groups else None
        self.block_size = vllm_config.cache_config.block_size
        self.hash_block_size = kv_cache_config.hash_block_size or self.block_size
        self.blocks_per_value = extra["blocks_per_value"]
        # vLLM's KV cache groups: one of full attention, or with its hybrid allocator one per
        # attention type (full, sliding window), each with its own block table. A value holds
        # one group's layers; a sliding-window group's values are loaded only within the window.
        # (A full-attention spec with a sliding window, as vLLM makes one without its hybrid
        # allocator, keeps every block: it is a full group here.)
        self.groups = [Group(i, list(g.layer_names), type(g.kv_cache_spec).__name__,
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
        # and BlockRemoved once every worker has put its part, in vLLM's vocabulary for an
        # offloading tier: medium STORAGE (or CPU), locality LOCAL, ownership "gdkv".
        ev = getattr(vllm_config, "kv_events_config", None)
        self.events = bool(ev is not None and ev.enable_kv_cache_events)
        self.event_tier = dict(medium=extra["kv_events_medium"],
                               locality=extra["kv_events_locality"], ownership=OWNERSHIP)
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
        # One of async, sync, layerwise (gdkv.config.VLLM_KEYS). layerwise: as sync (a request
        # runs in the step that loads it), but the step's forward pass waits layer by layer
        # (wait_for_layer_load), and saves start layer by layer (save_kv_layer). Values of fewer
        # layers (layers_per_value) let the first layers compute while the later ones load.
        self.load_mode = extra["load_mode"]
        self.layers_per_value = extra["layers_per_value"]   # 0: every layer
        # Values per block, unit of heads and group: chunks of layers_per_value layers; the
        # largest group's count (a group with fewer layers has fewer).
        self.chunks = max((len(g.chunks(self.layers_per_value)) for g in self.groups),
                          default=1)
        self.tokens_per_value = self.blocks_per_value * self.block_size
        if self.tokens_per_value % self.hash_block_size:
            self.usable = False
        self.page_bytes = spec.page_size_bytes if spec is not None else 0
        self.layout_name = str(kv_cache_config.kv_cache_layout or "")
        self.tp = pc.tensor_parallel_size
        self.pp = pc.pipeline_parallel_size
        mc = vllm_config.model_config
        self._heads(extra, spec, mc)
        model_id = extra["model_id"]
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
        self.namespace = extra["namespace"]

    @property
    def load_async(self) -> bool:
        """Loads that span steps (load_mode async): vLLM waits for them, other requests run."""
        return self.load_mode == "async"

    @property
    def layerwise(self) -> bool:
        return self.load_mode == "layerwise"

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
        k = extra["heads_per_value"]
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

    def keyspace(self, pp_rank: int, unit: int, group: "Group", chunk: int = 0) -> KeySpace:
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

    def all_keyspaces(self, group: "Group") -> list[KeySpace]:
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
