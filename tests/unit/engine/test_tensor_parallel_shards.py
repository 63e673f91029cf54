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
        block = SparseMoeBlock(4, 8, num_experts=2, top_k=1, normalize_top_k=False, hidden_act="silu",
                               dtype=torch.float32)
        for name, tensor in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            block.load_expert(1, name, tensor)
        rows = slice(rank * 4, rank * 4 + 4)
        assert torch.equal(block.w13[1], torch.cat([gate[rows], up[rows]]))
        assert torch.equal(block.w2[1], down[:, rows])


def test_uneven_split_is_refused(as_rank):
    as_rank(0, 3)
    with pytest.raises(ValueError, match="do not divide"):
        QKVParallelLinear(16, 4, 8, 2, bias=False, dtype=torch.float32)
