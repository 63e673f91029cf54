"""Typed model of an InferenceService, mirroring crds/inferenceservice.yaml field for field.

Python names are snake_case; the YAML/JSON names are the camelCase aliases. Defaults, enums
and minimums here equal the CRD's (tests/unit/operator/test_operator_crd.py compares the two trees).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from kubesgl.contract import (
    DECODE,
    MIXED,
    PREFILL,
    EngineRole,
    LogLevel,
    TinyArch,
    label_key_problem,
    label_value_problem,
)
from kubesgl.engine.config import (
    ENGINE_OPTIONS,
    AttentionBackend,
    Device,
    Dtype,
    KvCacheDtype,
    LoadFormat,
    SchedulePolicyName,
)
from kubesgl.router.config import ROUTER_OPTIONS
from kubesgl.router.policies import PolicyName

API_GROUP = "kubesgl.io"
API_VERSION = "v1alpha1"
KIND = "InferenceService"
GPU_RESOURCE = "nvidia.com/gpu"  # the extended resource of a GPU (the NVIDIA device plugin)
# A MIG slice of the device plugin's mixed strategy (nvidia.com/mig-3g.40gb): one per process
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"


def is_gpu_resource(name: str) -> bool:
    """A GPU under any name the device plugin gives one: GPU_RESOURCE, a renamed time-sliced
    GPU (nvidia.com/gpu.shared) or a MIG slice. Not every nvidia.com/ resource: the network
    operator's RDMA devices (nvidia.com/hostdev) are none."""
    return name.startswith((GPU_RESOURCE, MIG_RESOURCE_PREFIX))


PLURAL = "inferenceservices"


class SpecModel(BaseModel):
    """Base of every spec block: camelCase on the wire, unknown fields are errors."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True, strict=True
    )


# A Kubernetes quantity as the API server parses one (apimachinery's resource.Quantity): the
# Python client's parse_quantity also takes "40 Gi", "1_000" and "Infinity", which the API
# server refuses. No sign "-": each quantity of the spec is a size or an amount, which the API
# server refuses below 0 (a negative integer is refused here, not by the CRD). The CRD has the
# same pattern (tests/unit/operator/test_operator_crd.py).
QUANTITY_PATTERN = r"^\+?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"


def _quantity(value: object) -> int | str:
    if isinstance(value, float):  # Kubernetes' own objects take `cpu: 0.5`; the CRD does not
        raise ValueError(f'write {value} as a string ("{value}")')
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError("a quantity is an integer or a string")
    if isinstance(value, int) and value < 0 or isinstance(value, str) and value.startswith("-"):
        raise ValueError(f"{value!r} is below 0")
    if isinstance(value, str) and not re.fullmatch(QUANTITY_PATTERN, value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity")
    return value


_QUANTITY_SCHEMA = WithJsonSchema(
    {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": QUANTITY_PATTERN}]}
)
Quantity = Annotated[int | str, PlainValidator(_quantity), _QUANTITY_SCHEMA]


def _size(value: object) -> int | str:
    # imported here: the client package takes 0.4 s, which every `kubesgl up` and `kubesgl
    # render` paid at start-up for a field few specs set
    from kubernetes.utils import parse_quantity

    quantity = _quantity(value)
    size = parse_quantity(quantity)  # safe: the API server's pattern matched
    if size == 0:
        raise ValueError(f"{value!r} leaves no room: give a size above 0, or leave it unset")
    text = str(quantity)
    amount = format(size.normalize(), "f") + (" byte" if size == 1 else " bytes")
    if text.endswith("m"):  # thousandths: 512m is 0.512 bytes, 2000m 2 bytes; Mi meant, likely
        raise ValueError(
            f"{value!r} is {amount}, m counting thousandths of a byte; did you mean {text[:-1]}Mi?"
        )
    if size != size.to_integral_value():
        raise ValueError(f"{value!r} is {amount}, not whole bytes; give whole bytes, such as 4Gi")
    return quantity


# The size limit of an emptyDir the pod writes into (the download, /dev/shm): whole bytes above
# 0, which the API server does not ask (it takes 0, and 512m: 0.512 bytes), and no m suffix
# (2000m is 2 bytes, 2000Mi meant). The CRD's schema is Quantity's; 0, fractions of a byte and
# the m suffix are refused here.
Size = Annotated[int | str, PlainValidator(_size), _QUANTITY_SCHEMA]

ANNOTATIONS_MAX_BYTES = 256 * 1024  # the API server's limit on an object's annotations


def _qualified_name(key: str) -> str:
    problem = label_key_problem(key)
    if problem:
        raise ValueError(problem)
    return key


def _label_value(value: str) -> str:
    problem = label_value_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _annotations_fit(annotations: dict[str, str]) -> dict[str, str]:
    size = sum(len(key.encode()) + len(value.encode()) for key, value in annotations.items())
    if size > ANNOTATIONS_MAX_BYTES:
        raise ValueError(f"{size} bytes: the API server takes at most {ANNOTATIONS_MAX_BYTES}")
    return annotations


MetadataKey = Annotated[str, AfterValidator(_qualified_name)]
Labels = dict[MetadataKey, Annotated[str, AfterValidator(_label_value)]]
Annotations = Annotated[dict[MetadataKey, str], AfterValidator(_annotations_fit)]


def _cidr(value: str) -> str:
    # canonical only: one way to write each range, which the API server keeps as written
    try:
        network = ipaddress.ip_network(value)
    except ValueError:
        network = None
    if network is None or "/" not in value:
        raise ValueError(f"{value!r} is not a CIDR such as 10.0.0.0/8 (no host bits set)")
    if str(network) != value:
        raise ValueError(f"{value!r}: write it as {network}")
    return value


Cidr = Annotated[str, AfterValidator(_cidr)]


class SecretKeyRef(SpecModel):
    name: str = Field(min_length=1)
    key: str = Field(min_length=1)


class LocalObjectReference(SpecModel):
    name: str = Field(min_length=1)


class PvcSource(SpecModel):
    claim_name: str = Field(min_length=1)
    # Folder of the model inside the claim; empty means the claim's root.
    path: str = ""
    read_only: bool = True

    @field_validator("path")
    @classmethod
    def _inside_the_claim(cls, path: str) -> str:
        # mounted at a fixed folder, the engine reads <mount>/<path>: `..` would leave the claim
        if path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"{path!r}: a folder inside the claim, relative, without '..'")
        return path


class HostPathSource(SpecModel):
    path: str = Field(pattern=r"^/")


# A commit's full id, the one revision a repository cannot move (a branch or a tag can).
COMMIT_ID = re.compile(r"[0-9a-f]{40}")


class HuggingFaceSource(SpecModel):
    repo: str = Field(pattern=r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
    # main by default, as hf download's; a branch moves, so docs/operator.md asks for a commit
    revision: str = Field(default="main", min_length=1)
    token_secret: SecretKeyRef | None = None
    # Size limit of the emptyDir the weights are downloaded into.
    size_limit: Size | None = None

    @property
    def pinned(self) -> bool:
        """Whether every pod downloads the same weights: each downloads at its start, and a
        branch or tag may name another commit by then."""
        return COMMIT_ID.fullmatch(self.revision) is not None


class TinySource(SpecModel):
    """A small model with random weights, made by `kubesgl make-tiny-model`: nothing to download
    (the quickstart)."""

    arch: TinyArch = "llama"


class ModelSpec(SpecModel):
    # Empty strings here and in UcxSpec are refused, not read as unset: a value was meant.
    served_name: str | None = Field(default=None, min_length=1)
    pvc: PvcSource | None = None
    host_path: HostPathSource | None = None
    hugging_face: HuggingFaceSource | None = None
    tiny: TinySource | None = None


class CompileCacheSpec(SpecModel):
    """A PersistentVolumeClaim every engine pod mounts read-write for the kernels FlashInfer and
    Triton compile at first use (render/engine.py, COMPILE_CACHE_DIR)."""

    claim_name: str = Field(min_length=1)


def _engine_option(name: str) -> Any:
    """The spec.engine field of a numeric engine option: unset (the engine's default), or a
    value within the limits the engine declares (engine/config.py)."""
    return Field(default=None, **ENGINE_OPTIONS[name].bounds.limits())


class EngineSpec(SpecModel):
    """Options of every engine pod. A field named like an EngineConfig field (engine/config.py)
    is that `kubesgl serve` option, rendered when set (None: the engine's default); its choices
    come from the engine and tests/unit/test_engine_options.py checks it against the engine's
    declaration. The fields after them are the pod's own settings."""

    device: Device = "cuda"  # no `auto`: the operator must know whether to request GPUs
    dtype: Dtype = "auto"
    load_format: LoadFormat = "auto"
    page_size: int | None = _engine_option("page_size")
    max_running_requests: int | None = _engine_option("max_running_requests")
    max_queued_requests: int | None = _engine_option("max_queued_requests")
    chunked_prefill_size: int | None = _engine_option("chunked_prefill_size")  # <= 0: no chunking
    max_total_tokens: int | None = _engine_option("max_total_tokens")
    attention_backend: AttentionBackend | None = None  # None: the engine's default, auto
    kv_cache_dtype: KvCacheDtype | None = None
    context_length: int | None = _engine_option("context_length")
    max_prefill_tokens: int | None = _engine_option("max_prefill_tokens")
    mem_fraction_static: float | None = _engine_option("mem_fraction_static")
    default_max_tokens: int | None = _engine_option("default_max_tokens")
    cuda_graph_max_bs: int | None = _engine_option("cuda_graph_max_bs")
    piecewise_cuda_graph_max_tokens: int | None = _engine_option("piecewise_cuda_graph_max_tokens")
    disaggregation_timeout: float | None = _engine_option("disaggregation_timeout")
    max_sequences_per_request: int | None = _engine_option("max_sequences_per_request")
    max_stop_string_length: int | None = _engine_option("max_stop_string_length")
    max_request_body_bytes: int | None = _engine_option("max_request_body_bytes")
    max_prompt_chars_per_token: int | None = _engine_option("max_prompt_chars_per_token")
    schedule_policy: SchedulePolicyName | None = None
    schedule_max_wait: float | None = _engine_option("schedule_max_wait")
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    disable_cuda_graph: bool = False
    enable_mixed_chunk: bool = False
    enable_piecewise_cuda_graph: bool = False

    api_key_secret: SecretKeyRef | None = None
    # A claim that keeps the compiled kernels (FlashInfer's JIT, Triton's) across pods
    compile_cache: CompileCacheSpec | None = None
    log_level: LogLevel = "info"
    shutdown_timeout_seconds: int = Field(default=60, ge=1)
    extra_args: list[str] = Field(default_factory=list)


# The resources a container takes under a name without a domain (apimachinery's
# IsStandardContainerResourceName), hugepages-<page size> beside them.
STANDARD_CONTAINER_RESOURCES = ("cpu", "memory", "ephemeral-storage")


def _resource_name(name: str) -> str:
    """A container's resource as the API server names one: a qualified name, and without a
    domain one of its own (`gpu` alone is none: nvidia.com/gpu)."""
    problem = label_key_problem(name)
    if problem:
        raise ValueError(problem)
    if "/" not in name and not (
        name in STANDARD_CONTAINER_RESOURCES or name.startswith("hugepages-")
    ):
        raise ValueError(
            f"{name!r} is no container resource: cpu, memory, ephemeral-storage, "
            "hugepages-<size>, or a device plugin's with its domain (nvidia.com/gpu)"
        )
    return name


ResourceName = Annotated[str, AfterValidator(_resource_name)]


class Resources(SpecModel):
    requests: dict[ResourceName, Quantity] = Field(default_factory=dict)
    limits: dict[ResourceName, Quantity] = Field(default_factory=dict)


class Toleration(SpecModel):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None

    @model_validator(mode="after")
    def _as_kubernetes_checks(self) -> Toleration:
        """The API server's own rules: rendered, the operator's apply would fail on them."""
        if self.operator == "Exists" and self.value:
            raise ValueError("operator Exists takes no value")
        if not self.key and self.operator != "Exists":
            raise ValueError("without a key the operator must be Exists")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds needs effect NoExecute")
        return self


class Placement(SpecModel):
    """What every workload block shares: size and where its pods may run."""

    resources: Resources = Field(default_factory=Resources)
    node_selector: Labels = Field(default_factory=dict)  # checked as labels, as Kubernetes does
    tolerations: list[Toleration] = Field(default_factory=list)
    affinity: dict[str, Any] | None = None  # a Kubernetes Affinity, passed on as it is
    priority_class_name: str | None = Field(default=None, min_length=1)
    runtime_class_name: str | None = Field(default=None, min_length=1)
    # The pods' own, beside the operator's: sidecar injection, cost tags per role.
    pod_labels: Labels = Field(default_factory=dict)
    pod_annotations: Annotations = Field(default_factory=dict)
    extra_args: list[str] = Field(default_factory=list)


class EnvVar(SpecModel):
    """An environment variable of a role's containers: a value, or a Kubernetes EnvVarSource."""

    # what the API server takes as a variable's name
    name: str = Field(min_length=1, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    value: str | None = None
    value_from: dict[str, Any] | None = None


class RoleSpec(Placement):
    # None: the operator does not write the count (1 at creation, then what the Deployment
    # has: an autoscaler's last count once autoscaling is removed), so no apply scales it down.
    replicas: int | None = Field(default=None, ge=0)
    env: list[EnvVar] = Field(default_factory=list)
    tensor_parallel_size: int = Field(default=1, ge=1)
    # Size limit of the pod's memory-backed /dev/shm; None: 1Gi per tensor-parallel rank
    # (operator/render/engine.py, shm_size_limit).
    shm_size_limit: Size | None = None

    @property
    def replicas_at_creation(self) -> int:
        """The count a new Deployment of the role gets: Kubernetes' default, 1, where unset."""
        return 1 if self.replicas is None else self.replicas


# The router pod's resources when spec.router.resources is not given (docs/operator.md, Router).
ROUTER_DEFAULT_RESOURCES = Resources(
    requests={"cpu": "500m", "memory": "512Mi"},
    limits={"cpu": "2", "memory": "2Gi"},
)


def _router_option(flag: str) -> Any:
    """The spec.router field of a router option, named like its flag: unset (the router's
    default), or a value within the limits the router declares (router/options.py)."""
    return Field(default=None, **ROUTER_OPTIONS[flag].bounds.limits())


class RouterSpec(Placement):
    replicas: int = Field(default=1, ge=0)
    policy: PolicyName = "cache_aware"
    cache_threshold: float | None = _router_option("--cache-threshold")
    balance_abs_threshold: int | None = _router_option("--balance-abs-threshold")
    balance_rel_threshold: float | None = _router_option("--balance-rel-threshold")
    pd_min_prefill_tokens: int | None = _router_option("--pd-min-prefill-tokens")  # P/D only
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    # The key of the router's admin API (/workers); None: no worker can be added or removed.
    admin_key_secret: SecretKeyRef | None = None
    resources: Resources = ROUTER_DEFAULT_RESOURCES
    # The client-facing Service's: a cloud's load balancer settings (an internal one, say).
    service_annotations: Annotations = Field(default_factory=dict)
    # The clients a LoadBalancer Service admits, enforced by the cloud's load balancer.
    load_balancer_source_ranges: list[Cidr] = Field(default_factory=list)


# An extended resource as the API server takes one in a container's resources (apimachinery's
# IsExtendedResourceName): a qualified name with a domain prefix, outside kubernetes.io; the CRD
# has the same pattern, _extended_resource the rest (lengths, the domain, requests.<name>).
EXTENDED_RESOURCE_PATTERN = (
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
    r"/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)


def _extended_resource(name: str) -> str:
    # the API server also checks requests.<name>, the name a ResourceQuota counts it under
    problem = label_key_problem(name) or label_key_problem(f"requests.{name}")
    if problem:
        raise ValueError(problem)
    if name.startswith("requests."):  # a quota's name of one, never a resource's own
        raise ValueError(f"{name!r} starts with 'requests.', which the API server refuses")
    if "kubernetes.io/" in name:
        raise ValueError(
            f"{name!r} is in Kubernetes' own domain: a device plugin's resource has its own "
            "(rdma/..., nvidia.com/...)"
        )
    if is_gpu_resource(name):
        raise ValueError(f"{name!r} is a GPU, which the role's tensorParallelSize requests")
    return name


ExtendedResourceName = Annotated[
    str, Field(pattern=EXTENDED_RESOURCE_PATTERN), AfterValidator(_extended_resource)
]


class RdmaSpec(SpecModel):
    """RDMA NICs for the KV transfer of both roles' engine pods (disaggregated mode only): the
    device plugin's extended resource, requested and limited to `count` per pod, and IPC_LOCK
    (render/engine.py, docs/operator.md#rdma-between-prefill-and-decode)."""

    # e.g. rdma/rdma_shared_device_a (the RDMA shared device plugin), rdma/ib, nvidia.com/hostdev
    resource_name: ExtendedResourceName
    count: int = Field(default=1, ge=1)


class UcxSpec(SpecModel):
    transports: str | None = Field(default=None, min_length=1)
    net_devices: str | None = Field(default=None, min_length=1)


class KvTransferSpec(SpecModel):
    backend: Literal["nixl"] = "nixl"
    ucx: UcxSpec = Field(default_factory=UcxSpec)
    rdma: RdmaSpec | None = None


class PrefillAutoscaling(SpecModel):
    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(ge=1)
    metric: Literal["waitingRequests", "timeToFirstToken"] = "waitingRequests"
    target: float = Field(ge=0.001)  # an HPA's quantity holds milli-units at the finest


class DecodeAutoscaling(SpecModel):
    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(ge=1)
    # waitingRequests: rooms queued for KV slots, the decode pool's saturation (runningRequests
    # is capped by the pool, so a target above what a pod holds never fires)
    metric: Literal["runningRequests", "kvCacheUsage", "waitingRequests"] = "runningRequests"
    target: float = Field(ge=0.001)  # an HPA's quantity holds milli-units at the finest


class MixedAutoscaling(SpecModel):
    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(ge=1)
    metric: Literal["waitingRequests", "runningRequests", "kvCacheUsage", "timeToFirstToken"] = (
        "waitingRequests"
    )
    target: float = Field(ge=0.001)  # an HPA's quantity holds milli-units at the finest


RoleAutoscaling = PrefillAutoscaling | DecodeAutoscaling | MixedAutoscaling


# Kubernetes' limits on an HPA's behavior (k8s.io/kubernetes pkg/apis/autoscaling/validation):
# the API server refuses an HPA, or KEDA's HPA of a ScaledObject, beyond them.
MAX_STABILIZATION_WINDOW_SECONDS = 3600
MAX_POLICY_PERIOD_SECONDS = 1800


class HpaScalingPolicy(SpecModel):
    """One autoscaling/v2 HPAScalingPolicy: at most `value` pods (Pods) or percent of the
    count at the period's start (Percent) added or removed within periodSeconds."""

    type: Literal["Pods", "Percent"]
    value: int = Field(ge=1)
    period_seconds: int = Field(ge=1, le=MAX_POLICY_PERIOD_SECONDS)


class HpaScalingRules(SpecModel):
    """One direction of an autoscaling/v2 HorizontalPodAutoscalerBehavior; a field left out
    takes the operator's default for scale-up (render/autoscaling.py, DEFAULT_SCALE_UP) and
    Kubernetes' for scale-down."""

    stabilization_window_seconds: int | None = Field(
        default=None, ge=0, le=MAX_STABILIZATION_WINDOW_SECONDS
    )
    select_policy: Literal["Max", "Min", "Disabled"] | None = None
    # None: the default's; an empty list the API server refuses ("at least one Policy")
    policies: list[HpaScalingPolicy] | None = Field(default=None, min_length=1)


class HpaBehavior(SpecModel):
    """autoscaling/v2 HorizontalPodAutoscalerBehavior, given to every autoscaled role's HPA
    (KEDA: its advanced.horizontalPodAutoscalerConfig.behavior)."""

    scale_up: HpaScalingRules | None = None
    scale_down: HpaScalingRules | None = None


class AutoscalingSpec(SpecModel):
    provider: Literal["hpa", "keda"] = "hpa"
    # Prometheus that KEDA queries, e.g. http://prometheus.monitoring:9090 (KEDA only: refused
    # with hpa, whose metrics come through the custom-metrics adapter).
    prometheus_address: str | None = None
    # None: the operator's scale-up rules (render/autoscaling.py, DEFAULT_SCALE_UP) and
    # Kubernetes' scale-down rules
    behavior: HpaBehavior | None = None
    prefill: PrefillAutoscaling | None = None
    decode: DecodeAutoscaling | None = None
    mixed: MixedAutoscaling | None = None

    def for_role(self, role: EngineRole) -> RoleAutoscaling | None:
        return getattr(self, role)


class PodMonitorSpec(SpecModel):
    interval: str = Field(default="15s", pattern=r"^[0-9]+(ms|s|m|h)$")
    # over the InferenceService's; the operator's own keys are refused (validation.py)
    labels: Labels = Field(default_factory=dict)


class MonitoringSpec(SpecModel):
    pod_monitor: PodMonitorSpec | None = None


class LabelSelector(SpecModel):
    """A Kubernetes label selector of equality terms; empty selects everything."""

    match_labels: Labels = Field(default_factory=dict)


class IpBlock(SpecModel):
    """A Kubernetes IPBlock: addresses in `cidr` but in none of `except`."""

    cidr: Cidr
    except_: list[Cidr] = Field(default_factory=list, alias="except")

    @model_validator(mode="after")
    def _exceptions_inside(self) -> IpBlock:
        """The API server's rule: each exception a strict part of the block."""
        block = ipaddress.ip_network(self.cidr)
        for exception in map(ipaddress.ip_network, self.except_):
            # an address of the other family is in no block of this one
            if exception.prefixlen <= block.prefixlen or exception.network_address not in block:
                raise ValueError(f"except: {exception} is not strictly inside {block}")
        return self


class NetworkPeer(SpecModel):
    """A NetworkPolicy peer: pods by label, in namespaces by label, or (alone) addresses by
    ipBlock. No namespaceSelector: the InferenceService's namespace only; an empty one: every
    namespace."""

    namespace_selector: LabelSelector | None = None
    pod_selector: LabelSelector | None = None
    ip_block: IpBlock | None = None


# Prometheus as kube-prometheus-stack and the prometheus chart label its pods, in any namespace.
PROMETHEUS_PEER = NetworkPeer(
    namespace_selector=LabelSelector(),
    pod_selector=LabelSelector(match_labels={"app.kubernetes.io/name": "prometheus"}),
)


class NetworkPolicySpec(SpecModel):
    """The NetworkPolicies of the instance's pods (docs/operator.md, Security)."""

    enabled: bool = True
    # Who may reach the router's port; empty: any source.
    clients_from: list[NetworkPeer] = Field(default_factory=list)
    # Who may scrape /metrics on the engines' (and, with clientsFrom, the router's) HTTP port.
    metrics_from: list[NetworkPeer] = [PROMETHEUS_PEER]


class InferenceServiceSpec(SpecModel):
    model: ModelSpec
    image: str = Field(min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    # Secret names, each as a string or as {name: ...} (a pod spec's form), as the chart takes them
    image_pull_secrets: list[str | LocalObjectReference] = Field(default_factory=list)
    mode: Literal["mixed", "disaggregated"] = "mixed"
    engine: EngineSpec = Field(default_factory=EngineSpec)
    prefill: RoleSpec | None = None
    decode: RoleSpec | None = None
    mixed: RoleSpec | None = None
    router: RouterSpec = Field(default_factory=RouterSpec)
    kv_transfer: KvTransferSpec = Field(default_factory=KvTransferSpec)
    autoscaling: AutoscalingSpec | None = None
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)

    def engine_roles(self) -> dict[EngineRole, RoleSpec]:
        """The engine roles this mode runs; mixed mode runs one role, by default with 1 replica."""
        if self.mode == "mixed":
            return {MIXED: self.mixed or RoleSpec()}
        roles: dict[EngineRole, RoleSpec] = {}
        if self.prefill is not None:
            roles[PREFILL] = self.prefill
        if self.decode is not None:
            roles[DECODE] = self.decode
        return roles

    def autoscaling_for(self, role: EngineRole) -> RoleAutoscaling | None:
        return None if self.autoscaling is None else self.autoscaling.for_role(role)


def _service_name(name: str) -> str:
    # the API server takes `llama3.1`; a Service named after it would be refused
    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name):
        raise ValueError(
            "must be a DNS label, as Service names are: lowercase letters, digits and '-', "
            "starting with a letter and ending with a letter or digit (no dots)"
        )
    return name


class Metadata(BaseModel):
    """The part of ObjectMeta the operator uses; other metadata fields are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    # Children are named <name>-<role>, and Service names are DNS labels of at most 63
    # characters: "-prefill" leaves 55.
    name: Annotated[str, Field(min_length=1, max_length=55), AfterValidator(_service_name)]
    namespace: str = "default"
    # copied to every child's metadata, not to pods (docs/operator.md, What an InferenceService
    # becomes)
    labels: Labels = Field(default_factory=dict)
    uid: str | None = None
    generation: int | None = None


class InferenceService(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True
    )

    api_version: Literal["kubesgl.io/v1alpha1"]
    kind: Literal["InferenceService"]
    metadata: Metadata
    spec: InferenceServiceSpec
