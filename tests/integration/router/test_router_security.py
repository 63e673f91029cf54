"""Issue 11, item 3 (router): the admin API is closed without a key, worker URLs are checked,
engines get the router's credentials and never the client's.

Every worker here listens on loopback; the link-local and metadata addresses are only sent to
the admin API as text (or come out of a fake resolver), which refuses them before any
connection is tried.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_router_cli import free_port, wait_until_ready

from kubesgl import __version__

pytestmark = pytest.mark.asyncio

ADMIN_KEY_ENV = "KUBESGL_ROUTER_ADMIN_KEY"
API_KEY_ENV = "KUBESGL_API_KEY"  # the engines' key, under the name engine pods read it by
ADMIN = {"Authorization": "Bearer adm1n"}


def lowercase(headers: dict[str, str]) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, (
        body
    )
    return body["error"]


async def test_without_an_admin_key_the_pool_cannot_be_changed(engines, start_router, client):
    a, b = await engines("a"), await engines("b")
    async with start_router(workers=[a.url]) as router:
        await router.ready()
        added = await client.post(router.url + "/workers", json={"url": b.url})
        removed = await client.delete(router.url + "/workers", params={"url": a.url})
        # even with a key the router does not have
        keyed = await client.post(router.url + "/workers", json={"url": b.url}, headers=ADMIN)
        listing = await client.get(router.url + "/workers")
        served = await client.post(router.url + "/v1/completions", json={"prompt": "x"})
    for refused in (added, removed, keyed):
        assert refused.status_code == 403
        error = error_of(refused)
        assert error["type"] == "permission_error" and ADMIN_KEY_ENV in error["message"]
    # the listing stays open: it shows what /metrics shows
    assert listing.status_code == 200 and [w["url"] for w in listing.json()["workers"]] == [a.url]
    assert served.status_code == 200 and not b.requests


async def test_the_admin_key_opens_the_admin_api(engines, start_router, client):
    a = await engines("a")
    async with start_router(admin_api_key="adm1n") as router:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "adm1n"}):
            for call in (client.get(router.url + "/workers", headers=headers),
                         client.post(router.url + "/workers", json={"url": a.url}, headers=headers),
                         client.delete(router.url + "/workers", params={"url": a.url}, headers=headers)):  # fmt: skip
                refused = await call
                assert (
                    refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
                )
                assert error_of(refused)["type"] == "authentication_error"
        assert router.app.workers.all() == []
        added = await client.post(
            router.url + "/workers", json={"url": a.url}, headers={"Authorization": "bearer adm1n"}
        )
        assert added.status_code == 200
        removed = await client.delete(router.url + "/workers", params={"url": a.url}, headers=ADMIN)
        assert removed.json() == {"removed": a.url}


async def test_the_admin_api_refuses_worker_urls_that_lead_elsewhere(engines, start_router, client):
    a = await engines("a")
    looked_up: list[str] = []

    async def fake_resolve(host: str, port: int) -> list[str]:
        looked_up.append(host)
        if host == "localhost":
            return ["127.0.0.1"]
        if host == "rebind.test":
            return ["127.0.0.1", "169.254.169.254"]
        if host == "link.test":
            return ["fe80::1%2"]
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    refused = {
        f"http://admin:hunter2@127.0.0.1:{a.port}": "no user name or password",
        "ftp://127.0.0.1:21": "http://HOST:PORT",
        "http://169.254.169.254:80": "cloud metadata address",
        "http://[fd00:ec2::254]:80": "cloud metadata address",
        "http://metadata.google.internal:80": "cloud metadata host name",
        "http://169.254.10.10:30000": "link-local",
        "http://[fe80::1]:30000": "link-local",
        "http://2852039166:80": "cloud metadata address",  # 169.254.169.254 as one number
        "http://rebind.test:30000": "rebind.test resolves to 169.254.169.254, a cloud metadata address",
        "http://link.test:30000": "link-local",
        "http://nowhere.test:30000": "does not resolve",
    }
    async with start_router(admin_api_key="adm1n") as router:
        router.app.resolve = fake_resolve
        for url, reason in refused.items():
            response = await client.post(router.url + "/workers", json={"url": url}, headers=ADMIN)
            assert response.status_code == 400, url
            error = error_of(response)
            assert error["param"] == "url" and reason in error["message"], (url, error)
            assert "hunter2" not in response.text
        assert router.app.workers.all() == []
        assert sorted(looked_up) == [
            "link.test",
            "nowhere.test",
            "rebind.test",
        ]  # addresses are not looked up
        # a name that resolves to loopback is fine
        added = await client.post(
            router.url + "/workers", json={"url": f"localhost:{a.port}"}, headers=ADMIN
        )
        assert (
            added.status_code == 200
            and added.json()["worker"]["url"] == f"http://localhost:{a.port}"
        )
        await router.ready()
        assert (
            await client.post(router.url + "/v1/completions", json={"prompt": "x"})
        ).status_code == 200


async def test_engines_never_see_the_clients_credentials(engines, start_router, client):
    a = await engines("a")
    async with start_router(workers=[a.url]) as router:
        await router.ready()
        headers = {
            "Authorization": "Bearer client-secret",
            "Cookie": "session=client-secret",
            "X-Trace": "7",
        }
        for path, body in (("/v1/completions", {"prompt": "x"}), ("/generate", {"text": "x"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True})):  # fmt: skip
            assert (
                await client.post(router.url + path, json=body, headers=headers)
            ).status_code == 200
        assert (await client.get(router.url + "/v1/models", headers=headers)).status_code == 200
    # the clients' requests (X-Trace), and the router's own /v1/models probes, which ask the model
    seen = [lowercase(r["headers"]) for r in a.requests] + [lowercase(h) for h in a.models_headers]
    assert len([received for received in seen if received.get("x-trace") == "7"]) == 4
    for received in seen:
        assert "client-secret" not in str(received) and "authorization" not in received


async def test_with_the_engines_key_the_router_checks_clients_and_presents_its_own(
    engines, start_router, client, kv_table
):
    key = "eng1ne-key"
    p = await engines("p", "prefill", kv=kv_table, api_key=key)
    d = await engines("d", "decode", kv=kv_table, api_key=key)
    async with start_router(
        prefill=[(p.url, p.bootstrap_port)], decode=[d.url], api_key=key
    ) as router:
        await router.ready()  # health probes pass
        body = {"prompt": "x" * 2000}  # long enough to be disaggregated
        for credentials in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": f"Basic {key}"},
        ):
            headers = {**credentials, "X-Trace": "refused"}
            for call in (client.post(router.url + "/v1/completions", json=body, headers=headers),
                         client.post(router.url + "/generate", json={"text": "x"}, headers=headers),
                         client.get(router.url + "/v1/models", headers=headers),
                         client.post(router.url + "/tokenize", json={"prompt": "x"}, headers=headers),
                         client.post(router.url + "/detokenize", json={"tokens": [1]}, headers=headers)):  # fmt: skip
                refused = await call
                assert refused.status_code == 401, headers
                error = error_of(refused)
                assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
        assert not p.requests and not d.requests
        assert not [h for h in d.models_headers if lowercase(h).get("x-trace") == "refused"]
        # /health, /metrics and /version stay open, as on an engine, and /liveness (the kubelet
        # sends no key)
        assert (await client.get(router.url + "/health")).status_code == 200
        assert (await client.get(router.url + "/liveness")).status_code == 200
        assert (await client.get(router.url + "/metrics")).status_code == 200
        assert (await client.get(router.url + "/version")).status_code == 200
        ok = await client.post(
            router.url + "/v1/completions", json=body, headers={"Authorization": f"bearer {key}"}
        )
        models = await client.get(
            router.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}
        )
    assert ok.status_code == 200 and models.status_code == 200
    for received in [p.requests[0]["headers"], d.requests[0]["headers"], d.models_headers[-1],
                     p.probe_headers[-1], d.probe_headers[-1]]:  # fmt: skip
        assert (
            lowercase(received)["authorization"] == f"Bearer {key}"
        )  # the router's own, as it spells it


async def test_engines_refusing_the_routers_key_make_a_clear_error(engines, start_router, client):
    a = await engines("a", api_key="the-engines-key")
    async with start_router(
        workers=[a.url], api_key="another-key", breaker_failure_threshold=1
    ) as router:
        await router.ready()
        auth = {"Authorization": "Bearer another-key"}
        for _ in range(3):
            response = await client.post(
                router.url + "/v1/completions", json={"prompt": "x"}, headers=auth
            )
            assert response.status_code == 502
            assert API_KEY_ENV in error_of(response)["message"] and a.url in response.text
        # not the worker's fault: its circuit stays closed
        assert router.app.workers.get(a.url).breaker.state.value == "closed"


async def test_router_process_reads_its_keys_from_the_environment(engines, client):
    a, b = await engines("a", api_key="eng1ne"), await engines("b", api_key="eng1ne")
    port = free_port()
    env = {**os.environ, ADMIN_KEY_ENV: "adm1n", API_KEY_ENV: "eng1ne"}
    process = subprocess.Popen(
        [sys.executable, "-m", "kubesgl", "router", "--worker", a.url, "--port", str(port),
         "--health-check-interval", "0.2", "--log-level", "warning"], env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_until_ready(url, process)
        assert b"adm1n" not in Path(f"/proc/{process.pid}/cmdline").read_bytes()  # not in `ps`
        assert (await client.post(url + "/workers", json={"url": b.url})).status_code == 401
        assert (
            await client.post(url + "/workers", json={"url": b.url}, headers=ADMIN)
        ).status_code == 200
        assert (await client.post(url + "/v1/completions", json={"prompt": "x"})).status_code == 401
        answer = await client.post(
            url + "/v1/completions",
            json={"prompt": "x"},
            headers={"Authorization": "Bearer eng1ne"},
        )
        assert answer.status_code == 200
    finally:
        process.terminate()
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)
    assert len(a.requests) + len(b.requests) == 1


async def test_the_admin_key_flag_still_works_with_a_warning(engines, client):
    a = await engines("a")
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "kubesgl", "router", "--port", str(port), "--admin-api-key", "adm1n",
         "--health-check-interval", "0.2", "--log-level", "warning"],
        env={k: v for k, v in os.environ.items() if k not in (ADMIN_KEY_ENV, API_KEY_ENV)}, stderr=subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        async with asyncio.timeout(20):
            while True:
                try:
                    added = await client.post(url + "/workers", json={"url": a.url}, headers=ADMIN)
                    break
                except httpx.TransportError:
                    assert process.poll() is None, "the router exited"
                    await asyncio.sleep(0.05)
        assert added.status_code == 200
        await wait_until_ready(url, process)
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    assert (
        f"--admin-api-key shows the admin key to anyone who can list processes; set {ADMIN_KEY_ENV}"
        in stderr.decode()
    )


@pytest.mark.slow
async def test_a_real_engine_takes_the_routers_key_and_never_sees_the_clients(tiny_model):
    """`kubesgl serve --api-key` behind `kubesgl router` processes, through the OpenAI SDK."""
    import openai

    key = "sk-eng1ne"
    clean = {k: v for k, v in os.environ.items() if k not in (ADMIN_KEY_ENV, API_KEY_ENV)}
    engine_port, with_key, without_key = free_port(), free_port(), free_port()
    engine = subprocess.Popen(
        [sys.executable, "-m", "kubesgl", "serve", "--model", tiny_model("llama"), "--port", str(engine_port),
         "--device", "cpu", "--max-total-tokens", "512", "--served-model-name", "default", "--api-key", key],
        env={**clean, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    engine_url = f"http://127.0.0.1:{engine_port}"

    def router(port: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "kubesgl", "router", "--worker", engine_url, "--port", str(port),
             "--health-check-interval", "0.2", "--log-level", "error"], env=env,
        )  # fmt: skip

    routers = [router(with_key, {**clean, API_KEY_ENV: key}), router(without_key, clean)]
    try:
        await wait_until_ready(engine_url, engine, timeout=300)
        for port, process in zip((with_key, without_key), routers):
            await wait_until_ready(f"http://127.0.0.1:{port}", process)

        def sdk(port: int, api_key: str) -> openai.AsyncOpenAI:
            return openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, max_retries=0
            )

        completion = await sdk(with_key, key).completions.create(
            model="default", prompt="hi", max_tokens=2
        )
        assert completion.choices[0].finish_reason == "length"
        models = await sdk(with_key, key).models.list()
        assert [m.id for m in models.data] == ["default"]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{with_key}") as through:
            tokens = await through.post(
                "/tokenize", json={"prompt": "hi"}, headers={"Authorization": f"Bearer {key}"}
            )
            assert tokens.json()["count"] == completion.usage.prompt_tokens
            assert (await through.get("/version")).json() == {"version": __version__}
        with pytest.raises(openai.AuthenticationError) as refused:
            await sdk(with_key, "sk-wrong").completions.create(
                model="default", prompt="hi", max_tokens=2
            )
        assert refused.value.code == "invalid_api_key"
        # A router without the engines' key forwards no credentials, not even the right key from
        # the client: the engine refuses, and the client learns what to set.
        with pytest.raises(openai.APIStatusError) as gateway:
            await sdk(without_key, key).completions.create(
                model="default", prompt="hi", max_tokens=2
            )
        assert gateway.value.status_code == 502 and API_KEY_ENV in gateway.value.message
    finally:
        for process in (*routers, engine):
            process.terminate()
        for process in (*routers, engine):
            process.wait(timeout=60)
