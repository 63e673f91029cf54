"""The kopf wiring: which events lead to which reconciliation.

- create / update / resume of an InferenceService: validate, apply its children, prune, status;
- delete: remove its children in order (a finalizer holds the object until then);
- any event on a child: restore it as last applied if it was deleted or edited, and for
  Deployments refresh the owner's status from their replica counts;
- any event on one of its pods: when why it cannot start changes, refresh the status
  (pods.py), with a Warning Event when a role's reason does.

Blocking API calls run in threads; indexes and status bookkeeping stay on the event loop (the
record of what the applies made is written in their threads, under the apply lock).
The handlers are registered at import in `registry`, and keep their state in kopf's memo
(`OperatorState`), so `kopf.run(registry=registry, memo=OperatorState())` runs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from kubesgl import contract
from kubesgl.operator import naming
from kubesgl.operator.drift import has_drifted
from kubesgl.operator.kube import (
    CHILD_KINDS,
    DEPLOYMENT,
    INFERENCE_SERVICE,
    ApplyRejected,
    KubeApi,
    MissingApi,
)
from kubesgl.operator.pods import POD, PodFailure, pod_failure, role_failures
from kubesgl.operator.reconcile import (
    Made,
    apply_children,
    delete_children,
    owned_by,
    prune_retired,
    restore_child,
)
from kubesgl.operator.status import (
    Rollout,
    Verdict,
    compute_status,
    serves_in_full,
    status_patch,
)
from kubesgl.operator.validation import InvalidSpec, parse_inference_service, spec_warnings

ISVC = (INFERENCE_SERVICE.group, INFERENCE_SERVICE.version, INFERENCE_SERVICE.plural)
OURS = {contract.MANAGED_BY_LABEL: naming.MANAGER}
# Retry delay when the cluster lacks an API the spec needs (KEDA, prometheus-operator) or the
# API server refused a child (a quota, a webhook): either may change without the spec changing.
APPLY_RETRY_SECONDS = 60


class KeyedLocks:
    """One asyncio.Lock per key, kept only while a task holds or awaits it, so that the locks of
    InferenceServices come and go with them. Not dropped at tear-down: a handler may still hold
    or await the lock then, and a lock dropped under a waiter lets the next task take a new one
    of the same key while the waiter runs (asyncio.Lock reads unlocked between a release and
    its waiter's wake-up, so `locked()` cannot tell)."""

    def __init__(self) -> None:
        self._locks: dict[tuple[str, str], tuple[asyncio.Lock, int]] = {}  # lock, its tasks

    @contextlib.asynccontextmanager
    async def hold(self, key: tuple[str, str]) -> AsyncIterator[None]:
        lock, tasks = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, tasks + 1)
        try:
            async with lock:
                yield
        finally:
            lock, tasks = self._locks[key]
            if tasks == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, tasks - 1)


@dataclass
class OperatorState:
    """The operator's state, as kopf's memo: `kopf.run(memo=OperatorState())`. kopf hands each
    resource's handlers a shallow copy, so the containers below are shared by all of them, and
    the API client set at startup is seen by every resource memo made after it."""

    api: KubeApi | None = None
    # One status writer at a time per InferenceService, so the last one sees the newest counts.
    status_locks: KeyedLocks = field(default_factory=KeyedLocks)
    # What this process last wrote, ahead of the watch stream echoing it back.
    written_status: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    # Why the last apply of an InferenceService failed, until one succeeds: its Degraded.
    apply_failures: dict[tuple[str, str], Verdict] = field(default_factory=dict)
    apply_locks: KeyedLocks = field(default_factory=KeyedLocks)
    # What the applies made of each InferenceService: its children as applied (read and
    # written under apply_locks), which a repair restores, and the generation applied in
    # full, which its status describes.
    made: dict[tuple[str, str], Made] = field(default_factory=dict)
    # InferenceServices whose retired engine roles serve until their replacements are ready:
    # each event of their Deployments checks again (reconcile.prune_retired).
    retiring: set[tuple[str, str]] = field(default_factory=set)
    # By InferenceService, its pods that cannot start, by pod name (pod_health).
    pod_failures: dict[tuple[str, str], dict[str, PodFailure]] = field(default_factory=dict)

    def kube(self) -> KubeApi:
        assert self.api is not None, "the startup handler creates the API client"
        return self.api

    def made_of(self, key: tuple[str, str], uid: str) -> Made:
        """The record of this InferenceService's children; a new one for an object made
        again under the name of one deleted."""
        made = self.made.get(key)
        if made is None or made.uid != uid:
            made = self.made[key] = Made(uid)
        return made


def _snapshot(body: Mapping[str, Any]) -> dict[str, Any]:
    """A plain copy of an InferenceService, as the indexes keep it."""
    meta = body["metadata"]
    return {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": {
            key: _plain(meta[key])
            for key in ("name", "namespace", "labels", "uid", "generation", "deletionTimestamp")
            if key in meta
        },
        "spec": _plain(body.get("spec", {})),
        "status": _plain(body.get("status", {})),
    }


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


def _owner(body: Mapping[str, Any]) -> tuple[str, str] | None:
    for reference in body.get("metadata", {}).get("ownerReferences") or []:
        if reference.get("kind") == INFERENCE_SERVICE.kind and reference.get(
            "apiVersion", ""
        ).startswith(INFERENCE_SERVICE.group + "/"):
            return reference.get("name"), reference.get("uid")
    return None


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


registry = kopf.OperatorRegistry()


@kopf.on.startup(registry=registry, id="configure")
def configure(settings: kopf.OperatorSettings, memo: OperatorState, **_: Any) -> None:
    settings.persistence.finalizer = "kubesgl.io/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kubesgl.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="kubesgl.io", key="last-handled-configuration"
    )
    # Only warnings become Kubernetes Events; the rest goes to the log.
    settings.posting.level = logging.WARNING
    watch_only_children(settings)
    memo.api = KubeApi.from_environment()


def watch_only_children(settings: kopf.OperatorSettings) -> None:
    """Watch streams of the child kinds carry the operator's label as a selector, so that the
    API server sends only its children: the handlers' `labels=` filter is kopf's, applied to
    every Deployment, Service, Role, ... of the cluster after it came over the wire."""
    selector = ",".join(f"{key}={value}" for key, value in OURS.items())
    for kind in (*CHILD_KINDS, POD):  # and the pods, which carry the label too
        settings.watching.label_selectors[kind.group, kind.version, kind.plural] = selector


@kopf.on.login(registry=registry, id="login")
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    return kopf.login_via_client(**kwargs)


# Handlers receive each index as a keyword argument named by its id.
@kopf.index(*ISVC, registry=registry, id="inference_services")
def inference_services(body: kopf.Body, namespace: str | None, name: str, **_: Any) -> Any:
    return {(namespace, name): _snapshot(body)}


@kopf.index(
    DEPLOYMENT.group,
    DEPLOYMENT.version,
    DEPLOYMENT.plural,
    labels=OURS,
    registry=registry,
    id="rollouts",
)
def rollouts(body: kopf.Body, namespace: str | None, **_: Any) -> Any:
    owner = _owner(body)
    if owner is None:
        return None
    instance, uid = owner
    return {(namespace, instance): (uid, Rollout.from_deployment(body))}


async def publish_status(
    memo: OperatorState,
    namespace: str,
    name: str,
    inference_services: kopf.Index,
    rollouts: kopf.Index,
) -> None:
    key = (namespace, name)
    async with memo.status_locks.hold(key):
        stored = list(inference_services.get(key, []))
        if not stored or stored[0]["metadata"].get("deletionTimestamp"):
            return
        isvc_body = stored[0]
        uid = isvc_body["metadata"].get("uid")
        mine = {
            rollout.role: rollout
            for owner_uid, rollout in rollouts.get(key, [])
            if owner_uid == uid
        }
        problems: str | None
        try:
            isvc = parse_inference_service(isvc_body)
        except InvalidSpec as error:
            # nothing is applied: what runs goes on serving, at the same endpoint
            roles, problems = sorted(mine), str(error)
        else:
            roles, problems = [*isvc.spec.engine_roles(), contract.ROUTER], None
        serves = problems is None or contract.ROUTER in mine
        endpoint = naming.router_endpoint(name, namespace) if serves else None
        _forget_failures_of_full_roles(memo, key, mine)
        previous = memo.written_status.get(key, isvc_body.get("status") or {})
        newest = isvc_body["metadata"].get("generation", 0)
        held_back = problems is not None or key in memo.apply_failures
        new = compute_status(
            # why the newest spec is held back is news of it; the rest is of the applied one
            generation=newest if held_back else _applied(memo, key, uid, previous, newest),
            roles=roles,
            rollouts=mine,
            endpoint=endpoint,
            problems=problems,
            previous=previous,
            now=_now(),
            apply_failure=memo.apply_failures.get(key),
            pod_failures=role_failures(memo.pod_failures.get(key, {}).values()),
        )
        patch = status_patch(new, previous)
        if patch is not None:
            await asyncio.to_thread(memo.kube().patch_status, namespace, name, patch)
            memo.written_status[key] = new


def _forget_failures_of_full_roles(
    memo: OperatorState, key: tuple[str, str], rollouts: Mapping[str, Rollout]
) -> None:
    """A role that serves in full has no pod failing to start: what is kept of its pods is of
    ones whose deletion the pod watch missed (a reconnect re-lists, telling no deletion), which
    would otherwise degrade the role's next rollout."""
    failing = memo.pod_failures.get(key, {})
    for pod, failure in list(failing.items()):
        rollout = rollouts.get(failure.role)
        if rollout is not None and serves_in_full(rollout):
            del failing[pod]
    if not failing:
        memo.pod_failures.pop(key, None)


def _applied(
    memo: OperatorState,
    key: tuple[str, str],
    uid: str | None,
    previous: Mapping[str, Any],
    newest: int,
) -> int:
    """The generation the running children are of: the last one applied in full, else (none
    yet, since the operator started) the one the status already says, else (a new
    InferenceService, being created) the newest."""
    made = memo.made.get(key)
    if made is not None and made.uid == uid and made.generation is not None:
        return made.generation
    return int(previous.get("observedGeneration") or 0) or newest


def _refused(memo: OperatorState, namespace: str | None, name: str, **_: Any) -> bool:
    return (namespace or "", name) in memo.apply_failures


# The timer applies again what the cluster refused: the missing API may have been installed
# since, the quota raised, the webhook fixed, none of which changes the spec. Its filter (status
# changes re-evaluate it) keeps it, and kopf's log line per run, to the refused ones.
@kopf.on.timer(  # type: ignore[arg-type]
    *ISVC,
    interval=APPLY_RETRY_SECONDS,
    initial_delay=APPLY_RETRY_SECONDS,  # not at once: the failed apply has only just run
    when=_refused,
    registry=registry,
    id="retry-refused",
)
@kopf.on.resume(*ISVC, registry=registry, id="resume")
@kopf.on.create(*ISVC, registry=registry, id="create")
# kopf's handler protocols (ChangingFn, WatchingFn, TimerFn) leave out the index arguments it passes.
@kopf.on.update(*ISVC, registry=registry, id="update")  # type: ignore[arg-type]
async def reconcile(
    body: kopf.Body,
    namespace: str | None,
    name: str,
    logger: kopf.Logger,
    memo: OperatorState,
    inference_services: kopf.Index,
    rollouts: kopf.Index,
    **_: Any,
) -> None:
    """Apply the InferenceService's children and publish its status; a spec that cannot work
    or a child the cluster refuses is reported there, and in a Warning Event; so is an applied
    Hugging Face revision that can move, in an Event only. One apply at a time per
    InferenceService (the retry timer and a change may come together), each of the newest
    spec."""
    assert namespace is not None  # InferenceServices are namespaced
    key = (namespace, name)
    async with memo.apply_locks.hold(key):
        try:
            isvc = parse_inference_service(_snapshot(body))
        except InvalidSpec as error:
            memo.apply_failures.pop(key, None)  # the spec's problems are the news now
            kopf.warn(body, reason="InvalidSpec", message=f"nothing applied: {error}")
            await publish_status(memo, namespace, name, inference_services, rollouts)
            return
        if not body.get("status") and key not in memo.written_status:
            # A new InferenceService: its status says at once that its roles are being
            # created, not after the apply's calls (an error there leaves it none till a retry).
            # Not on a change: the running Deployments, not yet changed, would read as the new
            # generation rolled out.
            await publish_status(memo, namespace, name, inference_services, rollouts)
        made = memo.made_of(key, isvc.metadata.uid or "")
        try:
            applied = await asyncio.to_thread(apply_children, memo.kube(), isvc, made)
        except (MissingApi, ApplyRejected) as error:
            # Not kopf's retry: it would hold a fixed spec back until the retry is due.
            # The timer tries again, and a change of the spec applies at once.
            reason = "MissingAPI" if isinstance(error, MissingApi) else "ApplyFailed"
            kopf.warn(body, reason=reason, message=str(error))
            memo.apply_failures[key] = Verdict(True, reason, str(error))
        else:
            made.generation = isvc.metadata.generation or 0  # the spec applied, not the live body
            memo.apply_failures.pop(key, None)
            logger.info("applied %d objects", len(applied.objects))
            for warning in spec_warnings(isvc):
                kopf.warn(body, reason=warning.reason, message=warning.message)
            if applied.retiring:
                memo.retiring.add(key)
            else:
                memo.retiring.discard(key)
        await publish_status(memo, namespace, name, inference_services, rollouts)


@kopf.on.delete(*ISVC, registry=registry, id="delete")
async def tear_down(
    namespace: str | None, name: str, uid: str, logger: kopf.Logger, memo: OperatorState, **_: Any
) -> None:
    assert namespace is not None  # InferenceServices are namespaced
    count = await asyncio.to_thread(delete_children, memo.kube(), namespace, name, uid)
    # under the lock: a status write in flight would record itself after the pop, and an
    # InferenceService made again under this name would start from the old one's status
    async with memo.status_locks.hold((namespace, name)):
        memo.written_status.pop((namespace, name), None)
    memo.apply_failures.pop((namespace, name), None)
    memo.pod_failures.pop((namespace, name), None)  # its pods' deletions may have gone unseen
    memo.retiring.discard((namespace, name))
    async with memo.apply_locks.hold((namespace, name)):
        memo.made.pop((namespace, name), None)
    logger.info("deleted %d children", count)


@dataclass(frozen=True)
class ChildEvent:
    """What a repair reads of an event of a child."""

    owner: tuple[str, str]  # its InferenceService's namespace and name
    owner_uid: str
    child: tuple[str, str]  # kind, name
    body: Mapping[str, Any]
    deleted: bool


async def repair_child(
    event: kopf.RawEvent,
    body: kopf.Body,
    namespace: str | None,
    resource: kopf.Resource,
    logger: kopf.Logger,
    memo: OperatorState,
    inference_services: kopf.Index,
    rollouts: kopf.Index,
    **_: Any,
) -> None:
    owner = _owner(body)
    # Children live in their owner's namespace; kopf knows the kind of a watched resource.
    if owner is None or namespace is None or resource.kind is None:
        return
    instance, uid = owner
    stored = list(inference_services.get((namespace, instance), []))
    if not stored or not owned_by(body, stored[0]["metadata"].get("uid", "")):
        return
    if stored[0]["metadata"].get("deletionTimestamp"):
        return
    seen = ChildEvent(
        owner=(namespace, instance),
        owner_uid=uid,
        child=(resource.kind, body["metadata"]["name"]),
        body=body,
        deleted=event.get("type") == "DELETED",
    )
    # looked at first without the lock: most events (a Deployment's status) change nothing
    if _to_restore(memo, seen) is not None:
        await _restore(memo, seen, logger)
    if resource.kind == DEPLOYMENT.kind:
        await _continue_retiring((namespace, instance), memo, inference_services)
        await publish_status(memo, namespace, instance, inference_services, rollouts)


def _to_restore(memo: OperatorState, event: ChildEvent) -> dict[str, Any] | None:
    """The child as the operator last applied it, if it was deleted or edited since."""
    made = memo.made.get(event.owner)
    if made is None or made.uid != event.owner_uid:
        return None  # none applied by this process yet: its first apply will
    target = made.children.get(event.child)
    if target is None or not (event.deleted or has_drifted(target, event.body)):
        return None
    return target


async def _restore(memo: OperatorState, event: ChildEvent, logger: kopf.Logger) -> None:
    """Puts the child back as last applied, never as a spec not applied yet: under the apply
    lock, and looked up again there, as an apply may have changed it meanwhile."""
    async with memo.apply_locks.hold(event.owner):
        target = _to_restore(memo, event)
        if target is None:
            return
        logger.info("restoring %s %s", *event.child)
        try:
            await asyncio.to_thread(restore_child, memo.kube(), target, event.owner_uid)
        except ApplyRejected as error:  # the InferenceService's status says so already
            logger.warning("could not restore: %s", error)


async def _continue_retiring(
    key: tuple[str, str], memo: OperatorState, inference_services: kopf.Index
) -> None:
    """Goes on pruning the objects of roles the InferenceService no longer runs: they go once
    its Deployments have rolled out, which a Deployment's change may have finished."""
    if key not in memo.retiring:
        return
    # of the newest spec: one may have come meanwhile
    async with memo.apply_locks.hold(key):
        newest = list(inference_services.get(key, []))
        try:
            current = parse_inference_service(newest[0]) if newest else None
        except InvalidSpec:
            current = None  # the InferenceService handler reports it
        if current is None:
            return
        made = memo.made_of(key, current.metadata.uid or "")
        if not await asyncio.to_thread(prune_retired, memo.kube(), current, made):
            memo.retiring.discard(key)


for _kind in CHILD_KINDS:
    kopf.on.event(
        _kind.group,
        _kind.version,
        _kind.plural,
        labels=OURS,
        registry=registry,
        id=f"repair-{_kind.plural}",
    )(repair_child)  # type: ignore[arg-type]  # the index arguments, as for reconcile


# kopf's WatchingFn protocol leaves out the index arguments, as for reconcile.
@kopf.on.event(  # type: ignore[arg-type]
    POD.group, POD.version, POD.plural, labels=OURS, registry=registry, id="pod-health"
)
async def pod_health(
    event: kopf.RawEvent,
    body: kopf.Body,
    namespace: str | None,
    name: str,
    memo: OperatorState,
    inference_services: kopf.Index,
    rollouts: kopf.Index,
    **_: Any,
) -> None:
    """Keeps why each of an InferenceService's pods cannot start, and publishes the status when
    that changes: the Deployments report it only at their progress deadline. A role whose
    reason changes to a failure gets a Warning Event, once per change."""
    instance = body.get("metadata", {}).get("labels", {}).get(contract.INSTANCE_LABEL)
    if namespace is None or not instance:
        return
    key = (namespace, instance)
    failure = None if event.get("type") == "DELETED" else pod_failure(body)
    failing = memo.pod_failures.get(key, {})
    if failing.get(name) == failure:
        return
    before = role_failures(failing.values())
    if failure is None:
        failing.pop(name, None)
    else:
        failing[name] = failure
    if failing:
        memo.pod_failures[key] = failing
    else:
        memo.pod_failures.pop(key, None)
    stored = list(inference_services.get(key, []))
    for role, summed in role_failures(failing.values()).items():
        if stored and summed.reason != getattr(before.get(role), "reason", None):
            kopf.warn(stored[0], reason=summed.reason, message=f"{role}: {summed.message}")
    await publish_status(memo, namespace, instance, inference_services, rollouts)
