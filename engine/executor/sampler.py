"""Turns logits into tokens: penalties, grammar masks, temperature, top-k, top-p, min-p, per-request seeds.

Sampling uses the exponential-race form of the categorical draw: argmax(p / E) with
E ~ Exp(1) picks token i with probability p_i, and lets a seeded row draw its own noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xgrammar

from kubesgl.engine.forward_batch import PenaltyBatch, SamplingBatch, host_to_device


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] log-probability of each sampled token
    top_ids: torch.Tensor | None = None  # [B, k]
    top_logprobs: torch.Tensor | None = None  # [B, k]


class PenaltyState:
    """Token counts per request-table row, kept on the device so that the scheduler never
    waits for a step's tokens to build the next step's penalties."""

    def __init__(self, num_rows: int, vocab_size: int, device: torch.device):
        self.num_rows, self.vocab_size, self.device = num_rows, vocab_size, device
        self._output_counts: torch.Tensor | None = None  # [rows, vocab] int32
        self._seen: torch.Tensor | None = None  # [rows, vocab] bool: in the prompt or the output

    def _ensure(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The output counts and the seen mask, allocated on first use: most deployments never
        penalise."""
        if self._output_counts is None or self._seen is None:
            self._output_counts = torch.zeros(
                self.num_rows, self.vocab_size, dtype=torch.int32, device=self.device
            )
            self._seen = torch.zeros(
                self.num_rows, self.vocab_size, dtype=torch.bool, device=self.device
            )
        return self._output_counts, self._seen

    def reset(self, resets: list[tuple[int, list[int], list[int]]]) -> None:
        output_counts, seen = self._ensure()
        for row, prompt, outputs in resets:
            output_counts[row].zero_()
            seen[row].zero_()
            # index_fill_, not `seen[row, ids] = True`: that copies the True to the device and waits
            seen[row].index_fill_(0, self._on_device(prompt), True)
            if outputs:
                ids = self._on_device(outputs)
                output_counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
                seen[row].index_fill_(0, ids, True)

    def _on_device(self, token_ids: list[int]) -> torch.Tensor:
        return host_to_device(torch.tensor(token_ids, dtype=torch.int64), self.device)

    def apply(
        self, logits: torch.Tensor, rows: torch.Tensor, penalties: PenaltyBatch
    ) -> torch.Tensor:
        output_counts, seen_rows = self._ensure()
        counts = output_counts[rows].float()
        seen = seen_rows[rows]
        rep = penalties.repetition.unsqueeze(1)
        # Repetition penalty (CTRL): shrink the logit of every token already seen.
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - penalties.frequency.unsqueeze(1) * counts
        return logits - penalties.presence.unsqueeze(1) * (counts > 0).float()

    def record(self, rows: torch.Tensor, tokens: torch.Tensor, emits: torch.Tensor) -> None:
        output_counts, seen = self._ensure()
        # every row is written, the non-emitting ones with nothing: selecting the emitting rows
        # first (rows[emits]) would wait for the device to count them. A step has each row once.
        output_counts[rows, tokens] += emits.to(torch.int32)
        seen[rows, tokens] |= emits


def top_k_top_p_min_p_mask(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor
) -> torch.Tensor:
    """True for the tokens each row may sample.

    top-k keeps the k most likely tokens; top-p keeps the smallest set of most likely tokens
    whose mass reaches p; min-p keeps tokens at least p times as likely as the most likely.
    """
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    keep_sorted = ranks < top_ks.unsqueeze(1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep_sorted &= mass_before < top_ps.unsqueeze(1)
    keep_sorted &= sorted_probs >= min_ps.unsqueeze(1) * sorted_probs[:, :1]
    keep_sorted[:, 0] = True  # the most likely token always stays
    return torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)


class Sampler:
    def __init__(self, penalty_state: PenaltyState):
        self.penalty_state = penalty_state

    @staticmethod
    def warm_up_mask(vocab_size: int, device: torch.device) -> None:
        """Run the grammar-mask kernel once (on a GPU, xgrammar's Triton kernel compiles at first use)."""
        logits = torch.zeros(1, vocab_size, device=device)
        xgrammar.apply_token_bitmask_inplace(
            logits, torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32, device=device)
        )

    def __call__(
        self, logits: torch.Tensor, sampling: SamplingBatch, rows: torch.Tensor, emits: torch.Tensor
    ) -> SampleOutput:
        raw_logits = logits
        if sampling.penalties is not None:
            if sampling.penalties.resets:
                self.penalty_state.reset(sampling.penalties.resets)
            logits = self.penalty_state.apply(logits, rows, sampling.penalties)
        # logprobs are the model's own distribution: masks go on a copy when they are reported
        keep_raw = sampling.top_logprobs >= 0
        if sampling.logit_bias is not None:
            bias = sampling.logit_bias
            if logits is raw_logits and keep_raw:
                logits = logits.clone()
            logits[bias.rows, bias.token_ids] += bias.values
        if sampling.banned is not None:  # tokens that would end a request before min_tokens
            if logits is raw_logits and keep_raw:
                logits = logits.clone()
            logits[sampling.banned.rows, sampling.banned.token_ids] = float("-inf")
        if sampling.vocab_mask is not None:
            # Every mode below samples from these logits: a disallowed token is -inf, so neither
            # argmax nor the temperature/top-k/top-p/min-p draw can pick it.
            bitmask = host_to_device(sampling.vocab_mask.wait(), logits.device)
            if logits is raw_logits and keep_raw:
                logits = logits.clone()
            xgrammar.apply_token_bitmask_inplace(logits, bitmask)
        if sampling.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, sampling)
        if sampling.penalties is not None:
            self.penalty_state.record(rows, tokens, emits)
        out = SampleOutput(token_ids=tokens)
        if sampling.top_logprobs >= 0:
            # Log-probabilities of the model's own distribution, before penalties and temperature.
            logprobs = torch.log_softmax(raw_logits, dim=-1)
            out.logprobs = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
            if sampling.top_logprobs > 0:
                out.top_logprobs, out.top_ids = logprobs.topk(sampling.top_logprobs, dim=-1)
        return out

    def _sample(self, logits: torch.Tensor, sampling: SamplingBatch) -> torch.Tensor:
        probs = torch.softmax(logits / sampling.temperatures.unsqueeze(1), dim=-1)
        if sampling.use_top_k or sampling.use_top_p or sampling.use_min_p:
            keep = top_k_top_p_min_p_mask(probs, sampling.top_ks, sampling.top_ps, sampling.min_ps)
            probs = probs.masked_fill(~keep, 0.0)
        noise = torch.empty_like(probs).exponential_()
        for row, seed in sampling.seeded_rows:
            generator = torch.Generator(device=probs.device).manual_seed(seed)
            noise[row] = torch.empty(probs.shape[1], device=probs.device).exponential_(
                generator=generator
            )
        sampled = (probs / noise.clamp_(min=1e-20)).argmax(dim=-1)  # a zero draw would make 0/0
        return torch.where(sampling.greedy, logits.argmax(dim=-1), sampled)
