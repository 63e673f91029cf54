"""A small Kubernetes API surface over the official client: server-side apply, list, delete and
status patches for the fixed set of kinds the operator manages.

The kinds are known in advance, so their URL paths come from a table rather than discovery.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException

from kubesgl import contract
from kubesgl.operator import naming
from kubesgl.operator.spec import API_GROUP, API_VERSION, KIND, PLURAL

Object = dict[str, Any]


@dataclass(frozen=True)
class Kind:
    api_version: str  # "v1", "apps/v1", ...
    kind: str
    plural: str
    # served only where an add-on is installed (KEDA, prometheus-operator): a 404 on apply
    # means the cluster lacks the API, not the object
    optional: bool = False
    # scales a Deployment: deleted before a new one is applied (reconcile.apply_children)
    autoscaler: bool = False

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        root = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        path = f"{root}/namespaces/{namespace}/{self.plural}"
        if name is not None:
            path += f"/{name}"
        if subresource is not None:
            path += f"/{subresource}"
        return path


INFERENCE_SERVICE = Kind(f"{API_GROUP}/{API_VERSION}", KIND, PLURAL)
DEPLOYMENT = Kind("apps/v1", "Deployment", "deployments")
# In teardown order (reconcile.delete_children): autoscalers first so that nothing scales a
# role being removed, the Deployments before the Services that reach their pods, the
# NetworkPolicies once no pods are meant to run, the router's RBAC last.
CHILD_KINDS: tuple[Kind, ...] = (
    Kind("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers", autoscaler=True),
    Kind("keda.sh/v1alpha1", "ScaledObject", "scaledobjects", optional=True, autoscaler=True),
    Kind("monitoring.coreos.com/v1", "PodMonitor", "podmonitors", optional=True),
    DEPLOYMENT,
    Kind("v1", "Service", "services"),
    Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
    Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
    Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
    Kind("rbac.authorization.k8s.io/v1", "Role", "roles"),
    Kind("v1", "ServiceAccount", "serviceaccounts"),
)
_BY_KIND = {kind.kind: kind for kind in CHILD_KINDS}


def kind_of(obj: Mapping[str, Any]) -> Kind:
    kind = _BY_KIND.get(obj["kind"])
    if kind is None or kind.api_version != obj["apiVersion"]:
        raise KeyError(f"{obj['apiVersion']} {obj['kind']} is not a kind the operator manages")
    return kind


def deletion_rank(obj: Mapping[str, Any]) -> int:
    """Where a child's kind comes in a teardown: its place in CHILD_KINDS."""
    return CHILD_KINDS.index(kind_of(obj))


class MissingApi(RuntimeError):
    """The cluster does not serve a kind the spec needs (e.g. KEDA is not installed)."""


class ApplyRejected(RuntimeError):
    """The API server refused a child as rendered (an object-count quota, an admission webhook,
    a value it validates that the operator does not): the message is the server's."""


class NoCluster(RuntimeError):
    """No Kubernetes API to talk to; the message says what was tried."""


def load_credentials() -> None:
    """In-cluster credentials inside a pod, otherwise the kubeconfig (KUBECONFIG or ~/.kube/config)."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException as not_in_pod:
        try:
            kubernetes.config.load_kube_config()
        except kubernetes.config.ConfigException as no_kubeconfig:
            path = os.environ.get("KUBECONFIG", kubernetes.config.KUBE_CONFIG_DEFAULT_LOCATION)
            raise NoCluster(
                f"tried in-cluster credentials ({not_in_pod}) and the kubeconfig {path} "
                f"({no_kubeconfig})"
            ) from None


def check_reachable(timeout_s: float = 5.0) -> None:
    """One GET /version to the API server of the loaded credentials, not retried; raises NoCluster
    when nothing answers. Any HTTP answer, an error status too, means a server is there."""
    configuration = kubernetes.client.Configuration.get_default_copy()
    configuration.retries = False
    client = kubernetes.client.ApiClient(configuration)
    try:
        client.call_api(*client.param_serialize("GET", "/version"), _request_timeout=timeout_s)
        return
    except urllib3.exceptions.HTTPError as error:
        reason = str(error.__cause__ or error)
    except ApiException as error:
        if error.status:
            return
        reason = str(error.reason)  # status 0: the client's own failure, a TLS error for example
    reason = " ".join(reason.split())  # one line
    raise NoCluster(f"tried the Kubernetes API at {configuration.host}: {reason}")


def _message(error: ApiException) -> str:
    """The API server's own message (its Status body), else the HTTP reason."""
    try:
        return str(json.loads(error.body or "")["message"])
    except (TypeError, ValueError, KeyError):
        return f"{error.status} {error.reason}"


class KubeApi:
    def __init__(self, client: kubernetes.client.ApiClient):
        self._client = client

    @classmethod
    def from_environment(cls) -> KubeApi:
        load_credentials()
        return cls(kubernetes.client.ApiClient())

    def _call(
        self,
        method: str,
        path: str,
        body: Object | None = None,
        query: Iterable[tuple[str, str]] = (),
        content_type: str = "application/json",
    ) -> Object:
        request = self._client.param_serialize(
            method,
            path,
            query_params=list(query),
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self._client.call_api(*request)
        data = response.read()
        if not 200 <= response.status <= 299:
            raise ApiException.from_response(
                http_resp=response, body=data.decode(errors="replace"), data=None
            )
        return json.loads(data) if data else {}

    def apply(self, obj: Object, manager: str = naming.MANAGER, force: bool = True) -> Object:
        """Server-side apply as `manager` (the operator's by default), taking over conflicting
        fields when `force`; without it, a conflict raises ApiException 409."""
        kind = kind_of(obj)
        meta = obj["metadata"]
        path = kind.path(meta["namespace"], meta["name"])
        # Strict: a field the API server does not know (a misspelt key in an affinity or an
        # env's valueFrom, passed on as the spec gives them) fails the apply instead of being
        # dropped with a warning nobody reads
        query = [
            ("fieldManager", manager),
            ("force", str(force).lower()),
            ("fieldValidation", "Strict"),
        ]
        try:
            return self._call("PATCH", path, obj, query, "application/apply-patch+yaml")
        except ApiException as error:
            if error.status == 404 and kind.optional:
                raise MissingApi(
                    f"the cluster does not serve {kind.api_version} {kind.kind};"
                    " install its CRDs or change the spec"
                ) from None
            if error.status in (400, 403, 422):  # this object, as it is, will not be taken
                raise ApplyRejected(
                    f"the API server refused {kind.kind} {meta['name']}: {_message(error)}"
                ) from None
            raise

    def get(self, kind: Kind, namespace: str, name: str) -> Object | None:
        try:
            return self._call("GET", kind.path(namespace, name))
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def list_children(self, kind: Kind, namespace: str, instance: str) -> list[Object]:
        """Objects of one kind that this operator made for an instance; [] if the kind is absent."""
        selector = (
            f"{contract.INSTANCE_LABEL}={instance},{contract.MANAGED_BY_LABEL}={naming.MANAGER}"
        )
        try:
            listing = self._call("GET", kind.path(namespace), query=[("labelSelector", selector)])
        except ApiException as error:
            if error.status == 404:
                return []
            raise
        items = listing.get("items", [])
        # List responses leave kind and apiVersion out of their items.
        return [{"apiVersion": kind.api_version, "kind": kind.kind, **item} for item in items]

    def delete(self, kind: Kind, namespace: str, name: str) -> None:
        try:
            path = kind.path(namespace, name)
            self._call("DELETE", path, query=[("propagationPolicy", "Background")])
        except ApiException as error:
            if error.status != 404:
                raise

    def patch_status(self, namespace: str, name: str, status: Object) -> None:
        path = INFERENCE_SERVICE.path(namespace, name, "status")
        self._call("PATCH", path, {"status": status}, content_type="application/merge-patch+json")
