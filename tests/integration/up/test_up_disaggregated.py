"""`kubesgl up -f examples/quickstart.yaml`, the README's first command: the tiny model made
into the cache, a prefill and a decode engine behind the router, answers through the OpenAI SDK
equal to a plain engine's, every request through both engines; a killed replica is restarted;
Ctrl-C leaves no process behind. One stack for the whole module, stopped by the last test."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from up_harness import CHAT, MAX_TOKENS, PROMPTS, RunningUp, descendants, listening_addresses

from kubesgl import contract
from kubesgl.up.status import read_counters

QUICKSTART = Path(__file__).resolve().parents[3] / "examples" / "quickstart.yaml"


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("up-quickstart")
    up = RunningUp(QUICKSTART, tmp_path, env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    up.wait_for(r"ready in [\d.]+ s: OpenAI base URL ")
    yield up
    up.kill()


def engine_url(up: RunningUp, name: str) -> str:
    return up.wait_for(rf"^\S+ {name}: ready on (\S+)(?: \(bootstrap port \d+\))?$").group(1)


def test_answers_through_the_sdk_equal_a_plain_engine_through_both_engines(
    quickstart, plain_engine_answers
):
    output = quickstart.output()
    assert "making the model, once: " in output and "make-tiny-model" in output
    assert f"OpenAI base URL: {quickstart.base_url}/v1" in output
    client = openai.OpenAI(base_url=quickstart.base_url + "/v1", api_key="none", max_retries=0)
    for prompt in PROMPTS:
        answer = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert answer.choices[0].text == plain_engine_answers[prompt]
    chat = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert chat.choices[0].message.content == plain_engine_answers["chat"]

    # pdMinPrefillTokens: 0 in the quickstart: each short prompt too was prefilled by the prefill
    # engine and its KV written into the decode engine
    with httpx.Client() as http:
        prefill = read_counters(http, engine_url(quickstart, "prefill-0"), contract.PREFILL)
        decode = read_counters(http, engine_url(quickstart, "decode-0"), contract.DECODE)
        router = read_counters(http, quickstart.base_url, contract.ROUTER)
        routes = http.get(quickstart.base_url + "/metrics").text
    assert prefill.requests == decode.requests == router.requests == len(PROMPTS) + 1
    assert decode.tokens == (len(PROMPTS) + 1) * MAX_TOKENS
    assert f'kubesgl_router_pd_routes_total{{route="disaggregated"}} {len(PROMPTS) + 1}.0' in routes


def test_every_process_listens_on_loopback_only(quickstart):
    """The engines' scheduler processes listened on the host's external address too: UCX's TCP
    transport (NIXL's, for the KV) takes every network device unless UCX_NET_DEVICES says."""
    addresses = listening_addresses(descendants(quickstart.process.pid))
    assert addresses == {"127.0.0.1"}


def test_a_killed_replica_is_restarted_and_serves_again(quickstart, plain_engine_answers):
    before = len(quickstart.output())
    killed = quickstart.engine_pid("decode-0")
    os.kill(killed, signal.SIGKILL)
    quickstart.wait_for(r"decode-0: exited \(killed by SIGKILL\); restarting now$", after=before)
    quickstart.wait_for(r"decode-0: ready on ", after=before)
    assert quickstart.engine_pid("decode-0") != killed
    deadline = time.monotonic() + 60  # up told the router (SIGUSR1): it takes it back at once
    while (
        answer := quickstart.completion(PROMPTS[0])
    ).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert (
        answer.status_code == 200
        and answer.json()["choices"][0]["text"] == plain_engine_answers[PROMPTS[0]]
    )


def test_ctrl_c_stops_everything_and_leaves_no_process(quickstart):
    status, left = quickstart.interrupt()
    assert status == 0
    assert left == []
    output = quickstart.output()
    assert output.index("router: stopped") < output.index("prefill-0: stopped")
    assert "decode-0: stopped" in output
