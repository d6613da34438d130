"""gdkv's exceptions: one base class, the standard ones mixed in where they fit.

Every exception a gdkv call raises for a failed command carries the NVMe status it got
(``status``, an int, -1 when no command ran) and the key (``key``, bytes or None)::

    try:
        client.get(b"missing")
    except KeyError as e:        # gdkv.KeyNotFoundError
        e.status                 # 0x87
"""

from __future__ import annotations

import builtins

from . import _core


class Error(Exception):
    """Base class of gdkv's errors."""

    status: int
    key: bytes | None

    def __init__(self, message: str, status: int = -1, key: bytes | None = None):
        super().__init__(message)
        self.status = status
        self.key = key


class KeyNotFoundError(Error, KeyError):
    """The key does not exist (87h)."""

    def __str__(self) -> str:  # KeyError's own str() would quote the message
        return str(self.args[0]) if self.args else ""


class KeyExistsError(Error):
    """A Store with must_not_exist found the key (89h)."""


class InvalidKeyError(Error, ValueError):
    """A key of 0 or more than 16 bytes (86h)."""


class ValueSizeError(Error, ValueError):
    """A value larger than the controller takes (85h), or a buffer too small for the value."""


class CapacityError(Error):
    """The store is full (81h), or the memory shared with gdkvd is."""


class NotReadyError(Error):
    """The backend cannot serve now (82h): e.g. the Ceph cluster is unreachable."""


class TimeoutError(Error, builtins.TimeoutError):
    """gdkvd did not complete a command in time; the client is unusable from then on."""


class ConnectionError(Error, builtins.ConnectionError):
    """gdkvd is gone (it exited or died), or a connection could not be made."""


class ClosedError(Error):
    """The client was closed."""


_BY_STATUS = {
    0x81: CapacityError,
    0x82: NotReadyError,
    0x85: ValueSizeError,
    0x86: InvalidKeyError,
    0x87: KeyNotFoundError,
    0x89: KeyExistsError,
}


# Why a call failed besides its status: the extension's FailureKind (python/src/errors.h).
_K = _core.failure_kinds
_TIMED_OUT, _PEER_GONE, _CLOSED = _K["timed_out"], _K["peer_gone"], _K["closed"]
_CONNECT_FAILED = _K["connect_failed"]


def _make(op: str, key: bytes | None, status: int, failure: int, message: str) -> Error:
    """Builds the exception for a failed call (the extension calls this)."""
    if failure == _TIMED_OUT:
        cls = TimeoutError
    elif failure in (_PEER_GONE, _CONNECT_FAILED):
        cls = ConnectionError
    elif failure == _CLOSED:
        cls = ClosedError
    else:
        cls = _BY_STATUS.get(status, Error)
    where = f"{op} {key!r}" if key is not None else op
    return cls(f"{where}: {message}", status, key)


def raise_first(results: list) -> list:
    """Raises the first gdkv.Error in a batch call's results (put_many, delete_many,
    get_many_into, exists_many); else returns them."""
    for r in results:
        if isinstance(r, Error):
            raise r
    return results
