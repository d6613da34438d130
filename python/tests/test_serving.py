"""A short serving run (bench/serving/serve_bench.py) on the real vLLM engine: vLLM alone against
gdkv through gdkvd, four users with four turns each on two concurrent streaming clients, and
gdkvd SIGKILLed and restarted in the middle of gdkv's run. Reuse must happen, no request may
fail, and every request's output tokens must equal vLLM alone's. Figures are benchmarks, recorded
in docs/serving.md, not judged here."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_short_serving_run_reuses_kv_and_survives_a_gdkvd_kill(tmp_path):
    out = subprocess.run(
        [sys.executable, "-P", str(ROOT / "bench" / "serving" / "serve_bench.py"),
         "--systems", "vllm,gdkv", "--users", "4", "--turns", "4", "--doc-tokens", "512",
         "--answer-tokens", "8", "--kv-blocks", "12", "--kill-gdkvd-at", "3",
         "--model", str(tmp_path / "model"), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
    text = out.stdout.decode(errors="replace")
    assert out.returncode == 0, text[-4000:]
    r = json.loads(text.strip().splitlines()[-1])["systems"]
    assert r["vllm"]["requests"] == 16 and r["vllm"]["failed"] == 0
    gdkv = r["gdkv"]
    assert gdkv["failed"] == 0
    assert gdkv["identical"] == gdkv["compared"] == 16
    assert gdkv["tokens_from_store"] > 0
    assert gdkv["gdkvd_killed_at_s"] == 3      # the fault happened during the run
    assert "loading_again_after_s" in gdkv, text[-2000:]
