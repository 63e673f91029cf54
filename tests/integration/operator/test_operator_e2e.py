"""The operator end to end: kopf, the kubernetes client and the API emulator, no mocks inside."""

from __future__ import annotations

import copy
import time
from typing import Any

import yaml
from operator_harness import EXAMPLES, NAMESPACE, Cluster, OperatorProcess, wait_for

from kubesgl.operator.drift import has_drifted
from kubesgl.operator.kube import CHILD_KINDS, DEPLOYMENT, INFERENCE_SERVICE, kind_of
from kubesgl.operator.pods import POD
from kubesgl.operator.render import render
from kubesgl.operator.validation import parse_inference_service


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


def rendered(created: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    objects = render(parse_inference_service(created))
    return {(obj["kind"], obj["metadata"]["name"]): obj for obj in objects}


def settle(cluster: Cluster, created: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """Wait until every child exists and the status names the current generation."""
    name = created["metadata"]["name"]
    wanted = set(rendered(created))
    wait_for(lambda: set(cluster.children(name)) == wanted, what="all children")
    generation = lambda: (cluster.isvc(name) or {}).get("metadata", {}).get("generation")  # noqa: E731
    wait_for(
        lambda: (
            ((cluster.isvc(name) or {}).get("status") or {}).get("observedGeneration")
            == generation()
        ),
        what="status of the current generation",
    )
    return cluster.children(name)


def versions(children: dict[tuple[str, str], dict[str, Any]]) -> dict[tuple[str, str], str]:
    return {key: obj["metadata"]["resourceVersion"] for key, obj in children.items()}


def mark_ready(
    cluster: Cluster,
    name: str,
    ready: int | None = None,
    conditions: list[dict[str, Any]] | None = None,
) -> None:
    """Play the Deployment controller: report a finished rollout of the current generation."""
    deployment = cluster.get(DEPLOYMENT, name)
    assert deployment is not None, name
    replicas = deployment["spec"].get("replicas", 1)
    status = {
        "observedGeneration": deployment["metadata"]["generation"],
        "replicas": replicas,
        "updatedReplicas": replicas,
        "readyReplicas": replicas if ready is None else ready,
        "availableReplicas": replicas if ready is None else ready,
        "conditions": conditions or [],
    }
    cluster.patch(DEPLOYMENT, name, {"status": status}, subresource="status")


def test_apply_creates_every_child_with_owner_reference_and_labels(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    created = cluster.create_isvc(example("disaggregated.yaml"))
    children = settle(cluster, created)
    wanted = rendered(created)
    assert set(children) == set(wanted)
    for key, child in children.items():
        owners = child["metadata"]["ownerReferences"]
        assert [(o["kind"], o["name"], o["uid"], o["controller"]) for o in owners] == [
            ("InferenceService", "llama-pd", created["metadata"]["uid"], True)
        ], key
        labels = child["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "kubesgl"
        assert labels["app.kubernetes.io/instance"] == "llama-pd"
        # The live object holds everything rendered (plus what the server adds).
        assert not has_drifted(wanted[key], child), key
    prefill = children[("Deployment", "llama-pd-prefill")]
    template = prefill["spec"]["template"]
    assert template["metadata"]["labels"]["kubesgl.io/role"] == "prefill"
    assert template["metadata"]["annotations"]["kubesgl.io/bootstrap-port"] == "8998"
    status = cluster.isvc("llama-pd")["status"]
    assert status["endpoint"] == "http://llama-pd.default.svc:8000"
    assert set(status["roles"]) == {"prefill", "decode", "router"}


def test_a_change_updates_exactly_the_affected_children(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    created = cluster.create_isvc(example("disaggregated.yaml"))
    before = versions(settle(cluster, created))

    def changed_after(patch: dict[str, Any]) -> set[tuple[str, str]]:
        nonlocal before
        cluster.patch_isvc("llama-pd", {"spec": patch})
        updated = cluster.isvc("llama-pd")
        after = versions(settle(cluster, updated))
        assert set(after) == set(before)
        difference = {key for key in after if after[key] != before[key]}
        before = after
        return difference

    deployments = {("Deployment", f"llama-pd-{role}") for role in ("prefill", "decode", "router")}
    assert changed_after({"image": "ghcr.io/kubesgl/kubesgl:0.2.0"}) == deployments
    assert changed_after({"decode": {"replicas": 3}}) == {("Deployment", "llama-pd-decode")}
    assert changed_after({"engine": {"maxRunningRequests": 64}}) == {
        ("Deployment", "llama-pd-prefill"),
        ("Deployment", "llama-pd-decode"),
    }
    decode = cluster.get(DEPLOYMENT, "llama-pd-decode")
    assert decode["spec"]["replicas"] == 3
    args = decode["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-running-requests") + 1] == "64"
    assert decode["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":0.2.0")


def test_removing_a_feature_prunes_its_children(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    created = cluster.create_isvc(example("autoscaled-hpa.yaml"))
    children = settle(cluster, created)
    assert ("HorizontalPodAutoscaler", "llama-hpa-decode") in children
    cluster.patch_isvc("llama-hpa", {"spec": {"autoscaling": None}})
    children = settle(cluster, cluster.isvc("llama-hpa"))
    assert not [key for key in children if key[0] == "HorizontalPodAutoscaler"]


def test_deleted_or_edited_children_are_restored(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    created = cluster.create_isvc(example("disaggregated.yaml"))
    settle(cluster, created)
    service = kind_of({"apiVersion": "v1", "kind": "Service"})
    cluster.delete(service, "llama-pd-decode")
    wait_for(lambda: cluster.get(service, "llama-pd-decode"), what="the Service to come back")

    container = {"name": "engine", "image": "attacker/image:latest"}
    cluster.patch(
        DEPLOYMENT,
        "llama-pd-prefill",
        {"spec": {"replicas": 7, "template": {"spec": {"containers": [container]}}}},
    )

    def restored() -> bool:
        spec = cluster.get(DEPLOYMENT, "llama-pd-prefill")["spec"]
        image = spec["template"]["spec"]["containers"][0]["image"]
        return image == "ghcr.io/kubesgl/kubesgl:0.1.0" and spec["replicas"] == 1

    wait_for(restored, what="the hand-edited Deployment to be restored")


def test_replicas_set_by_an_autoscaler_are_not_reverted(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    created = cluster.create_isvc(example("autoscaled-hpa.yaml"))
    settle(cluster, created)
    assert "replicas" not in rendered(created)[("Deployment", "llama-hpa-decode")]["spec"]
    # What the HPA does: write the scale subresource.
    cluster.patch(DEPLOYMENT, "llama-hpa-decode", {"spec": {"replicas": 5}}, subresource="scale")
    cluster.patch_isvc("llama-hpa", {"spec": {"image": "ghcr.io/kubesgl/kubesgl:0.2.0"}})

    def image_updated() -> dict[str, Any] | None:
        decode = cluster.get(DEPLOYMENT, "llama-hpa-decode")
        image = decode["spec"]["template"]["spec"]["containers"][0]["image"]
        return decode if image.endswith(":0.2.0") else None

    decode = wait_for(image_updated, what="the new image on the decode Deployment")
    settle(cluster, cluster.isvc("llama-hpa"))
    time.sleep(1)  # room for a wrong write to land
    assert cluster.get(DEPLOYMENT, "llama-hpa-decode")["spec"]["replicas"] == 5
    assert decode["spec"]["replicas"] == 5
    status = cluster.isvc("llama-hpa")["status"]["roles"]["decode"]
    assert status["replicas"] == 5


def decode_turned_autoscaled(cluster: Cluster, replicas: int) -> dict[str, Any]:
    """The decode Deployment of autoscaled-hpa.yaml, created with `replicas` and no
    autoscaling, once autoscaling is turned on (its HPA made)."""
    manifest = example("autoscaled-hpa.yaml")
    autoscaling = manifest["spec"].pop("autoscaling")
    manifest["spec"]["decode"]["replicas"] = replicas
    settle(cluster, cluster.create_isvc(manifest))
    assert cluster.get(DEPLOYMENT, "llama-hpa-decode")["spec"]["replicas"] == replicas
    cluster.patch_isvc("llama-hpa", {"spec": {"autoscaling": autoscaling}})
    children = settle(cluster, cluster.isvc("llama-hpa"))
    assert ("HorizontalPodAutoscaler", "llama-hpa-decode") in children
    return children[("Deployment", "llama-hpa-decode")]


def replicas_after_an_unrelated_edit(cluster: Cluster, name: str, deployment: str) -> int:
    """A Deployment's count once the InferenceService's image has changed and the apply landed."""
    cluster.patch_isvc(name, {"spec": {"image": "ghcr.io/kubesgl/kubesgl:0.2.0"}})
    settle(cluster, cluster.isvc(name))
    time.sleep(1)  # room for a wrong write to land
    return cluster.get(DEPLOYMENT, deployment)["spec"]["replicas"]


def test_turning_autoscaling_on_keeps_the_replicas_that_run(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    # Applied without replicas, a field the operator owned alone would fall back to 1 replica.
    assert decode_turned_autoscaled(cluster, 4)["spec"].get("replicas") == 4
    # and the operator no longer holds it: the HPA's count survives the next change
    cluster.patch(DEPLOYMENT, "llama-hpa-decode", {"spec": {"replicas": 6}}, subresource="scale")
    assert replicas_after_an_unrelated_edit(cluster, "llama-hpa", "llama-hpa-decode") == 6


def test_a_role_at_zero_turned_autoscaled_falls_back_to_one_replica(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    """An HPA does not scale a target at 0 replicas: the count is not handed over."""
    assert "replicas" not in decode_turned_autoscaled(cluster, 0)["spec"]  # the default, 1


def test_a_role_at_zero_whose_replicas_is_unset_stays_at_zero(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    """Scaled to 0 by hand, then `replicas` removed from the spec: the count is the
    Deployment's own, and no apply may start a GPU pod nobody asked for."""
    manifest = example("mixed.yaml")
    manifest["spec"]["mixed"]["replicas"] = 0
    settle(cluster, cluster.create_isvc(manifest))
    cluster.patch_isvc("qwen3-mixed", {"spec": {"mixed": {"replicas": None}}})
    settle(cluster, cluster.isvc("qwen3-mixed"))
    assert replicas_after_an_unrelated_edit(cluster, "qwen3-mixed", "qwen3-mixed-mixed") == 0


def test_removing_autoscaling_keeps_the_autoscalers_count(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    """With `replicas` unset (ignored while autoscaled), the decode pool stays at the count the
    HPA left, through later changes too, instead of dropping to 1 in one apply."""
    settle(cluster, cluster.create_isvc(example("autoscaled-hpa.yaml")))
    cluster.patch(DEPLOYMENT, "llama-hpa-decode", {"spec": {"replicas": 8}}, subresource="scale")
    cluster.patch_isvc("llama-hpa", {"spec": {"autoscaling": None}})
    children = settle(cluster, cluster.isvc("llama-hpa"))
    assert ("HorizontalPodAutoscaler", "llama-hpa-decode") not in children
    assert replicas_after_an_unrelated_edit(cluster, "llama-hpa", "llama-hpa-decode") == 8


def test_status_follows_the_deployments(cluster: Cluster, operator: OperatorProcess) -> None:
    created = cluster.create_isvc(example("mixed.yaml"))
    settle(cluster, created)
    assert cluster.condition("qwen3-mixed", "Ready")["status"] == "False"
    assert cluster.condition("qwen3-mixed", "Progressing")["status"] == "True"

    mark_ready(cluster, "qwen3-mixed-mixed")
    wait_for(
        lambda: cluster.condition("qwen3-mixed", "Ready", role="mixed").get("status") == "True",
        what="the mixed role to be Ready",
    )
    assert cluster.condition("qwen3-mixed", "Ready")["status"] == "False"  # router still pending
    mark_ready(cluster, "qwen3-mixed-router")
    wait_for(
        lambda: cluster.condition("qwen3-mixed", "Ready").get("status") == "True", what="Ready"
    )
    assert cluster.condition("qwen3-mixed", "Progressing")["status"] == "False"
    roles = cluster.isvc("qwen3-mixed")["status"]["roles"]
    assert roles["mixed"]["readyReplicas"] == 2 and roles["router"]["readyReplicas"] == 1

    stuck = {
        "type": "Progressing",
        "status": "False",
        "reason": "ProgressDeadlineExceeded",
        "message": 'ReplicaSet "qwen3-mixed-mixed-5f8" has timed out progressing.',
    }
    mark_ready(cluster, "qwen3-mixed-mixed", ready=1, conditions=[stuck])
    wait_for(
        lambda: cluster.condition("qwen3-mixed", "Degraded").get("status") == "True",
        what="Degraded",
    )
    ready = cluster.condition("qwen3-mixed", "Ready")
    assert ready["status"] == "False" and "mixed: 1/2 ready" in ready["message"]
    assert "timed out" in cluster.condition("qwen3-mixed", "Degraded", role="mixed")["message"]


def test_a_spec_that_cannot_work_is_degraded_with_an_event_and_applies_nothing(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    document = example("disaggregated.yaml")
    del document["spec"]["decode"]
    cluster.create_isvc(document)
    wait_for(
        lambda: cluster.condition("llama-pd", "Degraded").get("reason") == "InvalidSpec",
        what="Degraded InvalidSpec",
    )
    degraded = cluster.condition("llama-pd", "Degraded")
    assert degraded["status"] == "True"
    assert "spec.decode: required when mode is disaggregated" in degraded["message"]
    events = wait_for(
        lambda: [e for e in cluster.events() if e.get("reason") == "InvalidSpec"],
        what="an InvalidSpec event",
    )
    assert "spec.decode" in events[0]["message"]
    assert events[0]["type"] == "Warning"
    assert cluster.children("llama-pd") == {}

    # Fixing the spec applies it.
    cluster.patch_isvc("llama-pd", {"spec": {"decode": {"replicas": 1}}})
    settle(cluster, cluster.isvc("llama-pd"))
    assert cluster.condition("llama-pd", "Degraded")["status"] == "False"


def test_a_hugging_face_branch_is_applied_with_a_warning_event_and_a_commit_without(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    """Each pod downloads `main` as the branch is when it starts: the event says so."""
    document = example("disaggregated.yaml")
    document["spec"]["model"]["huggingFace"]["revision"] = "main"
    created = cluster.create_isvc(document)
    settle(cluster, created)
    events = wait_for(
        lambda: [e for e in cluster.events() if e.get("reason") == "UnpinnedRevision"],
        what="an UnpinnedRevision event",
    )
    assert events[0]["type"] == "Warning"
    assert "revision 'main' is a branch or tag" in events[0]["message"]

    commit = {"spec": {"model": {"huggingFace": {"revision": "a" * 40}}}}
    cluster.patch_isvc("llama-pd", commit)
    settle(cluster, cluster.isvc("llama-pd"))
    download = cluster.get(DEPLOYMENT, "llama-pd-decode")["spec"]["template"]["spec"]
    assert "a" * 40 in download["initContainers"][0]["args"]
    unpinned = [e for e in cluster.events() if e.get("reason") == "UnpinnedRevision"]
    assert len(unpinned) == len(events)  # the commit's apply posted none


def test_an_extended_resource_requested_without_its_limit_is_degraded_with_an_event(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    """The API server refuses such a pod template: the InferenceService names its own field,
    and nothing is applied until the resource is given in the limits."""
    document = example("disaggregated.yaml")
    document["spec"]["decode"]["resources"]["requests"]["rdma/hca"] = 1
    cluster.create_isvc(document)
    degraded = wait_for(
        lambda: (
            (c := cluster.condition("llama-pd", "Degraded")).get("reason") == "InvalidSpec" and c
        ),
        what="Degraded InvalidSpec",
    )
    assert degraded["status"] == "True"
    assert (
        "spec.decode.resources.requests.rdma/hca: rdma/hca is not overcommitted"
        in (degraded["message"])
    )
    events = wait_for(
        lambda: [e for e in cluster.events() if e.get("reason") == "InvalidSpec"],
        what="an InvalidSpec event",
    )
    assert "spec.decode.resources.requests.rdma/hca" in events[0]["message"]
    assert events[0]["type"] == "Warning"
    assert cluster.children("llama-pd") == {}

    cluster.patch_isvc("llama-pd", {"spec": {"decode": {"resources": {"limits": {"rdma/hca": 1}}}}})
    settle(cluster, cluster.isvc("llama-pd"))
    assert cluster.condition("llama-pd", "Degraded")["status"] == "False"


def test_an_invalid_edit_of_a_serving_service_keeps_it_ready_at_its_endpoint(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    """Nothing is applied, so the running pods go on serving: `kubectl wait`, Argo CD and Flux
    must not see the model down because of a typo; Degraded says what is wrong."""
    settle(cluster, cluster.create_isvc(example("mixed.yaml")))
    mark_ready(cluster, "qwen3-mixed-mixed")
    mark_ready(cluster, "qwen3-mixed-router")
    wait_for(
        lambda: cluster.condition("qwen3-mixed", "Ready").get("status") == "True", what="Ready"
    )
    cluster.patch_isvc("qwen3-mixed", {"spec": {"prefill": {"replicas": 1}}})  # mixed mode
    wait_for(
        lambda: cluster.condition("qwen3-mixed", "Degraded").get("reason") == "InvalidSpec",
        what="Degraded InvalidSpec",
    )
    assert cluster.condition("qwen3-mixed", "Ready")["status"] == "True"
    assert cluster.condition("qwen3-mixed", "Progressing")["reason"] == "InvalidSpec"
    assert (
        cluster.isvc("qwen3-mixed")["status"]["endpoint"] == "http://qwen3-mixed.default.svc:8000"
    )


def test_a_child_the_api_server_refuses_degrades_the_service_with_its_message(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    """The spec is valid but a child is not (here a memory request above its limit, which the
    API server checks and the operator does not): the server's message becomes Degraded's,
    with a Warning Event, instead of a retry loop nobody sees; fixing the spec clears it."""
    document = example("disaggregated.yaml")
    document["spec"]["decode"]["resources"]["limits"] = {"memory": "32Gi"}  # requests 64Gi
    cluster.create_isvc(document)
    degraded = wait_for(
        lambda: (
            (c := cluster.condition("llama-pd", "Degraded")).get("reason") == "ApplyFailed" and c
        ),
        what="Degraded ApplyFailed",
    )
    assert degraded["status"] == "True"
    assert "Deployment llama-pd-decode" in degraded["message"]
    assert "must be less than or equal to memory limit" in degraded["message"]
    events = wait_for(
        lambda: [e for e in cluster.events() if e.get("reason") == "ApplyFailed"],
        what="an ApplyFailed event",
    )
    assert events[0]["type"] == "Warning"

    cluster.patch_isvc("llama-pd", {"spec": {"decode": {"resources": {"limits": None}}}})
    settle(cluster, cluster.isvc("llama-pd"))
    assert cluster.condition("llama-pd", "Degraded")["status"] == "False"


def test_a_misspelt_field_passed_on_from_the_spec_is_refused_not_dropped(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    """`affinity` is passed to the pods as given; applied without fieldValidation=Strict, the
    API server dropped `podAntiAfinity` with a warning and the pods ran without it."""
    document = example("disaggregated.yaml")
    document["spec"]["decode"]["affinity"] = {"podAntiAfinity": {}}
    cluster.create_isvc(document)
    degraded = wait_for(
        lambda: (
            (c := cluster.condition("llama-pd", "Degraded")).get("reason") == "ApplyFailed" and c
        ),
        what="Degraded ApplyFailed",
    )
    assert "Deployment llama-pd-decode" in degraded["message"]
    assert "affinity.podAntiAfinity: field not declared in schema" in degraded["message"]


def test_an_object_of_the_same_name_that_is_not_its_own_is_never_taken_over(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    """A user's Service already holds the name a child would take: the operator refuses to
    apply over it (server-side apply with force would merge its selector with ours and make
    it ours, so deleting the InferenceService would delete it), says so in Degraded, and
    leaves it as it was, also when the InferenceService goes."""
    [service_kind] = [kind for kind in CHILD_KINDS if kind.kind == "Service"]
    services = cluster._resource(service_kind)
    theirs = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "qwen3-mixed", "namespace": "default", "labels": {"team": "web"}},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]},
    }
    services.create(body=theirs, namespace="default")
    cluster.create_isvc(example("mixed.yaml"))
    degraded = wait_for(
        lambda: (
            (c := cluster.condition("qwen3-mixed", "Degraded")).get("reason") == "ApplyFailed" and c
        ),
        what="Degraded ApplyFailed",
    )
    assert "Service qwen3-mixed" in degraded["message"] and "not" in degraded["message"]
    service = cluster.get(service_kind, "qwen3-mixed")
    assert service is not None and service["spec"]["selector"] == {"app": "web"}
    assert not service["metadata"].get("ownerReferences")
    cluster.delete_isvc("qwen3-mixed")
    wait_for(lambda: cluster.isvc("qwen3-mixed") is None, what="the InferenceService to go")
    assert cluster.get(service_kind, "qwen3-mixed") is not None


def test_deleting_the_inference_service_removes_its_children(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    created = cluster.create_isvc(example("autoscaled-keda.yaml"))
    settle(cluster, created)
    other = cluster.create_isvc(example("mixed.yaml"))
    settle(cluster, other)
    cluster.delete_isvc("llama-keda")
    wait_for(lambda: cluster.isvc("llama-keda") is None, what="the InferenceService to go")
    wait_for(lambda: cluster.children("llama-keda") == {}, what="its children to go")
    assert set(cluster.children("qwen3-mixed")) == set(rendered(other))


def test_a_restart_changes_nothing(cluster: Cluster, operator: OperatorProcess) -> None:
    created = cluster.create_isvc(example("autoscaled-keda.yaml"))
    settle(cluster, created)
    for role in ("prefill", "decode", "router"):
        mark_ready(cluster, f"llama-keda-{role}")
    wait_for(lambda: cluster.condition("llama-keda", "Ready").get("status") == "True", what="Ready")
    children_before = copy.deepcopy(cluster.children("llama-keda"))
    isvc_before = cluster.isvc("llama-keda")

    operator.stop()
    operator.start()
    wait_for(
        lambda: operator.log().count("Resuming is processed") >= 1,
        timeout=30,
        what="the restarted operator to resume the InferenceService",
    )
    time.sleep(1)  # room for late writes to land

    assert cluster.children("llama-keda") == children_before
    isvc_after = cluster.isvc("llama-keda")
    assert isvc_after["status"] == isvc_before["status"]
    assert isvc_after["metadata"]["generation"] == isvc_before["metadata"]["generation"]
    assert INFERENCE_SERVICE.kind == isvc_after["kind"]


def test_the_inference_services_labels_follow_to_the_children_and_settle(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    document = example("mixed.yaml")
    document["metadata"]["labels"] = {"team": "search", "app.kubernetes.io/managed-by": "Helm"}
    created = cluster.create_isvc(document)
    children = settle(cluster, created)
    for key, child in children.items():
        labels = child["metadata"]["labels"]
        assert labels["team"] == "search", key
        assert labels["app.kubernetes.io/managed-by"] == "kubesgl-operator", key
    time.sleep(2)  # room for re-applies, were the repair handler to see drift
    assert versions(cluster.children("qwen3-mixed")) == versions(children)

    cluster.patch_isvc("qwen3-mixed", {"metadata": {"labels": {"team": None, "tier": "gold"}}})

    def relabelled() -> bool:
        return all(
            "team" not in child["metadata"]["labels"]
            and child["metadata"]["labels"].get("tier") == "gold"
            for child in cluster.children("qwen3-mixed").values()
        )

    wait_for(relabelled, what="the children to carry the new labels")
    # the pod templates did not change: no Deployment's spec did, so no pod restarts
    for key, child in cluster.children("qwen3-mixed").items():
        if child["kind"] == "Deployment":
            assert "team" not in child["spec"]["template"]["metadata"]["labels"], key
            assert child["metadata"]["generation"] == children[key]["metadata"]["generation"], key


def test_network_policies_are_kept_as_rendered_and_go_when_turned_off(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    created = cluster.create_isvc(example("disaggregated.yaml"))
    children = settle(cluster, created)
    policies = sorted(name for kind, name in children if kind == "NetworkPolicy")
    assert policies == ["llama-pd-decode", "llama-pd-prefill", "llama-pd-router"]
    network_policy = kind_of({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy"})
    wanted = rendered(created)[("NetworkPolicy", "llama-pd-prefill")]

    cluster.delete(network_policy, "llama-pd-prefill")
    wait_for(
        lambda: cluster.get(network_policy, "llama-pd-prefill"), what="the policy to come back"
    )
    # a hand edit opening the engines to every pod of the namespace is set back
    cluster.patch(
        network_policy, "llama-pd-decode", {"spec": {"ingress": [{"from": [{"podSelector": {}}]}]}}
    )
    wait_for(
        lambda: (
            not has_drifted(
                rendered(created)[("NetworkPolicy", "llama-pd-decode")],
                cluster.get(network_policy, "llama-pd-decode"),
            )
        ),
        what="the hand-edited policy to be restored",
    )
    assert not has_drifted(wanted, cluster.get(network_policy, "llama-pd-prefill"))

    cluster.patch_isvc("llama-pd", {"spec": {"networkPolicy": {"enabled": False}}})
    children = settle(cluster, cluster.isvc("llama-pd"))
    assert not [key for key in children if key[0] == "NetworkPolicy"]
    assert ("Deployment", "llama-pd-prefill") in children


def test_a_mode_switch_keeps_the_old_pool_until_the_new_one_is_ready(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    created = cluster.create_isvc(example("mixed.yaml"))
    settle(cluster, created)
    for role in ("mixed", "router"):
        mark_ready(cluster, f"qwen3-mixed-{role}")
    pd = {"mode": "disaggregated", "mixed": None, "prefill": {"replicas": 1}, "decode": {}}
    cluster.patch_isvc("qwen3-mixed", {"spec": pd})
    new_pool = [f"qwen3-mixed-{role}" for role in ("prefill", "decode")]
    wait_for(lambda: all(cluster.get(DEPLOYMENT, name) for name in new_pool), what="the new pool")
    time.sleep(1)  # the operator has had its chance to delete the old pool too early
    assert cluster.get(DEPLOYMENT, "qwen3-mixed-mixed") is not None
    mark_ready(cluster, new_pool[0])
    time.sleep(1)
    assert cluster.get(DEPLOYMENT, "qwen3-mixed-mixed") is not None  # decode is not ready yet
    mark_ready(cluster, new_pool[1])
    children = settle(cluster, cluster.isvc("qwen3-mixed"))
    assert not [key for key in children if key[1] == "qwen3-mixed-mixed"]


def start_pod(cluster: Cluster, instance: str, role: str, suffix: str) -> str:
    """Play the ReplicaSet controller: a pod of the role's Deployment, with its template's
    labels; its status is the kubelet's to write (set_pod_status)."""
    deployment = cluster.get(DEPLOYMENT, f"{instance}-{role}")
    assert deployment is not None
    name = f"{instance}-{role}-6d5f7c9b8-{suffix}"
    template = deployment["spec"]["template"]
    labels = {**template["metadata"]["labels"], "pod-template-hash": "6d5f7c9b8"}
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
        "spec": template["spec"],
    }
    cluster._resource(POD).create(body=body, namespace=NAMESPACE)
    return name


def set_pod_status(cluster: Cluster, name: str, containers: list[dict[str, Any]]) -> None:
    """Play the kubelet: the pod is scheduled, its containers as given."""
    status = {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "True"}],
        "containerStatuses": containers,
    }
    cluster.patch(POD, name, {"status": status}, subresource="status")


def test_a_pod_that_cannot_pull_its_image_degrades_the_service_until_it_recovers(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    """The Deployment would say so only after its progress deadline (70 minutes): the pod says
    at once. The reason names the failure, the message the role, the pod and the kubelet's
    words; a Warning Event says the same once; the condition clears when the pod recovers."""
    settle(cluster, cluster.create_isvc(example("mixed.yaml")))
    mark_ready(cluster, "qwen3-mixed-router")
    healthy = start_pod(cluster, "qwen3-mixed", "mixed", "aaaaa")
    failing = start_pod(cluster, "qwen3-mixed", "mixed", "bbbbb")
    loading = {"name": "engine", "ready": False, "restartCount": 0, "state": {"running": {}}}
    set_pod_status(cluster, healthy, [loading])  # loading the model: no failure
    pull_error = 'failed to pull and unpack image "ghcr.io/kubesgl/kubesgl:0.1.0-typo": not found'
    for reason, message in (("ErrImagePull", pull_error), ("ImagePullBackOff", "Back-off")):
        waiting = {"waiting": {"reason": reason, "message": message}}
        set_pod_status(cluster, failing, [{**loading, "state": waiting}])
        if reason == "ErrImagePull":
            degraded = wait_for(
                lambda: (
                    (c := cluster.condition("qwen3-mixed", "Degraded")).get("status") == "True"
                    and c
                ),
                what="Degraded from the pod",
            )
            assert degraded["reason"] == "ImagePullBackOff"
            assert (
                degraded["message"]
                == f"mixed: pod {failing}: container engine: ErrImagePull: {pull_error}"
            )
            role = cluster.condition("qwen3-mixed", "Degraded", role="mixed")
            assert role["reason"] == "ImagePullBackOff"
    wait_for(
        lambda: "Back-off" in cluster.condition("qwen3-mixed", "Degraded")["message"],
        what="the back-off's message",
    )
    events = wait_for(
        lambda: [e for e in cluster.events() if e.get("reason") == "ImagePullBackOff"],
        what="an ImagePullBackOff event",
    )
    assert len(events) == 1, events  # once per change of reason, not per retry
    assert events[0]["type"] == "Warning" and failing in events[0]["message"]
    assert events[0]["involvedObject"]["kind"] == "InferenceService"
    assert cluster.condition("qwen3-mixed", "Progressing")["status"] == "True"

    set_pod_status(cluster, failing, [loading])  # pulled at last: loading
    wait_for(
        lambda: cluster.condition("qwen3-mixed", "Degraded").get("status") == "False",
        what="Degraded to clear",
    )
    assert cluster.condition("qwen3-mixed", "Degraded", role="mixed")["reason"] == "AsExpected"
