"""The engines' key space: an engine's block hashes become 16-byte gdkv keys, salted with the
engine, the model, the KV dtype and layout and an optional namespace (:class:`KeySpace`)."""

from __future__ import annotations

import json
from typing import Any

from . import hash128


def _as_bytes(h: Any) -> bytes:
    if isinstance(h, (bytes, bytearray, memoryview)):
        return bytes(h)
    if isinstance(h, str):
        return h.encode()
    if isinstance(h, int):
        return h.to_bytes(32, "little", signed=True)
    raise TypeError(f"a block hash must be bytes, str or int, not {type(h).__name__}")


class KeySpace:
    """Engine block hashes to 16-byte gdkv keys: ``prefix || XXH3-128(salt || hash)[:12]``.

    ``salt`` is the XXH3-128 of the JSON list ``["gdkv", engine, namespace, model, dtype,
    layout]``: each field is quoted and escaped, so two different field lists never give one salt
    (``description``, ``gdkv/<engine>/<namespace>/<model>/<dtype>/<layout>``, is the readable form,
    for logs; it is not what is hashed). The engine hash already names the block's tokens and its
    whole prefix (vLLM, SGLang and LMCache chain their hashes), so the key names "this prefix's KV,
    in this engine's layout, of this model".

    ``prefix``, the first 4 bytes of every key, is the XXH3-128 of ``["gdkv", engine,
    namespace]`` (its first 4 bytes): ``client.list(prefix)`` finds one engine's keys in one
    namespace (SGLang's ``clear``), and 96 bits of hash stay for the blocks.
    """

    PREFIX_BYTES = 4

    def __init__(self, engine: str, model: str, dtype: str, layout: str, namespace: str = ""):
        fields = ["gdkv", engine, namespace, model, dtype, layout]
        self.description = "/".join(fields)
        self.salt = hash128(json.dumps(fields).encode())
        self.prefix = hash128(json.dumps(fields[:3]).encode())[: self.PREFIX_BYTES]

    def key(self, block_hash: Any) -> bytes:
        return self.prefix + hash128(self.salt + _as_bytes(block_hash))[: 16 - self.PREFIX_BYTES]

    def keys(self, block_hashes) -> list[bytes]:
        return [self.key(h) for h in block_hashes]
