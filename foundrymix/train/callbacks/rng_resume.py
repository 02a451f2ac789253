"""``ResumeRng``: a run resumed mid-epoch continues the random streams where the checkpoint left them.

Composer restores them only at an epoch's first batch or while spinning a dataloader forward,
which a loader that resumes itself skips: dropout would restart from the seed. They are restored
after the resume's first batch is read, before the model sees it; not at an epoch boundary
(Composer does) nor on another number of ranks (each rank had its own).
"""

from __future__ import annotations

from typing import Any, Optional

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist, reproducibility


class ResumeRng(Callback):
    """Saves the ranks' RNG states with each checkpoint; restores them on a mid-epoch resume."""

    def __init__(self) -> None:
        self._loaded: Optional[list[dict[str, Any]]] = None
        self._armed = False

    def state_dict(self) -> dict[str, Any]:
        return {'rng': reproducibility.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loaded = state.get('rng')

    def fit_start(self, state: State, logger: Logger) -> None:
        self._armed = (self._loaded is not None and int(state.timestamp.batch_in_epoch) > 0
                       and len(self._loaded) == dist.get_world_size())

    def after_dataloader(self, state: State, logger: Logger) -> None:
        if self._armed:
            reproducibility.load_rng_state(self._loaded)
            self._armed, self._loaded = False, None
