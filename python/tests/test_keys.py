"""gdkv.chain_keys equals the C++ gdkv::chain_keys (pinned values shared with
tests/wire_format_test.cc), and its input checks; gdkv.engine's key salts and weights
fingerprint."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import gdkv

GOLDEN = ["fd89c484d255d92e1edd78443f19b4f0", "0007b2bf6e043ecedb83299278cdd0b4",
          "9214b2ff4ccd1303bebde69b044cffcb"]


def test_golden_values_match_cpp():
    assert [k.hex() for k in gdkv.chain_keys(range(48), 16, "gdkv-golden")] == GOLDEN
    # Any sequence of ints: lists, numpy arrays, tensors.
    assert [k.hex() for k in gdkv.chain_keys(np.arange(48), 16, b"gdkv-golden")] == GOLDEN
    assert [k.hex() for k in gdkv.chain_keys(torch.arange(48), 16, "gdkv-golden")] == GOLDEN


def test_chain_properties():
    a = list(range(100))
    b = a[:40] + [7] * 60
    ka, kb = gdkv.chain_keys(a, 16, "m"), gdkv.chain_keys(b, 16, "m")
    assert len(ka) == 6 and all(len(k) == 16 for k in ka)
    assert ka[:2] == kb[:2] and ka[2] != kb[2]
    assert gdkv.chain_keys(a, 16, "other")[0] != ka[0]
    assert gdkv.chain_keys(a[32:], 16, "m", parent=ka[1]) == ka[2:]
    assert gdkv.chain_keys(a[:15], 16, "m") == []


def test_bad_input():
    with pytest.raises(ValueError):
        gdkv.chain_keys([1, 2], 0, "m")
    with pytest.raises(ValueError):
        gdkv.chain_keys([-1] * 16, 16, "m")
    with pytest.raises(ValueError):
        gdkv.chain_keys([2 ** 32] * 16, 16, "m")
    with pytest.raises(TypeError):
        gdkv.chain_keys(["a"] * 16, 16, "m")
    with pytest.raises(TypeError):
        gdkv.chain_keys([1] * 16, 16, 5)
    with pytest.raises(ValueError):
        gdkv.chain_keys([1] * 16, 16, "m", parent=b"")


def test_hash128():
    assert len(gdkv.hash128(b"abc")) == 16
    assert gdkv.hash128(b"abc") == gdkv.hash128(bytearray(b"abc"))
    assert gdkv.hash128(b"abc") != gdkv.hash128(b"abd")
    with pytest.raises(TypeError):
        gdkv.hash128("text")


def test_errors_are_a_hierarchy():
    assert issubclass(gdkv.KeyNotFoundError, KeyError)
    assert issubclass(gdkv.InvalidKeyError, ValueError)
    assert issubclass(gdkv.TimeoutError, TimeoutError)
    for e in (gdkv.KeyNotFoundError, gdkv.CapacityError, gdkv.TimeoutError, gdkv.ConnectionError,
              gdkv.NotReadyError, gdkv.ValueSizeError, gdkv.KeyExistsError, gdkv.ClosedError):
        assert issubclass(e, gdkv.Error)
    for f in (gdkv.open, gdkv.connect, gdkv.chain_keys, gdkv.Client.get_into,
              gdkv.Client.lookup_prefix):
        assert ">>>" in f.__doc__  # the docstrings show a call


# ---- gdkv.engine: key salts and the weights fingerprint ----
def test_keyspace_fields_cannot_run_into_each_other():
    from gdkv.engine import KeySpace
    a = KeySpace("e", "a/b", "c", "l", "ns")
    b = KeySpace("e", "a", "b/c", "l", "ns")
    c = KeySpace("e", "x", "l", "y", "ns/a")
    d = KeySpace("e", "a/x", "l", "y", "ns")
    assert a.salt != b.salt and c.salt != d.salt
    assert len({a.key(b"h"), b.key(b"h"), c.key(b"h"), d.key(b"h")}) == 4
    assert KeySpace("e", "a/b", "c", "l", "ns").salt == a.salt   # and stable


def test_keyspace_prefix_names_engine_and_namespace():
    """Every key of one engine and namespace starts with the space's 4-byte prefix (what
    SGLang's clear lists); other namespaces and engines have other prefixes."""
    from gdkv.engine import KeySpace
    a = KeySpace("sglang", "m1", "bf16", "l", "ns")
    b = KeySpace("sglang", "m2", "fp16", "x", "ns")    # another model: same prefix, other salt
    other_ns, other_engine = KeySpace("sglang", "m1", "bf16", "l", "ns2"), \
        KeySpace("vllm", "m1", "bf16", "l", "ns")
    assert a.prefix == b.prefix and a.salt != b.salt and len(a.prefix) == 4
    assert len({a.prefix, other_ns.prefix, other_engine.prefix}) == 3
    for ks in (a, b, other_ns, other_engine):
        keys = ks.keys([b"h1", b"h2", 7])
        assert all(len(k) == 16 and k.startswith(ks.prefix) for k in keys)
        assert len(set(keys)) == 3
    assert a.key(b"h1") != b.key(b"h1")


def test_weights_fingerprint(tmp_path, monkeypatch):
    from gdkv import fingerprint as engine
    cache = tmp_path / "cache"
    monkeypatch.setenv("GDKV_CACHE_DIR", str(cache))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert engine.weights_fingerprint("org/not-a-local-model") == ""
    assert engine.weights_fingerprint(str(model)) == ""   # no weight files
    w = model / "model.safetensors"
    w.write_bytes(b"\1" * 4096)
    one = engine.weights_fingerprint(str(model))
    assert len(one) == 32 and (cache / "weights-fingerprints.json").exists()
    w.write_bytes(b"\2" * 4096)                          # same size, other weights
    os.utime(w, ns=(1, 10 ** 18))
    two = engine.weights_fingerprint(str(model))
    assert two != one
    os.utime(w, ns=(1, 2 * 10 ** 18))                     # touched: read again, same content
    assert engine.weights_fingerprint(str(model)) == two
    (model / "extra.bin").write_bytes(b"\2" * 10)        # every weight file counts
    assert engine.weights_fingerprint(str(model)) not in (one, two)
    assert engine.weights_fingerprint(str(w)) != ""      # one file (a .gguf, say)


def test_weights_fingerprint_samples_large_files(tmp_path, monkeypatch):
    from gdkv import fingerprint as engine
    monkeypatch.setenv("GDKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(engine, "FULL_HASH_BYTES", 1 << 20)   # a "large" file: above 1 MiB
    model = tmp_path / "model"
    model.mkdir()
    w = model / "model.safetensors"
    header = b'{"w": {"dtype": "U8", "shape": [4194304], "data_offsets": [0, 4194304]}}'
    data = bytearray(len(header).to_bytes(8, "little") + header + bytes(4 << 20))
    w.write_bytes(data)
    base = engine.weights_fingerprint(str(model))
    seen = {base}
    for where in (8 + 5, 100, len(data) - 1, len(data) // 2 + 5000):  # header, edges, a sample
        changed = bytearray(data)
        changed[where] ^= 0xFF
        w.write_bytes(changed)
        os.utime(w, ns=(1, (where + 1) * 10 ** 9))
        seen.add(engine.weights_fingerprint(str(model)))
    assert len(seen) == 5
