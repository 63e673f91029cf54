"""One request cannot hold up the others (issue 11, item 4): beside a steady stream of normal
requests, each hostile request is refused at once (or, within the limits, served without
slowing the rest), and the normal requests keep completing. Before the limits, `prompt:
["a"]*500, n: 64` queued 32,000 sub-requests, 16 stop strings of 100 KB made every step search
the output, and a 5 MB prompt was tokenized in full before its length was checked: each held
the normal requests for seconds.

The server takes its API key from the environment (item 6): it is required, and it shows
in no command line, no child's environment and no log line."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from serve_harness import process_tree_alive, start_server

KEY = "sk-from-the-environment-5b1f"
BODY_LIMIT = 4 * 1024 * 1024
MB = 1_000_000


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    server = start_server(
        tiny_model("llama"),
        "--served-model-name",
        "tiny",
        "--max-request-body-bytes",
        str(BODY_LIMIT),
        tmp_path=tmp_path_factory.mktemp("limits"),
        env={"KUBESGL_API_KEY": KEY},
    )
    yield server
    assert server.stop() == 0


def _client(server, **kwargs) -> httpx.Client:
    return httpx.Client(
        base_url=server.base_url, headers={"authorization": f"Bearer {KEY}"}, timeout=60, **kwargs
    )


class NormalTraffic:
    """Normal requests one after another, in a thread, with their latencies."""

    def __init__(self, server):
        self.server, self.latencies, self.failures = server, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with _client(self.server) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                response = client.post(
                    "/v1/completions",
                    json={
                        "model": "tiny",
                        "prompt": "hello there",
                        "max_tokens": 8,
                        "ignore_eos": True,
                    },
                )
                self.latencies.append(time.monotonic() - started)
                if (
                    response.status_code != 200
                    or response.json()["usage"]["completion_tokens"] != 8
                ):
                    self.failures.append(response.text)

    def __enter__(self) -> NormalTraffic:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


HOSTILE = [
    ("500 prompts x n=64", "/v1/completions", {"prompt": ["a"] * 500, "n": 64}, 400, "n"),
    (
        "16 stop strings of 100 KB",
        "/v1/completions",
        {"prompt": "hi", "stop": ["x" * 100_000] * 16, "max_tokens": 1000, "ignore_eos": True},
        400,
        "stop",
    ),
    ("a 1 MB prompt", "/v1/completions", {"prompt": "ab " * (MB // 3)}, 400, "prompt"),
    (
        "a 1 MB prompt in a list",
        "/v1/completions",
        {"prompt": ["fine", "ab " * (MB // 3)]},
        400,
        "prompt.1",
    ),
    (
        "a 1 MB chat message",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "ab " * (MB // 3)}]},
        400,
        "messages",
    ),
    ("a 1 MB /generate text", "/generate", {"text": "ab " * (MB // 3)}, 400, "text"),
    ("a 5 MB body", "/v1/completions", {"prompt": "ab " * (5 * MB // 3)}, 413, None),
]


def test_hostile_requests_are_refused_at_once_while_normal_requests_go_on(server):
    with _client(server) as client:
        idle = []
        for _ in range(5):
            started = time.monotonic()
            assert (
                client.post(
                    "/v1/completions",
                    json={
                        "model": "tiny",
                        "prompt": "hello there",
                        "max_tokens": 8,
                        "ignore_eos": True,
                    },
                ).status_code
                == 200
            )
            idle.append(time.monotonic() - started)
        with NormalTraffic(server) as normal:
            time.sleep(0.5)
            for name, path, body, status, param in HOSTILE:
                if path != "/generate":
                    body = {"model": "tiny", **body}
                started = time.monotonic()
                response = client.post(
                    path, content=json.dumps(body), headers={"content-type": "application/json"}
                )
                took = time.monotonic() - started
                assert response.status_code == status, (name, response.text[:300])
                error = response.json()["error"]
                assert error["param"] == param, (name, error)
                assert took < 5, f"{name}: answered in {took:.1f} s"
            # a body without a Content-Length is refused once it passes the limit
            chunks = (b"x" * 65536 for _ in range(5 * MB // 65536))
            response = client.post(
                "/v1/completions", content=chunks, headers={"content-type": "application/json"}
            )
            assert (
                response.status_code == 413
                and response.json()["error"]["code"] == "request_too_large"
            )
            time.sleep(0.5)
    assert not normal.failures, normal.failures[:3]
    assert len(normal.latencies) >= 5
    worst = max(normal.latencies)
    # before the limits the normal requests waited for seconds; here they go on as if idle
    # (the bound is loose for a shared 2-core machine)
    assert worst < max(3.0, 10 * max(idle)), (f"worst {worst:.2f} s", f"idle {max(idle):.2f} s")
    server.wait_idle()


def test_stop_strings_within_the_limits_are_matched_without_holding_up_the_others(server):
    """16 stop strings of the longest length allowed, over a long output: the stop matching
    reads each new character once, so the output and the normal requests beside it go on."""
    stops = [f"{i:02d}" + "q" * 1022 for i in range(16)]  # 1024 characters each, never produced
    with _client(server) as client:
        # The scheduler loads its tokenizer when the first request with a stop string arrives (seconds
        # here, and everyone waits): not what this test measures.
        assert (
            client.post(
                "/v1/completions", json={"prompt": "hi", "stop": ["zz"], "max_tokens": 2}
            ).status_code
            == 200
        )
    with _client(server) as client, NormalTraffic(server) as normal:
        response = client.post(
            "/v1/completions",
            json={
                "model": "tiny",
                "prompt": "hi",
                "stop": stops,
                "max_tokens": 1500,
                "ignore_eos": True,
            },
        )
        assert response.status_code == 200, response.text[:300]
        choice = response.json()["choices"][0]
        assert (
            choice["finish_reason"] == "length"
            and response.json()["usage"]["completion_tokens"] == 1500
        )
        answer = client.post(
            "/v1/completions",
            json={
                "model": "tiny",
                "prompt": "hi",
                "stop": [choice["text"][40:45]],
                "max_tokens": 1500,
                "ignore_eos": True,
                "temperature": 0,
            },
        )
    assert not normal.failures and normal.latencies
    assert max(normal.latencies) < 5, max(normal.latencies)
    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] in (
        "stop",
        "length",
    )
    server.wait_idle()


def test_the_api_key_from_the_environment_is_required_and_never_shown(server):
    assert (
        httpx.post(
            server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}
        ).status_code
        == 401
    )
    wrong = httpx.post(
        server.base_url + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 2},
        headers={"authorization": "Bearer sk-wrong"},
    )
    assert wrong.status_code == 401
    with _client(server) as client:
        assert (
            client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code
            == 200
        )
        assert KEY not in client.get("/server_info").text
    pids = [server.process.pid, *process_tree_alive(server.process.pid)]
    assert len(pids) >= 3  # the server, its scheduler and its tokenizer
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert KEY.encode() not in f.read(), f"the key is in the command line of {pid}"
    for pid in pids[1:]:  # the children were started without it
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert KEY.encode() not in f.read(), f"the key is in the environment of child {pid}"
    assert KEY not in server.log()
