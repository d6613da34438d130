"""Short serving runs (bench/serving/serve_bench.py) on the real vLLM engine: vLLM alone against
gdkv through gdkvd, four users with four turns each on two concurrent streaming clients, and
gdkvd SIGKILLed and restarted in the middle of gdkv's run; two engines on two network-namespace
hosts over one RADOS pool, with an OSD killed and a link cut; prefill/decode disaggregation
through gdkv on one node and across the two hosts. Reuse must happen, no request may fail, and
every request's output tokens must equal vLLM alone's. Figures are benchmarks, recorded in
docs/serving.md, not judged here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT


def serve_bench(tmp_path, *args: str, requests: int) -> tuple[dict, str]:
    """Runs serve_bench.py with ``args`` (small engines: 512-token documents, 8 answer tokens);
    requires exit 0 and vLLM alone's ``requests`` requests served; returns the systems' results
    and the output. Tiered systems run on the bench's own network-namespace hosts, not on the
    cluster scripts/test names in $GDKV_CEPH_CONF (that one has no hosts to cut off)."""
    env = {k: v for k, v in os.environ.items() if k != "GDKV_CEPH_CONF"}
    out = subprocess.run(
        [sys.executable, "-P", str(ROOT / "bench" / "serving" / "serve_bench.py"),
         "--doc-tokens", "512", "--answer-tokens", "8", *args,
         "--model", str(tmp_path / "model"), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900, env=env)
    text = out.stdout.decode(errors="replace")
    assert out.returncode == 0, text[-4000:]
    r = json.loads(text.strip().splitlines()[-1])["systems"]
    assert r["vllm"]["requests"] == requests and r["vllm"]["failed"] == 0
    return r, text


def needs_netns_and_ceph() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("ceph-mon") is None:
        pytest.skip("needs root, iproute2 and Ceph's daemons (scripts/test installs them)")


def test_short_serving_run_reuses_kv_and_survives_a_gdkvd_kill(tmp_path):
    # The connector connects again retry_interval_s after a failure (default 5 s): 0.5 s here,
    # so that it is back well before the run ends (gdkv's run is about 5 s on this machine).
    r, text = serve_bench(tmp_path, "--systems", "vllm,gdkv", "--users", "4", "--turns", "4",
                          "--kv-blocks", "12", "--kill-gdkvd-at", "3",
                          "--gdkv-extra", '{"retry_interval_s": 0.5}', requests=16)
    gdkv = r["gdkv"]
    assert gdkv["failed"] == 0
    assert gdkv["identical"] == gdkv["compared"] == 16
    assert gdkv["tokens_from_store"] > 0
    (kill,) = gdkv["faults"]                   # the fault happened during the run
    assert kill["fault"] == "gdkvd-kill" and 3 <= kill["at_s"] < 4, kill
    assert kill["back_to_full_speed_s"] >= 0, text[-2000:]   # gdkv served again


def test_two_hosts_over_rados_survive_an_osd_kill_and_a_cut_link(tmp_path):
    """Two engines, each with its own tiered gdkvd in a network-namespace host over one RADOS
    pool, a user's turns alternating between them: the second engine loads what the first
    saved (through RADOS). An OSD is killed and the second host's link cut for 6 s in the
    middle: no request fails and every output equals two engines of vLLM alone."""
    needs_netns_and_ceph()
    r, text = serve_bench(tmp_path, "--systems", "vllm,gdkv-tiered", "--engines", "2",
                          "--users", "4", "--turns", "4", "--kv-blocks", "12",
                          "--kill-osd-at", "2", "--cut-link-at", "4", "--cut-s", "6",
                          "--netns-prefix", "gdkvst", "--netns-subnet", "10.79.0", requests=16)
    t = r["gdkv-tiered"]
    assert t["failed"] == 0
    assert t["identical"] == t["compared"] == 16
    assert t["tokens_from_store"] > 0
    assert sorted(f["fault"] for f in t["faults"]) == ["link-cut", "osd-kill"], text[-2000:]
    assert set(t["per_engine"]) == {"0", "1"}
    # Each engine served turns whose earlier turns the other engine saved: its gdkvd read them
    # from RADOS, not from its own local tier.
    assert t["connector"]["loaded_values"] > 0
    assert len(t["far_reads"]) == 2 and min(t["far_reads"]) > 0, t["far_reads"]


def test_prefill_decode_disaggregation_through_gdkv(tmp_path):
    """Prefill on one engine (kv_producer), then the request on another (kv_consumer): the
    decode engine has every full block of each prompt before it computes (from gdkv, or its own
    prefix cache), through one gdkvd on the local store and across two network-namespace hosts
    over RADOS; outputs equal a decode engine that recomputed."""
    needs_netns_and_ceph()
    r, text = serve_bench(tmp_path, "--systems", "vllm,gdkv,gdkv-tiered", "--engines", "2",
                          "--pd", "--users", "4", "--turns", "3", "--kv-blocks", "16",
                          "--netns-prefix", "gdkvsp", "--netns-subnet", "10.80.0", requests=12)
    for name in ("gdkv", "gdkv-tiered"):
        s = r[name]
        assert s["failed"] == 0 and s["identical"] == s["compared"] == 12, name
        prefill, decode = s["engine_per_engine"]
        assert prefill["store_hit_tokens"] == 0, name          # a producer never loads
        assert decode["store_hit_tokens"] > 0, name
        # Every full block of every prompt (but the last token's) was the decode engine's
        # before it computed: loaded from gdkv or held by its own prefix cache.
        need = s["prompt_block_tokens"][1]
        assert decode["local_hit_tokens"] + decode["store_hit_tokens"] >= need, (name, decode)
        assert s["connector"]["saved_values"] > 0 and s["connector"]["failed_values"] == 0
    assert min(r["gdkv-tiered"]["far_reads"]) >= 0 and r["gdkv-tiered"]["far_reads"][1] > 0
