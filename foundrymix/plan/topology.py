"""Where the batches go: nodes x ranks per node (the loader's workers do not change the order)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """Nodes x ranks per node; every rank trains its slice of each global batch."""

    nodes: int = 1
    ranks_per_node: int = 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node
