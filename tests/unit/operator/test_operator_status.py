"""Status computation and drift detection, as pure functions."""

from __future__ import annotations

from kubesgl.operator.drift import has_drifted
from kubesgl.operator.status import Rollout, Verdict, compute_status, status_patch


def rollout(
    role: str,
    desired: int = 2,
    ready: int = 2,
    updated: int | None = None,
    failure: str | None = None,
    generation: int = 1,
    observed: int = 1,
) -> Rollout:
    updated = ready if updated is None else updated
    return Rollout(
        role=role,
        desired=desired,
        generation=generation,
        observed_generation=observed,
        replicas=desired,
        ready=ready,
        updated=updated,
        available=ready,
        failure=failure,
    )


def status(rollouts, previous=None, problems=None, now="2026-01-01T00:00:00Z"):
    return compute_status(
        generation=3,
        roles=["prefill", "decode", "router"],
        rollouts={r.role: r for r in rollouts},
        endpoint="http://x:8000",
        problems=problems,
        previous=previous or {},
        now=now,
    )


def conditions(result, role=None):
    source = result["roles"][role] if role else result
    return {c["type"]: (c["status"], c["reason"]) for c in source["conditions"]}


def test_all_roles_ready() -> None:
    result = status([rollout("prefill"), rollout("decode"), rollout("router", 1, 1)])
    assert conditions(result) == {
        "Ready": ("True", "AllRolesReady"),
        "Progressing": ("False", "Reconciled"),
        "Degraded": ("False", "AsExpected"),
    }
    assert result["observedGeneration"] == 3 and result["endpoint"] == "http://x:8000"
    assert result["roles"]["decode"]["readyReplicas"] == 2


def test_a_missing_or_partial_role_is_not_ready_and_progressing() -> None:
    result = status([rollout("prefill"), rollout("decode", ready=1, updated=2)])
    assert conditions(result)["Ready"] == ("False", "RolesNotReady")
    assert conditions(result)["Progressing"] == ("True", "RolesProgressing")
    ready = next(c for c in result["conditions"] if c["type"] == "Ready")
    assert "decode: 1/2 ready" in ready["message"] and "router" in ready["message"]
    assert conditions(result, "router")["Ready"] == ("False", "Pending")
    assert conditions(result, "prefill")["Ready"] == ("True", "AllReplicasReady")


def test_an_old_generation_is_still_progressing() -> None:
    result = status(
        [rollout("prefill", generation=2, observed=1), rollout("decode"), rollout("router", 1, 1)]
    )
    assert conditions(result, "prefill")["Progressing"] == ("True", "RollingOut")


def test_a_failed_deployment_degrades() -> None:
    result = status(
        [
            rollout("prefill"),
            rollout("decode", failure="deadline exceeded"),
            rollout("router", 1, 1),
        ]
    )
    assert conditions(result)["Degraded"] == ("True", "RolesDegraded")
    assert conditions(result, "decode")["Degraded"] == ("True", "DeploymentFailed")


def test_an_invalid_spec_degrades_without_endpoint_roles() -> None:
    result = compute_status(
        generation=2,
        roles=[],
        rollouts={},
        endpoint=None,
        problems="spec.decode: required",
        previous={},
        now="t",
    )
    assert conditions(result)["Degraded"] == ("True", "InvalidSpec")
    assert "endpoint" not in result


def test_transition_times_only_move_on_change() -> None:
    first = status([rollout("prefill"), rollout("decode"), rollout("router", 1, 1)], now="t1")
    same = status(
        [rollout("prefill"), rollout("decode"), rollout("router", 1, 1)], previous=first, now="t2"
    )
    assert same == first
    assert status_patch(same, first) is None
    worse = status(
        [rollout("prefill"), rollout("decode", ready=1), rollout("router", 1, 1)],
        previous=first,
        now="t3",
    )
    times = {c["type"]: c["lastTransitionTime"] for c in worse["conditions"]}
    assert times == {"Ready": "t3", "Progressing": "t3", "Degraded": "t1"}
    assert status_patch(worse, first) is not None


def test_status_patch_nulls_roles_that_are_gone() -> None:
    before = {"roles": {"mixed": {"readyReplicas": 1}, "router": {}}, "endpoint": "e"}
    after = {"roles": {"router": {}}, "conditions": []}
    patch = status_patch(after, before)
    assert patch["roles"] == {"router": {}, "mixed": None} and patch["endpoint"] is None


def test_drift_is_containment_with_quantities_normalised() -> None:
    desired = {
        "spec": {
            "replicas": 2,
            "template": {
                "containers": [
                    {"image": "a", "resources": {"limits": {"cpu": "0.5", "memory": "1Gi"}}}
                ]
            },
        }
    }
    live = {
        "status": {},
        "spec": {
            "replicas": 2,
            "strategy": {},
            "template": {
                "containers": [
                    {
                        "image": "a",
                        "imagePullPolicy": "IfNotPresent",
                        "resources": {"limits": {"cpu": "500m", "memory": "1Gi"}},
                    }
                ]
            },
        },
    }
    assert not has_drifted(desired, live)
    live["spec"]["replicas"] = 3
    assert has_drifted(desired, live)
    live["spec"]["replicas"] = 2
    live["spec"]["template"]["containers"][0]["image"] = "b"
    assert has_drifted(desired, live)
    assert has_drifted({"args": ["2"]}, {"args": ["2.0"]})  # only quantity fields are quantities
    # other fields the API server stores as canonical quantities
    assert not has_drifted(
        {"emptyDir": {"sizeLimit": "1.5Gi"}}, {"emptyDir": {"sizeLimit": "1536Mi"}}
    )
    hpa_metric = {"target": {"type": "AverageValue", "averageValue": "1000"}}
    assert not has_drifted(hpa_metric, {"target": {"type": "AverageValue", "averageValue": "1k"}})
    assert has_drifted(hpa_metric, {"target": {"type": "AverageValue", "averageValue": "2k"}})
    assert has_drifted({"env": [{"value": "1k"}]}, {"env": [{"value": "1000"}]})
    assert has_drifted({"spec": {"x": 1}}, {})


def test_a_refused_apply_is_degraded_and_keeps_what_runs_ready():
    """A valid spec whose child the API server refused: Degraded with the server's message,
    not progressing (nothing moves until it is fixed or the refusal goes), while the roles
    already running stay Ready."""
    refused = Verdict(True, "ApplyFailed", "the API server refused Deployment x-decode: ...")
    running = [rollout(role) for role in ("prefill", "decode", "router")]
    result = compute_status(
        generation=3,
        roles=["prefill", "decode", "router"],
        rollouts={r.role: r for r in running},
        endpoint="http://x:8000",
        problems=None,
        previous={},
        now="2026-01-01T00:00:00Z",
        apply_failure=refused,
    )
    assert conditions(result) == {
        "Ready": ("True", "AllRolesReady"),
        "Progressing": ("False", "ApplyFailed"),
        "Degraded": ("True", "ApplyFailed"),
    }
    (degraded,) = [c for c in result["conditions"] if c["type"] == "Degraded"]
    assert degraded["message"] == refused.message
