"""Engine roles (prefill, decode, mixed): a Deployment running `kubesgl serve` and a headless
Service per role."""

from __future__ import annotations

import copy

from kubesgl import contract
from kubesgl.engine.config import ENGINE_OPTIONS
from kubesgl.operator import naming
from kubesgl.operator.render.common import (
    Object,
    as_given,
    container_security_context,
    http_probe,
    image_pull,
    metadata,
    placement,
    pod_metadata,
    pod_security_context,
    scrape_annotations,
    spread_over_nodes,
)
from kubesgl.operator.spec import (
    GPU_RESOURCE,
    EngineSpec,
    InferenceService,
    InferenceServiceSpec,
    Quantity,
    RdmaSpec,
    RoleSpec,
    SecretKeyRef,
    is_gpu_resource,
)

MODEL_ROOT = "/models"
HF_DOWNLOAD_DIR = f"{MODEL_ROOT}/hf"
# Meta's repositories carry their original checkpoint beside the Hugging Face one (16 GB more
# for Llama-3.1-8B), which the engine never reads: not fetched at every pod start.
HF_DOWNLOAD_SKIPS = ("--exclude", "original/*")
TINY_MODEL_DIR = f"{MODEL_ROOT}/tiny"
# The model init containers' resources (download-model, make-model), the same for every
# InferenceService: without cpu and memory requests and limits, a namespace whose ResourceQuota
# covers them refuses the pods (FailedCreate). KServe's storage-initializer defaults are the
# precedent (inferenceservice-config, storageInitializer: requests cpu 100m, memory 100Mi;
# limits cpu 1, memory 1Gi); memory is higher here. `hf download` streams the files to the
# emptyDir, so its memory does not grow with the model, but hf_xet buffers chunks in memory
# (defaults of GBs in xet-core; newer hf_xet sizes them from the cgroup's limit) and KServe's
# 1Gi was OOM-killed on large models (kserve/kserve#4726); make-model imports torch (about
# 240 MB resident, measured with --arch llama and qwen3-moe). A pod's effective request and
# limit are the larger of its init containers' and the sum of its containers', so beside an
# engine that asks for more, as one serving a real model does, these add nothing to what the
# pod is scheduled and counted for (docs/operator.md, Model sources).
MODEL_INIT_RESOURCES: Object = {
    "requests": {"cpu": "100m", "memory": "1Gi"},
    "limits": {"cpu": "1", "memory": "4Gi"},
}
# Time for routers, endpoints and load balancers to stop sending new requests to a pod being
# deleted before its SIGTERM: engines and routers stop listening then.
PRESTOP_SLEEP_SECONDS = 10
# What a draining engine may still take once its --shutdown-timeout is over, before its process
# has exited (engine/server/launcher.py): 5 s for the aborted requests to end, 5 s for uvicorn
# to close connections still open, 10 s (CHILD_STOP_S) for the scheduler and tokenizer
# processes to stop before they are killed, and up to 2 s of polling and minimum waits (0.1 s per child).
# tests/unit/test_termination_grace.py measures the engine against it.
ENGINE_EXIT_AFTER_DRAIN_SECONDS = 22
# Slack on top of that for the process to exit before the kubelet kills it.
EXIT_SLACK_SECONDS = 5
# The memory-backed /dev/shm of an engine pod, per tensor-parallel rank, when the role's
# shmSizeLimit is not set: NCCL's shared-memory buffers between ranks of the pod, Python's
# multiprocessing semaphores. NVIDIA recommends --shm-size=1g for NCCL containers.
SHM_PER_RANK_GI = 1
# Where spec.engine.compileCache's claim is mounted. FlashInfer (0.5) keeps its JIT-compiled
# modules under $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/<version>/<CUDA archs>/, HOME when
# unset; Triton keeps its kernels in $TRITON_CACHE_DIR, ~/.triton/cache when unset. Both key
# their entries by version and GPU, and write each under a file lock and a rename, so pods of
# several images or GPU kinds can share one claim.
COMPILE_CACHE_DIR = "/var/cache/kubesgl"
COMPILE_CACHE_VARIABLES = {
    "FLASHINFER_WORKSPACE_BASE": COMPILE_CACHE_DIR,
    "TRITON_CACHE_DIR": f"{COMPILE_CACHE_DIR}/triton",
}
# The capability RDMA needs (spec.kvTransfer.rdma): registering memory with the NIC pins it,
# which the kernel allows beyond RLIMIT_MEMLOCK only with IPC_LOCK (docs/operator.md).
RDMA_CAPABILITIES = ("IPC_LOCK",)
# Loading weights and capturing CUDA graphs can take long: up to an hour to start.
STARTUP_PROBE_PERIOD_SECONDS = 10
STARTUP_PROBE_FAILURES = 360
READINESS_PROBE_PERIOD_SECONDS = 5
# Before the startup probe's first check: scheduling, the image pull and the init container
# that downloads or makes the model, none of them bounded. Kubernetes' own default deadline.
POD_START_SECONDS = 600
# How long a rollout may go without a new pod ready before the Deployment reports
# ProgressDeadlineExceeded (Degraded, status.py): the pod's start, the startup probe's whole
# budget, and the first readiness check after it. Kubernetes' default, 600 s, called an engine
# still loading its model a failure. The router's too: it is unready until an engine can serve.
PROGRESS_DEADLINE_SECONDS = (
    POD_START_SECONDS
    + STARTUP_PROBE_PERIOD_SECONDS * STARTUP_PROBE_FAILURES
    + READINESS_PROBE_PERIOD_SECONDS
)


def prestop_pause() -> Object:
    """A container's lifecycle: the pause before SIGTERM (PRESTOP_SLEEP_SECONDS)."""
    return {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}}


def engine_grace_period_seconds(shutdown_timeout_seconds: int) -> int:
    """The pod's terminationGracePeriodSeconds: the preStop pause, the drain (the engine's
    --shutdown-timeout), the engine's exit after it, and slack. The kubelet counts the grace
    period from the start of the preStop hook, so a pod killed at its end has always had the
    whole drain."""
    return (
        PRESTOP_SLEEP_SECONDS
        + shutdown_timeout_seconds
        + ENGINE_EXIT_AFTER_DRAIN_SECONDS
        + EXIT_SLACK_SECONDS
    )


def shm_size_limit(block: RoleSpec) -> Quantity:
    """sizeLimit of the pod's /dev/shm. A memory-backed emptyDir counts against the pod's memory;
    without a size limit it may grow up to the pod's memory limit or, with none, the node's."""
    if block.shm_size_limit is not None:
        return block.shm_size_limit
    return f"{SHM_PER_RANK_GI * block.tensor_parallel_size}Gi"


def model_path(isvc: InferenceService) -> str:
    model = isvc.spec.model
    if model.pvc is not None:
        return f"{MODEL_ROOT}/{model.pvc.path}".rstrip("/") if model.pvc.path else MODEL_ROOT
    if model.hugging_face is not None:
        return HF_DOWNLOAD_DIR
    if model.tiny is not None:
        return TINY_MODEL_DIR
    return MODEL_ROOT


def served_model_name(isvc: InferenceService) -> str:
    model = isvc.spec.model
    if model.served_name:
        return model.served_name
    if model.hugging_face is not None:
        return model.hugging_face.repo
    return isvc.metadata.name


# spec.engine's engine options, in the order of their flags: those with a CRD default first, the
# rest after the pod's own flags. Running Deployments carry this order; changing it restarts them.
_SPEC_OPTIONS = [name for name in EngineSpec.model_fields if name in ENGINE_OPTIONS]
_ALWAYS_SET = [
    name
    for name in _SPEC_OPTIONS
    if EngineSpec.model_fields[name].default is not None and not ENGINE_OPTIONS[name].is_switch
]
_SET_WHEN_GIVEN = [name for name in _SPEC_OPTIONS if name not in _ALWAYS_SET]


def _flag(option: str) -> str:
    return ENGINE_OPTIONS[option].flag


# The engine prefers either flag to KUBESGL_API_KEY, the key the router sends (render/router.py)
_API_KEY_WHY = (
    "set spec.engine.apiKeySecret, which the engines and the router both read: an engine "
    "given this flag keeps a key of its own, refuses the router's, and every request fails "
    "while the pods show Ready"
)
# The flags the operator derives from the spec and that other objects rely on, each with why:
# extraArgs may not give them another value (validation.py). The model path and served name
# are not among them: nothing else the operator renders depends on them.
_OWNED_IN_EVERY_ROLE = {
    _flag("role"): "the role's block sets it (spec.mixed, spec.prefill or spec.decode)",
    _flag("tp_size"): "set the role's tensorParallelSize, which the pod's GPUs follow",
    _flag("device"): "set spec.engine.device, which the pod's GPUs follow",
    "--host": "fixed: probes, Services and the router reach the pod on its own address",
    "--port": (
        f"fixed: probes, Services, NetworkPolicies and the router use {contract.ENGINE_PORT}"
    ),
    "--shutdown-timeout": (
        "set spec.engine.shutdownTimeoutSeconds, which the pod's grace period follows"
    ),
    "--api-key": _API_KEY_WHY,
    "--api-key-file": _API_KEY_WHY,
}
ENGINE_OWNED_FLAGS: dict[contract.EngineRole, dict[str, str]] = {
    contract.MIXED: _OWNED_IN_EVERY_ROLE,
    contract.DECODE: _OWNED_IN_EVERY_ROLE,
    contract.PREFILL: {  # only a prefill engine serves its KV cache on a bootstrap port
        **_OWNED_IN_EVERY_ROLE,
        _flag("disaggregation_bootstrap_port"): (
            f"fixed: the pod's port, annotations and Service announce {contract.BOOTSTRAP_PORT}"
        ),
    },
}


def _option_args(engine: EngineSpec, names: list[str]) -> list[str]:
    """A switch when it is on, a flag and its value when the value is set."""
    args = []
    for name in names:
        value = getattr(engine, name)
        if ENGINE_OPTIONS[name].is_switch:
            args += [_flag(name)] if value else []
        elif value is not None:
            args += [_flag(name), str(value)]
    return args


def engine_args(isvc: InferenceService, role: contract.EngineRole, block: RoleSpec) -> list[str]:
    engine = isvc.spec.engine
    args = [
        "serve",
        _flag("model"),
        model_path(isvc),
        "--served-model-name",
        served_model_name(isvc),
        _flag("role"),
        role,
        _flag("tp_size"),
        str(block.tensor_parallel_size),
        "--host",
        "0.0.0.0",
        "--port",
        str(contract.ENGINE_PORT),
        *_option_args(engine, _ALWAYS_SET),
        "--log-level",
        engine.log_level,
        "--shutdown-timeout",
        str(engine.shutdown_timeout_seconds),
    ]
    if role == contract.PREFILL:
        args += [_flag("disaggregation_bootstrap_port"), str(contract.BOOTSTRAP_PORT)]
    args += _option_args(engine, _SET_WHEN_GIVEN)
    # No --api-key: the engine reads the key from contract.API_KEY_ENV (_env), so it is in
    # neither the pod spec nor the process's argv.
    return args + list(engine.extra_args) + list(block.extra_args)


def _env(isvc: InferenceService) -> list[Object]:
    # The root filesystem is read-only: caches (torch, triton, Hugging Face) go under /tmp.
    env: list[Object] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
    ]
    env += api_key_env(isvc)
    if isvc.spec.mode == "disaggregated":
        ucx = isvc.spec.kv_transfer.ucx
        if ucx.transports:
            env.append({"name": "UCX_TLS", "value": ucx.transports})
        if ucx.net_devices:
            env.append({"name": "UCX_NET_DEVICES", "value": ucx.net_devices})
    if isvc.spec.engine.compile_cache is not None:
        env += [{"name": name, "value": value} for name, value in COMPILE_CACHE_VARIABLES.items()]
    return env


def rdma(spec: InferenceServiceSpec) -> RdmaSpec | None:
    """spec.kvTransfer.rdma where the mode moves KV between pods (validation refuses it in mixed
    mode)."""
    return spec.kv_transfer.rdma if spec.mode == "disaggregated" else None


def role_env(block: RoleSpec) -> list[Object]:
    """The role's own environment variables (spec.ROLE.env), after the operator's."""
    return [as_given(variable) for variable in block.env]


def secret_env(name: str, secret: SecretKeyRef) -> Object:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}}}


def api_key_env(isvc: InferenceService) -> list[Object]:
    """The engines' API key from spec.engine.apiKeySecret, for engine and router pods alike."""
    secret = isvc.spec.engine.api_key_secret
    return [] if secret is None else [secret_env(contract.API_KEY_ENV, secret)]


EPHEMERAL_STORAGE = "ephemeral-storage"


def _asked_for(block: RoleSpec) -> set[str]:
    """The resources a role's block names, as a request or a limit."""
    return {*block.resources.requests, *block.resources.limits}


def _asks_for_other_gpus(block: RoleSpec) -> bool:
    return any(name != GPU_RESOURCE and is_gpu_resource(name) for name in _asked_for(block))


def _download_size_limit(spec: InferenceServiceSpec) -> Quantity | None:
    """The sizeLimit of the node-disk emptyDir a Hugging Face model is downloaded into."""
    source = spec.model.hugging_face
    return None if source is None else source.size_limit


def engine_resources(spec: InferenceServiceSpec, block: RoleSpec) -> Object:
    """The engine container's requests and limits, as rendered: the block's own, and what
    the operator adds (the download's disk, the GPUs)."""
    resources: Object = {}
    requests = dict(block.resources.requests)
    limits = dict(block.resources.limits)
    # room on the node's disk for the download: without it the scheduler may pick a node the
    # kubelet then evicts the pod from mid-download (a limit given alone is the request too)
    download_size = _download_size_limit(spec)
    if download_size is not None and EPHEMERAL_STORAGE not in _asked_for(block):
        requests[EPHEMERAL_STORAGE] = download_size
    # with both, a pod asks for a whole GPU beside its slice and stays Pending
    if spec.engine.device == "cuda" and not _asks_for_other_gpus(block):
        limits[GPU_RESOURCE] = block.tensor_parallel_size
    # an extended resource: requested and limited alike, as the API server requires
    nics = rdma(spec)
    if nics is not None:
        requests[nics.resource_name] = nics.count
        limits[nics.resource_name] = nics.count
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    return resources


def _model_volume(isvc: InferenceService) -> Object:
    model = isvc.spec.model
    if model.pvc is not None:
        claim = {"claimName": model.pvc.claim_name, "readOnly": model.pvc.read_only}
        return {"name": "model", "persistentVolumeClaim": claim}
    if model.host_path is not None:
        return {"name": "model", "hostPath": {"path": model.host_path.path, "type": "Directory"}}
    # downloaded or made at each pod start (validation guarantees exactly one source)
    empty_dir: Object = {}
    download_size = _download_size_limit(isvc.spec)
    if download_size is not None:
        empty_dir["sizeLimit"] = download_size
    return {"name": "model", "emptyDir": empty_dir}


def _model_container(
    isvc: InferenceService,
    block: RoleSpec,
    name: str,
    command: list[str],
    args: list[str],
    env: list[Object],
) -> Object:
    """An init container that writes the model into the shared emptyDir before the engine starts."""
    pull, _ = image_pull(isvc)
    return {
        "name": name,
        "image": isvc.spec.image,
        **pull,
        "command": command,
        "args": args,
        # the role's own variables too: a proxy or a mirror (HF_ENDPOINT) may be needed
        "env": [{"name": "HOME", "value": "/tmp"}, *env, *role_env(block)],
        "volumeMounts": [
            {"name": "model", "mountPath": MODEL_ROOT},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "resources": copy.deepcopy(MODEL_INIT_RESOURCES),
        "securityContext": container_security_context(),
    }


def _model_init_container(isvc: InferenceService, block: RoleSpec) -> Object | None:
    """Downloads a Hugging Face model, or makes the tiny one; None for mounted sources."""
    model = isvc.spec.model
    if model.hugging_face is not None:
        source = model.hugging_face
        env: list[Object] = []
        if source.token_secret is not None:
            ref = {"name": source.token_secret.name, "key": source.token_secret.key}
            env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
        return _model_container(
            isvc,
            block,
            "download-model",
            ["hf", "download", source.repo],
            ["--revision", source.revision, "--local-dir", HF_DOWNLOAD_DIR, *HF_DOWNLOAD_SKIPS],
            env,
        )
    if model.tiny is not None:
        return _model_container(
            isvc,
            block,
            "make-model",
            ["kubesgl"],
            ["make-tiny-model", TINY_MODEL_DIR, "--arch", model.tiny.arch],
            [],
        )
    return None


def engine_deployment(isvc: InferenceService, role: contract.EngineRole, block: RoleSpec) -> Object:
    instance = isvc.metadata.name
    name = naming.role_object_name(instance, role)
    ports: list[Object] = [{"name": "http", "containerPort": contract.ENGINE_PORT}]
    annotations = scrape_annotations(contract.ENGINE_PORT)
    if role == contract.PREFILL:
        ports.append({"name": "bootstrap", "containerPort": contract.BOOTSTRAP_PORT})
        # under SGLang's name too, so that SGLang's router can discover the pod as well
        for key in (contract.BOOTSTRAP_PORT_ANNOTATION, contract.SGLANG_BOOTSTRAP_PORT_ANNOTATION):
            annotations[key] = str(contract.BOOTSTRAP_PORT)
    model_read_only = isvc.spec.model.pvc is None or isvc.spec.model.pvc.read_only
    pull, pod_pull = image_pull(isvc)
    container: Object = {
        "name": "engine",
        "image": isvc.spec.image,
        **pull,
        "command": ["kubesgl"],
        "args": engine_args(isvc, role, block),
        "env": [*_env(isvc), *role_env(block)],
        "ports": ports,
        "volumeMounts": [
            {"name": "model", "mountPath": MODEL_ROOT, "readOnly": model_read_only},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "startupProbe": http_probe(
            "http", period=STARTUP_PROBE_PERIOD_SECONDS, failures=STARTUP_PROBE_FAILURES
        ),
        "readinessProbe": http_probe("http", period=READINESS_PROBE_PERIOD_SECONDS, failures=2),
        "livenessProbe": http_probe("http", period=15, failures=4, timeout=5),
        "lifecycle": prestop_pause(),
        "securityContext": container_security_context(
            RDMA_CAPABILITIES if rdma(isvc.spec) is not None else ()
        ),
    }
    if isvc.spec.engine.compile_cache is not None:
        container["volumeMounts"].append({"name": "compile-cache", "mountPath": COMPILE_CACHE_DIR})
    resources = engine_resources(isvc.spec, block)
    if resources:
        container["resources"] = resources
    pod_spec: Object = {
        "automountServiceAccountToken": False,  # engines never talk to the API server
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        "terminationGracePeriodSeconds": engine_grace_period_seconds(
            isvc.spec.engine.shutdown_timeout_seconds
        ),
        "containers": [container],
        "volumes": [
            _model_volume(isvc),
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size_limit(block)}},
            {"name": "tmp", "emptyDir": {}},
        ],
        **pod_pull,
        **spread_over_nodes(isvc, role),
        **placement(block),
    }
    cache = isvc.spec.engine.compile_cache
    if cache is not None:
        claim = {"claimName": cache.claim_name}
        pod_spec["volumes"].append({"name": "compile-cache", "persistentVolumeClaim": claim})
    init = _model_init_container(isvc, block)
    if init is not None:
        pod_spec["initContainers"] = [init]
    spec: Object = {
        "progressDeadlineSeconds": PROGRESS_DEADLINE_SECONDS,
        "selector": {"matchLabels": naming.selector_labels(instance, role)},
        "template": {
            "metadata": pod_metadata(isvc, role, block, annotations),
            "spec": pod_spec,
        },
    }
    # An autoscaler owns the replica count of an autoscaled role, and an unset count is the
    # Deployment's own (RoleSpec.replicas): never write it then.
    if isvc.spec.autoscaling_for(role) is None and block.replicas is not None:
        spec = {"replicas": block.replicas, **spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(isvc, name, role),
        "spec": spec,
    }


def headless_service(isvc: InferenceService, role: contract.EngineRole) -> Object:
    """Stable DNS names for a role's pods (one record per ready pod)."""
    ports: list[Object] = [
        {"name": "http", "port": contract.ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}
    ]
    if role == contract.PREFILL:
        ports.append(
            {
                "name": "bootstrap",
                "port": contract.BOOTSTRAP_PORT,
                "targetPort": "bootstrap",
                "protocol": "TCP",
            }
        )
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(isvc, naming.role_object_name(isvc.metadata.name, role), role),
        "spec": {
            "clusterIP": "None",
            "selector": naming.selector_labels(isvc.metadata.name, role),
            "ports": ports,
        },
    }
