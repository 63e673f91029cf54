"""Bringing the cluster to the rendered state: apply what is wanted, delete what no longer is."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.exceptions import ApiException

from kubesgl import contract
from kubesgl.operator import naming
from kubesgl.operator.kube import CHILD_KINDS, ApplyRejected, KubeApi, deletion_rank, kind_of
from kubesgl.operator.render import Object, render
from kubesgl.operator.spec import InferenceService
from kubesgl.operator.status import Rollout

log = logging.getLogger(__name__)


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    references = obj.get("metadata", {}).get("ownerReferences") or []
    return any(reference.get("uid") == uid for reference in references)


def identity(obj: Mapping[str, Any]) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


@dataclass(frozen=True)
class Applied:
    objects: list[Object]
    # Engine roles the spec no longer runs (a mode switch) and that keep serving, with their
    # objects, until the roles that replace them are ready: `prune_retired` removes them then.
    retiring: tuple[str, ...] = ()


@dataclass
class Made:
    """What the operator made of one InferenceService's children: each as it last applied it,
    until it deletes it, and the generation whose spec it last applied in full. A repair puts
    a child back to this, never to a spec not applied yet (one being applied, or one the
    cluster refused: the children applied before the refused one are at the new spec)."""

    uid: str
    generation: int | None = None  # none applied in full yet, by this process
    children: dict[tuple[str, str], Object] = field(default_factory=dict)


def apply_children(api: KubeApi, isvc: InferenceService, made: Made | None = None) -> Applied:
    """Apply every child of a validated InferenceService and prune the ones it no longer has
    (those of retired engine roles once their replacements serve), recording each in `made`."""
    made = made if made is not None else Made(isvc.metadata.uid or "")
    desired = render(isvc)
    # listed once, before applying: what the hand-over reads, and what pruning deletes
    existing = {
        identity(child): child
        for child in _owned_children(
            api, isvc.metadata.namespace, isvc.metadata.name, isvc.metadata.uid or ""
        )
    }
    for obj in desired:  # all checked before any is applied
        if identity(obj) not in existing:
            _refuse_to_take_over(api, obj, isvc.metadata.uid or "")
    wanted = {identity(obj) for obj in desired}
    stale = {key: child for key, child in existing.items() if key not in wanted}
    for key in [key for key, child in stale.items() if kind_of(child).autoscaler]:
        # before the new autoscaler: KEDA refuses a ScaledObject for a Deployment an HPA
        # still scales, and an apply that fails would hold every later prune back
        _delete(api, isvc, stale.pop(key), made)
    for obj in desired:
        live = existing.get(identity(obj))
        if live is not None and obj["kind"] == "Deployment" and "replicas" not in obj["spec"]:
            role = _role(obj)
            autoscaled = (
                role in contract.ENGINE_ROLES and isvc.spec.autoscaling_for(role) is not None
            )
            _hand_over_replicas(api, obj, live, autoscaled)
        api.apply(obj)
        made.children[identity(obj)] = obj
    retiring = _retired_roles(isvc, stale.values())
    for child in stale.values():
        if _role(child) not in retiring:
            _delete(api, isvc, child, made)
    if retiring:  # the statuses listed above predate this apply: read them again
        retiring = prune_retired(api, isvc, made)
    return Applied(desired, retiring)


def prune_retired(
    api: KubeApi, isvc: InferenceService, made: Made | None = None
) -> tuple[str, ...]:
    """Deletes the objects of engine roles the spec no longer runs once every Deployment it
    does run has rolled out and is ready (a switch between mixed and disaggregated keeps the
    old pool, and the router pods that still send to it, serving until then); returns the
    retired roles still kept."""
    meta = isvc.metadata
    made = made if made is not None else Made(meta.uid or "")
    children = {
        identity(child): child
        for child in _owned_children(api, meta.namespace, meta.name, meta.uid or "")
    }
    wanted = {identity(obj) for obj in render(isvc)}
    stale = [child for key, child in children.items() if key not in wanted]
    retiring = _retired_roles(isvc, stale)
    if not retiring:
        return ()
    deployments = [key for key in wanted if key[0] == "Deployment"]
    if not all(key in children and _rolled_out(children[key]) for key in deployments):
        log.info(
            "keeping the %s pool until the roles that replace it are ready", ", ".join(retiring)
        )
        return retiring
    for child in sorted(stale, key=deletion_rank):
        _delete(api, isvc, child, made)
    return ()


def _role(obj: Mapping[str, Any]) -> str | None:
    return obj["metadata"].get("labels", {}).get(contract.ROLE_LABEL)


def _retired_roles(isvc: InferenceService, stale: Iterable[Object]) -> tuple[str, ...]:
    """Engine roles the spec's mode no longer runs with objects among `stale` (a Deployment,
    or what is left of a role whose Deployment is gone already)."""
    roles = {_role(obj) for obj in stale}
    running = isvc.spec.engine_roles()
    return tuple(sorted(r for r in contract.ENGINE_ROLES if r in roles and r not in running))


def _rolled_out(deployment: Object) -> bool:
    """Every replica runs the current spec and is ready, and no old one is left."""
    rollout = Rollout.from_deployment(deployment)
    return (
        rollout.observed_generation >= rollout.generation
        and rollout.updated == rollout.ready == rollout.replicas == rollout.desired
    )


def _delete(api: KubeApi, isvc: InferenceService, child: Object, made: Made) -> None:
    log.info("deleting %s %s: no longer in the spec", *identity(child))
    api.delete(kind_of(child), isvc.metadata.namespace, child["metadata"]["name"])
    made.children.pop(identity(child), None)


def restore_child(api: KubeApi, obj: Object, uid: str) -> None:
    """Apply again a child as the operator last applied it (deleted or edited since): its
    fields are those applied before, so no replicas hand-over is due; a deleted one's name
    may have been taken meanwhile by an object not this instance's."""
    _refuse_to_take_over(api, obj, uid)
    api.apply(obj)


def _refuse_to_take_over(api: KubeApi, obj: Object, uid: str) -> None:
    """A child's name may already be taken by an object that is not this instance's (a
    user's Service, or another instance's child: `a`'s `a-prefill` Service and instance
    `a-prefill`'s router). Applying with force would merge into it and make it ours, and
    deleting the InferenceService would then delete it."""
    meta = obj["metadata"]
    live = api.get(kind_of(obj), meta["namespace"], meta["name"])
    if live is not None and not owned_by(live, uid):
        raise ApplyRejected(
            f"{obj['kind']} {meta['name']} already exists and is not this InferenceService's: "
            "rename the InferenceService, or delete or rename that object"
        )


def _hand_over_replicas(api: KubeApi, deployment: Object, live: Object, autoscaled: bool) -> None:
    """An autoscaled Deployment, or one whose role leaves `replicas` unset, is applied without
    replicas. Where the operator still holds the field alone (autoscaling just turned on, the
    count just unset), leaving it out would reset it to the
    default, 1 replica, until the autoscaler scales up again; so another field manager first
    applies the running count, and the field stays when the operator lets go of it. The
    autoscaler changes it from there (Kubernetes' "transferring ownership"). An autoscaled
    role at 0 is let fall back to 1: an HPA does not scale a target that has no replicas; a
    role not autoscaled stays at 0."""
    meta = deployment["metadata"]
    if not _applies_field(live, naming.MANAGER, "spec", "replicas"):
        return
    running = live["spec"].get("replicas", 1)
    if running == 0 and autoscaled:
        return
    replicas = {
        "apiVersion": deployment["apiVersion"],
        "kind": "Deployment",
        "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
        "spec": {"replicas": running},
    }
    try:
        api.apply(replicas, naming.REPLICAS_HANDOVER_MANAGER, force=False)
    except ApiException as error:
        if error.status != 409:
            raise
        # the count changed under us: whoever changed it holds the field now
        log.info("replicas of Deployment %s changed during the hand-over", meta["name"])


def _applies_field(obj: Mapping[str, Any], manager: str, *path: str) -> bool:
    """Whether `manager`'s server-side applies to `obj` set the field at `path`."""
    for entry in obj["metadata"].get("managedFields") or []:
        if entry.get("manager") != manager or entry.get("operation") != "Apply":
            continue
        fields = entry.get("fieldsV1") or {}
        for name in path:
            fields = fields.get(f"f:{name}")
            if fields is None:
                break
        else:
            return True
    return False


def delete_children(api: KubeApi, namespace: str, instance: str, uid: str) -> int:
    """Delete an InferenceService's children in teardown order (kube.CHILD_KINDS), the
    router's before the engines' so that no new requests reach draining engines; returns how
    many."""
    children = _owned_children(api, namespace, instance, uid)

    def order(obj: Object) -> tuple[int, int]:
        is_engine = obj["metadata"].get("labels", {}).get(contract.ROLE_LABEL) != contract.ROUTER
        return deletion_rank(obj), int(is_engine)

    for child in sorted(children, key=order):
        api.delete(kind_of(child), namespace, child["metadata"]["name"])
    return len(children)


def _owned_children(api: KubeApi, namespace: str, instance: str, uid: str) -> list[Object]:
    return [
        child
        for kind in CHILD_KINDS
        for child in api.list_children(kind, namespace, instance)
        if owned_by(child, uid)
    ]
