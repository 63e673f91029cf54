"""Mixture-of-experts block with softmax top-k routing (Qwen3-MoE).

Experts are stacked into [experts, 2 * intermediate, hidden] (gate and up fused) and
[experts, hidden, intermediate] tensors; under tensor parallelism each rank holds a slice
of every expert's intermediate dimension and the block all-reduces its output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kubesgl.engine.distributed import get_tp_group
from kubesgl.engine.layers.activation import gated_activation
from kubesgl.engine.layers.kernels import LayerKernels


def route(
    router_logits: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids), both [tokens, top_k]; probabilities from a float32 softmax."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        normalize_top_k: bool,
        hidden_act: str,
        dtype: torch.dtype,
        kernels: LayerKernels = "torch",
    ):
        super().__init__()
        tp = get_tp_group()
        self.top_k, self.normalize_top_k, self.num_experts = top_k, normalize_top_k, num_experts
        self.intermediate_size = intermediate_size
        self.local_intermediate = tp.shard(intermediate_size)[1]
        self.act = gated_activation(hidden_act, kernels)
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, dtype=dtype)
        self.gate.weight.requires_grad_(False)
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * self.local_intermediate, hidden_size, dtype=dtype),
            requires_grad=False,
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, self.local_intermediate, dtype=dtype),
            requires_grad=False,
        )
        self.fused = (
            kernels == "triton"
        )  # the grouped-GEMM Triton kernel instead of the loop over experts

    def load_expert(self, expert: int, projection: str, loaded: torch.Tensor) -> None:
        """Copy this rank's slice of one expert's gate_proj, up_proj or down_proj."""
        start = get_tp_group().rank * self.local_intermediate
        size = self.local_intermediate
        if projection == "down_proj":
            self.w2.data[expert].copy_(loaded[:, start : start + size])
            return
        offset = {"gate_proj": 0, "up_proj": size}[projection]
        self.w13.data[expert, offset : offset + size].copy_(loaded[start : start + size])

    def load_fused(self, name: str, loaded: torch.Tensor) -> None:
        """Stacked checkpoints: gate_up_proj [experts, 2 * intermediate, hidden], down_proj [experts, hidden, intermediate]."""
        for expert in range(self.num_experts):
            if name == "down_proj":
                self.load_expert(expert, "down_proj", loaded[expert])
            else:
                gate, up = loaded[expert].chunk(2, dim=0)
                self.load_expert(expert, "gate_proj", gate)
                self.load_expert(expert, "up_proj", up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.normalize_top_k)
        if self.fused:
            from kubesgl.engine.layers.triton_kernels.fused_moe import fused_moe

            return get_tp_group().all_reduce(
                fused_moe(x, self.w13, self.w2, weights, experts, self.act)
            )
        out = torch.zeros_like(x)
        # Loop over the experts that received tokens: the CPU path, and the reference.
        for expert in experts.unique().tolist():
            token_idx, slot = torch.where(experts == expert)
            h = self.act(F.linear(x[token_idx], self.w13[expert]))
            h = F.linear(h, self.w2[expert]) * weights[token_idx, slot, None]
            out.index_add_(0, token_idx, h.to(out.dtype))
        return get_tp_group().all_reduce(out)
