"""The kopf handlers called directly, with the cluster calls stubbed: the state they keep
(KeyedLocks' map read directly: the operator never asks which keys it holds)."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import pytest
from operator_fixtures import load_example

from kubesgl.operator import handlers
from kubesgl.operator.reconcile import Applied

KEY = ("default", "one")


class StatusWrites:
    def __init__(self) -> None:
        self.patches: list[tuple[str, str, dict[str, Any]]] = []

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.patches.append((namespace, name, status))


async def test_a_reconciled_inference_service_keeps_no_lock(monkeypatch):
    """An operator that runs for months sees many InferenceServices come and go: a lock lasts
    while a handler holds or awaits it, not for the life of the process (the maps kept one
    per InferenceService ever seen)."""
    monkeypatch.setattr(handlers, "apply_children", lambda api, isvc, made: Applied(objects=[]))
    body = load_example("mixed.yaml")
    name = body["metadata"]["name"]
    body["metadata"].update(namespace="default", uid="u-1", generation=1)
    memo = handlers.OperatorState(api=StatusWrites())  # type: ignore[arg-type]
    logger = logging.getLogger("test")
    index = {("default", name): [body]}

    await handlers.reconcile(
        body=body, namespace="default", name=name, logger=logger, memo=memo,
        inference_services=index, rollouts={},
    )  # fmt: skip
    assert memo.api.patches  # the handler ran through: it published a status
    assert ("default", name) not in memo.status_locks._locks
    assert ("default", name) not in memo.apply_locks._locks


async def test_a_lock_stays_while_a_task_holds_or_awaits_it():
    """Dropping the lock of a key that a task still awaits would let the next task take a new
    lock of the same key while the waiter runs: two status writers at once."""
    locks = handlers.KeyedLocks()
    inside: list[str] = []
    overlaps: list[tuple[str, ...]] = []

    async def hold(task: str) -> None:
        async with locks.hold(KEY):
            inside.append(task)
            overlaps.append(tuple(inside))
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            inside.remove(task)

    first, second = asyncio.create_task(hold("a")), asyncio.create_task(hold("b"))
    await asyncio.sleep(0)
    assert KEY in locks._locks  # held by a, awaited by b
    await first
    third = asyncio.create_task(hold("c"))  # b is woken but may not have run yet
    await asyncio.gather(second, third)
    assert overlaps == [("a",), ("b",), ("c",)]
    assert KEY not in locks._locks


async def test_a_lock_is_forgotten_when_its_holder_fails():
    locks = handlers.KeyedLocks()
    with pytest.raises(RuntimeError):
        async with locks.hold(KEY):
            raise RuntimeError("the API server refused")
    assert KEY not in locks._locks


def _reconciling(body: dict[str, Any], memo: handlers.OperatorState) -> Any:
    return handlers.reconcile(
        body=body, namespace="default", name=body["metadata"]["name"],
        logger=logging.getLogger("test"), memo=memo,
        inference_services={("default", body["metadata"]["name"]): [body]}, rollouts={},
    )  # fmt: skip


async def test_a_new_inference_service_has_a_status_before_its_children_are_applied(monkeypatch):
    """Not only after the apply's many calls, nor never when one of them fails (kopf retries
    the handler later): `kubectl get` shows it being created at once."""
    seen: list[list[Any]] = []

    def apply_children(api: StatusWrites, isvc: Any, made: Any) -> Applied:
        seen.append(list(api.patches))
        raise ConnectionResetError("the API server went away")

    monkeypatch.setattr(handlers, "apply_children", apply_children)
    body = load_example("mixed.yaml")
    body["metadata"].update(namespace="default", uid="u-1", generation=1)
    memo = handlers.OperatorState(api=StatusWrites())  # type: ignore[arg-type]
    with pytest.raises(ConnectionResetError):
        await _reconciling(body, memo)
    ((_, _, status),) = seen[0]
    assert status["observedGeneration"] == 1
    conditions = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
    assert conditions["Progressing"] == ("True", "RolesProgressing")
    assert conditions["Ready"] == ("False", "RolesNotReady")


async def test_a_changed_inference_service_has_its_status_written_after_the_apply(monkeypatch):
    """Before it, the Deployments of the last generation would read as the new one's rollout
    done."""
    seen: list[list[Any]] = []

    def apply_children(api: StatusWrites, isvc: Any, made: Any) -> Applied:
        seen.append(list(api.patches))
        return Applied(objects=[])

    monkeypatch.setattr(handlers, "apply_children", apply_children)
    body = load_example("mixed.yaml")
    body["metadata"].update(namespace="default", uid="u-1", generation=2)
    body["status"] = {"observedGeneration": 1, "conditions": []}
    memo = handlers.OperatorState(api=StatusWrites())  # type: ignore[arg-type]
    await _reconciling(body, memo)
    assert seen == [[]]
    assert memo.api.patches  # type: ignore[union-attr]


@pytest.mark.parametrize(("revision", "warned"), [
    (None, True), ("main", True), ("v1.0", True),
    ("0e9e39f249a16976918f6564b8830bc894c89659", False),
    ("0E9E39F249A16976918F6564B8830BC894C89659", True),  # the Hub's ids are lowercase
    ("0e9e39f", True),  # a short id: the Hub resolves only full ones
])  # fmt: skip
async def test_an_applied_hugging_face_revision_that_can_move_is_warned_of(
    monkeypatch, revision, warned
):
    """Each pod downloads its model when it starts: under `main`, the default, pods started
    at different times loaded different commits, and nothing said so."""
    warnings: list[tuple[str, str]] = []
    monkeypatch.setattr(handlers, "apply_children", lambda api, isvc, made: Applied(objects=[]))
    monkeypatch.setattr(
        handlers.kopf, "warn", lambda body, reason, message: warnings.append((reason, message))
    )
    body = load_example("disaggregated.yaml")
    source = body["spec"]["model"]["huggingFace"]
    source.pop("revision")
    if revision is not None:
        source["revision"] = revision
    body["metadata"].update(namespace="default", uid="u-1", generation=1)
    await _reconciling(body, handlers.OperatorState(api=StatusWrites()))  # type: ignore[arg-type]
    if warned:
        ((reason, message),) = warnings
        assert reason == "UnpinnedRevision"
        assert f"revision {revision or 'main'!r} is a branch or tag" in message
    else:
        assert warnings == []


async def test_replicas_an_autoscaler_overrides_are_warned_of(monkeypatch):
    """The same warning as `kubesgl render`'s, as a Warning Event once applied."""
    warnings: list[tuple[str, str]] = []
    monkeypatch.setattr(handlers, "apply_children", lambda api, isvc, made: Applied(objects=[]))
    monkeypatch.setattr(
        handlers.kopf, "warn", lambda body, reason, message: warnings.append((reason, message))
    )
    body = load_example("autoscaled-hpa.yaml")
    body["spec"]["decode"]["replicas"] = 3
    body["metadata"].update(namespace="default", uid="u-1", generation=1)
    await _reconciling(body, handlers.OperatorState(api=StatusWrites()))  # type: ignore[arg-type]
    ((reason, message),) = warnings
    assert reason == "ReplicasIgnored"
    assert message.startswith("spec.decode.replicas (3) is ignored while spec.autoscaling.decode")


async def test_a_model_from_a_volume_is_not_warned_of(monkeypatch):
    warnings: list[str] = []
    monkeypatch.setattr(handlers, "apply_children", lambda api, isvc, made: Applied(objects=[]))
    monkeypatch.setattr(
        handlers.kopf, "warn", lambda body, reason, message: warnings.append(reason)
    )
    body = load_example("mixed.yaml")
    body["metadata"].update(namespace="default", uid="u-1", generation=1)
    await _reconciling(body, handlers.OperatorState(api=StatusWrites()))  # type: ignore[arg-type]
    assert warnings == []


class SlowStatusWrites(StatusWrites):
    """Status writes that wait, in their thread, until the test lets them through."""

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()
        self.go_on = threading.Event()

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.started.set()
        self.go_on.wait(timeout=10)
        super().patch_status(namespace, name, status)


async def test_a_deleted_inference_service_leaves_no_status_written_during_its_teardown(
    monkeypatch,
):
    """A status write in flight when the InferenceService is deleted recorded itself after the
    teardown forgot it: one made again under the same name skipped its "being created" status
    and took the old one's lastTransitionTimes."""
    monkeypatch.setattr(handlers, "delete_children", lambda api, namespace, name, uid: 0)
    body = load_example("mixed.yaml")
    name = body["metadata"]["name"]
    body["metadata"].update(namespace="default", uid="u-1", generation=1)
    api = SlowStatusWrites()
    memo = handlers.OperatorState(api=api)  # type: ignore[arg-type]
    index = {("default", name): [body]}
    writing = asyncio.create_task(
        handlers.publish_status(memo, "default", name, index, {})  # type: ignore[arg-type]
    )
    await asyncio.to_thread(api.started.wait, 10)
    tearing_down = asyncio.create_task(
        handlers.tear_down(
            namespace="default", name=name, uid="u-1", logger=logging.getLogger("test"), memo=memo
        )
    )
    for _ in range(5):
        await asyncio.sleep(0)  # the teardown runs as far as it can while the write waits
    api.go_on.set()
    await asyncio.gather(writing, tearing_down)
    assert ("default", name) not in memo.written_status
