"""The soak's ledger of what gdkvd acknowledged and what it reported removed, which tells a value
the store let go (evicted, reclaimed, deleted: reported on gdkvd's ``/removed`` feed) from a lost
write (an acknowledged value gone without a report).

Two checks use it:

- **In a life.** A user that finds a value missing that it stored (``missing``) leaves an
  observation. The main thread reads ``/removed`` every fraction of a second and hands the keys to
  ``removed``; a report of the key explains the observation. An observation still unexplained by
  a read of the feed that began after it was made (GRACE_S after) is a **lost** value: gdkvd
  reports a removal when it happens, so that read had it.
- **Across a restart.** Records gdkvd adds between the soak's last read of its feed and the kill
  die with it. After the restart (no client yet) the soak lists what the store holds
  (``restarted``). A value acknowledged, not reported removed and not listed was reclaimed in
  that gap or lost. The local store reclaims its oldest segment first, and a value acknowledged
  before another value's Store was sent lies in an earlier batch, so in the same or an older
  segment: if such an older value is still listed (and was not written again since), the missing
  one was not reclaimed and is **lost**. The rest are **unknown**; more of them than the segments
  that the bytes written in the gap could have filled is a loss too.

Times are the caller's clock (time.monotonic). Thread-safe: the users and the main thread share
one ledger.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterable, Optional

# A value found missing is judged by a read of the feed that began at least this long after. The
# local store's I/O thread reports a reclaimed key (and the host cache drops it) before it serves
# another op, so the report is there when a lookup finds the key missing; this is a margin.
GRACE_S = 0.5


@dataclass
class Entry:
    """One key's last known state (a key gdkvd reported removed has none). held: True once a
    Store of it was acknowledged, False once a user found it missing, None while no Store of it
    was acknowledged or when a report of its removal may be of an earlier Store (not judged until
    it is stored again)."""
    held: Optional[bool] = None
    acked_sent: float = 0.0     # when the acknowledged Store was sent
    acked: float = 0.0          # when its acknowledgement had arrived
    last_sent: float = 0.0      # when the latest Store was sent, acknowledged or not


@dataclass
class RestartCheck:
    """One restart: values acknowledged before the kill and gone after it."""
    life: int
    expected: int = 0                               # values held at the kill (not reported)
    lost: list[bytes] = field(default_factory=list)
    unknown: list[bytes] = field(default_factory=list)
    unknown_allowed: int = 0                        # at most reclaimable in the gap


class Ledger:
    """What the soak's users stored and what gdkvd reported removed (see the module's text)."""

    def __init__(self, segment_bytes: int, value_bytes: int):
        self.segment_bytes, self.value_bytes = segment_bytes, value_bytes
        self.lock = threading.Lock()
        self.entries: dict[bytes, Entry] = {}
        self.pending: dict[bytes, float] = {}   # key -> when a user found it missing
        self.sent_bytes = 0                      # Store bytes sent, ever
        self.inflight_bytes = 0                  # Store bytes sent and not answered
        self.explained = 0                       # missing values gdkvd had reported removed
        self.lost: list[tuple[bytes, str]] = []  # (key, why): the soak fails on any
        self.unknown = 0                         # missing, whether reported cannot be known
        self.checks: list[RestartCheck] = []
        # The last completed read of the feed: when it began, and (sent_bytes, inflight_bytes)
        # then; the one in progress.
        self._last_read = float("-inf")
        self._gap = (0, 0)
        self._reading = (0.0, 0, 0)

    # ---- the users ------------------------------------------------------------------------------
    def sending(self, keys: Iterable[bytes], nbytes: int, t: float) -> None:
        with self.lock:
            for k in keys:
                self.entries.setdefault(k, Entry()).last_sent = t
            self.sent_bytes += nbytes
            self.inflight_bytes += nbytes

    def stored(self, keys: Iterable[bytes], nbytes: int, sent: float, acked: float) -> None:
        """The Stores of `keys`, sent at `sent`, were acknowledged by `acked`."""
        with self.lock:
            for k in keys:
                e = self.entries.setdefault(k, Entry(last_sent=sent))
                e.held, e.acked_sent, e.acked = True, sent, acked
            self.inflight_bytes -= nbytes

    def unanswered(self, nbytes: int) -> None:
        """Stores that got no answer (the connection went): their keys keep their state."""
        with self.lock:
            self.inflight_bytes -= nbytes

    def missing(self, key: bytes, t: float) -> None:
        """A user found `key` missing at `t` (a lookup's or a read's answer)."""
        with self.lock:
            e = self.entries.get(key)
            if e is not None and e.held:
                e.held = False
                self.pending[key] = t

    # ---- the feed --------------------------------------------------------------------------------
    def reading(self, t: float) -> None:
        """A read of /removed begins at `t` (removed() follows when it completes)."""
        with self.lock:
            self._reading = (t, self.sent_bytes, self.inflight_bytes)

    def removed(self, keys: Iterable[bytes]) -> None:
        """The read that reading() announced completed and returned `keys`. A read that failed or
        said that removals were missed is not passed here (see feed_gap)."""
        with self.lock:
            start, sent, inflight = self._reading
            prev = self._last_read
            for k in keys:
                if self.pending.pop(k, None) is not None:
                    self.explained += 1
                    continue
                e = self.entries.get(k)
                if e is None:
                    continue
                # The removal happened after the previous read began. The Store acknowledged
                # before that is the one removed; one acknowledged since may have come after it.
                if e.held and e.acked >= prev:
                    e.held = None
                else:
                    del self.entries[k]
            for k, t in list(self.pending.items()):
                if t + GRACE_S < start:
                    del self.pending[k]
                    self.lost.append((k, "missing in a life and not reported removed"))
            self._last_read = start
            self._gap = (sent, inflight)

    def feed_gap(self) -> None:
        """The feed said removals may have been missed: nothing held is known any more."""
        with self.lock:
            self.unknown += len(self.pending)
            self.pending.clear()
            for e in self.entries.values():
                if e.held:
                    e.held = None

    # ---- a restart -------------------------------------------------------------------------------
    def restarted(self, life: int, listed: set[bytes], t: float) -> RestartCheck:
        """gdkvd was killed after the last removed() and started again; `listed` is every key its
        store holds, listed before any user came back, and the new gdkvd's feed was positioned at
        `t`. `life` is the life that ended."""
        with self.lock:
            check = RestartCheck(life)
            # Found missing after the last read of the feed: its record died with gdkvd.
            self.unknown += len(self.pending)
            self.pending.clear()
            gone: list[tuple[bytes, Entry]] = []
            oldest_witness = float("inf")
            for k, e in self.entries.items():
                if not e.held:
                    continue
                check.expected += 1
                if k not in listed:
                    gone.append((k, e))
                elif e.last_sent == e.acked_sent:   # not written again since: its record it is
                    oldest_witness = min(oldest_witness, e.acked)
            for k, e in gone:
                (check.lost if oldest_witness < e.acked_sent else check.unknown).append(k)
            for k in [k for k in self.entries if k not in listed]:
                del self.entries[k]
            sent, inflight = self._gap
            gap_bytes = inflight + self.sent_bytes - sent
            per_segment = max(1, self.segment_bytes // self.value_bytes)
            check.unknown_allowed = (gap_bytes // self.segment_bytes + 2) * per_segment
            for k in check.lost:
                self.lost.append((k, f"acknowledged before the kill ending life {life} and gone "
                                     "after it, while a value acknowledged before it was sent "
                                     "is still held"))
            if len(check.unknown) > check.unknown_allowed:
                for k in check.unknown:
                    self.lost.append((k, f"gone after the kill ending life {life}: "
                                         f"{len(check.unknown)} such values, more than the "
                                         f"{check.unknown_allowed} the store could have reclaimed "
                                         "after the last read of /removed"))
            else:
                self.unknown += len(check.unknown)
            self._last_read = t
            self._gap = (self.sent_bytes, self.inflight_bytes)
            self.checks.append(check)
            return check
