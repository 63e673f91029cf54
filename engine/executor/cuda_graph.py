"""CUDA graphs for decode steps.

A decode step launches a few hundred small kernels; replaying them as one captured graph
removes the launch cost, which dominates at small batches. Graphs are captured once per
batch size in `batch_sizes` (sharing one memory pool); a batch is padded up to the next
captured size with rows that read and write only the padding page (slot 0) through a
padding row of the request table. Sampling stays outside the graph.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
from collections.abc import Iterator

import torch

from kubesgl.engine.attention import AttentionBackend
from kubesgl.engine.forward_batch import ForwardBatch, ForwardMode, SamplingBatch
from kubesgl.engine.models.decoder import CausalLM

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Collects garbage now, then keeps the collector off until the block ends: for capturing
    CUDA graphs. An object freed during a capture may make a CUDA call that a capture forbids
    (a CUDA graph's own destructor does) and so invalidate it, and the collector runs whenever
    allocations make it due: in a process that built an engine before, that one's graphs may
    be in its garbage (the GPU tests saw a capture fail so, at random)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def default_batch_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16))
    return sorted({s for s in sizes if s < max_bs} | {max_bs})


class CudaGraphRunner:
    def __init__(
        self, model: CausalLM, backend: AttentionBackend, padding_row: int, max_batch_size: int
    ):
        self.model, self.backend, self.padding_row = model, backend, padding_row
        self.batch_sizes = default_batch_sizes(max_batch_size)
        device = backend.req_to_token.table.device
        n = self.batch_sizes[-1]
        long = lambda: torch.zeros(n, dtype=torch.int64, device=device)  # noqa: E731
        self.input_ids, self.positions, self.out_cache_loc, self.seq_lens = (
            long(),
            long(),
            long(),
            long(),
        )
        self.extend_lens = torch.ones(n, dtype=torch.int64, device=device)
        self.req_rows = torch.full((n,), padding_row, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self._capture_all()

    def _batch(self, bs: int, seq_lens_cpu: list[int]) -> ForwardBatch:
        empty = torch.empty(0, dtype=torch.int64, device=self.input_ids.device)
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_rows=self.req_rows[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=seq_lens_cpu,
            extend_lens_cpu=[1] * bs,
            extend_lens=self.extend_lens[:bs],
            table_rows=empty,
            table_cols=empty,
            table_slots=empty,
            future_slots=empty,
            emits=empty,
            sampling=_NO_SAMPLING,
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        self.seq_lens.fill_(1)  # padding rows: one token, at slot 0
        self.backend.init_cuda_graph(self.batch_sizes[-1])
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with collector_paused(), torch.cuda.stream(stream):
            for bs in reversed(self.batch_sizes):  # largest first, so smaller ones reuse its memory
                batch = self._batch(bs, [1] * bs)
                self.backend.prepare_cuda_graph(batch)
                for _ in range(2):  # warm up: Triton compiles, cuBLAS picks algorithms
                    self.model(batch.input_ids, batch.positions, batch, self.backend)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self.logits[bs] = self.model(
                        batch.input_ids, batch.positions, batch, self.backend
                    )
                self.graphs[bs] = graph
        torch.cuda.current_stream().wait_stream(stream)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.batch_sizes)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.mode is ForwardMode.DECODE and batch.batch_size <= self.batch_sizes[-1]

    def run(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        bs = batch.batch_size
        padded = self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]
        self.input_ids[:bs].copy_(input_ids)
        self.positions[:bs].copy_(batch.positions)
        self.out_cache_loc[:bs].copy_(batch.out_cache_loc)
        self.req_rows[:bs].copy_(batch.req_rows)
        self.seq_lens[:bs].copy_(batch.seq_lens)
        if padded > bs:
            self.input_ids[bs:padded].zero_()
            self.positions[bs:padded].zero_()
            self.out_cache_loc[bs:padded].zero_()
            self.req_rows[bs:padded].fill_(self.padding_row)
            self.seq_lens[bs:padded].fill_(1)
        self.backend.prepare_cuda_graph(
            self._batch(padded, batch.seq_lens_cpu + [1] * (padded - bs))
        )
        self.graphs[padded].replay()
        return self.logits[padded][:bs]


_NO_SAMPLING = SamplingBatch(
    temperatures=torch.empty(0),
    greedy=torch.empty(0, dtype=torch.bool),
    top_ps=torch.empty(0),
    top_ks=torch.empty(0, dtype=torch.int64),
    min_ps=torch.empty(0),
    all_greedy=True,
    use_top_p=False,
    use_top_k=False,
    use_min_p=False,
)
