"""``S3Log``: one line per epoch and one at the end of the run with the S3 requests and retries.

Why: retries keep a cloud job alive, but silently; a job that spends its time retrying must
say so. Counts are summed over the ranks; a run that made no S3 request prints nothing.
"""

from __future__ import annotations

from typing import Optional

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from foundrymix.s3.retries import FIELDS, RetryCounts, S3RetryCounter


class S3Log(Callback):
    """Print ``S3 (epoch E): ...`` at each epoch end and ``S3 (run): ...`` at fit end (rank 0).

    The run line covers everything since ``since``: the metadata fetched while the trainer was
    built and every shard downloaded since (DataLoader workers fork and share the counters).
    """

    def __init__(self, counter: S3RetryCounter, since: Optional[RetryCounts] = None) -> None:
        self.counter = counter
        self._run_counts = since if since is not None else counter.snapshot()
        self._epoch_counts = self._run_counts
        self.lines: list[str] = []  # what was printed, for callers and tests

    def _summed(self, counts: RetryCounts) -> RetryCounts:
        total = RetryCounts()
        for rank_counts in dist.all_gather_object(counts.counts):
            total = total + RetryCounts({k: rank_counts[k] for k in FIELDS})
        return total

    def _print(self, counts: RetryCounts, label: str) -> None:
        counts = self._summed(counts)
        if dist.get_global_rank() == 0 and counts['requests']:
            line = counts.line(f'S3 ({label})')
            self.lines.append(line)
            print(line, flush=True)

    def epoch_end(self, state: State, logger: Logger) -> None:
        now = self.counter.snapshot()
        self._print(now - self._epoch_counts, f'epoch {int(state.timestamp.epoch) - 1}')
        self._epoch_counts = now

    def fit_end(self, state: State, logger: Logger) -> None:
        self._print(self.counter.snapshot() - self._run_counts, 'run')
