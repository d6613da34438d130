"""A KV-aware router for the serving benchmark: it follows the engines' KV events and sends each
request to an engine that holds a long prefix of it.

Each engine runs with vLLM's ``--kv-events-config`` (a ZMQ publisher); the router subscribes to
all of them. vLLM's own ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events say
which blocks each engine's prefix cache holds; the gdkv connector's, medium ``GDKV``, say which
are in gdkv, where every engine can load them. Events carry each block's tokens and its parent's
hash, so the router maps a prompt to block hashes without computing vLLM's hashes itself: a block
is known by (its parent's hash, its tokens). Extra hash keys (LoRA adapters, cache salts,
images) are not looked at: the benchmark's workloads have none.

The rule: among the engines with the fewest requests in flight, the one whose own cache holds
the longest prefix of the prompt; a prefix gdkv holds counts for every engine (it can load it),
an engine's own for that engine only, and is preferred at equal length (no load at all).
"""

from __future__ import annotations

import threading
from typing import Optional


class KvRouter:
    """Routes over engines whose KV events are published at ``endpoints`` (ZMQ addresses such
    as ``tcp://127.0.0.1:5557``), ``block_size`` tokens a block."""

    def __init__(self, endpoints: list[str], block_size: int, topic: str = "kv"):
        import zmq
        self.block_size = block_size
        self.lock = threading.Lock()
        self.child: dict[tuple, object] = {}   # (parent hash, tokens) -> block hash
        self.local: list[set] = [set() for _ in endpoints]
        self.store: set = set()
        self.inflight = [0] * len(endpoints)
        self.decisions = {"own_cache": 0, "gdkv": 0, "none": 0}
        self.events = 0
        self.ctx = zmq.Context()
        self.subs = []
        for e in endpoints:
            s = self.ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, topic.encode())
            s.connect(e)
            self.subs.append(s)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._follow, name="kv-router", daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decode = msgspec.msgpack.Decoder(type=KVEventBatch)
        poller = zmq.Poller()
        for s in self.subs:
            poller.register(s, zmq.POLLIN)
        while not self.stopping.is_set():
            for sock, _ in poller.poll(100):
                frames = sock.recv_multipart()
                batch = decode.decode(frames[-1])
                with self.lock:
                    for ev in batch.events:
                        self._apply(self.subs.index(sock), ev)

    def _apply(self, engine: int, ev) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
        self.events += 1
        if isinstance(ev, AllBlocksCleared):
            self.local[engine].clear()
            return
        # gdkv's events name it as their owner (medium STORAGE or CPU, as vLLM's own tiers).
        held = self.store if getattr(ev, "ownership", None) == "gdkv" else self.local[engine]
        if isinstance(ev, BlockRemoved):
            held.difference_update(ev.block_hashes)
            return
        if not isinstance(ev, BlockStored) or ev.block_size != self.block_size:
            return
        parent = ev.parent_block_hash
        for i, h in enumerate(ev.block_hashes):
            tokens = tuple(ev.token_ids[i * self.block_size:(i + 1) * self.block_size])
            self.child[(parent, tokens)] = h
            held.add(h)
            parent = h

    def _hashes(self, prompt: list[int]) -> list:
        """The known block hashes of the prompt's leading full blocks."""
        out, parent = [], None
        for start in range(0, len(prompt) - self.block_size + 1, self.block_size):
            h = self.child.get((parent, tuple(prompt[start:start + self.block_size])))
            if h is None:
                break
            out.append(h)
            parent = h
        return out

    @staticmethod
    def _run(hashes: list, held: set) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in held:
            n += 1
        return n

    def route(self, prompt: list[int]) -> int:
        """The engine for ``prompt``; the caller reports its end with ``done``."""
        with self.lock:
            hashes = self._hashes(prompt)
            store = self._run(hashes, self.store)
            least = min(self.inflight)
            best: Optional[tuple] = None
            for i, held in enumerate(self.local):
                if self.inflight[i] != least:
                    continue
                own = self._run(hashes, held)
                rank = (max(own, store), own >= store, -i)
                if best is None or rank > best[0]:
                    best = (rank, i, own)
            (reach, _, _), engine, own = best
            self.decisions["none" if reach == 0 else "own_cache" if own >= store else
                           "gdkv"] += 1
            self.inflight[engine] += 1
            return engine

    def done(self, engine: int) -> None:
        with self.lock:
            self.inflight[engine] -= 1

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(5)
        for s in self.subs:
            s.close(0)
        self.ctx.term()
