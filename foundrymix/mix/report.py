"""The plan as people read it: rich tables and plain sentences (JSON is ``Plan.to_dict``).

Kept apart from :mod:`foundrymix.mix.plan` so the numbers stay a pure function and the
words can change (or a picture be added) without touching them.
"""

from __future__ import annotations

from typing import Any

from foundrymix.mix.plan import Plan, StreamPlan


def console_for_output() -> Any:
    """A rich console; 160 columns wide when stdout is not a terminal (logs, pipes)."""
    from rich.console import Console
    console = Console()
    return console if console.is_terminal else Console(width=160)


def render_plan(plan: Plan, console: Any = None) -> None:
    """Print ``plan``: the per-epoch mixture table, the run length, notes and warnings."""
    from rich.table import Table

    console = console or console_for_output()
    table = Table(title=f'Mixture per epoch ({plan.epoch_size:,} rows of {plan.max_seq_len} '
                        f'tokens; batching {plan.batching_method}, seed {plan.shuffle_seed})')
    for col in ('stream', 'kind', 'rows', 'rows/epoch', 'passes', 'seen', 'share',
                'tokens/epoch', 'loss tok/epoch', 'tok share', 'loss share'):
        table.add_column(col, justify='left' if col in ('stream', 'kind', 'seen') else 'right')
    for s in plan.streams:
        approx = '' if s.tokens_exact else '~'
        table.add_row(
            s.name, s.kind, f'{s.rows:,}', f'{s.rows_per_epoch:,}', f'{s.passes:.3g}x',
            seen_text(s), f'{s.share:.1%}', f'{approx}{s.tokens_per_epoch:,.0f}',
            f'{approx}{s.loss_tokens_per_epoch:,.0f}', f'{s.token_share:.1%}',
            f'{s.loss_token_share:.1%}')
    console.print(table)
    console.print(
        f'global batch {plan.global_batch_size} ({plan.batch_size} x {plan.world_size} '
        f'ranks): {plan.batches_per_epoch:,} batches = {plan.samples_per_epoch:,} samples '
        f'per epoch')
    if plan.duration:
        d = plan.duration
        where = (f'stops in epoch {d.last_epoch} after batch {d.last_batch_in_epoch:,} '
                 f'(sample {d.last_sample_in_epoch:,} of the epoch)' if d.ends_mid_epoch
                 else f'ends exactly at the end of epoch {d.last_epoch}')
        console.print(f'max_duration {d.max_duration}: {d.total_batches:,} batches, '
                      f'{d.total_samples:,} samples, {d.total_tokens:,} tokens = '
                      f'{d.epochs:.4g} epochs ({d.full_epochs} full); {where}')
        if d.rows_per_stream is not None:
            console.print('rows trained per stream over the run: ' + ', '.join(
                f'{k} {v:,}' for k, v in d.rows_per_stream.items()))
    for note in plan.notes:
        console.print(f'note: {note}')
    for warning in plan.warnings:
        console.print(f'[yellow]warning:[/yellow] {warning}')


def seen_text(s: StreamPlan) -> str:
    """'each row 2x or 3x' style description of how often rows are seen per epoch."""
    if s.rows_seen_extra == 0:
        return f'every row {s.full_passes}x'
    if s.full_passes == 0:
        return f'{s.rows_seen_extra:,} rows 1x, {s.unseen_rows:,} unseen'
    return (f'{s.rows - s.rows_seen_extra:,} rows {s.full_passes}x, '
            f'{s.rows_seen_extra:,} rows {s.full_passes + 1}x')
