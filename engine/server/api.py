"""The HTTP surface (docs/server.md): OpenAI chat completions and completions, SGLang's
/generate, /v1/models, /health, /metrics and vLLM's /tokenize, /detokenize and /version."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import (
    AsyncIterator,
    Mapping,
    Sequence,
)
from typing import Any, Protocol

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kubesgl import __version__
from kubesgl.contract import (
    KV_LAYOUT_HEADER,
    MAX_BODY_DEPTH,
    TOO_DEEP_BODY,
    nested_deeper_than,
)
from kubesgl.engine.messages import (
    BootstrapTarget,
    EngineInfo,
    Tokenized,
    TokenizeRequest,
)
from kubesgl.engine.sampling_params import SamplingParams, check_prompt_tokens
from kubesgl.engine.server import sglang_routes, tool_calls
from kubesgl.engine.server.access import RequestAccounting
from kubesgl.engine.server.context import (
    Ctx,
    ServerContext,
    ServerState,
    authorized,
    unavailable,
)
from kubesgl.engine.server.engine_client import DuplicateRequestId, EngineClient, EngineGone
from kubesgl.engine.server.errors import (
    APIError,
    answer_errors_as_openai,
    as_bad_request,
)
from kubesgl.engine.server.limits import (
    BodyLimit,
    check_prompt_chars,
    check_sequences,
    check_stop_strings,
)
from kubesgl.engine.server.openai_format import (
    ChatFormatter,
    CompletionFormatter,
    NativeFormatter,
    ToolOutput,
)
from kubesgl.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequestBody,
    GenerateRequestBody,
    TokenizeRequestBody,
)
from kubesgl.engine.server.responses import Stream, respond


def build_app(client: EngineClient, state: ServerState) -> FastAPI:
    app = FastAPI(title="kubesgl engine", docs_url=None, redoc_url=None)
    app.state.server_context = ServerContext(client, state)
    answer_errors_as_openai(app)
    app.add_middleware(BodyLimit, limit=state.config.max_request_body_bytes)
    app.add_middleware(RequestAccounting, metrics=client.metrics)  # outermost: sees the 413 too
    app.include_router(health_routes)
    app.include_router(sglang_routes.routes)
    app.include_router(api_routes)
    return app


async def shallow_body(request: Request) -> None:
    """Refuses a body nested deeper than MAX_BODY_DEPTH before the route validates it or
    sends any of it on (pickled to the tokenizer process, which fails from some 500 levels: a
    500). It checks what FastAPI read as JSON (Starlette keeps it on the request): a body of
    another type, or one a route without a body ignores, is not read for this."""
    if not hasattr(request, "_json"):
        return
    # No more brackets than the limit, none nests deeper (those in strings only count extra):
    # a prompt of token ids, however long, is not walked
    raw = await request.body()
    if raw.count(b"[") + raw.count(b"{") > MAX_BODY_DEPTH and nested_deeper_than(
        MAX_BODY_DEPTH, request._json
    ):
        raise APIError(400, TOO_DEEP_BODY)


def require_available(ctx: ServerContext, model: str | None = None) -> None:
    """A 503 while the server takes no request (loading, draining), else a 404 if `model`
    names another model than the one served."""
    if (why := unavailable(ctx)) is not None:
        raise APIError(503, why, "service_unavailable")
    if model is not None:
        require_model(ctx, model)


def require_model(ctx: ServerContext, model: str) -> None:
    """A 404 unless `model` is the served model's name."""
    served = ctx.state.served_model_name
    if model != served:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )


def engine_info(ctx: ServerContext) -> EngineInfo:
    info = ctx.client.info
    assert info is not None  # sent with `ready`, before which require_available answers 503
    return info


def validated(
    ctx: ServerContext, params: SamplingParams, names: Mapping[str, str] | None = None
) -> SamplingParams:
    with as_bad_request(names):
        params.validate(engine_info(ctx).vocab_size)
    return params


def within_limits(
    ctx: ServerContext,
    params: SamplingParams,
    texts: list[tuple[int, str]],
    token_prompts: Sequence[tuple[int, str]] = (),
    names: Mapping[str, str] | None = None,  # the client's names of the engine's fields
) -> None:
    """The request's size against the server's limits (limits.py) but its number of sequences
    (`bootstrap_targets`); `texts` holds the characters of each text prompt and the field that
    holds it, `token_prompts` the length of each prompt given as token ids and its field."""
    config = ctx.state.config
    context_length = engine_info(ctx).context_length
    with as_bad_request(names):
        check_stop_strings(config, params)
        for chars, param in texts:
            check_prompt_chars(config, context_length, chars, param)
        for tokens, param in token_prompts:
            check_prompt_tokens(context_length, tokens, param)


_MESSAGE_TEXT = ("content", "name", "tool_call_id")  # a template message's text fields


def chat_chars(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any] | None,
) -> int:
    """The characters a chat prompt renders from: the messages' text, names and the ids of the
    calls they answer, their earlier tool calls, the tools' definitions and the client's
    template variables (the template may write all of them into the prompt)."""
    chars = sum(len(m[key]) for m in messages for key in _MESSAGE_TEXT if key in m)
    chars += sum(len(json.dumps(m["tool_calls"])) for m in messages if "tool_calls" in m)
    chars += len(json.dumps(template_kwargs)) if template_kwargs else 0
    return chars + (len(json.dumps(tools)) if tools else 0)


def chat_prompt(
    body: ChatCompletionRequest | TokenizeRequestBody,
    params: SamplingParams,
    tools: list[dict[str, Any]] | None,
    add_special_tokens: bool | None = None,
) -> tuple[TokenizeRequest, int]:
    """The tokenizer's request for a chat prompt, and the characters it renders from (chat_chars,
    for the limits). One builder for /v1/chat/completions and /tokenize: /tokenize's count must
    be the prompt_tokens of a chat request with the same messages, tools and template options."""
    assert body.messages is not None  # /tokenize's chat branch; a chat request always has them
    messages = [m.as_template_input() for m in body.messages]
    prompt = TokenizeRequest(
        "",
        params,
        messages=messages,
        tools=tools,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template_kwargs=body.chat_template_kwargs,
        add_special_tokens=add_special_tokens,
    )
    return prompt, chat_chars(messages, tools, body.chat_template_kwargs)


class BootstrapBody(Protocol):
    """A request body with SGLang's bootstrap fields (protocol.py's _Bootstrap): which room of
    which prefill engine each choice fills or reads."""

    def bootstrap_targets(
        self, prompts: int, n: int, default_port: int
    ) -> list[BootstrapTarget | None]: ...


def bootstrap_targets(
    ctx: ServerContext,
    body: BootstrapBody,
    prompts: int,
    n: int,
    names: Mapping[str, str] | None = None,
) -> list[BootstrapTarget | None]:
    """The bootstrap target of each of the request's prompts x n sequences (None without
    rooms), once their number is within the server's limit: a request refused for asking
    too many ends no room (the client, not the limit, would bound the rooms it names)."""
    config = ctx.state.config
    with as_bad_request(names):
        check_sequences(config, prompts, n)
        # `bootstrap_port: null` means this engine's own --disaggregation-bootstrap-port
        return body.bootstrap_targets(prompts, n, config.disaggregation_bootstrap_port)


@contextlib.asynccontextmanager
async def refusal_ends_rooms(
    ctx: ServerContext, targets: list[BootstrapTarget | None]
) -> AsyncIterator[None]:
    """A request this server refuses (APIError) before its engine sees it ends its rooms in
    the engine all the same: a prefill engine's decode engine learns of the refusal at once,
    as of one its scheduler makes, instead of waiting for KV that never comes until the
    router gives up on it (docs/disaggregation.md, failures). So does a 404 for another
    model's name and a draining engine's 503, where its partner serves the request (a
    rolling upgrade). Not a loading engine's 503: its scheduler reads no message until it is
    ready, and its bootstrap server, not listening until its pool exists, refuses the
    partner's post of the room at once."""
    try:
        yield
    except APIError as exc:
        refused = [target for target in targets if target is not None]
        # a request without rooms (a mixed engine's) has nothing to end
        if refused and ctx.client.ready.is_set():
            await ctx.client.refuse_rooms(refused, exc.message, exc.status)
        raise


def start_streams(ctx: ServerContext, subs: list[TokenizeRequest]) -> list[Stream]:
    """The engine's outputs of each request (sent to it once read)."""
    try:
        return [ctx.client.generate(sub) for sub in subs]  # only a client-given rid can clash
    except DuplicateRequestId as exc:
        raise APIError(400, str(exc), param="rid") from exc
    except EngineGone as exc:  # it failed after this request came: another engine may serve it
        raise APIError(503, str(exc), "service_unavailable") from exc


health_routes = APIRouter()
api_routes = APIRouter(dependencies=[Depends(authorized), Depends(shallow_body)])


@health_routes.get("/health")
async def health(ctx: Ctx) -> Response:
    if unavailable(ctx) is not None:
        return PlainTextResponse("not ready", status_code=503)
    # a prefill or decode engine's KV layout, by which the router pairs them
    layout = engine_info(ctx).kv_layout
    return PlainTextResponse("ok", headers={KV_LAYOUT_HEADER: layout} if layout else None)


@health_routes.get("/metrics")
async def metrics(ctx: Ctx) -> Response:
    return Response(ctx.client.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@health_routes.get("/version")  # vLLM's; open, as /metrics, which shows it in build_info
async def version() -> dict:
    return {"version": __version__}


def model_card(ctx: ServerContext) -> dict:
    """The served model as OpenAI describes a model (and vLLM's max_model_len)."""
    card = {
        "id": ctx.state.served_model_name,
        "object": "model",
        "created": ctx.state.started,
        "owned_by": "kubesgl",
    }
    if ctx.client.info is not None:
        card["max_model_len"] = ctx.client.info.context_length
    return card


@api_routes.get("/v1/models")
async def models(ctx: Ctx) -> dict:
    return {"object": "list", "data": [model_card(ctx)]}


@api_routes.get("/v1/models/{model:path}")  # :path, for names with a slash (org/name)
async def model(model: str, ctx: Ctx) -> dict:
    require_model(ctx, model)
    return model_card(ctx)


@api_routes.post("/tokenize")  # vLLM's
async def tokenize(body: TokenizeRequestBody, ctx: Ctx) -> dict:
    require_available(ctx, body.model)
    if body.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        prompt, chars = chat_prompt(body, SamplingParams(), tools, body.add_special_tokens)
        param = "messages"
    else:
        assert body.prompt is not None  # the body holds one of the two
        chars, param = len(body.prompt), "prompt"
        prompt = TokenizeRequest(
            "", SamplingParams(), text=body.prompt, add_special_tokens=body.add_special_tokens
        )
    context_length = engine_info(ctx).context_length
    with as_bad_request():  # the tokenizer serves every request: no single one may hold it up
        check_prompt_chars(ctx.state.config, context_length, chars, param)
    tokens = (await tokenizer_answer(ctx, prompt=prompt)).token_ids
    return {"count": len(tokens), "max_model_len": context_length, "tokens": tokens}


@api_routes.post("/detokenize")  # vLLM's
async def detokenize(body: DetokenizeRequestBody, ctx: Ctx) -> dict:
    require_available(ctx, body.model)
    info = engine_info(ctx)
    if len(body.tokens) > info.context_length:  # no sequence of this model is longer
        raise APIError(
            400,
            f"tokens holds {len(body.tokens)} ids; this model's context length is "
            f"{info.context_length}",
            param="tokens",
        )
    if bad := [t for t in body.tokens if not 0 <= t < info.vocab_size]:
        raise APIError(
            400,
            f"tokens contains ids outside the vocabulary (size {info.vocab_size}): {bad[:10]}",
            param="tokens",
        )
    return {"prompt": (await tokenizer_answer(ctx, token_ids=body.tokens)).text}


async def tokenizer_answer(
    ctx: ServerContext, prompt: TokenizeRequest | None = None, token_ids: list[int] | None = None
) -> Tokenized:
    try:
        answer = await ctx.client.tokenizer_call(prompt, token_ids)
    except EngineGone as exc:  # another error is a bug: the crash answer's 500
        raise APIError(500, str(exc), "server_error") from exc
    if answer.error is not None:
        raise APIError.of(answer.error)
    return answer


@api_routes.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, request: Request, ctx: Ctx) -> Response:
    names = body.renamed_fields()
    targets = bootstrap_targets(ctx, body, 1, body.n, names)
    async with refusal_ends_rooms(ctx, targets):
        require_available(ctx, body.model)
        subs, streams, tool_output = _chat_requests(ctx, body, names, targets)
    return await respond(
        ctx,
        request,
        subs,
        streams,
        ["messages"] * len(subs),
        body.stream,
        body.include_usage,
        ChatFormatter(response_meta(ctx, subs), body.logprobs, tool_output),
        names,
    )


def _chat_requests(
    ctx: ServerContext,
    body: ChatCompletionRequest,
    names: Mapping[str, str],
    targets: list[BootstrapTarget | None],
) -> tuple[list[TokenizeRequest], list[Stream], ToolOutput]:
    params = body.to_sampling_params()
    with as_bad_request(names):
        choice = body.tool_mode()
    if (grammar := choice.grammar(body.parallel_tool_calls)) is not None:
        params = dataclasses.replace(params, grammar=grammar)
    params = validated(ctx, params, names)
    tool_output = ToolOutput(
        choice.mode,
        choice.named["function"]["name"] if choice.named else None,
        tool_calls.format_for_model(ctx.state.config.model) if choice.mode == "auto" else None,
        frozenset(t["function"]["name"] for t in choice.tools),
        body.parallel_tool_calls,
    )
    prompt, chars = chat_prompt(body, params, choice.template_tools)
    within_limits(ctx, params, [(chars, "messages")], names=names)
    subs = fan_out([prompt], body.n, params, "chatcmpl", targets)
    return subs, start_streams(ctx, subs), tool_output


@api_routes.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, ctx: Ctx) -> Response:
    prompts = body.prompts()
    listed = isinstance(body.prompt, list) and any(isinstance(p, str | list) for p in body.prompt)
    fields = [f"prompt.{i}" for i in range(len(prompts))] if listed else ["prompt"]
    targets = bootstrap_targets(ctx, body, len(prompts), body.n)
    async with refusal_ends_rooms(ctx, targets):
        require_available(ctx, body.model)
        params = validated(ctx, body.to_sampling_params())
        within_limits(
            ctx,
            params,
            [(len(p), param) for p, param in zip(prompts, fields) if isinstance(p, str)],
            [(len(p), param) for p, param in zip(prompts, fields) if not isinstance(p, str)],
        )
        bases = [
            TokenizeRequest("", params, **({"text": p} if isinstance(p, str) else {"input_ids": p}))
            for p in prompts
        ]
        subs = fan_out(bases, body.n, params, "cmpl", targets)
        streams = start_streams(ctx, subs)
    return await respond(
        ctx,
        request,
        subs,
        streams,
        [field for field in fields for _ in range(body.n)],  # choice p * n + i: prompt p
        body.stream,
        body.include_usage,
        CompletionFormatter(response_meta(ctx, subs), body.logprobs is not None),
    )


@api_routes.post("/generate")
async def generate(body: GenerateRequestBody, request: Request, ctx: Ctx) -> Response:
    names = body.renamed_fields()
    targets = bootstrap_targets(ctx, body, 1, 1, names)
    rid = body.rid or EngineClient.new_rid("gen")
    async with refusal_ends_rooms(ctx, targets):
        require_available(ctx)
        params = validated(ctx, body.to_sampling_params(), names)
        within_limits(
            ctx,
            params,
            [(len(body.text), "text")] if body.text is not None else [],
            [(len(body.input_ids), "input_ids")] if body.input_ids is not None else [],
            names=names,
        )
        sub = TokenizeRequest(
            rid, params, text=body.text, input_ids=body.input_ids, bootstrap=targets[0]
        )
        streams = start_streams(ctx, [sub])
    prompt_field = "text" if body.text is not None else "input_ids"
    return await respond(
        ctx,
        request,
        [sub],
        streams,
        [prompt_field],
        body.stream,
        False,
        NativeFormatter(rid, top_logprobs=body.return_logprob and body.top_logprobs_num > 0),
        names,
    )


def fan_out(
    bases: list[TokenizeRequest],
    n: int,
    params: SamplingParams,
    prefix: str,
    targets: list[BootstrapTarget | None],
) -> list[TokenizeRequest]:
    """n copies of every prompt; copies after the first share its cached prompt, and
    seeded copies get distinct seeds so that they differ. Choice p * n + i is copy i of
    prompt p and takes targets[p * n + i]. All follow the first into the queue."""
    group = EngineClient.new_rid(prefix)
    first = f"{group}-0"
    subs = []
    for p, base in enumerate(bases):
        leader = None
        for i in range(n):
            copy = dataclasses.replace(
                params, seed=None if params.seed is None else params.seed + i
            )
            rid = f"{group}-{p * n + i}"
            subs.append(
                dataclasses.replace(
                    base,
                    rid=rid,
                    params=copy,
                    prefix_leader=leader,
                    bootstrap=targets[p * n + i],
                    request_leader=None if rid == first else first,
                )
            )
            leader = leader or rid
    return subs


def response_meta(ctx: ServerContext, subs: list[TokenizeRequest]) -> dict:
    """What every response and chunk of one OpenAI request carries: the id its choices share
    (their rids less the choice index), when it was created, and the served model's name."""
    return {
        "id": subs[0].rid.rsplit("-", 1)[0],
        "created": int(time.time()),
        "model": ctx.state.served_model_name,
    }
