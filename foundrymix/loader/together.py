"""Ranks that train in lockstep stop at the same batch when any rank's read fails, each
saying why.

Why: a damaged shard is found by the rank that opens it (and a stage's storage, built at
its first batch, can fail on one node only). Alone, that rank raises and the
others wait in the next gradient all-reduce until the launcher kills them, none saying
why. With :class:`StopTogether` set on the loader (the trainer sets it), the ranks agree
before each batch is handed over -- one integer summed over a gloo group (CPU, apart from
the GPU's collectives) -- and when any rank failed, every rank raises: the failing rank its
own error, the others :class:`OtherRankFailed` with its message (stream, shard, what to
do). Off by default: a loop that reads the ranks' loaders unevenly would wait in it.
"""

from __future__ import annotations

from typing import Any, Optional

from foundrymix.errors import WorkerError


class OtherRankFailed(WorkerError):
    """Another rank's read of this global batch failed; the message is that rank's."""


class StopTogether:
    """``agree(failure)`` before each batch, on every rank: returns when no rank failed,
    else raises on every rank (see the module). Without a process group of more than one
    rank it raises only this rank's failure."""

    def __init__(self) -> None:
        self._group: Any = None

    def __call__(self, failure: Optional[BaseException]) -> None:
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
        mine = None if failure is None else f'{type(failure).__name__}: {failure}'
        tdist.all_gather_object(said, mine, group=self._group)
        if failure is not None:
            raise failure
        rank, message = next((r, m) for r, m in enumerate(said) if m is not None)
        raise OtherRankFailed(f'rank {rank} could not read its rows of this batch, so every rank '
                              f'stops here: {message}')
