"""A vLLM instance on CPU for the connector's tests and benchmark: vLLM's own Scheduler (the
connector configured through KVTransferConfig with its module path), real Request objects with
vLLM's block hasher, and one worker's KV cache from vLLM's allocate_kv_cache.

``Instance.step`` plays the model runner's part of an engine step (bind the metadata, start the
loads, the forward pass, wait_for_save, collect the transfer results and the worker metadata,
report them to the scheduler). The forward pass writes each computed block's KV as bytes that
are a function of the block's prefix hash and the layer (:func:`kv_bytes`), so a block loaded
from gdkv can be checked exactly against what a forward pass would have written.

:func:`started_meanwhile`: a real engine (gdkv_demo.vllm_demo.Server) started on a thread of its
own, for the engine tests that use two.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                         SchedulerConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (get_kv_cache_configs, get_request_block_hasher,
                                         init_none_hash)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from gdkv.vllm import GdkvConnector

BS = 16   # vLLM's block size (tokens)
init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


def llama_dir(path: Path, *, layers: int, kv_heads: int, head_dim: int) -> str:
    """A Llama config on disk (no weights): what vLLM's ModelConfig reads."""
    from transformers import LlamaConfig
    LlamaConfig(hidden_size=kv_heads * 2 * head_dim, intermediate_size=128,
                num_hidden_layers=layers, num_attention_heads=kv_heads * 2,
                num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=1000,
                max_position_embeddings=4096).save_pretrained(path)
    return str(path)


def kv_bytes(block_hash: bytes, layer: int, n: int) -> torch.Tensor:
    """The 'forward pass': a block's KV in one layer, a function of its prefix hash."""
    g = torch.Generator().manual_seed(int.from_bytes(block_hash[:7], "little") * 131 + layer)
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)


class Instance:
    """One vLLM instance: its scheduler, one worker's connector and KV cache (CPU)."""

    def __init__(self, model_dir: str, extra: dict, layout: str = "LBNHC",
                 dtype: torch.dtype = torch.float32, kv_bytes_total: int = 8 << 20,
                 max_len: int = 1024, kv_dtype: torch.dtype | None = None,
                 kv_role: str = "kv_both", window: int = 0, prefix_caching: bool = True):
        # kv_dtype: the KV cache's dtype, if not the model's (as an fp8 cache would be).
        # window: every odd layer attends to a sliding window of that many tokens (vLLM's
        # hybrid KV cache manager then keeps a group of full and one of sliding layers).
        mc = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True,
                         dtype=str(dtype).removeprefix("torch."), max_model_len=max_len, seed=0)
        sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_len,
                             max_model_len=max_len, is_encoder_decoder=False)
        cc = CacheConfig(block_size=BS, cache_dtype="auto", enable_prefix_caching=prefix_caching)
        cc.kv_cache_layout = layout
        kt = KVTransferConfig(kv_connector="GdkvConnector", kv_connector_module_path="gdkv.vllm",
                              kv_role=kv_role, kv_connector_extra_config=extra,
                              kv_load_failure_policy="recompute")
        vc = VllmConfig(scheduler_config=sc, model_config=mc, cache_config=cc,
                        kv_transfer_config=kt, device_config=DeviceConfig("cpu"))
        self.layers = mc.hf_config.num_hidden_layers
        geometry = dict(block_size=BS, num_kv_heads=mc.hf_config.num_key_value_heads,
                        head_size=mc.get_head_size(), dtype=kv_dtype or dtype)
        specs = {f"model.layers.{i}.self_attn.attn":
                 SlidingWindowSpec(**geometry, sliding_window=window) if window and i % 2 else
                 FullAttentionSpec(**geometry) for i in range(self.layers)}
        self.kcc = get_kv_cache_configs(vc, [specs], [kv_bytes_total])[0]
        self.kcc.kv_cache_layout = layout
        vc.cache_config.num_gpu_blocks = self.kcc.num_blocks
        self.scheduler = Scheduler(vc, self.kcc, StructuredOutputManager(vc), block_size=BS)
        self.connector = GdkvConnector(vc, KVConnectorRole.WORKER, self.kcc)
        self.kv = allocate_kv_cache(self.kcc, torch.device("cpu"), KVCacheLayout[layout])
        self.connector.register_kv_caches(self.kv)
        self.worker = self.connector.worker
        # Per layer (num_blocks, page bytes), over self.kv, in the connector's order of layers
        # (group by group); layer_of[i] and group_of[i] name page i's model layer and group.
        self.pages = self.worker.pages
        self.page = self.pages[0].shape[1] if self.pages else 0
        names = self.connector.plan.layer_names
        self.layer_of = [int(n.split(".")[2]) for n in names]
        self.group_of = [next(g.index for g in self.connector.plan.groups if n in g.layer_names)
                         for n in names]
        self.requests: dict[str, Request] = {}
        # The forward pass (step): on_layer(i) runs after page i's wait_for_layer_load, before
        # its attention; a layer in skip_wait plays one vLLM runs without waiting for its KV.
        self.on_layer = None
        self.skip_wait: set[int] = set()

    def add(self, rid: str, tokens: list[int], kv_transfer_params: dict | None = None) -> Request:
        """A request; ``kv_transfer_params`` as a client sends them in its request body."""
        sp = SamplingParams(max_tokens=3, extra_args={"kv_transfer_params": kv_transfer_params}
                            if kv_transfer_params is not None else None)
        r = Request(rid, tokens, sp, None, block_hasher=HASHER)
        self.requests[rid] = r
        self.scheduler.add_request(r)
        return r

    def block_ids(self, rid: str, group: int = 0) -> list[int]:
        return self.scheduler.kv_cache_manager.get_blocks(rid).get_block_ids()[group]

    def expected(self, rid: str, position: int, layer: int) -> torch.Tensor:
        return kv_bytes(self.requests[rid].block_hashes[position], layer, self.page)

    def step(self, check_load=None):
        """One engine step, as vLLM's model runner does it; returns the scheduler output and
        the block ids the connector reported as failed loads. ``check_load(out)`` runs after the
        scheduler planned the step and before the worker starts its loads."""
        out = self.scheduler.schedule()
        c = self.connector
        c.bind_connector_metadata(out.kv_connector_metadata)
        if check_load is not None:
            check_load(out)
        c.start_load_kv(None)
        # The forward pass: every full block this step computes gets its KV, layer by layer in
        # the model's order, each layer's attention after wait_for_layer_load and followed by
        # save_kv_layer (vLLM's maybe_transfer_kv_layer), unless the layer is in skip_wait.
        reqs = [(new.req_id, new.num_computed_tokens) for new in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        reqs += [(rid, cached.num_computed_tokens[i]) for i, rid in enumerate(cached.req_ids)]
        names = c.plan.layer_names
        for i in sorted(range(len(names)), key=lambda i: self.layer_of[i]):
            if i not in self.skip_wait:
                c.wait_for_layer_load(names[i])
            if self.on_layer is not None:
                self.on_layer(i)
            for rid, computed in reqs:
                self._compute(rid, computed, out, i)
            c.save_kv_layer(names[i], None, None)
        c.wait_for_save()
        self.worker.drain()   # deterministic tests: the background transfers finish here
        res = c.get_transfer_results(out.finished_req_ids)
        failed = c.get_block_ids_with_load_errors()
        c.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        out_kv = KVConnectorOutput(finished_recving=res.finished_recving,
                                   failed_recving=res.failed_recving, invalid_block_ids=failed,
                                   kv_connector_worker_meta=c.build_connector_worker_meta())
        mro = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids], kv_connector_output=out_kv)
        self.scheduler.update_from_output(out, mro)
        return out, failed

    def _compute(self, rid: str, computed: int, out, i: int) -> None:
        """Page i's KV of the full blocks this step computes for ``rid``."""
        if not self.pages:   # a layout the connector does not use: no bytes to check
            return
        r = self.requests[rid]
        end = min(computed + out.num_scheduled_tokens[rid], len(r.block_hashes) * BS) // BS
        ids = self.block_ids(rid, self.group_of[i])
        for p in range(computed // BS, end):
            if ids[p] != 0:   # vLLM's null block: outside a sliding window
                self.pages[i][ids[p]] = self.expected(rid, p, self.layer_of[i])

    def run(self, limit: int = 12) -> list:
        outs = []
        for _ in range(limit):
            if not self.scheduler.has_requests():
                break
            outs.append(self.step())
        return outs

    def close(self):
        self.connector.shutdown()


@contextlib.contextmanager
def started_meanwhile(start):
    """Runs ``start()`` (an engine's start: about 30 s of imports and set-up here) on a thread of
    its own while the block goes on; yields a function that waits for it and returns the
    engine, which is stopped when the block ends (once started, also when the block fails)."""
    pool = ThreadPoolExecutor(1)
    future = pool.submit(start)
    try:
        yield future.result
    finally:
        pool.shutdown()
        if future.exception() is None:
            future.result().stop()
