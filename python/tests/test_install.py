"""`pip install` gives a user everything, from nothing but the Debian -dev packages: the package,
the daemon and the CLI, proven as a new user would meet it.

In fresh virtual environments (no packages of the project's): an sdist of ./python is made with
`python -m build --sdist` (build isolation on: scikit-build-core and nanobind come from PyPI), a
wheel is built from it with `pip wheel` (build isolation again: this is what `pip install
./python` and `pip install gdkv-0.1.0.tar.gz` do), and the wheel is installed into another fresh
environment. There `gdkvd` and `gdkv` are on the environment's bin/, `gdkv.features()` names what
was built, `python -m gdkv.server` starts a daemon with its defaults, and a value goes in and
out through the installed CLI and through Python. Versions come from python/requirements.txt
(a constraints file, also for the isolated build environments). CUDA device code is left out of
this build (it costs minutes); features() then says cuda False.

About 5 minutes on 2 cores, most of it the C++ build.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from conftest import ROOT

PY = "/usr/bin/python3"
LOCK = ROOT / "python" / "requirements.txt"


def run(*cmd, **kw) -> str:
    env = {**os.environ, "PIP_CONSTRAINT": str(LOCK), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2), **kw.pop("env", {})}
    kw.setdefault("cwd", "/")   # not the clone: its python/gdkv would shadow the installed one
    for k in ("VIRTUAL_ENV", "PYTHONPATH", "GDKV_BUILD_DIR"):
        env.pop(k, None)
    r = subprocess.run([str(c) for c in cmd], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, timeout=1500, **kw)
    out = r.stdout.decode(errors="replace")
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{out[-6000:]}"
    return out


def venv(path: Path) -> Path:
    run(PY, "-m", "venv", path)
    return path / "bin"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("install")
    builder = venv(tmp / "builder")
    run(builder / "pip", "install", "-q", "build", "pyproject_hooks", "packaging")
    run(builder / "python", "-m", "build", "--sdist", "--outdir", tmp / "dist", ROOT / "python")
    (sdist,) = (tmp / "dist").glob("gdkv-*.tar.gz")
    user = venv(tmp / "user")
    run(user / "pip", "wheel", "-q", "--no-deps", "-w", tmp / "wheels",
        "--config-settings=cmake.define.GDKV_WITH_CUDA=OFF", sdist)
    (wheel,) = (tmp / "wheels").glob("gdkv-*.whl")
    other = venv(tmp / "other")   # the wheel in another fresh environment
    run(other / "pip", "install", "-q", wheel)
    return {"tmp": tmp, "sdist": sdist, "bin": other}


def test_the_sdist_holds_the_cxx_sources_and_no_build_tree(installed):
    with tarfile.open(installed["sdist"]) as t:
        names = t.getnames()
    root = names[0].split("/")[0]
    for need in ("pyproject.toml", "CMakeLists.txt", "gdkv/__init__.py", "src/core.cc",
                 "cxx/CMakeLists.txt", "cxx/src/controller/reactor.cc",
                 "cxx/include/gdkv/client.h", "cxx/tools/gdkvd/main.cc"):
        assert f"{root}/{need}" in names, need
    assert not any("/build/" in n or n.endswith(".pyc") for n in names)
    with tarfile.open(installed["sdist"]) as t:
        assert all(not m.issym() for m in t.getmembers())   # symlinks stored as their files
    assert not (ROOT / "python" / "build").exists()   # nothing built in the caller's tree


def test_installed_programs_and_features(installed):
    bin_ = installed["bin"]
    assert (bin_ / "gdkvd").is_file() and (bin_ / "gdkv").is_file()
    assert "Usage" in run(bin_ / "gdkvd", "--help")
    features = json.loads(run(bin_ / "python", "-c",
                              "import gdkv, json; print(json.dumps(gdkv.features()))"))
    assert features["gdkvd"] == str(bin_ / "gdkvd") and features["gdkv"] == str(bin_ / "gdkv")
    assert features["cuda"] is False   # built without CUDA device code
    assert features["rados"] == ("rados" in features["backends"])
    rados = Path("/usr/include/rados/librados.hpp").exists()
    assert features["rados"] == rados   # found at build time when librados-dev is there


def test_server_defaults_cli_and_python(installed):
    bin_, tmp = installed["bin"], installed["tmp"]
    env = {"XDG_DATA_HOME": str(tmp / "data"), "XDG_RUNTIME_DIR": str(tmp / "run"),
           "HOME": str(tmp / "home")}
    for k in ("GDKV_STORE", "GDKV_SOCKET_DIR"):
        env[k] = ""
    full_env = {**os.environ, **env}
    for k in ("GDKV_STORE", "GDKV_SOCKET_DIR", "VIRTUAL_ENV"):
        full_env.pop(k, None)
    log = tmp / "server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen([str(bin_ / "python"), "-m", "gdkv.server", "--reactors", "1"],
                                  stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd="/")
    sock = tmp / "run" / "gdkv"
    try:
        deadline = time.monotonic() + 30
        while b"ready:" not in log.read_bytes():
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        text = log.read_text()
        assert f"socket directory {sock}" in text and "backend local" in text
        assert (tmp / "data" / "gdkv").is_dir()   # the store under the user's data dir
        cli = [str(bin_ / "gdkv"), "--connect", str(sock)]
        subprocess.run([*cli, "put", "greeting", "-"], input=b"hello from the CLI",
                       check=True, timeout=30)
        got = subprocess.run([*cli, "get", "greeting"], check=True, stdout=subprocess.PIPE,
                             timeout=30).stdout
        assert got.startswith(b"hello from the CLI")
        out = run(bin_ / "python", "-c", f"""
import gdkv, numpy as np
with gdkv.connect({str(sock)!r}) as c:
    assert c.get(b"greeting") == b"hello from the CLI"
    v = np.arange(1 << 20, dtype=np.uint8)
    c.put(b"block", v)
    out = c.empty(v.size, "uint8")
    assert c.get_into(b"block", out) == v.size and np.array_equal(out, v)
    print("python ok")
""")
        assert "python ok" in out
        subprocess.run([*cli, "get", "block", "-o", str(tmp / "block.bin")], check=True,
                       timeout=30)
        got = (tmp / "block.bin").read_bytes()
        assert len(got) == 1 << 20 and got[:4] == bytes([0, 1, 2, 3])
    finally:
        server.send_signal(signal.SIGINT)   # Ctrl-C: gdkvd finishes and exits cleanly
        rc = server.wait(20)
    assert rc == 0, log.read_text()
    assert "stopped cleanly" in log.read_text()


def test_a_missing_gdkvd_is_a_clear_error(monkeypatch):
    """python -m gdkv.server where no gdkvd is installed says where gdkvd comes from."""
    import gdkv.server
    monkeypatch.setattr(gdkv.server, "installed", lambda name: None)
    with pytest.raises(SystemExit, match="no gdkvd next to this Python or on PATH"):
        gdkv.server.main([])


def test_server_command_defaults(monkeypatch, tmp_path):
    """The quick-try defaults, and arguments that replace them."""
    import gdkv.server
    monkeypatch.setattr(gdkv.server, "installed", lambda name: "/x/gdkvd")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "d"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "r"))
    for k in ("GDKV_STORE", "GDKV_SOCKET_DIR"):
        monkeypatch.delenv(k, raising=False)
    cmd, sock = gdkv.server.command([])
    assert sock == str(tmp_path / "r" / "gdkv")
    assert cmd == ["/x/gdkvd", "--socket-dir", sock, "--backend", "local", "--store",
                   str(tmp_path / "d" / "gdkv"), "--metrics-port", "-1"]
    cmd, sock = gdkv.server.command(["--backend=memory", "--socket-dir", "/s",
                                     "--metrics-port", "9000"])
    assert sock == "/s" and "--store" not in cmd and cmd.count("--metrics-port") == 1
    monkeypatch.setenv("GDKV_SOCKET_DIR", "/from-env")
    assert gdkv.server.command([])[1] == "/from-env"
