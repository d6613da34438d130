"""Fixtures: clients of every kind, and a real gdkvd child process.

The gdkvd binary comes from the C++ build: $GDKV_BUILD_DIR (scripts/test sets it), else
build/release at the top of the repository. RADOS tests need $GDKV_CEPH_CONF (scripts/test
starts a cluster and sets it).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

import gdkv

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("GDKV_BUILD_DIR", ROOT / "build" / "release"))
GDKVD = BUILD / "tools" / "gdkvd" / "gdkvd"
CEPH_CONF = os.environ.get("GDKV_CEPH_CONF", "")

sys.path.insert(0, str(ROOT / "bench" / "python"))
# The demos and the model builder (demo/gdkv_demo, not installed): for this process and the
# processes the tests start.
sys.path.insert(0, str(ROOT / "demo"))
import gdkv_demo  # noqa: E402

os.environ["PYTHONPATH"] = gdkv_demo.child_env()["PYTHONPATH"]
import gdkvd_proc  # noqa: E402  (one gdkvd process class for the tests and the benchmarks)


class Gdkvd(gdkvd_proc.Gdkvd):
    """A gdkvd child process with one reactor, serving a temporary socket directory: the
    benchmarks' Gdkvd (bench/python/gdkvd_proc.py), whose start() starts it again there after
    kill()."""

    def __init__(self, *args: str, **kw):
        kw.setdefault("prefix", "gdkvd-py-")
        super().__init__("--reactors", "1", *args, binary=GDKVD, **kw)


def until(cond, what: str, timeout_s: float = 10.0) -> None:
    """Waits until ``cond()`` is true: for a state the test needs (a reconnect, a thread's
    progress), not for a time guessed to be enough. Fails the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout_s} s: {what}")
        time.sleep(0.01)


@pytest.fixture
def gdkvd():
    d = Gdkvd("--backend", "memory")
    yield d
    d.stop()


@pytest.fixture
def gdkvd_local(tmp_path):
    d = Gdkvd("--backend", "local", "--store", str(tmp_path / "store"), "--capacity",
              str(256 << 20))
    yield d
    d.stop()


def hint_gdkvd() -> Gdkvd:
    """A gdkvd with a DRAM cache (the target of scheduler hints) and /metrics."""
    return Gdkvd("--backend", "memory", "--cache-bytes", str(64 << 20), metrics=True)


def hinted(d: Gdkvd) -> float:
    """The keys gdkvd's cache has been hinted."""
    return d.metrics()["gdkv_cache_hint_keys_total"]


def record_hints(client, monkeypatch) -> list:
    """The key lists client.hint is given (each still goes to gdkv)."""
    calls: list = []
    real = client.hint

    def hint(keys):
        keys = list(keys)
        calls.append(keys)
        return real(keys)

    monkeypatch.setattr(client, "hint", hint)
    return calls


def open_kind(kind: str, tmp_path: Path, gdkvd_factory):
    """A client of one kind: memory/local in-process, or through a gdkvd."""
    if kind == "memory":
        return gdkv.open("memory")
    if kind == "local":
        return gdkv.open("local", store=str(tmp_path / "store"), capacity=256 << 20)
    if kind == "gdkvd":
        return gdkv.connect(gdkvd_factory().dir)
    raise ValueError(kind)


@pytest.fixture(params=["memory", "local", "gdkvd"])
def client(request, tmp_path):
    daemons = []

    def factory():
        d = Gdkvd("--backend", "memory")
        daemons.append(d)
        return d

    c = open_kind(request.param, tmp_path, factory)
    yield c
    c.close()
    for d in daemons:
        d.stop()


def require_ceph() -> str:
    """The cluster's ceph.conf. scripts/test sets GDKV_REQUIRE_CEPH=1: a missing cluster fails."""
    if not CEPH_CONF:
        if os.environ.get("GDKV_REQUIRE_CEPH") == "1":
            pytest.fail("GDKV_REQUIRE_CEPH=1 but GDKV_CEPH_CONF is not set")
        pytest.skip("no Ceph cluster: GDKV_CEPH_CONF is not set (scripts/test starts one)")
    return CEPH_CONF


def fail_for(client, monkeypatch, method: str, bad: bytes, err: gdkv.Error | None = None):
    """client.<method> (put_many, get_many_into, exists_many, lookup) fails for ``bad`` as a
    backend failing one key does: that key's result is ``err`` (default a gdkv.Error, 06h),
    every other key's is its own (a put of ``bad`` stores nothing; a lookup's run ends at
    ``bad``, with its error)."""
    real = getattr(client, method)
    if err is None:
        err = gdkv.Error(f"{method} {bad!r}: checksum mismatch", 0x06, bad)

    def wrapper(first, *args, **kw):
        items = list(first)
        keys = [k for k, _ in items] if method == "put_many" else items
        if bad not in keys:
            return real(items, *args, **kw)
        at = keys.index(bad)
        if method == "lookup":
            n, e = real(keys[:at])
            return (n, e) if n < at else (at, err)
        if method == "put_many":
            res = real(items[:at] + items[at + 1:], *args, **kw)
            return res[:at] + [err] + res[at:]
        res = real(items, *args, **kw)
        return res[:at] + [err] + res[at + 1:]

    monkeypatch.setattr(client, method, wrapper)
