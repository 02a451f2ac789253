"""``ResumeRng``: a run resumed mid-epoch continues the random streams where the checkpoint left them.

Why: Composer (0.32) restores the RNG states a checkpoint saved only when it resumes at an
epoch's first batch, or while it spins a dataloader forward; a dataloader that resumes
itself (``load_state_dict``, as foundrymix's does) skips both, so a run resumed mid-epoch
drew its dropout masks (``lora_dropout``, ``attention_dropout``) from the seed, not from
where the interrupted run was, and ended with other weights. This callback saves every
rank's RNG state (Composer's public ``get_rng_state``, gathered on every rank at the same
point of a checkpoint save as Composer gathers its own) and restores it right after the
first batch of such a resume is read, before it reaches the model: where the straight run
was when it read that batch (reading a batch draws nothing from the main process's RNGs).
At an epoch boundary Composer restores them itself, and this does nothing; so on another
number of ranks (the ranks' random streams cannot continue there: each rank had its own).
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
