"""bench/serving/kv_router.py's rule on events fed by hand (the serving benchmark runs it on real
engines' ZMQ events: docs/serving.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("zmq")

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "serving"))
from kv_router import KvRouter  # noqa: E402

from gdkv_demo.vllm_demo import free_port  # noqa: E402

BS = 4


def stored(hashes: list[bytes], tokens: list[int], parent=None, gdkv=False) -> BlockStored:
    """An engine's own block, or (gdkv=True) one the gdkv connector announces."""
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=BS, lora_id=None, medium="STORAGE" if gdkv else "GPU",
                       lora_name=None, **GDKV if gdkv else {})


GDKV = {"locality": "LOCAL", "ownership": "gdkv"}


@pytest.fixture
def router():
    r = KvRouter([f"tcp://127.0.0.1:{free_port()}" for _ in range(2)], BS)
    yield r
    r.close()


def test_the_longest_prefix_wins_among_the_least_busy(router):
    prompt = list(range(100, 116))                       # 4 blocks of 4 tokens
    with router.lock:
        router._apply(0, stored([b"a", b"b"], prompt[:8]))                  # engine 0: 2 blocks
        router._apply(1, stored([b"a"], prompt[:4]))                         # engine 1: 1 block
    assert router.route(prompt) == 0
    assert router.decisions == {"own_cache": 1, "gdkv": 0, "none": 0}
    # Engine 0 is busy now: engine 1 gets the next one, whatever it holds.
    assert router.route(prompt) == 1
    router.done(0)
    router.done(1)
    # gdkv holds 3 blocks: both engines can load them; engine 0's own 2 are shorter.
    with router.lock:
        router._apply(1, stored([b"c"], prompt[8:12], parent=b"b", gdkv=True))
        router._apply(0, stored([b"a", b"b"], prompt[:8], gdkv=True))
    assert router.route(prompt) == 0 and router.decisions["gdkv"] == 1
    router.done(0)
    # Removed from gdkv and cleared from engine 0: engine 1's own block decides.
    with router.lock:
        router._apply(0, BlockRemoved(block_hashes=[b"a"], medium="STORAGE", **GDKV))
        router._apply(0, AllBlocksCleared())
    assert router.route(prompt) == 1


def test_unknown_prompts_go_to_the_least_busy(router):
    assert router.route([1, 2, 3, 4, 5]) == 0
    assert router.route([1, 2, 3, 4, 5]) == 1
    assert router.decisions["none"] == 2
