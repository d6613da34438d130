"""Tenants with quotas through a real gdkvd: a tenant writing sixteen times its quota leaves every
value of another tenant readable, byte for byte, in the memory, local and tiered backends (with
the host cache in front); the flooding tenant loses only its own oldest values; a value larger
than its namespace's quota is refused; the per-namespace metrics say so."""

from __future__ import annotations

import os

import pytest

import gdkv
from conftest import Gdkvd, require_ceph

QUOTA = 4 << 20          # bytes each tenant may hold
VALUE = 64 << 10         # one value
CACHE = 12 << 20         # the host cache: both quotas fit, a flood does not


def value(tenant: int, i: int) -> bytes:
    return bytes([tenant]) * 8 + i.to_bytes(4, "little") + os.urandom(16) * ((VALUE - 12) // 16)


def daemon(kind: str, tmp_path) -> Gdkvd:
    tenants = ["--namespace", f"nsid=1,backend_namespace=61,capacity_bytes={QUOTA}",
               "--namespace", f"nsid=2,backend_namespace=62,capacity_bytes={QUOTA}"]
    store = ["--store", str(tmp_path / "store"), "--capacity", str(48 << 20),
             "--segment-bytes", str(8 << 20)]
    args = {"memory": ["--memory-capacity", str(16 << 20)],
            "local": store,
            "tiered": store + ["--ceph-conf", require_ceph() if kind == "tiered" else "",
                               "--pool", "gdkv-rep3"]}[kind]
    return Gdkvd("--backend", kind, *args, "--cache-bytes", str(CACHE), *tenants, metrics=True)


def held(d: Gdkvd, ns: int) -> dict[str, float]:
    return {name.split('tier="')[1].split('"')[0]: v for name, v in d.metrics().items()
            if name.startswith("gdkv_namespace_held_bytes{") and f'namespace="{ns}"' in name}


def evictions(d: Gdkvd, ns: int) -> float:
    return sum(v for name, v in d.metrics().items()
               if name.startswith("gdkv_namespace_evictions_total{")
               and f'namespace="{ns}"' in name)


@pytest.mark.parametrize("kind", ["memory", "local", "tiered"])
def test_a_flooding_tenant_never_evicts_another(kind, tmp_path):
    d = daemon(kind, tmp_path)
    try:
        with gdkv.connect(d.dir, nsid=2) as b, gdkv.connect(d.dir, nsid=1) as a:
            run = os.urandom(4).hex().encode()   # keys of this run only (the pool is shared)
            kept = {run + b"/b-%d" % i: value(2, i) for i in range(QUOTA // VALUE // 2)}
            for k, v in kept.items():
                b.put(k, v)
            flood = 16 * QUOTA // VALUE   # more than the local store's log: it wraps
            for i in range(flood):
                last = value(1, i)
                a.put(run + b"/a-%d" % i, last)
                if i % 16 == 0:      # B keeps reading its values while A floods
                    k = run + b"/b-%d" % (i // 16 % len(kept))
                    assert b.get(k) == kept[k]
            for k, v in kept.items():
                assert b.get(k) == v, f"{kind}: tenant B lost {k!r}"
            # A kept its newest value and (where the store itself holds the quota at once, not
            # a RADOS pool's periodic eviction behind it) lost its oldest.
            assert a.get(run + b"/a-%d" % (flood - 1)) == last
            if kind != "tiered":
                assert not a.exists(run + b"/a-0")
            with pytest.raises(gdkv.CapacityError):
                a.put(run + b"/too-big", bytes(QUOTA + VALUE))
        for tier, n in held(d, 61).items():
            assert n <= QUOTA, (kind, tier, n)
        assert held(d, 62), f"{kind}: no held bytes reported for tenant B"
        assert evictions(d, 61) > 0
        assert evictions(d, 62) == 0
    finally:
        d.stop()
