"""Merging the /v1/models answers of workers that serve different names into one list."""

from __future__ import annotations

import json

from kubesgl.router.breaker import CircuitBreaker
from kubesgl.router.model_list import cards_of, merged, served_sets
from kubesgl.router.upstream import BufferedReply
from kubesgl.router.workers import Role, Worker


def worker(*models: str) -> Worker:
    return Worker("http://10.0.0.1:30000", Role.MIXED, CircuitBreaker(), models=models)


def answer(body: object, status: int = 200) -> BufferedReply:
    return BufferedReply(status, [], json.dumps(body).encode())


def test_each_set_of_served_names_once_in_the_workers_order():
    """Order within a worker's list does not make another set; one that has not named its
    models yet is a set of its own (its engine's answer says what it serves)."""
    workers = [worker("b", "a"), worker(), worker("a", "b"), worker("a")]
    assert served_sets(workers) == [frozenset("ab"), frozenset(), frozenset("a")]


def test_cards_are_the_data_of_a_model_list():
    assert cards_of(answer({"object": "list", "data": [{"id": "a"}]})) == [{"id": "a"}]
    for not_a_list in (
        answer({"data": "a"}),
        answer(["a"]),
        answer({"data": [{"id": "a"}]}, status=204),
        BufferedReply(200, [], b"\x1f\x8b not json"),
        RuntimeError("failed"),
    ):
        assert cards_of(not_a_list) is None, not_a_list


def test_cards_merge_by_id_the_first_kept():
    reply = merged(
        [
            [{"id": "a", "owned_by": "x"}, {"id": "shared", "owned_by": "x"}],
            [{"id": "shared", "owned_by": "y"}, {"id": "b"}, {"object": "model"}, "c"],
        ]
    )
    assert (reply.status, reply.headers) == (200, [(b"content-type", b"application/json")])
    assert json.loads(reply.body) == {
        "object": "list",
        "data": [{"id": "a", "owned_by": "x"}, {"id": "shared", "owned_by": "x"}, {"id": "b"}],
    }
