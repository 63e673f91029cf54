"""How answers and stream chunks are shaped: what a chunk carries, and the same figures
streamed as in the whole answer."""

from __future__ import annotations

from kubesgl.engine.messages import FinishReason, TextOutput, TokenLogprob
from kubesgl.engine.server.openai_format import (
    ChatFormatter,
    Choice,
    CompletionFormatter,
    NativeFormatter,
    ToolOutput,
)
from kubesgl.engine.server.tool_calls import FORMATS


def output(
    text: str, token: str | None, i: int, last: bool, held: bool | None = None
) -> TextOutput:
    """The i-th token's output: its text, and its logprob entry when `token` is given. A token
    without text has it held back (part of a character), unless `held` says otherwise."""
    logprobs = (
        dict(
            logprobs=[TokenLogprob(i, -0.5)],
            token_strings=[token],
            top_strings=[[]],
            token_bytes=[list(token.encode())],
            top_bytes=[[]],
        )
        if token is not None
        else {}
    )
    reason = FinishReason("length") if last else None
    held = not text if held is None else held
    return TextOutput("r", text, [i], reason, 1, 0, i + 1, **logprobs, text_held=held)


def test_a_stream_sends_no_chunk_for_a_token_that_brings_no_text():
    """A token that ends inside a character (its bytes are held until the character is whole)
    brings no text: no chunk goes out for it, unless it carries logprobs or the finish."""

    def sent(formatter, pieces: list[str]) -> list[dict | None]:
        choice, chunks = Choice(index=0), []
        for i, piece in enumerate(pieces):
            out = output(piece, None, i, i == len(pieces) - 1)
            choice.add(out)
            chunks.append(formatter.chunk(choice, out))
        return chunks

    for formatter in (
        ChatFormatter({"id": "x"}, False),
        ChatFormatter(
            {"id": "x"}, False, ToolOutput("auto", format=FORMATS[0], declared=frozenset())
        ),
        CompletionFormatter({"id": "x"}, False),
    ):
        chunks = sent(formatter, ["a", "", "\u00e9", ""])
        assert chunks[1] is None
        assert chunks[3] is not None  # the finish goes out even with no text
        assert chunks[3]["choices"][0]["finish_reason"] == "length"


def test_each_token_of_an_engine_without_a_tokenizer_is_a_chunk():
    """Its tokens bring no text and hold none back: each is news (the answer's progress, which a
    benchmark times), not text to come later."""
    formatter, choice = CompletionFormatter({"id": "x"}, False), Choice(index=0)
    chunks = []
    for i in range(3):
        out = output("", None, i, i == 2, held=False)
        choice.add(out)
        chunks.append(formatter.chunk(choice, out))
    assert [c["choices"][0]["text"] if c else None for c in chunks] == ["", "", ""]


def test_streamed_text_offsets_count_tokens_as_the_whole_answer_does():
    """A token whose text is held back (part of a character, a possible stop string) has its
    logprob sent before its text: offsets count the tokens, not the text sent so far."""
    tokens = ["ab", "\ufffd", "\ufffd", "c", " stop", "d"]
    texts = ["ab", "", "\u00e9", "c", "", " stopd"]  # the detokenizer's releases
    formatter = CompletionFormatter({"id": "x"}, True)
    choice, streamed = Choice(index=0), []
    for i, (text, token) in enumerate(zip(texts, tokens)):
        out = output(text, token, i, i == len(tokens) - 1)
        choice.add(out)
        streamed += formatter.chunk(choice, out)["choices"][0]["logprobs"]["text_offset"]
    whole = formatter.final([choice], {})["choices"][0]["logprobs"]["text_offset"]
    assert streamed == whole == [0, 2, 3, 4, 5, 10]


def test_completion_top_logprobs_name_the_sampled_token():
    """OpenAI's completions: "up to logprobs + 1 elements", the sampled token always among
    them; `logprobs: 0` gave empty dicts."""
    formatter = CompletionFormatter({"id": "x"}, True)
    choice = Choice(index=0)
    out = TextOutput(
        "r",
        "ab",
        [7, 8],
        FinishReason("length"),
        1,
        0,
        2,
        logprobs=[TokenLogprob(7, -0.5, [(9, -0.1)]), TokenLogprob(8, -0.2, [(8, -0.2)])],
        token_strings=["a", "b"],
        top_strings=[["z"], ["b"]],
        token_bytes=[[97], [98]],
        top_bytes=[[[122]], [[98]]],
    )
    choice.add(out)
    tops = formatter.final([choice], {})["choices"][0]["logprobs"]["top_logprobs"]
    assert tops == [{"z": -0.1, "a": -0.5}, {"b": -0.2}]
    # two tokens that read alike (parts of characters): the top one's entry stays
    same = TextOutput(
        "r", "", [7], None, 1, 0, 1,
        logprobs=[TokenLogprob(7, -0.5, [(9, -0.1)])],
        token_strings=["\ufffd"],
        top_strings=[["\ufffd"]],
        token_bytes=[[0xE6]],
        top_bytes=[[[0xE5]]],
    )  # fmt: skip
    assert CompletionFormatter({"id": "x"}, True).chunk(Choice(index=0), same)["choices"][0][
        "logprobs"
    ]["top_logprobs"] == [{"\ufffd": -0.1}]
    none = CompletionFormatter({"id": "x"}, True)
    out.logprobs = [TokenLogprob(7, -0.5), TokenLogprob(8, -0.2)]
    out.top_strings, out.top_bytes = [[], []], [[], []]
    assert none.chunk(Choice(index=0), out)["choices"][0]["logprobs"]["top_logprobs"] == [
        {"a": -0.5},
        {"b": -0.2},
    ]


def no_errors_counted(status: int) -> None:
    raise AssertionError(f"no error event expected, got one of status {status}")


async def never_ended(index: int, why: str) -> None:
    raise AssertionError(f"choice {index} ended by the server: {why}")


def test_a_stream_holding_its_text_back_sends_keepalive_comments(monkeypatch):
    """A named tool call streams nothing until its arguments are whole: an SSE comment (which
    clients skip) goes out instead, so that proxies do not close the connection as idle."""
    import asyncio

    from kubesgl.engine.server import responses

    monkeypatch.setattr(responses, "HELD_STREAM_KEEPALIVE_S", 0.0)
    formatter = ChatFormatter({"id": "x"}, False, ToolOutput("named", name="f"))
    stop = FinishReason("stop", matched_token=2)
    outputs = [output('{"a": ', None, 0, False), TextOutput("r", "1}", [1], stop, 1, 0, 2)]

    async def rest():
        yield outputs[1]

    async def events() -> list[str]:
        stream = responses.stream_events(
            [rest()],
            [outputs[0]],
            [Choice(index=0)],
            {0},
            False,
            formatter,
            no_errors_counted,
            end=never_ended,
        )
        return [event async for event in stream]

    sent = asyncio.run(events())
    assert sent[0].startswith("data: ") and "assistant" in sent[0]  # the role
    assert sent[1] == responses.SSE_KEEPALIVE  # the arguments held back
    assert '"tool_calls"' in sent[2] and sent[-1] == "data: [DONE]\n\n"


def test_a_token_with_logprobs_and_no_text_still_carries_content():
    """Sent for its logprobs, mid-stream, with `content: ""` as before: code that appends each
    chunk's content must not meet None before the last chunk."""
    formatter = ChatFormatter({"id": "x"}, True)
    out = output("", "\ufffd", 0, False)
    choice = Choice(index=0)
    choice.add(out)
    (sent,) = formatter.chunk(choice, out)["choices"]
    assert sent["delta"] == {"content": ""} and sent["logprobs"]["content"]


def test_each_choice_of_a_chat_stream_has_its_own_role_chunk():
    """As OpenAI and vLLM stream n > 1: one role delta per choice index, each chunk one choice
    (clients that read choices[0] of each chunk see every choice's role)."""
    starts = ChatFormatter({"id": "x"}, False).stream_start(3)
    assert [[c["index"] for c in chunk["choices"]] for chunk in starts] == [[0], [1], [2]]
    assert all(chunk["choices"][0]["delta"]["role"] == "assistant" for chunk in starts)


def _streamed(formatter, outputs: list[TextOutput], include_usage: bool) -> list[dict]:
    """The JSON events of a one-choice stream of `outputs`, [DONE] left out."""
    import asyncio
    import json

    from kubesgl.engine.server import responses

    async def rest():
        for out in outputs[1:]:
            yield out

    async def events() -> list[str]:
        stream = responses.stream_events(
            [rest()],
            [outputs[0]],
            [Choice(index=0)],
            {0},
            include_usage,
            formatter,
            no_errors_counted,
            end=never_ended,
        )
        return [event async for event in stream]

    sent = asyncio.run(events())
    assert sent[-1] == "data: [DONE]\n\n"
    return [json.loads(event.removeprefix("data: ")) for event in sent[:-1]]


def test_with_include_usage_every_chunk_but_the_last_has_usage_null():
    """OpenAI's stream_options.include_usage: "All other chunks will also include a usage
    field, but with a null value" (code that tests `chunk.usage !== null` must not read a
    missing field as usage). Without it, no chunk has the field."""
    outputs = [output("a", None, 0, False), output("b", None, 1, True)]
    for formatter in (ChatFormatter({"id": "x"}, False), CompletionFormatter({"id": "x"}, False)):
        *chunks, last = _streamed(formatter, outputs, include_usage=True)
        assert chunks and all("usage" in c and c["usage"] is None for c in chunks)
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2
        assert all("usage" not in c for c in _streamed(formatter, outputs, include_usage=False))


def test_text_offsets_of_an_engine_without_a_tokenizer_count_no_placeholders(tiny_model, tmp_path):
    """Its tokens are named "token_id:N" and bring no text: every offset into the text
    returned (empty) is 0, streamed and whole, not the placeholders' lengths summed."""
    import shutil

    from kubesgl.engine.messages import TokenizeRequest, TokenOutput
    from kubesgl.engine.sampling_params import SamplingParams
    from kubesgl.engine.tokenizer.process import Tokenizer

    path = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model("llama"), path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    tokenizer = Tokenizer(str(path))
    tokenizer.start(TokenizeRequest("r", SamplingParams(), input_ids=[5]))
    formatter, choice, streamed = CompletionFormatter({"id": "x"}, True), Choice(index=0), []
    for i, token_id in enumerate((11, 12, 13)):
        reason = FinishReason("length") if i == 2 else None
        out = tokenizer.decode(TokenOutput("r", [token_id], reason, [TokenLogprob(token_id, -1.0)]))
        choice.add(out)
        streamed += formatter.chunk(choice, out)["choices"][0]["logprobs"]["text_offset"]
    whole = formatter.final([choice], {})["choices"][0]
    assert whole["text"] == "" and whole["logprobs"]["tokens"][0] == "token_id:11"
    assert streamed == whole["logprobs"]["text_offset"] == [0, 0, 0]


def test_generate_answers_the_top_logprobs_it_was_asked_for():
    """SGLang's /generate with return_logprob and top_logprobs_num: meta_info holds each
    token's alternatives in output_top_logprobs, as [logprob, token id, text], beside
    output_token_logprobs (they were computed, then dropped from the answer)."""
    out = TextOutput(
        "r",
        "ab",
        [7, 8],
        FinishReason("length"),
        1,
        0,
        2,
        logprobs=[
            TokenLogprob(7, -0.5, [(7, -0.5), (3, -1.5)]),
            TokenLogprob(8, -0.25, [(8, -0.25), (4, -2.0)]),
        ],
        token_strings=["a", "b"],
        top_strings=[["a", "x"], ["b", "y"]],
        token_bytes=[[97], [98]],
        top_bytes=[[[97], [120]], [[98], [121]]],
    )
    choice = Choice(index=0)
    choice.add(out)
    meta = NativeFormatter("gen-1", top_logprobs=True).final([choice], {})["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.5, 7, "a"], [-0.25, 8, "b"]]
    assert meta["output_top_logprobs"] == [
        [[-0.5, 7, "a"], [-1.5, 3, "x"]],
        [[-0.25, 8, "b"], [-2.0, 4, "y"]],
    ]
    streamed = NativeFormatter("gen-1", top_logprobs=True).chunk(choice, out)["meta_info"]
    assert streamed["output_top_logprobs"] == meta["output_top_logprobs"]
    # without top_logprobs_num, as SGLang: the sampled tokens' logprobs only
    assert (
        "output_top_logprobs"
        not in NativeFormatter("gen-1", top_logprobs=False).final([choice], {})["meta_info"]
    )


def test_a_formatter_that_fails_mid_stream_ends_its_choice_with_an_error_event():
    """The 200 is sent: the failure is an SSE error event, counted as an error, and the stream
    still ends with [DONE] (it was a connection cut mid-body, counted nowhere); the choice's
    request is closed, and the other choices go on."""
    import asyncio
    import json

    from kubesgl.engine.server import responses

    class FailingChat(ChatFormatter):
        def chunk(self, choice: Choice, out: TextOutput) -> dict | None:
            if choice.index == 0 and out.text == "b":
                raise RecursionError("maximum recursion depth exceeded")
            return super().chunk(choice, out)

    formatter = FailingChat({"id": "x"}, False)
    closed: list[int] = []
    outputs = [[output(t, None, i, i == 2) for i, t in enumerate("abc")] for _ in range(2)]

    async def rest(index: int):
        try:
            for out in outputs[index][1:]:
                yield out
                await asyncio.sleep(0)
        finally:
            closed.append(index)

    async def end(index: int, why: str) -> None:
        ended.append(index)

    ended: list[int] = []

    async def events() -> list[str]:
        errors: list[int] = []
        stream = responses.stream_events(
            [rest(0), rest(1)],
            [outputs[0][0], outputs[1][0]],
            [Choice(index=0), Choice(index=1)],
            {0, 1},
            False,
            formatter,
            errors.append,
            end=end,
        )
        sent = [event async for event in stream]
        assert errors == [500]
        return sent

    sent = asyncio.run(events())
    assert sent[-1] == "data: [DONE]\n\n"
    bodies = [json.loads(event.removeprefix("data: ")) for event in sent[:-1]]
    (error,) = [b["error"] for b in bodies if "error" in b]
    assert error["type"] == "server_error" and "RecursionError" in error["message"]
    texts = [(c["index"], c["delta"].get("content")) for b in bodies for c in b.get("choices", [])]
    # each choice opens with its role chunk (content ""), then its text
    assert [t for i, t in texts if i == 0] == ["", "a"] and [t for i, t in texts if i == 1] == [
        "",
        "a",
        "b",
        "c",
    ]
    assert sorted(closed) == [0, 1] and ended == [0]


def test_stream_events_has_no_default_for_ending_a_choice():
    """Without `end`, a choice the server ends would only have its stream closed, which aborts
    its request as a client that left: every caller must say how the server ends one."""
    import inspect

    from kubesgl.engine.server import responses

    end = inspect.signature(responses.stream_events).parameters["end"]
    assert end.default is inspect.Parameter.empty


def test_stream_events_has_no_default_for_counting_error_events():
    """An error event goes out in a 200 answer, which the access middleware does not count as
    an error: a caller without `on_error` would count it nowhere."""
    import inspect

    from kubesgl.engine.server import responses

    on_error = inspect.signature(responses.stream_events).parameters["on_error"]
    assert on_error.default is inspect.Parameter.empty


def _ending(reason: FinishReason | None, i: int = 0) -> TextOutput:
    return TextOutput("r", "ab", [i], reason, 1, 0, i + 1)


# how a choice ended -> its stop_reason, as vLLM's: the stop string or stop_token_ids entry
# matched; null on EOS (or a grammar's end token) and on length
_STOP_REASONS = [
    (FinishReason("stop", matched_str="\n\n", matched_end=2), "\n\n"),
    (FinishReason("stop", matched_token=7, stop_token=True), 7),
    (FinishReason("stop", matched_token=2), None),
    (FinishReason("length"), None),
]


def test_every_choice_says_its_stop_reason_as_vllm():
    for reason, expected in _STOP_REASONS:
        for formatter in (
            ChatFormatter({"id": "x"}, False),
            CompletionFormatter({"id": "x"}, False),
        ):
            choice, out = Choice(index=0), _ending(reason)
            choice.add(out)
            (whole,) = formatter.final([choice], {})["choices"]
            (last,) = formatter.chunk(choice, out)["choices"]
            assert (whole["finish_reason"], whole["stop_reason"]) == (reason.kind, expected)
            assert (last["finish_reason"], last["stop_reason"]) == (reason.kind, expected)


def test_stream_chunks_before_the_last_have_stop_reason_null():
    """The key is on every choice of every chunk, as vLLM's: null until the one that ends it."""
    chat = ChatFormatter({"id": "x"}, False)
    (start,) = chat.stream_start(1)[0]["choices"]
    assert "stop_reason" in start and start["stop_reason"] is None
    for formatter in (chat, CompletionFormatter({"id": "x"}, False)):
        choice, out = Choice(index=0), _ending(None)
        choice.add(out)
        (mid,) = formatter.chunk(choice, out)["choices"]
        assert "stop_reason" in mid and mid["stop_reason"] is None


def test_a_chat_answer_of_tool_calls_keeps_the_stop_reason():
    formatter = ChatFormatter({"id": "x"}, False, ToolOutput("named", name="f"))
    choice = Choice(index=0)
    choice.add(_ending(FinishReason("stop", matched_token=7, stop_token=True)))
    (whole,) = formatter.final([choice], {})["choices"]
    assert (whole["finish_reason"], whole["stop_reason"]) == ("stop", 7)


def test_generate_says_what_a_stop_matched_as_sglang():
    """SGLang's meta_info.finish_reason: {"type": "stop", "matched": the string or token id},
    EOS included; other endings are their type alone."""
    expected = [
        {"type": "stop", "matched": "\n\n"},
        {"type": "stop", "matched": 7},
        {"type": "stop", "matched": 2},
        {"type": "length"},
    ]
    for (reason, _), finish in zip(_STOP_REASONS, expected):
        choice = Choice(index=0)
        choice.add(_ending(reason))
        body = NativeFormatter("r").final([choice], {})
        assert body["meta_info"]["finish_reason"] == finish
    assert NativeFormatter("r").final([Choice(index=0)], {})["meta_info"]["finish_reason"] is None
