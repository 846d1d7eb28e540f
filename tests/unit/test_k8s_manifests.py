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
# docs/deployment.md "Kubernetes": kubectl create secret generic p2pworker-secret ...
SECRET = ("p2pworker-secret", "secret")
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


# deploy/k8s/llm-d: llm-d's P2P guide shape with the P2PWorkerTier.  Two overlays (aggregated, P/D), each on a
# stand-in for llm-d's model-server manifests (not in this repository), sharing one Component.  Without kubectl
# the overlays' own patches are checked (they must carry everything: they are also meant for llm-d's manifests);
# with it, their render too.
LLMD = DIR / "llm-d"
LLMD_OVERLAYS = {"aggregated": LLMD, "pd": LLMD / "pd"}
LLMD_ROLES = {("aggregated", "decode"): "both", ("pd", "prefill"): "prefill", ("pd", "decode"): "decode"}
LLMD_TIER_PORT = 7777  # the routing sidecar's --p2p-connector-port: what it puts in remote_port
LLMD_IMAGE = ("vllm/vllm-openai", "vllm-p2pworker", "v0.33.0")  # the guide's engine image -> ours
IN_TREE_TIER = {"type": "p2p", "host": "$(POD_IP)", "port": LLMD_TIER_PORT}


def _kust(d: Path) -> dict:
    return yaml.safe_load((d / "kustomization.yaml").read_text())


def _standin(overlay: Path) -> dict[str, dict]:
    """The Deployments of the overlay's base, by name before the base's namePrefix (what the patches target)."""
    out = {}
    for res in _kust(overlay)["resources"]:
        base = (overlay / res).resolve()
        for f in _kust(base)["resources"]:
            for d in yaml.safe_load_all((base / f).read_text()):
                if d:
                    out[d["metadata"]["name"]] = d
    return out


def _tier_patches(overlay: Path) -> dict[str, list[dict]]:
    """The JSON patches on the engines' --kv-transfer-config, by target Deployment."""
    return {p["target"]["name"]: yaml.safe_load((overlay / p["path"]).read_text()) for p in _kust(overlay)["patches"]}


def _kv_json(ops: list[dict]) -> str:
    (value,) = [o["value"] for o in ops if o["op"] == "replace" and o["path"].endswith("/args/8")]
    return value


def _component() -> tuple[dict, dict, dict]:
    """(the Component's kustomization, its engine patch's modelserver container, that patch's pod spec)."""
    comp = _kust(LLMD / "component")
    (p,) = comp["patches"]
    spec = yaml.safe_load((LLMD / "component" / p["path"]).read_text())["spec"]["template"]["spec"]
    (c,) = [c for c in spec["containers"] if c["name"] == "modelserver"]
    return comp, c, spec


def _walk(node):
    yield node
    for child in (node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()):
        yield from _walk(child)


def test_llm_d_standins_are_valid_and_have_the_guides_shape():
    for name, overlay in LLMD_OVERLAYS.items():
        deps = _standin(overlay)
        assert set(deps) == set(_tier_patches(overlay)), f"{name}: every model server gets its tier entry"
        for dep in deps.values():
            kubernetes_validate.validate(dep, K8S_VERSION, strict=True)
            c = dep["spec"]["template"]["spec"]["containers"][0]
            assert c["name"] == "modelserver" and c["args"][7] == "--kv-transfer-config"
            kv = json.loads(c["args"][8])
            assert kv["kv_connector_extra_config"]["secondary_tiers"] == [IN_TREE_TIER]  # what the overlay swaps
            assert c["image"].split(":")[0] == LLMD_IMAGE[0]
            for side in dep["spec"]["template"]["spec"].get("initContainers", []):  # the routing sidecar
                assert f"--p2p-connector-port={LLMD_TIER_PORT}" in side["args"]
                assert "--kv-connector=offloading" in side["args"]


def test_llm_d_overlays_swap_only_the_tier_entry_for_ours():
    for name, overlay in LLMD_OVERLAYS.items():
        deps = _standin(overlay)
        for target, ops in _tier_patches(overlay).items():
            # the patch checks where it writes: a guide whose arguments moved fails the build
            assert {"op": "test", "path": "/spec/template/spec/containers/0/name", "value": "modelserver"} in ops
            assert {"op": "test", "path": "/spec/template/spec/containers/0/args/7",
                    "value": "--kv-transfer-config"} in ops
            raw = _kv_json(ops)
            kv = json.loads(raw)
            (tier,) = kv["kv_connector_extra_config"]["secondary_tiers"]
            assert (tier["type"], tier["module_path"]) == ("P2PWorkerTier", "vllm_adapter.tier")
            assert (tier["host"], tier["port"]) == ("$(POD_IP)", LLMD_TIER_PORT)
            # the rest of the JSON is the guide's
            old = json.loads(deps[target]["spec"]["template"]["spec"]["containers"][0]["args"][8])
            for doc in (kv, old):
                doc["kv_connector_extra_config"].pop("secondary_tiers")
            assert kv == old, f"{name}/{target}: only the tier entry changes"
            assert kv["kv_connector_extra_config"]["offload_prompt_only"] is False  # generated KV is pullable
            # what the tier does at vLLM's start, once the kubelet has expanded $(POD_IP)
            (entry,) = tier_entries(json.loads(raw.replace("$(POD_IP)", "10.1.2.3")))
            _, worker = tier_settings(entry, env={})
            assert (worker.control.host, worker.control.port) == ("10.1.2.3", LLMD_TIER_PORT)
            assert worker.role == LLMD_ROLES[(name, target)]
            assert (worker.metrics_port, worker.metrics_host) == (9400, "0.0.0.0")


def test_llm_d_component_sets_secret_hash_seed_ports_dev_shm_and_image():
    comp, c, spec = _component()
    assert comp["kind"] == "Component"
    for name, overlay in LLMD_OVERLAYS.items():
        assert [(overlay / p).resolve() for p in _kust(overlay)["components"]] == [LLMD / "component"], name
        for dep in _standin(overlay):
            assert re.fullmatch(comp["patches"][0]["target"]["name"], dep), f"{name}/{dep} not patched"
    assert not re.fullmatch(comp["patches"][0]["target"]["name"], "render")  # only the model servers
    env = {e["name"]: e for e in c["env"]}
    assert env["P2PWORKER_SECRET"] == {"name": "P2PWORKER_SECRET",
                                       "valueFrom": {"secretKeyRef": dict(zip(("name", "key"), SECRET))}}
    assert env["PYTHONHASHSEED"]["value"] == "0"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"  # $(POD_IP) in the tier entry
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["p2p"] == LLMD_TIER_PORT and ports["worker-metrics"] == 9400
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    (vol,) = [v for v in spec["volumes"] if v["name"] == "shm"]
    assert vol["emptyDir"]["medium"] == "Memory"
    shm = _bytes(vol["emptyDir"]["sizeLimit"])
    for name, overlay in LLMD_OVERLAYS.items():
        deps = _standin(overlay)
        for target, ops in _tier_patches(overlay).items():
            cpu = int(json.loads(_kv_json(ops))["kv_connector_extra_config"]["cpu_bytes_to_use"])
            assert shm >= cpu + VLLM_SHM_HEADROOM, f"{name}/{target}: /dev/shm smaller than its CPU tier"
            limits = deps[target]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
            assert _bytes(limits["memory"]) >= shm  # tmpfs pages count against the limit
    assert [(i["name"], i["newName"], i["newTag"]) for i in comp["images"]] == [LLMD_IMAGE]


def test_llm_d_manifests_hold_no_secret():
    for f in LLMD.rglob("*.yaml"):
        for doc in yaml.safe_load_all(f.read_text()):
            for node in _walk(doc):
                if isinstance(node, dict):
                    assert node.get("kind") != "Secret", f"{f}: a Secret object"
                    if node.get("name") == "P2PWORKER_SECRET":
                        assert "value" not in node and "secretKeyRef" in node["valueFrom"], f"{f}: literal secret"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl here: the kustomize render is not checked")
def test_llm_d_kustomize_render_is_valid_and_every_engine_runs_our_tier():
    for name, overlay in LLMD_OVERLAYS.items():
        out = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=60,
                             check=True)
        docs = [d for d in yaml.safe_load_all(out.stdout) if d]
        assert len(docs) == len(_standin(overlay)), name
        for d in docs:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
            spec = d["spec"]["template"]["spec"]
            c = spec["containers"][0]
            assert c["image"] == f"{LLMD_IMAGE[1]}:{LLMD_IMAGE[2]}"
            env = {e["name"]: e for e in c["env"]}
            assert env["P2PWORKER_SECRET"]["valueFrom"]["secretKeyRef"] == dict(zip(("name", "key"), SECRET))
            assert env["PYTHONHASHSEED"]["value"] == "0"
            (tier,) = json.loads(c["args"][c["args"].index("--kv-transfer-config") + 1])[
                "kv_connector_extra_config"]["secondary_tiers"]
            assert (tier["type"], tier["module_path"], tier["port"]) == ("P2PWorkerTier", "vllm_adapter.tier",
                                                                          LLMD_TIER_PORT)
            assert LLMD_TIER_PORT in {p["containerPort"] for p in c["ports"] if p["name"] == "p2p"}
            (vol,) = [v for v in spec["volumes"] if v["name"] == "shm"]
            assert vol["emptyDir"]["medium"] == "Memory" and {"name": "shm", "mountPath": "/dev/shm"} in c[
                "volumeMounts"]
            assert _bytes(c["resources"]["limits"]["memory"]) >= _bytes(vol["emptyDir"]["sizeLimit"])
            for side in spec.get("initContainers", []):
                assert f"--p2p-connector-port={tier['port']}" in side["args"]
