#!/usr/bin/env python3
"""Time to first token with KV reuse from gdkv against a full recompute measured in the same
process (python -m gdkv_demo.reuse, request B), at several prompt lengths; B shares 5/6 of its prompt
with request A. Runs its own gdkvd on a fresh local store.

Usage: ttft_bench.py [--build build/release] [--model DIR] [LENGTH ...]   (default 1536 3072 6144)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gdkvd_proc import gdkvd  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "demo"))
from gdkv_demo import child_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--build", default=str(ROOT / "build" / "release"))
    p.add_argument("--model", default=os.environ.get("GDKV_MODEL_DIR",
                                                     str(ROOT / "build" / "demo-model")))
    p.add_argument("lengths", nargs="*", type=int, default=[1536, 3072, 6144])
    a = p.parse_args()
    store = tempfile.mkdtemp(prefix="gdkv-ttft-store-")
    with gdkvd("--backend", "local", "--store", store, "--reactors", "1",
               binary=f"{a.build}/tools/gdkvd/gdkvd", prefix="gdkv-ttft-") as d:
        print(f"{'prompt':>7} {'shared':>7} {'loaded':>7} {'MiB':>6} {'load ms':>8} "
              f"{'TTFT reuse':>11} {'TTFT full':>10} {'speedup':>8}  identical")
        rows = []
        for n in a.lengths:
            out = subprocess.run([sys.executable, "-m", "gdkv_demo.reuse", "--connect", d,
                                  "--model", a.model, "--prompt-tokens", str(n),
                                  "--shared-tokens", str(n * 5 // 6), "--json"],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=True,
                                 env=child_env())
            r = json.loads(out.stdout.decode().strip().splitlines()[-1])
            b = r["reuse"]
            rows.append(b)
            print(f"{b['prompt_tokens']:>7} {b['shared_tokens']:>7} "
                  f"{b['tokens_loaded'] / b['prompt_tokens']:>7.0%} "
                  f"{b['bytes_loaded'] / 2**20:>6.1f} {b['load_s'] * 1e3:>8.0f} "
                  f"{b['ttft_reuse_s']:>10.2f}s {b['ttft_full_s']:>9.2f}s "
                  f"{b['ttft_full_s'] / b['ttft_reuse_s']:>7.1f}x  {b['tokens_identical']}")
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
