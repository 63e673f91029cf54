"""The tokenizer/detokenizer process: text in, token ids to the scheduler; token ids back,
text out to the API server. Chat messages are rendered with the model's chat template."""

from __future__ import annotations

import logging
import signal

import zmq

from kubesgl.engine.io import (
    AbortRequest,
    EngineInfo,
    FinishReason,
    GenerateRequest,
    Shutdown,
    TextBatch,
    TextOutput,
    TokenizeRequest,
    TokenOutput,
)
from kubesgl.engine.server.children import exit_with_parent
from kubesgl.engine.server.ipc import Endpoints, pull, push
from kubesgl.engine.tokenizer.detokenizer import DecodeState, IncrementalDetokenizer
from kubesgl.engine.tokenizer.loader import load_tokenizer
from kubesgl.engine.tokenizer.token_bytes import TokenBytes

logger = logging.getLogger(__name__)


class TokenizerError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class Tokenizer:
    def __init__(self, model_path: str):
        self.hf = load_tokenizer(model_path)
        self.detokenizer = IncrementalDetokenizer(self.hf) if self.hf is not None else None
        self._token_bytes = TokenBytes(self.hf) if self.hf is not None else None
        self.states: dict[str, DecodeState] = {}

    def encode(self, request: TokenizeRequest) -> list[int]:
        if self.hf is None:
            if request.input_ids is None:
                raise TokenizerError("this model has no tokenizer: send the prompt as token ids", "prompt")
            if request.params.stop:
                raise TokenizerError("this model has no tokenizer: stop strings cannot be matched", "stop")
        if request.input_ids is not None:
            return list(request.input_ids)
        if request.messages is not None:
            if self.hf.chat_template is None:
                raise TokenizerError("this model has no chat template; use /v1/completions", "messages")
            try:
                return list(self.hf.apply_chat_template(request.messages, tokenize=True, add_generation_prompt=True,
                                                        return_dict=False))
            except Exception as exc:  # the template itself rejects the conversation
                raise TokenizerError(f"the chat template rejected the messages: {exc}", "messages") from exc
        return self.hf.encode(request.text, add_special_tokens=True)

    def start(self, request: TokenizeRequest) -> None:
        self.states[request.rid] = DecodeState(skip_special_tokens=request.params.skip_special_tokens,
                                               stop=list(request.params.stop))

    def decode(self, out: TokenOutput) -> TextOutput:
        state = self.states.get(out.rid)
        text = ""
        reason = out.finish_reason
        if state is not None and self.detokenizer is not None:
            matched = reason.matched_str if reason else None
            text = self.detokenizer.step(state, out.token_ids, finished=out.finished, matched_stop=matched)
        if out.finished:
            self.states.pop(out.rid, None)
        result = TextOutput(rid=out.rid, text=text, token_ids=out.token_ids, finish_reason=reason,
                            prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens,
                            completion_tokens=out.completion_tokens, logprobs=out.logprobs)
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


def run_tokenizer(model_path: str, endpoints: Endpoints, log_level: str) -> None:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s tokenizer %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    tokenizer = Tokenizer(model_path)
    context = zmq.Context()
    from_api = pull(context, endpoints.tokenizer_in)
    from_scheduler = pull(context, endpoints.detokenizer_in)
    to_scheduler = push(context, endpoints.scheduler_in)
    to_api = push(context, endpoints.api_in)
    poller = zmq.Poller()
    poller.register(from_api, zmq.POLLIN)
    poller.register(from_scheduler, zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
        if from_scheduler in ready:
            message = from_scheduler.recv_pyobj()
            if isinstance(message, EngineInfo):
                to_api.send_pyobj(message)
            else:
                to_api.send_pyobj(TextBatch([tokenizer.decode(out) for out in message.outputs], message.stats))
        if from_api in ready:
            message = from_api.recv_pyobj()
            if isinstance(message, Shutdown):
                to_scheduler.send_pyobj(message)
                return
            if isinstance(message, AbortRequest):
                to_scheduler.send_pyobj(message)
                continue
            try:
                input_ids = tokenizer.encode(message)
            except TokenizerError as exc:
                reason = FinishReason("error", message=str(exc), param=exc.param)
                to_api.send_pyobj(TextBatch([TextOutput(message.rid, "", [], reason, 0, 0, 0)]))
                continue
            tokenizer.start(message)
            to_scheduler.send_pyobj(GenerateRequest(message.rid, input_ids, message.params, message.prefix_leader))
