"""A gdkvd child process for the Python benchmarks: on a fresh socket directory, waited for
until it says "ready:", stopped when the block ends.

    with gdkvd("--backend", "memory") as sock:
        c = gdkv.connect(sock)
"""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[2]
GDKVD = ROOT / "build" / "release" / "tools" / "gdkvd" / "gdkvd"


@contextlib.contextmanager
def gdkvd(*args: str, binary: str | Path = GDKVD, config: Optional[str] = None,
          prefix: str = "gdkvd-bench-") -> Iterator[str]:
    """Runs ``gdkvd --socket-dir DIR --metrics-port -1 [--config DIR/gdkvd.toml] ARGS...`` and
    yields DIR; ``config`` is the TOML text of a config file."""
    d = tempfile.mkdtemp(prefix=prefix)
    cmd = [str(binary), "--socket-dir", d, "--metrics-port", "-1"]
    if config is not None:
        (Path(d) / "gdkvd.toml").write_text(config)
        cmd += ["--config", str(Path(d) / "gdkvd.toml")]
    log_path = Path(d) / "gdkvd.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*cmd, *args], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while b"ready:" not in log_path.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("gdkvd did not start: " + log_path.read_text(errors="replace"))
            time.sleep(0.02)
        yield d
    finally:
        proc.terminate()
        proc.wait()
