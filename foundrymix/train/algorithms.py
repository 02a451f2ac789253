"""The ``algorithms`` section of a training YAML, as LLM-Foundry spells it (``algorithms:
{gradient_clipping: {clipping_type: norm, clipping_threshold: 1.0}}``): Composer's algorithms
(microbatches and FSDP included), typed options read without importing torch or composer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from foundrymix.config import ConfigError, TableEntry, read_table
from foundrymix.train.callbacks import part


@dataclass
class GradientClippingConfig:
    """Composer's ``GradientClipping``: ``norm`` rescales the gradients so their global L2 norm
    is at most ``clipping_threshold``; ``value`` clamps each element; ``adaptive`` is AGC."""

    clipping_type: Literal['norm', 'value', 'adaptive'] = 'norm'
    clipping_threshold: float = 1.0

    def check(self, where: str) -> None:
        if self.clipping_threshold <= 0:
            raise ConfigError(f'{where}.clipping_threshold: must be positive, got {self.clipping_threshold}')


ALGORITHMS: dict[str, TableEntry] = {
    'gradient_clipping': TableEntry(GradientClippingConfig, part('composer.algorithms', 'GradientClipping')),
}


class Algorithms(dict):
    """``algorithms``: YAML name -> that algorithm's options (a dataclass of :data:`ALGORITHMS`)."""

    @classmethod
    def from_config(cls, value: Any, where: str) -> 'Algorithms':
        return read_table(cls, ALGORITHMS, value, where)

    def build(self) -> list[Any]:
        """Composer algorithm objects, in YAML order."""
        return [ALGORITHMS[n].factory(o) for n, o in self.items()]
