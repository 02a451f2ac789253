"""The run's small callbacks: ``ModelInfo`` (what ``export`` rebuilds the model from), ``ResumeRng``
(the random streams of a mid-epoch resume), ``S3Log`` (the S3 request and retry lines) and
``StopAt`` (the table's ``stop_at``)."""

from __future__ import annotations

from typing import Any, Optional

from composer.core import Callback, State, Time, TimeUnit
from composer.loggers import Logger
from composer.utils import dist, reproducibility

from foundrymix.errors import UserError
from foundrymix.format.schema import TokenizerInfo
from foundrymix.s3.retries import FIELDS, RetryCounts, S3RetryCounter


class ModelInfo(Callback):
    """Records the HF config, attention mode, the streams' tokenizer and a LoRA run's peft config in
    every checkpoint (saved, never loaded): Composer saves neither the transformers config nor the
    tokenizer, and an export must not guess the architecture from a YAML that may have changed since."""

    def __init__(self, hf_config: Any, attention: str, tokenizer: TokenizerInfo,
                 pretrained: Optional[str] = None, peft: Optional[dict[str, Any]] = None) -> None:
        self.hf_config = hf_config
        self.attention = attention
        self.tokenizer = tokenizer
        self.pretrained = pretrained
        self.peft = peft

    def state_dict(self) -> dict[str, Any]:
        """``peft``: a LoRA run's ``LoraConfig`` arguments (None: every weight trained)."""
        return {'hf_config': self.hf_config.to_dict(), 'attention': self.attention,
                'tokenizer': self.tokenizer.name, 'tokenizer_fingerprint': self.tokenizer.fingerprint,
                'pretrained': self.pretrained, 'peft': self.peft}


class ResumeRng(Callback):
    """Saves the ranks' RNG states with each checkpoint; a run resumed mid-epoch continues them (Composer
    restores them only while spinning a dataloader forward, which this loader skips: dropout would restart
    from the seed). Restored after the resume's first batch is read, before the model sees it; not at an
    epoch boundary (Composer does) nor on another number of ranks (each rank had its own)."""

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


class S3Log(Callback):
    """Print ``S3 (epoch E): ...`` at each epoch end and ``S3 (run): ...`` (everything since ``since``,
    the trainer's build included) at fit end, rank 0: the S3 requests and retries summed over the ranks,
    since retries keep a job alive silently. A run that made no S3 request prints nothing."""

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
