"""How fast the operator reacts: apply -> all children present, apply -> status written, and
Deployments ready -> status Ready, against the Kubernetes API emulator on loopback.

    python benchmarks/operator/bench_operator.py --count 20 --burst 20 \
        --output benchmarks/operator/results.json

The real operator (`python -m kubesgl operator`) runs in a subprocess; this script plays
kubectl and the Deployment controller through the kubernetes client and polls the emulator's
memory every 10 ms.
Needs the `test` extra (kmock) and the repository's tests/ (the emulator lives there).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import kmock
import yaml
from kubernetes.dynamic import DynamicClient

from kubesgl.operator.kube import CHILD_KINDS, DEPLOYMENT, INFERENCE_SERVICE, Kind, kind_of
from kubesgl.operator.render import render
from kubesgl.operator.validation import parse_inference_service

REPO = Path(__file__).resolve().parents[2]
# The emulator is the operator tests' own, not part of the package.
sys.path.insert(0, str(REPO / "tests" / "integration" / "operator"))
from fake_api_server import running_api_server  # noqa: E402

POLL_SECONDS = 0.01


class Bench:
    """Writes through the kubernetes client; reads the emulator's memory directly, so that
    polling does not load the API server being measured."""

    def __init__(self, client: DynamicClient, api: Any, namespace: str = "default"):
        self.client = client
        self.api = api
        self.namespace = namespace
        self.resources = {
            kind.kind: client.resources.get(api_version=kind.api_version, kind=kind.kind)
            for kind in (*CHILD_KINDS, INFERENCE_SERVICE)
        }

    def create(self, document: dict[str, Any]) -> dict[str, Any]:
        isvcs = self.resources[INFERENCE_SERVICE.kind]
        return isvcs.create(body=document, namespace=self.namespace).to_dict()

    def _live(self, kind: Kind, name: str) -> dict[str, Any] | None:
        key = (kmock.resource(kind.group, kind.version, kind.plural), self.namespace, name)
        if key not in self.api.objects or self.api.objects[key].deleted:
            return None
        return self.api.objects[key].raw

    def children_present(self, expected: dict[tuple[Kind, str], None]) -> bool:
        return all(self._live(kind, name) is not None for kind, name in expected)

    def status_of(self, name: str) -> dict[str, Any]:
        return (self._live(INFERENCE_SERVICE, name) or {}).get("status") or {}

    def mark_ready(self, deployment_name: str) -> None:
        deployments = self.resources[DEPLOYMENT.kind]
        deployment = deployments.get(name=deployment_name, namespace=self.namespace).to_dict()
        replicas = deployment["spec"].get("replicas", 1)
        status = {
            "observedGeneration": deployment["metadata"]["generation"],
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": replicas,
            "availableReplicas": replicas,
        }
        deployments.status.patch(
            name=deployment_name,
            namespace=self.namespace,
            body={"status": status},
            content_type="application/merge-patch+json",
        )


def wait(check, timeout: float = 60.0) -> float:
    start = time.perf_counter()
    while not check():
        if time.perf_counter() - start > timeout:
            raise TimeoutError("the operator did not get there in time")
        time.sleep(POLL_SECONDS)
    return time.perf_counter()


def expected_children(created: list[dict[str, Any]]) -> dict[tuple[Kind, str], None]:
    return {
        (kind_of(obj), obj["metadata"]["name"]): None
        for document in created
        for obj in render(parse_inference_service(document))
    }


def is_ready(status: dict[str, Any]) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or []
    )


def summary(values_ms: list[float]) -> dict[str, float]:
    ordered = sorted(values_ms)
    return {
        "p50": round(statistics.median(ordered), 1),
        "p90": round(ordered[max(0, int(0.9 * len(ordered)) - 1)], 1),
        "max": round(ordered[-1], 1),
    }


def run(count: int, burst: int) -> dict[str, Any]:
    template = yaml.safe_load((REPO / "examples" / "disaggregated.yaml").read_text())
    with running_api_server() as server, tempfile.TemporaryDirectory() as scratch:
        kubeconfig = server.write_kubeconfig(Path(scratch) / "kubeconfig")
        log = open(Path(scratch) / "operator.log", "wb")
        operator = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kubesgl",
                "operator",
                "--liveness-port",
                "0",
                "--log-level",
                "warning",
            ],
            env=dict(os.environ, KUBECONFIG=str(kubeconfig)),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            bench = Bench(DynamicClient(server.client()), server.api)
            time.sleep(3)  # let the operator finish starting; startup is not what is measured
            to_children, to_status, ready_to_status = [], [], []
            for index in range(count):
                document = copy.deepcopy(template)
                document["metadata"]["name"] = name = f"seq-{index}"
                start = time.perf_counter()
                created = bench.create(document)
                expected = expected_children([created])
                to_children.append(
                    (wait(lambda expected=expected: bench.children_present(expected)) - start) * 1e3
                )
                to_status.append(
                    (
                        wait(lambda name=name: bench.status_of(name).get("observedGeneration") == 1)
                        - start
                    )
                    * 1e3
                )
                start = time.perf_counter()
                for role in ("prefill", "decode", "router"):
                    bench.mark_ready(f"{name}-{role}")
                ready_to_status.append(
                    (wait(lambda name=name: is_ready(bench.status_of(name))) - start) * 1e3
                )

            documents = []
            for index in range(burst):
                document = copy.deepcopy(template)
                document["metadata"]["name"] = f"burst-{index}"
                documents.append(document)
            start = time.perf_counter()
            created = [bench.create(document) for document in documents]
            expected = expected_children(created)
            burst_children = (
                wait(lambda expected=expected: bench.children_present(expected)) - start
            )
            burst_status = (
                wait(
                    lambda: all(
                        bench.status_of(d["metadata"]["name"]).get("observedGeneration") == 1
                        for d in documents
                    )
                )
                - start
            )
        finally:
            operator.terminate()
            operator.wait(timeout=30)
            log.close()
    children_per_isvc = len(render(parse_inference_service(created[0])))
    return {
        "command": "python benchmarks/operator/bench_operator.py " + " ".join(sys.argv[1:]),
        "setup": "kubesgl operator (kopf) in a subprocess against the kmock-based API "
        "emulator of tests/integration/operator/fake_api_server.py on loopback, in this "
        "process; reads poll the emulator's memory every 10 ms",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "example": "examples/disaggregated.yaml",
        "children_per_inference_service": children_per_isvc,
        "sequential": {
            "count": count,
            "apply_to_children_ms": summary(to_children),
            "apply_to_status_ms": summary(to_status),
            "deployments_ready_to_status_ready_ms": summary(ready_to_status),
        },
        "burst": {
            "count": burst,
            "apply_to_all_children_ms": round(burst_children * 1e3, 1),
            "apply_to_all_status_ms": round(burst_status * 1e3, 1),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--count", type=int, default=20, help="InferenceServices applied one after another"
    )
    parser.add_argument("--burst", type=int, default=20, help="InferenceServices applied at once")
    parser.add_argument("--output", type=Path, help="write the results here as JSON")
    args = parser.parse_args()
    results = run(args.count, args.burst)
    text = json.dumps(results, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
