"""bootstrap_host / bootstrap_port / bootstrap_room on a request: one target per choice, in
the forms SGLang's router and kubesgl's send (one per choice, one per prompt, one for all)."""

from __future__ import annotations

import pytest

from kubesgl.contract import MAX_BOOTSTRAP_ROOM
from kubesgl.engine.messages import BootstrapTarget
from kubesgl.engine.sampling_params import InvalidRequestError
from kubesgl.engine.server.protocol import CompletionRequest


def targets(prompts: int, n: int, **fields) -> list[BootstrapTarget | None]:
    body = CompletionRequest(prompt=["p"] * prompts if prompts > 1 else "p", n=n, **fields)
    return body.bootstrap_targets(prompts, n, default_port=8998)


def test_no_room_means_no_targets_and_a_lone_host_is_refused():
    assert targets(2, 2) == [None] * 4
    with pytest.raises(InvalidRequestError) as caught:
        targets(1, 1, bootstrap_host="p")
    assert caught.value.param == "bootstrap_room"


def test_one_room_for_all_numbers_the_copies_as_sglang_does():
    assert targets(1, 3, bootstrap_host="p", bootstrap_room=10) == [
        BootstrapTarget(10, "p", 8998),
        BootstrapTarget(11, "p", 8998),
        BootstrapTarget(12, "p", 8998),
    ]
    assert [
        t.room for t in targets(1, 2, bootstrap_host="p", bootstrap_room=MAX_BOOTSTRAP_ROOM)
    ] == [
        MAX_BOOTSTRAP_ROOM,
        0,
    ]


def test_rooms_per_prompt_number_each_prompts_copies_and_per_choice_are_taken_as_given():
    per_prompt = targets(
        2, 2, bootstrap_host=["a", "b"], bootstrap_port=[1, None], bootstrap_room=[100, 200]
    )
    assert [(t.room, t.host, t.port) for t in per_prompt] == [
        (100, "a", 1),
        (101, "a", 1),
        (200, "b", 8998),
        (201, "b", 8998),
    ]
    per_choice = targets(2, 2, bootstrap_host="h", bootstrap_room=[5, 9, 7, 3])
    assert [t.room for t in per_choice] == [5, 9, 7, 3]


def test_lists_that_fit_neither_choices_nor_prompts_are_refused():
    with pytest.raises(InvalidRequestError, match="3 values for 2 prompts x n=2") as caught:
        targets(2, 2, bootstrap_host="h", bootstrap_room=[1, 2, 3])
    assert caught.value.param == "bootstrap_room"
