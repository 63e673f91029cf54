"""Attention through FlashInfer (flashinfer-python).

The KV pool is handed to FlashInfer in the allocator's pages (`--page-size`; a page of one
token is a slot), so the pool and the request-to-token table are used as they are: each
step lists its requests' pages (`gather_kv_pages`) and plans FlashInfer's wrappers on the
host from the lengths the batch already carries, without reading anything back from the
device. (Re-planning a wrapper waits for the device to have copied its previous plan: see
`_Planned`; that keeps the host at most about one step ahead.) Extend steps use the paged
prefill kernel (causal, queries aligned to the end of each request's KV), with the KV split
over several blocks only where the prefix is long against the new tokens; decode steps use
the tensor-core decode kernel, which reads each KV head once for all the query heads of its
group. A mixed step of short requests goes through the prefill kernel whole, in one call.
Layers with different sliding windows get a plan each.

Decode steps can be captured in CUDA graphs: each captured batch size has its own decode
wrappers over fixed buffers, planned again before every replay.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kubesgl.engine.attention import FLASHINFER_HEAD_DIMS
from kubesgl.engine.attention.base import AttentionBackend, AttentionLayerSpec
from kubesgl.engine.attention.triton_kernels.kv_pages import gather_kv_pages
from kubesgl.engine.forward_batch import ForwardBatch, ForwardMode
from kubesgl.engine.kvcache.allocator import pages_for
from kubesgl.engine.kvcache.pools import KVPool, ReqToTokenTable

WORKSPACE_BYTES = 256 << 20  # FlashInfer's scratch space for split-KV partial results
# FlashInfer's prefill plan splits a request's KV over several blocks when the queries' tiles
# leave multiprocessors idle, and merges the parts in a second kernel. Over a prefix of up to
# a few times the step's new tokens the unsplit kernel is faster: on an H200, 256 new tokens
# take 12 µs a layer without a prefix (30 split), 512 take 49 µs over 1024 cached ones (85).
# Over long prefixes the split wins for small chunks (256 over 4096: 80 split, 130 not); 512
# over 4096 is split by this rule and gives up 21 µs (159 against 138), the one measured case
# it gets wrong. benchmarks/chunk_attention.py
UNSPLIT_PREFIX_PER_NEW_TOKEN = 4
# A mixed step of short requests and a small chunk is attended in one prefill call rather
# than a prefill and a decode call: on an H200 a 256-token chunk beside 32 decodes of 768
# tokens takes as long on the device that way (46-67 µs a layer against 46-78), and the host
# launches one call instead of two (23-31 µs against 44-46), which a mixed step between
# piecewise graphs waits for. Decodes of 4096 tokens are faster in the decode kernel (88 µs
# against 125 beside a first chunk), and so is a 512-token chunk (55-89 against 77-112).
# benchmarks/chunk_attention.py
ONE_PASS_MIXED_MAX_KV = 2048
ONE_PASS_MIXED_MAX_CHUNK = 256


def _import_flashinfer():
    try:
        import flashinfer
    except ImportError as exc:
        raise ValueError(
            "--attention-backend flashinfer needs the flashinfer-python package "
            "(pip install 'kubesgl[flashinfer]')"
        ) from exc
    return flashinfer


def _indptr(lengths: Sequence[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum_(0, dtype=torch.int32)


class PagedKVLengths:
    """A batch's KV lengths in FlashInfer's terms: pages per request, their offsets, and the
    tokens in each request's last page."""

    def __init__(self, seq_lens: Sequence[int], page_size: int):
        pages = [pages_for(n, page_size) for n in seq_lens]
        self.total_pages = sum(pages)
        self.indptr = _indptr(pages)
        self.last_page_len = torch.tensor(
            [n - (p - 1) * page_size for n, p in zip(seq_lens, pages)], dtype=torch.int32
        )


class _Planned:
    """A FlashInfer wrapper and its last plan. `plan` stages the schedule in a pinned host
    buffer that the device copies from when the step runs; with steps queued ahead of the
    device, planning again must wait until that copy has happened."""

    def __init__(self, wrapper):
        self.wrapper = wrapper
        self._staged: torch.cuda.Event | None = None

    def plan(self, *args, **kwargs) -> None:
        if self._staged is not None:
            self._staged.synchronize()
        self.wrapper.plan(*args, **kwargs)
        self._staged = torch.cuda.Event()
        self._staged.record()

    def run(
        self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor
    ) -> None:
        self.wrapper.run(q, kv, out=out)


class FlashInferAttentionBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(
        self, kv_pool: KVPool, req_to_token: ReqToTokenTable, layers: Sequence[AttentionLayerSpec]
    ):
        super().__init__(kv_pool, req_to_token, layers)
        self._flashinfer = _import_flashinfer()
        self.device = req_to_token.table.device
        self.q_dtype, self.kv_dtype = kv_pool.compute_dtype, kv_pool.dtype
        if self.device.type != "cuda":
            raise ValueError("--attention-backend flashinfer runs on CUDA devices only")
        if self.q_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"--attention-backend flashinfer needs --dtype bfloat16 or float16, not {self.q_dtype}"
            )
        shapes = {
            (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scaling) for layer in layers
        }
        if len(shapes) != 1:
            raise ValueError(
                "--attention-backend flashinfer needs every layer to have the same attention shape"
            )
        self.num_heads, self.num_kv_heads, self.head_dim, self.scaling = shapes.pop()
        if self.head_dim not in FLASHINFER_HEAD_DIMS:
            raise ValueError(
                f"--attention-backend flashinfer needs a head_dim in {FLASHINFER_HEAD_DIMS}, "
                f"not {self.head_dim}"
            )
        self.page_size = kv_pool.page_size
        # [pages, page_size, kv_heads, head_dim] views of each layer's K and V
        self.paged_kv = [
            tuple(t.view(-1, self.page_size, *t.shape[1:]) for t in (k, v))
            for k, v in zip(kv_pool.k, kv_pool.v)
        ]
        self.windows = sorted({layer.sliding_window for layer in layers}, key=lambda w: w or 0)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        fi = self._flashinfer
        self.prefill = {
            w: _Planned(
                fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
            )
            for w in self.windows
        }
        self.decode = {
            w: _Planned(
                fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True)
            )
            for w in self.windows
        }
        self.graph_decode: dict[int, dict[int | None, _Planned]] = {}
        self.graph_indices: torch.Tensor | None = None

    def _kv_pages(self, batch: ForwardBatch) -> tuple[PagedKVLengths, torch.Tensor]:
        lengths = PagedKVLengths(batch.seq_lens_cpu, self.page_size)
        pages = gather_kv_pages(
            self.req_to_token.table,
            batch.req_rows,
            batch.seq_lens,
            self.page_size,
            lengths.total_pages,
        )
        return lengths, pages

    def _plan_decode(self, wrappers: dict[int | None, _Planned], batch: ForwardBatch) -> None:
        lengths, pages = self._kv_pages(batch)
        for window, planned in wrappers.items():
            planned.plan(
                lengths.indptr,
                pages,
                lengths.last_page_len,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                self.page_size,
                window_left=_window_left(window),
                q_data_type=self.q_dtype,
                kv_data_type=self.kv_dtype,
                sm_scale=self.scaling,
            )
        batch.attn = wrappers

    def prepare(self, batch: ForwardBatch) -> None:
        if batch.mode is ForwardMode.DECODE:
            self._plan_decode(self.decode, batch)
            return
        lengths, pages = self._kv_pages(batch)
        qo_indptr = _indptr(batch.extend_lens_cpu)
        split_kv = prefill_splits_kv(batch.seq_lens_cpu, batch.extend_lens_cpu)
        for window, planned in self.prefill.items():
            planned.plan(
                qo_indptr,
                lengths.indptr,
                pages,
                lengths.last_page_len,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                self.page_size,
                causal=True,
                disable_split_kv=not split_kv,
                sm_scale=self.scaling,
                window_left=_window_left(window),
                q_data_type=self.q_dtype,
                kv_data_type=self.kv_dtype,
            )
        batch.attn = self.prefill

    def attends_mixed_in_one_pass(self, batch: ForwardBatch) -> bool:
        chunk = sum(batch.extend_lens_cpu[: batch.prefill_rows])
        return mixed_in_one_pass(chunk, max(batch.seq_lens_cpu))

    def init_cuda_graph(self, max_batch_size: int) -> None:
        # Requests may share cached prefixes, so a batch can list more pages than the pool has.
        pages_per_request = pages_for(self.req_to_token.max_context_len, self.page_size)
        self.graph_indices = torch.zeros(
            max_batch_size * pages_per_request,
            dtype=torch.int32,
            device=self.device,
        )

    def prepare_cuda_graph(self, batch: ForwardBatch) -> None:
        bs = batch.batch_size
        if bs not in self.graph_decode:
            fi = self._flashinfer
            last_page_len = torch.ones(bs, dtype=torch.int32, device=self.device)
            self.graph_decode[bs] = {
                w: _Planned(
                    fi.BatchDecodeWithPagedKVCacheWrapper(
                        self.workspace,
                        "NHD",
                        use_cuda_graph=True,
                        use_tensor_cores=True,
                        paged_kv_indptr_buffer=torch.zeros(
                            bs + 1, dtype=torch.int32, device=self.device
                        ),
                        paged_kv_indices_buffer=self.graph_indices,
                        paged_kv_last_page_len_buffer=last_page_len,
                    )
                )
                for w in self.windows
            }
        # The wrappers copy the pages into graph_indices, their fixed buffer, when planned.
        self._plan_decode(self.graph_decode[bs], batch)

    def attend(
        self, q: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch, out: torch.Tensor
    ) -> None:
        kv = self.paged_kv[layer.layer_id]
        batch.attn[layer.sliding_window].run(q.contiguous(), kv, out)


def prefill_splits_kv(seq_lens: Sequence[int], extend_lens: Sequence[int]) -> bool:
    """Whether an extend step's attention may split the KV (see UNSPLIT_PREFIX_PER_NEW_TOKEN)."""
    longest_prefix = max(seq - new for seq, new in zip(seq_lens, extend_lens))
    return longest_prefix > UNSPLIT_PREFIX_PER_NEW_TOKEN * sum(extend_lens)


def mixed_in_one_pass(chunk_tokens: int, longest_request: int) -> bool:
    """Whether a mixed step is attended in one prefill call (see ONE_PASS_MIXED_MAX_KV)."""
    return chunk_tokens <= ONE_PASS_MIXED_MAX_CHUNK and longest_request <= ONE_PASS_MIXED_MAX_KV


def _window_left(window: int | None) -> int:
    """FlashInfer counts the keys left of the query; kubesgl's window includes the query."""
    return -1 if window is None else window - 1
