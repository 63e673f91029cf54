"""Harness for the operator tests: the real operator (`python -m kubesgl operator`, kopf and
the kubernetes client) in a subprocess, against the Kubernetes API emulator on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from fake_api_server import RunningApiServer
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError

from kubesgl.operator.kube import CHILD_KINDS, INFERENCE_SERVICE, Kind

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "examples"
NAMESPACE = "default"
T = TypeVar("T")


def wait_for(check: Callable[[], T], timeout: float = 15.0, what: str = "condition") -> T:
    """Poll until check() returns something truthy; fail with `what` after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


class Cluster:
    """Reads and writes through the kubernetes client, as kubectl or a controller would."""

    def __init__(self, server: RunningApiServer):
        self.server = server
        self.client = DynamicClient(server.client())

    def _resource(self, kind: Kind) -> Any:
        return self.client.resources.get(api_version=kind.api_version, kind=kind.kind)

    def create_isvc(self, document: dict[str, Any]) -> dict[str, Any]:
        created = self._resource(INFERENCE_SERVICE).create(body=document, namespace=NAMESPACE)
        return created.to_dict()

    def isvc(self, name: str) -> dict[str, Any] | None:
        return self.get(INFERENCE_SERVICE, name)

    def patch_isvc(self, name: str, patch: dict[str, Any]) -> None:
        self._resource(INFERENCE_SERVICE).patch(
            name=name,
            namespace=NAMESPACE,
            body=patch,
            content_type="application/merge-patch+json",
        )

    def delete_isvc(self, name: str) -> None:
        self._resource(INFERENCE_SERVICE).delete(name=name, namespace=NAMESPACE)

    def get(self, kind: Kind, name: str) -> dict[str, Any] | None:
        try:
            return self._resource(kind).get(name=name, namespace=NAMESPACE).to_dict()
        except NotFoundError:
            return None

    def patch(
        self, kind: Kind, name: str, patch: dict[str, Any], subresource: str | None = None
    ) -> None:
        resource = self._resource(kind)
        if subresource is not None:
            resource = resource.subresources[subresource]
        resource.patch(
            name=name, namespace=NAMESPACE, body=patch, content_type="application/merge-patch+json"
        )

    def delete(self, kind: Kind, name: str) -> None:
        self._resource(kind).delete(name=name, namespace=NAMESPACE)

    def children(self, instance: str) -> dict[tuple[str, str], dict[str, Any]]:
        """Every object labelled as a child of the instance, by (kind, name)."""
        found = {}
        for kind in CHILD_KINDS:
            listing = self._resource(kind).get(
                namespace=NAMESPACE, label_selector=f"app.kubernetes.io/instance={instance}"
            )
            for item in listing.to_dict()["items"]:
                found[(kind.kind, item["metadata"]["name"])] = item
        return found

    def events(self) -> list[dict[str, Any]]:
        events = self.client.resources.get(api_version="v1", kind="Event")
        return events.get(namespace=NAMESPACE).to_dict()["items"]

    def condition(self, name: str, kind: str, role: str | None = None) -> dict[str, Any]:
        status = (self.isvc(name) or {}).get("status") or {}
        if role is not None:
            status = (status.get("roles") or {}).get(role) or {}
        for condition in status.get("conditions") or []:
            if condition["type"] == kind:
                return condition
        return {}


class OperatorProcess:
    def __init__(self, kubeconfig: Path, log_path: Path):
        self.kubeconfig = kubeconfig
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig))
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kubesgl", "operator", "--liveness-port", "0"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")
