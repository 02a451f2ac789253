"""``StopAt``: end a job at a given time while the schedule keeps the whole run's length."""

from __future__ import annotations

from composer.core import Callback, State, Time, TimeUnit
from composer.loggers import Logger

from foundrymix.errors import UserError


class StopAt(Callback):
    """Stop training gracefully at a given time (``'40ba'`` or ``'1ep'``), keeping ``max_duration`` and
    so the whole run's LR schedule (a job cut to a cluster's time limit; ``autoresume`` continues it)."""

    def __init__(self, time: str) -> None:
        self.time = Time.from_timestring(time)
        if self.time.unit not in (TimeUnit.BATCH, TimeUnit.EPOCH):
            raise UserError(f'callbacks.stop_at.time must be in batches or epochs, got {time!r}')

    def _reached(self, state: State) -> bool:
        return state.timestamp.get(self.time.unit) >= self.time

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.time.unit == TimeUnit.BATCH and self._reached(state):
            state.stop_training()

    def epoch_end(self, state: State, logger: Logger) -> None:
        if self.time.unit == TimeUnit.EPOCH and self._reached(state):
            state.stop_training()
