"""Fixtures: clients of every kind, and a real gdkvd child process.

The gdkvd binary comes from the C++ build: $GDKV_BUILD_DIR (scripts/test sets it), else
build/release at the top of the repository. RADOS tests need $GDKV_CEPH_CONF (scripts/test
starts a cluster and sets it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import gdkv

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("GDKV_BUILD_DIR", ROOT / "build" / "release"))
GDKVD = BUILD / "tools" / "gdkvd" / "gdkvd"
CEPH_CONF = os.environ.get("GDKV_CEPH_CONF", "")


class Gdkvd:
    """A gdkvd child process serving a temporary socket directory."""

    def __init__(self, *args: str, metrics: bool = False, metrics_port: int = 0):
        if not GDKVD.exists():
            raise RuntimeError(f"{GDKVD} is missing: build the C++ tree first (scripts/test does)")
        self.dir = tempfile.mkdtemp(prefix="gdkvd-py-")
        self.log_path = Path(self.dir) / "gdkvd.log"
        self._log = open(self.log_path, "wb")
        # metrics: /metrics (and /removed) at metrics_port, 0: one the kernel picks (gdkvd logs it).
        port = ["--metrics-port", str(metrics_port) if metrics else "-1"]
        self.proc = subprocess.Popen(
            [str(GDKVD), "--socket-dir", self.dir, *port, "--reactors", "1", *args],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 20
        while b"ready:" not in self.log_path.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("gdkvd did not start: " + self.log())
            time.sleep(0.02)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def url(self, path: str) -> str:
        """http://127.0.0.1:PORT/PATH on gdkvd's metrics server (started with metrics=True)."""
        import re
        m = re.search(r"metrics on http://[0-9.]+:(\d+)/metrics", self.log())
        assert m, "gdkvd serves no /metrics: " + self.log()
        return f"http://127.0.0.1:{m.group(1)}{path}"

    def metrics(self) -> dict[str, float]:
        """gdkvd's /metrics (started with metrics=True): {'name{labels}': value}."""
        import urllib.request
        text = urllib.request.urlopen(self.url("/metrics"), timeout=5).read().decode()
        return {name: float(v) for name, v in
                (line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")}

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


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
