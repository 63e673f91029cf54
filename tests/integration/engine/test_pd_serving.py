"""Prefill/decode serving with real processes: a prefill engine, a decode engine and the
kubesgl router in front of them, against a mixed engine on the same weights; and what a
client sees when either engine fails."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx
import pytest
from serve_harness import free_port, start_router, start_server

MODEL_NAME = "tiny"


def start_pd_pair(model, tmp_path, prefill_args=(), decode_args=(), decode_env=None):
    bootstrap = free_port()
    prefill = start_server(
        model,
        "--role",
        "prefill",
        "--disaggregation-bootstrap-port",
        str(bootstrap),
        "--served-model-name",
        MODEL_NAME,
        *prefill_args,
        tmp_path=tmp_path,
    )
    decode = start_server(
        model,
        "--role",
        "decode",
        "--served-model-name",
        MODEL_NAME,
        *decode_args,
        tmp_path=tmp_path,
        env=decode_env,
    )
    return prefill, decode, bootstrap


def start_pd_router(prefill, decode, bootstrap, tmp_path, *args):
    """A router in front of the pair, sending even short prompts through both engines."""
    return start_router(
        "--prefill",
        f"{prefill.base_url}@{bootstrap}",
        "--decode",
        decode.base_url,
        "--pd-min-prefill-tokens",
        "0",
        *args,
        tmp_path=tmp_path,
    )


@pytest.fixture(scope="module")
def pd_stack(tiny_model, tmp_path_factory):
    """(router URL, mixed engine URL, prefill, decode) on the llama tiny model."""
    tmp_path = tmp_path_factory.mktemp("pd")
    model = tiny_model("llama")
    mixed = start_server(model, "--served-model-name", MODEL_NAME, tmp_path=tmp_path)
    prefill, decode, bootstrap = start_pd_pair(model, tmp_path)
    router = start_pd_router(prefill, decode, bootstrap, tmp_path, "--health-check-interval", "0.5")
    yield router.base_url, mixed, prefill, decode
    router.stop(timeout=30)
    for server in (mixed, prefill, decode):
        assert server.stop() == 0


def send_to_both(prefill, decode, path: str, body: dict) -> dict[str, httpx.Response | Exception]:
    """What a router does: the same request to the prefill and the decode engine at once."""
    answers: dict[str, httpx.Response | Exception] = {}

    def send(name: str, base: str) -> None:
        try:
            answers[name] = httpx.post(base + path, json=body, timeout=120)
        except httpx.HTTPError as exc:
            answers[name] = exc

    threads = [
        threading.Thread(target=send, args=(n, s.base_url))
        for n, s in (("p", prefill), ("d", decode))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def both(url_a: str, url_b: str):
    import openai  # here: the GPU machine runs this file's GPU test without the SDK

    return (
        openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) for url in (url_a, url_b)
    )


def test_completions_and_chat_through_the_router_equal_a_mixed_engine(pd_stack):
    url, mixed, prefill, decode = pd_stack
    pd, ref = both(url, mixed.base_url)
    prompts = ["The capital of France is", "Count from one to ten:", "🙂 naïve café " * 20]
    for prompt in prompts:
        kwargs = {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": 24,
            "temperature": 0,
            "logprobs": 2,
        }
        got, want = pd.completions.create(**kwargs), ref.completions.create(**kwargs)
        assert got.choices[0].text == want.choices[0].text
        assert got.choices[0].finish_reason == want.choices[0].finish_reason
        assert got.usage.completion_tokens == want.usage.completion_tokens == 24
        assert got.usage.prompt_tokens == want.usage.prompt_tokens
        assert got.choices[0].logprobs.tokens == want.choices[0].logprobs.tokens
        assert got.choices[0].logprobs.token_logprobs == pytest.approx(
            want.choices[0].logprobs.token_logprobs, abs=1e-4
        )
        streamed = pd.completions.create(**kwargs, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == want.choices[0].text
    messages = [{"role": "user", "content": "hello there"}]
    seeded = {
        "model": MODEL_NAME,
        "messages": messages,
        "max_tokens": 20,
        "temperature": 0.9,
        "seed": 5,
    }
    assert (
        pd.chat.completions.create(**seeded).choices[0].message.content
        == ref.chat.completions.create(**seeded).choices[0].message.content
    )
    chunks = pd.chat.completions.create(
        **seeded, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(chunks)
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == ref.chat.completions.create(**seeded).choices[0].message.content
    )
    assert chunks[-1].usage.completion_tokens == 20
    native = {"text": prompts[0], "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    assert (
        httpx.post(url + "/generate", json=native).json()["output_ids"]
        == httpx.post(mixed.base_url + "/generate", json=native).json()["output_ids"]
    )
    for server in (prefill, decode):
        server.wait_idle()
    assert decode.metric("kubesgl_kv_transfer_wait_seconds_count") >= 8
    assert prefill.metric("kubesgl_kv_transfer_bytes_total") > 0


def test_structured_output_through_the_router_equals_a_mixed_engine(pd_stack):
    """The prefill engine samples the first token under the grammar; the decode engine's
    matcher starts after it: greedy answers equal the mixed engine's and validate."""
    import json

    import jsonschema

    url, mixed, prefill, decode = pd_stack
    pd, ref = both(url, mixed.base_url)
    schema = {
        "type": "object",
        "required": ["id", "tags"],
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 99},
            "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["x", "y"]}},
        },
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    for temperature, stream in ((0, False), (0, True), (0.8, False)):
        kwargs = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": f"json {temperature}"}],
            "max_tokens": 60,
            "temperature": temperature,
            "seed": 3,
            "response_format": response_format,
        }
        want = ref.chat.completions.create(**kwargs).choices[0].message.content
        if stream:
            got = "".join(
                c.choices[0].delta.content or ""
                for c in pd.chat.completions.create(**kwargs, stream=True)
                if c.choices
            )
        else:
            answer = pd.chat.completions.create(**kwargs).choices[0]
            assert answer.finish_reason == "stop"
            got = answer.message.content
        assert got == want
        jsonschema.validate(json.loads(got), schema)
    native = {
        "text": "regex",
        "sampling_params": {"max_new_tokens": 30, "temperature": 0, "regex": "(ab|cd){3}!"},
    }
    assert (
        httpx.post(url + "/generate", json=native).json()["text"]
        == httpx.post(mixed.base_url + "/generate", json=native).json()["text"]
    )
    bad = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "b", "schema": {"type": "nonsense"}},
        },
    }
    got = httpx.post(url + "/v1/chat/completions", json=bad, timeout=60)
    assert got.status_code == 400 and "nonsense" in got.json()["error"]["message"], got.text
    for server in (prefill, decode):
        server.wait_idle()


def start_sglang_router(tmp_path, prefill, bootstrap: int, decode) -> tuple[subprocess.Popen, str]:
    """SGLang's own router (PyPI sglang-router) in PD mode in front of kubesgl engines."""
    port, metrics_port = free_port(), free_port()
    log = open(tmp_path / "sglang-router.log", "w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--pd-disaggregation",
            "--prefill",
            prefill.base_url,
            str(bootstrap),
            "--decode",
            decode.base_url,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-port",
            str(metrics_port),
            "--health-check-interval-secs",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # ready once it has found the model on its workers
        assert process.poll() is None, (tmp_path / "sglang-router.log").read_text()[-2000:]
        try:
            if MODEL_NAME in httpx.get(url + "/v1/models", timeout=1).text:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError("sglang-router did not find the kubesgl workers")


def test_sglangs_own_router_drives_kubesgl_engines(pd_stack, tmp_path):
    url, mixed, prefill, decode = pd_stack
    router, sglang_url = start_sglang_router(
        tmp_path, prefill, prefill_bootstrap_port(prefill), decode
    )
    try:
        pd, ref = both(sglang_url, mixed.base_url)
        assert [m.id for m in pd.models.list().data] == [MODEL_NAME]
        for prompt in ("The capital of France is", "Kubernetes schedules pods"):
            kwargs = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0}
            assert (
                pd.completions.create(**kwargs).choices[0].text
                == ref.completions.create(**kwargs).choices[0].text
            )
        messages = [{"role": "user", "content": "hi"}]
        chat = {"model": MODEL_NAME, "messages": messages, "max_tokens": 12, "temperature": 0}
        streamed = pd.chat.completions.create(**chat, stream=True)
        assert (
            "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
            == ref.chat.completions.create(**chat).choices[0].message.content
        )
        native = {"text": "hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        assert (
            httpx.post(sglang_url + "/generate", json=native, timeout=60).json()["output_ids"]
            == httpx.post(mixed.base_url + "/generate", json=native).json()["output_ids"]
        )
        for server in (prefill, decode):
            server.wait_idle()
    finally:
        os.killpg(router.pid, signal.SIGKILL)
        router.wait()


def test_what_the_engines_say_about_rooms(pd_stack):
    url, mixed, prefill, decode = pd_stack
    room = random.getrandbits(63)
    body = {
        "model": MODEL_NAME,
        "prompt": "hi",
        "max_tokens": 2,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": 1,
        "bootstrap_room": room,
    }
    refused = httpx.post(mixed.base_url + "/v1/completions", json=body)
    assert refused.status_code == 400 and "role is mixed" in refused.json()["error"]["message"]
    wrong_list = httpx.post(
        decode.base_url + "/v1/completions", json={**body, "n": 2, "bootstrap_room": [1, 2, 3]}
    )
    assert wrong_list.status_code == 400 and wrong_list.json()["error"]["param"] == "bootstrap_room"
    no_host = httpx.post(decode.base_url + "/generate", json={"text": "hi", "bootstrap_room": room})
    assert no_host.status_code == 400 and no_host.json()["error"]["param"] == "bootstrap_host"


def test_requests_sent_to_both_engines_as_sglangs_router_does(pd_stack):
    """No kubesgl router in between: the engines alone pair up; n > 1 with one room, as SGLang's
    router sends it (the copies take room + 1, ...)."""
    url, mixed, prefill, decode = pd_stack
    body = {
        "model": MODEL_NAME,
        "prompt": "two choices",
        "max_tokens": 8,
        "n": 2,
        "temperature": 0.8,
        "seed": 1,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill_bootstrap_port(prefill),
        "bootstrap_room": random.getrandbits(62),
    }
    answers = send_to_both(prefill, decode, "/v1/completions", body)
    assert answers["p"].status_code == 200 and answers["d"].status_code == 200, (
        answers["p"].text,
        answers["d"].text,
    )
    want = httpx.post(
        mixed.base_url + "/v1/completions",
        json={k: v for k, v in body.items() if not k.startswith("bootstrap")},
    ).json()
    assert [c["text"] for c in answers["d"].json()["choices"]] == [
        c["text"] for c in want["choices"]
    ], (answers["d"].json(), want)
    decode.wait_idle()
    prefill.wait_idle()


def test_a_request_the_prefill_api_server_refuses_fails_at_the_decode_engine_at_once(
    tiny_model, tmp_path
):
    """The prefill engine's API server refuses the request before its scheduler sees the room
    (a token-id prompt longer than its context, shorter than the decode engine's; a stop
    string over its limit). Its decode engine hears of it at once and answers the prefill
    engine's 400 with its reason, counted `refused`: the client's answer does not wait out
    the router's 1 s wait for the decode engine, which then aborted the decode request."""
    model = tiny_model("llama")
    prefill, decode, bootstrap = start_pd_pair(
        model,
        tmp_path,
        prefill_args=("--context-length", "64", "--max-stop-string-length", "8"),
    )
    router = start_pd_router(prefill, decode, bootstrap, tmp_path)
    try:
        refusals = {
            "context": {"prompt": [random.randrange(3, 500) for _ in range(80)]},
            "--max-stop-string-length": {"prompt": "hi", "stop": ["a stop string"]},
        }
        for reason, request in refusals.items():
            started = time.monotonic()
            answer = httpx.post(
                router.base_url + "/v1/completions",
                json={"model": MODEL_NAME, "max_tokens": 4, **request},
                timeout=60,
            )
            elapsed = time.monotonic() - started
            assert answer.status_code == 400, answer.text
            assert reason in answer.json()["error"]["message"], answer.text
            assert elapsed < 1.0, elapsed  # the router's wait for the decode engine
        decode.wait_idle()
        assert decode.metric('kubesgl_disagg_failures_total{reason="refused"}') == 2
        assert decode.metric('kubesgl_disagg_failures_total{reason="aborted"}') == 0
    finally:
        router.stop(timeout=30)
        for server in (prefill, decode):
            assert server.stop() == 0


def test_a_prefill_engine_whose_queue_is_full_sheds_the_burst_with_503s_and_leaks_nothing(
    tiny_model, tmp_path
):
    """A prefill engine with --max-queued-requests refuses the rooms beyond its queue with a
    503 at once. A router that may not retry passes it on, with Retry-After (and ends the
    decode engine's request for the room): a burst gets answers and 503s, never a 502. One
    that retries (the default) finds every prefill engine refusing and sends the request to
    the decode engine alone, which prefills it itself: every request is answered. Both
    engines end idle."""
    model = tiny_model("llama")
    prefill, decode, bootstrap = start_pd_pair(
        model,
        tmp_path,
        prefill_args=("--max-running-requests", "1", "--max-queued-requests", "1"),
    )
    router = start_pd_router(prefill, decode, bootstrap, tmp_path, "--max-retries", "0")
    retrying = start_pd_router(prefill, decode, bootstrap, tmp_path)
    try:

        async def burst(base_url: str = router.base_url) -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
                body = {"model": MODEL_NAME, "max_tokens": 4, "ignore_eos": True}
                return await asyncio.gather(
                    *(
                        client.post("/v1/completions", json={**body, "prompt": "x " * (50 + i)})
                        for i in range(12)
                    )
                )

        answers = asyncio.run(burst())
        statuses = sorted(answer.status_code for answer in answers)
        assert set(statuses) == {200, 503}, statuses
        for answer in answers:
            if answer.status_code == 503:
                assert answer.headers["retry-after"] == "1"
                assert "queue is full" in answer.json()["error"]["message"], answer.text
            else:
                assert answer.json()["usage"]["completion_tokens"] == 4
        for server in (prefill, decode):
            server.wait_idle()
        refused = statuses.count(503)
        assert prefill.metric('kubesgl_request_errors_total{status="503"}') == refused
        for reason in ("timeout", "transfer", "peer_lost"):  # the refusals failed no transfer
            assert decode.metric(f'kubesgl_disagg_failures_total{{reason="{reason}"}}') == 0

        answers = asyncio.run(burst(retrying.base_url))
        assert [answer.status_code for answer in answers] == [200] * len(answers)
        assert retrying.metric('kubesgl_router_pd_routes_total{route="decode_only_no_prefill"}') > 0
        for server in (prefill, decode):
            server.wait_idle()
    finally:
        retrying.stop(timeout=30)
        router.stop(timeout=30)
        for server in (prefill, decode):
            assert server.stop() == 0


def test_a_request_for_a_model_the_prefill_engine_does_not_serve_fails_at_the_decode_engine_at_once(
    tiny_model, tmp_path
):
    """The engines disagree on the served name (a rolling upgrade that renames it) and the
    request goes to both, as SGLang's router sends it (the kubesgl router pairs only engines
    that both serve the model): the decode engine answers the prefill engine's 404 at once,
    counted `refused`, instead of waiting for the KV until its timeout (a 504)."""
    model = tiny_model("llama")
    prefill, decode, bootstrap = start_pd_pair(
        model,
        tmp_path,
        prefill_args=("--served-model-name", "renamed"),
        decode_args=("--disaggregation-timeout", "20"),
    )
    try:
        body = {
            "model": MODEL_NAME,
            "prompt": "hi",
            "max_tokens": 4,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bootstrap,
            "bootstrap_room": random.getrandbits(62),
        }
        started = time.monotonic()
        answers = send_to_both(prefill, decode, "/v1/completions", body)
        elapsed = time.monotonic() - started
        assert answers["p"].status_code == 404, answers["p"].text
        assert answers["d"].status_code == 404, answers["d"].text
        assert "'renamed'" in answers["d"].json()["error"]["message"], answers["d"].text
        assert elapsed < 5, elapsed  # the decode engine's timeout is 20 s
        decode.wait_idle()
        assert decode.metric('kubesgl_disagg_failures_total{reason="refused"}') == 1
    finally:
        for server in (prefill, decode):
            assert server.stop() == 0


def prefill_bootstrap_port(prefill) -> int:
    args = prefill.process.args
    return int(args[args.index("--disaggregation-bootstrap-port") + 1])


def test_a_prefill_engine_killed_during_a_long_prefill_fails_the_decode_request_within_seconds(
    tiny_model, tmp_path
):
    model = tiny_model("llama")
    prefill, decode, bootstrap = start_pd_pair(
        model, tmp_path, prefill_args=("--chunked-prefill-size", "4")
    )
    try:
        room = random.getrandbits(63)
        prompt = [
            random.randrange(3, 500) for _ in range(2000)
        ]  # 500 chunks: seconds of prefill here
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 4},
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bootstrap,
            "bootstrap_room": room,
        }
        answers = {}

        def send(name, base):
            try:
                answers[name] = httpx.post(base + "/generate", json=body, timeout=60)
            except httpx.HTTPError as exc:
                answers[name] = exc

        threads = [
            threading.Thread(target=send, args=(n, s.base_url))
            for n, s in (("p", prefill), ("d", decode))
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while prefill.metric("kubesgl_num_running_requests") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(prefill.process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        threads[1].join(timeout=30)
        answer = answers["d"]
        assert time.monotonic() - killed_at < 12
        assert answer.status_code == 502, answer.text
        assert "prefill engine" in answer.json()["error"]["message"]
        concurrent = httpx.post(
            decode.base_url + "/generate",
            json={"text": "still serving", "sampling_params": {"max_new_tokens": 4}},
        )
        assert concurrent.status_code == 200 and len(concurrent.json()["output_ids"]) == 4
        decode.wait_idle()
        assert decode.metric('kubesgl_disagg_failures_total{reason="peer_lost",role="decode"}') == 1
    finally:
        for server in (prefill, decode):
            if server.process.poll() is None:
                os.killpg(server.process.pid, signal.SIGKILL)


def test_a_decode_engine_that_gets_no_nixl_notes_answers_within_seconds(tiny_model, tmp_path):
    """NIXL connects but delivers no note to the decode engine (a firewall after the
    handshake; here notes_lost/sitecustomize.py drops them): it waited its whole
    --disaggregation-timeout (60 s) and answered 504. The prefill engine's report of the
    room's end, which the decode engine asks for at each heartbeat, ends it within seconds."""
    drop_notes = os.path.join(os.path.dirname(__file__), "notes_lost")
    path = os.pathsep.join(filter(None, [drop_notes, os.environ.get("PYTHONPATH")]))
    prefill, decode, bootstrap = start_pd_pair(
        tiny_model("llama"), tmp_path, decode_env={"PYTHONPATH": path}
    )
    try:
        body = {
            "model": MODEL_NAME,
            "prompt": "The capital of France is",
            "max_tokens": 8,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bootstrap,
            "bootstrap_room": random.getrandbits(63),
        }
        started = time.monotonic()
        answers = send_to_both(prefill, decode, "/v1/completions", body)
        assert answers["p"].status_code == 200, answers["p"].text  # its KV was written
        answer = answers["d"]
        assert time.monotonic() - started < 10
        assert answer.status_code == 502, answer.text
        assert "its note (with the first token) did not arrive" in answer.text
        decode.wait_idle()  # the report released the room's slots
        assert decode.metric('kubesgl_disagg_failures_total{reason="transfer",role="decode"}') == 1
    finally:
        for server in (prefill, decode):
            assert server.stop() == 0


def test_a_decode_engine_killed_while_the_prefill_engine_holds_kv_leaves_the_prefill_engine_serving(
    tiny_model, tmp_path
):
    model = tiny_model("llama")
    # If the decode engine dies before it posted the room, nothing tells the prefill engine
    # (SGLang's router does not cancel it): its timeout frees the KV, shortened here.
    prefill, decode, bootstrap = start_pd_pair(
        model,
        tmp_path,
        prefill_args=("--chunked-prefill-size", "4", "--disaggregation-timeout", "5"),
    )
    try:
        prompt = [random.randrange(3, 500) for _ in range(1500)]
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 4},
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bootstrap,
            "bootstrap_room": random.getrandbits(63),
        }
        prefill_answer = _posted_in_background(prefill.base_url + "/generate", body)
        decode_side = threading.Thread(target=_post_quietly, args=(decode, body))
        decode_side.start()
        deadline = time.monotonic() + 60
        while (
            prefill.metric('kubesgl_disagg_requests{role="prefill",state="prefilling"}') < 1
        ):  # it holds KV
            assert time.monotonic() < deadline and not prefill_answer.done(), prefill_answer
            time.sleep(0.02)
        os.killpg(decode.process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        answer = prefill_answer.result(timeout=90)
        assert time.monotonic() - killed_at < 15
        assert answer.status_code in (502, 504), answer.text  # its write failed, or nobody took it
        concurrent = httpx.post(
            prefill.base_url + "/generate",
            json={"text": "still serving", "sampling_params": {"max_new_tokens": 4}},
        )
        assert concurrent.status_code == 200 and len(concurrent.json()["output_ids"]) == 4
        prefill.wait_idle()
    finally:
        for server in (prefill, decode):
            if server.process.poll() is None:
                os.killpg(server.process.pid, signal.SIGKILL)


def _posted_in_background(url: str, body: dict) -> Future[httpx.Response]:
    """POSTs `body` to `url` on a thread of its own; the answer comes as the future's result."""
    executor = ThreadPoolExecutor(max_workers=1)
    answer = executor.submit(httpx.post, url, json=body, timeout=120)
    executor.shutdown(wait=False)
    return answer


def test_a_decode_client_that_leaves_during_the_prefill_aborts_the_prefill_request(
    tiny_model, tmp_path
):
    """As SGLang's router leaves it (it never closes the prefill engine's request): the decode
    engine's client leaves while the prefill engine is still prefilling. The decode engine
    cancels the room saying its client left, and the prefill engine stops and ends its request
    as an abort, counted `aborted` like the decode engine's: no 502, no `refused`."""
    model = tiny_model("llama")
    prefill, decode, bootstrap = start_pd_pair(
        model, tmp_path, prefill_args=("--chunked-prefill-size", "4")
    )
    try:
        body = {
            "model": MODEL_NAME,
            "prompt": [random.randrange(3, 500) for _ in range(1500)],  # seconds of prefill
            "max_tokens": 4,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bootstrap,
            "bootstrap_room": random.getrandbits(63),
        }
        prefill_answer = _posted_in_background(prefill.base_url + "/v1/completions", body)
        payload = json.dumps(body).encode()
        decode_client = socket.create_connection(("127.0.0.1", urlsplit(decode.base_url).port))
        decode_client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(payload) + payload
        )
        deadline = time.monotonic() + 60
        while (
            prefill.metric('kubesgl_disagg_requests{role="prefill",state="prefilling"}') < 1
            or decode.metric('kubesgl_disagg_requests{role="decode",state="awaiting_kv"}') < 1
        ):
            assert time.monotonic() < deadline and not prefill_answer.done(), prefill_answer
            time.sleep(0.02)
        decode_client.close()  # the client leaves
        answer = prefill_answer.result(timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] == "abort"
        prefill.wait_idle()
        assert prefill.metric('kubesgl_disagg_failures_total{reason="aborted"}') == 1
        assert prefill.metric('kubesgl_disagg_failures_total{reason="refused"}') == 0
        assert prefill.metric('kubesgl_requests_total{finish_reason="abort"}') == 1
        assert decode.metric('kubesgl_disagg_failures_total{reason="aborted"}') == 1
        assert prefill.metric('kubesgl_request_errors_total{status="502"}') == 0  # exported at 0
    finally:
        for server in (prefill, decode):
            if server.process.poll() is None:
                os.killpg(server.process.pid, signal.SIGKILL)


def _post_quietly(server, body: dict) -> None:
    try:
        httpx.post(server.base_url + "/generate", json=body, timeout=120)
    except httpx.HTTPError:
        pass  # its engine is killed on purpose


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_pd_on_one_gpu_moves_kv_vram_to_vram_and_equals_a_mixed_engine(
    backend, tiny_model, tmp_path
):
    if backend == "flashinfer":
        pytest.importorskip(
            "flashinfer", reason="FlashInfer is not installed (pip install 'kubesgl[flashinfer]')"
        )
    model = tiny_model("llama", head_dim=64)
    gpu = (
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--attention-backend",
        backend,
        "--page-size",
        "16",
    )
    mixed = start_server(model, "--served-model-name", MODEL_NAME, *gpu, tmp_path=tmp_path)
    prefill, decode, bootstrap = start_pd_pair(model, tmp_path, prefill_args=gpu, decode_args=gpu)
    try:
        rng = random.Random(3)
        for length in (5, 100, 700):
            prompt = [rng.randrange(3, 600) for _ in range(length)]
            room = random.getrandbits(63)
            body = {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
            }
            paired = {
                **body,
                "bootstrap_host": "127.0.0.1",
                "bootstrap_port": bootstrap,
                "bootstrap_room": room,
            }
            answers = send_to_both(prefill, decode, "/generate", paired)
            want = httpx.post(mixed.base_url + "/generate", json=body, timeout=120).json()[
                "output_ids"
            ]
            assert answers["d"].json()["output_ids"] == want, length
        assert prefill.metric("kubesgl_kv_transfer_bytes_total") > 0
        for server in (prefill, decode):
            server.wait_idle()
    finally:
        for server in (mixed, prefill, decode):
            server.stop()


@pytest.mark.slow
def test_tensor_parallel_prefill_and_decode_pair_rank_by_rank(pd_stack, tiny_model, tmp_path):
    """TP 2 on both sides (gloo on the CPU): each prefill rank writes its shard of the heads
    into the same decode rank, and the output equals a TP 1 mixed engine's."""
    _, mixed, _, _ = pd_stack
    tp = ("--tp-size", "2")
    prefill, decode, bootstrap = start_pd_pair(
        tiny_model("llama"), tmp_path, prefill_args=tp, decode_args=tp
    )
    try:
        rng = random.Random(0)
        for length in (5, 300):
            body = {
                "input_ids": [rng.randrange(10, 600) for _ in range(length)],
                "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
            }
            paired = {
                **body,
                "bootstrap_host": "127.0.0.1",
                "bootstrap_port": bootstrap,
                "bootstrap_room": random.getrandbits(63),
            }
            answers = send_to_both(prefill, decode, "/generate", paired)
            assert answers["d"].status_code == 200, answers["d"].text
            assert (
                answers["d"].json()["output_ids"]
                == httpx.post(mixed.base_url + "/generate", json=body).json()["output_ids"]
            )
        for server in (prefill, decode):
            server.wait_idle()
    finally:
        for server in (prefill, decode):
            assert server.stop() == 0
