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
                model, self.backend, req_to_token.num_rows - 1, cuda_graph_max_bs
            )
        self.piecewise_graphs = (
            PiecewiseGraphRunner(model, kv_pool, piecewise_max_tokens)
            if piecewise_max_tokens > 0
            else None
        )

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
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(batch):
            logits = self.cuda_graphs.run(input_ids, batch)
        else:
            backend = self.mixed_attention if batch.mode is ForwardMode.MIXED else self.backend
            backend.prepare(batch)
            if self.piecewise_graphs is not None and self.piecewise_graphs.can_run(batch):
                logits = self.piecewise_graphs.run(input_ids, batch, backend)
            else:
                logits = self.model(input_ids, batch.positions, batch, backend)
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
