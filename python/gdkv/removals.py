"""gdkvd's removed keys, followed by the connectors that publish KV events
(:class:`RemovalFeed`): over a client's own gdkvd connection (one namespace, log page C0h), or
from ``/removed`` on gdkvd's metrics port (every namespace, for routers)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

log = logging.getLogger("gdkv.engine")


@dataclass
class _Page:
    """One read, either source: the keys of the namespace followed, and where to go on."""

    boot: int
    next: int                     # the cursor after this page
    newest: int                   # the newest sequence number gdkvd gave (at least `next`)
    lost: bool                    # removals were missed (dropped, a broken watch, a restart)
    more: bool                    # a full page: read again at once
    keys: list[bytes] = field(default_factory=list)


class RemovalFeed:
    """Follows the keys gdkvd's store stopped holding (deleted, evicted by the local store, the
    memory backend or this node's RADOS eviction), in order (docs/integrations.md, "KV events").

    ``source`` is either a connected :class:`gdkv.Client` (``gdkv.connect``): the removals of
    its namespace (or ``nsid``, an NVMe namespace the connection may use), read over the
    connection, so another tenant's removals are never seen; or the ``http://`` URL of gdkvd's
    ``/removed`` (every namespace; ``nsid`` then names a backend namespace, None: all), for a
    router on the metrics port.

    :meth:`poll` returns the keys removed since the previous call, reading at most MAX_PAGES
    pages (the rest: the next call). The first successful call only takes the feed's current
    position and returns ``[]``. It returns None when removals may have been missed: gdkvd
    restarted (its ``boot`` changed), the feed dropped records before they were read, or a
    RADOS watch broke; the caller then treats every key it follows as possibly gone. An
    unreachable gdkvd or a malformed answer is ``[]`` (with a warning once) and the cursor is
    kept. Not thread-safe: one poller."""

    PAGE = 4096  # gdkvd's records per answer
    MAX_PAGES = 16  # pages read by one poll (gdkvd's log holds 65,536 records); the rest: next

    def __init__(self, source: Any, nsid: Optional[int] = None, timeout_s: float = 2.0):
        if isinstance(source, str):
            if not source.startswith(("http://", "https://")):
                raise ValueError(f"gdkv: removals_url must be an http:// URL, not {source!r}")
            self.url: Optional[str] = source.split("?", 1)[0]
            self.client = None
        elif callable(getattr(source, "removed", None)):
            self.url, self.client = None, source
        else:
            raise TypeError(f"gdkv: RemovalFeed takes a gdkv.Client or an http:// URL, "
                            f"not {type(source).__name__}")
        self.nsid = nsid
        self.timeout_s = timeout_s
        self.boot: Optional[int] = None
        self.cursor: Optional[int] = None
        self._warned = False

    def _get(self, after: Optional[int]) -> Optional[_Page]:
        """The page after ``after``, checked; None, with a warning once, when gdkvd cannot be
        read or its answer is cut off or malformed."""
        import http.client
        import urllib.error
        import urllib.request

        from .errors import Error
        where = self.url if self.client is None else "the gdkvd connection"
        try:
            if self.client is not None:
                got = self.client.removed(after, nsid=self.nsid or 0, max_records=self.PAGE)
                page = _checked_client(got, after)
            else:
                url = self.url if after is None else f"{self.url}?after={after}"
                where = url
                with urllib.request.urlopen(url, timeout=self.timeout_s) as r:
                    page = self._from_json(_checked(json.loads(r.read()), after), after)
        except (OSError, ValueError, TypeError, Error, http.client.HTTPException,
                urllib.error.URLError) as e:
            if not self._warned:
                log.warning("gdkv: cannot read gdkvd's removals from %s (%s); retrying", where, e)
                self._warned = True
            return None
        self._warned = False
        return page

    def _from_json(self, page: dict, after: Optional[int]) -> _Page:
        records = page["removed"]
        out = _Page(page["boot"], page["last"] if after is None else after, page["last"],
                    page["lost"], len(records) >= self.PAGE)
        for seq, nsid, key in records:
            out.next = seq
            if nsid == 0:
                out.lost = True
            elif self.nsid is None or nsid == self.nsid:
                out.keys.append(bytes.fromhex(key))
        return out

    def poll(self) -> Optional[list[bytes]]:
        page = self._get(self.cursor)
        if page is None:
            return []
        if self.cursor is None or page.boot != self.boot:
            restarted = self.boot is not None
            if restarted and page.next != page.newest:   # start from the new life's newest
                page = self._get(None) or page
            self.boot, self.cursor = page.boot, page.newest
            return None if restarted else []
        missed = page.lost
        keys: list[bytes] = []
        for pages in range(1, self.MAX_PAGES + 1):
            keys += page.keys
            self.cursor = page.next
            if not page.more or pages == self.MAX_PAGES:
                break
            nxt = self._get(self.cursor)
            if nxt is None or nxt.boot != self.boot:
                missed = True
                break
            page = nxt
            missed = missed or page.lost
        if missed:
            self.cursor = max(self.cursor, page.newest)   # the caller starts over anyway
            return None
        return keys


def _checked(page: Any, after: Optional[int]) -> dict:
    """``page`` if it is a /removed answer whose records follow ``after`` in order (so a poll
    always advances); ValueError otherwise."""
    if not isinstance(page, dict) or not isinstance(page.get("lost"), bool):
        raise ValueError("not a /removed answer")
    for name in ("boot", "last", "first"):
        if not _count(page.get(name)):
            raise ValueError(f"no {name!r} count")
    records = page.get("removed")
    if not isinstance(records, list):
        raise ValueError("no 'removed' list")
    last = after
    for r in records:
        if not (isinstance(r, list) and len(r) == 3 and _count(r[0]) and _count(r[1])
                and isinstance(r[2], str)):
            raise ValueError(f"bad record {r!r}")
        if (last is not None and r[0] <= last) or r[0] > page["last"]:
            raise ValueError(f"record {r[0]} out of order")
        bytes.fromhex(r[2])   # ValueError if not hex
        last = r[0]
    return page


def _checked_client(got: Any, after: Optional[int]) -> _Page:
    """A :meth:`gdkv.Client.removed` answer as a page, if it moves forward from ``after`` (or,
    lost, says so) and holds keys; ValueError otherwise."""
    boot, nxt, lost, keys, more = got
    if not (_count(boot) and _count(nxt) and isinstance(lost, bool) and isinstance(more, bool)
            and isinstance(keys, list)):
        raise ValueError(f"not a removed() answer: {got!r}")
    if after is not None and nxt < after and not lost:
        raise ValueError(f"cursor {nxt} behind {after}")
    if after is not None and more and nxt <= after:
        raise ValueError(f"cursor {nxt} does not advance")
    if not all(isinstance(k, bytes) and 1 <= len(k) <= 16 for k in keys):
        raise ValueError("a key that is not 1..16 bytes")
    if len(keys) > RemovalFeed.PAGE:
        raise ValueError(f"{len(keys)} keys in one page")
    return _Page(boot, nxt, nxt, lost, more, list(keys))


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
