"""KV reuse with a real transformer across two processes (python -m gdkv_demo.reuse): identical greedy
tokens and logits within tolerance, on the local store through gdkvd and on the Ceph cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT, Gdkvd, require_ceph

MODEL = os.environ.get("GDKV_MODEL_DIR", str(ROOT / "build" / "demo-model"))
# Smaller than the demo's defaults, to keep the suite quick; the same code path.
ARGS = ["--model", MODEL, "--prompt-tokens", "1280", "--shared-tokens", "1000",
        "--block-tokens", "64", "--steps", "8", "--json"]


def run_demo(*where: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "gdkv_demo.reuse", *where, *ARGS],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=900)
    assert out.returncode in (0, 1), out.stderr.decode()[-2000:]
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


def check(r: dict, *, stored: bool) -> None:
    a, b = r["store"], r["reuse"]
    assert a["pid"] != b["pid"]  # two processes
    assert a["blocks"] == 1280 // 64
    assert (a["stored_blocks"] == a["blocks"]) if stored else (a["stored_blocks"] == 0)
    assert b["blocks_found"] == b["blocks_loaded"] == 1000 // 64  # the shared full blocks
    assert b["tokens_loaded"] == 15 * 64
    assert b["tokens_identical"], r
    assert b["max_abs_logit_diff"] <= r["tolerance"], r
    assert r["ok"]
    assert a["copies"] == 0 and b["copies"] == 0


def test_reuse_through_gdkvd_on_the_local_store(tmp_path):
    d = Gdkvd("--backend", "local", "--store", str(tmp_path / "store"), "--capacity",
              str(1 << 30))
    try:
        check(run_demo("--connect", d.dir), stored=True)
        check(run_demo("--connect", d.dir), stored=False)  # A finds its blocks stored already
    finally:
        d.stop()


def test_reuse_on_the_ceph_cluster():
    conf = require_ceph()
    # A prompt of its own (seed), so request A finds none of its blocks in the shared pool.
    seed = str(int.from_bytes(os.urandom(4), "little"))
    check(run_demo("--backend", "rados", "--ceph-conf", conf, "--seed", seed), stored=True)


def test_demo_usage_errors():
    out = subprocess.run([sys.executable, "-m", "gdkv_demo.reuse", "--shared-tokens", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert out.returncode == 2 and b"shared-tokens" in out.stderr
    out = subprocess.run([sys.executable, "-m", "gdkv_demo.reuse", "--connect", "/nonexistent",
                          "--model", MODEL], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert out.returncode != 0
