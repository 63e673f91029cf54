import json

import pytest

from kubesgl.router.errors import RouterError
from kubesgl.router.request_parsing import parse_generation_request


def parse(path: str, body: object):
    return parse_generation_request(path, json.dumps(body).encode())


def test_chat_routing_text_keeps_roles_and_order():
    a = parse(
        "/v1/chat/completions",
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]},
    )
    b = parse(
        "/v1/chat/completions",
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "R"}]},
    )
    assert a.routing_text.startswith("system") and a.routing_text != b.routing_text
    common = len(a.routing_text) - 2
    assert a.routing_text[:common] == b.routing_text[:common]


def test_content_parts_and_prompts():
    parts = parse(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    )
    assert "hi" in parts.routing_text
    assert parse("/v1/completions", {"prompt": "abc"}).routing_text == "abc"
    ids = parse("/v1/completions", {"prompt": [1, 2, 3]})
    assert ids.routing_text == "\x01\x02\x03" and ids.choices == 1
    assert parse("/v1/completions", {"prompt": ["a", "b"]}).choices == 2
    assert parse("/v1/completions", {"prompt": ["a", "b"], "n": 3}).choices == 6
    assert parse("/generate", {"input_ids": [[5], [6]]}).choices == 2
    assert parse("/generate", {"text": "t", "sampling_params": {"n": 1}, "n": 2}).choices == 1
    assert parse("/v1/completions", {"prompt": "p", "stream": True}).stream


def test_a_null_reads_as_the_field_left_out():
    """OpenAI allows null for optional fields, and clients forwarding unset options send it."""
    plain = parse("/v1/completions", {"prompt": "p", "stream": None, "n": None})
    assert not plain.stream and plain.choices == 1
    assert parse("/generate", {"text": "t", "sampling_params": None}).choices == 1


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
        ("/v1/completions", {}, "prompt"),
        ("/v1/completions", {"prompt": [1, "x"]}, "prompt"),
        ("/v1/completions", {"prompt": [-1]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "n": 2.5}, "n"),
        ("/v1/completions", {"prompt": "x", "n": True}, "n"),
        ("/v1/completions", {"prompt": "x", "n": "2"}, "n"),
        ("/v1/completions", {"prompt": "x", "n": 65}, "n"),  # the engines' limit
        ("/v1/completions", {"prompt": "x", "n": 1e300}, "n"),
        ("/v1/completions", {"prompt": "x", "stream": 1}, "stream"),
        ("/generate", {}, "text"),
        ("/generate", {"text": "x", "sampling_params": []}, "sampling_params"),
        ("/generate", {"text": "x", "sampling_params": {"n": "2"}}, "sampling_params.n"),
        ("/generate", {"text": "x", "sampling_params": {"n": 3}}, "sampling_params.n"),
    ],
)
def test_bad_requests_are_400_naming_the_parameter(path, body, param):
    with pytest.raises(RouterError) as caught:
        parse(path, body)
    assert caught.value.status == 400 and caught.value.param == param


DEEPLY_NESTED = b'{"prompt": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize(
    "raw", [b"{", b"[1, 2]", b"\xff", pytest.param(DEEPLY_NESTED, id="deeply-nested")]
)
def test_non_object_bodies_are_400(raw):
    with pytest.raises(RouterError) as caught:
        parse_generation_request("/v1/completions", raw)
    assert caught.value.status == 400


def test_an_empty_body_is_named_as_such():
    """As an engine names it; it was 'not valid JSON: Expecting value: line 1 column 1'."""
    with pytest.raises(RouterError) as caught:
        parse_generation_request("/v1/completions", b"")
    assert caught.value.status == 400
    assert caught.value.message == "the request body is empty: send a JSON object"


def pd_route(body: dict) -> str:
    """The P/D route of a completions request with one prefill and one decode worker."""
    from kubesgl.router.metrics import RouterMetrics
    from kubesgl.router.policies import Choice, make_policy
    from kubesgl.router.routing import (
        DisaggregationSettings,
        Forwarder,
        Policies,
        RetrySettings,
    )
    from kubesgl.router.upstream import UpstreamClient
    from kubesgl.router.workers import Role, WorkerRegistry

    workers = WorkerRegistry()
    prefill = workers.add("http://p:1", Role.PREFILL)
    decode = workers.add("http://d:1", Role.DECODE)
    metrics = RouterMetrics(workers)
    policy = make_policy("round_robin")
    forwarder = Forwarder(
        workers,
        Policies(policy, policy, policy),
        UpstreamClient(None, metrics),  # type: ignore[arg-type]  # nothing is sent
        metrics,
        RetrySettings(),
        DisaggregationSettings(min_prefill_tokens=128),
    )
    request = parse("/v1/completions", body)
    return forwarder._pd_route(request, [prefill], Choice(decode), [prefill])


def test_a_batch_of_prompts_is_short_only_if_all_of_them_together_are():
    """The decode worker alone prefills every prompt of a batch: the first prompt's length
    alone sent a batch behind a short first prompt (or of many short ones) there."""
    long = "lorem ipsum " * 100  # 1200 characters: about 300 tokens
    assert pd_route({"prompt": ["hi", "yo"]}) == "decode_only_short"
    assert pd_route({"prompt": ["hi", "yo"], "n": 8}) == "decode_only_short"  # one prefill each
    assert pd_route({"prompt": ["hi", long, long]}) == "disaggregated"
    assert pd_route({"prompt": ["hi"] + ["a short question"] * 40}) == "disaggregated"
    assert pd_route({"prompt": [[1] * 10, [2] * 200]}) == "disaggregated"
    assert pd_route({"prompt": [[1] * 10, [2] * 10]}) == "decode_only_short"
