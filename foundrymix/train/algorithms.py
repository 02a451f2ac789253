"""The ``algorithms`` section of a training YAML: YAML name -> (typed options, factory), as
LLM-Foundry spells it (``algorithms: {gradient_clipping: {clipping_type: norm,
clipping_threshold: 1.0}}``).

Why Composer's algorithms and not our own code: ``GradientClipping`` already clips after
every step's backward, microbatches and FSDP included. Imports neither torch nor composer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from foundrymix.config import ConfigError, Gather, check_keys, join, read_dataclass, to_plain


@dataclass
class GradientClippingConfig:
    """Composer's ``GradientClipping``: ``norm`` rescales the gradients so their global L2 norm
    is at most ``clipping_threshold``; ``value`` clamps each element; ``adaptive`` is AGC."""

    clipping_type: Literal['norm', 'value', 'adaptive'] = 'norm'
    clipping_threshold: float = 1.0

    def check(self, where: str) -> None:
        if self.clipping_threshold <= 0:
            raise ConfigError(f'{where}.clipping_threshold: must be positive, got {self.clipping_threshold}')


def _gradient_clipping(o: GradientClippingConfig) -> Any:
    from composer.algorithms import GradientClipping
    return GradientClipping(clipping_type=o.clipping_type, clipping_threshold=o.clipping_threshold)


@dataclass(frozen=True)
class AlgorithmEntry:
    config: type
    factory: Callable[[Any], Any]


ALGORITHMS: dict[str, AlgorithmEntry] = {
    'gradient_clipping': AlgorithmEntry(GradientClippingConfig, _gradient_clipping),
}


class Algorithms(dict):
    """``algorithms``: YAML name -> that algorithm's options (a dataclass of :data:`ALGORITHMS`)."""

    @classmethod
    def from_config(cls, value: Any, where: str) -> 'Algorithms':
        algorithms = to_plain(value, where)
        gather, out = Gather(), cls()
        with gather:
            check_keys(algorithms, list(ALGORITHMS), where)
        for name, options in algorithms.items():
            if name in ALGORITHMS:
                with gather:
                    out[name] = read_dataclass(ALGORITHMS[name].config, options, join(where, name))
        gather.raise_any()
        return out

    def build(self) -> list[Any]:
        """Composer algorithm objects, in YAML order."""
        return [ALGORITHMS[n].factory(o) for n, o in self.items()]
