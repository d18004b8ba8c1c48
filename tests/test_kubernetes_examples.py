"""examples/kubernetes/ fits together: every manifest is valid YAML of Kubernetes
objects; the loraserve pods' arguments are real `loraserve serve` flags (with
--metrics-prefix vllm); the InferencePool selects those pods on the port the server
listens on; its endpoint picker is the EPP Service, which reaches the EPP pods; the
EPP watches that pool with the RBAC it needs and its stock metric settings, whose
metric names the server exports under --metrics-prefix vllm."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from loraserve.cli_args import build_parser
from loraserve.config import CacheConfig
from loraserve.metrics import ServerMetrics, cache_config_labels

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "examples" / "kubernetes"
# The EPP's flags that rename the metrics it scrapes; the stock settings leave them
# at their defaults, vLLM's names.
EPP_METRIC_FLAGS = ("--total-queued-requests-metric", "--total-running-requests-metric",
                    "--kv-cache-usage-percentage-metric", "--lora-info-metric",
                    "--cache-info-metric")
EPP_DEFAULT_METRICS = ("vllm:num_requests_waiting", "vllm:num_requests_running",
                       "vllm:kv_cache_usage_perc", "vllm:lora_requests_info",
                       "vllm:cache_config_info")


def documents(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc is not None]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind
                and (name is None or d["metadata"]["name"] == name)]
    return found


def container(deployment: dict, name: str) -> dict:
    (found,) = [c for c in deployment["spec"]["template"]["spec"]["containers"]
                if c["name"] == name]
    return found


def port_number(ctr: dict, port: int | str) -> int:
    """A container port given by number or by name."""
    if isinstance(port, int):
        return port
    (found,) = [p["containerPort"] for p in ctr["ports"] if p.get("name") == port]
    return found


def selects(selector: dict, deployment: dict) -> bool:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    return selector.items() <= labels.items()


@pytest.mark.parametrize("name", sorted(p.name for p in K8S.glob("*.yaml")))
def test_every_manifest_is_yaml_of_kubernetes_objects(name):
    docs = documents(name)
    assert docs
    if name == "ray-serve.yaml":  # a Ray Serve config file, not Kubernetes objects
        return
    for doc in docs:
        assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"], doc


@pytest.fixture(scope="module")
def pool_docs() -> list[dict]:
    return documents("inference-pool.yaml")


@pytest.fixture(scope="module")
def server_deployment() -> dict:
    return one(documents("deployment.yaml"), "Deployment", "loraserve")


def image_entrypoint() -> list[str]:
    line = re.search(r"^ENTRYPOINT (\[.*\])$", (ROOT / "docker" / "Dockerfile").read_text(),
                     re.M).group(1)
    return json.loads(line)


def test_the_pods_run_loraserve_with_vllms_metric_names(server_deployment):
    entrypoint = image_entrypoint()
    assert entrypoint[:2] == ["loraserve", "serve"]
    ctr = container(server_deployment, "loraserve")
    args, unknown = build_parser().parse_known_args(entrypoint[1:] + ctr["args"])
    assert not unknown
    assert args.metrics_prefix == "vllm" and args.enable_lora
    assert port_number(ctr, "http") == args.port


def test_the_pool_selects_the_loraserve_pods_on_their_port(pool_docs, server_deployment):
    pool = one(pool_docs, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert selects(spec["selector"]["matchLabels"], server_deployment)
    assert not selects(spec["selector"]["matchLabels"], one(pool_docs, "Deployment"))
    server_port = port_number(container(server_deployment, "loraserve"), "http")
    assert [p["number"] for p in spec["targetPorts"]] == [server_port]
    # The plain Service of the same pods agrees.
    service = one(documents("service.yaml"), "Service")
    assert selects(service["spec"]["selector"], server_deployment)


def test_the_endpoint_picker_is_reached_and_watches_the_pool(pool_docs):
    pool = one(pool_docs, "InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    service = one(pool_docs, "Service", ref["name"])
    (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert service_port.get("appProtocol") == "http2"  # gRPC (Envoy's ext_proc)
    epp = one(pool_docs, "Deployment", "loraserve-epp")
    assert selects(service["spec"]["selector"], epp)
    ctr = container(epp, "epp")
    assert port_number(ctr, service_port["targetPort"]) == 9002
    args = ctr["args"]
    assert args[args.index("--pool-name") + 1] == pool["metadata"]["name"]
    assert not [flag for flag in args if flag.split("=")[0] in EPP_METRIC_FLAGS]
    # The plugin configuration it reads is the ConfigMap mounted there.
    config_path = Path(args[args.index("--config-file") + 1])
    (mount,) = [m for m in ctr["volumeMounts"] if config_path.parent == Path(m["mountPath"])]
    (volume,) = [v for v in epp["spec"]["template"]["spec"]["volumes"]
                 if v["name"] == mount["name"]]
    config = yaml.safe_load(one(pool_docs, "ConfigMap", volume["configMap"]["name"])
                            ["data"][config_path.name])
    declared = {p.get("name", p["type"]) for p in config["plugins"]}
    used = {ref["pluginRef"] for profile in config["schedulingProfiles"]
            for ref in profile["plugins"]}
    assert used <= declared and "lora-affinity-scorer" in used


def test_the_epp_may_read_its_pool_and_the_pods(pool_docs):
    epp = one(pool_docs, "Deployment", "loraserve-epp")
    account = epp["spec"]["template"]["spec"]["serviceAccountName"]
    one(pool_docs, "ServiceAccount", account)
    binding = one(pool_docs, "RoleBinding")
    assert {"kind": "ServiceAccount", "name": account} in binding["subjects"]
    role = one(pool_docs, "Role", binding["roleRef"]["name"])
    granted = {(group, resource) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] if {"get", "watch", "list"} <= set(rule["verbs"])}
    assert {("inference.networking.k8s.io", "inferencepools"), ("", "pods")} <= granted


def test_the_route_sends_to_the_pool(pool_docs):
    pool = one(pool_docs, "InferencePool")
    route = one(pool_docs, "HTTPRoute")
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                         "name": pool["metadata"]["name"]}]


def test_the_server_exports_what_the_epp_reads_by_default():
    metrics = ServerMetrics("m", max_loras=4, prefix="vllm")
    metrics.set_cache_config(cache_config_labels(CacheConfig(), 100))
    text = metrics.render().decode()
    for name in EPP_DEFAULT_METRICS:
        assert re.search(rf"^{re.escape(name)}\{{", text, re.M), name
