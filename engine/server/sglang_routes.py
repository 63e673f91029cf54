"""SGLang's metadata and control endpoints, so that SGLang's own router (and tools written
for SGLang) can drive a kubesgl engine: /server_info, /model_info, /health_generate,
/flush_cache, /get_load, each also under SGLang's older /get_... name where it has one."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from kubesgl import __version__
from kubesgl.contract import DECODE, MIXED, PREFILL
from kubesgl.engine.messages import TokenizeRequest
from kubesgl.engine.sampling_params import SamplingParams
from kubesgl.engine.server.context import Ctx, authorized, unavailable
from kubesgl.engine.server.engine_client import EngineClient, EngineGone

HEALTH_GENERATE_TIMEOUT_S = 20.0
FLUSH_CACHE_TIMEOUT_S = 20.0  # a scheduler that is idle answers at its next loop
# SGLang's name for the role of an engine that does both phases
_DISAGGREGATION_MODE = {MIXED: "null", PREFILL: "prefill", DECODE: "decode"}


routes = APIRouter(dependencies=[Depends(authorized)])


def server_info(ctx: Ctx) -> JSONResponse:
    config, info = ctx.state.config, ctx.client.info
    return JSONResponse(
        {
            **dataclasses.asdict(config),
            "model_path": config.model,
            "tokenizer_path": config.model,
            "served_model_name": ctx.state.served_model_name,
            "dp_size": 1,
            "disaggregation_mode": _DISAGGREGATION_MODE[config.role],
            "disaggregation_transfer_backend": "nixl",
            "context_length": info.context_length if info else config.context_length,
            "max_total_num_tokens": info.max_total_tokens if info else None,
            "version": __version__,
        }
    )


def model_info(ctx: Ctx) -> JSONResponse:
    """The fields of SGLang's answer (its router reads them to name the served model)."""
    config, info = ctx.state.config, ctx.client.info
    return JSONResponse(
        {
            "model_path": config.model,
            "tokenizer_path": config.model,
            "served_model_name": ctx.state.served_model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "supports_vision": False,
            "model_type": None,
            "architectures": [info.architecture] if info else None,
            "max_context_length": info.context_length if info else None,
            "max_req_input_len": info.context_length - 1 if info else None,
            "vocab_size": info.vocab_size if info else None,
            "eos_token_ids": info.eos_token_ids if info else None,
        }
    )


def load(ctx: Ctx) -> JSONResponse:
    stats = ctx.client.stats
    running, waiting, tokens = (
        (stats.num_running, stats.num_waiting, stats.kv_used_tokens) if stats else (0, 0, 0)
    )
    return JSONResponse(
        [
            {
                "dp_rank": 0,
                "num_reqs": running + waiting,
                "num_waiting_reqs": waiting,
                "num_tokens": tokens,
            }
        ]
    )


async def health_generate(ctx: Ctx) -> Response:
    """Healthy only if one token can be generated end to end, and not draining: a
    probe must take a draining engine out of rotation, as /health does."""
    if (why := unavailable(ctx)) is not None:
        return PlainTextResponse(why, status_code=503)
    request = TokenizeRequest(
        EngineClient.new_rid("health"),
        SamplingParams(max_tokens=1, temperature=0),
        input_ids=[1],
        probe=True,
    )
    try:
        async with (
            asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S),
            contextlib.aclosing(ctx.client.generate(request)) as outputs,
        ):  # closed as the route answers, not when collected: the probe's id is held till then
            async for out in outputs:
                if out.finish_reason is not None and out.finish_reason.kind == "error":
                    return PlainTextResponse(
                        f"generation failed: {out.finish_reason.message}", status_code=503
                    )
    except TimeoutError:
        return PlainTextResponse(
            f"no token within {HEALTH_GENERATE_TIMEOUT_S:g} s", status_code=503
        )
    return PlainTextResponse("ok")


async def flush_cache(ctx: Ctx) -> Response:
    client = ctx.client
    if (why := unavailable(ctx)) is not None:  # loading, or draining: its requests still end
        return PlainTextResponse(f"not flushed: {why}", status_code=503)
    if client.user_requests:  # a /health_generate probe in flight is none
        return PlainTextResponse(
            f"not flushed: {client.user_requests} requests are running", status_code=400
        )
    try:
        async with asyncio.timeout(FLUSH_CACHE_TIMEOUT_S):
            flushed = await client.flush_cache()
    except EngineGone as exc:
        return PlainTextResponse(f"not flushed: {exc}", status_code=503)
    except TimeoutError:
        return PlainTextResponse(
            f"no answer from the scheduler within {FLUSH_CACHE_TIMEOUT_S:g} s", status_code=503
        )
    if not flushed:
        return PlainTextResponse(
            "not flushed: the engine is still finishing requests (ones their clients "
            "left, health probes, or prefill/decode transfers); try again",
            status_code=400,
        )
    return PlainTextResponse("Cache flushed.")


# each under SGLang's name and, where it has one, its older /get_... name
for path in ("/server_info", "/get_server_info"):
    routes.add_api_route(path, server_info, methods=["GET"])
for path in ("/model_info", "/get_model_info"):
    routes.add_api_route(path, model_info, methods=["GET"])
routes.add_api_route("/get_load", load, methods=["GET"])
routes.add_api_route("/health_generate", health_generate, methods=["GET", "POST"])
routes.add_api_route("/flush_cache", flush_cache, methods=["GET", "POST"])
