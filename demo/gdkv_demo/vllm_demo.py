"""A real vLLM engine serving through gdkv: ``python -m gdkv_demo.vllm_demo``.

Three vLLM OpenAI-compatible servers are started one after another on a locally built model
(random-weight Llama and a word-level tokenizer, nothing downloaded), each a fresh process with an
empty prefix cache, as a second node would be:

1. ``recompute``: no connector. Request B (``--prompt-tokens`` tokens) is prefilled in full: the
   reference tokens and logprobs, and the time to first token without gdkv.
2. ``store``: with ``gdkv.vllm.GdkvConnector``. Request A is served and its KV saved in gdkv.
3. ``reuse``: with the connector. Request B shares A's first ``--shared`` of its tokens: vLLM
   loads them from gdkv (``vllm:external_prefix_cache_hits``) and prefills only the rest.

It prints the time to first token of B with and without gdkv, the tokens found in gdkv, and
whether B's outputs in 3 are those of 1: the same tokens, and logprobs within ``--tolerance``
(1e-4). They are not bitwise equal, and cannot be: a prefill of the last tokens over cached KV runs
other kernel shapes than a prefill of all of them, so vLLM's own prefix cache moves logprobs by
about 1e-5 as well. The engine tests prove the stronger fact: with the same split, KV loaded from
gdkv gives bit for bit the logprobs of vLLM's own prefix cache (test_vllm_engine.py). Exit status 0 when tokens were reused
and the outputs are identical, 1 otherwise, 2 for usage errors.

    python -m gdkv_demo.vllm_demo --connect /run/gdkvd       # through a running gdkvd

A server is stopped with SIGTERM, once the saves its connector queued have landed
(:meth:`Server.saves_landed`): vLLM's executor may end a worker before its queued puts are done.
Every server gets one warm-up request first (a short unrelated prompt), so the times are of a warm
engine. The functions here (:func:`build_engine_model`, :class:`Server`) are also the engine
tests' (python/tests/test_vllm_engine.py).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

# The cores every engine's compute threads are pinned to (vLLM's VLLM_CPU_OMP_THREADS_BIND
# syntax: "0", "0-3", one list per rank separated by "|"); $GDKV_ENGINE_CPUS overrides.
ENGINE_CPUS = os.environ.get("GDKV_ENGINE_CPUS", "0")
DEFAULT_MODEL = os.environ.get(
    "GDKV_ENGINE_MODEL_DIR", str(Path.home() / ".cache" / "gdkv" / "models" / "llama-engine"))


def build_engine_model(path: str, **build: Any) -> str:
    """A model folder vLLM serves: gdkv_demo.model's random-weight Llama and its tokenizer."""
    from . import model as m

    vocab = build.setdefault("vocab", 8192)
    m.build_model(path, **build)
    m.build_tokenizer(path, vocab=vocab)
    return path


def connector_config(extra: dict, kv_role: str = "kv_both") -> str:
    """vLLM's --kv-transfer-config for GdkvConnector with ``extra`` as its extra config."""
    return json.dumps({"kv_connector": "GdkvConnector", "kv_connector_module_path": "gdkv.vllm",
                       "kv_role": kv_role, "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": extra})


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``vllm.entrypoints.openai.api_server`` child process on 127.0.0.1.

    ``kv`` is the connector's extra config (None: no connector), ``kv_role`` its role. ``args``
    are more server flags (``--max-num-batched-tokens 512``...). The server's log is
    ``self.log_path``; its workers' connector counters are at ``$GDKV_VLLM_STATS`` (from ``env``,
    else a file in the log directory), read by :meth:`worker_stats`."""

    def __init__(self, model: str, kv: Optional[dict] = None, *, dtype: str = "float32",
                 max_model_len: int = 8192, kv_cache_gib: int = 1, args: tuple = (),
                 env: Optional[dict] = None, log_dir: Optional[str] = None,
                 start_timeout_s: float = 600, kv_role: str = "kv_both"):
        self.model = model
        self.port = free_port()
        log_dir = log_dir or tempfile.mkdtemp(prefix="gdkv-vllm-")
        self.log_path = Path(log_dir) / f"vllm-{self.port}.log"
        # -P: the caller's working directory (a source tree, say) is not on the path.
        cmd = [sys.executable, "-P", "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager",
               "--seed", "0", *args]
        if kv is not None:
            cmd += ["--kv-transfer-config", connector_config(kv, kv_role)]
        e = dict(os.environ)
        # vLLM sets this in a process that starts its engine (a test that built one in-process,
        # say) and then sums its counters with every engine given the same directory: each
        # server gets a directory of its own from vLLM instead.
        e.pop("PROMETHEUS_MULTIPROC_DIR", None)
        # VLLM_SERVER_DEV_MODE: POST /reset_prefix_cache (reset_prefix_cache below).
        e.update({"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "HF_HUB_OFFLINE": "1",
                  "VLLM_SERVER_DEV_MODE": "1",
                  "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                  "DO_NOT_TRACK": "1", "VLLM_LOGGING_LEVEL": e.get("VLLM_LOGGING_LEVEL", "INFO")})
        # Every engine computes on the same pinned cores, with or without a connector: left to
        # itself (VLLM_CPU_OMP_THREADS_BIND=auto) vLLM's CPU platform reserves one more core for
        # an engine with a KV connector, and on a 2-core machine then computes on both cores
        # instead of one, which made a with/without comparison about 1.8x too kind to gdkv.
        e.setdefault("VLLM_CPU_OMP_THREADS_BIND", ENGINE_CPUS)
        e.update(env or {})
        if kv is not None:
            e.setdefault("GDKV_VLLM_STATS", str(Path(log_dir) / f"stats-{self.port}"))
        self.stats_path = e.get("GDKV_VLLM_STATS")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=e,
                                     start_new_session=True)
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if self._request("GET", "/health", None, 2)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vLLM did not start in {start_timeout_s} s:\n{self.tail()}")
            time.sleep(0.5)

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def _request(self, method: str, path: str, body: Optional[dict], timeout: float):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, json.dumps(body) if body is not None else None,
                         {"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def complete(self, prompt: list[int], max_tokens: int = 16, timeout: float = 600, *,
                 model: str = "m", **fields: Any) -> dict:
        """A greedy streamed completion of token ids ``prompt``: its time to first token
        (``ttft_s``) and to the last (``total_s``), the generated token ids and their logprobs.
        ``model`` names the served model or a LoRA adapter; ``fields`` are more request fields
        (``cache_salt="..."``)."""
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True,
                "stream": True, **fields}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        tokens: list[int] = []
        logprobs: list[float] = []
        ttft = None
        try:
            t0 = time.perf_counter()
            conn.request("POST", "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json"})
            r = conn.getresponse()
            if r.status != 200:
                raise RuntimeError(f"completion failed ({r.status}): {r.read()[:500]!r}")
            for line in r:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"completion failed: {chunk['error']}")
                lp = chunk["choices"][0].get("logprobs") or {}
                got = lp.get("tokens") or []
                if got and ttft is None:
                    ttft = time.perf_counter() - t0
                tokens += [int(t.removeprefix("token_id:")) for t in got]
                logprobs += [float(x) for x in lp.get("token_logprobs") or []]
        finally:
            conn.close()
        return {"ttft_s": ttft, "total_s": time.perf_counter() - t0, "tokens": tokens,
                "logprobs": logprobs}

    def chat(self, content: list, max_tokens: int = 16, timeout: float = 600,
             **fields: Any) -> dict:
        """A greedy chat completion of one user message, ``content`` its OpenAI content parts
        (``{"type": "text", ...}``, ``{"type": "image_url", ...}``): the generated token ids,
        their logprobs and the prompt's length in tokens."""
        body = {"model": "m", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "logprobs": True, "return_tokens_as_token_ids": True,
                "messages": [{"role": "user", "content": content}], **fields}
        status, raw = self._request("POST", "/v1/chat/completions", body, timeout)
        if status != 200:
            raise RuntimeError(f"chat completion failed ({status}): {raw[:500]!r}")
        reply = json.loads(raw)
        parts = reply["choices"][0]["logprobs"]["content"]
        return {"tokens": [int(p["token"].removeprefix("token_id:")) for p in parts],
                "logprobs": [float(p["logprob"]) for p in parts],
                "prompt_tokens": reply["usage"]["prompt_tokens"]}

    def worker_stats(self) -> list[dict]:
        """Each worker's connector counters (gdkv.vllm's WorkerSide.stats), by rank, as it last
        wrote them; a worker writes them once it has queued, saved or loaded values."""
        if not self.stats_path:
            return []
        out, path = [], Path(self.stats_path)
        for f in path.parent.glob(path.name + ".rank*.json"):
            try:
                out.append(json.loads(f.read_text()))
            except (OSError, ValueError):   # written by rename: only a file being replaced
                continue
        return sorted(out, key=lambda s: s.get("rank", 0))

    def saves_landed(self, timeout_s: float = 60) -> list[dict]:
        """Waits until no worker has a save queued: the connector puts a step's values on a
        thread of its own, so a response can come before its KV is in gdkv. Returns the workers'
        counters; raises RuntimeError when saves are still queued after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.worker_stats()
            if not any(s.get("saves_queued", 0) for s in stats):
                return stats
            if time.monotonic() > deadline:
                raise RuntimeError(f"saves still queued after {timeout_s} s: {stats}")
            time.sleep(0.05)

    def reset_prefix_cache(self) -> None:
        """Empties vLLM's own prefix cache (not gdkv), once the connector's queued saves have
        landed: the next request starts cold in vLLM, and finds in gdkv what this engine
        computed."""
        self.saves_landed()
        status, body = self._request("POST", "/reset_prefix_cache", None, 60)
        if status != 200:
            raise RuntimeError(f"reset_prefix_cache failed ({status}): {body[:300]!r}")

    def metric(self, name: str) -> float:
        """The sum of a Prometheus metric's samples on /metrics (0 when absent)."""
        _, text = self._request("GET", "/metrics", None, 30)
        total = 0.0
        for line in text.decode().splitlines():
            if line.startswith(name) and (line[len(name)] in "{ "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def prompts(n: int, shared: int, vocab: int, seed: int = 1) -> tuple[list[int], list[int]]:
    """Prompt A (n token ids) and prompt B (A's first ``shared`` ids, then others)."""
    import random

    rng = random.Random(seed)
    a = [rng.randrange(3, vocab) for _ in range(n)]
    tail = random.Random(seed + 1_000_003)
    return a, a[:shared] + [tail.randrange(3, vocab) for _ in range(n - shared)]


def memcpy_seconds(nbytes: int, value_bytes: int) -> float:
    """The best of 5 copies of ``nbytes`` (in values of ``value_bytes``) between numpy arrays:
    the reference for the engine-side load, measured in the same run."""
    import numpy as np

    n = max(1, nbytes // max(1, value_bytes))
    src = np.ones((n, value_bytes), np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(n):
            dst[i] = src[i]
        best = min(best, time.perf_counter() - t0)
    return best


def compare(out: dict, reference: dict, tolerance: float) -> dict:
    """Generated tokens and logprobs of two completions of one prompt."""
    diffs = [abs(x - y) for x, y in zip(out["logprobs"], reference["logprobs"])]
    largest = max(diffs) if diffs and len(out["logprobs"]) == len(reference["logprobs"]) else \
        float("inf")
    return {"tokens_identical": bool(out["tokens"]) and out["tokens"] == reference["tokens"],
            "logprobs_identical": out["logprobs"] == reference["logprobs"],
            "logprobs_match": largest <= tolerance, "max_logprob_difference": largest}


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m gdkv_demo.vllm_demo",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # Through gdkvd only: vLLM runs its scheduler and its worker in two processes (on this CPU
    # too), so an in-process controller would be two stores (docs/integrations.md).
    p.add_argument("--connect", metavar="DIR", required=True,
                   help="the socket directory of a running gdkvd")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model folder (default {DEFAULT_MODEL})")
    p.add_argument("--prompt-tokens", type=int, default=4096, help="tokens in each prompt (4096)")
    p.add_argument("--shared", type=float, default=0.9,
                   help="the share of B's prompt that is A's prefix (0.9)")
    p.add_argument("--steps", type=int, default=16, help="tokens generated per request (16)")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="largest logprob difference accepted against the recompute (1e-4)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    a = p.parse_args(argv)
    if not 0 < a.shared < 1 or a.prompt_tokens < 64:
        p.error("--shared must be in (0, 1) and --prompt-tokens at least 64")
    return a


def main(argv=None) -> int:
    a = _args(argv)
    build_engine_model(a.model, max_positions=max(8192, a.prompt_tokens + a.steps + 64))
    kv = {"socket_dir": a.connect}
    vocab = 8192
    prompt_a, prompt_b = prompts(a.prompt_tokens, int(a.prompt_tokens * a.shared), vocab)
    warm = prompts(64, 32, vocab, seed=7)[0]
    max_len = a.prompt_tokens + a.steps + 64
    log_dir = tempfile.mkdtemp(prefix="gdkv-vllm-demo-")
    out: dict[str, Any] = {"prompt_tokens": a.prompt_tokens, "shared_tokens": int(
        a.prompt_tokens * a.shared), "logs": log_dir}

    def phase(name, connector, prompt, stats=None):
        t0 = time.perf_counter()
        env = {"GDKV_VLLM_STATS": stats} if stats else None
        with Server(a.model, connector, max_model_len=max_len, log_dir=log_dir, env=env) as s:
            start_s = time.perf_counter() - t0
            s.complete(warm, 2)
            r = s.complete(prompt, a.steps)
            s.saves_landed()
            r["external_tokens"] = s.metric("vllm:external_prefix_cache_hits_total")
            r["start_s"] = start_s
        print(f"  {name}: engine up in {start_s:.0f} s, TTFT {r['ttft_s'] * 1e3:.0f} ms, "
              f"{int(r['external_tokens'])} prompt tokens from gdkv", file=sys.stderr)
        return r

    print("vLLM through gdkv (three engine processes, one after another):", file=sys.stderr)
    recompute = phase("recompute (no connector), request B", None, prompt_b)
    stored = phase("store (connector), request A", kv, prompt_a)
    stats = os.path.join(log_dir, "reuse-stats")
    reuse = phase("reuse (connector, fresh engine), request B", kv, prompt_b, stats)
    with open(stats + ".rank0.json") as f:   # the worker's counters, written at its shutdown
        worker = json.load(f)
    load_s, loaded = worker["load_s"], worker["loaded_bytes"]
    copy_s = memcpy_seconds(loaded, worker["value_bytes"])
    same = compare(reuse, recompute, a.tolerance)
    reused = int(reuse["external_tokens"])
    out.update({
        "ttft_recompute_s": recompute["ttft_s"], "ttft_gdkv_s": reuse["ttft_s"],
        "speedup": recompute["ttft_s"] / reuse["ttft_s"], "tokens_from_gdkv": reused,
        **same, "tokens": reuse["tokens"], "ttft_store_s": stored["ttft_s"],
        "load_s": load_s, "loaded_bytes": loaded, "memcpy_s": copy_s,
        "load_vs_memcpy": copy_s / load_s if load_s else 0.0})
    if a.json:
        print(json.dumps(out))
    else:
        print(f"request B: {a.prompt_tokens} prompt tokens, {out['shared_tokens']} shared with A")
        print(f"  TTFT without gdkv  {recompute['ttft_s'] * 1e3:8.0f} ms")
        print(f"  TTFT with gdkv     {reuse['ttft_s'] * 1e3:8.0f} ms  "
              f"({out['speedup']:.2f}x), {reused} prompt tokens loaded from gdkv")
        print(f"  engine-side load: {loaded / 2**20:.1f} MiB in {load_s * 1e3:.1f} ms, "
              f"{out['load_vs_memcpy']:.2f} of a memcpy of the same bytes "
              f"({copy_s * 1e3:.1f} ms)")
        print(f"  output tokens identical to the recompute: {same['tokens_identical']}; "
              f"logprobs within {a.tolerance:g}: {same['logprobs_match']} (largest difference "
              f"{same['max_logprob_difference']:.3g})")
    ok = reused > 0 and same["tokens_identical"] and same["logprobs_match"]
    if not ok:
        print("FAILED: " + ("nothing was reused" if reused == 0 else
                            "the output with gdkv differs from the recompute"), file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
