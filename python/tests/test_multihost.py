"""Several hosts on one machine: tiered gdkvd nodes (DRAM cache, local store,
RADOS) in network namespaces of their own, the Ceph cluster in another, so every RADOS op crosses
a veth link and a bridge (scripts/netns-hosts). Clients run beside their gdkvd: a client process
started in the host's namespace (unix sockets with paths work across network namespaces, but a
client beside its node is the deployment's shape), and /metrics is read from inside that
namespace (it listens on the namespace's own 127.0.0.1).

Needs root and `ip netns`; without them the module is skipped. Everything else missing (gdkvd,
the Ceph packages) fails. The namespaces are $GDKV_MULTIHOST_PREFIX-ceph, -h0, -h1 (default
prefix gdkvpy, so a manual `scripts/netns-hosts up` with its default prefix gdkv is not touched);
the module brings them up once and down at the end, also when a test fails.

Reusable pieces for more tests: the `hosts` fixture (a list of Host, one per namespace); Host.start
(a gdkvd with TOML overrides), Host.metric (one value of its /metrics), Host.client (a snippet of
Python run beside its gdkvd, returning what it passes to out()), Host.spawn (the same in the
background).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import gdkv
from conftest import GDKVD, ROOT, gdkvd_proc

pytestmark = pytest.mark.multihost

NETNS_HOSTS = ROOT / "scripts" / "netns-hosts"
PREFIX = os.environ.get("GDKV_MULTIHOST_PREFIX", "gdkvpy")
N_HOSTS = 2
PY = sys.executable
CEPH_TIMEOUT_MS = 3000  # backend.ceph_timeout_ms of every gdkvd these tests start
NOT_READY = 0x82

# What a client snippet starts with (Host.client): its arguments, a connection to its host's
# gdkvd, values derived from their keys (so any host can check any value), and out() for the
# result (one JSON line on stdout).
PRELUDE = '''
import json, sys, time
import numpy as np
import gdkv

ARGS = json.loads(sys.argv[1])
SOCK = ARGS["socket_dir"]


def connect(**kw):
    return gdkv.connect(SOCK, **kw)


def value_for(key: bytes, size: int) -> np.ndarray:
    seed = int.from_bytes(gdkv.hash128(bytes(key))[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def matches(c, key: bytes, size: int) -> bool:
    """Whether key reads back as value_for(key, size), byte for byte."""
    try:
        got = c.get(key, size_hint=size)
    except KeyError:
        return False
    return got == value_for(key, size).tobytes()


def expect_match(c, key: bytes, size: int) -> None:
    """Raises unless key reads back as value_for(key, size) (gdkv errors pass through)."""
    if c.get(key, size_hint=size) != value_for(key, size).tobytes():
        raise ValueError(f"{key.hex()}: wrong bytes")


def attempt(fn, *args, **kw):
    """Runs one call: {"ok", "status", "error", "ms"} (status -1 for an error not from gdkv)."""
    t0 = time.monotonic()
    try:
        fn(*args, **kw)
        r = {"ok": True, "status": 0, "error": None}
    except gdkv.Error as e:
        r = {"ok": False, "status": e.status, "error": type(e).__name__ + ": " + str(e)}
    except Exception as e:
        r = {"ok": False, "status": -1, "error": type(e).__name__ + ": " + str(e)}
    r["ms"] = (time.monotonic() - t0) * 1000
    return r


def out(obj):
    print("RESULT " + json.dumps(obj), flush=True)
'''


def value_for(key: bytes, size: int) -> np.ndarray:
    """The value stored under key (the prelude's, for checks in the test process)."""
    seed = int.from_bytes(gdkv.hash128(bytes(key))[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def keys_hex(keys) -> list[str]:
    return [bytes(k).hex() for k in keys]


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string is a JSON string for these values
    raise TypeError(f"no TOML for {v!r}")


def toml_text(config: dict) -> str:
    """{"": top-level keys, "backend": {...}, ...} as TOML (top-level keys first)."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in config.get("", {}).items()]
    for section, values in config.items():
        if section:
            lines.append(f"[{section}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


class Host:
    """One host namespace (h0, h1, ...): its gdkvd, and clients beside it."""

    def __init__(self, net: "Net", index: int):
        self.net = net
        self.index = index
        self.name = f"h{index}"
        self.ns = f"{net.prefix}-h{index}"
        self.dir = net.dir / self.name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.socket_dir = self.dir / "sock"
        self.gdkvd: gdkvd_proc.Gdkvd | None = None
        self._runs = 0
        self._spawned: list[subprocess.Popen] = []

    # ---- gdkvd ----
    def config(self, overrides: dict | None = None, *, store: str | None = None) -> dict:
        """The TOML of a tiered node on the netns cluster, with overrides ({section: {key: v}},
        section "" for top-level keys) applied on top."""
        cfg = {
            "": {"socket_dir": str(self.socket_dir), "metrics_port": 0,
                 "metrics_bind": "127.0.0.1"},
            "backend": {"kind": "tiered", "store": store or str(self.dir / "store"),
                        "capacity_bytes": 256 << 20, "segment_bytes": 16 << 20,
                        "pool": "gdkv-rep3", "ceph_conf": self.net.ceph_conf,
                        "ceph_client": "client.admin", "ceph_timeout_ms": CEPH_TIMEOUT_MS},
            "controller": {"reactors": 1},
            "cache": {"bytes": 64 << 20},
        }
        for section, values in (overrides or {}).items():
            cfg.setdefault(section, {}).update(values)
        return cfg

    def start(self, overrides: dict | None = None, *, extra_toml: str = "",
              fresh_store: bool = True) -> gdkvd_proc.Gdkvd:
        """Starts this host's gdkvd (stopping one already running). fresh_store: an empty local
        store (else the one the last gdkvd here left). extra_toml: appended as it is (tables
        such as [[namespace]])."""
        if self.gdkvd is not None:
            self.gdkvd.stop()
        self._runs += 1
        store = self.dir / "store"
        if fresh_store and store.exists():
            shutil.rmtree(store)
        # The tests' gdkvd (bench/python/gdkvd_proc.py), exec'd in this host's namespace: its
        # pid is gdkvd itself, in a session of its own (kill -9 reaches it and nothing else).
        self.gdkvd = gdkvd_proc.Gdkvd(binary=GDKVD, config=toml_text(self.config(overrides)) +
                                      extra_toml, metrics=True, socket_dir=self.socket_dir,
                                      wrap=["ip", "netns", "exec", self.ns])
        return self.gdkvd

    # ---- /metrics ----
    def metrics(self) -> dict[str, float]:
        """This host's gdkvd /metrics, read inside its namespace: {'name{labels}': value}."""
        assert self.gdkvd is not None, "no gdkvd here"
        samples = self.gdkvd.metrics()
        assert samples, f"/metrics on {self.name}: nothing read\n{self.gdkvd.log()[-2000:]}"
        return samples

    def metric(self, name: str, samples: dict[str, float] | None = None, **labels: str) -> float:
        """The sum of metric `name` (gdkv_ prefix optional) over the samples whose labels include
        `labels`: host.metric("rados_ops_total", op="get")."""
        if not name.startswith("gdkv_"):
            name = "gdkv_" + name
        samples = self.metrics() if samples is None else samples
        total, found = 0.0, False
        for key, value in samples.items():
            base, _, rest = key.partition("{")
            if base != name:
                continue
            have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest))
            if all(have.get(k) == v for k, v in labels.items()):
                total, found = total + value, True
        assert found, f"{self.name} has no metric {name} {labels}"
        return total

    # ---- clients beside the gdkvd ----
    def _client_cmd(self, code: str, args: dict) -> list[str]:
        self._runs += 1
        path = self.dir / f"client-{self._runs}.py"
        path.write_text(PRELUDE + "\n" + textwrap.dedent(code))
        args = {"socket_dir": str(self.socket_dir), **args}
        return ["ip", "netns", "exec", self.ns, PY, "-P", str(path), json.dumps(args)]

    def client(self, code: str, timeout: float = 120, **args):
        """Runs `code` (after PRELUDE) in a new process in this host's namespace; returns the
        object it passed to out(). ARGS holds socket_dir and `args` (JSON values)."""
        r = subprocess.run(self._client_cmd(code, args), capture_output=True, text=True,
                           timeout=timeout, cwd=self.dir)
        results = [ln[7:] for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        assert r.returncode == 0 and results, (
            f"client on {self.name} failed (rc {r.returncode}):\n{r.stdout}\n{r.stderr}")
        return json.loads(results[-1])

    def spawn(self, code: str, **args) -> subprocess.Popen:
        """Host.client in the background: a Popen (text stdout/stderr pipes); result() reads it."""
        p = subprocess.Popen(self._client_cmd(code, args), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=self.dir,
                             start_new_session=True)
        self._spawned.append(p)
        return p

    @staticmethod
    def result(p: subprocess.Popen, timeout: float = 120):
        """The out() object of a spawned client, once it exits."""
        stdout, stderr = p.communicate(timeout=timeout)
        results = [ln[7:] for ln in stdout.splitlines() if ln.startswith("RESULT ")]
        assert p.returncode == 0 and results, (
            f"spawned client failed (rc {p.returncode}):\n{stdout}\n{stderr}")
        return json.loads(results[-1])

    def cleanup(self) -> None:
        for p in self._spawned:
            if p.poll() is None:
                p.kill()
                p.communicate()
        self._spawned.clear()
        if self.gdkvd is not None:
            self.gdkvd.stop()
            self.gdkvd = None


class Net:
    """The namespaces of scripts/netns-hosts and its Ceph cluster."""

    def __init__(self, prefix: str, directory: Path, ceph_conf: str):
        self.prefix = prefix
        self.dir = directory
        self.ceph_conf = ceph_conf

    @staticmethod
    def script(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        env = {**os.environ, "GDKV_NETNS_PREFIX": PREFIX}
        env.pop("GDKV_NETNS_DIR", None)
        return subprocess.run([str(NETNS_HOSTS), *args], capture_output=True, text=True,
                              env=env, timeout=timeout)

    def cut(self, host: Host) -> None:
        r = self.script("cut", host.name)
        assert r.returncode == 0, r.stdout + r.stderr

    def restore(self, host: Host) -> None:
        r = self.script("restore", host.name)
        assert r.returncode == 0, r.stdout + r.stderr


def _skip_unless_netns() -> None:
    if os.geteuid() != 0:
        pytest.skip("multihost tests need root (network namespaces)")
    if shutil.which("ip") is None:
        pytest.skip("multihost tests need iproute2's `ip netns`")
    r = subprocess.run(["ip", "netns", "list"], capture_output=True)
    if r.returncode != 0:
        pytest.skip("`ip netns` does not work here: " + r.stderr.decode(errors="replace"))


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    _skip_unless_netns()
    assert GDKVD.exists(), f"{GDKVD} is missing: build the C++ tree first"
    Net.script("down")  # what an interrupted run of this module left
    t0 = time.monotonic()
    r = Net.script("up", str(N_HOSTS))
    try:
        assert r.returncode == 0, f"scripts/netns-hosts up failed:\n{r.stdout}\n{r.stderr}"
        ceph_conf = r.stdout.strip().splitlines()[-1]
        assert Path(ceph_conf).is_file(), r.stdout
        print(f"\nscripts/netns-hosts up {N_HOSTS}: {time.monotonic() - t0:.1f} s")
        yield Net(PREFIX, tmp_path_factory.mktemp("multihost"), ceph_conf)
    finally:
        d = Net.script("down")
        assert d.returncode == 0, f"scripts/netns-hosts down failed:\n{d.stdout}\n{d.stderr}"


@pytest.fixture
def hosts(net):
    """One Host per namespace; whatever a test started on them is stopped after it."""
    hs = [Host(net, i) for i in range(N_HOSTS)]
    yield hs
    for h in hs:
        h.cleanup()


def fresh_salt() -> str:
    """A salt of this test's own: the module's tests share one cluster, so keys derived from it
    are new to the pool."""
    return "multihost-" + uuid.uuid4().hex


STORE_BLOCKS = '''
c = connect()
keys = [bytes.fromhex(k) for k in ARGS["keys"]]
gdkv.raise_first(c.put_many([(k, value_for(k, s)) for k, s in zip(keys, ARGS["sizes"])]))
out({"stored": len(keys)})
'''

READ_BLOCKS = '''
c = connect()
keys = [bytes.fromhex(k) for k in ARGS["keys"]]
found = c.lookup_prefix(keys[:ARGS["chain"]]) if ARGS.get("chain") else None
out({"prefix": found, "matches": [matches(c, k, s) for k, s in zip(keys, ARGS["sizes"])]})
'''


def test_b_loads_what_a_stored_then_serves_it_without_rados(hosts):
    """A prompt's blocks stored on h0 are found and loaded byte-exact on h1 (through RADOS, over
    the veth link); h1's DRAM cache, then (after a restart, cache empty) its local store serve
    them again without one RADOS read."""
    a, b = hosts
    a.start()
    b.start()
    salt = fresh_salt()
    chain = gdkv.chain_keys(range(64 * 3), 64, salt)  # 3 blocks of 64 KiB
    big = [gdkv.hash128(f"{salt}-big-{i}".encode()) for i in range(3)]  # 3 of 2 MiB
    keys = keys_hex(chain + big)
    sizes = [64 << 10] * 3 + [2 << 20] * 3
    args = dict(keys=keys, sizes=sizes, chain=3)

    assert a.client(STORE_BLOCKS, keys=keys, sizes=sizes) == {"stored": 6}
    assert a.metric("rados_ops_total", op="put") >= 6

    before = b.metrics()
    first = b.client(READ_BLOCKS, **args)
    assert first == {"prefix": 3, "matches": [True] * 6}
    after_first = b.metrics()
    assert b.metric("rados_ops_total", after_first, op="get") - \
        b.metric("rados_ops_total", before, op="get") >= 6  # the first reads came from RADOS
    assert b.metric("tiered_far_reads_total", after_first) >= 6
    assert b.metric("tiered_fills_total", after_first) >= 6

    # Second round: the DRAM cache serves them; RADOS is not read.
    again = b.client(READ_BLOCKS, keys=keys, sizes=sizes)
    after_second = b.metrics()
    assert again["matches"] == [True] * 6
    assert b.metric("rados_ops_total", after_second, op="get") == \
        b.metric("rados_ops_total", after_first, op="get")
    assert b.metric("cache_hits_total", after_second) - \
        b.metric("cache_hits_total", after_first) >= 6

    # A restart empties the DRAM cache; the local store (kept) serves them, still no RADOS read.
    b.start(fresh_store=False)
    third = b.client(READ_BLOCKS, keys=keys, sizes=sizes)
    m = b.metrics()
    assert third["matches"] == [True] * 6
    assert b.metric("rados_ops_total", m, op="get") == 0, m
    assert b.metric("tiered_near_hits_total", m) >= 6


STORE_STREAM = '''
# Stores blocks until gdkvd goes away; each key is appended to the ack file once its Store was
# acknowledged (so every line there was acknowledged).
c = connect(timeout_ms=20000)
n, error = 0, None
with open(ARGS["acks"], "a") as acks:
    while n < ARGS["max"]:
        key = gdkv.hash128(f"{ARGS['salt']}-{n}".encode())
        size = ARGS["sizes"][n % len(ARGS["sizes"])]
        try:
            c.put(key, value_for(key, size))
        except gdkv.Error as e:
            error = type(e).__name__ + ": " + str(e)
            break
        acks.write(f"{key.hex()} {size}\\n")
        acks.flush()
        n += 1
out({"acked": n, "error": error})
'''

BUSY_LOOP = '''
# The other host's own work while the first one dies: Stores and Retrieves of its own keys for
# ARGS["seconds"]; every failure is recorded.
c = connect()
ops, failures, n = 0, [], 0
end = time.monotonic() + ARGS["seconds"]
while time.monotonic() < end:
    key = gdkv.hash128(f"{ARGS['salt']}-b-{n}".encode())
    for r in (attempt(c.put, key, value_for(key, 65536)),
              attempt(expect_match, c, key, 65536)):
        ops += 1
        if not r["ok"]:
            failures.append(r)
    n += 1
out({"ops": ops, "failures": failures[:5], "failed": len(failures)})
'''


def test_kill_a_mid_store_stream_leaves_b_unaffected_and_acks_durable(hosts):
    """kill -9 of h0's gdkvd while a client on h0 streams Stores: h1 keeps working throughout,
    and every Store h0 acknowledged reads back byte-exact on h1."""
    a, b = hosts
    a.start()
    b.start()
    salt = fresh_salt()
    acks = a.dir / f"acks-{salt}.txt"
    busy = b.spawn(BUSY_LOOP, salt=salt, seconds=8)
    stream = a.spawn(STORE_STREAM, salt=salt, acks=str(acks), max=100000,
                     sizes=[64 << 10, 2 << 20, 256 << 10])
    deadline = time.monotonic() + 60
    while not acks.exists() or len(acks.read_text().splitlines()) < 20:
        assert stream.poll() is None, Host.result(stream)
        assert time.monotonic() < deadline, "h0's stream acknowledged too few Stores"
        time.sleep(0.05)
    a.gdkvd.kill(signal.SIGKILL)  # mid-stream: a Store is in flight or about to be
    streamed = Host.result(stream, timeout=60)
    assert streamed["error"] and "ConnectionError" in streamed["error"], streamed
    busy_result = Host.result(busy, timeout=60)
    assert busy_result["failed"] == 0 and busy_result["ops"] > 0, busy_result

    acked = [ln.split() for ln in acks.read_text().splitlines()]
    assert len(acked) == streamed["acked"] >= 20
    keys = [k for k, _ in acked]
    sizes = [int(s) for _, s in acked]
    readback = b.client(READ_BLOCKS, keys=keys, sizes=sizes, timeout=300)
    missing = [k for k, ok in zip(keys, readback["matches"]) if not ok]
    assert not missing, f"{len(missing)} of {len(keys)} acknowledged Stores not readable on h1"
    print(f"\nh0 killed after {len(keys)} acknowledged Stores; h1 did {busy_result['ops']} ops "
          "meanwhile, none failed")
    # And h1 goes on working after the kill.
    after = b.client(BUSY_LOOP, salt=salt + "-after", seconds=1)
    assert after["failed"] == 0 and after["ops"] > 0, after
    # h0 restarted on the local store the crash left serves them too (from that store).
    a.start(fresh_store=False)
    assert a.client(READ_BLOCKS, keys=keys, sizes=sizes, timeout=300)["matches"] == \
        [True] * len(keys)


CUT_OFF_OPS = '''
# On a host cut off from the cluster: ops that need RADOS, then reads of what its tiers hold.
c = connect()
far = bytes.fromhex(ARGS["far_key"])             # in RADOS (stored by another host), not here
absent = gdkv.hash128(ARGS["salt"].encode() + b"-absent")
new = gdkv.hash128(ARGS["salt"].encode() + b"-new")
res = {
    "get_far": attempt(c.get, far),
    "get_absent": attempt(c.get, absent),
    "put_new": attempt(c.put, new, value_for(new, 65536)),
    "lookup_far": attempt(c.lookup_prefix, [far]),
}
held = [bytes.fromhex(k) for k in ARGS["held"]]
t0 = time.monotonic()
res["held"] = [matches(c, k, s) for k, s in zip(held, ARGS["held_sizes"])]
res["held_ms"] = (time.monotonic() - t0) * 1000
out(res)
'''

RECOVER = '''
# Polls until a fresh Store and a Retrieve of another host's block both succeed through RADOS.
c = connect()
far = bytes.fromhex(ARGS["far_key"])
t0 = time.monotonic()
tries, last = 0, None
while time.monotonic() - t0 < ARGS["deadline_s"]:
    tries += 1
    key = gdkv.hash128(f"{ARGS['salt']}-recover-{tries}".encode())
    p = attempt(c.put, key, value_for(key, 65536))
    g = attempt(expect_match, c, far, ARGS["far_size"]) if p["ok"] else p
    if p["ok"] and g["ok"]:
        out({"ok": True, "s": time.monotonic() - t0, "tries": tries, "key": key.hex()})
        break
    last = p if not p["ok"] else g
    time.sleep(0.2)
else:
    out({"ok": False, "s": time.monotonic() - t0, "tries": tries, "last": last})
'''


def test_cut_host_fails_fast_serves_its_tiers_and_recovers(hosts, net):
    """h1 cut off from the cluster: what needs RADOS fails with 82h within the op timeout; what
    h1's DRAM cache and local store hold is still served; after the link returns, h1 recovers by
    itself (a fresh Store and a Retrieve through RADOS succeed within seconds)."""
    a, b = hosts
    a.start()
    # A small DRAM cache: of six 2 MiB blocks it holds at most one, so most reads of them while
    # cut must come from the local store.
    b.start({"cache": {"bytes": 3 << 20}})
    salt = fresh_salt()
    far = gdkv.hash128(f"{salt}-far".encode())
    assert a.client(STORE_BLOCKS, keys=[far.hex()], sizes=[65536]) == {"stored": 1}
    held = keys_hex(gdkv.hash128(f"{salt}-held-{i}".encode()) for i in range(6))
    held_sizes = [2 << 20] * 6
    assert b.client(STORE_BLOCKS, keys=held, sizes=held_sizes) == {"stored": 6}
    near_before = b.metric("tiered_near_hits_total")

    net.cut(b)
    try:
        res = b.client(CUT_OFF_OPS, far_key=far.hex(), salt=salt, held=held,
                       held_sizes=held_sizes, timeout=120)
    finally:
        net.restore(b)
        restored = time.monotonic()
    print("\nwhile cut: " + ", ".join(f"{op} {res[op]['status']:#x} in {res[op]['ms']:.0f} ms"
                                     for op in ("get_far", "get_absent", "put_new", "lookup_far")))
    limit_ms = CEPH_TIMEOUT_MS + 1500
    for op in ("get_far", "get_absent", "put_new", "lookup_far"):
        r = res[op]
        assert not r["ok"] and r["status"] == NOT_READY, (op, r)
        assert r["ms"] < limit_ms, (op, r)
    assert res["held"] == [True] * 6, res
    assert b.metric("tiered_near_hits_total") - near_before >= 5, res

    rec = b.client(RECOVER, far_key=far.hex(), far_size=65536, salt=salt, deadline_s=60,
                   timeout=120)
    assert rec["ok"], rec
    print(f"\nh1 recovered: a Store and a Retrieve through RADOS succeeded {rec['s']:.1f} s "
          f"into the client ({rec['tries']} tries), {time.monotonic() - restored:.1f} s after "
          "the link returned (client start included)")
    # The Store h1 made after recovering is in RADOS: h0 reads it.
    assert a.client(READ_BLOCKS, keys=[rec["key"]], sizes=[65536]) == \
        {"prefix": None, "matches": [True]}


POLL_UNTIL_GONE = '''
# Reads the block until it reads as absent; reports the wall-clock time it first did, and how
# many reads returned it before (served from this host's tiers while A's Delete was on its way).
c = connect()
key = bytes.fromhex(ARGS["key"])
expect_match(c, key, ARGS["size"])  # cached here before the Delete
open(ARGS["ready"], "w").close()
served, t_end = 0, time.monotonic() + ARGS["deadline_s"]
while time.monotonic() < t_end:
    try:
        c.get(key, size_hint=ARGS["size"])
        served += 1
    except KeyError:
        out({"gone_at": time.time(), "served": served})
        break
else:
    out({"gone_at": None, "served": served})
'''

DELETE_AT = '''
c = connect()
key = bytes.fromhex(ARGS["key"])
c.delete(key)
out({"deleted_at": time.time()})
'''


def test_delete_on_a_is_seen_by_b_within_the_bound(hosts):
    """h0 deletes a block h1 holds in its DRAM cache and local store: h1 stops returning it
    within the bound docs/rados.md states (a RADOS notification; 1 s allowed here), and its
    local tier drops it too."""
    a, b = hosts
    a.start()
    b.start()
    salt = fresh_salt()
    bounds = []
    for i in range(3):
        key = gdkv.hash128(f"{salt}-del-{i}".encode())
        assert a.client(STORE_BLOCKS, keys=[key.hex()], sizes=[65536]) == {"stored": 1}
        ready = b.dir / f"ready-{salt}-{i}"
        poller = b.spawn(POLL_UNTIL_GONE, key=key.hex(), size=65536, ready=str(ready),
                         deadline_s=20)
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert poller.poll() is None and time.monotonic() < deadline, Host.result(poller)
            time.sleep(0.02)
        deleted = a.client(DELETE_AT, key=key.hex())["deleted_at"]
        gone = Host.result(poller, timeout=60)
        if gone["gone_at"] is None:
            m = b.metrics()
            seen = {n: b.metric(n, m) for n in ("rados_remote_deletes_total",
                                                 "tiered_remote_deletes_total",
                                                 "cache_remote_invalidations_total",
                                                 "rados_watch_errors_total")}
            pytest.fail(f"h1 still returns a block h0 deleted: {gone}; h1 saw {seen}")
        bounds.append((gone["gone_at"] - deleted) * 1000)
    m = b.metrics()
    assert b.metric("rados_remote_deletes_total", m) >= 3
    assert b.metric("tiered_remote_deletes_total", m) >= 3
    assert b.metric("cache_remote_invalidations_total", m) >= 3
    print(f"\ndelete on h0 seen on h1 after {sorted(bounds)} ms")
    assert max(bounds) < 1000, bounds


EVICT_POOL = "gdkv-mh-evict"
EVICT_QUOTA = 32 << 20

STORE_PACED = '''
# One-off blocks at a steady pace (ARGS["per_s"]), the hot set read every 16 Stores; any failure
# is recorded.
c = connect()
hot = [bytes.fromhex(k) for k in ARGS["hot"]]
failed, hot_misses, t0 = [], 0, time.monotonic()
for i in range(ARGS["count"]):
    key = gdkv.hash128(f"{ARGS['salt']}-once-{i}".encode())
    r = attempt(c.put, key, value_for(key, 65536))
    if not r["ok"]:
        failed.append(r)
    if i % 16 == 0:
        hot_misses += sum(not matches(c, k, 65536) for k in hot)
    time.sleep(max(0.0, t0 + (i + 1) / ARGS["per_s"] - time.monotonic()))
out({"failed": len(failed), "first": failed[:3], "hot_misses": hot_misses})
'''

READ_HOT = '''
c = connect()
hot = [bytes.fromhex(k) for k in ARGS["hot"]]
misses, end = 0, time.monotonic() + ARGS["seconds"]
while time.monotonic() < end:
    misses += sum(not matches(c, k, 65536) for k in hot)
    time.sleep(0.25)
out({"misses": misses})
'''


def _ceph(net, *args: str) -> str:
    r = subprocess.run(["ip", "netns", "exec", f"{net.prefix}-ceph", "ceph", "-c", net.ceph_conf,
                        *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def _pool_objects(net) -> int:
    """gdkv's objects in the eviction pool now (a listing, not the lagging statistics)."""
    r = subprocess.run(["ip", "netns", "exec", f"{net.prefix}-ceph", "rados", "-c",
                        net.ceph_conf, "-p", EVICT_POOL, "ls", "--all"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return sum(1 for line in r.stdout.splitlines() if line.split("\t")[0].startswith("ns"))


def test_pool_evicts_between_watermarks_and_keeps_the_hot_set(hosts, net):
    """A 32 MiB pool (its quota) with both hosts evicting at 60% / 40%: h0 stores 2.5 pools of
    one-off blocks while h0 and h1 read a hot set throughout. No Store fails (81h), the hot set
    survives, both hosts evict (the work is split), and the pool ends between the marks."""
    _ceph(net, "osd", "pool", "create", EVICT_POOL, "8", "8")
    _ceph(net, "osd", "pool", "set-quota", EVICT_POOL, "max_bytes", str(EVICT_QUOTA))
    _ceph(net, "osd", "pool", "application", "enable", EVICT_POOL, "rados")
    try:
        evict = {"backend": {"pool": EVICT_POOL, "evict": True, "evict_high_percent": 60,
                             "evict_low_percent": 40, "evict_interval_ms": 500,
                             "atime_interval_ms": 300}}
        a, b = hosts
        a.start(evict)
        b.start(evict)
        salt = fresh_salt()
        hot = keys_hex(gdkv.hash128(f"{salt}-hot-{i}".encode()) for i in range(32))
        assert a.client(STORE_BLOCKS, keys=hot, sizes=[65536] * 32) == {"stored": 32}
        count, per_s = 1280, 60  # 80 MiB in about 21 s
        reader = b.spawn(READ_HOT, hot=hot, seconds=count / per_s)
        stored = a.client(STORE_PACED, hot=hot, salt=salt, count=count, per_s=per_s, timeout=300)
        read = Host.result(reader, timeout=120)
        time.sleep(3)  # a few more passes after the last Store
        objects = _pool_objects(net)
        ma, mb = a.metrics(), b.metrics()
        ev_a, ev_b = (h.metric("rados_evictions_total", m) for h, m in ((a, ma), (b, mb)))
        print(f"\npool: {objects} blocks ({objects * 64 / 1024:.1f} MiB of "
              f"{EVICT_QUOTA >> 20} MiB); evicted {ev_a:.0f} on h0, {ev_b:.0f} on h1")
        assert stored["failed"] == 0, stored
        assert stored["hot_misses"] == 0 and read["misses"] == 0, (stored, read)
        assert ev_a > 0 and ev_b > 0, (ev_a, ev_b)
        assert a.metric("rados_evict_nodes", ma) == 2
        used = objects * 65536
        assert used <= EVICT_QUOTA * 60 // 100 + 4 * 65536, used
        assert used >= EVICT_QUOTA * 30 // 100, used
        assert a.metric("rados_pool_capacity_bytes", ma) == EVICT_QUOTA
    finally:
        for h in hosts:
            h.cleanup()
        _ceph(net, "osd", "pool", "rm", EVICT_POOL, EVICT_POOL, "--yes-i-really-really-mean-it")
