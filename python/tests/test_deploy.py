"""The Kubernetes manifests in deploy/kubernetes, checked offline: every resource against the
Kubernetes schemas (kubernetes-validate, strict: an unknown field fails), every gdkvd
configuration they carry by gdkvd's own --check-config, and the vLLM engine's connector config by
the connector's key table."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from conftest import GDKVD, ROOT
from gdkv import config

MANIFESTS = ROOT / "deploy" / "kubernetes"
KUBERNETES = "1.33.0"  # the oldest release still supported upstream when the manifests were written


def resources() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(MANIFESTS.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((str(path.relative_to(MANIFESTS)), doc))
    return out


def test_every_manifest_is_a_valid_kubernetes_resource():
    found = resources()
    kinds = sorted({(f, r["kind"]) for f, r in found})
    assert ("gdkvd-daemonset.yaml", "DaemonSet") in kinds
    assert ("ceph/gdkvd-daemonset.yaml", "DaemonSet") in kinds
    assert ("vllm-deployment.yaml", "Deployment") in kinds
    for name, r in found:
        try:
            kubernetes_validate.validate(r, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name}: {r['kind']}/{r['metadata']['name']}: {e.message}")


def test_a_mistyped_field_fails_validation():
    (ds,) = [r for f, r in resources() if f == "gdkvd-daemonset.yaml" and r["kind"] == "DaemonSet"]
    bad = copy.deepcopy(ds)
    spec = bad["spec"]["template"]["spec"]
    spec["contaniers"] = spec.pop("containers")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES, strict=True)


@pytest.mark.parametrize("configmap", ["gdkvd-configmap.yaml", "ceph/gdkvd-configmap.yaml"])
def test_gdkvd_accepts_the_configuration_the_manifests_carry(configmap, tmp_path):
    (cm,) = [r for f, r in resources() if f == configmap]
    toml = tmp_path / "gdkvd.toml"
    toml.write_text(cm["data"]["gdkvd.toml"])
    r = subprocess.run([str(GDKVD), "--config", str(toml), "--check-config"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "capacity_bytes = " in r.stdout  # the tenant's quota was read
    # The DaemonSet mounts the directories the configuration names.
    ds_file = str(Path(configmap).parent / "gdkvd-daemonset.yaml").lstrip("./")
    (ds,) = [r for f, r in resources() if f == ds_file and r["kind"] == "DaemonSet"]
    mounts = {m["mountPath"] for m in ds["spec"]["template"]["spec"]["containers"][0]
              ["volumeMounts"]}
    for key in ("socket_dir", "store", "ceph_conf"):
        for line in cm["data"]["gdkvd.toml"].splitlines():
            if line.strip().startswith(f"{key} ="):
                path = line.split("=", 1)[1].split("#")[0].strip().strip('"')
                assert any(path == m or path.startswith(m + "/") for m in mounts), (key, path)


def test_the_vllm_deployment_configures_the_connector_with_known_keys():
    (dep,) = [r for f, r in resources() if r["kind"] == "Deployment"]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "GdkvConnector"
    assert kv["kv_connector_module_path"] == "gdkv.vllm"
    assert importlib.util.find_spec(kv["kv_connector_module_path"]) is not None
    extra = config.read_config(kv["kv_connector_extra_config"], config.VLLM_KEYS, "the manifest")
    assert extra["socket_dir"] == "/run/gdkvd"
    mounts = {m["mountPath"] for m in dep["spec"]["template"]["spec"]["containers"][0]
              ["volumeMounts"]}
    assert "/run/gdkvd" in mounts
