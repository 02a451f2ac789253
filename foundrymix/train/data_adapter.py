"""The run's loader as Composer takes it. The loader itself is a plain stateful iterable
(:class:`~foundrymix.loader.run_loader.StagedDataLoader`); Composer checkpoints only the
``dataset`` of a torch ``DataLoader`` and counts epochs by ``len``, so this adapter is a
DataLoader whose ``dataset`` is the loader's position, whose ``len`` is one Composer epoch, and
whose batches every rank agrees on (:mod:`~foundrymix.train.together`)."""

from __future__ import annotations

from typing import Any, Iterator, Optional

from torch.utils.data import DataLoader, IterableDataset

from foundrymix.loader.run_loader import StagedDataLoader
from foundrymix.train.together import StopTogether, read_together


class ComposerPosition(IterableDataset):
    """What Composer saves and loads as ``train_dataloader.dataset``: the loader's state (its
    ``state_dict`` content, unchanged)."""

    def __init__(self, loader: StagedDataLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:  # pragma: no cover - the adapter iterates, not this
        raise TypeError('iterate the ComposerLoader, not its position')

    def state_dict(self, num_samples: int = 0, from_beginning: bool = True) -> dict[str, Any]:
        """(Composer's arguments: unused, the position is the batch.)"""
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


class ComposerLoader(DataLoader):
    """``loader`` for Composer's trainer or evaluator. ``epochs``: one iteration is one epoch of
    the mixture (Composer's ``ep``), for a run of one fixed mixture only -- with stages an epoch
    ending at a switch would be renumbered by a resume there, and an adaptive run has no epochs
    of one mixture. ``together``: every rank stops at a batch that failed on any rank."""

    def __init__(self, loader: StagedDataLoader, epochs: bool = False,
                 together: Optional[StopTogether] = None) -> None:
        super().__init__(ComposerPosition(loader), batch_size=loader.run.stages[0].batch_size)
        self.loader = loader
        self.together = together
        fixed = not loader.run.explicit and not loader.position.adaptive
        #: batches of one Composer epoch, or None (one iteration is the whole run)
        self.epoch: Optional[int] = loader.run.stages[0].plan.batches_per_epoch if epochs and fixed else None

    def __len__(self) -> int:
        return self.epoch if self.epoch is not None else len(self.loader)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if self.epoch is None:
            batches = iter(self.loader)
        else:  # to the end of the epoch the position is in
            batches = self.loader.batches((self.loader.position.batch // self.epoch + 1) * self.epoch)
        return batches if self.together is None else read_together(batches, self.together)
