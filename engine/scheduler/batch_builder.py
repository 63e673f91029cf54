"""Turns the requests chosen for a step into a ForwardBatch: allocates their KV slots,
lists the request-table writes, and gathers their sampling options into tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kubesgl.engine.forward_batch import (
    BannedTokens,
    ForwardBatch,
    ForwardMode,
    LogitBias,
    PenaltyBatch,
    SamplingBatch,
    VocabMask,
)
from kubesgl.engine.scheduler.kv_manager import KVManager
from kubesgl.engine.scheduler.request import Req

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, position) pairs over the 63-bit seed space


@dataclass
class ScheduledBatch:
    step: int
    reqs: list[Req]
    extend_lens: list[int]
    emits: list[bool]  # whether row i samples a real output token
    prefill_rows: int  # rows [0, prefill_rows) add prompt chunks; the rest decode
    forward: ForwardBatch


@dataclass
class _Rows:
    """Rows of a step before their KV slots are allocated: a request, and the tokens it adds."""

    reqs: list[Req] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    emits: list[bool] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)


class BatchBuilder:
    def __init__(self, kv: KVManager, vocab_size: int, future_capacity: int):
        self.kv = kv
        self.vocab_size = vocab_size
        self.future_capacity = future_capacity
        self._next_future = 1  # future slot 0 is never used: -0 would read as token 0
        self._step = 0

    def _future_slots(self, count: int) -> list[int]:
        slots = []
        for _ in range(count):
            slots.append(self._next_future)
            self._next_future = self._next_future % self.future_capacity + 1
        return slots

    def extend(self, chunks: list[tuple[Req, int]]) -> ScheduledBatch:
        """A prefill step: each request adds its next `n` tokens to fill (its prompt, and the
        outputs it had when it was retracted)."""
        return self._build(ForwardMode.EXTEND, self._prefill_rows(chunks), _Rows())

    def decode(self, reqs: list[Req]) -> ScheduledBatch:
        """A decode step: each request feeds its newest token, known or still in flight."""
        return self._build(ForwardMode.DECODE, _Rows(), self._decode_rows(reqs))

    def mixed(self, chunks: list[tuple[Req, int]], reqs: list[Req]) -> ScheduledBatch:
        """Both in one step: the chunks' rows first, then the decodes'."""
        return self._build(ForwardMode.MIXED, self._prefill_rows(chunks), self._decode_rows(reqs))

    @staticmethod
    def _prefill_rows(chunks: list[tuple[Req, int]]) -> _Rows:
        rows = _Rows()
        for req, n in chunks:
            start = req.num_scheduled
            rows.reqs.append(req)
            rows.lens.append(n)
            rows.emits.append(start + n == req.fill_len)
            rows.input_ids += req.fill_ids()[start : start + n]
            rows.positions += range(start, start + n)
        return rows

    @staticmethod
    def _decode_rows(reqs: list[Req]) -> _Rows:
        input_ids = [_decode_input(req) for req in reqs]
        positions = [req.num_scheduled for req in reqs]
        return _Rows(list(reqs), [1] * len(reqs), [True] * len(reqs), input_ids, positions)

    def _build(self, mode: ForwardMode, prefill: _Rows, decode: _Rows) -> ScheduledBatch:
        self._step += 1
        reqs, lens, emits = (
            prefill.reqs + decode.reqs,
            prefill.lens + decode.lens,
            prefill.emits + decode.emits,
        )
        input_ids, positions = (
            prefill.input_ids + decode.input_ids,
            prefill.positions + decode.positions,
        )
        out_cache_loc: list[int] = []
        seq_lens: list[int] = []
        rows: list[int] = []
        cols: list[int] = []
        slots: list[int] = []
        for req, n in zip(reqs, lens):
            out_cache_loc += self.kv.grow(req, n)
            req.num_scheduled += n
            seq_lens.append(req.num_scheduled)
            rows += [req.table_row] * (req.num_scheduled - req.table_len)
            cols += range(req.table_len, req.num_scheduled)
            slots += req.slots[req.table_len : req.num_scheduled]
            req.table_len = req.num_scheduled
            req.last_step = self._step
        future_slots = self._future_slots(len(reqs))
        sampling = self._sampling(reqs, emits)
        for req, emit, future in zip(reqs, emits, future_slots):
            if emit:
                req.outputs_scheduled += 1
                req.future_slot = future
        as_long = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
        forward = ForwardBatch(
            mode=mode,
            input_ids=as_long(input_ids),
            positions=as_long(positions),
            out_cache_loc=as_long(out_cache_loc),
            req_rows=as_long([req.table_row for req in reqs]),
            seq_lens=as_long(seq_lens),
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=list(lens),
            extend_lens=as_long(lens),
            table_rows=as_long(rows),
            table_cols=as_long(cols),
            table_slots=as_long(slots),
            future_slots=as_long(future_slots),
            emits=torch.tensor(emits, dtype=torch.bool),
            sampling=sampling,
            prefill_rows=len(prefill.reqs),
        )
        return ScheduledBatch(self._step, reqs, list(lens), list(emits), len(prefill.reqs), forward)

    def _sampling(self, reqs: list[Req], emits: list[bool]) -> SamplingBatch:
        params = [req.params for req in reqs]
        greedy = [p.greedy for p in params]
        top_ks = [min(p.top_k, self.vocab_size) if p.top_k > 0 else self.vocab_size for p in params]
        seeded = [
            (i, (p.seed * _SEED_MIX + req.outputs_scheduled) % (1 << 63))
            for i, (req, p) in enumerate(zip(reqs, params))
            if p.seed is not None and not p.greedy
        ]
        penalties = None
        if any(p.has_penalties for p in params):
            # A row's state starts from its request's tokens the first time a batch with
            # penalties holds it: the prompt, and the first token where another engine sampled it.
            resets = [
                (req.table_row, req.prompt_ids, list(req.output_ids))
                for req in reqs
                if not req.penalties_ready
            ]
            for req in reqs:
                req.penalties_ready = True
            penalties = PenaltyBatch(
                repetition=torch.tensor(
                    [p.repetition_penalty for p in params], dtype=torch.float32
                ),
                frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32),
                presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32),
                resets=resets,
            )
        banned = [
            (row, token)
            for row, req in enumerate(reqs)
            if req.outputs_scheduled < req.params.min_tokens
            for token in req.ending_ids
        ]
        biased = [(row, req.bias) for row, req in enumerate(reqs) if req.bias is not None]
        wanted = [p.logprobs for p, emit in zip(params, emits) if p.logprobs is not None and emit]
        return SamplingBatch(
            temperatures=torch.tensor(
                [1.0 if g else p.temperature for p, g in zip(params, greedy)], dtype=torch.float32
            ),
            greedy=torch.tensor(greedy, dtype=torch.bool),
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            top_ks=torch.tensor(top_ks, dtype=torch.int64),
            min_ps=torch.tensor([p.min_p for p in params], dtype=torch.float32),
            all_greedy=all(greedy),
            use_top_p=any(p.top_p < 1.0 for p in params),
            use_top_k=any(k < self.vocab_size for k in top_ks),
            use_min_p=any(p.min_p > 0.0 for p in params),
            seeded_rows=seeded,
            penalties=penalties,
            banned=BannedTokens(
                rows=torch.tensor([row for row, _ in banned], dtype=torch.int64),
                token_ids=torch.tensor([token for _, token in banned], dtype=torch.int64),
            )
            if banned
            else None,
            logit_bias=_logit_bias(biased) if biased else None,
            top_logprobs=max(wanted) if wanted else -1,
            # filled by the scheduler once every row's earlier tokens are known
            vocab_mask=VocabMask(len(reqs), self.vocab_size)
            if any(r.grammar for r in reqs)
            else None,
        )


def _logit_bias(biased: list[tuple[int, tuple[torch.Tensor, torch.Tensor]]]) -> LogitBias:
    """The rows' logit biases as one list of entries: each request's tensors, built when it
    arrived (Req.bias), joined, and its row repeated once per entry."""
    token_ids = [ids for _, (ids, _) in biased]
    return LogitBias(
        rows=torch.repeat_interleave(
            torch.tensor([row for row, _ in biased], dtype=torch.int64),
            torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64),
        ),
        token_ids=torch.cat(token_ids),
        values=torch.cat([values for _, (_, values) in biased]),
    )


def _decode_input(req: Req) -> int:
    """The token a decode step feeds: the newest output, or, while the step that samples it is
    in flight, minus its future slot (the model runner reads the token from there)."""
    if len(req.output_ids) == req.outputs_scheduled:
        return req.output_ids[-1]
    assert req.future_slot is not None  # set when the step in flight was scheduled
    return -req.future_slot
