"""A gdkvd child process for the Python benchmarks and tests (python/tests/conftest.py's Gdkvd
is this one): on a fresh socket directory, waited for until it says "ready:", stopped when the
block ends.

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
    once; ``config`` is the TOML text of a config file, ``metrics`` serves /metrics (and
    /removed) on ``metrics_port`` (0: one the kernel picks). ``dir`` is the socket directory,
    ``pid`` the running daemon's; start() starts it again there after kill(). ``wrap`` comes
    before the command and must exec it (``ip netns exec NS``: gdkvd in another network
    namespace, its socket still in this file system). ``socket_dir``: that directory instead of
    a new temporary one (a host's, kept across daemons). gdkvd reads no GDKVD_* variable of the
    caller's environment: what it runs with is ARGS and ``config``. A daemon that does not start
    raises RuntimeError with its log."""

    def __init__(self, *args: str, binary: str | Path = GDKVD, config: Optional[str] = None,
                 metrics: bool = False, metrics_port: int = 0, prefix: str = "gdkvd-bench-",
                 wrap: tuple | list = (), socket_dir: str | Path | None = None):
        if not Path(binary).exists():
            raise RuntimeError(f"{binary} is missing: build the C++ tree first (scripts/test "
                               "does)")
        if socket_dir is not None:
            Path(socket_dir).mkdir(parents=True, exist_ok=True)
        self.dir = str(socket_dir) if socket_dir is not None else tempfile.mkdtemp(prefix=prefix)
        self.wrap = list(wrap)
        self.cmd = [*wrap, str(binary), "--socket-dir", self.dir, "--metrics-port",
                    str(metrics_port) if metrics else "-1"]
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
            env = {k: v for k, v in os.environ.items() if not k.startswith("GDKVD_")}
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            text = self.log_path.read_text(errors="replace")
            this = text[text.rindex(marker):]
            if "ready:" in this:
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("gdkvd did not start: " + this[-3000:])
            time.sleep(0.02)
        m = re.search(r"metrics on http://[0-9.]+:(\d+)/metrics", this)
        self.metrics_port = int(m.group(1)) if m else 0
        self.starts += 1

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def url(self, path: str) -> str:
        """http://127.0.0.1:PORT/PATH on the metrics server (started with metrics=True)."""
        assert self.metrics_port, "gdkvd serves no /metrics: " + self.log()
        return f"http://127.0.0.1:{self.metrics_port}{path}"

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Sends ``sig`` and waits for the daemon to exit (one stopped by SIGSTOP is continued
        first, so that it can)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
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
        url = self.url("/metrics")
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

    # (Last: in the class body, a method named signal hides the module in later defaults.)
    def signal(self, sig: int) -> None:
        """Sends ``sig``. SIGSTOP returns once every thread of the daemon has stopped: the kernel
        stops a process's threads one after another, and its reactor serves calls until then."""
        assert self.proc is not None
        self.proc.send_signal(sig)
        if sig == signal.SIGSTOP:
            wait_stopped(self.proc.pid)


def thread_states(pid: int) -> list[str]:
    """The state letter of each thread of ``pid`` (/proc/PID/task/*/stat; "T": stopped). A
    thread that exits while read is left out."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        states.append(stat[stat.rindex(")") + 2])   # the name, in parentheses, may hold spaces
    return states


def wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Waits until every thread of ``pid`` is stopped (after a SIGSTOP); RuntimeError past
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = thread_states(pid)
        if states and all(s in "Tt" for s in states):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {pid} did not stop: thread states {states}")
        time.sleep(0.001)


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
