"""Facts that every tensor-parallel rank must act on alike.

Each rank of an engine drives its own NIXL agent (its shard of the KV pool), and rank 0
alone talks HTTP and keeps the clocks that time rooms out. A room may only count as sent or
arrived once every rank says so, and every rank must change its state in the same order, or
the ranks would schedule different steps. So each rank collects what it saw since the last
turn, `share` gathers those lists from all ranks, and every rank applies the same list.
"""

from __future__ import annotations

from typing import TypeVar

import torch.distributed as dist

Fact = TypeVar("Fact")


class RankConsensus:
    def __init__(self, rank: int = 0, tp_size: int = 1, group: dist.ProcessGroup | None = None):
        if tp_size > 1 and group is None:
            raise ValueError("more than one rank needs a process group to agree over")
        self.rank, self.tp_size, self.group = rank, tp_size, group

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def share(self, local: list[Fact]) -> list[Fact]:
        """Every rank's facts, rank 0's first. A collective: every rank must call it together."""
        if self.tp_size == 1:
            return local
        gathered: list[list[Fact] | None] = [None] * self.tp_size
        dist.all_gather_object(gathered, local, group=self.group)
        return [fact for part in gathered for fact in part or []]
