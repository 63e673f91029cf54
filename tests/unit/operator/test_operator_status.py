"""Status computation and drift detection, as pure functions."""

from __future__ import annotations

import copy
from typing import Any

from operator_fixtures import load_example, with_changes

from kubesgl.operator.drift import has_drifted
from kubesgl.operator.handlers import _snapshot
from kubesgl.operator.pods import RoleFailure
from kubesgl.operator.render import render
from kubesgl.operator.status import Rollout, Verdict, compute_status, status_patch
from kubesgl.operator.validation import parse_inference_service


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


PULL = RoleFailure("ImagePullBackOff", 'pod d-1: container engine: ErrImagePull: "x" not found')


def with_pods(rollouts, pod_failures, previous=None, now="t"):
    return compute_status(
        generation=3,
        roles=["prefill", "decode", "router"],
        rollouts={r.role: r for r in rollouts},
        endpoint="http://x:8000",
        problems=None,
        previous=previous or {},
        now=now,
        pod_failures=pod_failures,
    )


def test_a_role_whose_pods_cannot_start_is_degraded_with_their_reason() -> None:
    """Long before the Deployment's progress deadline: the role's condition has the pods'
    reason and message; the InferenceService's too, with the role named."""
    running = [rollout("prefill"), rollout("decode", ready=0), rollout("router", 1, 1)]
    result = with_pods(running, {"decode": PULL})
    assert conditions(result, "decode")["Degraded"] == ("True", "ImagePullBackOff")
    assert conditions(result)["Degraded"] == ("True", "ImagePullBackOff")
    degraded = next(c for c in result["conditions"] if c["type"] == "Degraded")
    assert degraded["message"] == f"decode: {PULL.message}"
    assert conditions(result)["Progressing"] == ("True", "RolesProgressing")  # still rolling out
    # more precise than the Deployment's own failure once the deadline has passed
    stuck = [rollout("prefill"), rollout("decode", ready=0, failure="timed out")]
    assert conditions(with_pods(stuck, {"decode": PULL}), "decode")["Degraded"] == (
        "True",
        "ImagePullBackOff",
    )


def test_roles_whose_pods_fail_differently_read_roles_degraded() -> None:
    unschedulable = RoleFailure("Unschedulable", "pod p-1: Unschedulable: 0/4 nodes")
    running = [rollout("prefill", ready=0), rollout("decode", ready=0), rollout("router", 1, 1)]
    result = with_pods(running, {"decode": PULL, "prefill": unschedulable})
    assert conditions(result)["Degraded"] == ("True", "RolesDegraded")
    degraded = next(c for c in result["conditions"] if c["type"] == "Degraded")
    assert "prefill: pod p-1: Unschedulable" in degraded["message"]
    assert "decode: pod d-1: container engine: ErrImagePull" in degraded["message"]


def test_failing_pods_of_a_role_that_is_fully_available_do_not_degrade_it() -> None:
    """A role with all its replicas ready and rolled out serves: a failing pod reported late
    (or of an old ReplicaSet) does not make it Degraded; when the pods recover, it clears."""
    healthy = [rollout("prefill"), rollout("decode"), rollout("router", 1, 1)]
    assert conditions(with_pods(healthy, {"decode": PULL}))["Degraded"] == ("False", "AsExpected")
    # a rolling update whose new pod cannot pull: the old ones serve, the rollout is stuck
    surging = [rollout("prefill"), rollout("decode", ready=2, updated=1), rollout("router", 1, 1)]
    assert conditions(with_pods(surging, {"decode": PULL}))["Degraded"][0] == "True"
    broken = with_pods([rollout("decode", ready=0)], {"decode": PULL}, now="t1")
    recovered = with_pods([rollout("decode", ready=0)], {}, previous=broken, now="t2")
    assert conditions(recovered, "decode")["Degraded"] == ("False", "AsExpected")
    transition = {c["type"]: c["lastTransitionTime"] for c in recovered["conditions"]}
    assert transition["Degraded"] == "t2"


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
    assert conditions(result) == {
        "Ready": ("False", "InvalidSpec"),
        "Progressing": ("False", "InvalidSpec"),
        "Degraded": ("True", "InvalidSpec"),
    }
    assert "endpoint" not in result


def test_an_invalid_edit_keeps_what_runs_ready() -> None:
    """A typo in a serving InferenceService's spec applies nothing: the old pods go on serving,
    so Ready stays theirs while Degraded says the spec is invalid."""
    running = [rollout(role) for role in ("mixed", "router")]
    result = compute_status(
        generation=4,
        roles=["mixed", "router"],
        rollouts={r.role: r for r in running},
        endpoint="http://x:8000",
        problems="spec.mixed.replicas: ...",
        previous={},
        now="t",
    )
    assert conditions(result) == {
        "Ready": ("True", "AllRolesReady"),
        "Progressing": ("False", "InvalidSpec"),
        "Degraded": ("True", "InvalidSpec"),
    }
    assert result["endpoint"] == "http://x:8000"


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


def test_labels_and_annotations_of_others_are_no_drift() -> None:
    """The repair handler renders from the indexed InferenceService: its labels must be there,
    or every child carrying them would be re-applied, and what others add to a child (a
    Deployment's revision, a mesh's or a cloud's annotations, labels) is not the operator's."""
    body = {
        "apiVersion": "kubesgl.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {
            "name": "tiny",
            "namespace": "default",
            "uid": "u1",
            "labels": {"team": "search"},
            "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"},
        },
        "spec": {"image": "img", "model": {"hostPath": {"path": "/m"}}},
    }
    indexed = _snapshot(body)
    assert "annotations" not in indexed["metadata"]
    for desired in render(parse_inference_service(indexed)):
        assert desired["metadata"]["labels"]["team"] == "search"
        live = copy.deepcopy(desired)
        live["metadata"]["labels"]["pod-template-hash"] = "5d4f"
        live["metadata"].setdefault("annotations", {})["deployment.kubernetes.io/revision"] = "3"
        assert not has_drifted(desired, live), desired["kind"]
        del live["metadata"]["labels"]["team"]  # taken off by hand: put back
        assert has_drifted(desired, live), desired["kind"]


def _as_served(value: Any) -> Any:
    """An object as the API server serves it back: the Go fields of an EnvVar's value, of a
    Toleration's key and value, and a NodeAffinity's preferences are `omitempty`, so an empty
    string or list there is dropped."""
    if isinstance(value, list):
        return [_as_served(item) for item in value]
    if not isinstance(value, dict):
        return value
    served = {key: _as_served(item) for key, item in value.items()}
    omitted = {
        "env": ("value",),
        "tolerations": ("key", "value"),
        "nodeAffinity": ("preferredDuringSchedulingIgnoredDuringExecution",),
    }
    for field, keys in omitted.items():
        block = served.get(field, [])
        for item in block if isinstance(block, list) else [block]:
            for key in keys:
                if item.get(key) in ("", []):
                    del item[key]
    return served


def test_an_empty_environment_value_is_no_drift() -> None:
    """`value: ""` was rendered as it is, and the API server drops it (EnvVar.value is
    omitempty): the Deployment looked drifted for good, and the repair handler re-applied it,
    logging "restoring Deployment", on every event."""
    document = with_changes(
        load_example("mixed.yaml"), "spec.mixed.env", [{"name": "EMPTY", "value": ""}]
    )
    document["metadata"]["uid"] = "u1"
    objects = render(parse_inference_service(document))
    deployment = next(
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-mixed")
    )
    assert not has_drifted(deployment, _as_served(deployment))


def test_a_toleration_with_an_empty_key_or_value_is_no_drift() -> None:
    """A Toleration's key and value are omitempty too: `value: ""` (the taint `gpu=:NoSchedule`)
    or `key: ""` with Exists (every taint) were rendered as given, and the Deployment looked
    drifted for good."""
    tolerations = [
        {"key": "gpu", "operator": "Equal", "value": "", "effect": "NoSchedule"},
        {"key": "", "operator": "Exists"},
    ]
    document = with_changes(load_example("mixed.yaml"), "spec.mixed.tolerations", tolerations)
    document["metadata"]["uid"] = "u1"
    objects = render(parse_inference_service(document))
    deployment = next(
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-mixed")
    )
    assert not has_drifted(deployment, _as_served(deployment))


def test_an_empty_list_of_affinity_preferences_is_no_drift() -> None:
    """An affinity is passed on as given, and the API server drops a NodeAffinity's empty list
    of preferences (omitempty): the Deployment looked drifted for good. A list it keeps, or an
    empty string it does not serve back, is still compared."""
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]}
                ]
            },
            "preferredDuringSchedulingIgnoredDuringExecution": [],
        }
    }
    document = with_changes(load_example("mixed.yaml"), "spec.mixed.affinity", affinity)
    document["metadata"]["uid"] = "u1"
    objects = render(parse_inference_service(document))
    deployment = next(
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-mixed")
    )
    live = _as_served(deployment)
    assert not has_drifted(deployment, live)
    terms = live["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    terms["nodeSelectorTerms"] = []  # changed by hand: put back
    assert has_drifted(deployment, live)


def test_an_env_divisor_the_api_server_rewrites_is_no_drift() -> None:
    """A resourceFieldRef's divisor is a quantity, which the API server stores canonical
    ("1024Ki" as "1Mi", 1 as "1"): the Deployment looked drifted for good."""
    for given, served in (("1024Ki", "1Mi"), (1, "1")):
        source = {"resourceFieldRef": {"resource": "limits.memory", "divisor": given}}
        document = with_changes(
            load_example("mixed.yaml"), "spec.mixed.env", [{"name": "MEM", "valueFrom": source}]
        )
        document["metadata"]["uid"] = "u1"
        objects = render(parse_inference_service(document))
        deployment = next(
            o
            for o in objects
            if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-mixed")
        )
        live = copy.deepcopy(deployment)
        env = live["spec"]["template"]["spec"]["containers"][0]["env"]
        (field,) = (v["valueFrom"]["resourceFieldRef"] for v in env if v["name"] == "MEM")
        field["divisor"] = served
        assert not has_drifted(deployment, live), given
        field["divisor"] = "2Mi"
        assert has_drifted(deployment, live)
