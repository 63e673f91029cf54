"""`--model` takes a Hugging Face id: huggingface_hub downloads it into its cache, and with
HF_HUB_OFFLINE=1 (or no Hub to reach) a cached copy serves without any network. The Hub is
fake_hub.py's, on a loopback port, so the cache is laid out by huggingface_hub itself; after the
download the fake Hub is gone and HF_ENDPOINT points at a closed port."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fake_hub import FakeHub
from serve_harness import free_port

REPO = "kubesgl-test/tiny-llama"


def generate(model: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "kubesgl",
            "generate",
            "--model",
            model,
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--prompt",
            "The capital of France is",
            "--max-tokens",
            "8",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )


@dataclass
class HubCache:
    env: dict[str, str]  # a process's environment: HF_HOME holds REPO, HF_ENDPOINT is a closed port
    output: str  # what `kubesgl generate --model REPO` printed while it downloaded REPO


@pytest.fixture(scope="module")
def hub_cache(tiny_model, tmp_path_factory) -> HubCache:
    """A Hugging Face cache holding REPO, downloaded from the fake Hub by `kubesgl generate
    --model REPO` (which must work while the Hub is there)."""
    home = tmp_path_factory.mktemp("hf-home")
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("HF_TOKEN", None)
    with FakeHub({REPO: Path(tiny_model("llama"))}) as hub:
        downloaded = generate(REPO, {**env, "HF_ENDPOINT": hub.url})
        assert downloaded.returncode == 0, downloaded.stderr
        assert any(
            "/resolve/" in request and request.endswith("model.safetensors")
            for request in hub.requests
        )
    snapshots = list((home / "hub" / "models--kubesgl-test--tiny-llama" / "snapshots").iterdir())
    assert len(snapshots) == 1 and (snapshots[0] / "model.safetensors").is_file()
    return HubCache({**env, "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}, downloaded.stdout)


def test_a_downloaded_id_generates_as_its_folder_does(hub_cache, tiny_model):
    local = generate(tiny_model("llama"), hub_cache.env)
    assert local.returncode == 0 and local.stdout == hub_cache.output


@pytest.mark.parametrize("offline", ["1", None], ids=["HF_HUB_OFFLINE", "no-hub-to-reach"])
def test_a_cached_id_needs_no_network(hub_cache, offline):
    env = {**hub_cache.env, "HF_HUB_OFFLINE": offline} if offline else hub_cache.env
    cached = generate(REPO, env)
    assert cached.returncode == 0, cached.stderr
    assert cached.stdout == hub_cache.output


def test_an_id_not_in_the_cache_offline_is_one_line(hub_cache):
    missing = generate("kubesgl-test/not-there", {**hub_cache.env, "HF_HUB_OFFLINE": "1"})
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.splitlines()[-1].startswith(
        "kubesgl generate: --model kubesgl-test/not-there: no such directory, and no complete copy in the "
        "Hugging Face cache ("
    )
    assert missing.stderr.rstrip().endswith("HF_HUB_OFFLINE is set")


def test_an_id_the_hub_does_not_have_is_one_line(tiny_model, tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    with FakeHub({REPO: Path(tiny_model("llama"))}) as hub:
        missing = generate("kubesgl-test/no-such-model", {**env, "HF_ENDPOINT": hub.url})
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.splitlines()[-1] == (
        "kubesgl generate: --model kubesgl-test/no-such-model: no such directory, and no such model on the "
        "Hugging Face Hub (a private one needs HF_TOKEN)"
    )


def test_kubesgl_serve_serves_a_cached_id_offline_under_its_name(hub_cache, server_factory):
    server = server_factory(REPO, env={**hub_cache.env, "HF_HUB_OFFLINE": "1"})
    assert [card["id"] for card in httpx.get(server.openai_url + "/models").json()["data"]] == [
        REPO
    ]
    answer = httpx.post(
        server.openai_url + "/completions",
        json={"model": REPO, "prompt": "hi", "max_tokens": 4, "ignore_eos": True},
    )
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
    assert "loading weights: 1 file(s)" in server.log() and "weights loaded: " in server.log()
    assert server.stop() == 0
