"""deploy/k8s: every object valid (strict: unknown fields are errors) for a pinned Kubernetes version, and the
objects agree with each other and with what the tier and the router accept."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from p2pworker.config import tier_entries, tier_settings
from p2pworker.router.pool import Role, parse_instance
from p2pworker.router.server import Router, RouterConfig

K8S_VERSION = "1.33.0"  # pinned: what the manifests are checked against
DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
SECRET = ("p2pworker-secret", "secret")  # README "Kubernetes": kubectl create secret generic p2pworker-secret ...
VLLM_SHM_HEADROOM = 2 << 30  # vLLM's own /dev/shm use (its Kubernetes guide mounts 2Gi)


def _docs() -> list[dict]:
    kust = yaml.safe_load((DIR / "kustomization.yaml").read_text())
    return [d for f in kust["resources"] for d in yaml.safe_load_all((DIR / f).read_text()) if d]


def _by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in _docs() if d["kind"] == kind}


def _bytes(q: str) -> int:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", q)
    assert m, f"quantity {q!r}"
    return int(m[1]) << {None: 0, "Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40}[m[2]]


def _container(dep: dict) -> dict:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def test_kustomization_lists_every_manifest_and_each_object_is_valid_for_the_pinned_version():
    kust = yaml.safe_load((DIR / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(p.name for p in DIR.glob("*.yaml") if p.name != "kustomization.yaml")
    docs = _docs()
    assert {d["kind"] for d in docs} == {"ConfigMap", "Deployment", "Service"}
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)  # raises on any error


def test_validation_catches_a_misspelt_field():  # the check above can fail
    dep = _by_kind("Deployment")["vllm-prefill"]
    bad = json.loads(json.dumps(dep))
    bad["spec"]["replica"] = bad["spec"].pop("replicas")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_services_select_one_deployment_and_name_its_ports_and_probes_use_named_ports():
    deps = _by_kind("Deployment")
    for name, svc in _by_kind("Service").items():
        sel = svc["spec"]["selector"]
        matching = [d for d in deps.values()
                    if sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matching) == 1, f"Service {name} selects {len(matching)} Deployments"
        ports = {p["name"] for p in _container(matching[0])["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports
        assert all(p["name"] for p in svc["spec"]["ports"])
    for dep in deps.values():
        c = _container(dep)
        assert dep["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
        ports = {p["name"] for p in c["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in c:
                port = (c[probe].get("httpGet") or c[probe].get("tcpSocket"))["port"]
                assert port in ports, f"{dep['metadata']['name']} {probe} port {port}"
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"


def test_engines_secret_host_config_and_dev_shm_size():
    cm = _by_kind("ConfigMap")["p2pworker-config"]["data"]
    for role in ("prefill", "decode"):
        dep = _by_kind("Deployment")[f"vllm-{role}"]
        c = _container(dep)
        env = {e["name"]: e for e in c["env"]}
        assert env["P2PWORKER_SECRET"]["valueFrom"]["secretKeyRef"] == dict(zip(("name", "key"), SECRET))
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        names = [e["name"] for e in c["env"]]
        assert names.index("POD_IP") < names.index("VLLM_P2P_SIDE_CHANNEL_HOST")  # $(POD_IP) expands only then
        assert env["VLLM_P2P_SIDE_CHANNEL_HOST"]["value"] == "$(POD_IP)"
        for e in c["env"]:
            ref = e.get("valueFrom", {}).get("configMapKeyRef")
            if ref:
                assert ref["name"] == "p2pworker-config" and ref["key"] in cm
        assert "$(KV_TRANSFER_CONFIG)" in c["args"] and "$(MODEL)" in c["args"]
        kv = json.loads(cm[f"{role}.json"])
        extra = kv["kv_connector_extra_config"]
        (tier,) = tier_entries(kv)  # the keys vLLM hands the tier
        # exactly what the tier does at vLLM's start, with the pod's environment
        settings, worker = tier_settings(tier, env={"VLLM_P2P_SIDE_CHANNEL_HOST": "10.1.2.3"})
        assert (worker.control.host, worker.control.port, worker.role) == ("10.1.2.3", 5710, role)
        assert {p["containerPort"] for p in c["ports"] if p["name"] == "p2p"} == {worker.control.port}
        assert {p["containerPort"] for p in c["ports"] if p["name"] == "worker-metrics"} == {worker.metrics_port}
        assert worker.metrics_host == "0.0.0.0"
        (vol,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "shm"]
        assert vol["emptyDir"]["medium"] == "Memory"
        assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        shm = _bytes(vol["emptyDir"]["sizeLimit"])
        assert shm >= int(extra["cpu_bytes_to_use"]) + VLLM_SHM_HEADROOM
        assert _bytes(c["resources"]["limits"]["memory"]) >= shm  # tmpfs pages count against the limit


def test_router_args_are_what_the_router_accepts_and_point_at_the_services():
    c = _container(_by_kind("Deployment")["p2pworker-router"])
    assert c["command"] == ["p2pworker", "router"]
    args, prefill, decode = c["args"], [], []
    for flag, value in zip(args, args[1:]):
        {"--prefill": prefill, "--decode": decode}.get(flag, []).append(value)
    Router(RouterConfig(prefill=tuple(prefill), decode=tuple(decode)))  # raises on a spec it would refuse
    flag = dict(zip(args[::2], args[1::2]))
    grace = _by_kind("Deployment")["p2pworker-router"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(flag["--shutdown-delay"]) + float(flag["--shutdown-timeout"])  # not killed mid-drain
    svcs = _by_kind("Service")
    for spec, role in [(p, Role.PREFILL) for p in prefill] + [(d, Role.DECODE) for d in decode]:
        inst = parse_instance(role, spec, 5710)
        host, port = inst.name.split(":")
        assert int(port) in {p["port"] for p in svcs[host]["spec"]["ports"] if p["name"] == "http"}
        if role is Role.PREFILL:
            assert inst.worker[0] == host
            assert inst.worker[1] in {p["port"] for p in svcs[host]["spec"]["ports"] if p["name"] == "p2p"}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl here: the kustomize render is not checked")
def test_kustomize_render_is_valid_and_labels_and_image_are_applied():
    out = subprocess.run(["kubectl", "kustomize", str(DIR)], capture_output=True, text=True, timeout=60, check=True)
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert len(docs) == len(_docs())
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "vllm-pd"
        if d["kind"] == "Deployment":
            assert _container(d)["image"] == "vllm-p2pworker:v0.33.0"
