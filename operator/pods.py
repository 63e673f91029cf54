"""Why an InferenceService's pods cannot start, read from the pods as the API server returns them.

A Deployment reports a pod that never starts (an image that cannot be pulled, no node that
fits, a container that crashes, a Secret that is missing) only once its progress deadline has
passed, 4205 s for the operator's Deployments (model loads take long). The pods tell at once:
`pod_failure` reads one pod, `role_failures` sums a role's failing pods up into what the
status reports (status.py uses it for a role that is not fully available).

A pod that is merely starting is no failure: scheduling, pulling, PodInitializing,
ContainerCreating, an init container at work (the model's download), or a container running
whose startup probe has not passed yet (the model's load).

Pure: the pods come from the operator's watch of them (handlers.py), no API call here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kubesgl import contract
from kubesgl.operator.kube import Kind

POD = Kind("v1", "Pod", "pods")

IMAGE_PULL = "ImagePullBackOff"
CRASH_LOOP = "CrashLoopBackOff"
UNSCHEDULABLE = "Unschedulable"

# The kubelet's waiting reasons of a container that cannot start, by the reason the status
# gives. A failed pull and its back-off alternate (ErrImagePull, ImagePullBackOff, ErrImagePull,
# ...), and so do a container that cannot run and its back-off: each pair reads as one reason,
# so that the condition and its Event do not flip with every retry; the message keeps the
# kubelet's own reason and words.
WAITING_FAILURES = {
    "ErrImagePull": IMAGE_PULL,
    "ImagePullBackOff": IMAGE_PULL,
    "RegistryUnavailable": IMAGE_PULL,
    "SignatureValidationFailed": IMAGE_PULL,
    "ErrImageInspect": IMAGE_PULL,
    "InvalidImageName": "InvalidImageName",
    "ErrImageNeverPull": "ErrImageNeverPull",
    "CreateContainerConfigError": "CreateContainerConfigError",  # a missing Secret or ConfigMap
    "CreateContainerError": "CreateContainerError",
    "PreStartHookError": CRASH_LOOP,
    "PostStartHookError": CRASH_LOOP,
    "RunContainerError": CRASH_LOOP,
    "CrashLoopBackOff": CRASH_LOOP,
}
# What the status reports is one of these.
REASONS = frozenset({*WAITING_FAILURES.values(), UNSCHEDULABLE})
MESSAGE_LIMIT = 300  # characters of the kubelet's or the scheduler's message


@dataclass(frozen=True)
class PodFailure:
    pod: str
    role: str  # the pod's role label
    reason: str  # one of REASONS
    message: str  # what failed, in the kubelet's or the scheduler's words (trimmed)


@dataclass(frozen=True)
class RoleFailure:
    """One failing pod of a role stands for all of them; the message says how many more."""

    reason: str
    message: str


def _trim(text: str | None, limit: int = MESSAGE_LIMIT) -> str:
    one_line = " ".join((text or "").split())
    return one_line if len(one_line) <= limit else one_line[: limit - 1] + "…"


def _container_failure(status: Mapping[str, Any], what: str) -> tuple[str, str] | None:
    name = status.get("name", "?")
    state = status.get("state") or {}
    waiting = state.get("waiting") or {}
    kubelet_reason = waiting.get("reason", "")
    if kubelet_reason in WAITING_FAILURES:
        detail = f"{what} {name}: {kubelet_reason}"
        message = _trim(waiting.get("message"))
        if kubelet_reason == "CrashLoopBackOff":
            message = _last_exit(status) or message  # the back-off's own words say little
        return WAITING_FAILURES[kubelet_reason], f"{detail}: {message}" if message else detail
    # Exited with an error and not ready again: between its back-offs, a crashing container is
    # running (or has just stopped), so this keeps the reason from flipping with each restart.
    # It holds until the container is ready: a pod reloading after one crash reads so too.
    terminated = state.get("terminated") or {}
    last = (status.get("lastState") or {}).get("terminated") or {}
    failed = (terminated and terminated.get("exitCode", 0) != 0) or (
        state.get("running") is not None
        and status.get("restartCount", 0) > 0
        and last.get("exitCode", 0) != 0
    )
    if failed and not status.get("ready"):
        restarts = status.get("restartCount", 0)
        times = f"restarted {restarts} time{'s' if restarts != 1 else ''}"
        exit_detail = _last_exit(status) if not terminated else _exit(terminated)
        return CRASH_LOOP, f"{what} {name} {times}, {exit_detail}"
    return None


def _exit(terminated: Mapping[str, Any]) -> str:
    code = terminated.get("exitCode", "?")
    reason = terminated.get("reason")
    text = f"exit code {code}" + (f" ({reason})" if reason else "")
    message = _trim(terminated.get("message"))
    return f"{text}: {message}" if message else text


def _last_exit(status: Mapping[str, Any]) -> str:
    last = (status.get("lastState") or {}).get("terminated")
    return f"last {_exit(last)}" if last else ""


def pod_failure(pod: Mapping[str, Any]) -> PodFailure | None:
    """Why this pod cannot start or keep running, or None if it is running, starting, or on its
    way out (being deleted, or Failed / Succeeded: its ReplicaSet makes another)."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") in ("Failed", "Succeeded"):
        return None
    name = meta.get("name", "?")
    role = (meta.get("labels") or {}).get(contract.ROLE_LABEL, "")
    for condition in status.get("conditions") or []:
        if (
            condition.get("type") == "PodScheduled"
            and condition.get("status") == "False"
            and condition.get("reason") == UNSCHEDULABLE
        ):
            message = _trim(condition.get("message"))
            return PodFailure(name, role, UNSCHEDULABLE, f"{UNSCHEDULABLE}: {message}")
    for key, what in (
        ("initContainerStatuses", "init container"),
        ("containerStatuses", "container"),
    ):
        for container in status.get(key) or []:
            found = _container_failure(container, what)
            if found is not None:
                return PodFailure(name, role, *found)
    return None


def role_failures(failures: Iterable[PodFailure]) -> dict[str, RoleFailure]:
    """By role, its failing pods summed up: the first by name, and how many more there are."""
    by_role: dict[str, list[PodFailure]] = {}
    for failure in failures:
        by_role.setdefault(failure.role, []).append(failure)
    summed = {}
    for role, pods in sorted(by_role.items()):
        ordered = sorted(pods, key=lambda failure: failure.pod)
        first, more = ordered[0], len(ordered) - 1
        message = f"pod {first.pod}: {first.message}"
        if more:
            message += f" (and {more} more failing pod{'s' if more != 1 else ''})"
        summed[role] = RoleFailure(first.reason, message)
    return summed
