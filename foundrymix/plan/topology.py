"""Where the batches go: nodes x ranks per node (the loader's workers do not change the order)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """Nodes x ranks per node; every rank trains its slice of each global batch."""

    nodes: int = 1
    ranks_per_node: int = 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


def env_world_size() -> int:
    """The ranks of this job, from the launcher's environment (``WORLD_SIZE``; 1 without)."""
    return int(os.environ.get('WORLD_SIZE', '1') or 1)


def env_rank() -> int:
    """This process's global rank, from the launcher's environment (``RANK``; 0 without)."""
    return int(os.environ.get('RANK', '0') or 0)
