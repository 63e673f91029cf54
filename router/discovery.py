"""Kubernetes pod discovery: engine pods matching label selectors join the pool while ready.

A pod's role comes from its `kubesgl.io/role` label (prefill, decode or mixed; other roles,
such as the router's own pods, are ignored) and a prefill pod's bootstrap port from its
`kubesgl.io/bootstrap-port` annotation, or SGLang's `sglang.ai/bootstrap-port`
(docs/architecture.md, Kubernetes objects). The watcher lists
the pods, then follows a watch from that list's resource version; whenever the watch ends
or fails it lists again, so the pool converges on the cluster's state.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from dataclasses import dataclass
from typing import Any

import aiohttp

from kubesgl import contract
from kubesgl.router.workers import DISCOVERED, Role, WorkerRegistry

log = logging.getLogger("kubesgl.router")

# kubesgl's own first; SGLang's lets the router take prefill pods deployed for SGLang's router
BOOTSTRAP_PORT_ANNOTATIONS = (
    contract.BOOTSTRAP_PORT_ANNOTATION,
    contract.SGLANG_BOOTSTRAP_PORT_ANNOTATION,
)
WATCH_TIMEOUT_S = 300  # the API server ends each watch after this; the watcher lists again


def parse_selector(items: list[str]) -> dict[str, str]:
    """["a=b,c=d", "e==f"] -> {"a": "b", "c": "d", "e": "f"}: the equality selectors of
    --kube-selector, comma-separated and with = or == as kubectl takes them. ValueError for anything else: pods
    are checked again against this dict, so a term it misread would drop every pod."""
    selector: dict[str, str] = {}
    for item in items:
        for term in item.split(","):
            equals = "==" if "==" in term else "="  # kubectl takes both
            key, sep, value = (part.strip() for part in term.partition(equals))
            problem: str | None
            if "!=" in term or "(" in term:
                problem = "only equality selectors are taken (KEY=VALUE), not !=, in or notin"
            elif not sep:
                problem = "not KEY=VALUE (only equality selectors are taken)"
            elif selector.get(key, value) != value:  # the API server would match no pod
                problem = f"the key {key!r} is given twice, also with {selector[key]!r}"
            else:
                problem = contract.label_key_problem(key) or contract.label_value_problem(value)
            if problem:
                raise ValueError(f"--kube-selector {item!r}: {problem}")
            selector[key] = value
    return selector


@dataclass(frozen=True)
class PodWorker:
    url: str
    role: Role
    bootstrap_port: int | None


def _pod_port(pod: dict[str, Any], default_port: int) -> int:
    for container in pod.get("spec", {}).get("containers", []):
        for port in container.get("ports", []) or []:
            if port.get("name") == "http" and isinstance(port.get("containerPort"), int):
                return port["containerPort"]
    return default_port


def _is_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status", {})
    if pod.get("metadata", {}).get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions", []) or []
    )


def worker_from_pod(
    pod: dict[str, Any], selector: dict[str, str], default_port: int
) -> PodWorker | None:
    """The worker a pod stands for, or None while it should not receive requests."""
    meta = pod.get("metadata", {})
    labels = meta.get("labels", {}) or {}
    # The API server filters by labelSelector already; checking again costs nothing.
    if any(labels.get(k) != v for k, v in selector.items()):
        return None
    try:
        role = Role(labels.get(contract.ROLE_LABEL, Role.MIXED.value))
    except ValueError:
        return None  # a router pod, or a role this router does not route to
    ip = pod.get("status", {}).get("podIP")
    if not ip or not _is_ready(pod):
        return None
    bootstrap_port = None
    if role is Role.PREFILL:
        annotations = meta.get("annotations", {}) or {}
        key = next((key for key in BOOTSTRAP_PORT_ANNOTATIONS if annotations.get(key)), None)
        try:
            bootstrap_port = int(annotations[key]) if key else contract.BOOTSTRAP_PORT
        except ValueError:
            log.warning("pod %s: bad %s annotation %r", meta.get("name"), key, annotations[key])
            return None
    return PodWorker(contract.http_url(ip, _pod_port(pod, default_port)), role, bootstrap_port)


@dataclass(frozen=True)
class KubeConnection:
    base_url: str
    headers: dict[str, str]
    ssl: ssl.SSLContext | bool  # False: no certificate check (kubeconfig insecure-skip-tls-verify)


def load_kube_connection() -> KubeConnection:
    """The in-cluster service account, else the kubeconfig ($KUBECONFIG or ~/.kube/config)."""
    from kubernetes import client, config  # imported here: only discovery needs it

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        # $KUBECONFIG is read now: the kubernetes package reads it once, at import.
        config.load_kube_config(
            config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration
        )
    if configuration.refresh_api_key_hook is not None:
        configuration.refresh_api_key_hook(configuration)  # reads a rotated token anew
    headers = {}
    token = configuration.api_key.get("authorization") or configuration.api_key.get("BearerToken")
    if token:
        prefix = configuration.api_key_prefix.get("authorization", "")
        headers["Authorization"] = f"{prefix} {token}".strip()
    context: ssl.SSLContext | bool = False
    if configuration.verify_ssl:
        context = ssl.create_default_context(cafile=configuration.ssl_ca_cert or None)
        if configuration.cert_file and configuration.key_file:
            context.load_cert_chain(configuration.cert_file, configuration.key_file)
    return KubeConnection(configuration.host.rstrip("/"), headers, context)


class PodWatcher:
    def __init__(
        self,
        workers: WorkerRegistry,
        namespace: str,
        selector: dict[str, str],
        worker_port: int = contract.ENGINE_PORT,
        retry_delay_s: float = 2.0,
    ) -> None:
        self.workers = workers
        self.namespace = namespace
        self.selector = selector
        self.worker_port = worker_port
        self.retry_delay_s = retry_delay_s
        self._pods: dict[str, PodWorker] = {}  # pod name -> the worker it registered

    @property
    def _label_selector(self) -> str:
        return ",".join(f"{k}={v}" for k, v in sorted(self.selector.items()))

    async def run(self) -> None:
        while True:
            try:
                connection = load_kube_connection()
                async with aiohttp.ClientSession(
                    base_url=connection.base_url + "/",
                    headers=connection.headers,
                    connector=aiohttp.TCPConnector(ssl=connection.ssl),
                    timeout=aiohttp.ClientTimeout(
                        total=None, connect=10, sock_read=WATCH_TIMEOUT_S + 30
                    ),
                ) as session:
                    version = await self._list(session)
                    await self._watch(session, version)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the API server is down, a token expired, ...: list again
                log.warning("pod discovery: %s; listing again in %.0fs", exc, self.retry_delay_s)
            await asyncio.sleep(self.retry_delay_s)

    @property
    def _pods_path(self) -> str:
        return f"api/v1/namespaces/{self.namespace}/pods"

    async def _list(self, session: aiohttp.ClientSession) -> str:
        params = {"labelSelector": self._label_selector}
        async with session.get(self._pods_path, params=params, raise_for_status=True) as response:
            pod_list = await response.json()
        seen = set()
        for pod in pod_list.get("items", []):
            name = pod["metadata"]["name"]
            seen.add(name)
            self._apply(name, pod)
        for name in set(self._pods) - seen:
            self._apply(name, None)
        return pod_list.get("metadata", {}).get("resourceVersion", "")

    async def _watch(self, session: aiohttp.ClientSession, version: str) -> None:
        params = {
            "labelSelector": self._label_selector,
            "watch": "true",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_TIMEOUT_S),
        }
        if version:
            params["resourceVersion"] = version
        async with session.get(self._pods_path, params=params, raise_for_status=True) as response:
            pending = b""
            # One JSON event per line; lines are split here, as pods can exceed a reader's line limit.
            async for chunk in response.content.iter_any():
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if line.strip():
                        self._on_event(json.loads(line))

    def _on_event(self, event: dict[str, Any]) -> None:
        kind, pod = event.get("type"), event.get("object", {})
        if kind == "ERROR":  # e.g. 410 Gone: the resource version is too old
            raise RuntimeError(f"watch error: {pod.get('message', pod)}")
        if kind in ("ADDED", "MODIFIED"):
            self._apply(pod["metadata"]["name"], pod)
        elif kind == "DELETED":
            self._apply(pod["metadata"]["name"], None)

    def _apply(self, name: str, pod: dict[str, Any] | None) -> None:
        """Brings the pool in line with one pod's state (None: the pod is gone)."""
        wanted = worker_from_pod(pod, self.selector, self.worker_port) if pod else None
        current = self._pods.get(name)
        if wanted == current:
            return
        if current is not None:
            self.workers.remove(current.url, pod=name)
            del self._pods[name]
        if wanted is not None:
            try:
                self.workers.add(
                    wanted.url, wanted.role, wanted.bootstrap_port, source=DISCOVERED, pod=name
                )
            except ValueError as exc:  # a link-local pod IP: this pod stays out, the others come in
                log.warning("pod %s is not a worker: %s", name, exc)
                return
            self._pods[name] = wanted
