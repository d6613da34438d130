"""A gdkvd child process for the Python benchmarks: on a fresh socket directory, waited for
until it says "ready:", stopped when the block ends.

    with gdkvd("--backend", "memory") as sock:
        c = gdkv.connect(sock)

:class:`Gdkvd` is the same daemon as an object that can also be killed and started again on the
same socket directory (and store), as the soak and the serving benchmark's faults do.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[2]
GDKVD = Path(os.environ.get("GDKV_BUILD_DIR", ROOT / "build" / "release")) / "tools" / "gdkvd" / \
    "gdkvd"


class Gdkvd:
    """``gdkvd --socket-dir DIR --metrics-port P [--config DIR/gdkvd.toml] ARGS...``, started at
    once; ``config`` is the TOML text of a config file, ``metrics`` serves /metrics on a port the
    kernel picks. ``dir`` is the socket directory, ``pid`` the running daemon's. ``wrap`` comes
    before the command and must exec it (``ip netns exec NS``: gdkvd in another network
    namespace, its socket still in this file system)."""

    def __init__(self, *args: str, binary: str | Path = GDKVD, config: Optional[str] = None,
                 metrics: bool = False, prefix: str = "gdkvd-bench-", wrap: tuple | list = ()):
        self.dir = tempfile.mkdtemp(prefix=prefix)
        self.wrap = list(wrap)
        self.cmd = [*wrap, str(binary), "--socket-dir", self.dir, "--metrics-port",
                    "0" if metrics else "-1"]
        if config is not None:
            (Path(self.dir) / "gdkvd.toml").write_text(config)
            self.cmd += ["--config", str(Path(self.dir) / "gdkvd.toml")]
        self.cmd += list(args)
        self.log_path = Path(self.dir) / "gdkvd.log"
        self.proc: Optional[subprocess.Popen] = None
        self.starts = 0
        self.metrics_port = 0
        self.start()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        """Starts the daemon (again) and waits until it is ready."""
        marker = f"---- start {self.starts}\n"
        with open(self.log_path, "ab") as log:
            log.write(marker.encode())
            log.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            text = self.log_path.read_text(errors="replace")
            this = text[text.rindex(marker):]
            if "ready:" in this:
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit("gdkvd did not start: " + this[-3000:])
            time.sleep(0.02)
        m = re.search(r"metrics on http://[0-9.]+:(\d+)/metrics", this)
        self.metrics_port = int(m.group(1)) if m else 0
        self.starts += 1

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Sends ``sig`` and waits for the daemon to exit."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def metrics(self) -> dict[str, float]:
        """/metrics (started with metrics=True): {'name{labels}': value}; {} without."""
        if not self.metrics_port:
            return {}
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        if self.wrap:   # another network namespace: fetched from inside it
            fetch = ("import sys, urllib.request; sys.stdout.write(urllib.request.urlopen("
                     f"{url!r}, timeout=5).read().decode())")
            text = subprocess.run([*self.wrap, sys.executable, "-c", fetch], check=True,
                                  capture_output=True, text=True, timeout=30).stdout
        else:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        return {name: float(v) for name, v in
                (line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")}

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


@contextlib.contextmanager
def gdkvd(*args: str, binary: str | Path = GDKVD, config: Optional[str] = None,
          prefix: str = "gdkvd-bench-") -> Iterator[str]:
    """Runs ``gdkvd --socket-dir DIR --metrics-port -1 [--config DIR/gdkvd.toml] ARGS...`` and
    yields DIR; ``config`` is the TOML text of a config file."""
    d = Gdkvd(*args, binary=binary, config=config, prefix=prefix)
    try:
        yield d.dir
    finally:
        d.stop()
