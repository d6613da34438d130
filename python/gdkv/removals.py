"""gdkvd's feed of removed keys (``/removed``), followed by the connectors that publish KV
events (:class:`RemovalFeed`)."""

from __future__ import annotations

import json
import logging
from typing import Optional

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
        import urllib.error
        import urllib.request
        url = self.url if after is None else f"{self.url}?after={after}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as r:
                page = json.loads(r.read())
        except (OSError, ValueError, urllib.error.URLError) as e:
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
        missed = bool(page["lost"])
        keys: list[bytes] = []
        while True:
            for seq, nsid, key in page["removed"]:
                self.cursor = seq
                if nsid == 0:
                    missed = True
                elif self.nsid is None or nsid == self.nsid:
                    keys.append(bytes.fromhex(key))
            if len(page["removed"]) < self.PAGE:
                break
            page = self._get(self.cursor)
            if page is None or page["boot"] != self.boot:
                missed = True
                break
            missed = missed or bool(page["lost"])
        if missed:
            if page is not None and page["boot"] == self.boot:
                self.cursor = max(self.cursor, page["last"])  # the caller starts over anyway
            return None
        return keys
