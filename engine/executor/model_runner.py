"""Runs forward steps: owns the model, the KV pool, the request-to-token table, the
attention backend and the sampler, all on one device."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kubesgl.engine.attention import create_backend
from kubesgl.engine.attention.mixed import MixedAttention
from kubesgl.engine.executor.cuda_graph import CudaGraphRunner
from kubesgl.engine.executor.piecewise_graph import PiecewiseGraphRunner
from kubesgl.engine.executor.sampler import PenaltyState, Sampler
from kubesgl.engine.forward_batch import ForwardBatch, ForwardMode
from kubesgl.engine.kvcache.pools import KVPool, ReqToTokenTable
from kubesgl.engine.models.decoder import CausalLM

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """A step's sampled tokens, on the host."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


@dataclass
class PendingStep:
    """A launched step whose outputs are on their way to the host. On a GPU, `run` returns
    as soon as the step is queued, so the next step can be queued behind it; only `wait`
    blocks, on the copies of this step's outputs."""

    outputs: dict[str, torch.Tensor]  # host tensors, filled by asynchronous copies
    done: torch.cuda.Event | None  # None on the CPU, where the step has already run

    def wait(self) -> StepResult:
        if self.done is not None:
            self.done.synchronize()
        lists = {name: tensor.tolist() for name, tensor in self.outputs.items()}
        return StepResult(**lists)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_pool: KVPool,
        req_to_token: ReqToTokenTable,
        attention_backend: str,
        future_capacity: int,
        cuda_graph_max_bs: int = 0,
        piecewise_max_tokens: int = 0,
        mixed_overlap: bool = False,
    ):
        self.model = model
        self.device = req_to_token.table.device
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.backend = create_backend(
            attention_backend,
            kv_pool=kv_pool,
            req_to_token=req_to_token,
            layers=model.attention_specs(),
        )
        self.mixed_attention = MixedAttention(self.backend)
        self.sampler = Sampler(
            PenaltyState(req_to_token.num_rows, model.config.vocab_size, self.device)
        )
        if self.device.type == "cuda":  # at start, not in the first request with a grammar
            self.sampler.warm_up_mask(model.config.vocab_size, self.device)
        # Tokens sampled by earlier steps, read by later ones through negative input ids, so
        # that step N+1 can be launched before step N's tokens reach the host.
        self.future_tokens = torch.zeros(future_capacity + 1, dtype=torch.int64, device=self.device)
        self.cuda_graphs = None
        if cuda_graph_max_bs > 0 and not self.backend.supports_cuda_graph:
            logger.info(
                "CUDA graphs off: the %s attention backend is not capturable", attention_backend
            )
        elif cuda_graph_max_bs > 0:
            # the table's last row is never handed out: padded graph rows read it (all slot 0)
            self.cuda_graphs = CudaGraphRunner(
                model, self.backend, req_to_token.num_rows - 1, cuda_graph_max_bs, mixed_overlap
            )
        self.piecewise_graphs = (
            PiecewiseGraphRunner(model, kv_pool, piecewise_max_tokens)
            if piecewise_max_tokens > 0
            else None
        )
        # Mixed steps on two streams: the decodes' graph on this one, the chunks on the
        # current one. On the CPU the parts run one after the other (what tests can check).
        self.decode_stream: torch.cuda.Stream | None = None
        self.mixed_overlap = mixed_overlap
        if mixed_overlap and self.device.type != "cuda":
            logger.warning(
                "--enable-mixed-chunk-overlap on %s: a mixed step's two passes run one after "
                "the other, which gains nothing",
                self.device.type,
            )
        elif mixed_overlap:
            if self.cuda_graphs is None:
                logger.warning("--enable-mixed-chunk-overlap off: it needs decode CUDA graphs")
                self.mixed_overlap = False
            else:
                self.decode_stream = torch.cuda.Stream(self.device)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> PendingStep:
        batch = batch.to(self.device)
        if batch.table_rows.numel():
            self.req_to_token.write(batch.table_rows, batch.table_cols, batch.table_slots)
        input_ids = torch.where(
            batch.input_ids < 0,
            self.future_tokens[(-batch.input_ids).clamp(min=0)],
            batch.input_ids,
        )
        parts = self._overlapped_parts(batch)
        if parts is not None:
            logits = self._forward_on_two_streams(input_ids, *parts)
        else:
            logits = self._forward(input_ids, batch)
        sample = self.sampler(logits, batch.sampling, batch.req_rows, batch.emits)
        self.future_tokens[batch.future_slots] = sample.token_ids
        optional = {
            "token_ids": sample.token_ids,
            "logprobs": sample.logprobs,
            "top_ids": sample.top_ids,
            "top_logprobs": sample.top_logprobs,
        }
        outputs = {name: tensor for name, tensor in optional.items() if tensor is not None}
        if self.device.type != "cuda":
            return PendingStep(outputs, None)
        host = {
            name: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            for name, t in outputs.items()
        }
        done = torch.cuda.Event()
        done.record()
        return PendingStep(host, done)

    def _overlapped_parts(self, batch: ForwardBatch) -> tuple[ForwardBatch, ForwardBatch] | None:
        """A mixed step's chunks and decodes where they run on two streams: with the overlap
        on, and where the decodes fit a captured graph (two eager parts would share the
        attention backend's plans)."""
        if not self.mixed_overlap or batch.mode is not ForwardMode.MIXED:
            return None
        chunks, decodes = batch.split_mixed()
        if self.cuda_graphs is not None and not self.cuda_graphs.can_run(decodes):
            return None
        return chunks, decodes

    def _forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """`batch`'s logits, from its decode CUDA graph, piecewise graphs or an eager pass."""
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(batch):
            return self.cuda_graphs.run(input_ids, batch)
        backend = self.mixed_attention if batch.mode is ForwardMode.MIXED else self.backend
        backend.prepare(batch)
        if self.piecewise_graphs is not None and self.piecewise_graphs.can_run(batch):
            return self.piecewise_graphs.run(input_ids, batch, backend)
        return self.model(input_ids, batch.positions, batch, backend)

    def _forward_on_two_streams(
        self, input_ids: torch.Tensor, chunks: ForwardBatch, decodes: ForwardBatch
    ) -> torch.Tensor:
        """A mixed step's logits, its decodes' graph launched first on the decode stream and
        its chunks on the current one: a decode step reads KV at the memory's pace and leaves
        the arithmetic units idle, which the chunks' matrix products can use meanwhile."""
        cut = chunks.num_tokens
        if self.decode_stream is not None:  # the inputs and table writes come first
            self.decode_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.decode_stream):  # no stream (the CPU): the passes run in turn
            decode_logits = self._forward(input_ids[cut:], decodes)
        chunk_logits = self._forward(input_ids[:cut], chunks)
        if self.decode_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.decode_stream)
        return torch.cat([chunk_logits, decode_logits])
