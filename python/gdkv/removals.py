"""gdkvd's feed of removed keys (``/removed``), followed by the connectors that publish KV
events (:class:`RemovalFeed`)."""

from __future__ import annotations

import json
import logging
from typing import Any, Optional

log = logging.getLogger("gdkv.engine")


class RemovalFeed:
    """Follows gdkvd's feed of removed keys, ``GET /removed?after=SEQ`` on its metrics port
    (docs/integrations.md, "KV events"): the keys its store stopped holding (deleted, evicted by
    the local store, the memory backend or this node's RADOS eviction), in order.

    :meth:`poll` returns the keys removed since the previous call, reading every page there is.
    The first successful call only takes the feed's current position and returns ``[]``. It
    returns None when removals may have been missed: gdkvd restarted (its ``boot`` changed), the
    feed dropped records before they were read, or a RADOS watch broke (a record with nsid 0); the
    caller then treats every key it follows as possibly gone. An unreachable gdkvd is ``[]`` (with
    a warning once) and the cursor is kept. ``nsid`` limits the keys to one backend namespace
    (None: all). Not thread-safe: one poller."""

    PAGE = 4096  # gdkvd's records per answer
    MAX_PAGES = 16  # pages read by one poll (gdkvd's log holds 65,536 records); the rest: next

    def __init__(self, url: str, nsid: Optional[int] = None, timeout_s: float = 2.0):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"gdkv: removals_url must be an http:// URL, not {url!r}")
        self.url = url.split("?", 1)[0]
        self.nsid = nsid
        self.timeout_s = timeout_s
        self.boot: Optional[int] = None
        self.cursor: Optional[int] = None
        self._warned = False

    def _get(self, after: Optional[int]) -> Optional[dict]:
        """The page after ``after``, checked (:func:`_checked`); None, with a warning once, when
        gdkvd cannot be read or its answer is cut off or malformed."""
        import http.client
        import urllib.error
        import urllib.request
        url = self.url if after is None else f"{self.url}?after={after}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as r:
                page = _checked(json.loads(r.read()), after)
        except (OSError, ValueError, http.client.HTTPException, urllib.error.URLError) as e:
            if not self._warned:
                log.warning("gdkv: cannot read gdkvd's removals at %s (%s); retrying", url, e)
                self._warned = True
            return None
        self._warned = False
        return page

    def poll(self) -> Optional[list[bytes]]:
        page = self._get(self.cursor)
        if page is None:
            return []
        if self.cursor is None or page["boot"] != self.boot:
            restarted = self.boot is not None
            self.boot, self.cursor = page["boot"], page["last"]
            return None if restarted else []
        missed = page["lost"]
        keys: list[bytes] = []
        for pages in range(1, self.MAX_PAGES + 1):
            for seq, nsid, key in page["removed"]:
                self.cursor = seq
                if nsid == 0:
                    missed = True
                elif self.nsid is None or nsid == self.nsid:
                    keys.append(bytes.fromhex(key))
            if len(page["removed"]) < self.PAGE or pages == self.MAX_PAGES:
                break
            page = self._get(self.cursor)
            if page is None or page["boot"] != self.boot:
                missed = True
                break
            missed = missed or page["lost"]
        if missed:
            if page is not None and page["boot"] == self.boot:
                self.cursor = max(self.cursor, page["last"])  # the caller starts over anyway
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


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
