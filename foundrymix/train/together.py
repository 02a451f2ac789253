"""Ranks in lockstep stop at the same batch when any rank's read fails, each saying why (alone, the
failing rank raises and the others hang in the next all-reduce until killed). Off by default: a loop
that reads the ranks' loaders unevenly would wait in the agreement."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar

from foundrymix.errors import WorkerError


T = TypeVar('T')


class OtherRankFailed(WorkerError):
    """Another rank's read of this global batch failed; the message is that rank's."""


class StopTogether:
    """Called with this rank's failure (or None) before each batch, on every rank: agrees by one
    integer summed over its own gloo group (CPU, apart from the GPU's collectives); when any
    rank failed, the failing rank raises its error and the others :class:`OtherRankFailed`.
    ``probes``: other failures of this rank to stop every rank at the next batch (a checkpoint
    upload that failed on rank 0), asked when the read did not fail."""

    def __init__(self, doing: str = 'could not read its rows of this batch') -> None:
        self._group: Any = None
        self.doing = doing  # what the failing rank could not do, as the others say it
        self.probes: list[Callable[[], Optional[BaseException]]] = []

    def __call__(self, failure: Optional[BaseException]) -> None:
        doing = self.doing
        if failure is None:
            failure, doing = next((e for e in (probe() for probe in self.probes) if e is not None), None), 'stopped'

        import torch
        import torch.distributed as tdist
        if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
            if failure is not None:
                raise failure
            return
        if self._group is None:  # every rank is here at its first batch: the group is made together
            self._group = tdist.new_group(backend='gloo')
        failed = torch.tensor([0 if failure is None else 1], dtype=torch.int64)
        tdist.all_reduce(failed, group=self._group)
        if int(failed.item()) == 0:
            return
        said: list[Any] = [None] * tdist.get_world_size()
        mine = None if failure is None else (doing, f'{type(failure).__name__}: {failure}')
        tdist.all_gather_object(said, mine, group=self._group)
        if failure is not None:
            raise failure
        rank, (did, message) = next((r, m) for r, m in enumerate(said) if m is not None)
        raise OtherRankFailed(f'rank {rank} {did}, so every rank stops here: {message}')

    def __enter__(self) -> 'StopTogether':
        return self

    def __exit__(self, kind: Any, error: Optional[BaseException], traceback: Any) -> None:
        """Every rank leaves the ``with`` block together: a rank whose block raised an ``Exception``
        raises it, and every other rank says which rank failed and why, instead of waiting in the
        first collective until the timeout."""
        if error is None or isinstance(error, Exception):
            self(error)


def read_together(batches: Iterable[T], together: StopTogether) -> Iterator[T]:
    """``batches``, each agreed on by every rank before it is yielded: a rank's failed read (or
    stage storage build) raises on it and :class:`OtherRankFailed` on every other rank, at that
    batch. The end needs no agreement: every rank's batches end at the same batch."""
    it = iter(batches)
    while True:
        failure: Optional[BaseException] = None
        try:
            batch = next(it)
        except StopIteration:
            return
        except Exception as e:
            failure = e
        together(failure)  # raises on every rank if any failed
        yield batch
