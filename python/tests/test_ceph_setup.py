"""docs/deployment.md's Ceph set-up, run as written (a fresh pool name, against the test
cluster): the pool, its application, its quota and gdkvd's cephx identity; then a gdkvd running as
that identity stores, reads, lists, deletes, watches for Deletes and reads the pool's quota and
fill (its monitor commands), so the documented capabilities are enough for all of it."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import uuid

import gdkv
from conftest import ROOT, Gdkvd, require_ceph, until


def doc_commands() -> list[str]:
    text = (ROOT / "docs" / "deployment.md").read_text()
    block = text.split("<!-- ceph-setup -->", 1)[1].split("<!-- end of ceph-setup -->", 1)[0]
    lines = [ln for ln in block.splitlines() if ln and not ln.startswith("```")]
    assert lines and all(ln.startswith("ceph ") for ln in lines), lines
    return lines


def test_the_documented_ceph_setup_gives_gdkvd_what_it_needs(tmp_path):
    conf = require_ceph()
    pool = "gdkv-doc-" + uuid.uuid4().hex[:8]
    user = "client.gdkv-" + pool[-8:]
    env = {**os.environ, "CEPH_CONF": conf}
    quota = None
    for line in doc_commands():
        line = line.replace("gdkv-rep3", pool).replace("client.gdkv", user)
        m = re.search(r"max_bytes (\d+)", line)
        if m:
            quota = int(m.group(1))
        r = subprocess.run(shlex.split(line), cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, f"{line}\n{r.stdout}\n{r.stderr}"
    keyring = next(tmp_path.glob("*.keyring"))
    assert user in keyring.read_text()

    d = Gdkvd("--backend", "rados", "--pool", pool, "--ceph-conf", conf, "--ceph-client", user,
              "--ceph-keyring", str(keyring), "--evict", "--evict-interval-ms", "200",
              "--cache-bytes", str(8 << 20), metrics=True)
    try:
        with gdkv.connect(d.dir) as c:
            c.put(b"setup-a", b"A" * 5000)
            c.put(b"setup-b", b"B" * 7000)
            assert c.get(b"setup-a") == b"A" * 5000
            assert c.exists(b"setup-b")
            assert c.list() == [b"setup-a", b"setup-b"]
            c.delete(b"setup-a")
            assert not c.exists(b"setup-a")

        def metric(name: str) -> float | None:
            return next((v for k, v in d.metrics().items() if k.split("{")[0] == name), None)

        # Monitor commands: the pool's quota read back and its fill measured by the eviction
        # checks (one every 200 ms); the Delete notified through the watch on the events object.
        until(lambda: metric("gdkv_rados_pool_capacity_bytes") == quota,
              "the pool's quota read through the monitor", 60)
        until(lambda: (metric("gdkv_rados_pool_used_bytes") or 0) > 0,
              "the pool's fill read through the monitor", 60)
        assert metric("gdkv_rados_delete_notifies_total") == 1
        assert metric("gdkv_rados_delete_notify_failures_total") == 0
        assert metric("gdkv_rados_watch_errors_total") == 0
        assert "not permitted" not in d.log() and "EACCES" not in d.log(), d.log()
    finally:
        d.stop()
