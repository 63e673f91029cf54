"""Turns an InferenceService document into the typed model, or into problems naming each field.

Two layers: the schema (pydantic, the same rules as the CRD) and the rules no schema can say,
such as "disaggregated mode needs a decode role". A spec that breaks the second layer passes
the API server but cannot work; the operator then reports it and applies nothing.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kubesgl import contract
from kubesgl.cli_help import CommandParser, RefusingParser
from kubesgl.contract import ENGINE_ROLES, EngineRole
from kubesgl.engine.server.options import build_parser as build_serve_parser
from kubesgl.engine.server.options import check_serve_args, parse_serve_args
from kubesgl.operator import naming
from kubesgl.operator.render.common import (
    ENV_REFERENCE,
    OWNED_POD_ANNOTATIONS,
    Object,
    expand_references,
)
from kubesgl.operator.render.engine import (
    COMPILE_CACHE_VARIABLES,
    ENGINE_OWNED_FLAGS,
    engine_args,
    engine_resources,
    shm_size_limit,
)
from kubesgl.operator.render.router import ROUTER_OWNED_FLAGS, router_args, router_env
from kubesgl.operator.spec import (
    GPU_RESOURCE,
    MIG_RESOURCE_PREFIX,
    InferenceService,
    InferenceServiceSpec,
    LocalObjectReference,
    Placement,
    RoleSpec,
    is_gpu_resource,
)
from kubesgl.router.cli import build_parser as build_router_parser
from kubesgl.router.cli import check_router_args

# What the operator sets in an engine role's containers (render/engine.py): a role's env may
# not name it (server-side apply refuses an env list that names a variable twice).
ENV_SET_BY_OPERATOR = frozenset(
    {
        "HOME",
        "HF_HUB_OFFLINE",
        "HF_TOKEN",
        contract.API_KEY_ENV,
        "UCX_TLS",
        "UCX_NET_DEVICES",
    }
)


# Stands for a key from a Secret, known in the pod only, when a command line is checked.
SECRET_PLACEHOLDER = "secret-from-the-pod"


@dataclass(frozen=True)
class Problem:
    field: str  # dotted path from the document root, e.g. "spec.decode.replicas"
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class InvalidSpec(ValueError):
    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("; ".join(map(str, problems)))


def parse_inference_service(document: Mapping[str, Any]) -> InferenceService:
    """Parse and check a whole InferenceService; raises InvalidSpec listing every problem."""
    try:
        isvc = InferenceService.model_validate(dict(document))
    except ValidationError as error:
        raise InvalidSpec(_schema_problems(error)) from None
    problems = workability_problems(isvc.spec) or _engine_problems(isvc) + _router_problems(isvc)
    problems = problems or _pairing_problems(isvc)
    if problems:
        raise InvalidSpec(problems)
    return isvc


# The members of the spec's unions (imagePullSecrets' items), by pydantic's names.
_UNION_MEMBERS = ("str", LocalObjectReference.__name__)


def _schema_problems(error: ValidationError) -> list[Problem]:
    problems = []
    for detail in error.errors():
        location = [str(part) for part in detail["loc"]]
        # Union members (str | LocalObjectReference) add their type name to the location:
        # not a field.
        location = [part for part in location if part not in _UNION_MEMBERS]
        problems.append(Problem(".".join(location) or "(document)", detail["msg"]))
    return problems


def unpinned_revision(isvc: InferenceService) -> str | None:
    """Why the pods of a Hugging Face model may load different weights, or None: a warning of
    the operator's and `kubesgl render`'s, not a problem, as `main` is the default; which
    commit a branch names is the Hub's to say, and nothing here asks it."""
    source = isvc.spec.model.hugging_face
    if source is None or source.pinned:
        return None
    return (
        f"spec.model.huggingFace.revision {source.revision!r} is a branch or tag, not a commit "
        "id (40 hex digits): each pod downloads the model when it starts, so pods started at "
        "different times may load different commits; give a commit id to pin them"
    )


def ignored_replicas(isvc: InferenceService) -> list[str]:
    """Why a role's `replicas` does nothing, for each role given one while an autoscaler owns
    its count: a warning, not a problem, as the count takes effect once autoscaling is
    removed (and a CRD older than this operator's filled in `replicas: 1`)."""
    warnings = []
    for role, block in isvc.spec.engine_roles().items():
        scaling = isvc.spec.autoscaling_for(role)
        if scaling is None or block.replicas is None:
            continue
        warnings.append(
            f"spec.{role}.replicas ({block.replicas}) is ignored while spec.autoscaling.{role} "
            f"scales the role ({scaling.min_replicas} to {scaling.max_replicas} replicas): the "
            "autoscaler owns the count, and this one applies only once autoscaling is removed; "
            "leave replicas out, or set the bounds in spec.autoscaling"
        )
    return warnings


@dataclass(frozen=True)
class SpecWarning:
    """A spec that runs but likely not as meant: `kubesgl render` prints it, the operator
    posts it as a Warning Event with this reason."""

    reason: str
    message: str


def spec_warnings(isvc: InferenceService) -> list[SpecWarning]:
    """Every warning of a sound spec, in the order printed and posted."""
    warnings = []
    unpinned = unpinned_revision(isvc)
    if unpinned is not None:
        warnings.append(SpecWarning("UnpinnedRevision", unpinned))
    warnings += [SpecWarning("ReplicasIgnored", message) for message in ignored_replicas(isvc)]
    return warnings


def workability_problems(spec: InferenceServiceSpec) -> list[Problem]:
    """Rules across fields: each one is a spec the API server accepts but that cannot run."""
    problems: list[Problem] = []
    problems += _mode_problems(spec)
    problems += _model_problems(spec)
    gpu_problems = _gpu_problems(spec)
    problems += gpu_problems
    problems += _resource_problems(spec, reported={problem.field for problem in gpu_problems})
    problems += _shm_problems(spec)
    problems += _rdma_problems(spec)
    problems += _autoscaling_problems(spec)
    problems += _network_policy_problems(spec)
    problems += _env_problems(spec)
    problems += _router_service_problems(spec)
    problems += _metadata_problems(spec)
    return problems


def _engine_problems(isvc: InferenceService) -> list[Problem]:
    """Each role's engine command line as rendered, checked by `kubesgl serve`'s own parser
    and rules: an engine refuses a bad flag or options that do not go together by exiting at
    start, a pod that would only crash-loop; and extraArgs may not change a flag the operator
    relies on elsewhere (a port that probes and Services would miss). Checked once the spec is
    otherwise sound (the command line is rendered from it)."""
    roles_by_problem: dict[tuple[str, str], list[str]] = {}
    for role, block in isvc.spec.engine_roles().items():
        values = {var.name: var.value for var in block.env if var.value is not None}
        argv = expand_references(engine_args(isvc, role, block)[1:], values)  # after `serve`
        sections = argv_sections(isvc, role, block, len(argv))
        # a variable from a Secret, a ConfigMap or the pod is known in the pod only: the line
        # is not checked as a whole, but the owned flags still are
        in_pod_only = any(ENV_REFERENCE.search(arg) for arg in argv)
        check = functools.partial(check_serve_args, environ=values)
        refused = None if in_pod_only else _first_refusal(check, argv, sections)
        found: tuple[str, str] | None
        if refused is not None:
            found = refused[0], f"the engine refuses these options: {refused[1]}"
        else:
            found = _owned_flag_problem(
                build_serve_parser, argv, sections, ENGINE_OWNED_FLAGS[role]
            )
        if found is not None:
            roles_by_problem.setdefault(found, []).append(role)
    return [
        Problem(field, f"{message} ({', '.join(roles)})")
        for (field, message), roles in roles_by_problem.items()
    ]


# What a prefill engine and the decode engines it pairs with must agree on, each with why: a
# mismatch passes each role's own check, and every request then fails (the tensor-parallel
# size, the roles' own field, is checked with the mode). A dtype of auto beside an explicit
# one is not compared: auto is the checkpoint's torch_dtype, which only the pods read
# (docs/operator.md says so).
_KV_LAYOUT = (
    "a prefill engine writes its KV cache into the decode engine's pool, so both need the "
    "same model, dtype and KV cache dtype"
)
_PAIRED_OPTIONS = {
    "model": _KV_LAYOUT,
    "dtype": _KV_LAYOUT,
    "kv_cache_dtype": _KV_LAYOUT,
    "served_model_name": (
        "both engines check the model each request names, so both need the same served name"
    ),
}


def _pairing_problems(isvc: InferenceService) -> list[Problem]:
    """Disaggregated mode: the options of _PAIRED_OPTIONS that the roles' extraArgs set apart,
    blaming the role whose extraArgs changed one (decode's, where both did). Checked once each
    line is sound; a line with a variable known in the pod only is not compared."""
    if isvc.spec.mode != "disaggregated":
        return []
    roles = isvc.spec.engine_roles()
    given: dict[EngineRole, argparse.Namespace] = {}
    # the line without the role's extraArgs; None where a flag's value is in them
    derived: dict[EngineRole, argparse.Namespace | None] = {}
    for role in (contract.PREFILL, contract.DECODE):
        block = roles[role]
        values = {var.name: var.value for var in block.env if var.value is not None}
        argv = expand_references(engine_args(isvc, role, block)[1:], values)
        if any(ENV_REFERENCE.search(arg) for arg in argv):
            return []
        given[role] = parse_serve_args(argv)
        try:
            derived[role] = parse_serve_args(argv[: len(argv) - len(block.extra_args)])
        except ValueError:
            derived[role] = None
    problems = []
    for name, why in _PAIRED_OPTIONS.items():
        prefill, decode = (
            getattr(given[contract.PREFILL], name),
            getattr(given[contract.DECODE], name),
        )
        if prefill == decode or (name == "dtype" and "auto" in (prefill, decode)):
            continue
        before = derived[contract.DECODE]
        decode_changed = before is None or getattr(before, name) != decode
        blamed: EngineRole = contract.DECODE if decode_changed else contract.PREFILL
        other: EngineRole = contract.PREFILL if decode_changed else contract.DECODE
        flag = "--" + name.replace("_", "-")  # argparse's dest, back to its flag
        problems.append(
            Problem(
                f"spec.{blamed}.extraArgs",
                f"{flag} {getattr(given[blamed], name)} here, {getattr(given[other], name)} in "
                f"the {other} role: {why} ({blamed})",
            )
        )
    return problems


# Each field's part of a command line, in order: (the field, where its part ends)
Sections = list[tuple[str, int]]


def argv_sections(
    isvc: InferenceService, role: EngineRole, block: RoleSpec, length: int
) -> Sections:
    """A role's command line: the spec's own options, spec.engine.extraArgs, the role's."""
    own = length - len(block.extra_args) - len(isvc.spec.engine.extra_args)
    return [
        ("spec.engine", own),
        ("spec.engine.extraArgs", own + len(isvc.spec.engine.extra_args)),
        (f"spec.{role}.extraArgs", length),
    ]


def _first_refusal(
    check: Callable[[list[str]], None], argv: list[str], sections: Sections
) -> tuple[str, str] | None:
    """Why `check` refuses the command line, and the field to blame: the first section that
    brings the problem (extraArgs may also mend what comes before them: they override)."""
    try:
        check(argv)
        return None
    except ValueError as error:
        whole = str(error)
    for field, end in sections[:-1]:
        try:
            check(argv[:end])
        except ValueError as error:
            return field, str(error)
    return sections[-1][0], whole


@dataclass(frozen=True)
class _AsGiven:
    """A flag's value that its type refuses, such as `$(VAR)` for a number: the kubelet may
    yet replace it, so it equals no value the operator renders."""

    text: str


class _FlagsParser(RefusingParser):
    """Finds the flags a command line sets, as its command does (aliases and `--flag=value`
    included), whatever values they hold: a value that the flag's type or choices refuse stays
    as given (_AsGiven, or the string), and what the parser does not know is left over (a
    `$(VAR)` where a flag goes, which only the pod can tell). It still refuses what no value
    can mend, such as a flag without its value at the end.

    `_get_value` and `_check_value` are argparse's private methods, not its API: this was
    checked on Python 3.11 (3.11.7, as CI runs; pyproject also allows 3.12, the image's Ubuntu
    python3). tests/unit/operator/test_operator_validation.py::
    test_owned_flags_are_found_whatever_a_variable_gives_another_flag guards it: it fails
    where another Python renames or stops calling them."""

    def _get_value(self, action: argparse.Action, arg_string: str) -> Any:
        try:
            return super()._get_value(action, arg_string)
        except argparse.ArgumentError:
            return _AsGiven(arg_string)

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        pass  # any choice: only the owned flags' values are compared, with the operator's


def _owned_flag_problem(
    build_parser: Callable[[type[CommandParser]], CommandParser],
    argv: list[str],
    sections: Sections,
    owned: Mapping[str, str],
) -> tuple[str, str] | None:
    """The first extraArgs that give a flag the operator relies on another value. Found
    whatever the other flags hold (_FlagsParser): a `$(VAR)` known in the pod only, given to a
    flag that takes a number or a choice, is no value a parser that checks types could take,
    and a line it cannot parse would leave the owned flags beside it unchecked."""
    parser = build_parser(_FlagsParser)

    def parse(args: list[str]) -> argparse.Namespace:
        return parser.parse_known_args(args)[0]

    (_, own), *extra_sections = sections
    derived = parse(argv[:own])
    for field, end in extra_sections:
        try:
            given = parse(argv[:end])
        except ValueError:
            continue  # a flag whose value is in the next section, say
        changed = _changed_flag(owned, derived, given)
        if changed is not None:
            return field, changed
    return None


def _changed_flag(
    owned: Mapping[str, str], derived: argparse.Namespace, given: argparse.Namespace
) -> str | None:
    """Why the first of the owned flags whose value the command line, as its command parses it
    (aliases and `--flag=value` included), changes from the operator's may not be set."""
    for flag, why in owned.items():
        dest = flag.removeprefix("--").replace("-", "_")  # argparse's rule
        if getattr(given, dest) != getattr(derived, dest):
            return f"may not set {flag} ({why})"
    return None


def _router_problems(isvc: InferenceService) -> list[Problem]:
    """The router's command line as rendered, checked by `kubesgl router`'s own parser and
    rules, with the environment variables of its pod (a key given twice, say); and its
    extraArgs may not change a flag the operator relies on."""
    argv = router_args(isvc)[1:]  # after `router`
    sections = [
        ("spec.router", len(argv) - len(isvc.spec.router.extra_args)),
        ("spec.router.extraArgs", len(argv)),
    ]
    environ = {
        variable["name"]: variable.get("value", SECRET_PLACEHOLDER) for variable in router_env(isvc)
    }
    refused = _first_refusal(functools.partial(check_router_args, environ=environ), argv, sections)
    if refused is not None:
        return [Problem(refused[0], f"the router refuses these options: {refused[1]}")]
    changed = _owned_flag_problem(build_router_parser, argv, sections, ROUTER_OWNED_FLAGS)
    return [] if changed is None else [Problem(*changed)]


def _env_problems(spec: InferenceServiceSpec) -> list[Problem]:
    problems = []
    # a compile cache's folders only while there is one: a role may point them elsewhere
    owned = ENV_SET_BY_OPERATOR | (
        set(COMPILE_CACHE_VARIABLES) if spec.engine.compile_cache is not None else set()
    )
    for role, block in spec.engine_roles().items():
        seen: set[str] = set()
        for index, variable in enumerate(block.env):
            field = f"spec.{role}.env.{index}"
            if variable.name in owned:
                problems.append(Problem(f"{field}.name", f"{variable.name} is set by the operator"))
            elif variable.name in seen:
                problems.append(Problem(f"{field}.name", f"{variable.name} is given twice"))
            seen.add(variable.name)
            if variable.value is not None and variable.value_from is not None:
                problems.append(Problem(field, "set value or valueFrom, not both"))
    return problems


def _router_service_problems(spec: InferenceServiceSpec) -> list[Problem]:
    router = spec.router
    # the API server refuses source ranges on a Service of another type
    if router.load_balancer_source_ranges and router.service_type != "LoadBalancer":
        field = "spec.router.loadBalancerSourceRanges"
        return [Problem(field, "only with serviceType LoadBalancer")]
    return []


def _owned_key_problems(field: str, keys: Iterable[str], owned: frozenset[str]) -> list[Problem]:
    """Keys of labels or annotations the operator sets: its own value would replace the one
    given."""
    return [Problem(field, f"{key} is set by the operator") for key in keys if key in owned]


def _metadata_problems(spec: InferenceServiceSpec) -> list[Problem]:
    """Pods' labels and annotations, and the PodMonitor's labels, naming the operator's keys."""
    blocks: list[tuple[str, Placement]] = [
        *spec.engine_roles().items(),
        (contract.ROUTER, spec.router),
    ]
    problems = []
    for role, block in blocks:
        problems += _owned_key_problems(
            f"spec.{role}.podLabels", block.pod_labels, naming.OWNED_LABELS
        )
        problems += _owned_key_problems(
            f"spec.{role}.podAnnotations", block.pod_annotations, OWNED_POD_ANNOTATIONS
        )
    pod_monitor = spec.monitoring.pod_monitor
    if pod_monitor is not None:
        problems += _owned_key_problems(
            "spec.monitoring.podMonitor.labels", pod_monitor.labels, naming.OWNED_LABELS
        )
    return problems


def _network_policy_problems(spec: InferenceServiceSpec) -> list[Problem]:
    settings = spec.network_policy
    problems = []
    for name, peers in (
        ("clientsFrom", settings.clients_from),
        ("metricsFrom", settings.metrics_from),
    ):
        for index, peer in enumerate(peers):
            selects = peer.namespace_selector is not None or peer.pod_selector is not None
            if peer.ip_block is None and not selects:
                message = "set ipBlock, or namespaceSelector, podSelector or both"
            elif peer.ip_block is not None and selects:  # as the API server requires
                message = "ipBlock goes alone, without namespaceSelector or podSelector"
            else:
                continue
            problems.append(Problem(f"spec.networkPolicy.{name}.{index}", message))
    return problems


def _mode_problems(spec: InferenceServiceSpec) -> list[Problem]:
    problems = []
    if spec.mode == "disaggregated":
        for role in (contract.PREFILL, contract.DECODE):
            if getattr(spec, role) is None:
                problems.append(Problem(f"spec.{role}", "required when mode is disaggregated"))
        if spec.mixed is not None:
            problems.append(Problem("spec.mixed", "only used when mode is mixed"))
        if (
            spec.prefill is not None
            and spec.decode is not None
            and (spec.prefill.tensor_parallel_size != spec.decode.tensor_parallel_size)
        ):
            # Rank r of a prefill pod writes its shard of the heads into rank r of a decode pod.
            problems.append(
                Problem(
                    "spec.decode.tensorParallelSize",
                    (
                        f"must equal spec.prefill.tensorParallelSize ({spec.prefill.tensor_parallel_size}): prefill and "
                        "decode engines pair rank by rank (docs/disaggregation.md)"
                    ),
                )
            )
    else:
        for role in (contract.PREFILL, contract.DECODE):
            if getattr(spec, role) is not None:
                problems.append(Problem(f"spec.{role}", "only used when mode is disaggregated"))
    return problems


def _rdma_problems(spec: InferenceServiceSpec) -> list[Problem]:
    nics = spec.kv_transfer.rdma
    if nics is None:
        return []
    if spec.mode != "disaggregated":
        return [
            Problem(
                "spec.kvTransfer.rdma",
                "only used when mode is disaggregated: a mixed engine moves no KV cache to "
                "another pod, so its pods would hold RDMA devices and IPC_LOCK for nothing",
            )
        ]
    problems = []
    for role, block in spec.engine_roles().items():
        for kind in ("requests", "limits"):
            if nics.resource_name in getattr(block.resources, kind):
                problems.append(
                    Problem(
                        f"spec.{role}.resources.{kind}.{nics.resource_name}",
                        "set by spec.kvTransfer.rdma (its count): leave it out here",
                    )
                )
    return problems


def _model_problems(spec: InferenceServiceSpec) -> list[Problem]:
    model = spec.model
    sources = [model.pvc, model.host_path, model.hugging_face, model.tiny]
    if sum(source is not None for source in sources) != 1:
        return [Problem("spec.model", "set exactly one of pvc, hostPath, huggingFace, tiny")]
    return []


def _gpu_problems(spec: InferenceServiceSpec) -> list[Problem]:
    problems = []
    for role, block in spec.engine_roles().items():
        for kind in ("requests", "limits"):
            for name, given in getattr(block.resources, kind).items():
                if is_gpu_resource(name):
                    field = f"spec.{role}.resources.{kind}.{name}"
                    problems += [
                        Problem(field, why) for why in _gpu_count_problems(spec, block, name, given)
                    ]
    return problems


def _gpu_count_problems(
    spec: InferenceServiceSpec, block: RoleSpec, name: str, given: object
) -> list[str]:
    tp = block.tensor_parallel_size
    if spec.engine.device == "cpu":
        return ["must be left out: with device cpu the engine uses no GPU"]
    if name.startswith(MIG_RESOURCE_PREFIX) and tp > 1:
        return [
            f"a MIG slice serves one process: tensorParallelSize {tp} needs whole GPUs "
            f"({GPU_RESOURCE})"
        ]
    if str(given) != str(tp):
        return [
            f"must equal tensorParallelSize ({tp}) or be left out: each tensor-parallel rank uses one GPU"
        ]
    return []


def _extended(name: str) -> bool:
    """An extended resource (nvidia.com/gpu, rdma/hca): a device plugin's, counted in whole
    devices; not a native one (no domain, or kubernetes.io's). apimachinery's
    IsExtendedResourceName."""
    return "/" in name and "kubernetes.io/" not in name


def _overcommit_allowed(name: str) -> bool:
    """Whether Kubernetes lets a container request less of a resource than its limit: the
    native ones but hugepages (apimachinery's IsOvercommitAllowed)."""
    return not _extended(name) and not name.startswith("hugepages-")


def _resource_problems(spec: InferenceServiceSpec, reported: set[str]) -> list[Problem]:
    """The containers' resources as rendered (the GPUs the operator adds to the limits
    included), held to the API server's rules: an extended resource is a whole number, and a
    resource it does not overcommit is set in the limits, its request, if given, equal. It
    refuses the Deployment's pod template otherwise: an ApplyFailed retried each minute,
    naming the Deployment's field, not the spec's, with the children before it applied.
    `reported`: fields already refused."""
    # imported here, as in spec._size: the client package is slow to import for `kubesgl up`
    from kubernetes.utils import parse_quantity

    blocks: list[tuple[contract.PodRole, Object]] = [
        (role, engine_resources(spec, block)) for role, block in spec.engine_roles().items()
    ]
    blocks.append((contract.ROUTER, spec.router.resources.model_dump(by_alias=True)))
    problems = []
    for role, resources in blocks:
        for kind in ("requests", "limits"):
            for name, amount in (resources.get(kind) or {}).items():
                field = f"spec.{role}.resources.{kind}.{name}"
                whole = parse_quantity(amount) == parse_quantity(amount).to_integral_value()
                if _extended(name) and not whole and field not in reported:
                    message = f"{amount!r}: Kubernetes counts {name} in whole devices"
                    problems.append(Problem(field, message))
        reported = reported | {problem.field for problem in problems}
        limits = resources.get("limits") or {}
        for name, request in (resources.get("requests") or {}).items():
            field = f"spec.{role}.resources.requests.{name}"
            if _overcommit_allowed(name) or field in reported:
                continue
            limit = limits.get(name)
            if limit is None:
                message = (
                    f"{name} is not overcommitted, so Kubernetes needs it in resources.limits "
                    "(a request, if given, equal to it): give it there"
                )
            elif parse_quantity(request) != parse_quantity(limit):
                message = (
                    f"must equal resources.limits.{name} ({limit}): Kubernetes does not "
                    f"overcommit {name}"
                )
            else:
                continue
            problems.append(Problem(field, message))
    return problems


def _shm_problems(spec: InferenceServiceSpec) -> list[Problem]:
    """A memory-backed /dev/shm counts against the container's memory limit: one as large
    leaves the engine nothing, and NCCL's buffers filling it get the pod OOM-killed. On the
    CPU nothing fills it (and `kubesgl up` makes none)."""
    if spec.engine.device != "cuda":
        return []
    # imported here, as in spec._size: the client package is slow to import for `kubesgl up`
    from kubernetes.utils import parse_quantity

    problems = []
    for role, block in spec.engine_roles().items():
        memory = block.resources.limits.get("memory")
        shm = shm_size_limit(block)
        if memory is not None and parse_quantity(shm) >= parse_quantity(memory):
            problems.append(
                Problem(
                    f"spec.{role}.shmSizeLimit",
                    f"/dev/shm ({shm}; unset: 1Gi per tensor-parallel rank) must be below "
                    f"resources.limits.memory ({memory}): it is memory-backed and counts "
                    "against that limit; raise the limit or lower shmSizeLimit",
                )
            )
    return problems


def _autoscaling_problems(spec: InferenceServiceSpec) -> list[Problem]:
    autoscaling = spec.autoscaling
    if autoscaling is None:
        return []
    problems = []
    if autoscaling.provider == "keda" and not autoscaling.prometheus_address:
        problems.append(
            Problem("spec.autoscaling.prometheusAddress", "required when provider is keda")
        )
    if autoscaling.provider == "hpa" and autoscaling.prometheus_address is not None:
        problems.append(
            Problem(
                "spec.autoscaling.prometheusAddress",
                "only used when provider is keda: an HPA reads its metrics through the "
                "cluster's custom-metrics adapter, whose own settings name its Prometheus",
            )
        )
    running = spec.engine_roles()
    for role in ENGINE_ROLES:
        scaling = autoscaling.for_role(role)
        if scaling is None:
            continue
        field = f"spec.autoscaling.{role}"
        if role not in running:
            problems.append(Problem(field, f"the {role} role does not run in {spec.mode} mode"))
        if scaling.min_replicas > scaling.max_replicas:
            problems.append(Problem(f"{field}.minReplicas", "greater than maxReplicas"))
        queue = spec.engine.max_queued_requests
        if scaling.metric == "waitingRequests" and queue is not None and scaling.target >= queue:
            problems.append(
                Problem(
                    f"{field}.target",
                    f"a pod's waitingRequests never exceeds engine.maxQueuedRequests ({queue}), "
                    "which refuses the requests beyond it: the target must be below it, or the "
                    "pool never scales out",
                )
            )
        if scaling.metric == "kvCacheUsage" and scaling.target > 1:
            problems.append(
                Problem(
                    f"{field}.target",
                    f"kvCacheUsage is a ratio of the KV pool: the target "
                    f"must be in (0, 1], not {scaling.target:g}",
                )
            )
    return problems
