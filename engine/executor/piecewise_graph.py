"""Piecewise CUDA graphs for prefill and mixed steps.

An eager forward pass is bound by launching its kernels: on an H200 one of the 8B shape costs
about 19 ms of host time at any size, more than the device needs for a 256- or 512-token step
(benchmarks/README.md). The decode graphs cannot take these steps: their attention depends on
each request's prompt and chunk lengths. So the model is cut at attention. Each piece (a
layer's o_proj and MLP, then the next layer's norm, qkv_proj, RoPE and KV store) is captured
once per token count in `token_counts`, and attention runs eagerly between pieces, prepared
for the real batch exactly as in an eager step. A step is padded up to the next captured
count; every piece computes each token's row from that row alone, and the padding rows store
their K and V in the padding slot (0), so they change nothing and are never read.

The pieces hand their results over through fixed buffers (q; the residual stream; attention's
output, which the backend writes in place; the step's KV slots, read by the captured stores),
so what a piece allocates lives only until the next piece's capture may reuse it, and the
graphs of all token counts share one memory pool. Between two pieces the host so launches
attention alone: on an H200 each attention call costs 20-45 µs of host time
(benchmarks/chunk_attention.py), and a mixed step may make two in each of its layers.
"""

from __future__ import annotations

import bisect
import functools
import logging
from collections.abc import Callable
from typing import Protocol

import torch

from kubesgl.engine.attention import AttentionBackend
from kubesgl.engine.executor.cuda_graph import collector_paused
from kubesgl.engine.forward_batch import ForwardBatch, ForwardMode
from kubesgl.engine.kvcache.pools import KVPool
from kubesgl.engine.models.decoder import CausalLM, DecoderLayer

logger = logging.getLogger(__name__)


def default_token_counts(max_tokens: int) -> list[int]:
    # finer where padding would cost most in proportion
    counts = [8, 16, 32, *range(64, 513, 64), *range(640, 1025, 128), *range(1280, max_tokens, 256)]
    return sorted({c for c in counts if c < max_tokens} | {max_tokens})


class _Replayable(Protocol):
    def replay(self) -> None: ...


class _EagerPiece:
    """A piece run as it is, where CUDA graphs are unavailable: it lets the pieces and their
    buffers be checked against the whole model on the CPU."""

    def __init__(self, piece: Callable[[], None]):
        self.replay = piece


class PiecewiseGraphRunner:
    def __init__(self, model: CausalLM, kv_pool: KVPool, max_tokens: int):
        self.model, self.kv_pool = model, kv_pool
        self.layers: list[DecoderLayer] = list(model.layers)  # type: ignore[arg-type]
        self.specs = model.attention_specs()
        self.token_counts = default_token_counts(max_tokens)
        embedding = model.embed_tokens.weight
        device, dtype = embedding.device, embedding.dtype
        n, hidden = self.token_counts[-1], model.config.hidden_size
        spec = self.specs[0]  # one q buffer and one output buffer serve every layer
        if any(
            (s.num_heads, s.num_kv_heads, s.head_dim)
            != (spec.num_heads, spec.num_kv_heads, spec.head_dim)
            for s in self.specs
        ):
            raise ValueError("piecewise CUDA graphs need every layer to have the same head shape")
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=device)
        # contiguous, unlike a view of the fused qkv projection, so attention takes it as it is
        self.q = torch.zeros(n, spec.num_heads, spec.head_dim, dtype=dtype, device=device)
        self.attention = torch.zeros_like(self.q)
        self.residual = torch.zeros(n, hidden, dtype=dtype, device=device)
        self.hidden = torch.zeros(n, hidden, dtype=dtype, device=device)
        self.pieces: dict[int, list[_Replayable]] = {}
        self._capture_all(device)

    def can_run(self, batch: ForwardBatch) -> bool:
        return (
            batch.mode in (ForwardMode.EXTEND, ForwardMode.MIXED)
            and batch.num_tokens <= self.token_counts[-1]
        )

    def run(
        self, input_ids: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend
    ) -> torch.Tensor:
        """The model's logits for `batch`, whose attention `backend` has prepared."""
        t = batch.num_tokens
        pieces = self.pieces[self.token_counts[bisect.bisect_left(self.token_counts, t)]]
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(batch.positions)
        self.out_cache_loc[:t].copy_(batch.out_cache_loc)
        self.out_cache_loc[t:].zero_()  # padding rows store into the padding slot
        q, out = self.q[:t], self.attention[:t]
        pieces[0].replay()
        for spec, piece in zip(self.specs, pieces[1:]):
            backend.attend(q, spec, batch, out)  # the piece before stored this layer's K and V
            piece.replay()
        return self.model.logits(self.hidden[:t], self.residual[:t], batch)

    def _piece(self, index: int, n: int) -> None:
        """Piece `index` over the first n rows: the embedding and the first layer's part
        before attention (0), layer index-1's part after attention and layer index's before
        it, or the last layer's part after attention (len(layers))."""
        residual: torch.Tensor | None = None
        if index == 0:
            hidden = self.model.embed_tokens(self.input_ids[:n])
        else:
            hidden, residual = self.layers[index - 1].after_attention(
                self.attention[:n].view(n, -1), self.residual[:n]
            )
            if index == len(self.layers):
                self.hidden[:n].copy_(hidden)
                self.residual[:n].copy_(residual)
                return
        q, k, v, residual = self.layers[index].before_attention(
            hidden, residual, self.positions[:n]
        )
        self.kv_pool.write(self.specs[index].layer_id, self.out_cache_loc[:n], k, v)
        self.q[:n].copy_(q)
        self.residual[:n].copy_(residual)

    @torch.inference_mode()
    def _capture_all(self, device: torch.device) -> None:
        if device.type != "cuda":
            for n in self.token_counts:
                self.pieces[n] = [
                    _EagerPiece(functools.partial(self._piece, i, n))
                    for i in range(len(self.layers) + 1)
                ]
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with collector_paused(), torch.cuda.stream(stream):
            for n in reversed(self.token_counts):  # largest first: smaller ones reuse its memory
                graphs: list[_Replayable] = []
                for index in range(len(self.layers) + 1):
                    self._piece(index, n)  # warm up: Triton compiles, cuBLAS picks algorithms
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self._piece(index, n)
                    graphs.append(graph)
                self.pieces[n] = graphs
        torch.cuda.current_stream().wait_stream(stream)
        logger.info("captured piecewise CUDA graphs for token counts %s", self.token_counts)
