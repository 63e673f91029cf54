"""`kubesgl up` on a mixed spec: two replicas behind the router answer as a plain engine; SIGTERM
while one replica hangs (stopped, it cannot drain) still leaves no process behind, the hung one
killed after its pod's grace period."""

from __future__ import annotations

import os
import signal

import openai
import pytest
import yaml
from up_harness import CHAT, MAX_TOKENS, PROMPTS, RunningUp

from kubesgl.operator.render.engine import PRESTOP_SLEEP_SECONDS, engine_grace_period_seconds

SHUTDOWN_TIMEOUT_S = 1


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, tiny_model):
    tmp_path = tmp_path_factory.mktemp("up-mixed")
    spec = tmp_path / "mixed.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kubesgl.io/v1alpha1",
                "kind": "InferenceService",
                "metadata": {"name": "local-mixed"},
                "spec": {
                    "image": "ghcr.io/kubesgl/kubesgl:0.1.0",
                    "mode": "mixed",
                    "model": {"servedName": "tiny", "hostPath": {"path": tiny_model("llama")}},
                    "engine": {
                        "device": "cpu",
                        "maxTotalTokens": 4096,
                        "shutdownTimeoutSeconds": SHUTDOWN_TIMEOUT_S,
                    },
                    "mixed": {"replicas": 2},
                },
            }
        )
    )
    up = RunningUp(spec, tmp_path)
    up.wait_for(r"ready in [\d.]+ s: OpenAI base URL ")
    yield up
    up.kill()


def test_two_replicas_answer_as_a_plain_engine(mixed, plain_engine_answers):
    client = openai.OpenAI(base_url=mixed.base_url + "/v1", api_key="none", max_retries=0)
    for prompt in PROMPTS:
        answer = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert answer.choices[0].text == plain_engine_answers[prompt]
    streamed = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        == plain_engine_answers["chat"]
    )


def test_sigterm_with_a_hung_replica_leaves_no_process(mixed):
    os.kill(mixed.engine_pid("mixed-0"), signal.SIGSTOP)  # it cannot act on SIGTERM any more
    status, left = mixed.interrupt(signal.SIGTERM)
    assert status == 0 and left == []
    output = mixed.output()
    # its pod's grace period without the preStop pause: the drain, the engine's exit after it, slack
    budget = engine_grace_period_seconds(SHUTDOWN_TIMEOUT_S) - PRESTOP_SLEEP_SECONDS
    assert budget == SHUTDOWN_TIMEOUT_S + 22 + 5
    assert f"mixed-0: killed: it did not stop within {budget} s" in output
    assert "mixed-1: stopped" in output
