"""The serving benchmark (bench/serving/serve_bench.py).

Short runs on the real vLLM engine: gdkv through gdkvd with gdkvd SIGKILLed and restarted in the
middle of the run; two engines on two network-namespace hosts over one RADOS pool, with an OSD
killed and a link cut; prefill/decode disaggregation through gdkv on one node and across the two
hosts. Every run serves the same workload (four users, three turns each, on two concurrent
streaming clients), and its outputs are compared token by token with one run of vLLM alone
(``--save-reference``, ``--reference``). Faults are made once a number of requests have finished,
not at a time, so that they fall inside the run on a machine of any speed. Reuse must happen, no
request may fail, every fault must be made and the store must serve again after it. Figures are
benchmarks, recorded in docs/serving.md, not judged here.

The bench's own logic (P/D TTFT, the outputs' comparison, the limit's checks, the flag on results
below the limit) runs here on stand-in engines, and the connector's counters on vLLM's scheduler
(vllm_instance.Instance).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench" / "serving"))
import serve_bench as sb  # noqa: E402

# Every real run's workload: 12 requests. Its vLLM alone outputs are the reference of each.
WORKLOAD = ("--users", "4", "--turns", "3", "--doc-tokens", "256", "--answer-tokens", "8")
REQUESTS = 12
# The connector reconnects at once after a failure (its default waits 5 s): the store serves
# again with the next request, however fast the run is.
RECONNECT = ("--gdkv-extra", '{"retry_interval_s": 0}')


# ---- the bench on stand-in engines ---------------------------------------------------------------
class FakeEngine:
    """Answers a prompt at once: output tokens a function of the prompt (plus ``shift``), TTFT
    ``ttft_s``, after ``sleep_s``; ``metrics`` are its Prometheus counters."""

    def __init__(self, ttft_s: float = 0.01, sleep_s: float = 0.0, shift: int = 0,
                 metrics: dict | None = None):
        self.ttft_s, self.sleep_s, self.shift = ttft_s, sleep_s, shift
        self.metrics = metrics or {}
        self.prompts: list[int] = []

    def complete(self, prompt: list[int], max_tokens: int = 16, timeout: float = 600) -> dict:
        time.sleep(self.sleep_s)
        self.prompts.append(len(prompt))
        first = (sum(prompt) + self.shift) % sb.VOCAB
        return {"ttft_s": self.ttft_s, "total_s": self.ttft_s + 0.001 * max_tokens,
                "tokens": [(first + i) % sb.VOCAB for i in range(max_tokens)]}

    def metric(self, name: str) -> float:
        return self.metrics.get(name, 0.0)


HOLDS_ALL = {"vllm:prefix_cache_hits_total": 1e9}   # a limit engine whose cache hit everything


def fake_bench(monkeypatch, capsys, tmp_path, engines: dict, *args: str) -> tuple[int, dict, str]:
    """serve_bench's main() with ``args`` on a small workload (3 users, 2 turns), each system's
    engines made by ``engines[name]()``; returns its exit status, its systems' results and its
    output."""

    @contextlib.contextmanager
    def system(name, a, work, net):
        yield sb.System(name, engines[name](), [], None)

    monkeypatch.setattr(sb, "system", system)
    monkeypatch.setattr(sb, "build_engine_model", lambda *a, **kw: None)
    monkeypatch.setattr(sb.tempfile, "mkdtemp", lambda **kw: str(tmp_path))
    monkeypatch.setattr(sys, "argv", [
        "serve_bench.py", "--users", "3", "--turns", "2", "--doc-tokens", "256",
        "--answer-tokens", "4", "--model", str(tmp_path / "model"), "--json", *args])
    rc = sb.main()
    out = capsys.readouterr().out
    return rc, json.loads(out.strip().splitlines()[-1])["systems"], out


def test_pd_ttft_includes_the_prefill_hop(monkeypatch, capsys, tmp_path):
    """With --pd a request's TTFT runs from sending it to the prefill engine to the first token
    from the decode engine, not the decode engine's alone."""
    two = lambda: [FakeEngine(sleep_s=0.2), FakeEngine(ttft_s=0.01)]   # noqa: E731
    rc, r, _ = fake_bench(monkeypatch, capsys, tmp_path, {"vllm": two, "gdkv": two},
                          "--systems", "vllm,gdkv", "--engines", "2", "--pd")
    assert rc == 0
    for s in r.values():
        assert s["ttft_p50_s"] >= 0.2 and s["ttft_p99_s"] >= 0.2, s
        assert s["decode_ttft_p50_s"] == 0.01, s
        assert s["tpot_mean_s"] == pytest.approx(0.004 / 3), s   # the hop is not a TPOT


def test_outputs_compared_whatever_the_order_of_the_systems(monkeypatch, capsys, tmp_path):
    same = lambda: [FakeEngine()]   # noqa: E731
    rc, r, _ = fake_bench(monkeypatch, capsys, tmp_path, {"vllm": same, "gdkv": same},
                          "--systems", "gdkv,vllm")
    assert rc == 0 and (r["gdkv"]["identical"], r["gdkv"].get("compared")) == (6, 6), r["gdkv"]

    other = lambda: [FakeEngine(shift=1)]   # noqa: E731
    rc, r, out = fake_bench(monkeypatch, capsys, tmp_path, {"vllm": same, "gdkv": other},
                            "--systems", "gdkv,vllm")
    assert rc == 1 and r["gdkv"]["identical"] == 0 and r["gdkv"]["compared"] == 6, out


def test_a_limit_too_small_for_the_workload_is_refused_before_it_starts(
        monkeypatch, capsys, tmp_path):
    started = lambda: pytest.fail("engines started")   # noqa: E731
    with pytest.raises(SystemExit) as e:
        fake_bench(monkeypatch, capsys, tmp_path, {"vllm": started, "limit": started},
                   "--systems", "vllm,limit", "--users", "40", "--doc-tokens", "1536")
    assert e.value.code == 2
    assert "--limit-blocks 400 cannot hold this workload's histories" in capsys.readouterr().err


def test_blocks_needed_is_what_the_engine_takes():
    """Multi-round QA, one engine: a user's first turn takes its prompt's blocks, each later turn
    the blocks past the history the turn before left (its full blocks are hit)."""
    a = sb.argparse.Namespace(workload="qa", users=2, turns=2, doc_tokens=250,
                              question_tokens=6, answer_tokens=4, concurrency=1, rate=0.0,
                              engines=1, pd=False, seed=1)
    # Turn 0: 256 prompt tokens + 3 computed answer tokens: 3 blocks (2 full).
    # Turn 1: 260 + 6 prompt tokens + 3: 3 blocks, 2 of them hit.
    assert sb.kv_blocks_needed(a) == [1 + 2 * (3 + 1)]
    a.pd, a.engines = True, 2   # the prefill engine computes prompts only
    assert sb.kv_blocks_needed(a) == [1 + 2 * (2 + 1), 1 + 2 * (3 + 1)]


def test_a_limit_that_did_not_hold_the_histories_fails_the_run(monkeypatch, capsys, tmp_path):
    """The limit engine's own prefix cache must have hit every reused turn's history: one whose
    metrics show fewer hits (it evicted) fails the run."""
    rc, r, out = fake_bench(monkeypatch, capsys, tmp_path,
                            {"vllm": lambda: [FakeEngine()], "limit": lambda: [FakeEngine()]},
                            "--systems", "vllm,limit", "--doc-tokens", "512")
    assert rc == 1 and r["limit"]["limit_held"] is False, out
    # 3 users' second turns, each over a history of 4 full blocks.
    assert r["limit"]["limit_hits"] == {"0": {"hit_tokens": 0, "holding_everything": 3 * 512}}
    assert "NOT THE LIMIT" in out

    rc, r, out = fake_bench(monkeypatch, capsys, tmp_path,
                            {"vllm": lambda: [FakeEngine()],
                             "limit": lambda: [FakeEngine(metrics=HOLDS_ALL)]},
                            "--systems", "vllm,limit", "--doc-tokens", "512")
    assert rc == 0 and r["limit"]["limit_held"] is True, out


def test_reused_turns_faster_than_the_limit_are_flagged(monkeypatch, capsys, tmp_path):
    """A store cannot serve a reused turn faster than the engine's own prefix cache: a result
    below the limit is flagged, not reported as a gain."""
    rc, r, out = fake_bench(monkeypatch, capsys, tmp_path, {
        "vllm": lambda: [FakeEngine(ttft_s=1.0)],
        "limit": lambda: [FakeEngine(ttft_s=0.5, metrics=HOLDS_ALL)],
        "gdkv": lambda: [FakeEngine(ttft_s=0.3)],
        "gdkv-sync": lambda: [FakeEngine(ttft_s=0.55)]},
        "--systems", "vllm,limit,gdkv,gdkv-sync")
    assert "gdkv 0.60 (BELOW THE LIMIT)" in out and "below the limit (gdkv): not a gain" in out
    assert "gdkv-sync 1.10 (BELOW" not in out
    assert r["gdkv"]["below_limit"] is True and r["gdkv-sync"]["below_limit"] is False
    assert rc == 0   # a flag, not a failure


# ---- the connector's counters ------------------------------------------------------------------
def test_connector_counts_loads_and_saves_in_values_and_blocks(tmp_path):
    """loaded_values and saved_values count gdkv values (one per KV head here), loaded_blocks
    and saved_blocks the blocks they hold: the same unit for loads and saves."""
    pytest.importorskip("vllm")
    from vllm_instance import BS, Instance, llama_dir

    model = llama_dir(tmp_path / "llama", layers=2, kv_heads=2, head_dim=32)
    cfg = {"backend": "memory", "namespace": str(tmp_path)}
    prompt = list(range(100, 100 + 12 * BS + 5))   # 12 full blocks
    one = Instance(model, cfg, "LBHNC")   # heads outside a block's tokens: a value per head
    assert len(one.worker.slots) == 2
    one.add("a", prompt)
    one.run()
    two = Instance(model, cfg, "LBHNC")
    two.add("b", prompt)
    two.run()
    saved, loaded = one.worker.stats, two.worker.stats
    assert (loaded["loaded_values"], saved["saved_values"]) == (24, 24)
    assert (loaded["loaded_blocks"], saved["saved_blocks"]) == (12, 12)
    assert loaded["failed_values"] == loaded["failed_blocks"] == 0
    one.close()
    two.close()


# ---- short runs on the real engine -------------------------------------------------------------
def serve_bench(work, *args: str, systems: tuple[str, ...]) -> tuple[dict, str]:
    """Runs serve_bench.py on WORKLOAD with ``args`` (the model in ``work``); requires exit 0 and
    every one of ``systems`` to have served REQUESTS requests; returns the systems' results and
    the output. Tiered systems run on the bench's own network-namespace hosts, not on the
    cluster scripts/test names in $GDKV_CEPH_CONF (that one has no hosts to cut off)."""
    env = {k: v for k, v in os.environ.items() if k != "GDKV_CEPH_CONF"}
    out = subprocess.run(
        [sys.executable, "-P", str(ROOT / "bench" / "serving" / "serve_bench.py"), *WORKLOAD,
         *args, "--model", str(work / "model"), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900, env=env)
    text = out.stdout.decode(errors="replace")
    assert out.returncode == 0, text[-4000:]
    r = json.loads(text.strip().splitlines()[-1])["systems"]
    for name in systems:
        assert r[name]["requests"] == REQUESTS and r[name]["failed"] == 0, (name, text[-3000:])
        if name != "vllm":
            assert r[name]["identical"] == r[name]["compared"] == REQUESTS, (name, text[-3000:])
    return r, text


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """vLLM alone's outputs of WORKLOAD, and the folder of the model every run serves."""
    work = tmp_path_factory.mktemp("serving")
    serve_bench(work, "--systems", "vllm", "--save-reference", str(work / "reference.json"),
                systems=("vllm",))
    return work


def values_per_block(work) -> int:
    """gdkv values a block of the engine model has (one per KV head, every layer in one)."""
    return json.loads((work / "model" / "config.json").read_text())["num_key_value_heads"]


def needs_netns_and_ceph() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("ceph-mon") is None:
        pytest.skip("needs root, iproute2 and Ceph's daemons (scripts/test installs them)")


def test_short_serving_run_reuses_kv_and_survives_a_gdkvd_kill(reference):
    """gdkv on an engine whose KV space (6 blocks) holds one history: reused turns load from
    gdkvd. gdkvd is SIGKILLed once 6 requests have finished (every user's first turn saved)
    and started again on its store: no request fails, and the store serves again."""
    r, text = serve_bench(reference, "--systems", "gdkv", "--kv-blocks", "6",
                          "--reference", str(reference / "reference.json"),
                          "--kill-gdkvd-at", "6req", *RECONNECT, systems=("gdkv",))
    gdkv = r["gdkv"]
    assert gdkv["tokens_from_store"] > 0
    (kill,) = gdkv["faults"]
    assert kill["fault"] == "gdkvd-kill" and 6 <= kill["at_requests"] < REQUESTS, kill
    assert "back_to_full_speed_s" in kill, text[-2000:]   # loaded from the store after it


def test_two_hosts_over_rados_survive_an_osd_kill_and_a_cut_link(reference):
    """Two engines, each with its own tiered gdkvd in a network-namespace host over one RADOS
    pool, a user's turns alternating between them: each engine loads what the other saved
    (through RADOS). OSD 1 is killed once 3 requests have finished, and the second host's link
    cut from 5 finished requests until 2 more have: no request fails, every output equals vLLM
    alone's, and RADOS serves again after the OSD kill. (The cut host reads from RADOS again
    only once Ceph's client has reconnected, seconds after the link is back, which a run this
    short may end before.)"""
    needs_netns_and_ceph()
    r, text = serve_bench(reference, "--systems", "gdkv-tiered", "--engines", "2",
                          "--kv-blocks", "12", "--reference", str(reference / "reference.json"),
                          "--kill-osd-at", "3req", "--cut-link-at", "5req", "--cut-for", "2req",
                          *RECONNECT, "--netns-prefix", "gdkvst", "--netns-subnet", "10.79.0",
                          systems=("gdkv-tiered",))
    t = r["gdkv-tiered"]
    assert t["tokens_from_store"] > 0
    faults = {f["fault"]: f for f in t["faults"]}
    assert sorted(faults) == ["link-cut", "osd-kill"], text[-2000:]
    assert faults["osd-kill"]["at_requests"] >= 3 and faults["link-cut"]["at_requests"] >= 5
    assert faults["link-cut"]["end_requests"] >= faults["link-cut"]["at_requests"] + 2
    assert "back_to_full_speed_s" in faults["osd-kill"], text[-2000:]
    assert set(t["per_engine"]) == {"0", "1"}
    # Each engine served turns whose earlier turns the other engine saved: its gdkvd read them
    # from RADOS, not from its own local tier.
    assert t["connector"]["loaded_values"] > 0
    assert len(t["far_reads"]) == 2 and min(t["far_reads"]) > 0, t["far_reads"]


def test_prefill_decode_disaggregation_through_gdkv(reference):
    """Prefill on one engine (kv_producer), then the request on another (kv_consumer): the
    decode engine has every full block of each prompt before it computes (from gdkv, or its own
    prefix cache), through one gdkvd on the local store and across two network-namespace hosts
    over RADOS; outputs equal vLLM alone's. The connector's blocks are the engine's: the decode
    engine's store hits are the blocks its connector loaded."""
    needs_netns_and_ceph()
    r, text = serve_bench(reference, "--systems", "gdkv,gdkv-tiered", "--engines", "2", "--pd",
                          "--kv-blocks", "12", "--reference", str(reference / "reference.json"),
                          "--netns-prefix", "gdkvsp", "--netns-subnet", "10.80.0",
                          systems=("gdkv", "gdkv-tiered"))
    per_block = values_per_block(reference)
    for name in ("gdkv", "gdkv-tiered"):
        s = r[name]
        prefill, decode = s["engine_per_engine"]
        assert prefill["store_hit_tokens"] == 0, name          # a producer never loads
        assert decode["store_hit_tokens"] > 0, name
        # Every full block of every prompt (but the last token's) was the decode engine's
        # before it computed: loaded from gdkv or held by its own prefix cache.
        need = s["prompt_block_tokens"][1]
        assert decode["local_hit_tokens"] + decode["store_hit_tokens"] >= need, (name, decode)
        c = s["connector"]
        assert c["failed_values"] == 0 and c["saved_blocks"] > 0, (name, c)
        assert c["loaded_blocks"] * sb.BLOCK == decode["store_hit_tokens"], (name, c, decode)
        assert c["loaded_values"] == per_block * c["loaded_blocks"], (name, c)
        assert c["saved_values"] == per_block * c["saved_blocks"], (name, c)
        assert s["ttft_p50_s"] > s["decode_ttft_p50_s"], name   # the prefill hop is in it
    # The prefill host's gdkvd only wrote to RADOS; the decode host's read what it wrote.
    far = r["gdkv-tiered"]["far_reads"]
    assert far[0] == 0 and far[1] > 0, far
