"""Why a pod cannot start, read from pods as the API server returns them (the kubelet's and the
scheduler's words as they write them), and a role's failing pods summed up."""

from __future__ import annotations

import copy
from typing import Any

from kubesgl.operator.pods import PodFailure, pod_failure, role_failures

IMAGE = "ghcr.io/kubesgl/kubesgl:0.1.0-typo"


def pod(
    name: str = "llama-pd-decode-6d5f7c9b8-x2x7q",
    role: str = "decode",
    phase: str = "Pending",
    conditions: list[dict[str, Any]] | None = None,
    init: list[dict[str, Any]] | None = None,
    containers: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase, "conditions": conditions or []}
    if init is not None:
        status["initContainerStatuses"] = init
    if containers is not None:
        status["containerStatuses"] = containers
    return {
        "metadata": {
            "name": name,
            "namespace": "default",
            "labels": {
                "app.kubernetes.io/name": "kubesgl",
                "app.kubernetes.io/instance": "llama-pd",
                "app.kubernetes.io/managed-by": "kubesgl-operator",
                "kubesgl.io/role": role,
                "pod-template-hash": "6d5f7c9b8",
            },
            "ownerReferences": [{"kind": "ReplicaSet", "name": "llama-pd-decode-6d5f7c9b8"}],
        },
        "spec": {"containers": [{"name": "engine", "image": IMAGE}]},
        "status": status,
    }


def container(
    name: str = "engine",
    state: dict[str, Any] | None = None,
    ready: bool = False,
    restarts: int = 0,
    last: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "name": name,
        "image": IMAGE,
        "imageID": "",
        "ready": ready,
        "started": "running" in (state or {}),
        "restartCount": restarts,
        "state": state or {"waiting": {"reason": "ContainerCreating"}},
        "lastState": {"terminated": last} if last else {},
    }


def waiting(reason: str, message: str | None = None) -> dict[str, Any]:
    return {"waiting": {"reason": reason, **({"message": message} if message else {})}}


SCHEDULED = {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}
UNSCHEDULABLE = {
    "type": "PodScheduled",
    "status": "False",
    "reason": "Unschedulable",
    "lastProbeTime": None,
    "lastTransitionTime": "2026-01-01T00:00:00Z",
    "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu. preemption: 0/4 nodes "
    "are available: 4 No preemption victims found for incoming pod.",
}
RUNNING = {"running": {"startedAt": "2026-01-01T00:01:00Z"}}
CRASHED = {
    "exitCode": 1,
    "reason": "Error",
    "startedAt": "2026-01-01T00:01:00Z",
    "finishedAt": "2026-01-01T00:01:30Z",
}


def test_an_image_that_cannot_be_pulled_names_the_container_and_the_kubelets_words() -> None:
    pulling = pod(
        conditions=[SCHEDULED],
        containers=[
            container(
                state=waiting(
                    "ErrImagePull",
                    f'failed to pull and unpack image "{IMAGE}": not found',
                )
            )
        ],
    )
    failure = pod_failure(pulling)
    assert failure == PodFailure(
        pod="llama-pd-decode-6d5f7c9b8-x2x7q",
        role="decode",
        reason="ImagePullBackOff",
        message=f'container engine: ErrImagePull: failed to pull and unpack image "{IMAGE}": '
        "not found",
    )
    # its back-off reads as the same reason: the condition does not flip with each retry
    backing_off = pod(
        conditions=[SCHEDULED],
        containers=[
            container(state=waiting("ImagePullBackOff", f'Back-off pulling image "{IMAGE}"'))
        ],
    )
    assert pod_failure(backing_off).reason == "ImagePullBackOff"  # type: ignore[union-attr]


def test_an_init_container_that_cannot_be_pulled_or_crashes_is_a_failure() -> None:
    init = container("download", state=waiting("ImagePullBackOff", "Back-off pulling image"))
    failure = pod_failure(pod(conditions=[SCHEDULED], init=[init], containers=[container()]))
    assert failure is not None and failure.reason == "ImagePullBackOff"
    assert failure.message.startswith("init container download: ImagePullBackOff")

    gated = {**CRASHED, "message": "401 Client Error: Unauthorized for url"}
    crashing = container(
        "download",
        state=waiting("CrashLoopBackOff", "back-off 40s restarting failed container=download"),
        restarts=3,
        last=gated,
    )
    failure = pod_failure(pod(conditions=[SCHEDULED], init=[crashing], containers=[container()]))
    assert failure is not None and failure.reason == "CrashLoopBackOff"
    # the last exit says more than the back-off
    assert failure.message == (
        "init container download: CrashLoopBackOff: last exit code 1 (Error): "
        "401 Client Error: Unauthorized for url"
    )


def test_a_pod_no_node_fits_is_unschedulable_with_the_schedulers_message() -> None:
    failure = pod_failure(pod(conditions=[UNSCHEDULABLE]))
    assert failure is not None and failure.reason == "Unschedulable"
    assert failure.message.startswith("Unschedulable: 0/4 nodes are available: 4 Insufficient")
    # gated pods (a queue's admission) and pods not yet looked at are not failures
    gated = {**UNSCHEDULABLE, "reason": "SchedulingGated", "message": "scheduling gated"}
    assert pod_failure(pod(conditions=[gated])) is None
    assert pod_failure(pod(conditions=[])) is None


def test_a_missing_secret_is_a_config_error() -> None:
    missing = waiting("CreateContainerConfigError", 'secret "hf-token" not found')
    failure = pod_failure(pod(conditions=[SCHEDULED], containers=[container(state=missing)]))
    assert failure is not None and failure.reason == "CreateContainerConfigError"
    assert (
        failure.message
        == 'container engine: CreateContainerConfigError: secret "hf-token" not found'
    )


def test_a_crashing_container_keeps_its_reason_between_back_offs() -> None:
    """CrashLoopBackOff while the kubelet waits, and the same while the container runs again
    not ready yet, or has just stopped: the condition does not flip with each restart."""
    backing_off = container(
        state=waiting("CrashLoopBackOff", "back-off 1m20s restarting failed container=engine"),
        restarts=4,
        last={**CRASHED, "exitCode": 137, "reason": "OOMKilled"},
    )
    rerunning = container(state=RUNNING, restarts=5, last=CRASHED)
    stopped = container(state={"terminated": CRASHED}, restarts=5)
    reasons = [
        pod_failure(pod(phase="Running", conditions=[SCHEDULED], containers=[state]))
        for state in (backing_off, rerunning, stopped)
    ]
    assert [failure.reason for failure in reasons if failure] == ["CrashLoopBackOff"] * 3
    assert reasons[0].message.endswith("last exit code 137 (OOMKilled)")  # type: ignore[union-attr]
    assert reasons[1].message == (  # type: ignore[union-attr]
        "container engine restarted 5 times, last exit code 1 (Error)"
    )


def test_a_pod_that_is_starting_or_loading_is_no_failure() -> None:
    """Scheduled and pulling, initialising (the model's download), or running with its startup
    probe not passed (the model's load): all take long and none is a failure."""
    starting = [
        pod(conditions=[SCHEDULED], containers=[container()]),  # ContainerCreating
        pod(
            conditions=[SCHEDULED],
            init=[container("download", state=RUNNING)],
            containers=[container(state=waiting("PodInitializing"))],
        ),
        pod(phase="Running", conditions=[SCHEDULED], containers=[container(state=RUNNING)]),
        # ready again after a crash: recovered
        pod(
            phase="Running",
            conditions=[SCHEDULED],
            containers=[container(state=RUNNING, ready=True, restarts=1, last=CRASHED)],
        ),
        # restarted after a clean exit (a drain): not a crash
        pod(
            phase="Running",
            conditions=[SCHEDULED],
            containers=[container(state=RUNNING, restarts=1, last={**CRASHED, "exitCode": 0})],
        ),
        # an init container that finished
        pod(
            conditions=[SCHEDULED],
            init=[container("download", state={"terminated": {**CRASHED, "exitCode": 0}})],
            containers=[container(state=RUNNING)],
        ),
    ]
    assert [pod_failure(each) for each in starting] == [None] * len(starting)


def test_pods_on_their_way_out_are_no_failures() -> None:
    """Being deleted (a rollout replaces it), or Failed (evicted: its ReplicaSet made another)."""
    broken = pod(containers=[container(state=waiting("ImagePullBackOff", "Back-off"))])
    deleting = copy.deepcopy(broken)
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:05:00Z"
    evicted = copy.deepcopy(broken)
    evicted["status"].update(phase="Failed", reason="Evicted")
    assert pod_failure(broken) is not None
    assert pod_failure(deleting) is None and pod_failure(evicted) is None


def test_a_long_message_is_trimmed_to_one_line() -> None:
    long = "rpc error:\n" + "x" * 1000
    failure = pod_failure(pod(containers=[container(state=waiting("ErrImagePull", long))]))
    assert failure is not None and "\n" not in failure.message
    assert len(failure.message) < 400 and failure.message.endswith("…")


def test_a_role_reports_its_first_failing_pod_and_how_many_more() -> None:
    failures = [
        PodFailure("llama-pd-decode-abc-zzzzz", "decode", "Unschedulable", "Unschedulable: b"),
        PodFailure("llama-pd-decode-abc-aaaaa", "decode", "Unschedulable", "Unschedulable: a"),
        PodFailure("llama-pd-decode-abc-mmmmm", "decode", "Unschedulable", "Unschedulable: c"),
        PodFailure("llama-pd-router-def-aaaaa", "router", "CrashLoopBackOff", "container x"),
    ]
    summed = role_failures(failures)
    assert summed["decode"].reason == "Unschedulable"
    assert summed["decode"].message == (
        "pod llama-pd-decode-abc-aaaaa: Unschedulable: a (and 2 more failing pods)"
    )
    assert summed["router"].message == "pod llama-pd-router-def-aaaaa: container x"
    assert role_failures([]) == {}
