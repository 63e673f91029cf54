"""Kubernetes pod discovery against kmock's stateful Kubernetes API emulator.

Pods are created, patched and deleted with the official `kubernetes` client, the router
reads the same emulator through the kubeconfig in $KUBECONFIG. The emulator ignores label
selectors, so these tests also show that the router filters pods by their labels itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import kmock
import pytest
import pytest_asyncio
import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from kubesgl.router.config import KubeDiscoverySettings

pytestmark = pytest.mark.asyncio

NAMESPACE = "serving"
INSTANCE = {"app.kubernetes.io/name": "kubesgl", "app.kubernetes.io/instance": "demo"}


@pytest_asyncio.fixture
async def core_api(tmp_path, monkeypatch) -> AsyncIterator[k8s.CoreV1Api]:
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        emulator.resources["v1/pods"] = kmock.ResourceInfo(
            namespaced=True, kind="Pod", singular="pod"
        )
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": str(server.url).rstrip("/")}}],
            "users": [{"name": "tester", "user": {"token": "test-token"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}],
        }))  # fmt: skip
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        api_client = k8s_config.new_client_from_config(str(kubeconfig))
        yield k8s.CoreV1Api(api_client)
        api_client.close()


def pod(name: str, role: str, port: int, *, ready: bool, labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": {**INSTANCE, "kubesgl.io/role": role, **(labels or {})},
            "annotations": annotations or {},
        },
        "spec": {
            "containers": [
                {
                    "name": "engine",
                    "image": "kubesgl",
                    "ports": [{"name": "http", "containerPort": port}],
                }
            ]
        },
        "status": pod_status(ready),
    }


def pod_status(ready: bool) -> dict[str, Any]:
    if not ready:
        return {"phase": "Pending", "conditions": [{"type": "Ready", "status": "False"}]}
    return {
        "phase": "Running",
        "podIP": "127.0.0.1",
        "conditions": [{"type": "Ready", "status": "True"}],
    }


async def create(api: k8s.CoreV1Api, body: dict[str, Any]) -> None:
    await asyncio.to_thread(api.create_namespaced_pod, NAMESPACE, body)


async def set_ready(api: k8s.CoreV1Api, name: str, ready: bool) -> None:
    await asyncio.to_thread(
        api.patch_namespaced_pod_status, name, NAMESPACE, {"status": pod_status(ready)}
    )


async def test_pods_join_and_leave_the_pool(core_api, engines, start_router, client):
    a, b, stranger = await engines("a"), await engines("b"), await engines("stranger")
    discovery = KubeDiscoverySettings(NAMESPACE, {"app.kubernetes.io/instance": "demo"})
    async with start_router(kube=discovery, policy="round_robin") as router:
        workers = router.app.workers

        # Not ready yet, another instance's pod, a router pod: none of them may join.
        await create(core_api, pod("engine-a", "mixed", a.port, ready=False))
        await create(core_api, pod("other", "mixed", stranger.port, ready=True,
                                   labels={"app.kubernetes.io/instance": "other"}))  # fmt: skip
        await create(core_api, pod("router", "router", stranger.port, ready=True))
        await create(core_api, pod("engine-b", "mixed", b.port, ready=True))
        await router.until(lambda: workers.get(b.url) is not None)
        # Events arrive in order: the earlier pods were seen and left out.
        assert [w.url for w in workers.all()] == [b.url]
        assert workers.get(b.url).source == "kubernetes"

        await set_ready(core_api, "engine-a", True)
        await router.until(lambda: workers.get(a.url) is not None)
        await router.all_healthy()
        served = set()
        for _ in range(4):
            response = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
            served.add(response.json()["choices"][0]["text"].split("-tok")[0])
        assert served == {"a", "b"}

        await set_ready(core_api, "engine-a", False)
        await router.until(lambda: workers.get(a.url) is None)
        await asyncio.to_thread(core_api.delete_namespaced_pod, "engine-b", NAMESPACE)
        await router.until(lambda: workers.get(b.url) is None)
        assert workers.all() == []
        assert stranger.requests == []


async def test_prefill_pods_bring_their_bootstrap_port(core_api, engines, start_router):
    p, d = await engines("p", "prefill"), await engines("d", "decode")
    discovery = KubeDiscoverySettings(NAMESPACE, dict(INSTANCE))
    async with start_router(kube=discovery) as router:
        workers = router.app.workers
        await create(core_api, pod("prefill-0", "prefill", p.port, ready=True,
                                   annotations={"kubesgl.io/bootstrap-port": "9555"}))  # fmt: skip
        await create(core_api, pod("decode-0", "decode", d.port, ready=True))
        await router.until(lambda: len(workers.all()) == 2)
        prefill, decode = workers.get(p.url), workers.get(d.url)
        assert (prefill.role.value, prefill.bootstrap_port) == ("prefill", 9555)
        assert (decode.role.value, decode.bootstrap_port) == ("decode", None)
        assert workers.is_disaggregated()
