"""Vocabulary-parallel embedding, also used as the LM head: each rank holds a contiguous
slice of the vocabulary (padded so that it divides evenly)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kubesgl.engine.distributed import get_tp_group
from kubesgl.engine.layers.kernels import LayerKernels
from kubesgl.engine.layers.linear import linear


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        kernels: LayerKernels = "torch",
    ):
        super().__init__()
        tp = get_tp_group()
        self.kernels = kernels  # for the LM head
        self.vocab_size = vocab_size
        self.padded_vocab = -(-vocab_size // tp.size) * tp.size
        self.start, self.local_vocab = tp.shard(self.padded_vocab)
        self.weight = nn.Parameter(
            torch.zeros(self.local_vocab, hidden_size, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape != (self.vocab_size, param.shape[1]):
            raise ValueError(
                f"embedding {tuple(loaded.shape)} does not fit ({self.vocab_size}, {param.shape[1]})"
            )
        rows = loaded[self.start : self.start + self.local_vocab]
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        tp = get_tp_group()
        if tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.local_vocab)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return tp.all_reduce(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the whole vocabulary, as the LM head."""
        local = linear(hidden, self.weight, None, self.kernels).float()
        return get_tp_group().all_gather_last_dim(local)[..., : self.vocab_size]
