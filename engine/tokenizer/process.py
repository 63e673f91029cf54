"""The tokenizer/detokenizer process: text in, token ids to the scheduler; token ids back,
text out to the API server. Chat messages are rendered with the model's chat template."""

from __future__ import annotations

import inspect
import logging
import signal
from collections.abc import Callable
from typing import Any, Protocol, get_args

import zmq

from kubesgl.engine.child_process import exit_with_parent
from kubesgl.engine.ipc import Endpoints, pull, push
from kubesgl.engine.messages import (
    AbortRequest,
    CacheFlushed,
    EngineInfo,
    FinishReason,
    FlushCache,
    GenerateRequest,
    RoomRefused,
    Shutdown,
    StepOutputs,
    TextBatch,
    TextOutput,
    Tokenized,
    TokenizerCall,
    TokenizeRequest,
    TokenOutput,
)
from kubesgl.engine.tokenizer.detokenizer import DecodeState, IncrementalDetokenizer
from kubesgl.engine.tokenizer.loader import load_tokenizer
from kubesgl.engine.tokenizer.token_bytes import TokenBytes
from kubesgl.gc_pacing import GcPacer

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 1000  # an idle loop still turns this often, so that it can collect garbage


class TokenizerError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def reserved_template_names(hf) -> frozenset[str]:
    """What chat_template_kwargs may not set: apply_chat_template's own arguments (the server
    sets those it uses; the others, such as `chat_template` or `return_tensors`, are not the
    client's to choose) and the conversation's name inside the template."""
    parameters = inspect.signature(hf.apply_chat_template).parameters.values()
    return frozenset(p.name for p in parameters if p.kind is not p.VAR_KEYWORD) | {"messages"}


class Tokenizer:
    def __init__(self, model_path: str):
        self.hf = load_tokenizer(model_path)
        self.detokenizer = IncrementalDetokenizer(self.hf) if self.hf is not None else None
        self._token_bytes = TokenBytes(self.hf) if self.hf is not None else None
        self.states: dict[str, DecodeState] = {}
        self._reserved_template_names = (
            reserved_template_names(self.hf) if self.hf is not None else frozenset()
        )

    def encode(self, request: TokenizeRequest) -> list[int]:
        if self.hf is None:
            if request.input_ids is None:
                raise TokenizerError(
                    "this model has no tokenizer: send the prompt as token ids", "prompt"
                )
            if request.params.stop:
                raise TokenizerError(
                    "this model has no tokenizer: stop strings cannot be matched", "stop"
                )
        if request.input_ids is not None:
            return list(request.input_ids)
        if request.messages is not None:
            return self._render_chat(request)
        special = True if request.add_special_tokens is None else request.add_special_tokens
        return self.hf.encode(request.text, add_special_tokens=special)

    def _render_chat(self, request: TokenizeRequest) -> list[int]:
        if self.hf.chat_template is None:
            raise TokenizerError("this model has no chat template; use /v1/completions", "messages")
        template_kwargs = request.chat_template_kwargs or {}
        if taken := sorted(template_kwargs.keys() & self._reserved_template_names):
            raise TokenizerError(
                f"chat_template_kwargs may not set {', '.join(map(repr, taken))}: "
                "the server decides it",
                "chat_template_kwargs",
            )
        try:
            rendered = self.hf.apply_chat_template(
                request.messages,
                tools=request.tools,
                tokenize=not request.add_special_tokens,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                return_dict=False,
                **template_kwargs,
            )
        except Exception as exc:  # the template itself rejects the conversation
            raise TokenizerError(
                f"the chat template rejected the messages: {exc}", "messages"
            ) from exc
        if request.add_special_tokens:  # the tokenizer's own (a BOS) beside the template's
            return self.hf.encode(rendered, add_special_tokens=True)
        return list(rendered)

    def answer(self, call: TokenizerCall) -> Tokenized:
        """/tokenize and /detokenize; TokenizerError for what the request asks wrongly."""
        if self.hf is None:  # no field of the request is at fault: none is named
            message = (
                "this model has no tokenizer: it takes and returns token ids only, and cannot "
                "tokenize or detokenize"
            )
            return Tokenized(call.call_id, error=FinishReason("error", message=message))
        if call.prompt is not None:
            return Tokenized(call.call_id, token_ids=self.encode(call.prompt))
        assert call.token_ids is not None  # one of the two, as the API server sends it
        return Tokenized(call.call_id, text=self.hf.decode(call.token_ids))

    def start(self, request: TokenizeRequest) -> None:
        self.states[request.rid] = DecodeState.of(request.params)

    def decode(self, out: TokenOutput) -> TextOutput:
        state = self.states.get(out.rid)
        text, held = "", False
        reason = out.finish_reason
        if state is not None and self.detokenizer is not None:
            text = self.detokenizer.step(
                state,
                out.token_ids,
                finished=out.finished,
                matched_stop=reason.matched_str if reason else None,
                matched_end=reason.matched_end if reason else None,
                matched_token=reason.matched_token if reason else None,
            )
            held = state.holds_text
        if out.finished:
            self.states.pop(out.rid, None)
        result = TextOutput(
            rid=out.rid,
            text=text,
            token_ids=out.token_ids,
            finish_reason=reason,
            prompt_tokens=out.prompt_tokens,
            cached_tokens=out.cached_tokens,
            completion_tokens=out.completion_tokens,
            logprobs=out.logprobs,
            queue_seconds=out.queue_seconds,
            prefill_seconds=out.prefill_seconds,
            handoff_seconds=out.handoff_seconds,
            text_held=held,
            tokens_named_by_id=self.hf is None,
        )
        if out.logprobs:
            name, raw = self._token_text, self._raw_bytes
            result.token_strings = [name(lp.token_id) for lp in out.logprobs]
            result.top_strings = [[name(t) for t, _ in lp.top] for lp in out.logprobs]
            result.token_bytes = [raw(lp.token_id) for lp in out.logprobs]
            result.top_bytes = [[raw(t) for t, _ in lp.top] for lp in out.logprobs]
        return result

    def _token_text(self, token_id: int) -> str:
        return self.hf.decode([token_id]) if self.hf is not None else f"token_id:{token_id}"

    def _raw_bytes(self, token_id: int) -> list[int]:
        if self._token_bytes is None:
            return list(self._token_text(token_id).encode())
        return list(self._token_bytes(token_id))


class Sender(Protocol):
    """Where the loop sends messages: a PUSH socket (tests pass a recorder)."""

    def send_pyobj(self, obj: object, /) -> object: ...


# What the API server sends the process, and what the scheduler (rank 0) does
FromApi = TokenizeRequest | TokenizerCall | AbortRequest | FlushCache | RoomRefused | Shutdown
FromScheduler = StepOutputs | EngineInfo | CacheFlushed


class TokenizerLoop:
    """What the process does with each message. An exception that one request raises becomes
    that request's error answer (500, logged) and every other request goes on."""

    def __init__(self, tokenizer: Tokenizer, to_scheduler: Sender, to_api: Sender):
        self.tokenizer, self.to_scheduler, self.to_api = tokenizer, to_scheduler, to_api

    def from_api(self, message: FromApi) -> bool:
        """Handles one message from the API server; False once it was Shutdown."""
        handler = _FROM_API.get(type(message))
        if handler is None:  # a fault of the engine's own processes, never a client's
            raise TypeError(f"not a message for the tokenizer: {message!r}")
        return handler(self, message)

    def from_scheduler(self, message: FromScheduler) -> None:
        handler = _FROM_SCHEDULER.get(type(message))
        if handler is None:
            raise TypeError(f"not a message for the detokenizer: {message!r}")
        handler(self, message)

    def _shut_down(self, message: Shutdown) -> bool:
        self.to_scheduler.send_pyobj(message)
        return False

    def _pass_to_scheduler(self, message: AbortRequest | FlushCache | RoomRefused) -> bool:
        self.to_scheduler.send_pyobj(message)
        return True

    def _call(self, message: TokenizerCall) -> bool:
        self.to_api.send_pyobj(self._answer(message))
        return True

    def _tokenize(self, message: TokenizeRequest) -> bool:
        try:
            input_ids = self.tokenizer.encode(message)
        except TokenizerError as exc:
            refusal = FinishReason("error", message=str(exc), param=exc.param)
            self._fail(message.rid, refusal)
            if message.bootstrap is not None:  # refused before the scheduler saw its room
                self.to_scheduler.send_pyobj(
                    RoomRefused(message.bootstrap, str(exc), refusal.status)
                )
            return True
        except Exception as exc:
            logger.exception("tokenizing request %s failed", message.rid)
            self._fail(message.rid, _internal_error("tokenizing the request", exc))
            return True
        self.tokenizer.start(message)
        self.to_scheduler.send_pyobj(
            GenerateRequest(
                message.rid,
                input_ids,
                message.params,
                prefix_leader=message.prefix_leader,
                bootstrap=message.bootstrap,
                request_leader=message.request_leader,
                probe=message.probe,
            )
        )
        return True

    def _pass_to_api(self, message: EngineInfo | CacheFlushed) -> None:
        self.to_api.send_pyobj(message)

    def _detokenize(self, message: StepOutputs) -> None:
        texts = []
        for out in message.outputs:
            try:
                texts.append(self.tokenizer.decode(out))
            except Exception as exc:
                logger.exception("detokenizing request %s failed", out.rid)
                self.tokenizer.states.pop(out.rid, None)
                if not out.finished:  # stop it in the scheduler too; its later tokens are dropped
                    self.to_scheduler.send_pyobj(AbortRequest(out.rid, "detokenizing failed"))
                texts.append(
                    _error_output(out.rid, _internal_error("detokenizing the output", exc))
                )
        self.to_api.send_pyobj(TextBatch(texts, message.stats))

    def _answer(self, call: TokenizerCall) -> Tokenized:
        try:
            return self.tokenizer.answer(call)
        except TokenizerError as exc:
            return Tokenized(
                call.call_id, error=FinishReason("error", message=str(exc), param=exc.param)
            )
        except Exception as exc:
            logger.exception("/tokenize or /detokenize call %d failed", call.call_id)
            return Tokenized(call.call_id, error=_internal_error("tokenizing", exc))

    def _fail(self, rid: str, reason: FinishReason) -> None:
        self.to_api.send_pyobj(TextBatch([_error_output(rid, reason)]))


# How each message changes the process: every member of FromApi and FromScheduler has its
# handler; one from the API server returns False to end the loop (Shutdown).
_FROM_API: dict[type, Callable[[TokenizerLoop, Any], bool]] = {
    TokenizeRequest: TokenizerLoop._tokenize,
    TokenizerCall: TokenizerLoop._call,
    AbortRequest: TokenizerLoop._pass_to_scheduler,
    FlushCache: TokenizerLoop._pass_to_scheduler,
    RoomRefused: TokenizerLoop._pass_to_scheduler,
    Shutdown: TokenizerLoop._shut_down,
}
assert set(_FROM_API) == set(get_args(FromApi))
_FROM_SCHEDULER: dict[type, Callable[[TokenizerLoop, Any], None]] = {
    StepOutputs: TokenizerLoop._detokenize,
    EngineInfo: TokenizerLoop._pass_to_api,
    CacheFlushed: TokenizerLoop._pass_to_api,
}
assert set(_FROM_SCHEDULER) == set(get_args(FromScheduler))


def _internal_error(what: str, exc: Exception) -> FinishReason:
    return FinishReason(
        "error", message=f"internal error {what}: {type(exc).__name__}: {exc}", status=500
    )


def _error_output(rid: str, reason: FinishReason) -> TextOutput:
    return TextOutput(rid, "", [], reason, 0, 0, 0)


def run_tokenizer(model_path: str, endpoints: Endpoints, log_level: str) -> None:
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s tokenizer %(levelname)s %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    context = zmq.Context()
    from_api = pull(context, endpoints.tokenizer_in)
    from_scheduler = pull(context, endpoints.detokenizer_in)
    loop = TokenizerLoop(
        Tokenizer(model_path),
        push(context, endpoints.scheduler_in),
        push(context, endpoints.api_in),
    )
    poller = zmq.Poller()
    poller.register(from_api, zmq.POLLIN)
    poller.register(from_scheduler, zmq.POLLIN)
    gc_pacer = GcPacer()
    gc_pacer.start()
    while True:
        ready = dict(poller.poll(IDLE_POLL_MS))
        gc_pacer.tick(busy=bool(loop.tokenizer.states))
        if from_scheduler in ready:
            loop.from_scheduler(from_scheduler.recv_pyobj())
        if from_api in ready and not loop.from_api(from_api.recv_pyobj()):
            return
