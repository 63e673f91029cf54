"""NetworkPolicies: what may reach the instance's pods (docs/operator.md, Security).

One policy per pod role, named and labelled like the role's other objects, each selecting that
role's pods and allowing only:
- router: clients (spec.networkPolicy.clientsFrom, pods or address blocks; none given: any
  source) on the router port;
  with clientsFrom, also the metrics scrapers;
- every engine role: the instance's router pods and the metrics scrapers
  (spec.networkPolicy.metricsFrom) on the engine's HTTP port;
- prefill from decode and decode from prefill, of the same instance, on any port: the bootstrap
  server (a prefill pod's port 8998) and the KV transfer, which NIXL runs over UCX, whose TCP
  transport listens on ephemeral ports chosen at start;
- prefill also from the instance's router pods on the bootstrap port: the router cancels the
  rooms of a prefill request that failed (router/room_cancel.py).
Ingress only: egress (the API server for the router's discovery, model downloads, DNS) is
left open. The kubelet's probes are not subject to NetworkPolicies.
"""

from __future__ import annotations

from kubesgl import contract
from kubesgl.operator import naming
from kubesgl.operator.render.common import Object, metadata
from kubesgl.operator.spec import InferenceService, LabelSelector, NetworkPeer

_PARTNER: dict[contract.EngineRole, contract.EngineRole] = {
    contract.PREFILL: contract.DECODE,
    contract.DECODE: contract.PREFILL,
}


def _tcp(port: int) -> list[Object]:
    return [{"protocol": "TCP", "port": port}]


def _selector(selector: LabelSelector) -> Object:
    # {} selects everything; the API server drops an empty matchLabels, so it is not rendered
    return {"matchLabels": dict(selector.match_labels)} if selector.match_labels else {}


def _peer(peer: NetworkPeer) -> Object:
    rendered: Object = {}
    if peer.ip_block is not None:
        rendered["ipBlock"] = peer.ip_block.model_dump(by_alias=True, exclude_defaults=True)
    if peer.namespace_selector is not None:
        rendered["namespaceSelector"] = _selector(peer.namespace_selector)
    if peer.pod_selector is not None:
        rendered["podSelector"] = _selector(peer.pod_selector)
    return rendered


def _pods_of(isvc: InferenceService, role: contract.PodRole) -> Object:
    """A peer: the instance's pods of one role, in its own namespace."""
    return {"podSelector": {"matchLabels": naming.selector_labels(isvc.metadata.name, role)}}


def _policy(isvc: InferenceService, role: contract.PodRole, ingress: list[Object]) -> Object:
    instance = isvc.metadata.name
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(isvc, naming.role_object_name(instance, role), role),
        "spec": {
            "podSelector": {"matchLabels": naming.selector_labels(instance, role)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def router_network_policy(isvc: InferenceService) -> Object:
    settings = isvc.spec.network_policy
    rule: Object = {"ports": _tcp(contract.ROUTER_PORT)}
    if settings.clients_from:  # otherwise no `from`: any source
        rule["from"] = [_peer(peer) for peer in (*settings.clients_from, *settings.metrics_from)]
    return _policy(isvc, contract.ROUTER, [rule])


def engine_network_policy(isvc: InferenceService, role: contract.EngineRole) -> Object:
    settings = isvc.spec.network_policy
    http_from = [_pods_of(isvc, contract.ROUTER), *(_peer(peer) for peer in settings.metrics_from)]
    ingress: list[Object] = [{"from": http_from, "ports": _tcp(contract.ENGINE_PORT)}]
    if role == contract.PREFILL:
        router = [_pods_of(isvc, contract.ROUTER)]
        ingress.append({"from": router, "ports": _tcp(contract.BOOTSTRAP_PORT)})
    if role in _PARTNER:
        # no ports: every port and protocol (the bootstrap port and UCX's)
        ingress.append({"from": [_pods_of(isvc, _PARTNER[role])]})
    return _policy(isvc, role, ingress)


def network_policies(isvc: InferenceService) -> list[Object]:
    if not isvc.spec.network_policy.enabled:
        return []
    roles = isvc.spec.engine_roles()
    return [*(engine_network_policy(isvc, role) for role in roles), router_network_policy(isvc)]
