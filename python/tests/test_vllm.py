"""gdkv.vllm.GdkvConnector driven by vLLM's own scheduler, on CPU (vllm_instance.Instance:
vLLM's Scheduler, Request objects and KV cache allocator; the model runner's part of a step)."""

from __future__ import annotations

import signal

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

import gdkv  # noqa: E402
from conftest import Gdkvd  # noqa: E402
from vllm_instance import BS, Instance, llama_dir  # noqa: E402

LAYERS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return llama_dir(tmp_path_factory.mktemp("llama"), layers=LAYERS, kv_heads=2, head_dim=32)


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
