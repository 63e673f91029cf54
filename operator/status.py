"""The InferenceService status, computed from the spec's validity, its Deployments' status and
why its pods cannot start (pods.py).

Pure: the same inputs give the same status, and a condition keeps its lastTransitionTime until
its status changes, so recomputing an unchanged world writes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubesgl import contract
from kubesgl.operator.pods import RoleFailure

Object = dict[str, Any]
CONDITION_TYPES = ("Ready", "Progressing", "Degraded")


@dataclass(frozen=True)
class Rollout:
    """What a role's Deployment reports about itself."""

    role: str
    desired: int  # spec.replicas as the Deployment has it (an autoscaler may have set it)
    generation: int
    observed_generation: int
    replicas: int
    ready: int
    updated: int
    available: int
    failure: str | None  # why the Deployment controller gave up, if it did

    @classmethod
    def from_deployment(cls, deployment: Mapping[str, Any]) -> Rollout:
        meta = deployment.get("metadata", {})
        spec = deployment.get("spec", {})
        status = deployment.get("status") or {}
        return cls(
            role=meta.get("labels", {}).get(contract.ROLE_LABEL, ""),
            desired=spec.get("replicas", 1),
            generation=meta.get("generation", 0),
            observed_generation=status.get("observedGeneration", 0),
            replicas=status.get("replicas", 0),
            ready=status.get("readyReplicas", 0),
            updated=status.get("updatedReplicas", 0),
            available=status.get("availableReplicas", 0),
            failure=_failure(status.get("conditions", [])),
        )


def _failure(conditions: list[Mapping[str, Any]]) -> str | None:
    for condition in conditions:
        kind, state = condition.get("type"), condition.get("status")
        if (kind == "ReplicaFailure" and state == "True") or (
            kind == "Progressing" and state == "False"
        ):
            return condition.get("message") or condition.get("reason") or kind
    return None


@dataclass(frozen=True)
class Verdict:
    status: bool
    reason: str
    message: str


def _finished(rollout: Rollout) -> bool:
    """Its newest template's replicas all available, and no other pod left."""
    return (
        rollout.observed_generation >= rollout.generation
        and rollout.updated >= rollout.desired
        and rollout.available >= rollout.desired
        and rollout.replicas == rollout.desired
    )


def serves_in_full(rollout: Rollout) -> bool:
    """Every replica ready and rolled out: none of the role's pods is failing to start."""
    return rollout.desired > 0 and rollout.ready >= rollout.desired and _finished(rollout)


def _role_verdicts(rollout: Rollout | None, pods: RoleFailure | None = None) -> dict[str, Verdict]:
    if rollout is None:
        return {
            "Ready": Verdict(False, "Pending", "the Deployment does not exist yet"),
            "Progressing": Verdict(True, "Creating", "the Deployment does not exist yet"),
            "Degraded": Verdict(False, "AsExpected", ""),
        }
    counts = f"{rollout.ready}/{rollout.desired} ready"
    if rollout.desired == 0:
        ready = Verdict(False, "ScaledToZero", "0 replicas requested")
    elif rollout.ready >= rollout.desired:
        ready = Verdict(True, "AllReplicasReady", counts)
    else:
        ready = Verdict(False, "ReplicasNotReady", counts)
    finished = _finished(rollout)
    if finished:
        progressing = Verdict(False, "RolloutComplete", counts)
    else:
        detail = f"{rollout.updated}/{rollout.desired} updated, {rollout.available} available"
        progressing = Verdict(True, "RollingOut", detail)
    if pods is not None and not (ready.status and finished):
        # A role not fully available whose pods cannot start: they say why, long before the
        # Deployment's progress deadline, and more precisely than it after.
        degraded = Verdict(True, pods.reason, pods.message)
    elif rollout.failure:
        degraded = Verdict(True, "DeploymentFailed", rollout.failure)
    else:
        degraded = Verdict(False, "AsExpected", "")
    return {"Ready": ready, "Progressing": progressing, "Degraded": degraded}


def _overall(
    per_role: Mapping[str, Mapping[str, Verdict]], pod_reasons: frozenset[str] = frozenset()
) -> dict[str, Verdict]:
    def summary(kind: str, want: bool) -> str:
        return "; ".join(
            f"{role}: {verdicts[kind].message or verdicts[kind].reason}"
            for role, verdicts in per_role.items()
            if verdicts[kind].status is want
        )

    not_ready = summary("Ready", False)
    progressing = summary("Progressing", True)
    degraded = summary("Degraded", True)
    reasons = {verdicts["Degraded"].reason for verdicts in per_role.values()}
    reasons -= {"AsExpected"}
    # The pods' reason when every degraded role's pods fail alike: `kubectl get` shows it.
    degraded_reason = reasons.pop() if len(reasons) == 1 and reasons <= pod_reasons else None
    return {
        "Ready": Verdict(True, "AllRolesReady", "")
        if not not_ready
        else Verdict(False, "RolesNotReady", not_ready),
        "Progressing": Verdict(True, "RolesProgressing", progressing)
        if progressing
        else Verdict(False, "Reconciled", ""),
        "Degraded": Verdict(True, degraded_reason or "RolesDegraded", degraded)
        if degraded
        else Verdict(False, "AsExpected", ""),
    }


def _held_back(
    overall: Mapping[str, Verdict], failure: Verdict, progressing: str
) -> dict[str, Verdict]:
    """The spec is held back (invalid: nothing of it is applied; refused: what came before the
    refused child is): Degraded says why and Progressing stops, while what already runs keeps
    its Ready and goes on serving."""
    return {
        **overall,
        "Progressing": Verdict(False, failure.reason, progressing),
        "Degraded": failure,
    }


def _invalid(overall: Mapping[str, Verdict], problems: str, running: bool) -> dict[str, Verdict]:
    failure = Verdict(True, "InvalidSpec", problems)
    held_back = _held_back(overall, failure, "nothing is applied until the spec is fixed")
    if not running:  # no role to be Ready from: the spec never ran
        held_back["Ready"] = Verdict(False, "InvalidSpec", problems)
    return held_back


def _conditions(
    verdicts: Mapping[str, Verdict], previous: list[Mapping[str, Any]], generation: int, now: str
) -> list[Object]:
    before = {condition.get("type"): condition for condition in previous}
    conditions = []
    for kind in CONDITION_TYPES:
        verdict = verdicts[kind]
        status = "True" if verdict.status else "False"
        old = before.get(kind, {})
        conditions.append(
            {
                "type": kind,
                "status": status,
                "reason": verdict.reason,
                "message": verdict.message,
                "lastTransitionTime": old.get("lastTransitionTime", now)
                if old.get("status") == status
                else now,
                "observedGeneration": generation,
            }
        )
    return conditions


def compute_status(
    *,
    generation: int,
    roles: list[str],
    rollouts: Mapping[str, Rollout],
    endpoint: str | None,
    problems: str | None,
    previous: Mapping[str, Any],
    now: str,
    apply_failure: Verdict | None = None,
    pod_failures: Mapping[str, RoleFailure] | None = None,
) -> Object:
    """roles: the roles the spec runs (engine roles and router), or those still running when
    the spec is invalid; problems: why the spec is invalid, or None when it is valid;
    apply_failure: why the API server refused the last apply of a valid spec, or None. Either
    way what is already running keeps its Ready. pod_failures: by role, why its pods cannot
    start (pods.role_failures); a role not fully available is Degraded with their reason."""
    pod_failures = pod_failures or {}
    per_role = {role: _role_verdicts(rollouts.get(role), pod_failures.get(role)) for role in roles}
    pod_reasons = frozenset(failure.reason for failure in pod_failures.values())
    overall = _overall(per_role, pod_reasons)
    if problems is not None:
        overall = _invalid(overall, problems, running=bool(per_role))
    elif apply_failure is not None:
        overall = _held_back(overall, apply_failure, "applied again until the cluster takes it")
    previous_roles = previous.get("roles") or {}
    status: Object = {
        "observedGeneration": generation,
        "conditions": _conditions(overall, previous.get("conditions") or [], generation, now),
        "roles": {},
    }
    for role in roles:
        rollout = rollouts.get(role)
        old_conditions = (previous_roles.get(role) or {}).get("conditions") or []
        status["roles"][role] = {
            "replicas": rollout.desired if rollout else 0,
            "readyReplicas": rollout.ready if rollout else 0,
            "updatedReplicas": rollout.updated if rollout else 0,
            "availableReplicas": rollout.available if rollout else 0,
            "conditions": _conditions(per_role[role], old_conditions, generation, now),
        }
    if endpoint is not None:
        status["endpoint"] = endpoint
    return status


def status_patch(new: Object, previous: Mapping[str, Any]) -> Object | None:
    """The merge patch from previous to new, or None when nothing changed.

    A merge patch keeps what it does not mention, so what is gone is set to null."""
    gone_roles = set(previous.get("roles") or {}) - set(new["roles"])
    endpoint_gone = "endpoint" in previous and "endpoint" not in new
    if all(previous.get(key) == value for key, value in new.items()) and not endpoint_gone:
        return None
    patch = {**new, "roles": {**new["roles"], **{role: None for role in gone_roles}}}
    if endpoint_gone:
        patch["endpoint"] = None
    return patch
