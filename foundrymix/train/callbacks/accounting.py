"""``StreamAccounting``: samples, tokens, loss tokens and training loss per stream, against the plan.

The counters live in Composer checkpoints (a resumed run continues them). Each rank counts its
own batches; one float64 ``all_reduce`` on ``state.device`` sums them only where a sum is read
(``log_interval``, the end, a checkpoint save). Per-stream loss is exact, not a mean of batch
means: row sums are added per stream on the device at ``after_loss`` (no host sync).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from composer.core import Callback, State, Time, TimeUnit
from composer.loggers import Logger
from composer.utils import dist

from foundrymix.errors import UserError
from foundrymix.format.schema import IGNORE_INDEX
from foundrymix.train import report

#: the counters, in the order of :func:`count`'s rows, and with the loss: the rows of ``totals``
COUNTERS = ('samples', 'tokens', 'loss_tokens')
FIELDS = (*COUNTERS, 'loss_sum', 'loss_targets')


@dataclass(frozen=True)
class LossReduction:
    """One reduction's per-stream loss sums (float64) and targets (int64), summed over every rank,
    of the batches since the previous one; ``batch``: the batches trained when it ran."""

    batch: int
    loss_sum: np.ndarray
    loss_targets: np.ndarray


def interval_hit(timestamp: Any, interval: Time) -> bool:
    if interval.unit == TimeUnit.BATCH:
        return int(timestamp.batch) % interval.value == 0
    if interval.unit == TimeUnit.EPOCH:
        return int(timestamp.batch_in_epoch) == 0
    raise UserError(f'log interval must be in batches or epochs, got {interval}')


def count(batch: Mapping[str, torch.Tensor], n_streams: int) -> np.ndarray:
    """This rank's batch as a ``(3, n_streams)`` int64 array: samples, real tokens, loss tokens
    (numpy: torch's CPU reductions would wake its OpenMP pool, competing with the loader workers)."""
    def host(name: str) -> np.ndarray:
        return batch[name].detach().cpu().numpy()

    stream_id = host('stream_id').reshape(-1)
    real = host('attention_mask').sum(axis=1, dtype=np.int64)
    loss = (host('labels') != IGNORE_INDEX).sum(axis=1, dtype=np.int64)
    counts = np.zeros((3, n_streams), dtype=np.int64)
    np.add.at(counts[0], stream_id, 1)
    np.add.at(counts[1], stream_id, real)
    np.add.at(counts[2], stream_id, loss)
    return counts


class StreamAccounting(Callback):
    """Count samples, tokens and loss tokens per stream; every ``log_interval`` record and log a
    history point; at the end rank 0 writes ``stream_accounting.json`` (and ``.png``) into ``out_dir``."""

    def __init__(self, stream_names: Sequence[str], planned_share: Sequence[float],
                 out_dir: str, log_interval: str = '10ba', plot: bool = True,
                 stage_names: Optional[Sequence[str]] = None,
                 eval_stream_names: Optional[Sequence[str]] = None) -> None:
        self.stream_names = list(stream_names)
        #: the eval_loader's streams (its batches' stream ids); per-stream eval loss with 2 or more
        self.eval_stream_names = list(eval_stream_names or ())
        #: a staged run's stages; batches then carry ``stage_id`` and are counted per stage too
        self.stage_names = list(stage_names) if stage_names else None
        self.planned_share = [float(s) for s in planned_share]
        self.out_dir = out_dir
        self.log_interval = Time.from_timestring(log_interval)
        self.plot = plot
        self.history: list[dict[str, Any]] = []
        n, width = len(self.stream_names), 1 + len(self.stage_names or ())
        #: summed over ranks, per (the run, then each stage) x :data:`FIELDS` x stream (float64: whole
        #: numbers stay exact below 2**53)
        self.totals = np.zeros((width, len(FIELDS), n))
        #: this rank's counts since the last reduce, as ``totals``' first three fields
        self._pending = np.zeros((width, len(COUNTERS), n), dtype=np.int64)
        self._device: Any = None  # the trainer's Composer ``Device`` (from fit_start); None: the CPU
        #: this rank's loss since the last reduce, on the device: (sum, targets) x (run, stages...) x streams
        self._loss_pending: Optional[torch.Tensor] = None
        self._loss_batch: Optional[torch.Tensor] = None  # the batch in progress (its microbatches so far)
        self._eval_pending: Optional[torch.Tensor] = None
        self._last_batch = 0
        self._last_reduction = LossReduction(0, np.zeros(n, dtype=np.float64), np.zeros(n, dtype=np.int64))
        self._reduce_hooks: list[Callable[[LossReduction], None]] = []

    @property
    def samples(self) -> np.ndarray:
        return self.totals[0, 0].astype(np.int64)

    @property
    def tokens(self) -> np.ndarray:
        return self.totals[0, 1].astype(np.int64)

    @property
    def loss_tokens(self) -> np.ndarray:
        return self.totals[0, 2].astype(np.int64)

    @property
    def loss_sum(self) -> np.ndarray:
        return self.totals[0, 3].copy()

    @property
    def loss_targets(self) -> np.ndarray:
        return self.totals[0, 4].astype(np.int64)

    # -- events -------------------------------------------------------------------
    def fit_start(self, state: State, logger: Logger) -> None:
        self._device = state.device

    def before_train_batch(self, state: State, logger: Logger) -> None:
        """Start the batch's loss over: Composer (microbatch ``auto``) reruns a batch that ran out of
        memory from here; only ``after_train_batch`` adds a batch's loss to the pending sums."""
        if self._loss_batch is not None:
            self._loss_batch.zero_()

    def after_train_batch(self, state: State, logger: Logger) -> None:
        """Count the batch and add its loss (here, so counting runs while the GPU works)."""
        counts = count(state.batch, len(self.stream_names))
        self._pending[0] += counts
        if self.stage_names is not None:  # a batch never straddles two stages
            self._pending[1 + int(state.batch['stage_id'].reshape(-1)[0])] += counts
        if self._loss_batch is not None:
            if self._loss_pending is None:
                self._loss_pending = torch.zeros_like(self._loss_batch)
            self._loss_pending += self._loss_batch

    def after_loss(self, state: State, logger: Logger) -> None:
        """Add this microbatch's per-row loss sums and targets to its streams (and stage), on the device."""
        rows = getattr(state.outputs, 'row_loss', None)
        if rows is None:  # a model that does not report per-row loss
            return
        n = len(self.stream_names)
        where = state.batch['stream_id'].reshape(-1).to(rows.loss_sum.device)
        index, sums, targets = where, rows.loss_sum, rows.targets
        if self.stage_names is not None:  # the run's column and the row's stage's column
            stage = state.batch['stage_id'].reshape(-1).to(where.device)
            index = torch.cat([where, (1 + stage) * n + where])
            sums, targets = torch.cat([sums, sums]), torch.cat([targets, targets])
        if self._loss_batch is None:
            self._loss_batch = torch.zeros(2, self.totals.shape[0] * n, dtype=torch.float64, device=where.device)
        self._loss_batch[0].index_add_(0, index, sums.to(torch.float64))
        self._loss_batch[1].index_add_(0, index, targets.to(torch.float64))

    def reduce(self) -> None:
        """Add every rank's pending counts and loss to the totals (one ``all_reduce``, called by
        every rank at the same points), then run the hooks of :meth:`add_reduce_hook`."""
        width, n = self.totals.shape[0], len(self.stream_names)
        counts = torch.from_numpy(self._pending.reshape(-1)).to(torch.float64)
        loss = self._loss_pending if self._loss_pending is not None else torch.zeros(2, width * n, dtype=torch.float64)
        pending = torch.cat([counts, loss.reshape(-1).to(counts.device)])
        if self._device is not None:
            pending = self._device.tensor_to_device(pending)
        dist.all_reduce(pending, reduce_operation='SUM')
        summed = pending.cpu().numpy()
        loss_sum, targets = summed[counts.numel():].reshape(2, width, n)
        self.totals[:, :3] += np.rint(summed[:counts.numel()]).reshape(self._pending.shape)
        self.totals[:, 3] += loss_sum
        self.totals[:, 4] += np.rint(targets)
        self._pending[:] = 0
        if self._loss_pending is not None:
            self._loss_pending.zero_()
        self._last_reduction = LossReduction(self._last_batch, loss_sum[0].copy(),
                                             np.rint(targets[0]).astype(np.int64))
        for hook in self._reduce_hooks:
            hook(self._last_reduction)

    # -- per-stream loss for other callbacks ---------------------------------------
    def add_reduce_hook(self, hook: Callable[[LossReduction], None]) -> None:
        """Call ``hook(reduction)`` after every reduction (interval, checkpoint save, end; two in
        a row: the second all zeros), on every rank with the same values: it may run collectives."""
        self._reduce_hooks.append(hook)

    def reduced_loss(self) -> tuple[np.ndarray, np.ndarray]:
        """The last reduction's per-stream loss sums (float64) and loss targets (int64), see :class:`LossReduction`."""
        return self._last_reduction.loss_sum.copy(), self._last_reduction.loss_targets.copy()

    # -- eval --------------------------------------------------------------------
    def eval_batch_end(self, state: State, logger: Logger) -> None:
        rows = getattr(state.outputs, 'row_loss', None)
        if len(self.eval_stream_names) < 2 or rows is None:
            return
        where = state.batch['stream_id'].reshape(-1).to(rows.loss_sum.device)
        if self._eval_pending is None:
            self._eval_pending = torch.zeros(2, len(self.eval_stream_names), dtype=torch.float64,
                                             device=where.device)
        self._eval_pending[0].index_add_(0, where, rows.loss_sum.to(torch.float64))
        self._eval_pending[1].index_add_(0, where, rows.targets.to(torch.float64))

    def eval_end(self, state: State, logger: Logger) -> None:
        """Log ``eval/streams/<name>/loss``: the eval loss per stream, summed over every rank."""
        if len(self.eval_stream_names) < 2:
            return
        pending = self._eval_pending
        if pending is None:
            pending = torch.zeros(2, len(self.eval_stream_names), dtype=torch.float64)
        pending = state.device.tensor_to_device(pending)
        dist.all_reduce(pending, reduce_operation='SUM')
        loss_sum, targets = pending.cpu().numpy()
        self._eval_pending = None
        logger.log_metrics({f'eval/streams/{name}/loss': float(loss_sum[i] / targets[i])
                            for i, name in enumerate(self.eval_stream_names) if targets[i]})

    def batch_end(self, state: State, logger: Logger) -> None:
        self._last_batch = int(state.timestamp.batch)
        if interval_hit(state.timestamp, self.log_interval):
            self.reduce()
            self.record(state, logger)

    def fit_end(self, state: State, logger: Logger) -> None:
        self._last_batch = int(state.timestamp.batch)
        self.reduce()
        if not self.history or self.history[-1]['batch'] != int(state.timestamp.batch):
            self.record(state, logger)
        if dist.get_global_rank() == 0:
            report.write_report({**self.summary(state), 'history': self.history}, self.out_dir, plot=self.plot)

    def record(self, state: State, logger: Logger) -> None:
        """Append a history point and log the per-stream metrics."""
        before = self.history[-1] if self.history else None
        point = {'batch': int(state.timestamp.batch), 'epoch': int(state.timestamp.epoch), **_lists(self.totals[0])}
        self.history.append(point)
        metrics: dict[str, Any] = {'streams/epoch': int(state.timestamp.epoch)}
        for name, s in self.streams().items():
            for key in ('tokens', 'loss_tokens', 'share', 'token_share', 'planned_share'):
                metrics[f'streams/{name}/{key}'] = s[key]
        # the loss since the previous point (a logger's curve), not the run's mean so far
        since = report.interval_loss(before, point)
        metrics.update({f'streams/{name}/loss': since[i] for i, name in enumerate(self.stream_names)
                        if since[i] is not None})
        logger.log_metrics(metrics)

    # -- output -------------------------------------------------------------------
    def streams(self) -> dict[str, dict[str, Any]]:
        """Per stream: the counters, realized shares of samples and tokens, planned share."""
        total_samples = max(int(self.samples.sum()), 1)
        total_tokens = max(int(self.tokens.sum()), 1)
        return {name: _counts(self.totals[0], i, share=float(self.samples[i]) / total_samples,
                              token_share=float(self.tokens[i]) / total_tokens,
                              planned_share=self.planned_share[i])
                for i, name in enumerate(self.stream_names)}

    def summary(self, state: Optional[State] = None) -> dict[str, Any]:
        """The report's data (without ``history``); ``batch``/``epoch`` from ``state`` if given."""
        total = _counts(self.totals[0].sum(axis=1, keepdims=True), 0)
        out: dict[str, Any] = {'streams': self.streams(), 'total': total}
        if self.stage_names is not None:
            out['stages'] = {stage: {name: _counts(self.totals[1 + k], j) for j, name in enumerate(self.stream_names)
                                     if self.totals[1 + k, 0, j]}
                             for k, stage in enumerate(self.stage_names)}
        if state is not None:
            out['batch'] = int(state.timestamp.batch)
            out['epoch'] = int(state.timestamp.epoch)
        return out

    # -- checkpointing --------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The counters summed over ranks, up to the last batch (a collective: reduces first)."""
        self.reduce()
        stages = [_lists(t) for t in self.totals[1:]]
        return {'stream_names': self.stream_names, **_lists(self.totals[0]), 'history': self.history,
                'stage_names': self.stage_names, 'stage_counts': [[s[c] for c in COUNTERS] for s in stages],
                'stage_loss_sum': [s['loss_sum'] for s in stages],
                'stage_loss_targets': [s['loss_targets'] for s in stages]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the checkpoint's counters and loss sums, by stream name; streams added since (ids
        are in order of first use) and a checkpoint's missing loss sums start at zero."""
        old = list(state['stream_names'])
        if self.stream_names[:len(old)] != old:  # streams are numbered in order of first use
            raise UserError(f'checkpoint counts streams {old}, this run has {self.stream_names}: '
                             f'resuming a different mixture')
        zeros = [0] * len(old)

        def ledger(counts: Any, loss_sum: Any, targets: Any) -> np.ndarray:
            """One :data:`FIELDS` x stream block of ``totals`` from a checkpoint's lists (new streams: 0)."""
            out = np.zeros((len(FIELDS), len(self.stream_names)))
            out[:, :len(old)] = np.vstack([np.reshape(counts, (len(COUNTERS), len(old))), [loss_sum], [targets]])
            return out

        def saved(d: Mapping[str, Any]) -> np.ndarray:
            return ledger([d[c] for c in COUNTERS], d.get('loss_sum', zeros), d.get('loss_targets', zeros))

        self.totals[:] = 0
        self.totals[0] = saved(state)
        self._pending[:] = 0
        self._loss_pending = None
        self._loss_batch = None
        self.history = [{**point, **_lists(saved(point))} for point in state['history']]
        stages = list(state.get('stage_names') or [])
        if self.stage_names is not None and not stages and 'main' in self.stage_names:
            # a run without stages (the stage 'main') that now has stages: it was all 'main'
            self.totals[1 + self.stage_names.index('main')] = self.totals[0]
        no_loss = [zeros] * len(stages)
        for k, stage in enumerate(stages):  # stages appended since the checkpoint start at 0
            if self.stage_names is not None and stage in self.stage_names:
                self.totals[1 + self.stage_names.index(stage)] = ledger(
                    state['stage_counts'][k], state.get('stage_loss_sum', no_loss)[k],
                    state.get('stage_loss_targets', no_loss)[k])


def _lists(block: np.ndarray) -> dict[str, list[Any]]:
    """A :data:`FIELDS` x stream block of ``totals`` as a checkpoint and the history hold it: whole
    numbers as ints, ``loss_sum`` as floats."""
    return {name: row.tolist() if name == 'loss_sum' else row.astype(np.int64).tolist()
            for name, row in zip(FIELDS, block)}


def _counts(block: np.ndarray, i: int, **shares: float) -> dict[str, Any]:
    """Column ``i`` of a :data:`FIELDS` x stream block as the report gives a stream: the counters,
    ``shares``, the mean loss per loss target and the targets."""
    out = {name: int(block[k, i]) for k, name in enumerate(COUNTERS)}
    return {**out, **shares, 'loss': report.mean_loss(block[3, i], int(block[4, i])), 'loss_targets': int(block[4, i])}
