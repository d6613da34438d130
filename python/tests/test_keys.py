"""gdkv.chain_keys equals the C++ gdkv::chain_keys (pinned values shared with
tests/wire_format_test.cc), and its input checks."""

from __future__ import annotations

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
