"""Rendering: every object valid against the Kubernetes schemas (strict), and the contract
details of each kind."""

from __future__ import annotations

import math
import re
from typing import Any

import kubernetes_validate
import pytest
import yaml
from cloudcoil.models.keda.v1alpha1 import ScaledObject
from cloudcoil.models.prometheus_operator.v1 import PodMonitor
from operator_fixtures import EXAMPLES, REPO, load_example, with_changes

from kubesgl.operator import naming
from kubesgl.operator.render import render
from kubesgl.operator.render.engine import COMPILE_CACHE_VARIABLES
from kubesgl.operator.validation import ENV_SET_BY_OPERATOR, InvalidSpec, parse_inference_service
from kubesgl.router.cli import check_router_args

K8S_VERSION = kubernetes_validate.utils.latest_version()
# KEDA and prometheus-operator CRDs, as generated into pydantic models by cloudcoil.
CRD_MODELS = {"ScaledObject": ScaledObject, "PodMonitor": PodMonitor}


def objects_of(document: dict[str, Any], uid: str = "0c5e1b4a-1111-2222-3333-444455556666"):
    document = with_changes(document, "metadata.uid", uid)
    return {
        (o["kind"], o["metadata"]["name"]): o for o in render(parse_inference_service(document))
    }


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def validate_against_crd_model(obj: dict[str, Any]) -> None:
    """Typed per the published CRD schema; a field the model does not know would be dropped by
    the round trip, so the round trip must give the object back unchanged."""
    model = CRD_MODELS[obj["kind"]].model_validate(obj)
    again = _drop_nulls(model.model_dump(by_alias=True, exclude_unset=True, mode="json"))
    assert again == obj


def oldest_supported_kubernetes() -> str:
    """The least version the chart's kubeVersion admits (">=1.30.0-0": 1.30.0)."""
    chart = yaml.safe_load((REPO / "charts" / "kubesgl" / "Chart.yaml").read_text())
    (version,) = re.fullmatch(r">=(\d+\.\d+\.\d+)-0", chart["kubeVersion"]).groups()
    return version


@pytest.mark.parametrize("version", [oldest_supported_kubernetes(), K8S_VERSION])
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_rendered_object_is_valid(path, version) -> None:
    """Valid on the newest Kubernetes and on the oldest the chart admits: a field newer than
    that (the preStop sleep action before 1.30, say) moves the chart's kubeVersion."""
    objects = objects_of(yaml.safe_load(path.read_text()))
    for obj in objects.values():
        if obj["kind"] in CRD_MODELS:
            validate_against_crd_model(obj)
        else:
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_crd_model_check_catches_unknown_fields() -> None:
    monitor = objects_of(load_example("disaggregated.yaml"))[("PodMonitor", "llama-pd")]
    monitor["spec"]["podMetricsEndpoint"] = monitor["spec"].pop("podMetricsEndpoints")
    with pytest.raises(AssertionError):
        validate_against_crd_model(monitor)


def test_rendering_is_deterministic() -> None:
    document = load_example("disaggregated.yaml")
    assert objects_of(document) == objects_of(document)


def test_mixed_mode_renders_one_engine_role() -> None:
    objects = objects_of(load_example("mixed.yaml"))
    deployments = sorted(name for kind, name in objects if kind == "Deployment")
    assert deployments == ["qwen3-mixed-mixed", "qwen3-mixed-router"]
    args = objects[("Deployment", "qwen3-mixed-mixed")]["spec"]["template"]["spec"]["containers"][
        0
    ]["args"]
    assert args[args.index("--role") + 1] == "mixed"
    assert "--disaggregation-bootstrap-port" not in args


def test_chunked_prefill_size_zero_turns_chunking_off() -> None:
    """The engine's documented 0 was out of the spec's reach (minimum 1)."""
    objects = objects_of(
        with_changes(load_example("mixed.yaml"), "spec.engine.chunkedPrefillSize", 0)
    )
    args = engine_pod(objects, "qwen3-mixed-mixed")["spec"]["containers"][0]["args"]
    assert args[args.index("--chunked-prefill-size") + 1] == "0"


def test_image_pull_secrets_as_names_or_as_a_pod_spec_writes_them() -> None:
    """The chart took both forms; the CRD only names, so a values file's form was refused."""
    document = with_changes(
        load_example("mixed.yaml"), "spec.imagePullSecrets", ["regcred", {"name": "other"}]
    )
    objects = objects_of(document)
    for name in ("qwen3-mixed-mixed", "qwen3-mixed-router"):
        pulled = engine_pod(objects, name)["spec"]["imagePullSecrets"]
        assert pulled == [{"name": "regcred"}, {"name": "other"}]
    with pytest.raises(InvalidSpec, match=r"spec\.imagePullSecrets\.0"):
        parse_inference_service(with_changes(document, "spec.imagePullSecrets", [{"nam": "x"}]))


def engine_pod(objects, name: str) -> dict[str, Any]:
    return objects[("Deployment", name)]["spec"]["template"]


def test_engine_pod_contract() -> None:
    document = load_example("disaggregated.yaml")
    for role in ("prefill", "decode"):  # both roles on two GPUs: one per tensor-parallel rank
        document["spec"][role]["tensorParallelSize"] = 2
    objects = objects_of(document)
    prefill = engine_pod(objects, "llama-pd-prefill")
    decode = engine_pod(objects, "llama-pd-decode")
    container = decode["spec"]["containers"][0]
    assert container["command"] == ["kubesgl"]
    args = container["args"]
    assert args[:2] == ["serve", "--model"]
    options = dict(zip(args[1::2], args[2::2]))
    assert options["--role"] == "decode" and options["--tp-size"] == "2"
    assert options["--port"] == "30000" and options["--shutdown-timeout"] == "120"
    assert options["--chunked-prefill-size"] == "8192"
    assert options["--served-model-name"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert prefill["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    prefill_args = prefill["spec"]["containers"][0]["args"]
    assert prefill_args[prefill_args.index("--disaggregation-bootstrap-port") + 1] == "8998"
    for annotation in (
        "kubesgl.io/bootstrap-port",
        "sglang.ai/bootstrap-port",
    ):  # kubesgl's and SGLang's routers
        assert prefill["metadata"]["annotations"][annotation] == "8998"
        assert annotation not in decode["metadata"]["annotations"]
    assert decode["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert decode["metadata"]["labels"] == {
        "app.kubernetes.io/name": "kubesgl",
        "app.kubernetes.io/instance": "llama-pd",
        "kubesgl.io/role": "decode",
        "app.kubernetes.io/managed-by": "kubesgl-operator",
    }
    shm = next(v for v in decode["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}  # 1Gi per rank
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    assert container["lifecycle"]["preStop"]["sleep"]["seconds"] == 10
    # preStop pause, drain (--shutdown-timeout), the engine's exit after it, slack
    assert decode["spec"]["terminationGracePeriodSeconds"] == 10 + 120 + 22 + 5
    assert decode["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert {"name": "UCX_TLS", "value": "tcp,cuda_copy"} in container["env"]


def test_a_rollout_may_last_as_long_as_an_engine_may_take_to_start() -> None:
    """Kubernetes' default progress deadline (600 s) marked an engine still loading its model,
    which its startup probe allows an hour, ProgressDeadlineExceeded: Degraded. The router too:
    it is unready until an engine can serve."""
    deployments = {
        name: obj
        for (kind, name), obj in objects_of(load_example("disaggregated.yaml")).items()
        if kind == "Deployment"
    }
    router = deployments.pop("llama-pd-router")
    for deployment in deployments.values():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        startup, readiness = container["startupProbe"], container["readinessProbe"]
        longest_start = (
            startup["periodSeconds"] * startup["failureThreshold"] + readiness["periodSeconds"]
        )
        # and the pod's start before the probe: scheduling, image pull, model download
        deadline = deployment["spec"]["progressDeadlineSeconds"]
        assert deadline >= longest_start + 600
        assert router["spec"].get("progressDeadlineSeconds") == deadline


def test_roles_and_router_take_scheduling_fields_and_roles_their_environment() -> None:
    document = load_example("disaggregated.yaml")
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]}
                ]
            }
        }
    }
    scheduling = {
        "affinity": affinity,
        "priorityClassName": "inference",
        "runtimeClassName": "nvidia",
    }
    document["spec"]["decode"].update(scheduling)
    document["spec"]["router"] = {"priorityClassName": "inference"}
    secret = {"secretKeyRef": {"name": "mirror", "key": "url"}}
    document["spec"]["decode"]["env"] = [
        {"name": "NCCL_DEBUG", "value": "INFO"},
        {"name": "HF_ENDPOINT", "valueFrom": secret},
    ]
    objects = objects_of(document)
    decode, prefill = (
        engine_pod(objects, "llama-pd-decode"),
        engine_pod(objects, "llama-pd-prefill"),
    )
    for field, value in scheduling.items():
        assert decode["spec"][field] == value and field not in prefill["spec"]
    router = engine_pod(objects, "llama-pd-router")
    assert router["spec"]["priorityClassName"] == "inference" and "affinity" not in router["spec"]
    role_env = [
        {"name": "NCCL_DEBUG", "value": "INFO"},
        {"name": "HF_ENDPOINT", "valueFrom": secret},
    ]
    engine, download = decode["spec"]["containers"][0], decode["spec"]["initContainers"][0]
    for container in (engine, download):  # after the operator's own variables
        assert container["env"][-2:] == role_env
        assert len({variable["name"] for variable in container["env"]}) == len(container["env"])
    assert not any(v["name"] == "NCCL_DEBUG" for v in prefill["spec"]["containers"][0]["env"])


def test_the_operators_own_engine_environment_is_what_a_role_may_not_name() -> None:
    document = load_example("disaggregated.yaml")
    document["spec"]["engine"]["apiKeySecret"] = {"name": "keys", "key": "api"}
    document["spec"]["model"]["huggingFace"]["tokenSecret"] = {"name": "hf", "key": "token"}
    document["spec"]["kvTransfer"] = {"ucx": {"transports": "rc", "netDevices": "mlx5_0:1"}}
    document["spec"]["engine"]["compileCache"] = {"claimName": "kernels"}
    pod = engine_pod(objects_of(document), "llama-pd-decode")
    containers = [*pod["spec"]["containers"], *pod["spec"]["initContainers"]]
    rendered = {variable["name"] for c in containers for variable in c["env"]}
    # the compile cache's only with one (a role may set them without)
    assert rendered == ENV_SET_BY_OPERATOR | set(COMPILE_CACHE_VARIABLES)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_init_container_has_cpu_and_memory_requests_and_limits(path) -> None:
    """A namespace ResourceQuota on cpu or memory refuses a pod any of whose containers lacks
    them (FailedCreate); the engine's are the user's, the init containers' the operator's."""
    pods = [
        o["spec"]["template"]["spec"]
        for o in objects_of(yaml.safe_load(path.read_text())).values()
        if o["kind"] == "Deployment"
    ]
    inits = [c for pod in pods for c in pod.get("initContainers", [])]
    for init in inits:
        for kind in ("requests", "limits"):
            assert set(init["resources"][kind]) == {"cpu", "memory"}, (init["name"], kind)


def test_init_containers_resources_are_the_operators_defaults() -> None:
    """Both sources' init containers get the same resources, whatever the role's own."""
    objects = objects_of(load_example("disaggregated.yaml"))
    (download,) = engine_pod(objects, "llama-pd-decode")["spec"]["initContainers"]
    quickstart = objects_of(load_example("quickstart.yaml"))
    (make,) = engine_pod(quickstart, "quickstart-prefill")["spec"]["initContainers"]
    assert download["name"] == "download-model" and make["name"] == "make-model"
    assert (
        download["resources"]
        == make["resources"]
        == {
            "requests": {"cpu": "100m", "memory": "1Gi"},
            "limits": {"cpu": "1", "memory": "4Gi"},
        }
    )


def test_model_sources() -> None:
    hf = engine_pod(objects_of(load_example("disaggregated.yaml")), "llama-pd-decode")["spec"]
    (download,) = hf["initContainers"]
    assert download["command"] == ["hf", "download", "meta-llama/Llama-3.1-8B-Instruct"]
    token = next(e for e in download["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    model = next(v for v in hf["volumes"] if v["name"] == "model")
    assert model["emptyDir"] == {"sizeLimit": "40Gi"}

    pvc = engine_pod(objects_of(load_example("mixed.yaml")), "qwen3-mixed-mixed")["spec"]
    model = next(v for v in pvc["volumes"] if v["name"] == "model")
    assert model["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    args = pvc["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/models/qwen3-8b"
    assert "initContainers" not in pvc

    host = engine_pod(objects_of(load_example("autoscaled-keda.yaml")), "llama-keda-decode")["spec"]
    model = next(v for v in host["volumes"] if v["name"] == "model")
    assert model["hostPath"]["path"] == "/mnt/models/llama-3.1-8b-instruct"

    # the tiny model: made by `kubesgl make-tiny-model` into an emptyDir at each pod start
    tiny = engine_pod(objects_of(load_example("quickstart.yaml")), "quickstart-prefill")["spec"]
    (make,) = tiny["initContainers"]
    assert make["command"] + make["args"] == [
        "kubesgl",
        "make-tiny-model",
        "/models/tiny",
        "--arch",
        "llama",
    ]
    assert make["image"] == load_example("quickstart.yaml")["spec"]["image"]
    assert {"name": "model", "mountPath": "/models"} in make["volumeMounts"]
    assert next(v for v in tiny["volumes"] if v["name"] == "model") == {
        "name": "model",
        "emptyDir": {},
    }
    args = tiny["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/models/tiny"


def test_cpu_device_requests_no_gpu() -> None:
    document = with_changes(load_example("mixed.yaml"), "spec.engine.device", "cpu")
    container = engine_pod(objects_of(document), "qwen3-mixed-mixed")["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})


@pytest.mark.parametrize("kinds", [["limits"], ["requests", "limits"]])
@pytest.mark.parametrize("gpu", ["nvidia.com/mig-3g.40gb", "nvidia.com/gpu.shared"])
def test_a_role_asking_for_another_gpu_resource_gets_no_whole_gpu_too(gpu, kinds) -> None:
    """A MIG slice (mixed strategy) or a renamed time-sliced GPU: with nvidia.com/gpu beside it
    the pod asked for both and stayed Pending."""
    resources = {kind: {gpu: 1} for kind in kinds}
    document = with_changes(load_example("mixed.yaml"), "spec.mixed.resources", resources)
    container = engine_pod(objects_of(document), "qwen3-mixed-mixed")["spec"]["containers"][0]
    assert container["resources"] == resources
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})


def test_a_network_device_of_nvidias_is_no_gpu() -> None:
    # the NVIDIA network operator's RDMA devices (UCX over RDMA between prefill and decode)
    limits = {"nvidia.com/hostdev": 1}
    document = with_changes(load_example("mixed.yaml"), "spec.mixed.resources.limits", limits)
    container = engine_pod(objects_of(document), "qwen3-mixed-mixed")["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/hostdev": 1, "nvidia.com/gpu": 1}


def test_prefill_decode_settings_are_not_used_in_mixed_mode() -> None:
    """kvTransfer's UCX settings and router.pdMinPrefillTokens tune the handover from prefill to
    decode pods: a mixed pool has none, and its router got --pd-min-prefill-tokens."""
    document = load_example("mixed.yaml")
    document["spec"]["kvTransfer"] = {"ucx": {"transports": "tcp"}}
    document["spec"]["router"]["pdMinPrefillTokens"] = 64
    objects = objects_of(document)
    engine = engine_pod(objects, "qwen3-mixed-mixed")["spec"]["containers"][0]
    assert not any(variable["name"].startswith("UCX_") for variable in engine["env"])
    router = objects[("Deployment", "qwen3-mixed-router")]["spec"]["template"]["spec"]
    assert not any(arg.startswith("--pd-") for arg in router["containers"][0]["args"])


def test_router_discovers_pods_with_read_only_rbac() -> None:
    objects = objects_of(load_example("disaggregated.yaml"))
    role = objects[("Role", "llama-pd-router")]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    pod = objects[("Deployment", "llama-pd-router")]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "llama-pd-router"
    args = pod["containers"][0]["args"]
    assert args[0] == "router"
    assert args[args.index("--kube-namespace") + 1] == "default"
    selectors = [args[i + 1] for i, arg in enumerate(args) if arg == "--kube-selector"]
    assert selectors == ["app.kubernetes.io/name=kubesgl", "app.kubernetes.io/instance=llama-pd"]
    assert args[args.index("--cache-threshold") + 1] == "0.5"
    assert "--pd-min-prefill-tokens" not in args  # unset: the router's default
    quickstart = objects_of(load_example("quickstart.yaml"))[("Deployment", "quickstart-router")]
    args = quickstart["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--pd-min-prefill-tokens") + 1] == "0"
    service = objects[("Service", "llama-pd")]
    assert service["spec"]["ports"][0]["port"] == 8000
    assert objects[("Service", "llama-pd-decode")]["spec"]["clusterIP"] == "None"
    for role in ("prefill", "decode", "router"):
        assert objects[("PodDisruptionBudget", f"llama-pd-{role}")]["spec"]["maxUnavailable"] == 1


def test_the_router_service_takes_annotations_and_source_ranges() -> None:
    plain = objects_of(load_example("mixed.yaml"))[("Service", "qwen3-mixed")]
    assert "annotations" not in plain["metadata"]
    assert "loadBalancerSourceRanges" not in plain["spec"]
    internal = {"service.beta.kubernetes.io/aws-load-balancer-internal": "true"}
    router = {
        "serviceType": "LoadBalancer",
        "serviceAnnotations": internal,
        "loadBalancerSourceRanges": ["10.0.0.0/8", "fd00::/8"],
    }
    document = with_changes(load_example("mixed.yaml"), "spec.router", router)
    service = objects_of(document)[("Service", "qwen3-mixed")]
    assert service["metadata"]["annotations"] == internal
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["loadBalancerSourceRanges"] == ["10.0.0.0/8", "fd00::/8"]
    kubernetes_validate.validate(service, K8S_VERSION, strict=True)


@pytest.mark.parametrize("service_type", ["ClusterIP", "NodePort", "LoadBalancer"])
def test_the_router_service_leaves_external_traffic_policy_to_the_user(service_type) -> None:
    """docs/operator.md (Security) has users set externalTrafficPolicy: Local on the Service
    themselves: it survives the operator's forced apply only while the apply leaves it out."""
    document = with_changes(load_example("mixed.yaml"), "spec.router.serviceType", service_type)
    service = objects_of(document)[("Service", "qwen3-mixed")]
    assert "externalTrafficPolicy" not in service["spec"]


# The InferenceService's labels as Helm, Argo CD and Kueue users set them: the operator's own
# keys among them are not copied.
USER_LABELS = {
    "team": "search",
    "kueue.x-k8s.io/queue-name": "inference",
    "app.kubernetes.io/managed-by": "Helm",
    "app.kubernetes.io/instance": "argo-app",
    "kubesgl.io/role": "prefill",
}


def test_the_inference_services_labels_reach_every_child_but_not_the_operators_keys() -> None:
    document = load_example("disaggregated.yaml")
    document["metadata"]["labels"] = USER_LABELS
    document["metadata"]["annotations"] = {
        "kubectl.kubernetes.io/last-applied-configuration": "{}",
        "kubesgl.io/last-handled-configuration": "{}",
    }
    objects = objects_of(document)
    plain = objects_of(load_example("disaggregated.yaml"))
    copied = {"team": "search", "kueue.x-k8s.io/queue-name": "inference"}
    for key, obj in objects.items():
        meta = obj["metadata"]
        assert meta["labels"]["app.kubernetes.io/instance"] == "llama-pd"
        assert meta["labels"]["app.kubernetes.io/managed-by"] != "Helm"
        assert not any(key.endswith("-configuration") for key in meta.get("annotations", {}))
        own = plain[key]["metadata"]["labels"]
        assert meta["labels"] == {**copied, **own}  # a role only where it was
        if obj["kind"] != "PodMonitor":
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_inference_services_labels_stay_off_the_pods() -> None:
    """A relabel of the InferenceService (Helm's chart and version labels change with every
    upgrade) must not restart the engines: the labels reach the Deployments' own metadata, where
    Kueue reads its queue name, and not their pod templates."""
    document = load_example("disaggregated.yaml")
    document["metadata"]["labels"] = USER_LABELS
    objects = objects_of(document)
    plain = objects_of(load_example("disaggregated.yaml"))
    deployments = [key for key, obj in objects.items() if obj["kind"] == "Deployment"]
    assert len(deployments) == 3
    for key in deployments:
        deployment = objects[key]
        assert deployment["metadata"]["labels"]["team"] == "search"
        assert deployment["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "inference"
        # the pods exactly as without the InferenceService's labels: no rollout
        assert deployment["spec"]["template"] == plain[key]["spec"]["template"]


def test_pods_take_their_roles_labels_and_annotations() -> None:
    document = load_example("disaggregated.yaml")
    document["metadata"]["labels"] = {"team": "search", "tier": "gold"}
    document["spec"]["decode"]["podLabels"] = {"sidecar.istio.io/inject": "true", "tier": ""}
    document["spec"]["decode"]["podAnnotations"] = {"proxy.istio.io/config": "{}"}
    document["spec"]["router"]["podAnnotations"] = {"cost-center": "42"}
    objects = objects_of(document)

    def pod_meta(role: str) -> dict[str, Any]:
        return objects[("Deployment", f"llama-pd-{role}")]["spec"]["template"]["metadata"]

    decode, prefill, router = pod_meta("decode"), pod_meta("prefill"), pod_meta("router")
    assert decode["labels"] == {  # the role's own: none of the InferenceService's
        "tier": "",
        "sidecar.istio.io/inject": "true",
        **naming.object_labels("llama-pd", "decode"),
    }
    assert prefill["labels"] == naming.object_labels("llama-pd", "prefill")
    assert decode["annotations"]["proxy.istio.io/config"] == "{}"
    assert "proxy.istio.io/config" not in prefill["annotations"]
    assert router["annotations"]["cost-center"] == "42"
    assert router["annotations"]["prometheus.io/scrape"] == "true"
    deployment = objects[("Deployment", "llama-pd-decode")]
    assert "sidecar.istio.io/inject" not in deployment["metadata"]["labels"]  # pods' only
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


SELECTOR_KEYS = frozenset({"selector", "podSelector", "namespaceSelector", "matchLabels"})


def _selectors(value: Any, path: str = "") -> dict[str, Any]:
    """Every selector in a rendered object, by its path: a Deployment's spec.selector, a
    Service's, a PDB's, a NetworkPolicy's podSelector and its peers', a PodMonitor's, the
    router's --kube-selector, an autoscaler's metric selectors."""
    found: dict[str, Any] = {}
    if isinstance(value, dict):
        for key, sub in value.items():
            if key in SELECTOR_KEYS:
                found[f"{path}.{key}"] = sub
            else:
                found.update(_selectors(sub, f"{path}.{key}"))
    elif isinstance(value, list):
        for index, sub in enumerate(value):
            found.update(_selectors(sub, f"{path}.{index}"))
            if isinstance(sub, str) and sub == "--kube-selector":
                found[f"{path}.{index + 1}"] = value[index + 1]
    return found


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_labels_of_the_inference_service_and_its_pods_change_no_selector(path) -> None:
    """Selectors are the operator's labels only: a Deployment's is immutable (the apply would
    be refused), and a Service, PDB or NetworkPolicy selecting by a user's label would let go of
    the pods when it changes, or take in others' pods carrying it."""
    plain_document = yaml.safe_load(path.read_text())
    document = with_changes(plain_document, "metadata.labels", USER_LABELS)
    isvc = parse_inference_service(plain_document)
    for role in [*isvc.spec.engine_roles(), "router"]:
        document = with_changes(
            document, f"spec.{role}.podLabels", {"team": "pods", "sidecar.istio.io/inject": "true"}
        )
    objects, plain = objects_of(document), objects_of(plain_document)
    assert objects.keys() == plain.keys()
    kinds = set()
    for key, obj in objects.items():
        selectors = _selectors(obj)
        assert selectors == _selectors(plain[key]), key
        kinds |= {key[0]} if selectors else set()
        if obj["kind"] == "Deployment":  # its pods still match it
            match = obj["spec"]["selector"]["matchLabels"]
            assert match.items() <= obj["spec"]["template"]["metadata"]["labels"].items()
            assert "team" not in match
    assert {"Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"} <= kinds


def test_owner_references_only_with_a_uid() -> None:
    objects = objects_of(load_example("mixed.yaml"))
    for obj in objects.values():
        (owner,) = obj["metadata"]["ownerReferences"]
        assert owner["kind"] == "InferenceService" and owner["controller"] is True
    plain = render(parse_inference_service(load_example("mixed.yaml")))
    assert all("ownerReferences" not in obj["metadata"] for obj in plain)


def test_an_unset_engine_replicas_is_left_to_the_deployment() -> None:
    """No apply writes a count the spec does not give: removing autoscaling would otherwise
    scale a role from the autoscaler's count to 1 at once."""
    document = load_example("mixed.yaml")
    document["spec"]["mixed"].pop("replicas")
    assert "replicas" not in objects_of(document)[("Deployment", "qwen3-mixed-mixed")]["spec"]
    document["spec"]["mixed"]["replicas"] = 3
    assert objects_of(document)[("Deployment", "qwen3-mixed-mixed")]["spec"]["replicas"] == 3


def test_hpa_owns_replicas_of_autoscaled_roles() -> None:
    objects = objects_of(load_example("autoscaled-hpa.yaml"))
    for role in ("prefill", "decode"):
        assert "replicas" not in objects[("Deployment", f"llama-hpa-{role}")]["spec"]
    assert objects[("Deployment", "llama-hpa-router")]["spec"]["replicas"] == 1
    decode = objects[("HorizontalPodAutoscaler", "llama-hpa-decode")]["spec"]
    assert decode["scaleTargetRef"]["name"] == "llama-hpa-decode"
    assert (decode["minReplicas"], decode["maxReplicas"]) == (2, 8)
    # KV usage: the fullest pod's, an External metric (one saturated pod beside idle ones scales)
    (metric,) = decode["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"] == {
        "name": "kubesgl_kv_cache_usage_ratio_max",
        "selector": {"matchLabels": {"app_kubernetes_io_instance": "llama-hpa", "role": "decode"}},
    }
    assert metric["external"]["target"] == {"type": "Value", "value": "800m"}
    prefill = objects[("HorizontalPodAutoscaler", "llama-hpa-prefill")]["spec"]["metrics"][0]
    assert prefill["pods"]["metric"]["name"] == "kubesgl_num_waiting_requests"
    assert prefill["pods"]["target"]["averageValue"] == "4"


def test_keda_scaled_objects_query_the_role_pods() -> None:
    objects = objects_of(load_example("autoscaled-keda.yaml"))
    assert not [key for key in objects if key[0] == "HorizontalPodAutoscaler"]
    decode = objects[("ScaledObject", "llama-keda-decode")]["spec"]
    (trigger,) = decode["triggers"]
    # the decode pool's limit is its KV pool: running requests stop growing there (the
    # example's runningRequests target of 48 was never reached with decode saturated)
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    assert trigger["metadata"]["threshold"] == "0.8"
    assert trigger["metadata"]["query"] == (
        'max(kubesgl_kv_cache_usage_ratio{namespace="default",'
        'pod=~"llama-keda-decode-[a-z0-9]+-?[a-z0-9]{5}",role="decode"})'
    )
    prefill = objects[("ScaledObject", "llama-keda-prefill")]["spec"]["triggers"][0]
    assert prefill["metricType"] == "Value"
    assert "histogram_quantile(0.9" in prefill["metadata"]["query"]
    assert prefill["metadata"]["threshold"] == "0.5"


def _behaviors(objects: dict[tuple[str, str], Any]) -> dict[str, Any]:
    """Each autoscaler's HPA behavior, by its name: the HPA's own, or the one KEDA gives its HPA."""
    found = {}
    for (kind, name), obj in objects.items():
        if kind == "HorizontalPodAutoscaler":
            found[name] = obj["spec"]["behavior"]
        elif kind == "ScaledObject":
            found[name] = obj["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    return found


@pytest.mark.parametrize("provider", ["hpa", "keda"])
def test_scale_up_is_bounded_by_default_while_new_engines_load(provider: str) -> None:
    """Kubernetes' default (4 pods or 100% per 15 s, no window) reached maxReplicas before a
    new engine served: by default a role at most doubles within 180 s, on what a minute asks."""
    document = load_example(f"autoscaled-{provider}.yaml")
    document["spec"]["autoscaling"].pop("behavior", None)
    behaviors = _behaviors(objects_of(document))
    assert sorted(behaviors) == [f"llama-{provider}-decode", f"llama-{provider}-prefill"]
    for behavior in behaviors.values():
        assert behavior == {
            "scaleUp": {
                "stabilizationWindowSeconds": 60,
                "selectPolicy": "Max",
                "policies": [{"type": "Percent", "value": 100, "periodSeconds": 180}],
            }
        }


@pytest.mark.parametrize("provider", ["hpa", "keda"])
def test_the_specs_behavior_overrides_the_default_field_by_field(provider: str) -> None:
    """scaleUp's fields given replace the default's, the others stay; scaleDown as given. Valid
    as the HPA's (Kubernetes' schema) and as KEDA's (its CRD's)."""
    document = with_changes(
        load_example(f"autoscaled-{provider}.yaml"),
        "spec.autoscaling.behavior",
        {
            "scaleUp": {"policies": [{"type": "Pods", "value": 2, "periodSeconds": 300}]},
            "scaleDown": {"stabilizationWindowSeconds": 600, "selectPolicy": "Min"},
        },
    )
    objects = objects_of(document)
    for behavior in _behaviors(objects).values():
        assert behavior == {
            "scaleUp": {
                "stabilizationWindowSeconds": 60,
                "selectPolicy": "Max",
                "policies": [{"type": "Pods", "value": 2, "periodSeconds": 300}],
            },
            "scaleDown": {"stabilizationWindowSeconds": 600, "selectPolicy": "Min"},
        }
    for obj in objects.values():
        if obj["kind"] in CRD_MODELS:
            validate_against_crd_model(obj)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize(("target", "threshold"), [
    (2, "2"), (0.8, "0.8"), (1234567, "1234567"), (123456.7, "123456.7"),
    (0.0012345678, "0.0012345678"), (1e16, "10000000000000000"),
])  # fmt: skip
def test_a_keda_threshold_is_the_targets_every_digit(target, threshold) -> None:
    """Written with 6 significant digits, 1234567 was 1.23457e+06: KEDA scaled at 1234570."""
    document = with_changes(
        load_example("autoscaled-keda.yaml"), "spec.autoscaling.prefill.target", target
    )
    scaled = objects_of(document)[("ScaledObject", "llama-keda-prefill")]
    assert scaled["spec"]["triggers"][0]["metadata"]["threshold"] == threshold
    assert float(threshold) == target


@pytest.mark.parametrize("provider", ["hpa", "keda"])
def test_decode_scales_on_rooms_waiting_for_kv_slots(provider: str) -> None:
    """A decode pod's queue holds the rooms its KV pool has no slots for: the decode pool's
    saturation, as prompts queued are the prefill pool's (decode took only running requests
    and KV usage)."""
    document = load_example(f"autoscaled-{provider}.yaml")
    document["spec"]["autoscaling"]["decode"] = {
        "maxReplicas": 8,
        "metric": "waitingRequests",
        "target": 2,
    }
    objects = objects_of(document)
    name = f"llama-{provider}-decode"
    if provider == "hpa":
        (metric,) = objects[("HorizontalPodAutoscaler", name)]["spec"]["metrics"]
        assert metric["pods"] == {
            "metric": {"name": "kubesgl_num_waiting_requests"},
            "target": {"type": "AverageValue", "averageValue": "2"},
        }
        return
    (trigger,) = objects[("ScaledObject", name)]["spec"]["triggers"]
    assert trigger["metricType"] == "AverageValue" and trigger["metadata"]["threshold"] == "2"
    assert trigger["metadata"]["query"] == (
        f'sum(kubesgl_num_waiting_requests{{namespace="default",'
        f'pod=~"{name}-[a-z0-9]+-?[a-z0-9]{{5}}",role="decode"}})'
    )


@pytest.mark.parametrize("length", [17, 40, 50, 56, 57, 58, 63])
def test_keda_queries_match_the_pods_of_long_deployment_names(length: int) -> None:
    """The API server cuts `<deployment>-<hash>-` at 58 characters before the 5 random ones:
    a pattern that wants the whole name, a hash and a dash matched no pod of a long name, so
    KEDA read nothing and kept the minimum replicas."""
    deployment = ("a" * length)[: length - 7] + "-decode"
    pattern = naming.pod_name_pattern(deployment)
    for pod_template_hash in ("5d4b9c8f5b", "7d4b9c8f", "abc"):
        pod = f"{deployment}-{pod_template_hash}-"[:58] + "xk2p9"
        assert re.fullmatch(pattern, pod), (pattern, pod)
    others = [f"{deployment}x-5d4b9c8f5b-xk2p9", f"{deployment}-5d4b9c8f5b-xk2p9-extra"]
    assert not [other for other in others if len(deployment) < 57 and re.fullmatch(pattern, other)]
    assert "\\" not in pattern  # no escapes: a PromQL string would need them doubled


def test_keda_kv_usage_is_the_fullest_pods() -> None:
    """One pod at 0.96 beside an idle one: the average (0.48) never reaches a target of 0.8,
    the maximum does (issue 15)."""
    document = load_example("autoscaled-keda.yaml")
    document["spec"]["autoscaling"]["decode"] = {
        "maxReplicas": 8,
        "metric": "kvCacheUsage",
        "target": 0.8,
    }
    trigger = objects_of(document)[("ScaledObject", "llama-keda-decode")]["spec"]["triggers"][0]
    assert trigger["metricType"] == "Value" and trigger["metadata"]["threshold"] == "0.8"
    assert trigger["metadata"]["query"] == (
        'max(kubesgl_kv_cache_usage_ratio{namespace="default",'
        'pod=~"llama-keda-decode-[a-z0-9]+-?[a-z0-9]{5}",role="decode"})'
    )
    pods = [0.96, 0.0]
    value = max(pods)  # what the query returns
    replicas = len(pods)
    assert math.ceil(replicas * value / 0.8) > replicas  # the HPA's rule for a Value target


def test_pod_monitor_only_when_asked() -> None:
    assert ("PodMonitor", "qwen3-mixed") not in objects_of(load_example("mixed.yaml"))
    monitor = objects_of(load_example("disaggregated.yaml"))[("PodMonitor", "llama-pd")]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["podMetricsEndpoints"] == [
        {"port": "http", "path": "/metrics", "interval": "15s"}
    ]


def test_the_pod_monitors_labels_win_over_the_inference_services() -> None:
    # Helm puts `release: <its release>` on what it applies; kube-prometheus-stack selects
    # PodMonitors by `release: prometheus`: the PodMonitor's own labels must keep their values.
    document = load_example("disaggregated.yaml")
    document["metadata"]["labels"] = {"release": "my-app", "team": "search"}
    monitor = objects_of(document)[("PodMonitor", "llama-pd")]
    assert monitor["metadata"]["labels"] == {
        "team": "search",
        "release": "prometheus",
        **naming.object_labels("llama-pd"),
    }


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {
        variable["name"]: variable.get("value", variable.get("valueFrom"))
        for variable in container["env"]
    }


def test_api_keys_come_from_secrets_through_the_environment_never_argv() -> None:
    document = with_changes(
        load_example("disaggregated.yaml"),
        "spec.engine.apiKeySecret",
        {"name": "keys", "key": "api"},
    )
    document = with_changes(
        document, "spec.router.adminKeySecret", {"name": "keys", "key": "admin"}
    )
    objects = objects_of(document)
    api_key = {"secretKeyRef": {"name": "keys", "key": "api"}}
    for role in ("prefill", "decode", "router"):
        container = engine_pod(objects, f"llama-pd-{role}")["spec"]["containers"][0]
        assert "--api-key" not in container["args"] and "--admin-api-key" not in container["args"]
        assert not [arg for arg in container["args"] if "$(" in arg], (
            "the kubelet would expand it into argv"
        )
        assert env_of(container)["KUBESGL_API_KEY"] == api_key  # the router sends it to engines
    router = engine_pod(objects, "llama-pd-router")["spec"]["containers"][0]
    assert env_of(router)["KUBESGL_ROUTER_ADMIN_KEY"] == {
        "secretKeyRef": {"name": "keys", "key": "admin"}
    }
    decode = engine_pod(objects, "llama-pd-decode")["spec"]["containers"][0]
    assert "KUBESGL_ROUTER_ADMIN_KEY" not in env_of(decode)
    # the init container downloading the model gets neither key
    (download,) = engine_pod(objects, "llama-pd-decode")["spec"]["initContainers"]
    assert {"KUBESGL_API_KEY", "KUBESGL_ROUTER_ADMIN_KEY"}.isdisjoint(env_of(download))

    plain = objects_of(load_example("disaggregated.yaml"))
    for role in ("prefill", "decode", "router"):
        env = env_of(engine_pod(plain, f"llama-pd-{role}")["spec"]["containers"][0])
        assert {"KUBESGL_API_KEY", "KUBESGL_ROUTER_ADMIN_KEY"}.isdisjoint(env)


def test_the_router_has_requests_and_limits() -> None:
    router = engine_pod(objects_of(load_example("mixed.yaml")), "qwen3-mixed-router")["spec"]
    assert router["containers"][0]["resources"] == {
        "requests": {"cpu": "500m", "memory": "512Mi"},
        "limits": {"cpu": "2", "memory": "2Gi"},
    }
    # a 10 s preStop pause (endpoints stop sending to it first), the engines' 60 s drain
    # (spec.engine.shutdownTimeoutSeconds' default) for its streams, slack
    assert router["containers"][0]["lifecycle"] == {"preStop": {"sleep": {"seconds": 10}}}
    assert router["terminationGracePeriodSeconds"] == 10 + 60 + 5
    given = {"requests": {"cpu": 2}, "limits": {"memory": "4Gi"}}
    document = with_changes(load_example("mixed.yaml"), "spec.router.resources", given)
    router = engine_pod(objects_of(document), "qwen3-mixed-router")["spec"]
    assert router["containers"][0]["resources"] == given  # replaces the default as a whole


@pytest.mark.parametrize("replicas", [1, 4, 10])
def test_a_router_rollout_stops_no_router_before_its_replacement_is_ready(replicas) -> None:
    """Kubernetes' default stops a quarter of 4 or more routers before their replacements
    serve: a rollout then served on fewer routers, and one whose new pods never become ready
    (an image older than the operator, refusing a flag the operator renders) kept them down."""
    document = with_changes(load_example("mixed.yaml"), "spec.router.replicas", replicas)
    router = objects_of(document)[("Deployment", "qwen3-mixed-router")]["spec"]
    assert router["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 0},
    }


@pytest.mark.parametrize(("example", "router_name"), [
    ("mixed.yaml", "qwen3-mixed-router"), ("disaggregated.yaml", "llama-pd-router"),
])  # fmt: skip
@pytest.mark.parametrize("shutdown_timeout", [1, 120, 900])
def test_the_router_gives_streams_as_long_as_the_engines_drain(
    example, router_name, shutdown_timeout
) -> None:
    """The router's --shutdown-timeout is the engines' (spec.engine.shutdownTimeoutSeconds):
    it used to cut streams after a fixed 25 s that its engines were still draining. Its
    grace period follows it as an engine's does."""
    document = with_changes(
        load_example(example), "spec.engine.shutdownTimeoutSeconds", shutdown_timeout
    )
    pod = engine_pod(objects_of(document), router_name)["spec"]
    args = pod["containers"][0]["args"]
    assert args.count("--shutdown-timeout") == 1
    assert args[args.index("--shutdown-timeout") + 1] == str(shutdown_timeout)
    # the preStop pause, the drain, slack
    assert pod["terminationGracePeriodSeconds"] == 10 + shutdown_timeout + 5
    check_router_args(args[1:], {})  # the router takes the command line


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_each_roles_pods_prefer_different_nodes(path) -> None:
    """Replicas on one node all went down with it; preferred only, never left Pending."""
    for (kind, _), obj in objects_of(yaml.safe_load(path.read_text())).items():
        if kind == "Deployment":
            assert obj["spec"]["template"]["spec"]["topologySpreadConstraints"] == [
                {
                    "maxSkew": 1,
                    "topologyKey": key,
                    "whenUnsatisfiable": "ScheduleAnyway",
                    "labelSelector": obj["spec"]["selector"],
                    "matchLabelKeys": ["pod-template-hash"],
                }
                # zones too: pods with constraints of their own lose the scheduler's defaults
                for key in ("kubernetes.io/hostname", "topology.kubernetes.io/zone")
            ]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_pods_that_are_not_ready_never_block_a_drain(path) -> None:
    """An engine stuck loading or crash-looping used up its role's budget: with Kubernetes'
    default policy a node drain waited on it for ever."""
    budgets = [
        obj
        for (kind, _), obj in objects_of(yaml.safe_load(path.read_text())).items()
        if kind == "PodDisruptionBudget"
    ]
    assert budgets
    for budget in budgets:
        assert budget["spec"]["maxUnavailable"] == 1
        assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_a_download_to_the_nodes_disk_requests_room_for_it() -> None:
    """Without an ephemeral-storage request the scheduler put the pod on a node without room
    for the model, where the kubelet evicted it mid-download."""
    document = load_example("disaggregated.yaml")
    assert document["spec"]["model"]["huggingFace"]["sizeLimit"] == "40Gi"
    decode = engine_pod(objects_of(document), "llama-pd-decode")["spec"]
    assert decode["containers"][0]["resources"]["requests"]["ephemeral-storage"] == "40Gi"
    # the role's own ask for ephemeral storage, a request or a limit (the request then), wins
    for kind in ("requests", "limits"):
        given = with_changes(document, f"spec.decode.resources.{kind}", {"ephemeral-storage": 1})
        (container,) = engine_pod(objects_of(given), "llama-pd-decode")["spec"]["containers"]
        storage = [values.get("ephemeral-storage") for values in container["resources"].values()]
        assert 1 in storage and "40Gi" not in storage
    unbounded = with_changes(document, "spec.model.huggingFace.sizeLimit", ...)
    decode = engine_pod(objects_of(unbounded), "llama-pd-decode")["spec"]
    assert "ephemeral-storage" not in decode["containers"][0]["resources"].get("requests", {})


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_a_volume_already_owned_by_the_pods_group_is_not_chowned_again(path) -> None:
    """With fsGroup alone the kubelet changes the group of every file of a writable volume (a
    shared models PVC) at each pod start."""
    for (kind, _), obj in objects_of(yaml.safe_load(path.read_text())).items():
        if kind == "Deployment":
            security = obj["spec"]["template"]["spec"]["securityContext"]
            assert security["fsGroup"] == 1000
            assert security["fsGroupChangePolicy"] == "OnRootMismatch"


def test_the_routers_liveness_probe_is_not_its_readiness() -> None:
    """The router's /health answers 503 while no worker can serve. As its liveness probe too,
    it had the kubelet restart the router every minute while the engines loaded their model or
    a pool was down (CrashLoopBackOff, the prefix trees lost at each restart)."""
    objects = objects_of(load_example("disaggregated.yaml"))
    (router,) = engine_pod(objects, "llama-pd-router")["spec"]["containers"]
    assert router["readinessProbe"]["httpGet"]["path"] == "/health"
    assert router["livenessProbe"]["httpGet"]["path"] == "/liveness"


def test_shm_size_follows_tensor_parallelism_unless_given() -> None:
    def shm(document: dict[str, Any], name: str) -> dict[str, Any]:
        volumes = engine_pod(objects_of(document), name)["spec"]["volumes"]
        return next(v for v in volumes if v["name"] == "dshm")["emptyDir"]

    assert shm(load_example("mixed.yaml"), "qwen3-mixed-mixed") == {
        "medium": "Memory",
        "sizeLimit": "1Gi",
    }
    document = with_changes(load_example("mixed.yaml"), "spec.mixed.tensorParallelSize", 4)
    assert shm(document, "qwen3-mixed-mixed")["sizeLimit"] == "4Gi"
    document = with_changes(document, "spec.mixed.shmSizeLimit", "16Gi")
    assert shm(document, "qwen3-mixed-mixed")["sizeLimit"] == "16Gi"


# What a NetworkPolicy-enforcing CNI allows, for the rules the operator renders: a pod selected
# by some policy takes ingress that one of their rules allows; other pods take everything.
def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_matches(peer: dict[str, Any], policy_namespace: str, source: dict[str, Any]) -> bool:
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], source["namespace_labels"]):
            return False
    elif source["namespace"] != policy_namespace:
        return False
    return _selects(peer.get("podSelector", {}), source["labels"])


def allowed(objects, source: dict[str, Any], target_labels: dict[str, str], port: int) -> bool:
    policies = [
        o
        for kind_name, o in objects.items()
        if kind_name[0] == "NetworkPolicy" and _selects(o["spec"]["podSelector"], target_labels)
    ]
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"]["ingress"]:
            peers = rule.get("from")
            if peers is not None and not any(
                _peer_matches(peer, policy["metadata"]["namespace"], source) for peer in peers
            ):
                continue
            ports = rule.get("ports")
            if ports is None or any(p["port"] == port and p["protocol"] == "TCP" for p in ports):
                return True
    return False


def pod(
    instance: str, role: str | None, namespace: str = "default", **labels: str
) -> dict[str, Any]:
    own = {"app.kubernetes.io/name": "kubesgl", "app.kubernetes.io/instance": instance}
    if role is not None:
        own["kubesgl.io/role"] = role
    return {
        "namespace": namespace,
        "namespace_labels": {"kubernetes.io/metadata.name": namespace},
        "labels": {**own, **labels} if instance else labels,
    }


def test_network_policies_let_in_only_what_the_service_needs() -> None:
    objects = objects_of(load_example("disaggregated.yaml"))
    names = sorted(name for kind, name in objects if kind == "NetworkPolicy")
    assert names == ["llama-pd-decode", "llama-pd-prefill", "llama-pd-router"]
    for name in names:
        assert objects[("NetworkPolicy", name)]["spec"]["policyTypes"] == ["Ingress"]
    router, prefill, decode = (pod("llama-pd", role) for role in ("router", "prefill", "decode"))
    client = pod("", None, "apps", app="web")
    prometheus = pod("", None, "monitoring", **{"app.kubernetes.io/name": "prometheus"})
    other_router = pod("other", "router")  # another InferenceService's router
    targets = {role: pod("llama-pd", role)["labels"] for role in ("router", "prefill", "decode")}

    def may(source, role, port) -> bool:
        return allowed(objects, source, targets[role], port)

    assert may(client, "router", 8000) and may(prometheus, "router", 8000)
    assert not may(client, "router", 9000)
    for role in ("prefill", "decode"):
        assert may(router, role, 30000) and may(prometheus, role, 30000)  # requests, /metrics
        assert not may(client, role, 30000) and not may(other_router, role, 30000)
        assert not may(prometheus, role, 8998)
    assert may(decode, "prefill", 8998)  # the bootstrap server
    assert may(router, "prefill", 8998)  # room cancels of failed prefill requests
    assert not may(router, "prefill", 41234) and not may(router, "decode", 8998)
    for port in (8998, 30000, 41234):  # and UCX's ports, both ways
        assert may(decode, "prefill", port) and may(prefill, "decode", port)
    assert not may(pod("other", "decode"), "prefill", 8998)
    assert not may(prefill, "prefill", 41234) and not may(decode, "router", 8000 + 1)


def test_network_policy_settings() -> None:
    mixed = objects_of(load_example("mixed.yaml"))
    assert sorted(name for kind, name in mixed if kind == "NetworkPolicy") == [
        "qwen3-mixed-mixed",
        "qwen3-mixed-router",
    ]
    (rule,) = mixed[("NetworkPolicy", "qwen3-mixed-mixed")]["spec"]["ingress"]  # no peer engines
    assert rule["ports"] == [{"protocol": "TCP", "port": 30000}]
    assert rule["from"][1] == {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }

    off = with_changes(load_example("mixed.yaml"), "spec.networkPolicy", {"enabled": False})
    assert not [key for key in objects_of(off) if key[0] == "NetworkPolicy"]

    gateway = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
    scraper = {"podSelector": {"matchLabels": {"app": "vmagent"}}}  # this namespace only
    document = with_changes(
        load_example("mixed.yaml"),
        "spec.networkPolicy",
        {"clientsFrom": [gateway], "metricsFrom": [scraper]},
    )
    objects = objects_of(document)
    target = pod("qwen3-mixed", "router")["labels"]
    engine = pod("qwen3-mixed", "mixed")["labels"]
    assert allowed(objects, pod("", None, "gateway", app="envoy"), target, 8000)
    assert not allowed(objects, pod("", None, "apps", app="web"), target, 8000)
    assert allowed(objects, pod("", None, "default", app="vmagent"), target, 8000)
    assert allowed(objects, pod("", None, "default", app="vmagent"), engine, 30000)
    assert not allowed(objects, pod("", None, "other", app="vmagent"), engine, 30000)
    prometheus = pod("", None, "monitoring", **{"app.kubernetes.io/name": "prometheus"})
    assert not allowed(objects, prometheus, engine, 30000)


def test_clients_may_be_address_blocks() -> None:
    block = {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}
    clients = [{"ipBlock": block}, {"ipBlock": {"cidr": "fd00::/8"}}]
    document = with_changes(load_example("mixed.yaml"), "spec.networkPolicy.clientsFrom", clients)
    policy = objects_of(document)[("NetworkPolicy", "qwen3-mixed-router")]
    (rule,) = policy["spec"]["ingress"]
    prometheus = {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }
    assert rule["from"] == [{"ipBlock": block}, {"ipBlock": {"cidr": "fd00::/8"}}, prometheus]
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)


def test_scrapers_may_be_address_blocks() -> None:
    """docs/operator.md (Security): metricsFrom takes an ipBlock as clientsFrom does."""
    scrapers = [{"ipBlock": {"cidr": "10.0.0.0/8"}}]
    document = with_changes(load_example("mixed.yaml"), "spec.networkPolicy.metricsFrom", scrapers)
    policy = objects_of(document)[("NetworkPolicy", "qwen3-mixed-mixed")]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"][1:] == scrapers  # after this instance's router pods
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)


RDMA = {"resourceName": "rdma/rdma_shared_device_a", "count": 2}


def test_rdma_gives_both_roles_the_nics_and_ipc_lock_and_keeps_the_rest_restricted() -> None:
    document = load_example("disaggregated.yaml")
    document["spec"]["kvTransfer"] = {
        "ucx": {"transports": "rc,cuda_copy", "netDevices": "mlx5_0:1"},
        "rdma": RDMA,
    }
    objects = objects_of(document)
    for name in ("llama-pd-prefill", "llama-pd-decode"):
        pod = engine_pod(objects, name)
        (container,) = pod["spec"]["containers"]
        resources = container["resources"]
        # an extended resource: requested and limited alike, beside what the role asks for
        assert resources["requests"] == {
            "cpu": "8",
            "memory": "64Gi",
            "ephemeral-storage": "40Gi",
            "rdma/rdma_shared_device_a": 2,
        }
        assert resources["limits"] == {"nvidia.com/gpu": 1, "rdma/rdma_shared_device_a": 2}
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"add": ["IPC_LOCK"], "drop": ["ALL"]},
        }
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        (init,) = pod["spec"]["initContainers"]  # the download pins no memory for a NIC
        assert init["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        env = {v["name"]: v["value"] for v in container["env"] if "value" in v}
        assert env["UCX_TLS"] == "rc,cuda_copy" and env["UCX_NET_DEVICES"] == "mlx5_0:1"
    router = objects[("Deployment", "llama-pd-router")]["spec"]["template"]["spec"]
    assert router["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_without_rdma_engines_keep_no_capability_and_no_nic() -> None:
    for path in EXAMPLES:
        document = yaml.safe_load(path.read_text())
        if "rdma" in document["spec"].get("kvTransfer", {}):
            continue
        for obj in objects_of(document).values():
            if obj["kind"] == "Deployment":
                for container in obj["spec"]["template"]["spec"]["containers"]:
                    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
                    limits = container.get("resources", {}).get("limits", {})
                    assert not any(name.startswith("rdma/") for name in limits)


def test_a_compile_cache_is_the_claim_mounted_where_flashinfer_and_triton_keep_kernels() -> None:
    document = load_example("disaggregated.yaml")
    document["spec"]["engine"]["compileCache"] = {"claimName": "kernels"}
    objects = objects_of(document)
    for name in ("llama-pd-prefill", "llama-pd-decode"):
        pod = engine_pod(objects, name)["spec"]
        (container,) = pod["containers"]
        assert {"name": "compile-cache", "persistentVolumeClaim": {"claimName": "kernels"}} in (
            pod["volumes"]
        )
        assert {"name": "compile-cache", "mountPath": "/var/cache/kubesgl"} in (
            container["volumeMounts"]
        )
        env = {v["name"]: v.get("value") for v in container["env"]}
        # FlashInfer appends .cache/flashinfer/<version>/<archs> to its workspace base
        assert env["FLASHINFER_WORKSPACE_BASE"] == "/var/cache/kubesgl"
        assert env["TRITON_CACHE_DIR"] == "/var/cache/kubesgl/triton"
        assert env["HOME"] == "/tmp"  # everything else stays in the pod's own /tmp
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        (init,) = pod["initContainers"]  # the download compiles nothing
        assert all(m["name"] != "compile-cache" for m in init["volumeMounts"])


def test_without_a_compile_cache_kernels_stay_in_the_pods_tmp() -> None:
    pod = engine_pod(objects_of(load_example("mixed.yaml")), "qwen3-mixed-mixed")["spec"]
    assert [v["name"] for v in pod["volumes"]] == ["model", "dshm", "tmp"]
    names = {v["name"] for v in pod["containers"][0]["env"]}
    assert not names & {"FLASHINFER_WORKSPACE_BASE", "TRITON_CACHE_DIR"}
