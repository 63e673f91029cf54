"""Parsing an InferenceService: defaults, and every bad input named by its field."""

from __future__ import annotations

from typing import Any

import pytest
from operator_fixtures import EXAMPLES, load_example, with_changes

from kubesgl.operator.validation import (
    InvalidSpec,
    SpecWarning,
    parse_inference_service,
    spec_warnings,
)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_parses(path) -> None:
    import yaml

    parse_inference_service(yaml.safe_load(path.read_text()))


def test_defaults_follow_the_crd() -> None:
    minimal = {
        "apiVersion": "kubesgl.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "tiny"},
        "spec": {"image": "img", "model": {"hostPath": {"path": "/m"}}},
    }
    spec = parse_inference_service(minimal).spec
    assert spec.mode == "mixed"
    assert list(spec.engine_roles()) == ["mixed"]
    assert spec.engine_roles()["mixed"].replicas is None  # the Deployment's own count
    assert spec.engine.device == "cuda" and spec.engine.shutdown_timeout_seconds == 60
    assert spec.router.policy == "cache_aware" and spec.router.replicas == 1
    assert spec.router.admin_key_secret is None
    assert spec.router.resources.requests == {"cpu": "500m", "memory": "512Mi"}
    assert spec.router.resources.limits == {"cpu": "2", "memory": "2Gi"}
    assert spec.network_policy.enabled and spec.network_policy.clients_from == []
    (prometheus,) = spec.network_policy.metrics_from
    assert prometheus.pod_selector.match_labels == {"app.kubernetes.io/name": "prometheus"}
    assert spec.engine_roles()["mixed"].shm_size_limit is None


def problems_of(document) -> list[str]:
    with pytest.raises(InvalidSpec) as caught:
        parse_inference_service(document)
    return [str(problem) for problem in caught.value.problems]


@pytest.mark.parametrize(
    ("example", "path", "value", "expected"),
    [
        (
            "disaggregated.yaml",
            "spec.decode",
            ...,
            "spec.decode: required when mode is disaggregated",
        ),
        (
            "disaggregated.yaml",
            "spec.prefill",
            ...,
            "spec.prefill: required when mode is disaggregated",
        ),
        (
            "disaggregated.yaml",
            "spec.mixed",
            {"replicas": 1},
            "spec.mixed: only used when mode is mixed",
        ),
        (
            "mixed.yaml",
            "spec.prefill",
            {"replicas": 1},
            "spec.prefill: only used when mode is disaggregated",
        ),
        (
            "disaggregated.yaml",
            "spec.decode.tensorParallelSize",
            2,
            "spec.decode.tensorParallelSize: must equal spec.prefill.tensorParallelSize (1)",
        ),
        ("mixed.yaml", "spec.model.hostPath", {"path": "/m"}, "spec.model: set exactly one of"),
        ("mixed.yaml", "spec.model.pvc", ..., "spec.model: set exactly one of"),
        (
            "quickstart.yaml",
            "spec.model.pvc",
            {"claimName": "m"},
            "spec.model: set exactly one of pvc, hostPath, huggingFace, tiny",
        ),
        (
            "quickstart.yaml",
            "spec.model.tiny.arch",
            "gpt",
            "spec.model.tiny.arch: Input should be 'llama'",
        ),
        (
            "quickstart.yaml",
            "spec.router.pdMinPrefillTokens",
            -1,
            "spec.router.pdMinPrefillTokens: Input should be greater than or equal to 0",
        ),
        (
            "mixed.yaml",
            "spec.mixed.replicas",
            -1,
            "spec.mixed.replicas: Input should be greater than or equal to 0",
        ),
        (
            "mixed.yaml",
            "spec.mixed.tensorParallelSize",
            0,
            "spec.mixed.tensorParallelSize: Input should be greater",
        ),
        (
            "mixed.yaml",
            "spec.mixed.replica",
            2,
            "spec.mixed.replica: Extra inputs are not permitted",
        ),
        ("mixed.yaml", "spec.engine.dtype", "fp8", "spec.engine.dtype: Input should be"),
        (
            "mixed.yaml",
            "spec.mode",
            "split",
            "spec.mode: Input should be 'mixed' or 'disaggregated'",
        ),
        ("mixed.yaml", "spec.image", ..., "spec.image: Field required"),
        ("mixed.yaml", "spec.router.policy", "fastest", "spec.router.policy: Input should be"),
        (
            "mixed.yaml",
            "spec.mixed.resources.limits",
            {"memory": "lots"},
            "spec.mixed.resources.limits.memory: Value error, 'lots' is not a Kubernetes quantity",
        ),
        (
            "mixed.yaml",
            "spec.mixed.resources.limits",
            {"nvidia.com/gpu": 2},
            "spec.mixed.resources.limits.nvidia.com/gpu: must equal tensorParallelSize (1)",
        ),
        (  # a renamed time-sliced GPU is counted as one
            "mixed.yaml",
            "spec.mixed.resources.limits",
            {"nvidia.com/gpu.shared": 2},
            "spec.mixed.resources.limits.nvidia.com/gpu.shared: must equal tensorParallelSize (1)",
        ),
        (  # a CUDA process sees one MIG slice: ranks on slices never meet
            "mixed.yaml",
            "spec.mixed",
            {"tensorParallelSize": 2, "resources": {"limits": {"nvidia.com/mig-3g.40gb": 2}}},
            "spec.mixed.resources.limits.nvidia.com/mig-3g.40gb: a MIG slice serves one process",
        ),
        (
            "mixed.yaml",
            "metadata.name",
            "Qwen_3",
            "metadata.name: Value error, must be a DNS label",
        ),
        ("mixed.yaml", "metadata.name", "llama3.1", "metadata.name: Value error, must be a DNS"),
        (
            "mixed.yaml",
            "spec.model.pvc.path",
            "../etc",
            "spec.model.pvc.path: Value error, '../etc'",
        ),
        (
            "mixed.yaml",
            "spec.model.pvc.path",
            "/models",
            "spec.model.pvc.path: Value error, '/models'",
        ),
        (
            "mixed.yaml",
            "spec.mixed.replicas",
            "2",
            "spec.mixed.replicas: Input should be a valid int",
        ),
        (
            "mixed.yaml",
            "spec.engine.disableCudaGraph",
            "true",
            "spec.engine.disableCudaGraph: Input should be a valid boolean",
        ),
        (
            "mixed.yaml",
            "spec.mixed.resources.requests",
            {"cpu": 0.5},
            'spec.mixed.resources.requests.cpu: Value error, write 0.5 as a string ("0.5")',
        ),
        (
            "mixed.yaml",
            "spec.mixed.tolerations",
            [{"key": "gpu", "operator": "Exists", "value": "yes"}],
            "spec.mixed.tolerations.0: Value error, operator Exists takes no value",
        ),
        (
            "mixed.yaml",
            "spec.mixed.tolerations",
            [{"key": "gpu", "effect": "NoSchedule", "tolerationSeconds": 60}],
            "spec.mixed.tolerations.0: Value error, tolerationSeconds needs effect NoExecute",
        ),
        (
            "mixed.yaml",
            "spec.mixed.tolerations",
            [{"effect": "NoSchedule"}],
            "spec.mixed.tolerations.0: Value error, without a key the operator must be Exists",
        ),
        (
            "mixed.yaml",
            "metadata.name",
            "a" * 56,
            "metadata.name: String should have at most 55 characters",
        ),
        (
            "autoscaled-hpa.yaml",
            "spec.autoscaling.decode.minReplicas",
            9,
            "spec.autoscaling.decode.minReplicas: greater than maxReplicas",
        ),
        (
            "autoscaled-hpa.yaml",
            "spec.autoscaling.decode.metric",
            "timeToFirstToken",  # the decode engine's TTFT includes the prefill engine's
            "spec.autoscaling.decode.metric: Input should be 'runningRequests', 'kvCacheUsage' or 'waitingRequests'",
        ),
        (
            "autoscaled-hpa.yaml",
            "spec.autoscaling.mixed",
            {"maxReplicas": 2, "target": 1},
            "spec.autoscaling.mixed: the mixed role does not run in disaggregated mode",
        ),
        (
            "autoscaled-hpa.yaml",
            "spec.autoscaling.prefill.target",
            0.0004,  # an HPA's quantity has milli-units: this would be 0m, which it refuses
            "spec.autoscaling.prefill.target: Input should be greater than or equal to 0.001",
        ),
        (
            "autoscaled-hpa.yaml",
            "spec.autoscaling.decode.target",
            2,
            "spec.autoscaling.decode.target: kvCacheUsage is a ratio of the KV pool: the target must be in (0, 1]",
        ),
        (  # the prefill pods' waitingRequests (target 4) never pass the queue the engines keep
            "autoscaled-hpa.yaml",
            "spec.engine.maxQueuedRequests",
            4,
            "spec.autoscaling.prefill.target: a pod's waitingRequests never exceeds "
            "engine.maxQueuedRequests (4), which refuses the requests beyond it: the target "
            "must be below it, or the pool never scales out",
        ),
        (
            "autoscaled-keda.yaml",
            "spec.autoscaling.prometheusAddress",
            ...,
            "spec.autoscaling.prometheusAddress: required when provider is keda",
        ),
        (  # counted against the memory limit, /dev/shm would leave the engine nothing
            "mixed.yaml",
            "spec.mixed.shmSizeLimit",
            "64Gi",
            "spec.mixed.shmSizeLimit: /dev/shm (64Gi; unset: 1Gi per tensor-parallel rank) "
            "must be below resources.limits.memory (64Gi)",
        ),
        (  # the default, 1Gi per rank, too
            "mixed.yaml",
            "spec.mixed.resources.limits.memory",
            "1Gi",
            "spec.mixed.shmSizeLimit: /dev/shm (1Gi; unset: 1Gi per tensor-parallel rank)",
        ),
        (  # it was ignored: an HPA reads metrics through the custom-metrics adapter
            "autoscaled-hpa.yaml",
            "spec.autoscaling.prometheusAddress",
            "http://prometheus.monitoring:9090",
            "spec.autoscaling.prometheusAddress: only used when provider is keda",
        ),
        (
            "disaggregated.yaml",
            "spec.model.huggingFace.sizeLimit",
            "big",
            "spec.model.huggingFace.sizeLimit: Value error, 'big' is not a Kubernetes quantity",
        ),
        (
            "quickstart.yaml",
            "spec.decode.shmSizeLimit",
            "lots",
            "spec.decode.shmSizeLimit: Value error, 'lots' is not a Kubernetes quantity",
        ),
        (
            "mixed.yaml",
            "spec.router.adminKeySecret",
            {"name": "keys"},
            "spec.router.adminKeySecret.key: Field required",
        ),
        (
            "mixed.yaml",
            "spec.router.resources.limits",
            {"memory": "lots"},
            "spec.router.resources.limits.memory: Value error, 'lots' is not a Kubernetes quantity",
        ),
        (
            "disaggregated.yaml",
            "spec.decode.env",
            [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "UCX_TLS", "value": "rc"}],
            "spec.decode.env.1.name: UCX_TLS is set by the operator",
        ),
        (
            "mixed.yaml",
            "spec.mixed.env",
            [{"name": "HTTPS_PROXY", "value": "http://a"}, {"name": "HTTPS_PROXY", "value": "b"}],
            "spec.mixed.env.1.name: HTTPS_PROXY is given twice",
        ),
        (
            "mixed.yaml",
            "spec.mixed.env",
            [
                {
                    "name": "TOKEN",
                    "value": "x",
                    "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}},
                }
            ],
            "spec.mixed.env.0: set value or valueFrom, not both",
        ),
        (
            "mixed.yaml",
            "spec.mixed.env",
            [{"name": "A=B", "value": "x"}],
            "spec.mixed.env.0.name: String should match pattern",
        ),
        (
            "mixed.yaml",
            "spec.mixed.runtimeClassName",
            "",
            "spec.mixed.runtimeClassName: String should have at least 1 character",
        ),
        (
            "mixed.yaml",
            "spec.networkPolicy.enabled",
            "maybe",
            "spec.networkPolicy.enabled: Input should be a valid boolean",
        ),
        (
            "mixed.yaml",
            "spec.networkPolicy.metricsFrom",
            [{"podSelector": {"matchLabels": {"app": "p"}}}, {}],
            "spec.networkPolicy.metricsFrom.1: set ipBlock, or namespaceSelector, podSelector "
            "or both",
        ),
        (
            "mixed.yaml",
            "spec.networkPolicy.clientsFrom",
            [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {"matchLabels": {"a": "b"}}}],
            "spec.networkPolicy.clientsFrom.0: ipBlock goes alone, without namespaceSelector or "
            "podSelector",
        ),
        (
            "mixed.yaml",
            "spec.networkPolicy.clientsFrom",
            [{"ipBlock": {"cidr": "10.0.0.1/8"}}],
            "spec.networkPolicy.clientsFrom.0.ipBlock.cidr: Value error, '10.0.0.1/8' is not a "
            "CIDR",
        ),
        (
            "mixed.yaml",
            "spec.networkPolicy.clientsFrom",
            [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.0.0.0/8"]}}],
            "spec.networkPolicy.clientsFrom.0.ipBlock: Value error, except: 10.0.0.0/8 is not "
            "strictly inside 10.0.0.0/8",
        ),
        (
            "mixed.yaml",
            "spec.networkPolicy.clientsFrom",
            [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["fd00::/8"]}}],
            "spec.networkPolicy.clientsFrom.0.ipBlock: Value error, except: fd00::/8 is not "
            "strictly inside 10.0.0.0/8",
        ),
        (
            "mixed.yaml",
            "spec.networkPolicy.clientsFrom",
            [{"podSelector": {"labels": {}}}],
            "spec.networkPolicy.clientsFrom.0.podSelector.labels: Extra inputs are not permitted",
        ),
        (
            "disaggregated.yaml",
            "spec.model.huggingFace.repo",
            "no-slash",
            "spec.model.huggingFace.repo: String should match pattern",
        ),
        # empty strings were taken as "unset" (a servedName or UCX settings silently left to
        # the default) or passed on (`hf download --revision ''` in the pod's init container)
        (
            "quickstart.yaml",
            "spec.model.servedName",
            "",
            "spec.model.servedName: String should have at least 1 character",
        ),
        (
            "disaggregated.yaml",
            "spec.model.huggingFace.revision",
            "",
            "spec.model.huggingFace.revision: String should have at least 1 character",
        ),
        (
            "quickstart.yaml",
            "spec.kvTransfer.ucx.transports",
            "",
            "spec.kvTransfer.ucx.transports: String should have at least 1 character",
        ),
        (
            "quickstart.yaml",
            "spec.kvTransfer.ucx.netDevices",
            "",
            "spec.kvTransfer.ucx.netDevices: String should have at least 1 character",
        ),
        (
            "mixed.yaml",
            "metadata.labels",
            {"team": "search and rescue"},
            "metadata.labels.team: Value error, 'search and rescue' is not a label value",
        ),
        (
            "disaggregated.yaml",
            "spec.decode.podLabels",
            {"app.kubernetes.io/name": "llm"},
            "spec.decode.podLabels: app.kubernetes.io/name is set by the operator",
        ),
        (
            "mixed.yaml",
            "spec.router.podAnnotations",
            {"prometheus.io/scrape": "false"},
            "spec.router.podAnnotations: prometheus.io/scrape is set by the operator",
        ),
        (
            "mixed.yaml",
            "spec.mixed.podLabels",
            {"sidecar.istio.io/inject": True},
            "spec.mixed.podLabels.sidecar.istio.io/inject: Input should be a valid string",
        ),
        (
            "mixed.yaml",
            "spec.router.serviceAnnotations",
            {"-internal": "true"},
            "spec.router.serviceAnnotations.-internal.[key]: Value error, '-internal' is not a "
            "Kubernetes key",
        ),
        (
            "mixed.yaml",
            "spec.router.loadBalancerSourceRanges",
            ["10.0.0.1/8"],
            "spec.router.loadBalancerSourceRanges.0: Value error, '10.0.0.1/8' is not a CIDR",
        ),
        (
            "mixed.yaml",
            "spec.router.loadBalancerSourceRanges",
            ["2001:DB8::/32"],
            "spec.router.loadBalancerSourceRanges.0: Value error, '2001:DB8::/32': write it as "
            "2001:db8::/32",
        ),
        # the HPA behavior Kubernetes refuses (its limits: a window of at most 3600 s, a
        # policy's period 1 to 1800 s and value above 0, at least one policy when given)
        (
            "autoscaled-hpa.yaml",
            "spec.autoscaling.behavior",
            {"scaleUp": {"stabilizationWindowSeconds": 3601}},
            "spec.autoscaling.behavior.scaleUp.stabilizationWindowSeconds: Input should be less "
            "than or equal to 3600",
        ),
        (
            "autoscaled-keda.yaml",
            "spec.autoscaling.behavior",
            {"scaleDown": {"policies": []}},
            "spec.autoscaling.behavior.scaleDown.policies: List should have at least 1 item",
        ),
        (
            "autoscaled-hpa.yaml",
            "spec.autoscaling.behavior",
            {"scaleUp": {"policies": [{"type": "Pods", "value": 0, "periodSeconds": 60}]}},
            "spec.autoscaling.behavior.scaleUp.policies.0.value: Input should be greater than or "
            "equal to 1",
        ),
        (
            "autoscaled-hpa.yaml",
            "spec.autoscaling.behavior",
            {"scaleUp": {"policies": [{"type": "Percent", "value": 50, "periodSeconds": 1801}]}},
            "spec.autoscaling.behavior.scaleUp.policies.0.periodSeconds: Input should be less "
            "than or equal to 1800",
        ),
        (
            "autoscaled-hpa.yaml",
            "spec.autoscaling.behavior",
            {"scaleUp": {"selectPolicy": "Average"}},
            "spec.autoscaling.behavior.scaleUp.selectPolicy: Input should be 'Max', 'Min' or "
            "'Disabled'",
        ),
        (
            "autoscaled-hpa.yaml",
            "spec.autoscaling.behavior",
            {"scaleUp": {"tolerance": "0.05"}},
            "spec.autoscaling.behavior.scaleUp.tolerance: Extra inputs are not permitted",
        ),
        (
            "mixed.yaml",  # a ClusterIP Service: the API server refuses source ranges on it
            "spec.router.loadBalancerSourceRanges",
            ["10.0.0.0/8"],
            "spec.router.loadBalancerSourceRanges: only with serviceType LoadBalancer",
        ),
    ],
)
def test_bad_input_names_the_field(example, path, value, expected) -> None:
    problems = problems_of(with_changes(load_example(example), path, value))
    assert any(problem.startswith(expected) for problem in problems), problems


@pytest.mark.parametrize(
    ("example", "role", "bounds"),
    [("autoscaled-hpa.yaml", "decode", "2 to 8"), ("autoscaled-mixed.yaml", "mixed", "1 to 6")],
)
def test_replicas_of_an_autoscaled_role_are_warned_of(example, role, bounds) -> None:
    """The autoscaler owns the count: a role's replicas beside it did nothing, and nothing said
    so. A warning, not a problem: it applies once autoscaling is removed."""
    document = with_changes(load_example(example), f"spec.{role}.replicas", 3)
    assert spec_warnings(parse_inference_service(document)) == [
        SpecWarning(
            "ReplicasIgnored",
            f"spec.{role}.replicas (3) is ignored while spec.autoscaling.{role} scales the role "
            f"({bounds} replicas): the autoscaler owns the count, and this one applies only "
            "once autoscaling is removed; leave replicas out, or set the bounds in "
            "spec.autoscaling",
        )
    ]


def test_replicas_of_a_role_no_autoscaler_scales_are_not_warned_of() -> None:
    document = with_changes(load_example("mixed.yaml"), "spec.mixed.replicas", 3)
    assert spec_warnings(parse_inference_service(document)) == []
    document = load_example("autoscaled-hpa.yaml")
    document["spec"]["autoscaling"].pop("prefill")
    document["spec"]["prefill"]["replicas"] = 2
    assert spec_warnings(parse_inference_service(document)) == []


def test_a_dev_shm_on_the_cpu_is_not_held_to_the_memory_limit() -> None:
    # nothing fills it there, and `kubesgl up` (the quickstart's CPU engines) makes none
    spec = with_changes(load_example("quickstart.yaml"), "spec.decode.shmSizeLimit", "8Gi")
    assert parse_inference_service(spec).spec.engine.device == "cpu"


# Every map of labels (or of what Kubernetes checks as labels: a nodeSelector, a selector's
# matchLabels), as (example, path set, value's place in it, where its problems are named)
LABEL_FIELDS = [
    ("mixed.yaml", "metadata.labels", None, "metadata.labels"),
    ("disaggregated.yaml", "spec.decode.podLabels", None, "spec.decode.podLabels"),
    ("mixed.yaml", "spec.router.podLabels", None, "spec.router.podLabels"),
    ("mixed.yaml", "spec.mixed.nodeSelector", None, "spec.mixed.nodeSelector"),
    ("mixed.yaml", "spec.router.nodeSelector", None, "spec.router.nodeSelector"),
    (
        "disaggregated.yaml",
        "spec.monitoring.podMonitor.labels",
        None,
        "spec.monitoring.podMonitor.labels",
    ),
    (
        "mixed.yaml",
        "spec.networkPolicy.clientsFrom",
        "podSelector",
        "spec.networkPolicy.clientsFrom.0.podSelector.matchLabels",
    ),
    (
        "mixed.yaml",
        "spec.networkPolicy.metricsFrom",
        "namespaceSelector",
        "spec.networkPolicy.metricsFrom.0.namespaceSelector.matchLabels",
    ),
]


def _with_labels(example: str, path: str, selector: str | None, labels: dict[str, Any]):
    value: Any = labels if selector is None else [{selector: {"matchLabels": labels}}]
    return with_changes(load_example(example), path, value)


@pytest.mark.parametrize(("example", "path", "selector", "field"), LABEL_FIELDS)
@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        ({"team": "search and rescue"}, "team: Value error, 'search and rescue' is not a label "),
        ({"-team": "search"}, "-team.[key]: Value error, '-team' is not a Kubernetes key"),
        ({"Example.com/team": "search"}, "Example.com/team.[key]: Value error"),
        ({"team": "x" * 64}, "team: Value error"),
    ],
)
def test_every_map_of_labels_is_checked_as_kubernetes_checks_labels(
    example, path, selector, field, labels, expected
) -> None:
    """One type for every such map: a nodeSelector or matchLabels the API server refuses was
    rendered, and the apply of the Deployment or NetworkPolicy failed."""
    problems = problems_of(_with_labels(example, path, selector, labels))
    assert any(problem.startswith(f"{field}.{expected}") for problem in problems), problems


@pytest.mark.parametrize(("example", "path", "selector", "field"), LABEL_FIELDS)
def test_every_map_of_labels_takes_kubernetes_labels(example, path, selector, field) -> None:
    labels = {"team": "search", "example.com/tier": "", "nvidia.com/gpu.product": "H100-SXM"}
    parse_inference_service(_with_labels(example, path, selector, labels))


def test_pod_monitor_labels_may_not_name_the_operators_keys() -> None:
    """The operator's own labels are set over them: the PodMonitor would not carry the value."""
    document = with_changes(
        load_example("disaggregated.yaml"),
        "spec.monitoring.podMonitor.labels",
        {"release": "prometheus", "app.kubernetes.io/instance": "llm"},
    )
    assert problems_of(document) == [
        "spec.monitoring.podMonitor.labels: app.kubernetes.io/instance is set by the operator"
    ]


# Every quantity field of the spec, in an example that has the field's block
QUANTITY_FIELDS = [
    ("disaggregated.yaml", "spec.model.huggingFace.sizeLimit"),
    # roles without a memory limit, which /dev/shm must be below
    ("disaggregated.yaml", "spec.decode.shmSizeLimit"),
    ("mixed.yaml", "spec.mixed.resources.requests.memory"),
    ("mixed.yaml", "spec.router.resources.requests.cpu"),
]


@pytest.mark.parametrize(("example", "path"), QUANTITY_FIELDS)
@pytest.mark.parametrize("value", ["40 Gi", "1_000", "Infinity", "2gi", "1e3.5", ""])
def test_a_quantity_the_api_server_refuses_is_refused(example, path, value) -> None:
    """The Python client's parse_quantity takes "40 Gi" (spaces, underscores, Infinity): the
    spec was rendered, and the API server refused the Deployment."""
    problems = problems_of(with_changes(load_example(example), path, value))
    assert problems == [f"{path}: Value error, {value!r} is not a Kubernetes quantity"]


@pytest.mark.parametrize(("example", "path"), QUANTITY_FIELDS)
@pytest.mark.parametrize("value", ["-1Gi", -1])
def test_a_quantity_below_0_is_refused(example, path, value) -> None:
    """Each is a size or an amount, which the API server refuses below 0."""
    problems = problems_of(with_changes(load_example(example), path, value))
    assert problems == [f"{path}: Value error, {value!r} is below 0"]


@pytest.mark.parametrize(("example", "path"), QUANTITY_FIELDS)
@pytest.mark.parametrize("value", ["40Gi", "1.5Gi", ".5Ki", "1e3", "+2k", "3", 4096])
def test_every_quantity_field_takes_a_kubernetes_quantity(example, path, value) -> None:
    """One quantity type everywhere: sizeLimit and shmSizeLimit take an integer too, as the
    emptyDir's own sizeLimit does (and whole bytes only, with no m suffix: below)."""
    parse_inference_service(with_changes(load_example(example), path, value))


@pytest.mark.parametrize(("example", "path"), QUANTITY_FIELDS)
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2000m", "'2000m' is 2 bytes, m counting thousandths of a byte; did you mean 2000Mi?"),
        ("1000m", "'1000m' is 1 byte, m counting thousandths of a byte; did you mean 1000Mi?"),
    ],
)
def test_a_size_limit_in_thousandths_is_refused_even_when_whole(
    example, path, value, expected
) -> None:
    """2000m is 2 whole bytes, which the size limits took: the m suffix on a size is almost
    surely a typo for Mi. A resource request or limit keeps taking it (cpu: 2000m)."""
    document = with_changes(load_example(example), path, value)
    if not path.endswith("izeLimit"):
        parse_inference_service(document)
        return
    assert problems_of(document) == [f"{path}: Value error, {expected}"]


@pytest.mark.parametrize(("example", "path"), QUANTITY_FIELDS)
@pytest.mark.parametrize("value", [0, "0", "0Gi", "0.0", "+0", "0e3"])
def test_a_size_limit_of_0_is_refused(example, path, value) -> None:
    """An emptyDir the pod writes into (the download, /dev/shm) cannot be of size 0, which the
    API server takes; a resource request or limit of 0 stays allowed (was: every 0 taken)."""
    document = with_changes(load_example(example), path, value)
    if not path.endswith("izeLimit"):
        parse_inference_service(document)
        return
    assert problems_of(document) == [
        f"{path}: Value error, {value!r} leaves no room: give a size above 0, or leave it unset"
    ]


@pytest.mark.parametrize(("example", "path"), QUANTITY_FIELDS)
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("512m", "'512m' is 0.512 bytes, m counting thousandths of a byte; did you mean 512Mi?"),
        ("1500m", "'1500m' is 1.5 bytes, m counting thousandths of a byte; did you mean 1500Mi?"),
        ("1e-9", "'1e-9' is 0.000000001 bytes, not whole bytes; give whole bytes, such as 4Gi"),
        (".5", "'.5' is 0.5 bytes, not whole bytes; give whole bytes, such as 4Gi"),
        ("0.1Ki", "'0.1Ki' is 102.4 bytes, not whole bytes; give whole bytes, such as 4Gi"),
    ],
)
def test_a_size_limit_of_a_fraction_of_a_byte_is_refused(example, path, value, expected) -> None:
    """A size limit is bytes: 512m is 0.512 bytes (512Mi meant, likely), which the API server
    takes and no emptyDir can hold; only a size of exactly 0 was refused. A resource request or
    limit still takes a fraction (cpu: 500m)."""
    document = with_changes(load_example(example), path, value)
    if not path.endswith("izeLimit"):
        parse_inference_service(document)
        return
    assert problems_of(document) == [f"{path}: Value error, {expected}"]


def test_engine_rules_across_options_are_reported_per_role() -> None:
    document = with_changes(
        load_example("disaggregated.yaml"), "spec.engine.enableMixedChunk", True
    )
    document = with_changes(document, "spec.engine.chunkedPrefillSize", 256)
    assert problems_of(document) == [
        "spec.engine: the engine refuses these options: --enable-mixed-chunk: "
        "--chunked-prefill-size (256) must be larger than --max-running-requests (256): a mixed "
        "step's decodes, one token each, count against it and leave the rest to the prefill "
        "chunk (prefill, decode)"
    ]
    parse_inference_service(with_changes(document, "spec.engine.chunkedPrefillSize", 4096))


@pytest.mark.parametrize(
    ("path", "extra_args", "expected"),
    [
        (
            "spec.decode.extraArgs",
            ["--kv-cache-dtype", "fp8_e4m3"],
            "spec.decode.extraArgs: --kv-cache-dtype fp8_e4m3 here, auto in the prefill role: "
            "a prefill engine writes its KV cache into the decode engine's pool, so both need "
            "the same model, dtype and KV cache dtype (decode)",
        ),
        (
            "spec.prefill.extraArgs",
            ["--dtype", "float16"],
            "spec.prefill.extraArgs: --dtype float16 here, bfloat16 in the decode role: a "
            "prefill engine writes its KV cache into the decode engine's pool, so both need the "
            "same model, dtype and KV cache dtype (prefill)",
        ),
        (
            "spec.decode.extraArgs",
            ["--served-model-name", "llama"],
            "spec.decode.extraArgs: --served-model-name llama here, "
            "meta-llama/Llama-3.1-8B-Instruct in the prefill role: both engines check the model "
            "each request names, so both need the same served name (decode)",
        ),
    ],
)
def test_prefill_and_decode_engines_that_cannot_pair_are_refused(path, extra_args, expected):
    """Each role's command line was checked alone: prefill and decode engines whose KV pools or
    model names differ started, became ready, and failed every request (a 502 naming "KV pools
    differ", or the prefill engine's 404)."""
    document = load_example("disaggregated.yaml")
    assert problems_of(with_changes(document, path, extra_args)) == [expected]
    # the same value in both roles pairs, and so does an explicit dtype beside auto, which the
    # checkpoint decides
    both = with_changes(document, "spec.prefill.extraArgs", extra_args)
    parse_inference_service(with_changes(both, "spec.decode.extraArgs", extra_args))
    auto = with_changes(document, "spec.engine.dtype", "auto")
    parse_inference_service(with_changes(auto, "spec.decode.extraArgs", ["--dtype", "float16"]))


def test_all_problems_are_reported_at_once() -> None:
    document = with_changes(load_example("disaggregated.yaml"), "spec.decode", ...)
    document = with_changes(document, "spec.model.pvc", {"claimName": "m"})
    problems = problems_of(document)
    assert len(problems) == 2, problems


def test_extra_args_the_engine_would_refuse_name_the_field_that_gave_them() -> None:
    """extraArgs reach the engine's command line as they are: a misspelt flag or a value the
    engine refuses made pods that exit at start, over and over."""
    document = load_example("disaggregated.yaml")
    with_shared = with_changes(document, "spec.engine.extraArgs", ["--max-runing-requests", "8"])
    assert problems_of(with_shared) == [
        "spec.engine.extraArgs: the engine refuses these options: unrecognized arguments: "
        "--max-runing-requests 8 (prefill, decode)"
    ]
    # a prefix of a flag is no flag, and another server's flag names the engine's
    with_prefix = with_changes(document, "spec.decode.extraArgs", ["--po=8080", "--block-size=16"])
    assert problems_of(with_prefix) == [
        "spec.decode.extraArgs: the engine refuses these options: unrecognized arguments: "
        "--po=8080 --block-size=16; --block-size is --page-size in kubesgl serve (decode)"
    ]
    with_role = with_changes(document, "spec.decode.extraArgs", ["--page-size", "0"])
    assert problems_of(with_role) == [
        "spec.decode.extraArgs: the engine refuses these options: --page-size must be at least 1, "
        "got 0 (decode)"
    ]
    server_option = with_changes(document, "spec.prefill.extraArgs", ["--watchdog-timeout", "1"])
    assert problems_of(server_option) == [
        "spec.prefill.extraArgs: the engine refuses these options: --watchdog-timeout must be "
        "at least 3 s: an idle scheduler says it is alive every 1 s (prefill)"
    ]
    assert problems_of(with_changes(document, "spec.decode.extraArgs", ["--help"]))
    fine = with_changes(document, "spec.decode.extraArgs", ["--max-running-requests", "8"])
    parse_inference_service(fine)


@pytest.mark.parametrize(
    ("path", "extra_args", "expected"),
    [
        (
            "spec.prefill.extraArgs",
            ["--port", "8080"],
            "spec.prefill.extraArgs: may not set --port",
        ),
        # --flag=value and another engine's flag of the option are the flag too
        ("spec.decode.extraArgs", ["--port=8080"], "spec.decode.extraArgs: may not set --port"),
        ("spec.prefill.extraArgs", ["--tp", "2"], "spec.prefill.extraArgs: may not set --tp-size"),
        (
            "spec.engine.extraArgs",
            ["--host", "127.0.0.1"],
            "spec.engine.extraArgs: may not set --host",
        ),
        (
            "spec.prefill.extraArgs",
            ["--role", "decode"],
            "spec.prefill.extraArgs: may not set --role",
        ),
        (
            "spec.prefill.extraArgs",
            ["--tp-size", "2"],
            "spec.prefill.extraArgs: may not set --tp-size",
        ),
        (
            "spec.decode.extraArgs",
            ["--device", "cpu"],
            "spec.decode.extraArgs: may not set --device",
        ),
        (
            "spec.prefill.extraArgs",
            ["--disaggregation-bootstrap-port", "9000"],
            "spec.prefill.extraArgs: may not set --disaggregation-bootstrap-port",
        ),
        (
            "spec.engine.extraArgs",
            ["--shutdown-timeout", "600"],
            "spec.engine.extraArgs: may not set --shutdown-timeout (set "
            "spec.engine.shutdownTimeoutSeconds",
        ),
        (
            "spec.engine.extraArgs",
            ["--api-key", "sekrit"],
            "spec.engine.extraArgs: may not set --api-key (set spec.engine.apiKeySecret",
        ),
        # a key from a Secret, known in the pod only, is still the engine's own
        (
            "spec.engine.extraArgs",
            ["--api-key=$(FROM_A_SECRET)"],
            "spec.engine.extraArgs: may not set --api-key (set spec.engine.apiKeySecret",
        ),
        (
            "spec.decode.extraArgs",
            ["--api-key-file", "/keys/api"],
            "spec.decode.extraArgs: may not set --api-key-file (set spec.engine.apiKeySecret",
        ),
    ],
)
def test_extra_args_may_not_change_the_flags_the_operator_relies_on(
    path, extra_args, expected
) -> None:
    """A port, host, role, tensor-parallel size, device, bootstrap port or drain the pod's
    probes, Services, GPUs or grace period do not follow made pods that never worked; an API
    key the router does not have, pods that refused its every request."""
    document = with_changes(load_example("disaggregated.yaml"), path, extra_args)
    (problem,) = problems_of(document)
    assert problem.startswith(expected)


def test_owned_flags_are_checked_beside_a_variable_known_in_the_pod_only() -> None:
    """A `$(VAR)` from a Secret keeps the line from being checked as a whole; --port 9000
    beside it still made pods that probes and Services never reached."""
    document = with_changes(
        load_example("disaggregated.yaml"),
        "spec.engine.extraArgs",
        ["--served-model-name", "$(FROM_A_SECRET)", "--port", "9000"],
    )
    (problem,) = problems_of(document)
    assert problem.startswith("spec.engine.extraArgs: may not set --port")


@pytest.mark.parametrize(
    "extra_args",
    [
        ["--port", "31000", "--log-level", "$(FROM_A_CONFIGMAP)"],
        ["--max-running-requests", "$(FROM_A_CONFIGMAP)", "--port=31000"],
        ["--port", "$(FROM_A_CONFIGMAP)"],
        ["--port=$(FROM_A_CONFIGMAP)"],
    ],
)
def test_owned_flags_are_found_whatever_a_variable_gives_another_flag(extra_args) -> None:
    """A `$(VAR)` known in the pod only, given to a flag that takes a number or a choice, made
    the command line unparseable, and the owned flags went unchecked: --port 31000 beside
    `--log-level $(VAR)` was accepted, and the same --port with a plain value refused. A port
    known in the pod only is not the operator's either."""
    from_a_configmap = {"configMapKeyRef": {"name": "c", "key": "k"}}
    document = with_changes(
        load_example("mixed.yaml"),
        "spec.mixed.env",
        [{"name": "FROM_A_CONFIGMAP", "valueFrom": from_a_configmap}],
    )
    (problem,) = problems_of(with_changes(document, "spec.mixed.extraArgs", extra_args))
    assert problem.startswith("spec.mixed.extraArgs: may not set --port"), problem
    # the same variable for a flag the operator does not own is left to the pod
    other = ["--port", "30000", "--log-level", "$(FROM_A_CONFIGMAP)"]
    parse_inference_service(with_changes(document, "spec.mixed.extraArgs", other))


def test_only_a_prefill_role_owns_the_bootstrap_port() -> None:
    """Mixed and decode engines announce no bootstrap port: the reason given was untrue."""
    document = with_changes(
        load_example("disaggregated.yaml"),
        "spec.decode.extraArgs",
        ["--disaggregation-bootstrap-port", "9000"],
    )
    parse_inference_service(document)  # the decode engine takes the flag, and nothing hangs on it


def test_extra_args_may_repeat_the_operators_values_and_set_other_options() -> None:
    document = with_changes(
        load_example("disaggregated.yaml"),
        "spec.engine.extraArgs",
        ["--port", "30000", "--mem-fraction-static", "0.5"],
    )
    parse_inference_service(document)


def test_router_extra_args_are_checked_by_the_routers_own_parser() -> None:
    """A router that refuses its command line only crash-loops; its extraArgs were passed on
    unchecked."""
    document = load_example("disaggregated.yaml")
    unknown = with_changes(document, "spec.router.extraArgs", ["--no-such-flag"])
    assert problems_of(unknown) == [
        "spec.router.extraArgs: the router refuses these options: unrecognized arguments: "
        "--no-such-flag"
    ]
    admin_secret = with_changes(document, "spec.router.adminKeySecret", {"name": "a", "key": "k"})
    key_twice = with_changes(admin_secret, "spec.router.extraArgs", ["--admin-api-key", "x"])
    assert problems_of(key_twice) == [
        "spec.router.extraArgs: the router refuses these options: the admin key is given twice: "
        "set KUBESGL_ROUTER_ADMIN_KEY or pass --admin-api-key, not both"
    ]
    for flag in (
        ["--port=8080"],
        ["--host", "127.0.0.1"],
        ["--kube-selector", "a=b"],
        ["--shutdown-timeout", "5"],  # spec.engine.shutdownTimeoutSeconds sets it
    ):
        (problem,) = problems_of(with_changes(document, "spec.router.extraArgs", flag))
        assert problem.startswith("spec.router.extraArgs: may not set --"), problem
    parse_inference_service(with_changes(document, "spec.router.extraArgs", ["--max-retries", "5"]))


def test_a_cpu_engine_takes_no_gpu_and_no_gpu_only_attention_backend() -> None:
    """Both rendered: the engine refused the backend at start, and the pod held GPUs it never
    used."""
    cpu = with_changes(load_example("mixed.yaml"), "spec.engine.device", "cpu")
    flashinfer = with_changes(cpu, "spec.engine.attentionBackend", "flashinfer")
    assert problems_of(flashinfer) == [
        "spec.engine: the engine refuses these options: --attention-backend flashinfer runs on "
        "CUDA GPUs; on the CPU use torch (or auto) (mixed)"
    ]
    triton = with_changes(cpu, "spec.mixed.extraArgs", ["--attention-backend=triton"])
    (problem,) = problems_of(triton)
    assert problem.startswith("spec.mixed.extraArgs: the engine refuses these options: ")
    interpreted = with_changes(
        triton, "spec.mixed.env", [{"name": "TRITON_INTERPRET", "value": "1"}]
    )
    parse_inference_service(interpreted)  # Triton's interpreter runs on the CPU
    for gpu in ("nvidia.com/gpu", "nvidia.com/mig-1g.10gb"):
        gpus = with_changes(cpu, "spec.mixed.resources", {"limits": {gpu: 4}})
        assert problems_of(gpus) == [
            f"spec.mixed.resources.limits.{gpu}: must be left out: with device cpu the "
            "engine uses no GPU"
        ]
    rdma = with_changes(cpu, "spec.mixed.resources", {"limits": {"nvidia.com/hostdev": 1}})
    parse_inference_service(rdma)  # an RDMA device of NVIDIA's network operator is no GPU


def test_the_command_line_is_checked_as_the_pod_runs_it() -> None:
    """extraArgs override the spec's own options, a flag's value may come after the shared
    extraArgs, and $(VAR) takes the role's variable as the kubelet expands it."""
    document = with_changes(
        load_example("disaggregated.yaml"), "spec.engine.enableMixedChunk", True
    )
    document = with_changes(document, "spec.engine.chunkedPrefillSize", 256)
    parse_inference_service(
        with_changes(document, "spec.engine.extraArgs", ["--max-running-requests", "128"])
    )
    split = with_changes(
        load_example("disaggregated.yaml"), "spec.engine.extraArgs", ["--page-size"]
    )
    for role in ("prefill", "decode"):
        split = with_changes(split, f"spec.{role}.extraArgs", ["16"])
    parse_inference_service(split)
    by_variable = with_changes(
        load_example("disaggregated.yaml"), "spec.engine.extraArgs", ["--page-size", "$(PAGES)"]
    )
    for role, value in (("prefill", "16"), ("decode", "0")):
        by_variable = with_changes(
            by_variable, f"spec.{role}.env", [{"name": "PAGES", "value": value}]
        )
    assert problems_of(by_variable) == [
        "spec.engine.extraArgs: the engine refuses these options: --page-size must be at least "
        "1, got 0 (decode)"
    ]
    from_secret = {"secretKeyRef": {"name": "s", "key": "k"}}
    by_variable = with_changes(
        by_variable, "spec.decode.env", [{"name": "PAGES", "valueFrom": from_secret}]
    )
    parse_inference_service(by_variable)  # known in the pod only: not checked


@pytest.mark.parametrize(
    ("path", "resources", "expected"),
    [
        (  # an RDMA device requested only: the API server refused every pod of the Deployment
            "spec.mixed.resources",
            {"requests": {"rdma/hca": 1}},
            "spec.mixed.resources.requests.rdma/hca: rdma/hca is not overcommitted, so "
            "Kubernetes needs it in resources.limits",
        ),
        (  # a MIG slice: the operator adds no whole GPU to the limits beside it
            "spec.mixed.resources",
            {"requests": {"nvidia.com/mig-3g.40gb": 1}},
            "spec.mixed.resources.requests.nvidia.com/mig-3g.40gb: nvidia.com/mig-3g.40gb is "
            "not overcommitted",
        ),
        (
            "spec.decode.resources",
            {"requests": {"nvidia.com/hostdev": 1}, "limits": {"nvidia.com/hostdev": 2}},
            "spec.decode.resources.requests.nvidia.com/hostdev: must equal "
            "resources.limits.nvidia.com/hostdev (2)",
        ),
        (
            "spec.router.resources",
            {"requests": {"hugepages-2Mi": "1Gi", "memory": "1Gi"}},
            "spec.router.resources.requests.hugepages-2Mi: hugepages-2Mi is not overcommitted",
        ),
    ],
)
def test_a_resource_kubernetes_does_not_overcommit_is_set_in_the_limits(
    path, resources, expected
) -> None:
    example = "disaggregated.yaml" if path.startswith("spec.decode") else "mixed.yaml"
    problems = problems_of(with_changes(load_example(example), path, resources))
    assert any(problem.startswith(expected) for problem in problems), problems


def test_resources_kubernetes_takes_are_taken() -> None:
    document = load_example("mixed.yaml")
    for resources in (
        {"limits": {"rdma/hca": 1}},  # the request is the limit
        {"requests": {"rdma/hca": "1"}, "limits": {"rdma/hca": 1}},
        {"requests": {"nvidia.com/gpu": 1}},  # the operator sets the limit: tensorParallelSize
        {"requests": {"cpu": "4", "nvidia.com/hostdev": 1}, "limits": {"nvidia.com/hostdev": 1}},
    ):
        parse_inference_service(with_changes(document, "spec.mixed.resources", resources))
    gpu_on_cpu = with_changes(document, "spec.engine.device", "cpu")
    gpu_on_cpu = with_changes(
        gpu_on_cpu, "spec.mixed.resources", {"requests": {"nvidia.com/gpu": 1}}
    )
    # reported once, as the GPU rule says it
    assert problems_of(gpu_on_cpu) == [
        "spec.mixed.resources.requests.nvidia.com/gpu: must be left out: with device cpu the "
        "engine uses no GPU"
    ]


@pytest.mark.parametrize(
    ("path", "resources", "field"),
    [
        ("spec.mixed.resources", {"limits": {"rdma/hca": "500m"}}, "limits.rdma/hca"),
        (
            "spec.mixed.resources",
            {"limits": {"nvidia.com/hostdev": "1.5"}},
            "limits.nvidia.com/hostdev",
        ),
        (
            "spec.router.resources",
            {"limits": {"example.com/dongle": "0.5"}},
            "limits.example.com/dongle",
        ),
    ],
)
def test_an_extended_resource_is_counted_in_whole_devices(path, resources, field) -> None:
    """The API server refused the Deployment (`must be an integer`), blaming its own field."""
    problems = problems_of(with_changes(load_example("mixed.yaml"), path, resources))
    role = path.split(".")[1]
    amount = next(iter(next(iter(resources.values())).values()))
    assert problems == [
        f"spec.{role}.resources.{field}: {amount!r}: Kubernetes counts {field.split('.', 1)[1]} "
        "in whole devices"
    ]


@pytest.mark.parametrize(
    ("path", "resources", "expected"),
    [
        (
            "spec.mixed.resources",
            {"limits": {"gpu": 1}},
            "spec.mixed.resources.limits.gpu.[key]: Value error, 'gpu' is no container resource",
        ),
        (
            "spec.mixed.resources",
            {"requests": {"Memory": "1Gi"}},
            "spec.mixed.resources.requests.Memory.[key]: Value error, 'Memory' is no container "
            "resource",
        ),
        (
            "spec.router.resources",
            {"limits": {"nvidia.com/gpu ": 1}},
            "spec.router.resources.limits.nvidia.com/gpu .[key]: Value error, 'nvidia.com/gpu ' "
            "is not a Kubernetes key",
        ),
    ],
)
def test_a_resource_name_the_api_server_refuses_is_refused(path, resources, expected) -> None:
    """It refused the Deployment (`must be a standard resource for containers`), blaming its
    own field."""
    problems = problems_of(with_changes(load_example("mixed.yaml"), path, resources))
    assert any(problem.startswith(expected) for problem in problems), problems


def test_every_resource_name_a_container_takes_is_taken() -> None:
    resources = {"cpu": "1", "memory": "8Gi", "ephemeral-storage": "1Gi", "hugepages-2Mi": "1Gi"}
    resources |= {"nvidia.com/gpu": 1, "rdma/hca": 1, "example.com/dongle": 1}
    document = with_changes(load_example("mixed.yaml"), "spec.mixed.resources.limits", resources)
    parse_inference_service(document)


RDMA = {"resourceName": "rdma/rdma_shared_device_a"}


def test_rdma_is_refused_where_no_kv_cache_moves_between_pods() -> None:
    document = with_changes(load_example("mixed.yaml"), "spec.kvTransfer.rdma", RDMA)
    assert problems_of(document) == [
        "spec.kvTransfer.rdma: only used when mode is disaggregated: a mixed engine moves no KV "
        "cache to another pod, so its pods would hold RDMA devices and IPC_LOCK for nothing"
    ]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("rdma", "String should match pattern"),  # no domain: not an extended resource
        ("RDMA/hca", "String should match pattern"),  # a domain is lowercase
        ("rdma/", "String should match pattern"),
        ("rdma/hca/a", "String should match pattern"),
        ("rdma/" + "a" * 64, "Value error"),  # a name of at most 63 characters
        ("example.kubernetes.io/nic", "Value error, 'example.kubernetes.io/nic' is in Kubernetes'"),
        ("kubernetes.io/nic", "Value error, 'kubernetes.io/nic' is in Kubernetes' own domain"),
        ("nvidia.com/gpu", "Value error, 'nvidia.com/gpu' is a GPU"),
        ("nvidia.com/mig-1g.10gb", "Value error, 'nvidia.com/mig-1g.10gb' is a GPU"),
        ("requests.rdma/hca", "Value error, 'requests.rdma/hca' starts with 'requests.'"),
    ],
)
def test_an_rdma_resource_is_named_as_kubernetes_names_an_extended_resource(name, expected) -> None:
    document = with_changes(
        load_example("disaggregated.yaml"), "spec.kvTransfer.rdma", {"resourceName": name}
    )
    problems = problems_of(document)
    assert any(
        problem.startswith(f"spec.kvTransfer.rdma.resourceName: {expected}") for problem in problems
    ), problems


@pytest.mark.parametrize(
    "name",
    ["rdma/rdma_shared_device_a", "rdma/ib", "nvidia.com/hostdev", "rdma/hca_shared_devices_a"],
)
def test_the_rdma_device_plugins_resources_are_taken(name) -> None:
    document = with_changes(
        load_example("disaggregated.yaml"), "spec.kvTransfer.rdma", {"resourceName": name}
    )
    parse_inference_service(document)


def test_rdma_count_is_a_whole_device_or_more() -> None:
    document = with_changes(
        load_example("disaggregated.yaml"), "spec.kvTransfer.rdma", {**RDMA, "count": 0}
    )
    assert any(
        p.startswith("spec.kvTransfer.rdma.count: Input should be greater than or equal to 1")
        for p in problems_of(document)
    )


def test_a_role_may_not_ask_for_the_rdma_resource_itself() -> None:
    """One declaration: the count would be two fields', and one of them silently overridden."""
    document = with_changes(load_example("disaggregated.yaml"), "spec.kvTransfer.rdma", RDMA)
    document = with_changes(
        document, "spec.decode.resources.limits", {"rdma/rdma_shared_device_a": 2}
    )
    assert problems_of(document) == [
        "spec.decode.resources.limits.rdma/rdma_shared_device_a: set by spec.kvTransfer.rdma "
        "(its count): leave it out here"
    ]


@pytest.mark.parametrize("name", ["FLASHINFER_WORKSPACE_BASE", "TRITON_CACHE_DIR"])
def test_the_compile_cache_variables_are_the_operators_with_a_compile_cache(name) -> None:
    """Only then: a spec that set one without a cache was valid before there was one."""
    document = with_changes(
        load_example("mixed.yaml"), "spec.mixed.env", [{"name": name, "value": "/tmp/kernels"}]
    )
    parse_inference_service(document)  # valid
    cached = with_changes(document, "spec.engine.compileCache", {"claimName": "kernels"})
    assert problems_of(cached) == [f"spec.mixed.env.0.name: {name} is set by the operator"]


def test_a_compile_cache_names_its_claim() -> None:
    document = with_changes(load_example("mixed.yaml"), "spec.engine.compileCache", {})
    assert any(
        p.startswith("spec.engine.compileCache.claimName: Field required")
        for p in problems_of(document)
    )
