"""How weights split over tensor-parallel ranks, checked rank by rank without processes:
each rank's parameters must be exactly its slice of the checkpoint tensor."""

from __future__ import annotations

import pytest
import torch

from kubesgl.engine.distributed import parallel_state
from kubesgl.engine.distributed.parallel_state import TensorParallelGroup
from kubesgl.engine.layers.linear import QKVParallelLinear, RowParallelLinear
from kubesgl.engine.layers.moe import SparseMoeBlock


@pytest.fixture
def as_rank(monkeypatch):
    def set_rank(rank: int, size: int) -> None:
        monkeypatch.setattr(parallel_state, "_group", TensorParallelGroup(rank=rank, size=size))

    return set_rank


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_kv_heads_split_or_replicated(as_rank, size):
    heads, kv_heads, dim, hidden = 8, 2, 4, 16
    k = torch.arange(kv_heads * dim * hidden, dtype=torch.float32).view(kv_heads * dim, hidden)
    for rank in range(size):
        as_rank(rank, size)
        layer = QKVParallelLinear(hidden, dim, heads, kv_heads, bias=False, dtype=torch.float32)
        layer.weight.weight_loader(layer.weight, k, "k")
        local_q_heads = heads // size
        first_q_head = rank * local_q_heads
        # the KV head the rank's query heads use (grouped-query attention)
        kv_head = first_q_head // (heads // kv_heads)
        local_kv = max(1, kv_heads // size)
        expected = k[kv_head * dim : (kv_head + local_kv) * dim]
        q_rows = local_q_heads * dim
        assert torch.equal(layer.weight[q_rows : q_rows + local_kv * dim], expected)


def test_row_parallel_takes_its_columns(as_rank):
    weight = torch.randn(6, 8)
    for rank in range(2):
        as_rank(rank, 2)
        layer = RowParallelLinear(8, 6, bias=False, dtype=torch.float32)
        layer.weight.weight_loader(layer.weight, weight)
        assert torch.equal(layer.weight, weight[:, rank * 4 : rank * 4 + 4])


def test_moe_experts_shard_their_intermediate_dimension(as_rank):
    gate, up, down = torch.randn(8, 4), torch.randn(8, 4), torch.randn(4, 8)
    for rank in range(2):
        as_rank(rank, 2)
        block = SparseMoeBlock(
            4,
            8,
            num_experts=2,
            top_k=1,
            normalize_top_k=False,
            hidden_act="silu",
            dtype=torch.float32,
        )
        for name, tensor in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            block.load_expert(1, name, tensor)
        rows = slice(rank * 4, rank * 4 + 4)
        assert torch.equal(block.w13[1], torch.cat([gate[rows], up[rows]]))
        assert torch.equal(block.w2[1], down[:, rows])


def test_uneven_split_is_refused(as_rank):
    as_rank(0, 3)
    with pytest.raises(ValueError, match="do not divide"):
        QKVParallelLinear(16, 4, 8, 2, bias=False, dtype=torch.float32)


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe"])
def test_collectives_per_forward_pass(arch, tiny_model, monkeypatch):
    """A forward pass at TP > 1 all-reduces the embedding and each layer's attention and MLP
    (or MoE) output, and all-gathers the logits once: what benchmarks/tp_scaling.py counts.
    The model is built with one rank; a group that counts, and claims two ranks, serves the
    forward pass (each collective hands its input back, as a sum over one real rank would)."""
    import sys
    from dataclasses import dataclass, field
    from pathlib import Path

    from kubesgl.engine import LLM, SamplingParams

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    from tp_scaling import allreduces_per_forward

    @dataclass(frozen=True)
    class CountingGroup(TensorParallelGroup):
        calls: dict = field(default_factory=lambda: {"all_reduce": 0, "all_gather": 0})

        def all_reduce(self, tensor, op=None):
            self.calls["all_reduce"] += 1
            return tensor

        def all_gather_last_dim(self, tensor):
            self.calls["all_gather"] += 1
            return tensor

    path = tiny_model(arch)
    with LLM(path, dtype="float32", device="cpu", max_total_tokens=1024) as llm:
        group = CountingGroup(rank=0, size=2)
        monkeypatch.setattr(parallel_state, "_group", group)
        llm.generate(
            [[5, 6, 7]], SamplingParams(max_tokens=1)
        )  # one prefill step: one forward pass
        monkeypatch.setattr(parallel_state, "_group", TensorParallelGroup())
    assert group.calls == allreduces_per_forward(path)
