"""``EpochBoundary``: a checkpoint taken at an epoch's end resumes at the next epoch."""

from __future__ import annotations

from composer.core import Callback, State
from composer.loggers import Logger


class EpochBoundary(Callback):
    """Tell the dataset when Composer finishes an epoch.

    Why: Composer saves ``dataset.state_dict(sample_in_epoch, True)`` and right after an
    epoch ends ``sample_in_epoch`` is 0 while the dataset still names the finished
    epoch, so a checkpoint taken at ``1ep`` would replay that epoch on resume
    (composer 0.32.1 + streaming 0.13.0). ``MixedDataset.mark_epoch_complete`` makes the
    saved position point at the start of the next epoch instead.
    """

    def epoch_end(self, state: State, logger: Logger) -> None:
        dataset = getattr(state.train_dataloader, 'dataset', None)
        if hasattr(dataset, 'mark_epoch_complete'):
            dataset.mark_epoch_complete()
