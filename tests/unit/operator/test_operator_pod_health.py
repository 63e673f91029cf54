"""The pod-health handler called directly, with the status writes kept: what it remembers of
the pods, when it publishes, and its Warning Events (once per change of a role's reason)."""

from __future__ import annotations

import logging
from typing import Any

from operator_fixtures import load_example

from kubesgl.operator import handlers
from kubesgl.operator.status import Rollout

KEY = ("default", "qwen3-mixed")


class StatusWrites:
    def __init__(self) -> None:
        self.patches: list[dict[str, Any]] = []

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.patches.append(status)


def a_pod(suffix: str, waiting: str | None) -> dict[str, Any]:
    state = {"waiting": {"reason": waiting, "message": "m"}} if waiting else {"running": {}}
    return {
        "metadata": {
            "name": f"qwen3-mixed-mixed-6d5f7c9b8-{suffix}",
            "namespace": "default",
            "labels": {
                "app.kubernetes.io/instance": "qwen3-mixed",
                "app.kubernetes.io/managed-by": "kubesgl-operator",
                "kubesgl.io/role": "mixed",
            },
        },
        "status": {
            "phase": "Pending",
            "containerStatuses": [{"name": "engine", "ready": False, "state": state}],
        },
    }


async def test_pod_events_publish_degraded_warn_once_per_reason_and_forget_recovered_pods(
    monkeypatch,
):
    warnings: list[tuple[str, str]] = []
    monkeypatch.setattr(
        handlers.kopf, "warn", lambda body, reason, message: warnings.append((reason, message))
    )
    isvc = load_example("mixed.yaml")
    isvc["metadata"].update(namespace="default", uid="u-1", generation=1)
    memo = handlers.OperatorState(api=StatusWrites())  # type: ignore[arg-type]
    # none of the 2 replicas available yet
    rollout = Rollout("mixed", 2, 1, 1, replicas=2, ready=0, updated=2, available=0, failure=None)

    async def event(pod: dict[str, Any], kind: str = "MODIFIED") -> None:
        await handlers.pod_health(
            event={"type": kind, "object": pod}, body=pod, namespace="default",
            name=pod["metadata"]["name"], memo=memo, logger=logging.getLogger("test"),
            inference_services={KEY: [isvc]}, rollouts={KEY: [("u-1", rollout)]},
        )  # fmt: skip

    def degraded() -> tuple[str, str]:
        (condition,) = [
            c for c in memo.written_status[KEY]["conditions"] if c["type"] == "Degraded"
        ]
        return condition["status"], condition["reason"]

    await event(a_pod("aaaaa", None))  # loading: nothing to say
    assert memo.pod_failures == {} and memo.api.patches == []  # type: ignore[union-attr]
    await event(a_pod("bbbbb", "ErrImagePull"))
    assert degraded() == ("True", "ImagePullBackOff")
    await event(a_pod("bbbbb", "ImagePullBackOff"))  # the same reason: no second Event
    await event(a_pod("ccccc", "CreateContainerConfigError"))  # not the role's first pod
    assert [reason for reason, _ in warnings] == ["ImagePullBackOff"]
    assert warnings[0][1].startswith("mixed: pod qwen3-mixed-mixed-6d5f7c9b8-bbbbb: container")
    # the pod reported goes: the next one's reason is the role's, with its Event
    await event(a_pod("bbbbb", "ImagePullBackOff"), kind="DELETED")
    assert degraded() == ("True", "CreateContainerConfigError")
    assert [reason for reason, _ in warnings][-1] == "CreateContainerConfigError"
    await event(a_pod("ccccc", None))  # recovered
    assert degraded() == ("False", "AsExpected")
    assert memo.pod_failures == {}  # nothing kept of pods that are well
    assert len(warnings) == 2


async def test_a_pod_whose_deletion_was_missed_is_forgotten_once_its_role_serves_in_full(
    monkeypatch,
):
    """A watch that reconnects re-lists and tells no deletion: the entry of a pod gone meanwhile
    degraded the role's every later rollout."""
    monkeypatch.setattr(handlers.kopf, "warn", lambda body, reason, message: None)
    isvc = load_example("mixed.yaml")
    isvc["metadata"].update(namespace="default", uid="u-1", generation=1)
    memo = handlers.OperatorState(api=StatusWrites())  # type: ignore[arg-type]
    starting = Rollout("mixed", 2, 1, 1, replicas=2, ready=0, updated=2, available=0, failure=None)
    serving = Rollout("mixed", 2, 1, 1, replicas=2, ready=2, updated=2, available=2, failure=None)
    gone = a_pod("bbbbb", "ImagePullBackOff")  # its DELETED event never comes
    await handlers.pod_health(
        event={"type": "MODIFIED", "object": gone}, body=gone, namespace="default",
        name=gone["metadata"]["name"], memo=memo, logger=logging.getLogger("test"),
        inference_services={KEY: [isvc]}, rollouts={KEY: [("u-1", starting)]},
    )  # fmt: skip
    assert KEY in memo.pod_failures
    await handlers.publish_status(memo, *KEY, {KEY: [isvc]}, {KEY: [("u-1", serving)]})
    assert memo.pod_failures == {}
