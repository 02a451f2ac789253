"""The plan as people read it: rich tables and plain sentences (JSON is ``Plan.to_dict``).

Kept apart from :mod:`foundrymix.plan.mixture` so the numbers stay a pure function and the
words can change (or a picture be added) without touching them.
"""

from __future__ import annotations

from typing import Any

from foundrymix.plan.mixture import Plan, StreamPlan


def console_for_output() -> Any:
    """A rich console; 160 columns wide when stdout is not a terminal (logs, pipes)."""
    from rich.console import Console
    console = Console()
    return console if console.is_terminal else Console(width=160)


#: a plan lists every rank up to this many, else the range over ranks
MAX_RANK_ROWS = 16


def render_ranks(plan: Plan, console: Any) -> None:
    """Topology, num_canonical_nodes, exactness and every rank's rows per stream per epoch."""
    mode = ('exact: whole global batches, no row trained twice by rank padding' if plan.exact
            else 'exact: false (streaming pads ranks with repeated rows)')
    console.print(f'topology {plan.nodes} node(s) x {plan.ranks_per_node} rank(s), '
                  f'num_canonical_nodes {plan.num_canonical_nodes}; {mode}; repeated by padding '
                  f'per epoch: {plan.repeated_rows_per_epoch:,}')
    if not plan.per_rank:
        return
    names = [s.name for s in plan.streams]
    if len(plan.per_rank) <= MAX_RANK_ROWS:
        for r in plan.per_rank:
            console.print(f'  rank {r.rank} (node {r.node}, local {r.local_rank}): '
                          f'{r.batches_per_epoch:,} batches, {r.samples_per_epoch:,} rows/epoch ('
                          + ', '.join(f'{n} {r.rows_per_stream[n]:,}' for n in names) + ')')
        return
    for n in names:
        counts = [r.rows_per_stream[n] for r in plan.per_rank]
        console.print(f'  {n}: {min(counts):,}..{max(counts):,} rows per rank per epoch')


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
    render_ranks(plan, console)
    if plan.duration:
        d = plan.duration
        where = (f'stops in epoch {d.last_epoch} after batch {d.last_batch_in_epoch:,} '
                 f'(sample {d.last_sample_in_epoch:,} of the epoch)' if d.ends_mid_epoch
                 else f'ends exactly at the end of epoch {d.last_epoch}')
        console.print(f'{plan.duration_name} {d.max_duration}: {d.total_batches:,} batches, '
                      f'{d.total_samples:,} samples, {d.total_tokens:,} tokens = '
                      f'{d.epochs:.4g} epochs ({d.full_epochs} full); {where}')
        scope = 'the run' if plan.duration_name == 'max_duration' else 'the stage'
        if d.rows_per_stream is not None:
            console.print(f'rows trained per stream over {scope}: ' + ', '.join(
                f'{k} {v:,}' for k, v in d.rows_per_stream.items()))
        if d.passes_per_stream is not None:
            console.print(passes_line(d.passes_per_stream, scope, d.rows_per_stream is None))
    for note in plan.notes:
        console.print(f'note: {note}')
    for warning in plan.warnings:
        console.print(f'[yellow]warning:[/yellow] {warning}')


def passes_line(passes: dict[str, float], scope: str, approximate: bool = False) -> str:
    """``passes over the run: web 2.00, code 0.87`` -- how many times each stream's rows are
    trained in all (rows trained / rows), the question a mixture by shares leaves open."""
    tilde = '~' if approximate else ''
    return f'passes over {scope}: ' + ', '.join(f'{k} {tilde}{v:.2f}' for k, v in passes.items())


def seen_text(s: StreamPlan) -> str:
    """'each row 2x or 3x' style description of how often rows are seen per epoch."""
    if s.rows_seen_extra == 0:
        return f'every row {s.full_passes}x'
    if s.full_passes == 0:
        return f'{s.rows_seen_extra:,} rows 1x, {s.unseen_rows:,} unseen'
    return (f'{s.rows - s.rows_seen_extra:,} rows {s.full_passes}x, '
            f'{s.rows_seen_extra:,} rows {s.full_passes + 1}x')


def render_run_plan(run: Any, console: Any = None) -> None:
    """Print a staged run: the stages and where they fall, each stage's mixture, the totals."""
    from rich.table import Table

    console = console or console_for_output()
    table = Table(title=f'Stages ({run.total_batches:,} global batches of '
                        f'{run.global_batch_size} rows x {run.max_seq_len} tokens)')
    for col in ('stage', 'duration', 'batches', 'first batch', 'last batch', 'epochs of its mixture'):
        table.add_column(col, justify='left' if col in ('stage', 'duration') else 'right')
    for s in run.stages:
        table.add_row(f'{s.index} {s.name}', s.duration, f'{s.batches:,}', f'{s.start_batch:,}',
                      f'{s.end_batch - 1:,}', f'{s.plan.duration.epochs:.4g}')
    console.print(table)
    for s in run.stages:
        console.rule(f'stage {s.index} {s.name}: batches {s.start_batch:,}-{s.end_batch - 1:,}')
        render_plan(s.plan, console)
    reused = sorted({n for s in run.stages[1:] for n in (p.name for p in s.plan.streams)
                     if any(n in (p.name for p in t.plan.streams) for t in run.stages[:s.index])})
    if reused:
        console.print(f'note: {", ".join(reused)} come back in a later stage: each stage starts a '
                      f'fresh pass over its streams, shuffled with its own seed')
    console.rule('whole run')
    console.print('rows trained per stream over the run: ' + ', '.join(
        f'{k} {v:,}' for k, v in run.rows_per_stream.items()))
    rows = {p.name: p.rows for s in run.stages for p in s.plan.streams}
    if run.rows_per_stream:
        console.print(passes_line({k: v / rows[k] for k, v in run.rows_per_stream.items()}, 'the run'))


def plot_run_plan(run: Any, path: str, realized: Any = None) -> None:
    """A picture of the planned mixture over training steps: one band per stream (its
    share of each global batch), stage boundaries marked; ``realized`` (batch ->
    cumulative rows per stream, from the accounting report) is drawn over it."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    import numpy as np

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
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bands = ax.stackplot(xs, np.array(shares).T, labels=[f'{n} (plan)' for n in names], alpha=0.45)
    for s in run.stages[1:]:
        ax.axvline(s.start_batch, color='black', linewidth=0.8, linestyle='--')
    for s in run.stages:
        ax.text((s.start_batch + s.end_batch) / 2, 1.01, s.name, ha='center', va='bottom', fontsize=8)
    if realized is not None:
        _draw_realized(ax, run, names, realized, [tuple(b.get_facecolor()[0][:3]) for b in bands])
    ax.set_xlim(0, run.total_batches)
    ax.set_ylim(0, 1.08)
    ax.set_xlabel('global batch')
    ax.set_ylabel('share of rows (stacked)')
    ax.set_title('Planned mixture over training' + (' and realized (lines: share so far in the '
                                                     'stage)' if realized is not None else ''))
    ax.legend(fontsize=7, loc='lower right')
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _draw_realized(ax: Any, run: Any, names: list[str], realized: Any, colors: list[Any]) -> None:
    """Stacked realized shares, each stage counted from its own start, as step lines."""
    import numpy as np

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
