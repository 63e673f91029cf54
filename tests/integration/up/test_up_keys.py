"""`kubesgl up` with the keys of a spec's Secrets (engine.apiKeySecret, router.adminKeySecret)
taken from its environment, as the pods take them from the Secrets: through the environment,
so that no process's command line shows them, and required by the router and the engines."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest
import yaml
from up_harness import RunningUp, descendants

API_KEY = "sk-up-test-2f9c"
ADMIN_KEY = "admin-up-test-77d1"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, tiny_model):
    tmp_path = tmp_path_factory.mktemp("up-keys")
    spec = tmp_path / "keys.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kubesgl.io/v1alpha1",
                "kind": "InferenceService",
                "metadata": {"name": "local-keys"},
                "spec": {
                    "image": "ghcr.io/kubesgl/kubesgl:0.1.0",
                    "mode": "mixed",
                    "model": {"servedName": "tiny", "hostPath": {"path": tiny_model("llama")}},
                    "engine": {
                        "device": "cpu",
                        "maxTotalTokens": 4096,
                        "apiKeySecret": {"name": "keys", "key": "api"},
                    },
                    "router": {"adminKeySecret": {"name": "keys", "key": "admin"}},
                },
            }
        )
    )
    up = RunningUp(
        spec, tmp_path, env={"KUBESGL_API_KEY": API_KEY, "KUBESGL_ROUTER_ADMIN_KEY": ADMIN_KEY}
    )
    up.wait_for(r"ready in [\d.]+ s: OpenAI base URL ")
    yield up
    up.kill()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_no_command_line_shows_a_key(keyed):
    tree = descendants(keyed.process.pid)
    assert len(tree) >= 3  # the router, the engine and its children
    for pid in tree:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except FileNotFoundError:
            continue
        assert API_KEY not in cmdline and ADMIN_KEY not in cmdline, cmdline


def test_clients_and_the_admin_api_need_their_keys(keyed):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}
    url = keyed.base_url + "/v1/completions"
    assert httpx.post(url, json=body, timeout=60).status_code == 401
    assert httpx.post(url, json=body, headers=bearer("wrong"), timeout=60).status_code == 401
    assert httpx.post(url, json=body, headers=bearer(API_KEY), timeout=60).status_code == 200

    workers = keyed.base_url + "/workers"
    assert httpx.get(workers, timeout=10).status_code == 401
    assert httpx.get(workers, headers=bearer(API_KEY), timeout=10).status_code == 401
    listing = httpx.get(workers, headers=bearer(ADMIN_KEY), timeout=10)
    assert listing.status_code == 200
    (engine,) = [worker["url"] for worker in listing.json()["workers"]]
    # the engine itself: the same key, which the router presented on the client's behalf
    assert httpx.post(engine + "/v1/completions", json=body, timeout=60).status_code == 401
    assert (
        httpx.post(
            engine + "/v1/completions", json=body, headers=bearer(API_KEY), timeout=60
        ).status_code
        == 200
    )


def test_closing_the_terminal_drains_and_stops_everything(keyed):
    """SIGHUP (its terminal closed) stops `kubesgl up` as Ctrl-C does, leaving no process behind.
    The module's last test: it stops the module's `kubesgl up`."""
    status, left = keyed.interrupt(signal.SIGHUP)
    assert status == 0 and left == []
    assert "stopping: the router, then the engines" in keyed.output()  # its file keeps the drain
