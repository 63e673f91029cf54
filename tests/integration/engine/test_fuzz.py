"""Fuzzing a real engine: schemathesis draws valid and invalid requests for every operation of
the OpenAPI schema the server publishes, then a corpus of hostile values goes into every field
of every POST body. Not one answer may be a 5xx, and afterwards the engine still serves with no
running request and no KV held (what the robustness docs promise: no request harms the others).

KUBESGL_FUZZ_EXAMPLES sets schemathesis's examples per operation and mode (default 40)."""

from __future__ import annotations

import json
import os
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.generation import GenerationMode
from serve_harness import RunningServer

EXAMPLES = int(os.environ.get("KUBESGL_FUZZ_EXAMPLES", "40"))
HEADERS = {"authorization": "Bearer sk-test"}
# Valid requests may ask for thousands of tokens; these bound the work per example (the corpus
# below sends the extreme values) so that the fuzzing spends its time on variety, not on decoding.
GENERATION_BOUNDS = {
    "max_tokens": 16,
    "max_completion_tokens": 16,
    "max_new_tokens": 16,
    "n": 4,
    "best_of": 4,
    "top_logprobs": 5,
    "logprobs": 5,
}

HOSTILE_VALUES = [
    None,
    True,
    -1,
    0,
    2**63,
    -(2**63),
    2**64 + 1,
    1e308,
    -1e308,
    1e-320,
    "NaN",
    "Infinity",
    "",
    "\ud800",
    "\udfff a",
    "\x00",
    "\x00" * 64,
    "‮right-to-left",
    "🤖" * 100,
    "a" * 65536,
    [],
    [None],
    [[[[[[[[[[[]]]]]]]]]]],
    ["\ud800"],
    [-1],
    [2**40],
    {},
    {"": None},
    {"role": "system"},
    [{"role": "user", "content": "\ud800"}],
    [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}],
]

BASE_BODIES = {
    "/v1/completions": {"model": "tiny", "prompt": "hello", "max_tokens": 4},
    "/v1/chat/completions": {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
    },
    "/generate": {"text": "hello", "sampling_params": {"max_new_tokens": 4}},
}


def body_fields(schema: dict, path: str) -> list[str]:
    """The top-level fields of an operation's JSON body and of its nested `sampling_params`."""
    components = schema["components"]["schemas"]

    def properties(ref_holder: dict) -> dict:
        ref = ref_holder.get("$ref") or next(
            (s["$ref"] for s in ref_holder.get("anyOf", []) if "$ref" in s), None
        )
        return (
            components[ref.rsplit("/", 1)[1]].get("properties", {})
            if ref
            else ref_holder.get("properties", {})
        )

    request = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    fields = properties(request)
    nested = (
        [f"sampling_params.{name}" for name in properties(fields["sampling_params"])]
        if "sampling_params" in fields
        else []
    )
    return list(fields) + nested


def with_value(body: dict, field: str, value) -> dict:
    body = json.loads(json.dumps(body))
    target = body
    *parents, leaf = field.split(".")
    for parent in parents:
        target = target.setdefault(parent, {})
    target[leaf] = value
    return body


def assert_still_serving(server: RunningServer) -> None:
    answer = httpx.post(
        server.base_url + "/v1/completions",
        headers=HEADERS,
        timeout=60,
        json={"model": "tiny", "prompt": "still here", "max_tokens": 4},
    )
    assert answer.status_code == 200, answer.text
    server.wait_idle()


def bounded(case):
    """The case with its generation sizes clamped to GENERATION_BOUNDS where they are numbers."""
    for body in (
        case.body,
        case.body.get("sampling_params") if isinstance(case.body, dict) else None,
    ):
        if isinstance(body, dict):
            for name, bound in GENERATION_BOUNDS.items():
                if type(body.get(name)) is int and body[name] > bound:
                    body[name] = bound
    return case


@pytest.mark.parametrize(
    "mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"]
)
def test_schemathesis_finds_no_server_error(llama_server, mode):
    schema = schemathesis.openapi.from_url(llama_server.base_url + "/openapi.json")
    statuses: Counter = Counter()
    server_errors: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if mode == GenerationMode.NEGATIVE and not operation.body:
            continue  # no parameters and no body: nothing can be made invalid

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=mode).map(bounded))
        def call(case):
            response = case.call(base_url=llama_server.base_url, headers=HEADERS, timeout=120)
            statuses[response.status_code // 100] += 1
            if response.status_code >= 500:
                server_errors.append(
                    f"{case.operation.label} {case.body!r:.300} -> {response.status_code} {response.text:.300}"
                )

        call()
    assert server_errors == []
    assert statuses[4] > 0 and (mode == GenerationMode.NEGATIVE or statuses[2] > 0), statuses
    assert_still_serving(llama_server)


@pytest.mark.parametrize("path", list(BASE_BODIES))
def test_hostile_values_in_every_field_are_answered_without_a_server_error(llama_server, path):
    schema = httpx.get(llama_server.base_url + "/openapi.json").json()
    fields = body_fields(schema, path)
    assert len(fields) > 5, fields
    server_errors: list[str] = []
    with httpx.Client(base_url=llama_server.base_url, headers=HEADERS, timeout=120) as client:
        for field in fields:
            for value in HOSTILE_VALUES:
                body = with_value(BASE_BODIES[path], field, value)
                response = client.post(path, content=json.dumps(body))
                if response.status_code >= 500:
                    server_errors.append(
                        f"{field}={value!r:.60} -> {response.status_code} {response.text:.200}"
                    )
    assert server_errors == []
    assert_still_serving(llama_server)
