"""bench/python/peer_bench.py runs end to end (gdkvd, in-process, Mooncake Store started for
real) and verifies every value it reads: a short run, so the benchmark cannot rot unnoticed. The
figures themselves are recorded in docs/benchmarks.md, not judged here."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_peer_bench_runs_every_store_and_figure():
    out = subprocess.run([sys.executable, "-P", str(ROOT / "bench" / "python" / "peer_bench.py"),
                          "--seconds", "0.05", "--rounds", "1", "--json"], check=True,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=600)
    rows = json.loads(out.stdout.decode().strip().splitlines()[-1])
    assert set(rows) == {f"{s} batch {b}" for s in ("4KiB", "2MiB") for b in (1, 64)}
    for row in rows.values():
        assert row["memcpy_gbps"] > 0
        for store in ("gdkvd", "in-process", "mooncake"):
            for fig in ("put_zero_copy", "put_plain", "get_zero_copy", "get_plain"):
                assert row[f"{store}.{fig}"] > 0, (store, fig)
