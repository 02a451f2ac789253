"""The planned mixture as a picture: each stream's share of every global batch over the run,
stages marked, with what the run really trained (and its losses and LR) drawn over it."""

from __future__ import annotations

from typing import Any

import numpy as np


def plot_run_plan(run: Any, path: str, realized: Any = None, losses: Any = None,
                  lr: Any = None) -> None:
    """One band per stream (its share of each global batch), stages marked, ``realized`` (batches,
    cumulative rows per stream) over it; panels below: ``losses`` (batches, cumulative loss sums and
    targets) as each stream's mean loss per interval, ``lr`` (a ``WSDSchedule``, the base LR)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    names: list[str] = []
    for s in run.stages:
        names += [p.name for p in s.plan.streams if p.name not in names]
    xs, shares = [], []
    for s in run.stages:
        rows = s.plan.duration.rows_per_stream or {p.name: p.trained_rows_per_epoch
                                                  for p in s.plan.streams}
        total = sum(rows.values()) or 1
        share = [rows.get(n, 0) / total for n in names]
        xs += [s.start_batch, s.end_batch]
        shares += [share, share]
    heights = [3] + [2.5] * (losses is not None) + [1.4] * (lr is not None)
    fig, axes = plt.subplots(len(heights), 1, figsize=(9, 4.5 + 3.5 * (losses is not None) + 2 * (lr is not None)),
                             sharex=True, gridspec_kw={'height_ratios': heights}, squeeze=False)
    ax = axes[0][0]
    bands = ax.stackplot(xs, np.array(shares).T, labels=[f'{n} (plan)' for n in names], alpha=0.45)
    for s in run.stages[1:]:  # stage boundaries, on every panel
        for a in axes[:, 0]:
            a.axvline(s.start_batch, color='black', linewidth=0.8, linestyle='--')
    for s in run.stages:
        ax.text((s.start_batch + s.end_batch) / 2, 1.01, s.name, ha='center', va='bottom', fontsize=8)
    if realized is not None:
        _draw_realized(ax, run, names, realized, [tuple(b.get_facecolor()[0][:3]) for b in bands])
    ax.set_xlim(0, run.total_batches)
    ax.set_ylim(0, 1.08)
    if losses is not None:
        _draw_losses(axes[1][0], names, losses, [tuple(b.get_facecolor()[0][:3]) for b in bands])
    if lr is not None:
        _draw_lr(axes[-1][0], *lr)
    axes[-1][0].set_xlabel('global batch')
    ax.set_ylabel('share of rows (stacked)')
    ax.set_title('Planned mixture over training' + (' and realized (lines: share so far in the '
                                                     'stage)' if realized is not None else ''))
    ax.legend(fontsize=7, loc='lower right')
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _draw_losses(ax: Any, names: list[str], losses: Any, colors: list[Any]) -> None:
    """Per stream, the mean loss per loss target between consecutive history points, as steps
    (a stream with no targets in an interval leaves a gap)."""
    batches = np.concatenate(([0], np.asarray(losses[0])))
    sums = np.diff(np.vstack([np.zeros(len(names)), np.asarray(losses[1], dtype=np.float64)]), axis=0)
    targets = np.diff(np.vstack([np.zeros(len(names)), np.asarray(losses[2], dtype=np.float64)]), axis=0)
    mean = np.divide(sums, targets, out=np.full_like(sums, np.nan), where=targets > 0)
    for i, name in enumerate(names):
        ax.step(batches, np.concatenate((mean[:1, i], mean[:, i])), where='pre', color=colors[i],
                linewidth=1.4, label=name)
    ax.set_ylabel('training loss per loss token')
    ax.set_title('Training loss per stream (mean over each logging interval)')
    ax.legend(fontsize=7, loc='upper right')
    ax.grid(alpha=0.3)


def _draw_realized(ax: Any, run: Any, names: list[str], realized: Any, colors: list[Any]) -> None:
    """Stacked realized shares, each stage counted from its own start, as step lines."""
    batches = np.asarray(realized[0])
    rows = np.asarray(realized[1], dtype=np.float64)
    for stage in run.stages:
        before = batches <= stage.start_batch
        base = rows[before][-1] if before.any() else np.zeros(rows.shape[1])
        inside = (batches > stage.start_batch) & (batches <= stage.end_batch)
        if not inside.any():
            continue
        delta = rows[inside] - base
        stacked = np.cumsum(delta / np.maximum(delta.sum(axis=1, keepdims=True), 1), axis=1)
        xs = np.concatenate(([stage.start_batch], batches[inside]))
        for i, name in enumerate(names[:-1] if len(names) > 1 else names):
            ys = np.concatenate(([stacked[0, i]], stacked[:, i]))
            ax.step(xs, ys, where='pre', color=colors[i], linewidth=1.4,
                    label=f'{name} (realized)' if stage.index == 0 else None)


def _draw_lr(ax: Any, schedule: Any, lr: float) -> None:
    """The LR of every batch (a step per batch, batch ``b`` over ``[b, b + 1)``)."""
    lrs = schedule.lrs(lr)
    xs = np.arange(len(lrs) + 1)
    ax.step(xs, lrs + lrs[-1:], where='post', color='black', linewidth=1.2)
    ax.set_ylim(0, lr * 1.08)
    ax.set_ylabel('LR')
    ax.set_title(f'LR: wsd, warmup {schedule.warmup} ba, decay batches {schedule.decay_start}-'
                 f'{schedule.decay_end - 1} ({schedule.shape} to {schedule.to:g} x lr)', fontsize=9)
