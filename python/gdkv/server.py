"""``python -m gdkv.server``: a gdkvd for a quick try, with defaults a user can start from.

It runs the ``gdkvd`` installed with this package (``pip install`` puts it next to the Python
interpreter, in the environment's ``bin/``) on the local store, and prints the socket directory
clients connect to::

    $ python -m gdkv.server
    gdkv.server: gdkvd on the local store at /home/me/.local/share/gdkv, socket directory
    /run/user/1000/gdkv (connect with gdkv.connect("/run/user/1000/gdkv"))

Defaults: ``--backend local``, the store in ``$GDKV_STORE``, else ``$XDG_DATA_HOME/gdkv``, else
``~/.local/share/gdkv`` (gdkvd's own default); the socket directory ``$GDKV_SOCKET_DIR``, else
``$XDG_RUNTIME_DIR/gdkv``, else ``/tmp/gdkv-$USER``; no metrics port. Every other argument goes
to gdkvd as it is (``python -m gdkv.server --backend memory --cache-bytes 0``; ``gdkvd --help``
lists them). Ctrl-C or SIGTERM stops it cleanly (gdkvd finishes the commands in flight).
"""

from __future__ import annotations

import getpass
import os
import shutil
import sys
import sysconfig
from typing import Optional

from . import _core


def installed(name: str) -> Optional[str]:
    """The path of the program ``name`` (gdkvd, gdkv) installed with this package: in the
    scripts folder of the running interpreter's environment, else on PATH; None if neither."""
    for folder in {sysconfig.get_path("scripts"), os.path.dirname(sys.executable)}:
        path = os.path.join(folder, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return shutil.which(name)


def socket_dir() -> str:
    """Where the quick-try daemon listens unless --socket-dir is given."""
    if os.environ.get("GDKV_SOCKET_DIR"):
        return os.environ["GDKV_SOCKET_DIR"]
    if os.environ.get("XDG_RUNTIME_DIR"):
        return os.path.join(os.environ["XDG_RUNTIME_DIR"], "gdkv")
    return f"/tmp/gdkv-{getpass.getuser()}"


def store_dir() -> str:
    if os.environ.get("GDKV_STORE"):
        return os.environ["GDKV_STORE"]
    data = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                           "share")
    return os.path.join(data, "gdkv")


def _given(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def command(args: list[str]) -> tuple[list[str], str]:
    """The gdkvd command line for ``args`` (this module's defaults first), and its socket dir."""
    gdkvd = installed("gdkvd")
    if gdkvd is None:
        raise SystemExit("gdkv.server: no gdkvd next to this Python or on PATH; install the "
                         "package with pip (it ships gdkvd), or run the clone's "
                         "build/release/tools/gdkvd/gdkvd")
    cmd = [gdkvd]
    sock = socket_dir()
    if _given(args, "--socket-dir"):
        i = next(i for i, a in enumerate(args) if a.startswith("--socket-dir"))
        sock = args[i].split("=", 1)[1] if "=" in args[i] else args[i + 1]
    else:
        cmd += ["--socket-dir", sock]
    backend = "local"
    if _given(args, "--backend"):
        i = next(i for i, a in enumerate(args) if a.startswith("--backend"))
        backend = args[i].split("=", 1)[1] if "=" in args[i] else args[i + 1]
    else:
        cmd += ["--backend", "local"]
    traits = _core.backend_traits().get(backend, {})
    if traits.get("directory_setting") == "store" and not _given(args, "--store"):
        cmd += ["--store", store_dir()]
    if not _given(args, "--metrics-port"):
        cmd += ["--metrics-port", "-1"]
    return cmd + args, sock


def main(argv: Optional[list[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return
    cmd, sock = command(args)
    os.makedirs(sock, mode=0o700, exist_ok=True)
    print(f"gdkv.server: {' '.join(cmd)}\ngdkv.server: socket directory {sock} (connect with "
          f"gdkv.connect({sock!r}) or gdkv --connect {sock})", flush=True)
    # gdkvd itself: it handles SIGINT and SIGTERM (finishes the commands in flight, then exits).
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
