"""One forward step as the executor receives it: plain tensors, built on the CPU by the
scheduler and moved to the device in one go. Nothing here refers to scheduler objects."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch


class ForwardMode(Enum):
    EXTEND = auto()  # prefill: each request adds one or more tokens after its cached prefix
    DECODE = auto()  # each request adds exactly one token
    MIXED = auto()  # prefill chunks, then decodes (one token each): see ForwardBatch.prefill_rows


@dataclass
class PenaltyBatch:
    """Repetition, frequency and presence penalties of the rows that use any."""

    repetition: torch.Tensor  # [B] float32, 1.0 = off
    frequency: torch.Tensor  # [B] float32
    presence: torch.Tensor  # [B] float32
    # Rows (of the request table) to reset before this step, with the prompt and the outputs
    # so far that each row starts from.
    resets: list[tuple[int, list[int], list[int]]] = field(default_factory=list)


@dataclass
class BannedTokens:
    """Tokens that rows may not sample: (rows[i], token_ids[i]) pairs, such as the tokens that
    would end a request before its min_tokens."""

    rows: torch.Tensor  # [N] int64, rows of the batch
    token_ids: torch.Tensor  # [N] int64


@dataclass
class LogitBias:
    """Amounts added to rows' logits before sampling, (rows[i], token_ids[i]) by values[i]:
    the requests' logit_bias."""

    rows: torch.Tensor  # [N] int64, rows of the batch
    token_ids: torch.Tensor  # [N] int64
    values: torch.Tensor  # [N] float32


class VocabMask:
    """Which tokens each row may sample, as a bitmask (bit t of row i: token t allowed), filled
    by the scheduler from its grammars. With overlap, a step is launched before the tokens of
    the step before it are known, and those tokens decide this step's mask: the executor waits
    for `wait` only when it samples, after the forward pass."""

    def __init__(self, batch_size: int, vocab_size: int):
        # every bit set: a row without a grammar (or that samples nothing) is unconstrained
        self.bitmask = torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32)
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def set_ready(self, error: BaseException | None = None) -> None:
        self._error = error
        self._ready.set()

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set()

    def wait(self) -> torch.Tensor:
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(
                "the scheduler could not fill this step's grammar mask"
            ) from self._error
        return self.bitmask


@dataclass
class SamplingBatch:
    temperatures: torch.Tensor  # [B] float32; greedy rows hold 1.0 and are picked by argmax
    greedy: torch.Tensor  # [B] bool
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64; vocab size where off
    min_ps: torch.Tensor  # [B] float32
    all_greedy: bool
    use_top_p: bool
    use_top_k: bool
    use_min_p: bool
    # (row in batch, seed) of rows with their own seed; the seed already mixes in the position.
    seeded_rows: list[tuple[int, int]] = field(default_factory=list)
    penalties: PenaltyBatch | None = None
    banned: BannedTokens | None = None
    logit_bias: LogitBias | None = None
    top_logprobs: int = -1  # -1: no logprobs in this batch; k >= 0: sampled token's and top k
    vocab_mask: VocabMask | None = None  # rows with a grammar; None when the batch has none


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64; a value -f stands for the token sampled into future slot f
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, KV slot each token writes
    req_rows: torch.Tensor  # [B] int64, rows of the request-to-token table
    seq_lens: torch.Tensor  # [B] int64, KV length of each request after this step
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]  # [B] tokens each request adds (1 in decode)
    # [B] int64, extend_lens_cpu again, copied with the batch: a tensor made from the list in
    # the middle of a step would be a blocking copy, and the host would wait for the device
    extend_lens: torch.Tensor
    table_rows: torch.Tensor  # request-to-token writes applied before the step
    table_cols: torch.Tensor
    table_slots: torch.Tensor
    future_slots: torch.Tensor  # [B] where each row's sampled token is kept for later steps
    emits: torch.Tensor  # [B] bool, rows whose sampled token is a real output
    sampling: SamplingBatch
    attn: Any = None  # attention metadata, set by the attention backend
    prefill_rows: int = 0  # MIXED: the first rows extend by prompt chunks, the rest decode

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def split_mixed(self) -> tuple[ForwardBatch, ForwardBatch]:
        """A MIXED batch as an EXTEND batch of its prefill rows and a DECODE batch of the rest,
        for attention: views of this batch's rows and tokens (its table writes, sampling and
        future slots stay with it, and apply once)."""
        rows, tokens = self.prefill_rows, sum(self.extend_lens_cpu[: self.prefill_rows])

        def part(mode: ForwardMode, row_range: slice, token_range: slice) -> ForwardBatch:
            return dataclasses.replace(
                self,
                mode=mode,
                input_ids=self.input_ids[token_range],
                positions=self.positions[token_range],
                out_cache_loc=self.out_cache_loc[token_range],
                req_rows=self.req_rows[row_range],
                seq_lens=self.seq_lens[row_range],
                seq_lens_cpu=self.seq_lens_cpu[row_range],
                extend_lens_cpu=self.extend_lens_cpu[row_range],
                extend_lens=self.extend_lens[row_range],
                attn=None,
                prefill_rows=0,
            )

        return (
            part(ForwardMode.EXTEND, slice(None, rows), slice(None, tokens)),
            part(ForwardMode.DECODE, slice(rows, None), slice(tokens, None)),
        )

    def to(self, device: torch.device) -> ForwardBatch:
        if device.type == "cpu":
            return self
        return move_in_one_copy(self, device)


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, its copy queued on the device's stream without the host
    waiting: a copy from pinned memory is truly asynchronous, where `torch.tensor(values,
    device=...)` or a blocking `.to` waits for every step already queued on the device."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


# bytes: where each tensor's view starts. 16, not just its element size: Triton specialises
# a kernel on 16-byte aligned pointers and would compile another variant for the others.
_ALIGN = 16


def move_in_one_copy(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    """The batch with every tensor in it (its sampling's too) on `device`, as views of one
    buffer filled by a single asynchronous copy. A step carries about sixteen small tensors:
    one copy each would put as many transfers on the stream between two steps."""
    tensors = list(_tensors(batch))
    parts, sizes, is_data = [], [], []
    for tensor in tensors:
        parts.append(tensor.contiguous().view(-1).view(torch.uint8))
        sizes.append(tensor.nbytes)
        is_data.append(True)
        if padding := -tensor.nbytes % _ALIGN:
            parts.append(torch.zeros(padding, dtype=torch.uint8))
            sizes.append(padding)
            is_data.append(False)
    staged = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=device.type == "cuda")
    moved = host_to_device(torch.cat(parts, out=staged), device)
    pieces = (piece for piece, data in zip(moved.split(sizes), is_data) if data)
    views = (
        piece.view(t.dtype) if t.dim() == 1 else piece.view(t.dtype).view(t.shape)
        for piece, t in zip(pieces, tensors)
    )
    return _replace_tensors(batch, lambda _: next(views))


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in `value`, in its dataclasses' fields, depth first."""
    if isinstance(value, torch.Tensor):
        yield value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _tensors(getattr(value, f.name))


def _replace_tensors(value: Any, replace: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`value` with each tensor in it replaced by `replace(tensor)`, in `_tensors`' order."""
    if isinstance(value, torch.Tensor):
        return replace(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(
            value,
            **{
                f.name: _replace_tensors(getattr(value, f.name), replace)
                for f in dataclasses.fields(value)
            },
        )
    return value
