"""The soak (bench/soak/soak.py) for three minutes: a multi-turn workload's KV blocks through a real
gdkvd on the local store, the daemon SIGKILLed and SIGTERMed and restarted, the store reclaiming
segments and the host cache evicting. Every value read is checked against its key; the daemon's
and the client's RSS, descriptors, memfds and memfd mappings must stay flat after warm-up; no
request may fail. The 30-minute run is the same program (docs/benchmarks.md, "Soak")."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_three_minute_soak_with_restarts_is_flat_and_loses_nothing():
    out = subprocess.run([sys.executable, "-P", str(ROOT / "bench" / "soak" / "soak.py"),
                          "--seconds", "175", "--restart-every", "50", "--warmup", "20", "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=400)
    text = out.stdout.decode(errors="replace")
    # The report without its last line (the JSON of every sample), which would hide what failed.
    report = "\n".join(line for line in text.splitlines() if not line.startswith("{"))[-4000:]
    assert out.returncode == 0, report
    r = json.loads(text.strip().splitlines()[-1])
    assert r["failures"] == [], report
    assert r["wrong"] == 0 and r["failed"] == 0
    assert r["lives"] >= 4          # started, then killed and restarted three times
    assert r["retried"] > 0         # requests really met a dead daemon and came back
    assert r["blocks_loaded"] > 0 and r["blocks_stored"] > 0
    assert r["reclaimed"] > 0 and r["evictions"] > 0
    assert len(r["samples"]) >= 60
