"""gdkvd's removed keys through gdkv.engine.RemovalFeed, against real gdkvd processes: over a
client's own connection (one namespace: another tenant's removals are never seen) and from
/removed on the metrics port (every namespace); deletes and evictions in order, across pages, a
restart and records dropped reported as missed, an unreachable gdkvd is no error. The
connector's use of it (BlockRemoved on the engine's KV events) is in test_vllm_features.py; the
C++ side in metrics_server_test, vfio_user_e2e_test (log page C0h) and each backend's tests."""

from __future__ import annotations

import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

import gdkv
from conftest import Gdkvd
from gdkv.engine import RemovalFeed


def key(i: int) -> bytes:
    return b"removal-%08d" % i


def test_deletes_and_evictions_in_order_across_pages():
    # 64 KiB of memory store: 5,000 values of 1 KiB evict about 4,940, more than a page (4,096).
    d = Gdkvd("--backend", "memory", "--memory-capacity", str(64 << 10), metrics=True)
    try:
        feed = RemovalFeed(d.url("/removed"))
        assert feed.poll() == []       # the first call takes the position
        with gdkv.connect(d.dir) as c:
            for i in range(3):
                c.put(key(i), b"v" * 1024)
            c.delete(key(1))
            with pytest.raises(gdkv.errors.KeyNotFoundError):
                c.delete(key(1))       # absent: nothing removed
            assert feed.poll() == [key(1)]
            assert feed.poll() == []
            for i in range(3, 5000):
                c.put(key(i), b"v" * 1024)
            got = feed.poll()
            assert got is not None and len(got) > RemovalFeed.PAGE
            # Least recently used first: 0, 2, 3, ... each once, and none is held any more.
            assert got[:3] == [key(0), key(2), key(3)]
            assert len(set(got)) == len(got)
            assert got == sorted(got)
            held = set(c.list())
            assert not held & set(got)
            assert held | set(got) | {key(1)} == {key(i) for i in range(5000)}
    finally:
        d.stop()


def test_a_clients_feed_sees_only_its_namespace():
    """Two namespaces of one gdkvd (two tenants' key spaces) and one this process may not use:
    RemovalFeed over a client follows its own namespace only, over the NVMe connection."""
    other = os.getuid() + 4242
    d = Gdkvd("--backend", "memory", "--memory-capacity", str(256 << 10),
              "--namespace", "nsid=1,backend_namespace=1,name=a",
              "--namespace", "nsid=2,backend_namespace=2,name=b",
              "--namespace", f"nsid=3,backend_namespace=3,name=c,uids={other}")
    try:
        with gdkv.connect(d.dir, nsid=1) as a, gdkv.connect(d.dir, nsid=2) as b:
            feed_a, feed_b = RemovalFeed(a), RemovalFeed(b)
            assert feed_a.poll() == [] and feed_b.poll() == []
            start = b.removed()
            assert start.keys == [] and not start.lost
            bkey = lambda i: b"tenant-b-%04d" % i  # noqa: E731 (B's names, unlike A's)
            for i in range(3):
                a.put(key(i), b"a" * 100)
                b.put(bkey(i), b"b" * 100)
            a.delete(key(0))
            a.delete(key(1))
            b.delete(bkey(2))
            assert feed_a.poll() == [key(0), key(1)]
            assert feed_b.poll() == [bkey(2)]
            # A's evictions (1 KiB values into a 256 KiB store, which both namespaces share):
            # A's feed has A's keys only, B's feed B's only (the store may evict B's too).
            for i in range(10, 400):
                a.put(key(i), b"x" * 1024)
            got_a, got_b = feed_a.poll(), feed_b.poll()
            assert got_a and not set(got_a) & set(a.list())
            assert all(k.startswith(b"removal-") for k in got_a), got_a
            assert all(k.startswith(b"tenant-b-") for k in got_b), got_b
            page = b.removed(start.last)
            assert page.keys[0] == bkey(2) and page.boot == start.boot
            assert all(k.startswith(b"tenant-b-") for k in page.keys)
            # A namespace this peer may not use; one that does not exist.
            for ns in (3, 9):
                with pytest.raises(gdkv.Error) as e:
                    a.removed(start.last, nsid=ns)
                assert e.value.status == 0x0B
            # A cursor from the future (another boot's): lost.
            assert a.removed(start.last + 10**9).lost
    finally:
        d.stop()


def test_in_process_clients_have_no_removal_log():
    with gdkv.open(backend="memory") as c:
        with pytest.raises(ValueError):
            c.removed()
        feed = RemovalFeed(c)
        assert feed.poll() == [] and feed.cursor is None    # warned, nothing known
    with pytest.raises(TypeError):
        RemovalFeed(42)


class _FakeClient:
    """Answers removed() from ``answers`` in turn (an exception is raised)."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.calls = []

    def removed(self, after, *, nsid=0, max_records=4096):
        self.calls.append((after, nsid, max_records))
        a = self.answers.pop(0)
        if isinstance(a, BaseException):
            raise a
        return a


def test_a_client_feed_checks_answers_and_pages():
    R = gdkv.client.Removed
    keys = [key(i) for i in range(RemovalFeed.PAGE)]
    fake = _FakeClient(
        R(7, 10, False, [], False),                       # the position
        gdkv.errors.ConnectionError("gone"),             # unavailable: [] and the cursor kept
        R(7, 9, False, [key(1)], False),                 # behind the cursor: refused
        R(7, 12, False, [b""], False),                   # not a key: refused
        R(7, 12, False, [key(1)], False),
        R(7, 12 + RemovalFeed.PAGE, False, keys, True),  # a full page, more follow
        R(7, 20 + RemovalFeed.PAGE, False, [key(2)], False),
        R(7, 30 + RemovalFeed.PAGE, True, [key(3)], False),   # lost
        R(8, 5, True, [], False),                        # another boot: a restart
    )
    feed = RemovalFeed(fake, nsid=2)
    assert feed.poll() == [] and feed.cursor == 10 and feed.boot == 7
    assert fake.calls[0] == (None, 2, RemovalFeed.PAGE)
    for _ in range(3):
        assert feed.poll() == [] and feed.cursor == 10
    assert feed.poll() == [key(1)] and feed.cursor == 12
    assert feed.poll() == keys + [key(2)] and feed.cursor == 20 + RemovalFeed.PAGE
    assert feed.poll() is None and feed.cursor == 30 + RemovalFeed.PAGE
    assert feed.poll() is None and (feed.boot, feed.cursor) == (8, 5)
    assert not fake.answers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_restart_is_reported_as_missed_and_a_down_gdkvd_is_no_error(tmp_path):
    port = free_port()
    args = ("--backend", "local", "--store", str(tmp_path / "store"), "--capacity",
            str(256 << 20))
    feed = RemovalFeed(f"http://127.0.0.1:{port}/removed", timeout_s=1)
    # First life: the position, then one delete. Second life (a restart on the same store and
    # port): what went meanwhile is not known (None), then one delete.
    for life, first in ((1, []), (2, None)):
        d = Gdkvd(*args, metrics=True, metrics_port=port)
        try:
            assert feed.poll() == first
            with gdkv.connect(d.dir) as c:
                c.put(key(life), b"x" * 100)
                c.delete(key(life))
            assert feed.poll() == [key(life)]
        finally:
            d.stop()
        if life == 1:
            assert feed.poll() == []   # down: nothing known, no error, the cursor kept


class _Canned(BaseHTTPRequestHandler):
    pages: list = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = json.dumps(self.pages.pop(0)).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_dropped_records_a_broken_watch_and_other_namespaces():
    """What gdkvd reports that a real run cannot easily make happen (65,536 records dropped
    unread; a RADOS watch that broke), served as gdkvd serves it."""
    server = HTTPServer(("127.0.0.1", 0), _Canned)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    page = lambda last, first, lost, removed: dict(  # noqa: E731
        boot=7, last=last, first=first, lost=lost, removed=removed)
    _Canned.pages = [
        page(10, 1, False, []),
        page(12, 1, False, [[11, 1, key(1).hex()], [12, 2, key(2).hex()]]),
        page(99, 50, True, [[50, 1, key(3).hex()]]),
        page(101, 50, False, [[100, 0, ""], [101, 1, key(4).hex()]]),
        page(101, 50, False, []),
    ]
    try:
        feed = RemovalFeed(f"http://127.0.0.1:{server.server_port}/removed", nsid=1)
        assert feed.poll() == [] and feed.cursor == 10
        assert feed.poll() == [key(1)]          # namespace 2's key is not followed
        assert feed.poll() is None and feed.cursor == 99   # dropped unread
        assert feed.poll() is None              # nsid 0: the watch broke
        assert feed.poll() == [] and feed.cursor == 101
    finally:
        server.shutdown()
    with pytest.raises(ValueError):
        RemovalFeed("127.0.0.1:9/removed")


class _Raw(BaseHTTPRequestHandler):
    """Serves ``answers`` in turn: (Content-Length, body bytes), a function of the query's
    ``after``, or the last one again."""
    answers: list = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if callable(answer):
            after = int(self.path.split("after=")[1]) if "after=" in self.path else None
            answer = answer(after)
        length, body = answer
        self.send_response(200)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _json(**page) -> tuple[int, bytes]:
    body = json.dumps(page).encode()
    return len(body), body


def test_a_bad_answer_is_no_error_and_keeps_the_cursor():
    """A cut-off, malformed or non-advancing /removed answer: poll warns and returns [] with the
    cursor kept (it never raises, never loops), and the next good answer is read from there."""
    server = HTTPServer(("127.0.0.1", 0), _Raw)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    good = dict(boot=7, last=10, first=1, lost=False, removed=[])
    full = lambda seq: [[seq, 1, key(0).hex()]] * RemovalFeed.PAGE  # noqa: E731 (one seq)
    bad = [
        (1000, json.dumps(good).encode()[:20]),          # cut off (http.client.IncompleteRead)
        (9, b"not json!"),
        _json(boot=7, last=10, first=1, lost=False),     # no "removed"
        _json(boot=7, last=10, first=1, lost="no", removed=[]),
        _json(boot="7", last=10, first=1, lost=False, removed=[]),
        _json(boot=7, last=12, first=1, lost=False, removed=[[11, 1]]),
        _json(boot=7, last=12, first=1, lost=False, removed=[[11, 1, "xyz"]]),
        _json(boot=7, last=12, first=1, lost=False, removed=[[11, None, key(1).hex()]]),
        _json(boot=7, last=12, first=1, lost=False, removed=[[13, 1, key(1).hex()]]),
        _json(boot=7, last=12, first=1, lost=False, removed=[[10, 1, key(1).hex()]]),
        _json(boot=7, last=12, first=1, lost=False, removed=[[12, 1, ""], [11, 1, ""]]),
        _json(boot=7, last=10, first=1, lost=False, removed=full(10)),   # never advances
        _json(boot=7, last=20, first=1, lost=False, removed=[7]),
        (2, b"[]"),
    ]
    _Raw.answers = [_json(**good), *bad,
                    _json(boot=7, last=11, first=1, lost=False, removed=[[11, 1, key(5).hex()]])]
    try:
        feed = RemovalFeed(f"http://127.0.0.1:{server.server_port}/removed", timeout_s=2)
        assert feed.poll() == [] and feed.cursor == 10
        for answer in bad:
            assert feed.poll() == [], answer
            assert feed.cursor == 10 and feed.boot == 7
        assert feed.poll() == [key(5)] and feed.cursor == 11
        # A feed that always has a full page more: one poll reads MAX_PAGES of them and returns.
        _Raw.answers = [lambda after: _json(
            boot=7, last=after + RemovalFeed.PAGE + 1, first=1, lost=False,
            removed=[[after + 1 + i, 1, key(i).hex()] for i in range(RemovalFeed.PAGE)])]
        got = feed.poll()
        assert len(got) == RemovalFeed.PAGE * RemovalFeed.MAX_PAGES
        assert feed.cursor == 11 + RemovalFeed.PAGE * RemovalFeed.MAX_PAGES
    finally:
        server.shutdown()
