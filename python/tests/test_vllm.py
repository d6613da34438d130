"""gdkv.vllm.GdkvConnector driven by vLLM's own scheduler, on CPU (vllm_instance.Instance:
vLLM's Scheduler, Request objects and KV cache allocator; the model runner's part of a step)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

import gdkv  # noqa: E402
from conftest import Gdkvd, fail_for, hint_gdkvd, hinted, record_hints, until  # noqa: E402
import gdkv.engine  # noqa: E402
from gdkv.engine import EngineStore  # noqa: E402
from gdkv.vllm import Transfer  # noqa: E402
from vllm_instance import BS, Instance, llama_dir  # noqa: E402

LAYERS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return llama_dir(tmp_path_factory.mktemp("llama"), layers=LAYERS, kv_heads=2, head_dim=32)


PROMPT_A = list(range(100, 300))                    # 200 tokens: 12 full blocks
PROMPT_B = PROMPT_A[:160] + list(range(500, 550))   # shares 10 blocks with A, 210 tokens


@pytest.fixture(params=["in-process", "gdkvd"])
def extra(request, tmp_path):
    """Connector configs: an in-process memory store or a gdkvd (KV shared in place)."""
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
    # saved_values counts gdkv values: one per group of heads_per_value KV heads (the model's
    # 2 in one value for LBNHC, whose heads lie between a block's tokens; one each for LBHNC).
    units = {"LBNHC": 1, "LBHNC": 2}[layout]
    assert len(one.worker.spaces) == units
    saved_a = len(PROMPT_A) // tokens_per_value * units
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
    saved_b = (len(PROMPT_B) // tokens_per_value - external // tokens_per_value) * units
    assert two.worker.stats["saved_values"] == saved_b
    assert two.worker.stats["skipped_present"] == 0
    assert two.worker.stats["failed_values"] == 0
    if "socket_dir" in cfg:
        with gdkv.connect(cfg["socket_dir"]) as c:
            assert len(c.list()) == saved_a + saved_b
    # Written straight into the pages, through gdkvd too (the CPU KV tensors are shared with it
    # in place at registration): no staging copy either way.
    assert two.worker.stats["zero_copy_loads"] == 1
    assert two.connector.store.client().copies() == (0, 0)
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


def test_the_gpu_scatter_places_each_row_in_its_blocks(model_dir, tmp_path, monkeypatch):
    """The worker's scatter for CUDA pages (staged rows to the device in one copy, then an
    index_copy_ per layer), run on CPU tensors with its stream calls stubbed (no GPU here): each
    whole row's blocks land in their pages, layer by layer, in the slot's bytes; the rows of
    failed values, blocks marked -1 and every other byte are left alone."""
    class Stream:
        def __init__(self, device):
            pass

        def synchronize(self):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    inst = Instance(model_dir, {"backend": "memory", "namespace": str(tmp_path),
                                "blocks_per_value": 2}, "LBHNC")
    w = inst.worker
    one, two = w.slots[0], w.slots[1]   # LBHNC: one slot per KV head, at their offsets
    assert one.offset != two.offset and one.value_bytes == w.value_bytes
    stage = torch.randint(0, 256, (5, w.value_bytes), dtype=torch.uint8)
    targets = [([3, 4], one), ([-1, 7], two), ([9, 10], one)]
    w._scatter(stage, [0, 2, 4], targets)
    ub, expected = w.unit_bytes, [torch.zeros_like(pg) for pg in inst.pages]
    for r, (ids, sl) in zip([0, 2, 4], targets):
        value = stage[r].view(len(ids), len(sl.layers), ub)
        for j, b in enumerate(ids):
            for i, layer in enumerate(sl.layers):
                if b >= 0:
                    expected[layer][b, sl.offset:sl.offset + ub] = value[j, i]
    assert all(torch.equal(pg, e) for pg, e in zip(inst.pages, expected))
    assert int(expected[0].count_nonzero()) > 0
    inst.close()


def test_two_requests_in_one_step_save_once(model_dir, extra):
    """Two new requests with the same prompt in one step: each value is put once."""
    inst = Instance(model_dir, config(extra))
    inst.add("a", PROMPT_A)
    inst.add("a2", PROMPT_A)
    inst.run()
    assert inst.worker.stats["saved_values"] == 12
    inst.close()


@pytest.mark.parametrize("load_mode", ["async", "sync"])
def test_killed_gdkvd_mid_load(model_dir, tmp_path, load_mode):
    d = Gdkvd("--backend", "memory")
    cfg = {"socket_dir": d.dir, "timeout_ms": 2000, "retry_interval_s": 0.2}
    try:
        one = Instance(model_dir, cfg)
        one.add("a", PROMPT_A)
        one.run()
        two = Instance(model_dir, dict(cfg, load_mode=load_mode))
        two.add("b", PROMPT_B)

        def kill(out):   # after the scheduler granted the tokens, before the worker reads
            assert out.kv_connector_metadata.loads
            d.signal(signal.SIGKILL)
            d.proc.wait()

        out, failed = two.step(check_load=kill)
        # A sync load's request ran in that step (vLLM drops its output); an async one waited.
        assert out.num_scheduled_tokens == (
            {"b": len(PROMPT_B) - 10 * BS} if load_mode == "sync" else {})
        assert failed and len(failed) == 10            # every loaded block is reported
        assert two.worker.stats["failed_values"] == 10
        # vLLM recomputes the whole prompt, and the request finishes normally.
        out, failed = two.step()
        assert out.num_scheduled_tokens == {"b": len(PROMPT_B)} and not failed
        ids = two.block_ids("b")
        for p in range(len(PROMPT_B) // BS):   # the forward pass's KV, not what gdkv had
            for layer in range(LAYERS):
                assert torch.equal(two.pages[layer][ids[p]], two.expected("b", p, layer))
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


# ---- load_mode "sync": the request runs in the step that loads it ----
def test_sync_load_runs_in_the_planning_step(model_dir, extra):
    one = Instance(model_dir, config(extra))
    one.add("a", PROMPT_A)
    one.run()
    two = Instance(model_dir, config(extra, load_mode="sync"))
    b = two.add("b", PROMPT_B)
    external = 10 * BS
    out, failed = two.step()
    assert not failed and b.status == RequestStatus.RUNNING
    assert out.num_scheduled_tokens == {"b": len(PROMPT_B) - external}
    assert [t.req_id for t in out.kv_connector_metadata.loads] == ["b"]
    ids = two.block_ids("b")
    for p in range(10):   # A's bytes were in the pages before the forward pass wrote the rest
        for layer in range(LAYERS):
            assert torch.equal(two.pages[layer][ids[p]], two.expected("b", p, layer)), (p, layer)
    w = two.worker.stats
    assert w["loaded_values"] == 10 and w["sync_wait_s"] > 0
    assert not two.worker.finished_loads   # vLLM waits for no transfer result
    assert two.scheduler.connector.scheduler.requests["b"].loading is None
    two.run()
    assert b.is_finished()
    assert w["saved_values"] == len(PROMPT_B) // BS - 10 and w["skipped_present"] == 0
    one.close()
    two.close()


@pytest.mark.parametrize("kv_role", ["kv_both", "kv_producer"])
def test_a_prompt_vllm_holds_whole_is_not_saved_again(model_dir, extra, kv_role):
    """A's 12 full blocks all in vLLM's own prefix cache (8 tokens left to compute): they were
    saved when they were computed, so the second A gathers and puts nothing."""
    inst = Instance(model_dir, config(extra), kv_role=kv_role)
    inst.add("a", PROMPT_A)
    inst.run()
    inst.worker.drain()
    w = inst.worker.stats
    assert w["saved_values"] == 12 * len(inst.worker.slots)   # a value per slot and block
    before = w.snapshot()
    again = inst.add("again", PROMPT_A)
    out, _ = inst.step()
    assert out.num_scheduled_tokens == {"again": len(PROMPT_A) - 12 * BS}
    inst.run()
    inst.worker.drain()
    assert again.is_finished()
    assert {k: w[k] for k in ("saved_values", "skipped_present", "gather_s", "loaded_values")} \
        == {k: before[k] for k in ("saved_values", "skipped_present", "gather_s", "loaded_values")}
    inst.close()


def test_a_request_chooses_whether_and_how_it_is_saved(model_dir, tmp_path, monkeypatch, caplog):
    """kv_transfer_params: "gdkv_save": false saves nothing of the request, "gdkv_priority":
    "low" saves its values as low-priority Stores; a bad value is logged and the default kept."""
    inst = Instance(model_dir, {"backend": "memory", "namespace": str(tmp_path)})
    puts: list[bool] = []
    real = gdkv.Client.put_many
    monkeypatch.setattr(gdkv.Client, "put_many", lambda self, items, low_priority=False:
                        puts.append(low_priority) or real(self, items, low_priority=low_priority))
    w = inst.worker.stats
    inst.add("skip", PROMPT_A, {"gdkv_save": False, "other_connector": 1})
    inst.run()
    inst.worker.drain()
    assert w["saved_values"] == 0 and puts == []
    client = inst.connector.store.client()
    assert not client.exists(inst.worker.spaces[0].key(inst.requests["skip"].block_hashes[0]))

    b = inst.add("low", PROMPT_B, {"gdkv_priority": "low"})
    inst.run()
    inst.worker.drain()
    # vLLM's own cache holds the 10 blocks B shares with A: B saves its 3 others, low priority.
    assert w["saved_values"] == 3 * len(inst.worker.slots) and puts and all(puts)
    assert all(client.exists(inst.worker.spaces[0].key(h)) for h in b.block_hashes[10:13])

    puts.clear()
    with caplog.at_level(logging.WARNING, logger="gdkv.vllm"):
        inst.add("bad", list(range(1000, 1100)), {"gdkv_save": "no", "gdkv_priority": "urgent"})
        inst.run()
        inst.worker.drain()
    assert puts and not any(puts)
    assert "gdkv_save must be true or false, not 'no'" in caplog.text
    assert "gdkv_priority must be one of normal, low, not 'urgent'" in caplog.text
    inst.close()


# ---- kv_role: a producer (prefill engine) never loads, a consumer (decode engine) never saves
def test_producer_saves_and_never_loads(model_dir, tmp_path):
    cfg = {"backend": "memory", "namespace": str(tmp_path)}
    one = Instance(model_dir, cfg)
    one.add("a", PROMPT_A)
    one.run()
    prefill = Instance(model_dir, cfg, kv_role="kv_producer")
    prefill.add("b", PROMPT_B)   # gdkv holds 10 of its blocks: a producer computes them all
    out, failed = prefill.step()
    assert out.num_scheduled_tokens == {"b": len(PROMPT_B)} and not failed
    assert not out.kv_connector_metadata.loads
    prefill.run()
    w = prefill.worker.stats
    assert w["loaded_values"] == 0
    # It saves what gdkv lacks (the 10 shared values were there already).
    assert w["saved_values"] == len(PROMPT_B) // BS - 10 and w["skipped_present"] == 10
    # Its saves are in gdkv when the step that made them ends (no drain): a decode engine
    # asked right after the prefill engine answered finds them.
    w = prefill.worker
    w.start_saves([Transfer("s", [bytes([i]) * 32 for i in range(4)],
                            [[200 + i] for i in range(4)])])
    assert w.stats["saved_values"] == len(PROMPT_B) // BS - 10 + 4 and w.stats["save_wait_s"] > 0
    one.close()
    prefill.close()


def test_consumer_loads_and_never_saves(model_dir, tmp_path):
    cfg = {"backend": "memory", "namespace": str(tmp_path)}
    prefill = Instance(model_dir, cfg, kv_role="kv_producer")
    prefill.add("a", PROMPT_A)
    prefill.run()
    decode = Instance(model_dir, cfg, kv_role="kv_consumer")
    b = decode.add("b", PROMPT_B)
    decode.run()
    assert b.is_finished()
    w = decode.worker.stats
    assert w["loaded_values"] == 10 and w["saved_values"] == 0 and w["skipped_present"] == 0
    # The consumer's own values past the shared prefix were not put.
    client = decode.connector.store.client()
    assert all(client.exists(decode.worker.spaces[0].key(h)) for h in b.block_hashes[:10])
    assert not any(client.exists(decode.worker.spaces[0].key(h)) for h in b.block_hashes[10:])
    prefill.close()
    decode.close()


def test_load_mode_is_checked(model_dir, tmp_path):
    with pytest.raises(ValueError, match="load_mode"):
        Instance(model_dir, {"backend": "memory", "namespace": str(tmp_path),
                             "load_mode": "eager"})


def test_gdkvd_absent_means_no_hits(model_dir, tmp_path):
    cfg = {"socket_dir": str(tmp_path / "nothing-here"), "retry_interval_s": 60}
    inst = Instance(model_dir, cfg)
    inst.add("a", PROMPT_A)
    outs = inst.run()
    assert outs[0][0].num_scheduled_tokens == {"a": len(PROMPT_A)}
    assert inst.requests["a"].is_finished()
    assert inst.worker.stats["saved_values"] == 0
    inst.close()


def test_keys_differ_by_model_layout_and_rank(model_dir, tmp_path):
    base = {"backend": "memory", "namespace": "k"}
    a = Instance(model_dir, base).worker.spaces[0]
    b = Instance(model_dir, {**base, "model_id": "other-weights"}).worker.spaces[0]
    c = Instance(model_dir, base, layout="LBHNC").worker.spaces[0]
    d = Instance(model_dir, {**base, "blocks_per_value": 2}).worker.spaces[0]
    e = Instance(model_dir, {**base, "namespace": "k2"}).worker.spaces[0]
    h = bytes(32)
    keys = {x.key(h) for x in (a, b, c, d, e)}
    assert len(keys) == 5
    sched = Instance(model_dir, base).scheduler.connector.scheduler
    assert sched.full_spaces[0].key(h) == a.key(h)   # scheduler and worker agree


def test_values_hold_kv_heads_numbered_over_the_model(model_dir):
    """A value holds heads_per_value KV heads, named by their place among the model's heads (not
    the rank's), so engines of any tensor-parallel size find the heads they hold; ranks holding
    copies of a head (fewer KV heads than ranks, or MLA's one latent KV) save it once."""
    base = {"backend": "memory", "namespace": "heads"}
    p = Instance(model_dir, base, layout="LBHNC").connector.plan
    assert (p.total_heads, p.rank_heads, p.heads_per_value) == (2, 2, 1)
    assert p.rank_units(0) == (0, [0, 1], [True, True])
    p.tp, p.total_heads, p.rank_heads = 4, 8, 2          # 8 heads over 4 ranks
    assert p.rank_units(2) == (4, [4, 5], [True, True])
    p.tp, p.total_heads, p.rank_heads = 8, 2, 1          # 2 heads, each on 4 ranks
    assert [p.rank_units(r) for r in (3, 4, 5)] == [(0, [0], [False]), (1, [1], [True]),
                                                    (1, [1], [False])]
    # Every value whole: 2 heads in one value, or a layout with a head's tokens apart.
    assert Instance(model_dir, {**base, "heads_per_value": 2}, layout="LBHNC"
                    ).connector.plan.heads_per_value == 2
    assert Instance(model_dir, base, layout="LBNHC").connector.plan.heads_per_value == 2
    with pytest.raises(ValueError, match="heads_per_value must divide"):
        Instance(model_dir, {**base, "heads_per_value": 3}, layout="LBHNC")
    # One head's keys do not depend on the rank or on the engine's TP size.
    one = Instance(model_dir, base, layout="LBHNC").worker.spaces
    assert len({sp.key(bytes(32)) for sp in one}) == 2
    assert all("heads" in sp.description and "rank" not in sp.description for sp in one)


# ---- hybrid models: a sliding-window group loads only its window ----
def test_sliding_window_group_loads_only_its_window(model_dir, tmp_path):
    """Layers 1 and 3 attend to a 40-token window: vLLM's hybrid KV cache manager keeps them
    in a group of their own, which needs only the 3 blocks before a hit's end (vLLM's rule,
    cdiv(40 - 1, 16)). B's 10 shared blocks load whole in the full group and as blocks 7-9 in
    the window group; with a window block gone from gdkv the hit ends where a window is whole."""
    cfg = {"backend": "memory", "namespace": str(tmp_path)}
    one = Instance(model_dir, cfg, layout="LBHNC", window=40)
    assert [g.window for g in one.connector.plan.groups] == [0, 40]
    one.add("a", PROMPT_A)
    one.run()
    units = 2   # one gdkv value per KV head
    assert one.worker.stats["saved_values"] == 12 * 2 * units   # both groups, every block

    two = Instance(model_dir, cfg, layout="LBHNC", window=40)
    two.add("b", PROMPT_B)
    out, failed = two.step()
    assert not failed
    full, window = two.block_ids("b", 0), two.block_ids("b", 1)
    assert window[:7] == [0] * 7 and 0 not in window[7:10]   # vLLM's null blocks
    for i, pages in enumerate(two.pages):
        group, layer = two.group_of[i], two.layer_of[i]
        ids = full if group == 0 else window
        for p in range(10) if group == 0 else range(7, 10):
            assert torch.equal(pages[ids[p]], two.expected("b", p, layer)), (p, layer)
    # (A full layer and a window layer share one tensor, each group's blocks their own.)
    written = set(full[:10]) | set(window[7:10])
    others = [b for b in range(two.kcc.num_blocks) if b not in written]
    for pages in two.pages:
        assert int(pages[others].count_nonzero()) == 0   # nothing else written
    assert two.worker.stats["loaded_blocks"] == 10
    out, failed = two.step()
    assert out.num_scheduled_tokens == {"b": len(PROMPT_B) - 160} and not failed
    two.run()

    # B's 13 blocks are all in gdkv now. Window block 11 (of head 0) gone: a hit of 13 or 12
    # blocks lacks a block of its window, one of 11 has blocks 8-10.
    client = two.connector.store.client()
    window_space = [sl.space for sl in two.worker.slots if sl.group == 1][0]
    client.delete(window_space.key(two.requests["b"].block_hashes[11]))
    three = Instance(model_dir, cfg, layout="LBHNC", window=40)
    three.add("c", PROMPT_B)
    out, failed = three.step()
    assert [len(t.hashes) for t in out.kv_connector_metadata.loads] == [11]
    for i, pages in enumerate(three.pages):
        if three.group_of[i] == 1:
            ids = three.block_ids("c", 1)
            for p in range(8, 11):
                assert torch.equal(pages[ids[p]], three.expected("c", p, three.layer_of[i]))
    three.run()
    assert three.requests["c"].is_finished()
    for inst in (one, two, three):
        inst.close()


def test_an_engine_without_prefix_caching_saves_and_never_loads(model_dir, tmp_path, caplog):
    """vLLM turns its prefix caching off where its attention cannot compute past cached tokens
    (MLA on CPU; test_vllm_features.py::test_mla_ranks_save_one_copy): such an engine loads
    nothing, and still saves what it computes."""
    cfg = {"backend": "memory", "namespace": str(tmp_path)}
    one = Instance(model_dir, cfg)
    one.add("a", PROMPT_A)
    one.run()
    with caplog.at_level(logging.WARNING, logger="gdkv.vllm"):
        two = Instance(model_dir, cfg, prefix_caching=False)
    assert "loads nothing" in caplog.text
    two.add("b", PROMPT_B)
    out, failed = two.step()
    assert out.num_scheduled_tokens == {"b": len(PROMPT_B)} and not failed
    assert not out.kv_connector_metadata.loads
    two.run()
    assert two.worker.stats["loaded_values"] == 0
    assert two.worker.stats["saved_values"] == len(PROMPT_B) // BS - 10   # B's own blocks
    one.close()
    two.close()


# ---- keys name the weights and the dtype ----
def weights_dir(path, fill: float) -> str:
    """A Llama config and one weights file (the Instance harness reads only config.json)."""
    from safetensors.torch import save_file
    llama_dir(path, layers=LAYERS, kv_heads=2, head_dim=32)
    save_file({"w": torch.full((256,), fill)}, str(path / "model.safetensors"))
    return str(path)


def test_keys_name_the_weights(tmp_path, monkeypatch):
    """Two checkpoints at one path never share KV; one checkpoint keeps its keys."""
    monkeypatch.setenv("GDKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model"
    path.mkdir()
    cfg = {"backend": "memory", "namespace": "w"}
    weights_dir(path, 1.0)
    one = Instance(str(path), cfg).worker.spaces[0].salt
    weights_dir(path, 2.0)                                # other weights, same size and path
    os.utime(path / "model.safetensors", ns=(1, 10 ** 18))
    two = Instance(str(path), cfg).worker.spaces[0].salt
    assert two != one
    os.utime(path / "model.safetensors", ns=(1, 2 * 10 ** 18))   # touched, same weights
    assert Instance(str(path), cfg).worker.spaces[0].salt == two
    weights_dir(path, 1.0)                                # the first weights again
    assert Instance(str(path), cfg).worker.spaces[0].salt == one
    # model_id names the weights instead: the files are not read.
    assert Instance(str(path), {**cfg, "model_id": "x"}).worker.spaces[0].salt == \
        Instance(str(path), {**cfg, "model_id": "x"}).worker.spaces[0].salt


def test_keys_name_the_model_dtype(model_dir):
    """fp32 and bf16 weights compute different KV even into caches of one dtype."""
    cfg = {"backend": "memory", "namespace": "d"}
    fp32 = Instance(model_dir, cfg, dtype=torch.float32, kv_dtype=torch.bfloat16).worker.spaces[0]
    bf16 = Instance(model_dir, cfg, dtype=torch.bfloat16, kv_dtype=torch.bfloat16).worker.spaces[0]
    assert fp32.salt != bf16.salt
    assert "model=float32" in fp32.description and "model=bfloat16" in bf16.description


def a_stored_b_added(model_dir, tmp_path, **more):
    """Instance one ran PROMPT_A (its values are in gdkv); instance two (its config plus
    ``more``) has PROMPT_B added."""
    cfg = {"backend": "memory", "namespace": str(tmp_path)}
    one = Instance(model_dir, cfg)
    one.add("a", PROMPT_A)
    one.run()
    two = Instance(model_dir, {**cfg, **more})
    return cfg, one, two, two.add("b", PROMPT_B)


# ---- a value that fails to load is dropped, and saved again ----
@pytest.mark.parametrize("load_mode", ["async", "sync"])
def test_bad_value_is_dropped_and_saved_again(model_dir, tmp_path, load_mode):
    """A value of the wrong size under a block's key is reported and recomputed, never used; it
    is deleted, and the recompute saves it again. With sync loads the request ran in the step
    that loaded it: vLLM drops that step's output and recomputes from the failed block."""
    cfg, one, two, b = a_stored_b_added(model_dir, tmp_path, load_mode=load_mode)
    key = two.worker.spaces[0].key(b.block_hashes[3])
    client = two.connector.store.client()
    client.put(key, b"short")                 # what a torn or corrupted write would leave
    out, failed = two.step()
    assert failed == {two.block_ids("b")[3]}
    assert not client.exists(key) and two.worker.stats["dropped_values"] == 1
    out, _ = two.step()
    # vLLM keeps blocks 0..2 and recomputes from the failed block on: the failed block's pages
    # hold the forward pass's KV, not what gdkv had.
    assert out.num_scheduled_tokens == {"b": len(PROMPT_B) - 3 * BS}
    for layer in range(LAYERS):
        assert torch.equal(two.pages[layer][two.block_ids("b")[3]], two.expected("b", 3, layer))
    two.run()                                 # saves block 3 again
    assert len(client.get(key, size_hint=1 << 20)) == two.worker.value_bytes
    three = Instance(model_dir, cfg)
    three.add("c", PROMPT_B)
    out, failed = three.step()
    assert not failed and three.worker.stats["loaded_values"] == 13
    for p in range(13):
        for layer in range(LAYERS):
            assert torch.equal(three.pages[layer][three.block_ids("c")[p]],
                               three.expected("c", p, layer))
    for inst in (one, two, three):
        inst.close()


# ---- layerwise: values of some layers, loads the forward pass waits for layer by layer ----
def layerwise_pair(model_dir, tmp_path, per_value: int):
    """Instance one saved PROMPT_A in values of ``per_value`` layers; instance two loads them
    layer by layer and has PROMPT_B added."""
    cfg = {"backend": "memory", "namespace": str(tmp_path), "layers_per_value": per_value}
    one = Instance(model_dir, cfg)
    one.add("a", PROMPT_A)
    one.run()
    assert one.worker.stats["saved_values"] == 12 * (LAYERS // per_value)
    two = Instance(model_dir, {**cfg, "load_mode": "layerwise"})
    return one, two, two.add("b", PROMPT_B)


def test_layerwise_loads_let_the_first_layers_run_while_the_last_load(model_dir, tmp_path,
                                                                       monkeypatch):
    """Values of one layer each: the step that loads B runs layer 0's attention while layer 3's
    values are still loading (held here until layer 2 has run); every layer's KV is in its pages
    when its attention runs."""
    one, two, b = layerwise_pair(model_dir, tmp_path, 1)
    release = threading.Event()
    real = two.worker._load

    def load(t, slots=None, finish=True):
        if slots and slots[0].chunk == LAYERS - 1:
            assert release.wait(10)
        return real(t, slots, finish)

    monkeypatch.setattr(two.worker, "_load", load)
    last = two.layer_of.index(LAYERS - 1)
    seen = []

    def on_layer(i):
        ids = two.block_ids("b")
        for p in range(10):
            assert torch.equal(two.pages[i][ids[p]], two.expected("b", p, two.layer_of[i]))
        seen.append((two.layer_of[i], two.worker.step_loads[2][last].done()))
        if two.layer_of[i] == LAYERS - 2:
            # A moment later, so that the step is already waiting for layer 3's values
            # (layer_wait_s) rather than finding them loaded.
            threading.Timer(0.2, release.set).start()

    two.on_layer = on_layer
    out, failed = two.step()
    assert not failed and b.status == RequestStatus.RUNNING
    assert out.num_scheduled_tokens == {"b": len(PROMPT_B) - 10 * BS}
    assert seen == [(0, False), (1, False), (2, False), (3, True)]
    w = two.worker.stats
    assert w["loaded_blocks"] == 10 and w["failed_values"] == 0 and w["layer_wait_s"] > 0
    two.on_layer = None
    two.run()
    assert b.is_finished() and w["saved_values"] == (len(PROMPT_B) // BS - 10) * LAYERS
    one.close()
    two.close()


def test_a_layerwise_load_failing_in_its_last_layers_is_recomputed(model_dir, tmp_path):
    """Block 3's value of layers 2-3 is torn: its first layers load, the step runs, and vLLM is
    told block 3 failed, drops the step's output for B and recomputes from block 3 (KV half
    loaded is never used); the torn value is dropped and saved again."""
    one, two, b = layerwise_pair(model_dir, tmp_path, 2)
    later = next(sl for sl in two.worker.slots if sl.chunk == 1)
    key = later.space.key(b.block_hashes[3])
    client = two.connector.store.client()
    client.put(key, b"short")
    out, failed = two.step()
    assert failed == {two.block_ids("b")[3]}
    assert two.worker.stats["dropped_values"] == 1 and not client.exists(key)
    out, _ = two.step()
    assert out.num_scheduled_tokens == {"b": len(PROMPT_B) - 3 * BS}
    for i in range(LAYERS):
        assert torch.equal(two.pages[i][two.block_ids("b")[3]],
                           two.expected("b", 3, two.layer_of[i]))
    two.run()
    assert client.exists(key)
    one.close()
    two.close()


def test_a_layer_run_without_waiting_fails_the_steps_loads(model_dir, tmp_path, caplog):
    """A layer vLLM runs without wait_for_layer_load may have read its pages before the KV
    landed: every value of the step is reported failed (recomputed), and later loads finish
    before the forward pass, as sync loads do."""
    one, two, b = layerwise_pair(model_dir, tmp_path, 1)
    two.skip_wait = {two.layer_of.index(2)}
    with caplog.at_level(logging.WARNING, logger="gdkv.vllm"):
        out, failed = two.step()
    assert failed == set(two.block_ids("b")[:10])
    assert not two.worker.layerwise_ok and "without waiting" in caplog.text
    two.run()
    assert b.is_finished()
    c = two.add("c", PROMPT_A)
    two.scheduler.kv_cache_manager.reset_prefix_cache()
    out, failed = two.step()
    assert not failed and c.status == RequestStatus.RUNNING
    for p in range(11):
        for i in range(LAYERS):
            assert torch.equal(two.pages[i][two.block_ids("c")[p]],
                               two.expected("c", p, two.layer_of[i]))
    one.close()
    two.close()


def test_layerwise_saves_start_once_their_layers_are_computed(model_dir, tmp_path):
    """Values of two layers: the save of layers 0-1 starts before layer 2's attention; each
    value's KV events count one report per chunk (the scheduler waits for both)."""
    inst = Instance(model_dir, {"backend": "memory", "namespace": str(tmp_path),
                                "layers_per_value": 2, "load_mode": "layerwise"})
    inst.worker.plan.events = True
    sched = inst.scheduler.connector.scheduler
    sched.plan.events = True
    taken: list = []   # what vLLM's scheduler takes from the connector (to publish)
    take = sched.take_events
    sched.take_events = lambda: (lambda evs: taken.extend(evs) or evs)(take())
    inst.add("a", PROMPT_A)
    seen = []
    inst.on_layer = lambda i: seen.append((inst.layer_of[i], set(inst.worker.save_chunks)))
    inst.step()
    assert seen == [(0, set()), (1, set()), (2, {0}), (3, {0})]
    assert inst.worker.stats["saved_values"] == 12 * 2
    # The worker reported each value twice (a chunk at a time); the scheduler, which waits for
    # 2 reports (one rank, two chunks), announced all 12.
    assert sched.world == 2 and not sched.confirmed
    stored = [e for e in taken if type(e).__name__ == "BlockStored"]
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    assert [e.block_hashes for e in stored] == [
        [maybe_convert_block_hash(h)] for h in inst.requests["a"].block_hashes[:12]]
    inst.close()


def test_an_unknown_extra_config_key_is_an_error(model_dir, tmp_path):
    """A misspelt setting stops the connector at start, naming the key and the known ones,
    instead of leaving the setting at its default."""
    cfg = {"backend": "memory", "namespace": str(tmp_path), "layer_per_value": 2}
    with pytest.raises(ValueError, match=r"unknown key 'layer_per_value'.*layers_per_value"):
        Instance(model_dir, cfg)
    # A value of the wrong type is refused with its key; text (as JSON may carry) is read.
    cfg = {"backend": "memory", "namespace": str(tmp_path)}
    with pytest.raises(ValueError, match=r"blocks_per_value=1\.5 .*not an integer"):
        Instance(model_dir, {**cfg, "blocks_per_value": 1.5})
    with pytest.raises(ValueError, match=r"heads_per_value='one'"):
        Instance(model_dir, {**cfg, "heads_per_value": "one"})
    for key, low in [("blocks_per_value", 0), ("layers_per_value", -1)]:
        with pytest.raises(ValueError, match=f"{key}={low} .*must be at least {low + 1}"):
            Instance(model_dir, {**cfg, key: low})
    inst = Instance(model_dir, {**cfg, "blocks_per_value": "2"})
    assert inst.connector.plan.blocks_per_value == 2
    inst.close()


def test_values_of_fewer_layers_have_keys_of_their_own(model_dir, tmp_path):
    """layers_per_value names the layers in the key: whole-value engines and those of two
    layers share nothing, and a lookup needs every chunk of a block."""
    cfg = {"backend": "memory", "namespace": str(tmp_path)}
    one = Instance(model_dir, {**cfg, "layers_per_value": 2})
    one.add("a", PROMPT_A)
    one.run()
    whole = Instance(model_dir, cfg)
    whole.add("b", PROMPT_B)
    out, _ = whole.step()
    assert not out.kv_connector_metadata.loads   # nothing of A under whole-value keys
    two = Instance(model_dir, {**cfg, "layers_per_value": 2})
    b = two.add("b", PROMPT_B)
    second = next(sl for sl in two.worker.slots if sl.chunk == 1)
    two.connector.store.client().delete(second.space.key(b.block_hashes[5]))
    out, _ = two.step()
    assert [len(t.hashes) for t in out.kv_connector_metadata.loads] == [5]
    for inst in (one, whole, two):
        inst.close()


# ---- loads never wait behind saves ----
def blocking_put_many(client, monkeypatch):
    """Makes client.put_many wait for the returned Event (a gdkvd slow to store)."""
    release = threading.Event()
    real = client.put_many

    def put_many(items, **kw):
        items = list(items)
        release.wait(30)
        return real(items, **kw)

    monkeypatch.setattr(client, "put_many", put_many)
    return release


def wait_for_load(worker, req_id: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with worker.lock:
            if req_id in worker.finished_loads:
                return True
        time.sleep(0.01)
    return False


def test_loads_do_not_wait_for_saves(model_dir, tmp_path, monkeypatch):
    cfg = {"backend": "memory", "namespace": str(tmp_path)}
    one = Instance(model_dir, cfg)
    a = one.add("a", PROMPT_A)
    one.run()
    two = Instance(model_dir, cfg)
    release = blocking_put_many(two.connector.store.client(), monkeypatch)
    try:
        two.worker.start_saves([Transfer("s", [bytes([i]) * 32], [[200 + i]])
                                for i in range(4)])
        load = Transfer("b", list(a.block_hashes[:10]), [[1 + p] for p in range(10)])
        two.worker.start_loads([load])
        assert wait_for_load(two.worker, "b", 5), "the load waited for the saves"
    finally:
        release.set()
    two.worker.drain()
    assert two.worker.stats["loaded_values"] == 10 and two.worker.stats["saved_values"] == 4
    for p in range(10):
        assert torch.equal(two.pages[0][1 + p], one.expected("a", p, 0))
    one.close()
    two.close()


# ---- saves never take the memory a load needs ----
def test_saves_leave_the_load_staging_alone(model_dir, monkeypatch):
    """KV memory gdkvd cannot reach in place (here refused by prepare_shared_memory, as for
    CUDA KV) is loaded through staging, which saves never take."""
    def refuse(buf):
        raise ValueError("not private memory")

    monkeypatch.setattr(gdkv.engine, "prepare_shared_memory", refuse)
    d = Gdkvd("--backend", "memory")
    try:
        cfg = {"socket_dir": d.dir, "timeout_ms": 5000}
        one = Instance(model_dir, cfg)
        a = one.add("a", PROMPT_A)
        one.run()
        # 2 MiB shared with gdkvd; a value is 32 KiB, the load staging 8 of them.
        small = {**cfg, "shared_memory_bytes": 2 << 20, "staging_bytes": 256 << 10}
        two = Instance(model_dir, small)
        assert two.worker.value_bytes == 32 << 10
        release = blocking_put_many(two.connector.store.client(), monkeypatch)
        try:
            # 64 saves waiting for gdkv (2 MiB): as many as the budget allows are kept.
            two.worker.start_saves([Transfer(f"s{i}", [bytes([i]) * 32], [[200]])
                                    for i in range(64)])
            assert two.worker.stats["dropped_saves"] > 0
            load = Transfer("b", list(a.block_hashes[:10]), [[1 + p] for p in range(10)])
            two.worker.start_loads([load])
            assert wait_for_load(two.worker, "b", 10)
            assert two.worker.stats["failed_values"] == 0, "the saves took the load's memory"
        finally:
            release.set()
        two.worker.drain()
        assert two.worker.stats["loaded_values"] == 10
        for p in range(10):
            for layer in range(LAYERS):
                assert torch.equal(two.pages[layer][1 + p], one.expected("a", p, layer))
        assert two.worker.stats["saved_values"] + two.worker.stats["dropped_saves"] == 64
        one.close()
        two.close()
    finally:
        d.stop()


# ---- a batch that fails for one key fails that key only (conftest.fail_for) ----


def test_one_failing_key_fails_only_its_value(model_dir, tmp_path, monkeypatch):
    cfg, one, two, b = a_stored_b_added(model_dir, tmp_path)
    client = two.connector.store.client()
    bad = two.worker.spaces[0].key(b.block_hashes[5])
    fail_for(client, monkeypatch, "get_many_into", bad)
    out, failed = two.step()
    assert failed == {two.block_ids("b")[5]}          # not all 10 blocks
    assert two.worker.stats["loaded_values"] == 9
    assert not client.exists(bad) and two.worker.stats["dropped_values"] == 1
    two.close()
    one.close()


@pytest.mark.parametrize("err", [gdkv.NotReadyError, gdkv.CapacityError])
def test_a_key_gdkv_cannot_serve_now_is_a_miss_and_is_not_deleted(model_dir, tmp_path,
                                                                 monkeypatch, err):
    """A key whose Retrieve found the store behind gdkv unreachable (82h: the whole load is a
    miss and the client is dropped) or no shared memory (81h: that value is a miss) says nothing
    of the value: it is not deleted, unlike a value of the wrong size or one failing itself."""
    cfg, one, two, b = a_stored_b_added(model_dir, tmp_path)
    client = two.connector.store.client()
    bad = two.worker.spaces[0].key(b.block_hashes[5])
    fail_for(client, monkeypatch, "get_many_into", bad, err("cannot now", 0, bad))
    out, failed = two.step()
    ids = two.block_ids("b")
    assert failed == (set(ids[:10]) if err is gdkv.NotReadyError else {ids[5]})
    assert (two.connector.store.client() is None) == (err is gdkv.NotReadyError)
    assert client.exists(bad) and two.worker.stats["dropped_values"] == 0
    two.close()
    one.close()


@pytest.mark.parametrize("load_mode", ["async", "sync"])
def test_a_value_that_failed_to_load_is_not_offered_again(model_dir, tmp_path, monkeypatch,
                                                         load_mode):
    """gdkv lists a value it cannot deliver and keeps it (its delete fails too: a namespace not
    ready after a restart, a far tier cut off). The request recomputes from that value once;
    the connector never offers it to the request again (before, vLLM rescheduled, the lookup
    found it, the load failed: 644 times in 3 s in a serving run with a restarted tiered gdkvd)."""
    cfg, one, two, b = a_stored_b_added(model_dir, tmp_path, load_mode=load_mode)
    client = two.connector.store.client()
    # The first value: vLLM then starts the request from token 0 and asks the connector again
    # (it does not when a later value failed).
    fail_for(client, monkeypatch, "get_many_into", two.worker.spaces[0].key(b.block_hashes[0]))
    monkeypatch.setattr(client, "delete", lambda *args, **kw: None)
    out, failed = two.step()
    assert failed == {two.block_ids("b")[0]}
    out, failed = two.step()
    assert not out.kv_connector_metadata.loads and not failed
    assert out.num_scheduled_tokens == {"b": len(PROMPT_B)}
    two.run()
    assert b.is_finished() and two.worker.stats["failed_values"] == 1
    two.close()
    one.close()


def test_lookup_stops_before_a_failing_key(model_dir, tmp_path, monkeypatch):
    cfg, one, two, b = a_stored_b_added(model_dir, tmp_path)
    fail_for(two.connector.store.client(), monkeypatch, "lookup",
             two.worker.spaces[0].key(b.block_hashes[6]))
    out, failed = two.step()
    assert len(out.kv_connector_metadata.loads[0].hashes) == 6 and not failed
    two.close()
    one.close()


def test_one_failing_put_stores_the_others(model_dir, tmp_path, monkeypatch):
    cfg = {"backend": "memory", "namespace": str(tmp_path)}
    inst = Instance(model_dir, cfg)
    a = inst.add("a", PROMPT_A)
    client = inst.connector.store.client()
    bad = inst.worker.spaces[0].key(a.block_hashes[4])
    fail_for(client, monkeypatch, "put_many", bad)
    fail_for(client, monkeypatch, "exists_many", inst.worker.spaces[0].key(a.block_hashes[2]))
    inst.run()
    assert inst.worker.stats["saved_values"] == 11
    keys = inst.worker.spaces[0].keys(a.block_hashes)
    assert [client.exists(k) for k in keys] == [k != bad for k in keys]
    assert bad not in inst.worker.saved and keys[0] in inst.worker.saved
    inst.close()


# ---- the scheduler's state ----
def test_matched_tokens_changes_no_state(model_dir, tmp_path):
    """vLLM may ask for a request's external tokens more than once: only the answer it acts
    on counts (here gdkv lost the values between two lookups)."""
    cfg = {"backend": "memory", "namespace": str(tmp_path)}
    one = Instance(model_dir, cfg)
    a = one.add("a", PROMPT_A)
    one.run()
    two = Instance(model_dir, cfg)
    b = two.add("b", PROMPT_B)
    sched = two.scheduler.connector
    assert sched.get_num_new_matched_tokens(b, 0) == (160, True)
    assert sched.get_num_new_matched_tokens(b, 0) == (160, True)
    client = two.connector.store.client()
    for k in one.worker.spaces[0].keys(a.block_hashes):
        client.delete(k)                                # evicted meanwhile
    out, failed = two.step()
    assert out.num_scheduled_tokens == {"b": len(PROMPT_B)} and not failed
    two.run()
    assert two.worker.stats["saved_values"] == len(PROMPT_B) // BS   # every value, once
    one.close()
    two.close()


def test_worker_without_gdkv_turns_the_scheduler_off(model_dir, tmp_path):
    """LHBNC (heads outside blocks) keeps a block in pieces: the worker cannot use gdkv, though
    the scheduler's plan can. Its loads fail at once, and the scheduler stops granting."""
    cfg = {"backend": "memory", "namespace": str(tmp_path)}
    inst = Instance(model_dir, cfg, layout="LHBNC")
    assert not inst.worker.pages
    b = inst.add("b", PROMPT_B)
    p = inst.connector.plan
    value = bytes(p.blocks_per_value * LAYERS * p.head_bytes * p.heads_per_value)
    client = inst.connector.store.client()
    for h in b.block_hashes[:10]:                       # values a healthy worker had saved
        for space in inst.worker.spaces:
            client.put(space.key(h), value)
    out, failed = inst.step()
    assert len(failed) == 10 and inst.worker.stats["failed_blocks"] == 10
    inst.run()
    assert b.is_finished()
    c = inst.add("c", list(range(2000, 2200)))
    for h in c.block_hashes[:10]:
        for space in inst.worker.spaces:
            client.put(space.key(h), value)
    out, failed = inst.step()
    assert out.num_scheduled_tokens == {"c": 200} and not failed   # no external tokens
    assert not out.kv_connector_metadata.loads and not out.kv_connector_metadata.saves
    inst.close()


# ---- scheduler hints: what the waiting requests will load ----
def test_arriving_requests_hint_what_they_will_load(model_dir, monkeypatch):
    """vLLM's scheduler hands the connector each request as it enters the waiting queue: the
    values past vLLM's own prefix cache that gdkv holds (the leading run) reach gdkvd's cache
    as a hint, in order, once per request."""
    d = hint_gdkvd()
    try:
        cfg = {"socket_dir": d.dir, "timeout_ms": 5000}
        one = Instance(model_dir, cfg)
        a = one.add("a", PROMPT_A)              # gdkv holds none of it: nothing to hint
        one.run()
        assert hinted(d) == 0
        two = Instance(model_dir, cfg)
        sched = two.scheduler.connector.scheduler
        keys = sched.full_spaces[0].keys
        hints = record_hints(sched.store.client(), monkeypatch)
        b = two.add("b", PROMPT_B)              # shares 10 stored values with A, then 3 new
        c = two.add("c", PROMPT_A)              # waits behind b: A's 12 values
        assert hints == [keys(b.block_hashes[:10]), keys(a.block_hashes[:12])]
        assert hinted(d) == 22
        # vLLM asks get_num_new_matched_tokens again each step a request cannot be admitted;
        # that hints nothing more.
        conn = two.scheduler.connector
        assert conn.get_num_new_matched_tokens(b, 0) == (160, True)
        assert conn.get_num_new_matched_tokens(b, 0) == (160, True)
        two.run()
        assert b.is_finished() and c.is_finished()
        assert len(hints) == 2 and hinted(d) == 22
        assert two.worker.stats["loaded_values"] > 0

        # Instance one's prefix cache holds A's 12 blocks: a request for PROMPT_B there loads
        # only B's last 3 values (saved by two) from gdkv, and only those are hinted.
        hints_one = record_hints(one.scheduler.connector.scheduler.store.client(), monkeypatch)
        e = one.add("e", PROMPT_B)
        assert hints_one == [keys(b.block_hashes[10:13])]
        assert hinted(d) == 25
        out, failed = one.step()
        assert [t.hashes for t in out.kv_connector_metadata.loads] == [b.block_hashes[10:13]]
        one.run()
        assert e.is_finished() and hinted(d) == 25
        one.close()
        two.close()
    finally:
        d.stop()


def test_a_failing_hint_never_fails_the_request(model_dir, monkeypatch, caplog):
    """A hint gdkvd refuses is logged at debug level and leaves the client and the request's
    load alone; gdkvd dying between an arriving request's lookup and its hint drops the client,
    and the request runs without gdkv. add_request never raises."""
    d = hint_gdkvd()
    try:
        cfg = {"socket_dir": d.dir, "timeout_ms": 2000, "retry_interval_s": 60}
        one = Instance(model_dir, cfg)
        one.add("a", PROMPT_A)
        one.run()
        two = Instance(model_dir, cfg)
        sched = two.scheduler.connector.scheduler
        client = sched.store.client()
        real = client.hint

        def refused(keys):
            raise gdkv.Error("hint: invalid field", 0x02)

        monkeypatch.setattr(client, "hint", refused)
        with caplog.at_level(logging.DEBUG, logger="gdkv"):
            b = two.add("b", PROMPT_B)
        assert [r.levelname for r in caplog.records if "hint" in r.getMessage()] == ["DEBUG"]
        assert sched.store.client() is client and sched.store.failures == 0
        assert hinted(d) == 0
        out, failed = two.step()
        assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not failed
        two.run()
        assert b.is_finished() and two.worker.stats["loaded_values"] == 10

        def dies(keys):
            d.signal(signal.SIGKILL)
            d.proc.wait()
            return real(keys)

        monkeypatch.setattr(client, "hint", dies)
        c = two.add("c", list(PROMPT_A))      # blocks 0..9 in vLLM's cache, 10..11 in gdkv
        assert d.proc.poll() is not None      # the hint ran, against a dead gdkvd
        assert sched.store.failures == 1 and sched.store.client() is None
        out, failed = two.step()
        assert out.num_scheduled_tokens == {"c": len(PROMPT_A) - 10 * BS} and not failed
        two.run()
        assert c.is_finished()
        one.close()
        two.close()
    finally:
        d.stop()


# ---- a frozen gdkvd never stalls the caller ----
def test_client_never_waits_for_a_frozen_gdkvd():
    d = Gdkvd("--backend", "memory")
    try:
        store = EngineStore({"socket_dir": d.dir, "timeout_ms": 1000, "retry_interval_s": 0})
        c = store.client()
        assert c is not None                       # the constructor waited for the first one
        d.signal(signal.SIGSTOP)
        assert store.call(lambda c: c.exists(b"k"), "down") == "down"   # times out: dropped
        slowest = 0.0
        deadline = time.monotonic() + 2.5           # connects run and time out
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            assert store.client() is None
            slowest = max(slowest, time.monotonic() - t0)
            time.sleep(0.01)
        assert slowest < 0.5, slowest               # one that waited for a connect: 1 s
        d.signal(signal.SIGCONT)
        until(lambda: store.client() is not None, "a connect after SIGCONT")
        assert store.client().exists(b"k") is False
        store.close()
    finally:
        d.stop()


def test_removals_wait_bounded_and_a_failing_feed_never_stops_the_thread(monkeypatch):
    """The removals thread of an engine that never takes its events (an idle one) keeps at most
    REMOVALS_PENDING_KEYS keys (then one None: missed); a feed that raises is a miss, and the
    thread goes on."""
    from collections import deque

    import gdkv.vllm.scheduler as sched
    monkeypatch.setattr(sched, "REMOVALS_POLL_S", 0.001)
    monkeypatch.setattr(sched, "REMOVALS_PENDING_KEYS", 100)

    class Feed:
        polls = 0

        def poll(self):
            self.polls += 1
            if self.polls == 3:
                raise KeyError("boot")
            return [b"k%d" % self.polls] * 7

    side = object.__new__(sched.SchedulerSide)
    side.removals, side.removals_pending, side.removals_lock = deque(), 0, threading.Lock()
    side.announced, side.owner, side.events = {}, {}, []
    feed = Feed()
    threading.Thread(target=side._follow, args=(feed,), daemon=True).start()
    until(lambda: feed.polls >= 5, "the feed was polled past its failure")
    until(lambda: feed.polls >= 500, "the thread polls on")
    with side.removals_lock:
        assert side.removals_pending <= 100
        assert sum(len(k) for k in side.removals if k is not None) <= 100
        assert side.removals and side.removals[0] is None   # collapsed: missed
    side.take_events()
    assert not side.removals and side.removals_pending == 0
