"""The order in which apply_children talks to the API server, against a recording fake."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from kubesgl.operator.kube import Kind
from kubesgl.operator.reconcile import apply_children, delete_children, prune_retired
from kubesgl.operator.validation import parse_inference_service

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
UID = "uid-1"


class RecordingApi:
    """Holds objects by (kind, name) and records every write."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str, str]] = []

    def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((kind.kind, name))

    def list_children(self, kind: Kind, namespace: str, instance: str) -> list[dict[str, Any]]:
        return [obj for (k, _), obj in self.objects.items() if k == kind.kind]

    def apply(self, obj: dict[str, Any], manager: str = "", force: bool = True) -> dict[str, Any]:
        self.calls.append(("apply", obj["kind"], obj["metadata"]["name"]))
        live = copy.deepcopy(obj)
        live["metadata"]["ownerReferences"] = [{"uid": UID}]
        self.objects[(obj["kind"], obj["metadata"]["name"])] = live
        return live

    def delete(self, kind: Kind, namespace: str, name: str) -> None:
        self.calls.append(("delete", kind.kind, name))
        self.objects.pop((kind.kind, name), None)


def isvc(provider: str):
    document = yaml.safe_load((EXAMPLES / "autoscaled-keda.yaml").read_text())
    document["metadata"]["uid"] = UID
    if provider == "hpa":
        document["spec"]["autoscaling"] = yaml.safe_load(
            (EXAMPLES / "autoscaled-hpa.yaml").read_text()
        )["spec"]["autoscaling"]
    return parse_inference_service(document)


def test_switching_autoscaler_removes_the_old_one_before_the_new_one_is_applied():
    """KEDA's admission webhook refuses a ScaledObject whose Deployment an HPA still scales:
    applying first and pruning after would be refused on every retry."""
    api = RecordingApi()
    apply_children(api, isvc("hpa"))  # type: ignore[arg-type]
    hpas = [name for (kind, name) in api.objects if kind == "HorizontalPodAutoscaler"]
    assert hpas
    api.calls.clear()
    apply_children(api, isvc("keda"))  # type: ignore[arg-type]
    first_scaled_object = next(
        i for i, call in enumerate(api.calls) if call[:2] == ("apply", "ScaledObject")
    )
    deleted = {name for op, kind, name in api.calls[:first_scaled_object] if op == "delete"}
    assert set(hpas) <= deleted, api.calls


def _example(mode: str = "disaggregated"):
    document = yaml.safe_load((EXAMPLES / "disaggregated.yaml").read_text())
    document["metadata"]["uid"] = UID
    if mode == "mixed":
        document["spec"]["mode"] = "mixed"
        document["spec"]["mixed"] = document["spec"].pop("prefill")
        del document["spec"]["decode"]
    return parse_inference_service(document)


def _ready(api: RecordingApi) -> None:
    """Every Deployment has rolled out: its replicas all run the current spec and are ready."""
    for (kind, _), obj in api.objects.items():
        if kind == "Deployment":
            replicas = obj["spec"].get("replicas", 1)
            obj["metadata"]["generation"] = 1
            obj["status"] = {
                "observedGeneration": 1,
                "replicas": replicas,
                "updatedReplicas": replicas,
                "readyReplicas": replicas,
            }


def test_a_mode_switch_keeps_the_old_pool_serving_until_the_new_one_is_ready():
    """Mixed to disaggregated: the mixed Deployment and Service go only once the prefill,
    decode and router Deployments have rolled out (they were deleted in the pass that created
    the new pool, and nothing served until its pods had loaded the model)."""
    api = RecordingApi()
    apply_children(api, _example("mixed"))  # type: ignore[arg-type]
    _ready(api)
    mixed = {key for key in api.objects if key[1].endswith("-mixed")}
    assert ("Deployment", "llama-pd-mixed") in mixed and ("Service", "llama-pd-mixed") in mixed

    disaggregated = _example()
    applied = apply_children(api, disaggregated)  # type: ignore[arg-type]
    assert applied.retiring == ("mixed",)
    assert mixed <= set(api.objects)  # still serving
    assert prune_retired(api, disaggregated) == ("mixed",)  # type: ignore[arg-type]
    assert mixed <= set(api.objects)

    decode = api.objects.pop(("Deployment", "llama-pd-decode"))
    _ready(api)  # ready, but the decode Deployment is gone (deleted, its restore refused)
    assert prune_retired(api, disaggregated) == ("mixed",)  # type: ignore[arg-type]
    api.objects[("Deployment", "llama-pd-decode")] = decode
    _ready(api)  # the prefill, decode and router pods are ready
    assert prune_retired(api, disaggregated) == ()  # type: ignore[arg-type]
    assert not mixed & set(api.objects)
    deleted = [call for call in api.calls if call[0] == "delete"]
    assert [kind for _, kind, _ in deleted].index("Deployment") < [
        kind for _, kind, _ in deleted
    ].index("Service")  # the pods go before the Service that reaches them


def test_what_is_left_of_a_retired_role_goes_once_the_new_one_is_ready():
    """The old pool's Deployment went, its Service did not (a delete that failed): the
    Service is still the retired role's, deleted at the next check."""
    api = RecordingApi()
    apply_children(api, _example("mixed"))  # type: ignore[arg-type]
    disaggregated = _example()
    apply_children(api, disaggregated)  # type: ignore[arg-type]
    del api.objects[("Deployment", "llama-pd-mixed")]
    assert prune_retired(api, disaggregated) == ("mixed",)  # type: ignore[arg-type]
    _ready(api)
    assert prune_retired(api, disaggregated) == ()  # type: ignore[arg-type]
    assert ("Service", "llama-pd-mixed") not in api.objects


def test_a_teardown_deletes_autoscalers_first_the_router_before_the_engines_rbac_last():
    api = RecordingApi()
    apply_children(api, isvc("hpa"))  # type: ignore[arg-type]
    count = delete_children(api, "default", "llama-keda", UID)  # type: ignore[arg-type]
    deleted = [(kind, name) for op, kind, name in api.calls if op == "delete"]
    assert count == len(deleted) and not api.objects
    kinds = [kind for kind, _ in deleted]
    assert kinds[:2] == ["HorizontalPodAutoscaler"] * 2
    deployments = [name for kind, name in deleted if kind == "Deployment"]
    assert deployments[0].endswith("-router") and len(deployments) == 3
    assert kinds.index("Deployment") < kinds.index("Service")
    assert kinds[-3:] == ["RoleBinding", "Role", "ServiceAccount"]
