"""gdkv.vllm.GdkvConnector driven by vLLM's own scheduler, on CPU.

vLLM's real Scheduler (configured through KVTransferConfig with the connector's module path),
real Request objects with vLLM's block hasher, and the worker side's KV cache allocated by vLLM's
own allocate_kv_cache on CPU. The model runner's part of a step (bind the metadata, start loads,
run the forward pass, wait_for_save, collect the transfer results) is played by ``Instance.step``,
and the forward pass by writing each computed block's KV: bytes that are a function of the
block's prefix hash and the layer, so a block loaded from gdkv can be checked exactly.
"""

from __future__ import annotations

import signal

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,  # noqa: E402
                         SchedulerConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_planning import (get_global_kv_cache_groups,  # noqa: E402
                                            get_kv_cache_configs)
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

import gdkv  # noqa: E402
from conftest import Gdkvd  # noqa: E402
from gdkv.vllm import GdkvConnector  # noqa: E402

BS = 16          # vLLM block size (tokens)
LAYERS = 4
HEADS = 2
HEAD = 32
init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama config on disk: vLLM's ModelConfig reads it (no weights are loaded)."""
    from transformers import LlamaConfig
    d = tmp_path_factory.mktemp("llama")
    LlamaConfig(hidden_size=HEADS * HEAD * 2, intermediate_size=128, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS * 2, num_key_value_heads=HEADS, vocab_size=1000,
                max_position_embeddings=2048).save_pretrained(d)
    return str(d)


def kv_bytes(block_hash: bytes, layer: int, n: int) -> torch.Tensor:
    """The 'forward pass': a block's KV in one layer, a function of its prefix hash."""
    g = torch.Generator().manual_seed(int.from_bytes(block_hash[:7], "little") * 131 + layer)
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)


class Instance:
    """One vLLM instance: its scheduler, one worker's connector and KV cache (CPU)."""

    def __init__(self, model_dir: str, extra: dict, layout: str = "LBNHC"):
        mc = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True,
                         dtype="float32", max_model_len=1024, seed=0)
        sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=1024,
                             is_encoder_decoder=False)
        cc = CacheConfig(block_size=BS, cache_dtype="auto", enable_prefix_caching=True)
        cc.kv_cache_layout = layout
        kt = KVTransferConfig(kv_connector="GdkvConnector", kv_connector_module_path="gdkv.vllm",
                              kv_role="kv_both", kv_connector_extra_config=extra,
                              kv_load_failure_policy="recompute")
        vc = VllmConfig(scheduler_config=sc, model_config=mc, cache_config=cc,
                        kv_transfer_config=kt, device_config=DeviceConfig("cpu"))
        specs = {f"model.layers.{i}.self_attn.attn":
                 FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD,
                                   dtype=torch.float32) for i in range(LAYERS)}
        groups = get_global_kv_cache_groups(vc, [specs])
        self.kcc = get_kv_cache_configs(vc, [specs], [8 << 20], groups)[0]
        self.kcc.kv_cache_layout = layout
        vc.cache_config.num_gpu_blocks = self.kcc.num_blocks
        self.scheduler = Scheduler(vc, self.kcc, StructuredOutputManager(vc), block_size=BS)
        self.connector = GdkvConnector(vc, KVConnectorRole.WORKER, self.kcc)
        self.kv = allocate_kv_cache(self.kcc, torch.device("cpu"), KVCacheLayout[layout])
        self.connector.register_kv_caches(self.kv)
        self.worker = self.connector.worker
        self.pages = self.worker.pages   # per layer (num_blocks, page bytes), over self.kv
        self.page = self.pages[0].shape[1]
        self.requests: dict[str, Request] = {}

    def add(self, rid: str, tokens: list[int]) -> Request:
        r = Request(rid, tokens, SamplingParams(max_tokens=3), None, block_hasher=HASHER)
        self.requests[rid] = r
        self.scheduler.add_request(r)
        return r

    def block_ids(self, rid: str) -> list[int]:
        return self.scheduler.kv_cache_manager.get_blocks(rid).get_block_ids()[0]

    def expected(self, rid: str, position: int, layer: int) -> torch.Tensor:
        return kv_bytes(self.requests[rid].block_hashes[position], layer, self.page)

    def step(self, check_load=None):
        """One engine step, as vLLM's model runner does it; returns the scheduler output and
        the block ids the connector reported as failed loads."""
        out = self.scheduler.schedule()
        c = self.connector
        c.bind_connector_metadata(out.kv_connector_metadata)
        c.start_load_kv(None)
        if check_load is not None:
            check_load(out)
        # The forward pass: every full block this step computes gets its KV.
        for new in out.scheduled_new_reqs:
            self._compute(new.req_id, new.num_computed_tokens, out)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            self._compute(rid, cached.num_computed_tokens[i], out)
        c.wait_for_save()
        self.worker.drain()   # deterministic tests: the background transfers finish here
        res = c.get_transfer_results(out.finished_req_ids)
        failed = c.get_block_ids_with_load_errors()
        c.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        mro = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
            kv_connector_output=KVConnectorOutput(finished_recving=res.finished_recving,
                                                  invalid_block_ids=failed))
        self.scheduler.update_from_output(out, mro)
        return out, failed

    def _compute(self, rid: str, computed: int, out) -> None:
        r = self.requests[rid]
        ids = self.block_ids(rid)
        end = min(computed + out.num_scheduled_tokens[rid], len(r.block_hashes) * BS) // BS
        for p in range(computed // BS, end):
            for layer in range(LAYERS):
                self.pages[layer][ids[p]] = self.expected(rid, p, layer)

    def run(self, limit: int = 12) -> list:
        outs = []
        for _ in range(limit):
            if not self.scheduler.has_requests():
                break
            outs.append(self.step())
        return outs

    def close(self):
        self.connector.shutdown()


PROMPT_A = list(range(100, 300))                    # 200 tokens: 12 full blocks
PROMPT_B = PROMPT_A[:160] + list(range(500, 550))   # shares 10 blocks with A, 210 tokens


@pytest.fixture(params=["in-process", "gdkvd"])
def extra(request, tmp_path):
    """Connector configs: an in-process memory store (zero copy) or a gdkvd (staged)."""
    if request.param == "in-process":
        yield {"backend": "memory", "namespace": str(tmp_path)}   # a fresh key space per test
        return
    d = Gdkvd("--backend", "memory")
    yield {"socket_dir": d.dir, "gdkvd": d, "timeout_ms": 2000, "retry_interval_s": 0.2}
    d.stop()


def config(extra: dict, **more) -> dict:
    return {k: v for k, v in {**extra, **more}.items() if k != "gdkvd"}


@pytest.mark.parametrize("layout,blocks_per_value", [("LBNHC", 1), ("LBHNC", 4)])
def test_second_instance_loads_the_shared_prefix(model_dir, extra, layout, blocks_per_value):
    cfg = config(extra, blocks_per_value=blocks_per_value)
    one = Instance(model_dir, cfg, layout)
    one.add("a", PROMPT_A)
    one.run()
    tokens_per_value = BS * blocks_per_value
    saved_a = len(PROMPT_A) // tokens_per_value
    assert one.worker.stats["saved_values"] == saved_a

    # A second instance (another node, say): its own prefix cache is empty.
    two = Instance(model_dir, cfg, layout)
    b = two.add("b", PROMPT_B)
    external = len(PROMPT_A[:160]) // tokens_per_value * tokens_per_value
    out, failed = two.step()
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not failed
    assert out.num_scheduled_tokens == {}
    load = out.kv_connector_metadata.loads
    assert [t.req_id for t in load] == ["b"] and len(load[0].hashes) == external // tokens_per_value

    ids = two.block_ids("b")
    loaded = external // BS
    for p in range(loaded):          # exactly A's bytes, in every layer
        for layer in range(LAYERS):
            assert torch.equal(two.pages[layer][ids[p]], two.expected("b", p, layer)), (p, layer)
    others = [i for i in range(two.kcc.num_blocks) if i not in ids[:loaded]]
    for layer in range(LAYERS):      # nothing else was written
        assert int(two.pages[layer][others].count_nonzero()) == 0

    out, failed = two.step()         # B resumes after its external tokens
    assert not failed
    assert out.num_scheduled_tokens == {"b": len(PROMPT_B) - external}
    two.run()
    # Saves nothing twice: only B's own values past the shared prefix.
    saved_b = len(PROMPT_B) // tokens_per_value - external // tokens_per_value
    assert two.worker.stats["saved_values"] == saved_b
    assert two.worker.stats["skipped_present"] == 0
    assert two.worker.stats["failed_values"] == 0
    if "socket_dir" in cfg:
        with gdkv.connect(cfg["socket_dir"]) as c:
            assert len(c.list()) == saved_a + saved_b
        assert two.worker.stats["zero_copy_loads"] == 0
    else:
        assert two.worker.stats["zero_copy_loads"] == 1   # written straight into the pages
    one.close()
    two.close()


def test_zero_copy_in_process(model_dir, tmp_path):
    """In-process gdkv over CPU KV tensors: values move between the store and vLLM's pages
    with no staging copy (the client's copy counter stays at zero)."""
    cfg = {"backend": "memory", "namespace": str(tmp_path)}
    one = Instance(model_dir, cfg)
    one.add("a", PROMPT_A)
    one.run()
    two = Instance(model_dir, cfg)
    two.add("b", PROMPT_B)
    two.run()
    assert two.worker.stats["loaded_values"] == 10 and two.worker.stats["zero_copy_loads"] == 1
    assert two.connector.store.client().copies() == (0, 0)
    one.close()
    two.close()


def test_two_requests_in_one_step_save_once(model_dir, extra):
    """Two new requests with the same prompt in one step: each value is put once."""
    inst = Instance(model_dir, config(extra))
    inst.add("a", PROMPT_A)
    inst.add("a2", PROMPT_A)
    inst.run()
    assert inst.worker.stats["saved_values"] == 12
    inst.close()


def test_killed_gdkvd_mid_load(model_dir, tmp_path):
    d = Gdkvd("--backend", "memory")
    cfg = {"socket_dir": d.dir, "timeout_ms": 2000, "retry_interval_s": 0.2}
    try:
        one = Instance(model_dir, cfg)
        one.add("a", PROMPT_A)
        one.run()
        two = Instance(model_dir, cfg)
        two.add("b", PROMPT_B)

        def kill(out):   # after the scheduler granted the tokens, before the worker reads
            assert out.kv_connector_metadata.loads
            d.signal(signal.SIGKILL)
            d.proc.wait()

        out, failed = two.step(check_load=kill)
        assert failed and len(failed) == 10            # every loaded block is reported
        assert two.worker.stats["failed_values"] == 10
        # vLLM recomputes the whole prompt, and the request finishes normally.
        out, failed = two.step()
        assert out.num_scheduled_tokens == {"b": len(PROMPT_B)}
        two.run()
        assert two.requests["b"].is_finished()
        # gdkvd is gone: a new request simply gets no external tokens (and no error).
        c = two.add("c", list(range(700, 900)))
        out, failed = two.step()
        assert out.num_scheduled_tokens == {"c": 200} and not failed
        assert c.status == RequestStatus.RUNNING
        two.run()
        one.close()
        two.close()
    finally:
        d.stop()


def test_gdkvd_absent_means_no_hits(model_dir, tmp_path):
    cfg = {"socket_dir": str(tmp_path / "nothing-here"), "retry_interval_s": 60}
    inst = Instance(model_dir, cfg)
    inst.add("a", PROMPT_A)
    outs = inst.run()
    assert outs[0][0].num_scheduled_tokens == {"a": len(PROMPT_A)}
    assert inst.requests["a"].is_finished()
    assert inst.worker.stats["saved_values"] == 0
    inst.close()


def test_wrong_size_value_is_a_load_error(model_dir, tmp_path):
    """A value of the wrong size under a block's key is reported and recomputed, never used."""
    cfg = {"backend": "memory", "namespace": str(tmp_path)}
    one = Instance(model_dir, cfg)
    one.add("a", PROMPT_A)
    one.run()
    two = Instance(model_dir, cfg)
    b = two.add("b", PROMPT_B)
    key = two.worker.keys.key(b.block_hashes[3])
    client = two.connector.store.client()
    client.put(key, b"short")
    out, failed = two.step()
    ids = two.block_ids("b")
    assert failed == {ids[3]}
    out, _ = two.step()
    # vLLM keeps blocks 0..2 and recomputes from the failed block on: the failed block's pages
    # hold the forward pass's KV, not what gdkv had.
    assert out.num_scheduled_tokens == {"b": len(PROMPT_B) - 3 * BS}
    for layer in range(LAYERS):
        assert torch.equal(two.pages[layer][ids[3]], two.expected("b", 3, layer))
    one.close()
    two.close()


def test_keys_differ_by_model_layout_and_rank(model_dir, tmp_path):
    base = {"backend": "memory", "namespace": "k"}
    a = Instance(model_dir, base).worker.keys
    b = Instance(model_dir, {**base, "model_id": "other-weights"}).worker.keys
    c = Instance(model_dir, base, layout="LBHNC").worker.keys
    d = Instance(model_dir, {**base, "blocks_per_value": 2}).worker.keys
    e = Instance(model_dir, {**base, "namespace": "k2"}).worker.keys
    h = bytes(32)
    keys = {x.key(h) for x in (a, b, c, d, e)}
    assert len(keys) == 5
    sched = Instance(model_dir, base).scheduler.connector.scheduler
    assert sched.spaces[0].key(h) == a.key(h)        # scheduler and worker agree
