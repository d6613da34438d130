"""Monitoring as shipped in deploy/monitoring: a real Prometheus (Debian's package) scrapes a real
gdkvd with the example configuration, loads the alert rules, and answers every query of the
Grafana dashboard; promtool checks and unit-tests the rules."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

import gdkv
from conftest import ROOT, Gdkvd, require_ceph

MONITORING = ROOT / "deploy" / "monitoring"


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is missing: scripts/test installs Debian's prometheus package")
    return path


def test_promtool_checks_and_unit_tests_the_alert_rules():
    promtool = tool("promtool")
    for args in (["check", "config", "prometheus.yml"], ["check", "rules", "alerts.yml"],
                 ["test", "rules", "alerts_test.yml"]):
        r = subprocess.run([promtool, *args], cwd=MONITORING, capture_output=True, text=True)
        assert r.returncode == 0, f"promtool {' '.join(args)}:\n{r.stdout}\n{r.stderr}"
        assert "SUCCESS" in r.stdout + r.stderr


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expression) of every target of the dashboard, and its variables' queries."""
    dash = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    out = []
    for p in dash["panels"]:
        assert p["targets"], p["title"]
        for t in p["targets"]:
            out.append((p["title"], t["expr"]))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            out.append((f"variable {v['name']}", v["query"]["query"]))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(port: int, path: str, **params) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def test_prometheus_scrapes_gdkvd_and_answers_every_dashboard_query(tmp_path):
    """gdkvd in front of the shared pool (tiered: local store and RADOS, a host cache, a tenant
    with a quota) exports every metric the dashboard names; a real Prometheus started from the
    example configuration scrapes it, loads the rules, and evaluates every dashboard query."""
    conf = require_ceph()
    prometheus = tool("prometheus")
    d = Gdkvd("--backend", "tiered", "--store", str(tmp_path / "store"), "--capacity",
              str(64 << 20), "--segment-bytes", str(8 << 20), "--ceph-conf", conf, "--pool", "gdkv-rep3", "--cache-bytes",
              str(16 << 20), "--namespace", "nsid=1,backend_namespace=41,capacity_bytes=8388608",
              metrics=True)
    prom = None
    try:
        with gdkv.connect(d.dir) as c:
            for i in range(8):
                c.put(b"monitoring-%d" % i, bytes([i]) * 4096)
            for i in range(8):
                assert c.get(b"monitoring-%d" % i) == bytes([i]) * 4096
            assert not c.exists(b"monitoring-none")
            with pytest.raises(KeyError):
                c.get(b"monitoring-none")
        exported = {name.split("{")[0] for name in d.metrics()}

        for title, expr in dashboard_queries():
            for name in re.findall(r"\bgdkv_[a-z0-9_]+", expr):
                assert name in exported, f"dashboard panel {title!r} names {name}, which " \
                                         "gdkvd does not export"

        # The shipped configuration, pointed at this gdkvd and scraping every second.
        cfg = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
        cfg["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        cfg["rule_files"] = [str(MONITORING / f) for f in cfg["rule_files"]]
        (job,) = cfg["scrape_configs"]
        job["static_configs"] = [{"targets": [f"127.0.0.1:{d.metrics_port}"]}]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        port = free_port()
        log = open(tmp_path / "prometheus.log", "wb")
        prom = subprocess.Popen(
            [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        def scraped() -> bool:
            if prom.poll() is not None:
                pytest.fail("prometheus exited: " + (tmp_path / "prometheus.log").read_text())
            try:
                r = api(port, "query", query='up{job="gdkvd"} == 1')
                n = api(port, "query", query="gdkv_namespace_written_bytes_total > 0")
            except OSError:
                return False
            return bool(r["data"]["result"]) and bool(n["data"]["result"])

        deadline = time.monotonic() + 60
        while not scraped():
            assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()
            time.sleep(0.2)

        rules = api(port, "rules")["data"]["groups"]
        loaded = {r["name"]: r for g in rules for r in g["rules"]}
        assert len(loaded) == (MONITORING / "alerts.yml").read_text().count("- alert:")
        for name, r in loaded.items():
            assert r["health"] in ("ok", "unknown"), (name, r)

        # Every dashboard query parses and runs, with Grafana's variables as it would fill them.
        for title, expr in dashboard_queries():
            q = expr.replace("$__rate_interval", "1m").replace('"$instance"', '".*"')
            if q.startswith("label_values("):
                metric = q[len("label_values("):].split(",")[0]
                assert api(port, "series", **{"match[]": metric})["data"], title
                continue
            r = api(port, "query", query=q)
            assert r["status"] == "success", (title, q, r)
        held = api(port, "query", query='gdkv_namespace_held_bytes{namespace="41"}')
        assert held["data"]["result"], "no held bytes for the quota'd namespace"
    finally:
        if prom is not None:
            prom.terminate()
            try:
                prom.wait(20)
            except subprocess.TimeoutExpired:
                prom.kill()
                prom.wait()
        d.stop()
