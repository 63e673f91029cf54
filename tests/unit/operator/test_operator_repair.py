"""A child's events against a fake cluster: what the repair applies, and which generation the
status it writes describes, while the newest spec is not applied (being applied, or refused)."""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any

import pytest
from operator_fixtures import load_example, with_changes

from kubesgl.operator import handlers, naming
from kubesgl.operator.kube import ApplyRejected, Kind
from kubesgl.operator.reconcile import identity
from kubesgl.operator.status import Rollout

UID = "u-1"
LOGGER = logging.getLogger("test")


class Cluster:
    """Children by (kind, name), each rolled out as soon as applied; records every apply."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.applies: list[tuple[tuple[str, str], str, dict[str, Any]]] = []
        self.statuses: list[dict[str, Any]] = []
        self.refused: set[tuple[str, str]] = set()

    def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((kind.kind, name))

    def list_children(self, kind: Kind, namespace: str, instance: str) -> list[dict[str, Any]]:
        return [obj for (k, _), obj in self.objects.items() if k == kind.kind and _ours(obj)]

    def apply(self, obj: dict[str, Any], manager: str = naming.MANAGER, force: bool = True) -> Any:
        if identity(obj) in self.refused:
            raise ApplyRejected(f"the API server refused {obj['kind']}: exceeded quota")
        self.applies.append((identity(obj), manager, copy.deepcopy(obj)))
        if manager != naming.MANAGER:  # the replicas hand-over: the count stays as it is
            return None
        live = copy.deepcopy(obj)
        live["metadata"]["generation"] = 1
        replicas = live["spec"].get("replicas", 1) if obj["kind"] == "Deployment" else 0
        live["status"] = dict(
            observedGeneration=1, replicas=replicas, readyReplicas=replicas,
            updatedReplicas=replicas, availableReplicas=replicas,
        )  # fmt: skip
        self.objects[identity(obj)] = live
        return live

    def delete(self, kind: Kind, namespace: str, name: str) -> None:
        self.objects.pop((kind.kind, name), None)

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.statuses.append(status)

    def rollouts(self, key: tuple[str, str]) -> dict[tuple[str, str], Any]:
        deployments = [obj for (kind, _), obj in self.objects.items() if kind == "Deployment"]
        return {key: [(UID, Rollout.from_deployment(obj)) for obj in deployments]}


def _ours(obj: dict[str, Any]) -> bool:
    return any(ref.get("uid") == UID for ref in obj["metadata"].get("ownerReferences") or [])


def _generation(number: int, document: dict[str, Any]) -> dict[str, Any]:
    changed = copy.deepcopy(document)
    changed["metadata"].update(namespace="default", uid=UID, generation=number)
    return changed


V1 = _generation(1, load_example("mixed.yaml"))
KEY = ("default", V1["metadata"]["name"])
DEPLOYMENT = ("Deployment", "qwen3-mixed-mixed")


@pytest.fixture(autouse=True)
def _no_events(monkeypatch):
    monkeypatch.setattr(handlers.kopf, "warn", lambda body, reason, message: None)


async def _reconcile(cluster: Cluster, memo: handlers.OperatorState, body: dict[str, Any]):
    await handlers.reconcile(
        body=body, namespace="default", name=KEY[1], logger=LOGGER, memo=memo,
        inference_services={KEY: [body]}, rollouts=cluster.rollouts(KEY),
    )  # fmt: skip


async def _event(
    cluster: Cluster, memo: handlers.OperatorState, newest: dict[str, Any], live: Any
) -> None:
    class Deployments:
        kind = "Deployment"

    await handlers.repair_child(
        event={"type": "MODIFIED"}, body=live, namespace="default", resource=Deployments(),
        logger=LOGGER, memo=memo, inference_services={KEY: [newest]},
        rollouts=cluster.rollouts(KEY),
    )  # fmt: skip


async def _applied_v1() -> tuple[Cluster, handlers.OperatorState]:
    cluster = Cluster()
    memo = handlers.OperatorState(api=cluster)  # type: ignore[arg-type]
    await _reconcile(cluster, memo, V1)
    cluster.applies.clear()
    return cluster, memo


async def test_a_child_event_applies_nothing_of_a_spec_the_cluster_refused():
    """Turning autoscaling on gives up the Deployment's replicas; refused (here: the HPA's name
    is another's), nothing of it is applied, yet a Deployment's next event applied its new
    Deployment, new image and no replicas, without the replicas hand-over: the role fell back
    to 1 replica."""
    cluster, memo = await _applied_v1()
    autoscaling = {"provider": "hpa", "mixed": {"minReplicas": 1, "maxReplicas": 4,
                   "metric": "waitingRequests", "target": 4}}  # fmt: skip
    v2 = with_changes(V1, "spec.image", "example.com/kubesgl:new")
    v2 = _generation(2, with_changes(v2, "spec.autoscaling", autoscaling))
    cluster.objects["HorizontalPodAutoscaler", "qwen3-mixed-mixed"] = {
        "kind": "HorizontalPodAutoscaler", "metadata": {"name": "qwen3-mixed-mixed"}
    }  # fmt: skip
    await _reconcile(cluster, memo, v2)
    assert KEY in memo.apply_failures and cluster.applies == []
    await _event(cluster, memo, v2, cluster.objects[DEPLOYMENT])
    assert cluster.applies == []


async def test_a_child_event_applies_nothing_of_a_change_not_applied_yet():
    cluster, memo = await _applied_v1()
    v2 = _generation(2, with_changes(V1, "spec.image", "example.com/kubesgl:new"))
    await _event(cluster, memo, v2, cluster.objects[DEPLOYMENT])
    assert cluster.applies == []


async def test_an_edited_child_is_restored_as_last_applied():
    cluster, memo = await _applied_v1()
    v2 = _generation(2, with_changes(V1, "spec.image", "example.com/kubesgl:new"))
    edited = copy.deepcopy(cluster.objects[DEPLOYMENT])
    edited["spec"]["template"]["spec"]["containers"][0]["image"] = "example.com/edited"
    await _event(cluster, memo, v2, edited)
    ((child, _, applied),) = cluster.applies
    assert child == DEPLOYMENT
    assert applied["spec"]["template"]["spec"]["containers"][0]["image"] == V1["spec"]["image"]


async def test_a_restore_waits_for_the_apply_in_flight():
    """Two writers of one child at once: the restore of an older version could land after
    the apply of the newer one."""
    cluster, memo = await _applied_v1()
    edited = copy.deepcopy(cluster.objects[DEPLOYMENT])
    edited["spec"]["template"]["spec"]["containers"][0]["image"] = "example.com/edited"
    async with memo.apply_locks.hold(KEY):
        repairing = asyncio.create_task(_event(cluster, memo, V1, edited))
        await asyncio.sleep(0.2)  # time enough for an apply's thread
        assert cluster.applies == []
    await repairing
    assert [child for child, _, _ in cluster.applies] == [DEPLOYMENT]


async def test_the_children_applied_before_a_refused_one_are_not_set_back():
    """They are at the new spec: setting them back at each event, while the retry applies
    them again each minute, would roll the pods back and forth."""
    cluster, memo = await _applied_v1()
    v2 = _generation(2, with_changes(V1, "spec.image", "example.com/kubesgl:new"))
    cluster.refused.add(("PodDisruptionBudget", "qwen3-mixed-mixed"))  # after the Deployments
    await _reconcile(cluster, memo, v2)
    assert KEY in memo.apply_failures
    cluster.applies.clear()
    await _event(cluster, memo, v2, cluster.objects[DEPLOYMENT])
    assert cluster.applies == []


def _observed(status: dict[str, Any]) -> set[int]:
    generations = {status["observedGeneration"]}
    return generations | {condition["observedGeneration"] for condition in status["conditions"]}


async def test_a_status_written_before_a_change_is_applied_describes_the_applied_generation():
    """Written for gen 2 it read as gen 2 rolled out (`kubectl wait` returned) while gen 1
    ran."""
    cluster, memo = await _applied_v1()
    v2 = _generation(2, with_changes(V1, "spec.image", "example.com/kubesgl:new"))
    ready = copy.deepcopy(cluster.objects[DEPLOYMENT])
    ready["status"]["readyReplicas"] -= 1  # a change of its status: the status is written
    cluster.objects[DEPLOYMENT] = ready
    await _event(cluster, memo, v2, ready)
    assert _observed(cluster.statuses[-1]) == {1}


async def test_a_refused_change_is_reported_of_its_generation():
    cluster, memo = await _applied_v1()
    v2 = _generation(2, with_changes(V1, "spec.image", "example.com/kubesgl:new"))
    cluster.refused.add(DEPLOYMENT)
    await _reconcile(cluster, memo, v2)
    await _event(cluster, memo, v2, cluster.objects[DEPLOYMENT])
    status = cluster.statuses[-1]
    assert _observed(status) == {2}
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "ApplyFailed"
