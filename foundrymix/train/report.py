"""The per-stream accounting report: ``stream_accounting.json``, its plot and its table.

Plain data in, files out, without torch, so ``foundrymix report RUN/report`` re-renders
any run's table and PNG from its JSON. The summary::

    {"streams": {name: {"samples", "tokens", "loss_tokens", "share", "token_share",
                        "planned_share", "loss", "loss_targets"}, ...},
     "total": {"samples", "tokens", "loss_tokens", "loss", "loss_targets"},
     "stages": {stage: {name: {"samples", "tokens", "loss_tokens", "loss",
                               "loss_targets"}}},  # a staged run only
     "batch": b, "epoch": e,                     # where the run ended
     "history": [{"batch", "epoch", "samples": [...], "tokens": [...], "loss_tokens": [...],
                  "loss_sum": [...], "loss_targets": [...]}, ...]}
                                                 # cumulative, one list entry per stream

``loss`` is the mean training loss per loss target (``null`` with none; ``-`` in the table
where a summary has no loss keys).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Mapping, Optional

import numpy as np

from foundrymix.errors import MissingError, UserError

SUMMARY_NAME = 'stream_accounting.json'
PLOT_NAME = 'stream_accounting.png'


def write_report(summary: dict[str, Any], out_dir: str, plot: bool = True) -> None:
    """Write ``stream_accounting.json`` and (with ``plot`` and a history) the PNG into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, SUMMARY_NAME), 'w', encoding='utf-8') as f:
        json.dump(summary, f, indent=2)
    if plot and summary.get('history'):
        write_plot(summary, os.path.join(out_dir, PLOT_NAME))


#: streams the plot's legend names one by one
LEGEND_STREAMS = 40


def write_plot(summary: dict[str, Any], path: str) -> None:
    """Cumulative tokens per stream against batches, realized (solid) and planned (dashed: the planned
    share of the rows trained so far times the stream's realized tokens per row, as the legend says --
    up to LEGEND_STREAMS streams; beyond, only the total is labelled)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    names = list(summary['streams'])
    planned_share = [summary['streams'][n]['planned_share'] for n in names]
    history = summary['history']
    zero = [0] * len(names)
    steps = [0] + [p['batch'] for p in history]
    tokens = np.array([zero] + [p['tokens'] for p in history], dtype=np.float64)
    samples = np.array([zero] + [p['samples'] for p in history], dtype=np.float64)
    total_tokens = tokens.sum(axis=1)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labelled = len(names) <= LEGEND_STREAMS
    for i, name in enumerate(names):
        line, = ax.plot(steps, tokens[:, i], label=f'{name} (realized)' if labelled else '_')
        per_sample = tokens[-1, i] / max(samples[-1, i], 1)
        planned = np.array([planned_share[i] * s.sum() * per_sample for s in samples])
        ax.plot(steps, planned, linestyle='--', color=line.get_color(), alpha=0.6,
                label=f'{name} (plan: {planned_share[i]:.1%} of rows x its tokens/row)' if labelled else '_')
    ax.plot(steps, total_tokens, color='black', linewidth=0.8,
            label='all streams' if labelled else f'all {len(names):,} streams (one line each, unlabelled)')
    ax.set_xlabel('batch')
    ax.set_ylabel('cumulative tokens (non-padding)')
    ax.set_title('Tokens per stream: realized vs planned (planned row share, realized tokens/row)')
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(summary: dict[str, Any]) -> Any:
    """The summary as a rich table: per stream, what was consumed against the plan."""
    title = 'per-stream accounting'
    if 'batch' in summary and summary.get('stages'):
        title += f' after {summary["batch"]} batches ({len(summary["stages"])} stages)'
    elif 'batch' in summary:
        title += f' after {summary["batch"]} batches ({summary["epoch"]} full epochs)'
    rows = [([name], s, [f'{s["share"]:.2%}', f'{s["planned_share"]:.2%}']) for name, s in summary['streams'].items()]
    return _table(title, ['stream'], ['share', 'planned share'], rows)


def stage_table(stages: dict[str, Any]) -> Any:
    """Rows, tokens, loss tokens and the mean loss each stream gave to each stage of a staged run."""
    rows = [([stage, name], c, []) for stage, streams in stages.items() for name, c in streams.items()]
    return _table('per stage', ['stage', 'stream'], [], rows)


def _table(title: str, names: list[str], shares: list[str], rows: list[tuple[list[str], Any, list[str]]]) -> Any:
    """A rich table: the ``names`` columns, the counters, the ``shares`` columns, the mean loss
    (4 decimals, ``-`` where none was measured)."""
    from rich.table import Table
    out = Table(title=title)
    for col in (*names, 'samples', 'tokens', 'loss tokens', *shares, 'loss'):
        out.add_column(col, justify='left' if col in names else 'right')
    for keys, c, cells in rows:
        loss = '-' if c.get('loss') is None else f'{c["loss"]:.4f}'
        out.add_row(*keys, f'{c["samples"]:,}', f'{c["tokens"]:,}', f'{c["loss_tokens"]:,}', *cells, loss)
    return out


def print_report(summary: dict[str, Any], out_dir: str, plot: bool, console: Optional[Any] = None) -> None:
    """Print the table and where the JSON (and the PNG, with ``plot``) are."""
    if console is None:
        from rich.console import Console
        console = Console()
    console.print(table(summary))
    if summary.get('stages'):
        console.print(stage_table(summary['stages']))
    console.print(f'summary: {os.path.join(out_dir, SUMMARY_NAME)}')
    if plot:
        console.print(f'plot:    {os.path.join(out_dir, PLOT_NAME)}')


def load_summary(path: str) -> tuple[dict[str, Any], str]:
    """``path`` is a report directory or its ``stream_accounting.json``: (summary, report dir)."""
    file = os.path.join(path, SUMMARY_NAME) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise MissingError(f'{file}: no such file (expected a report directory or its {SUMMARY_NAME})')
    with open(file, encoding='utf-8') as f:
        try:
            summary = json.load(f)
        except json.JSONDecodeError as e:
            raise UserError(f'{file}: not JSON: {e}') from None
    if not isinstance(summary, dict) or not isinstance(summary.get('streams'), dict):
        raise UserError(f"{file}: not a stream accounting summary (no 'streams' mapping)")
    return summary, os.path.dirname(os.path.abspath(file))


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser('report', help="re-render a training run's per-stream accounting",
                              description=f'Print the per-stream table of a finished (or stopped) run and '
                                          f'write {PLOT_NAME} again beside its {SUMMARY_NAME}.')
    p.add_argument('path', metavar='RUN_REPORT_DIR_or_JSON',
                   help=f'the report directory (stream_accounting.out_dir) or its {SUMMARY_NAME}')
    p.add_argument('--no-plot', dest='plot', action='store_false', help=f'print the table only, no {PLOT_NAME}')
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    summary, out_dir = load_summary(args.path)
    plot = args.plot and bool(summary.get('history'))
    if plot:
        write_plot(summary, os.path.join(out_dir, PLOT_NAME))
    print_report(summary, out_dir, plot)
    return 0


def mean_loss(loss_sum: float, targets: int) -> Optional[float]:
    """The mean loss per loss target, or None when there were none (JSON null, not NaN)."""
    return float(loss_sum) / int(targets) if targets else None


def interval_loss(before: Optional[Mapping[str, Any]], after: Mapping[str, Any]) -> list[Optional[float]]:
    """Per stream: the mean loss between two history points (``before`` None: from the start)."""
    zero = [0] * len(after['loss_sum'])
    sums = np.subtract(after['loss_sum'], before['loss_sum'] if before else zero)
    targets = np.subtract(after['loss_targets'], before['loss_targets'] if before else zero)
    return [mean_loss(s, t) for s, t in zip(sums, targets)]
