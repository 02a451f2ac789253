"""Composer callbacks, one concern each: epoch-boundary position, per-stream accounting, sample log.

Their state lives in Composer checkpoints (``state_dict``/``load_state_dict``), so a
resumed run continues the counters instead of starting them over.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Sequence

import numpy as np
import torch
from composer.core import Callback, State, Time, TimeUnit
from composer.loggers import Logger
from composer.utils import dist

from foundrymix.schema import IGNORE_INDEX


def _train_dataset(state: State) -> Any:
    loader = state.train_dataloader
    return getattr(loader, 'dataset', None)


class EpochBoundary(Callback):
    """Tell the dataset when Composer finishes an epoch.

    Why: Composer saves ``dataset.state_dict(sample_in_epoch, True)`` and right after an
    epoch ends ``sample_in_epoch`` is 0 while the dataset still names the finished
    epoch, so a checkpoint taken at ``1ep`` would replay that epoch on resume
    (composer 0.32.1 + streaming 0.13.0). ``MixedDataset.mark_epoch_complete`` makes the
    saved position point at the start of the next epoch instead.
    """

    def epoch_end(self, state: State, logger: Logger) -> None:
        dataset = _train_dataset(state)
        if hasattr(dataset, 'mark_epoch_complete'):
            dataset.mark_epoch_complete()


def _interval_hit(state: State, interval: Time) -> bool:
    if interval.unit == TimeUnit.BATCH:
        return int(state.timestamp.batch) % interval.value == 0
    if interval.unit == TimeUnit.EPOCH:
        return int(state.timestamp.batch_in_epoch) == 0
    raise ValueError(f'log interval must be in batches or epochs, got {interval}')


class StreamAccounting(Callback):
    """Count samples, tokens and loss tokens consumed per stream; compare with the plan.

    Counts come from the batches themselves (``stream_id``, ``attention_mask``,
    ``labels``), summed over all ranks. Every ``log_interval`` it logs, per stream,
    cumulative tokens and loss tokens, the realized share of samples and tokens, the
    planned share of samples, and the epoch. At the end it writes
    ``stream_accounting.json`` and ``stream_accounting.png`` into ``out_dir``.
    """

    def __init__(self, stream_names: Sequence[str], planned_share: Sequence[float],
                 out_dir: str, log_interval: str = '10ba', plot: bool = True) -> None:
        self.stream_names = list(stream_names)
        self.planned_share = [float(s) for s in planned_share]
        self.out_dir = out_dir
        self.log_interval = Time.from_timestring(log_interval)
        self.plot = plot
        n = len(self.stream_names)
        self.samples = np.zeros(n, dtype=np.int64)
        self.tokens = np.zeros(n, dtype=np.int64)
        self.loss_tokens = np.zeros(n, dtype=np.int64)
        self.history: list[dict[str, Any]] = []

    # -- counting -----------------------------------------------------------------
    def after_dataloader(self, state: State, logger: Logger) -> None:
        batch = state.batch
        n = len(self.stream_names)
        stream_id = batch['stream_id'].reshape(-1)
        real = batch['attention_mask'].sum(dim=1)
        loss = (batch['labels'] != IGNORE_INDEX).sum(dim=1)
        counts = torch.zeros(3, n, dtype=torch.int64, device=stream_id.device)
        counts[0].index_add_(0, stream_id, torch.ones_like(stream_id))
        counts[1].index_add_(0, stream_id, real.to(torch.int64))
        counts[2].index_add_(0, stream_id, loss.to(torch.int64))
        dist.all_reduce(counts, reduce_operation='SUM')
        counts = counts.cpu().numpy()
        self.samples += counts[0]
        self.tokens += counts[1]
        self.loss_tokens += counts[2]

    def batch_end(self, state: State, logger: Logger) -> None:
        if _interval_hit(state, self.log_interval):
            self._record(state, logger)

    def fit_end(self, state: State, logger: Logger) -> None:
        if not self.history or self.history[-1]['batch'] != int(state.timestamp.batch):
            self._record(state, logger)
        if dist.get_global_rank() == 0:
            self.write_summary(state)

    def _record(self, state: State, logger: Logger) -> None:
        point = {
            'batch': int(state.timestamp.batch),
            'epoch': int(state.timestamp.epoch),
            'samples': self.samples.tolist(),
            'tokens': self.tokens.tolist(),
            'loss_tokens': self.loss_tokens.tolist(),
        }
        self.history.append(point)
        total_samples = max(int(self.samples.sum()), 1)
        total_tokens = max(int(self.tokens.sum()), 1)
        metrics: dict[str, Any] = {'streams/epoch': int(state.timestamp.epoch)}
        for i, name in enumerate(self.stream_names):
            metrics[f'streams/{name}/tokens'] = int(self.tokens[i])
            metrics[f'streams/{name}/loss_tokens'] = int(self.loss_tokens[i])
            metrics[f'streams/{name}/share'] = float(self.samples[i]) / total_samples
            metrics[f'streams/{name}/token_share'] = float(self.tokens[i]) / total_tokens
            metrics[f'streams/{name}/planned_share'] = self.planned_share[i]
        logger.log_metrics(metrics)

    # -- output -------------------------------------------------------------------
    def summary(self, state: Optional[State] = None) -> dict[str, Any]:
        total_samples = max(int(self.samples.sum()), 1)
        total_tokens = max(int(self.tokens.sum()), 1)
        streams = {}
        for i, name in enumerate(self.stream_names):
            streams[name] = {
                'samples': int(self.samples[i]),
                'tokens': int(self.tokens[i]),
                'loss_tokens': int(self.loss_tokens[i]),
                'share': float(self.samples[i]) / total_samples,
                'token_share': float(self.tokens[i]) / total_tokens,
                'planned_share': self.planned_share[i],
            }
        out: dict[str, Any] = {'streams': streams,
                               'total': {'samples': int(self.samples.sum()), 'tokens': int(self.tokens.sum()),
                                         'loss_tokens': int(self.loss_tokens.sum())}}
        if state is not None:
            out['batch'] = int(state.timestamp.batch)
            out['epoch'] = int(state.timestamp.epoch)
        return out

    @property
    def summary_path(self) -> str:
        return os.path.join(self.out_dir, 'stream_accounting.json')

    @property
    def plot_path(self) -> str:
        return os.path.join(self.out_dir, 'stream_accounting.png')

    def write_summary(self, state: Optional[State] = None) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        summary = self.summary(state)
        summary['history'] = self.history
        with open(self.summary_path, 'w', encoding='utf-8') as f:
            json.dump(summary, f, indent=2)
        if self.plot and self.history:
            self._plot()

    def _plot(self) -> None:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt

        zero = [0] * len(self.stream_names)
        steps = [0] + [p['batch'] for p in self.history]
        tokens = np.array([zero] + [p['tokens'] for p in self.history], dtype=np.float64)
        samples = np.array([zero] + [p['samples'] for p in self.history], dtype=np.float64)
        total_tokens = tokens.sum(axis=1)
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for i, name in enumerate(self.stream_names):
            line, = ax.plot(steps, tokens[:, i], label=f'{name} (realized)')
            # Planned tokens: planned sample share x realized tokens per sample of the stream.
            per_sample = tokens[-1, i] / max(samples[-1, i], 1)
            planned = np.array([self.planned_share[i] * s.sum() * per_sample for s in samples])
            ax.plot(steps, planned, linestyle='--', color=line.get_color(), alpha=0.6,
                    label=f'{name} (plan {self.planned_share[i]:.1%})')
        ax.plot(steps, total_tokens, color='black', linewidth=0.8, label='all streams')
        ax.set_xlabel('batch')
        ax.set_ylabel('cumulative tokens')
        ax.set_title('Tokens per stream: realized vs planned share')
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(self.plot_path, dpi=100)
        plt.close(fig)

    # -- checkpointing --------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {'stream_names': self.stream_names, 'samples': self.samples.tolist(),
                'tokens': self.tokens.tolist(), 'loss_tokens': self.loss_tokens.tolist(),
                'history': self.history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if list(state['stream_names']) != self.stream_names:
            raise ValueError(f'checkpoint counts streams {state["stream_names"]}, this run has '
                             f'{self.stream_names}: resuming a different mixture')
        self.samples = np.array(state['samples'], dtype=np.int64)
        self.tokens = np.array(state['tokens'], dtype=np.int64)
        self.loss_tokens = np.array(state['loss_tokens'], dtype=np.int64)
        self.history = list(state['history'])


class SampleLog(Callback):
    """Append each global batch's sample ids and streams to a JSONL file (rank 0).

    One line per batch: ``{"batch": b, "epoch": e, "sample_ids": [...], "stream_ids":
    [...]}`` in rank order. On resume, lines for batches at or after the checkpoint are
    dropped first, so the file always describes exactly what the weights saw.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def fit_start(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() != 0 or not os.path.exists(self.path):
            return
        resumed_at = int(state.timestamp.batch)
        with open(self.path, encoding='utf-8') as f:
            keep = [line for line in f if line.strip() and json.loads(line)['batch'] < resumed_at]
        with open(self.path, 'w', encoding='utf-8') as f:
            f.writelines(keep)

    def after_dataloader(self, state: State, logger: Logger) -> None:
        ids = state.batch['sample_id'].reshape(-1).tolist()
        streams = state.batch['stream_id'].reshape(-1).tolist()
        gathered = dist.all_gather_object((ids, streams))
        if dist.get_global_rank() != 0:
            return
        all_ids = [i for rank_ids, _ in gathered for i in rank_ids]
        all_streams = [s for _, rank_streams in gathered for s in rank_streams]
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, 'a', encoding='utf-8') as f:
            f.write(json.dumps({'batch': int(state.timestamp.batch), 'epoch': int(state.timestamp.epoch),
                                'sample_ids': all_ids, 'stream_ids': all_streams}) + '\n')


class StopAt(Callback):
    """Stop training gracefully at a given time (``'40ba'`` or ``'1ep'``), keeping ``max_duration``.

    Why: a long run often has to be cut into jobs shorter than a cluster's time limit.
    The LR schedule must still follow the *whole* run's ``max_duration``, so the run
    is stopped rather than shortened; with a matching ``save_interval`` the last
    checkpoint is at exactly that time, and ``autoresume`` continues from it.
    """

    def __init__(self, time: str) -> None:
        self.time = Time.from_timestring(time)
        if self.time.unit not in (TimeUnit.BATCH, TimeUnit.EPOCH):
            raise ValueError(f'callbacks.stop_at.time must be in batches or epochs, got {time!r}')

    def _reached(self, state: State) -> bool:
        return state.timestamp.get(self.time.unit) >= self.time

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.time.unit == TimeUnit.BATCH and self._reached(state):
            state.stop_training()

    def epoch_end(self, state: State, logger: Logger) -> None:
        if self.time.unit == TimeUnit.EPOCH and self._reached(state):
            state.stop_training()
