"""The plan as people read it: rich tables and sentences over :mod:`foundrymix.plan`'s numbers."""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Mapping

from foundrymix.plan.mixture import EVERY_STREAM_HINT, Plan, StreamPlan, under_one_pass_warnings
from foundrymix.plan.stages import stream_location

#: a plan lists every stream up to this many; beyond, the largest and smallest, the groups
#: (name prefixes such as ``web/``) and the totals -- ``--streams all`` or ``--json`` for all
MAX_STREAM_ROWS = 20
#: ... of which this many largest and this many smallest
EXTREME_ROWS = 5


def groups(names: Any) -> dict[str, list[str]]:
    """Group (a name up to its first ``/``: ``web/en`` -> ``web/``) -> member names, in first-seen
    order; only when some group has 2+ members."""
    out: dict[str, list[str]] = {}
    for n in names:
        out.setdefault(n.split('/', 1)[0] + '/' if '/' in n else '(no group)', []).append(n)
    return out if any(len(m) > 1 and g != '(no group)' for g, m in out.items()) else {}


def _most_least(values: Mapping[str, Any], text: Callable[[Any], str]) -> str:
    """``most: a 9, b 8; least: z 0, y 1``: the :data:`EXTREME_ROWS` largest and smallest."""
    order = sorted(values, key=lambda k: values[k])
    most = ', '.join(f'{k} {text(values[k])}' for k in reversed(order[-EXTREME_ROWS:]))
    least = ', '.join(f'{k} {text(values[k])}' for k in order[:EXTREME_ROWS])
    return f'most: {most}; least: {least}'


def counts_text(counts: Mapping[str, int], all_streams: bool = False) -> str:
    """``a 1, b 2`` for up to :data:`MAX_STREAM_ROWS` streams; beyond, the total, the
    extremes and the groups (one line of 1,000 streams read as noise)."""
    if all_streams or len(counts) <= MAX_STREAM_ROWS:
        return ', '.join(f'{k} {v:,}' for k, v in counts.items())
    text = f'{len(counts):,} streams, {sum(counts.values()):,} in all; {_most_least(counts, "{:,}".format)}'
    grouped = groups(counts)
    if grouped:
        text += '; by group: ' + ', '.join(
            f'{g} {sum(counts[n] for n in m):,} ({len(m):,} streams)' for g, m in grouped.items())
    return text


def console_for_output() -> Any:
    """A rich console; 160 columns wide when stdout is not a terminal (logs, pipes)."""
    from rich.console import Console
    console = Console()
    return console if console.is_terminal else Console(width=160)


#: a plan lists every rank up to this many, else the range over ranks
MAX_RANK_ROWS = 16


def render_ranks(plan: Plan, console: Any, all_streams: bool = False) -> None:
    """Topology and every rank's rows per stream per epoch."""
    console.print(f'topology {plan.nodes} node(s) x {plan.ranks_per_node} rank(s): each rank '
                  f'trains its {plan.batch_size} rows of every global batch of one order (the same '
                  f'on any topology; nothing padded)')
    if not plan.per_rank:
        return
    names = [s.name for s in plan.streams]
    if len(plan.per_rank) <= MAX_RANK_ROWS or plan.per_rank[0].rows_per_stream is None:
        for r in plan.per_rank[:MAX_RANK_ROWS]:
            per_stream = ('' if r.rows_per_stream is None else
                          ' (' + counts_text(r.rows_per_stream, all_streams) + ')')
            console.print(f'  rank {r.rank} (node {r.node}, local {r.local_rank}): '
                          f'{r.batches_per_epoch:,} batches, {r.samples_per_epoch:,} rows/epoch'
                          + per_stream)
        if len(plan.per_rank) > MAX_RANK_ROWS:
            console.print(f'  ... ranks {MAX_RANK_ROWS}-{len(plan.per_rank) - 1} alike')
        return
    if not all_streams and len(names) > MAX_STREAM_ROWS:
        spread = {n: max(r.rows_per_stream[n] for r in plan.per_rank)
                  - min(r.rows_per_stream[n] for r in plan.per_rank) for n in names}
        names = sorted(names, key=lambda n: -spread[n])[:EXTREME_ROWS]
        console.print(f'  rows per rank per epoch, the {len(names)} streams that differ most '
                      f'between ranks (every stream: --streams all):')
    for n in names:
        counts = [r.rows_per_stream[n] for r in plan.per_rank]
        console.print(f'  {n}: {min(counts):,}..{max(counts):,} rows per rank per epoch')


def render_plan(plan: Plan, console: Any, all_streams: bool = False) -> None:
    """Print ``plan``: the per-epoch mixture table (beyond :data:`MAX_STREAM_ROWS` streams, unless
    ``all_streams``, the largest and smallest by share and the totals), the groups, the run length,
    notes and warnings."""
    from rich.table import Table

    table = Table(title=f'Mixture per epoch ({plan.epoch_size:,} rows of {plan.max_seq_len} '
                        f'tokens; batching {plan.batching_method}, seed {plan.shuffle_seed})')
    for col in ('stream', 'kind', 'rows', 'rows/epoch', 'passes', 'seen', 'share',
                'tokens/epoch', 'loss tok/epoch', 'tok share', 'loss share'):
        table.add_column(col, justify='left' if col in ('stream', 'kind', 'seen') else 'right')
    shown, between = plan.streams, 0
    if not all_streams and len(plan.streams) > MAX_STREAM_ROWS:
        by_share = sorted(plan.streams, key=lambda s: -s.share)
        shown = by_share[:EXTREME_ROWS] + by_share[-EXTREME_ROWS:]
        between = len(plan.streams) - len(shown)
    for i, s in enumerate(shown):
        if between and i == EXTREME_ROWS:
            table.add_row(f'... {between:,} more', '', '', '', '', '', '', '', '', '', '')
        approx = '' if s.tokens_exact else '~'
        table.add_row(
            s.name, s.kind, f'{s.rows:,}', f'{s.rows_per_epoch:,}', f'{s.passes:.3g}x',
            seen_text(s), f'{s.share:.1%}', f'{approx}{s.tokens_per_epoch:,.0f}',
            f'{approx}{s.loss_tokens_per_epoch:,.0f}', f'{s.token_share:.1%}',
            f'{s.loss_token_share:.1%}')
    if between:
        approx = '' if all(s.tokens_exact for s in plan.streams) else '~'
        table.add_row(f'all {len(plan.streams):,}', '', f'{sum(s.rows for s in plan.streams):,}',
                      f'{sum(s.rows_per_epoch for s in plan.streams):,}', '', '', '100.0%',
                      f'{approx}{sum(s.tokens_per_epoch for s in plan.streams):,.0f}',
                      f'{approx}{sum(s.loss_tokens_per_epoch for s in plan.streams):,.0f}',
                      '100.0%', '100.0%')
    console.print(table)
    render_groups(plan, console)
    console.print(
        f'global batch {plan.global_batch_size} ({plan.batch_size} x {plan.world_size} '
        f'ranks): {plan.batches_per_epoch:,} batches = {plan.samples_per_epoch:,} samples '
        f'per epoch')
    render_ranks(plan, console, all_streams)
    if plan.duration:
        d = plan.duration
        if plan.adaptive:  # segments read by cursors: the configured epochs do not apply
            where = 'in adaptive segments (the per-epoch figures above are the configured start\'s epochs)'
        elif d.ends_mid_epoch:
            where = (f'= {d.epochs:.4g} epochs ({d.full_epochs} full); stops in epoch {d.last_epoch} after '
                     f'batch {d.last_batch_in_epoch:,} (sample {d.last_sample_in_epoch:,} of the epoch)')
        else:
            where = f'= {d.epochs:.4g} epochs ({d.full_epochs} full); ends exactly at the end of epoch {d.last_epoch}'
        console.print(f'{plan.duration_name} {d.max_duration}: {d.total_batches:,} batches, '
                      f'{d.total_samples:,} samples, {d.total_tokens:,} tokens {where}')
        scope = 'the run' if plan.duration_name == 'max_duration' else 'the stage'
        if d.rows_per_stream is not None:
            console.print(f'rows trained per stream over {scope}: '
                          + counts_text(d.rows_per_stream, all_streams))
        if d.passes_per_stream is not None:
            console.print(passes_line(d.passes_per_stream, scope, all_streams))
    if plan.counted:
        console.print('counted: ' + '; '.join(f'{k.replace("_", " ")} {v}'
                                              for k, v in plan.counted.items()))
    for note in plan.notes:
        console.print(f'note: {note}')
    for warning in plan.warnings:
        if all_streams and warning.endswith(EVERY_STREAM_HINT):
            prefix = warning[:warning.index(':') + 2] if warning.startswith('stage ') else ''
            for line in under_one_pass_warnings(plan.streams, limit=None):
                console.print(f'[yellow]warning:[/yellow] {prefix}{line}')
        else:
            console.print(f'[yellow]warning:[/yellow] {warning}')


def render_groups(plan: Plan, console: Any) -> None:
    """One row per stream group: the YAML's pattern entries (with their given weight) when
    there are any, else name prefixes up to ``/``, when the names form groups."""
    from rich.table import Table
    given = {g.pattern: f'{g.weight} {g.value:g}' for g in plan.groups}
    grouped = ({g.pattern: g.members for g in plan.groups} if plan.groups
               else groups(s.name for s in plan.streams))
    if not grouped:
        return
    by_name = {s.name: s for s in plan.streams}
    table = Table(title='Per group (train_loader.streams patterns)' if given
                  else 'Per group (name up to the first /)')
    for col in ('group', 'streams', 'given', 'rows', 'rows/epoch', 'passes', 'share',
                'tok share', 'loss share'):
        if col != 'given' or given:
            table.add_column(col, justify='left' if col in ('group', 'given') else 'right')
    for g, members in grouped.items():
        ms = [by_name[n] for n in members]
        rows, per_epoch = sum(m.rows for m in ms), sum(m.rows_per_epoch for m in ms)
        table.add_row(g, f'{len(ms):,}', *([given[g]] if given else []), f'{rows:,}',
                      f'{per_epoch:,}', f'{per_epoch / rows:.3g}x' if rows else '-',
                      f'{sum(m.share for m in ms):.1%}', f'{sum(m.token_share for m in ms):.1%}',
                      f'{sum(m.loss_token_share for m in ms):.1%}')
    console.print(table)


def passes_line(passes: dict[str, float], scope: str, all_streams: bool = False) -> str:
    """``passes over the run: web 2.00, code 0.87`` -- how many times each stream's rows are
    trained in all (rows trained / rows); beyond :data:`MAX_STREAM_ROWS` streams, the extremes."""
    if all_streams or len(passes) <= MAX_STREAM_ROWS:
        return f'passes over {scope}: ' + ', '.join(f'{k} {_passes(v)}' for k, v in passes.items())
    return f'passes over {scope} ({len(passes):,} streams): {_most_least(passes, _passes)}'


def _passes(v: float) -> str:
    """Two decimals; under 0.005 of a pass, two significant digits (a stream trained, never "0.00")."""
    return f'{v:.2f}' if v == 0 or v >= 0.005 else f'{v:.2g}'


def seen_text(s: StreamPlan) -> str:
    """'each row 2x or 3x' style description of how often rows are seen per epoch."""
    if s.rows_seen_extra == 0:
        return f'every row {s.full_passes}x'
    if s.full_passes == 0:
        return f'{s.rows_seen_extra:,} rows 1x, {s.unseen_rows:,} unseen'
    return (f'{s.rows - s.rows_seen_extra:,} rows {s.full_passes}x, '
            f'{s.rows_seen_extra:,} rows {s.full_passes + 1}x')


def render_run_plan(run: Any, console: Any, all_streams: bool = False) -> None:
    """Print a staged run: the stages and where they fall, each stage's mixture, the totals."""
    from rich.table import Table

    rows = (f'{run.global_batch_size} rows' if not run.batch_varies else
            f'{min(run.batch_sizes)}-{max(run.batch_sizes)} rows')
    # batch: the stage's global batch (rows); first/last: its global batches; epochs: of
    # its own mixture
    table = Table(title=f'Stages ({run.total_batches:,} global batches of {rows} x '
                        f'{run.max_seq_len} tokens: {run.total_samples:,} samples, '
                        f'{run.total_tokens:,} tokens)')
    for col in ('stage', 'duration', 'batch', 'batches', 'first', 'last', 'samples', 'tokens',
                'epochs'):
        table.add_column(col, justify='left' if col in ('stage', 'duration') else 'right')
    for s in run.stages:
        table.add_row(f'{s.index} {s.name}', s.duration, f'{s.global_batch_size:,}', f'{s.batches:,}',
                      f'{s.start_batch:,}', f'{s.end_batch - 1:,}', f'{s.samples:,}',
                      f'{s.tokens:,}', f'{s.plan.duration.epochs:.4g}')
    console.print(table)
    if run.batch_varies:
        console.print('note: the stages\' global batches differ: Composer counts the run in samples '
                      f'(max_duration {run.total_samples}sp), so a schedule in dur is a fraction of '
                      'the rows trained, not of the optimizer steps')
    for s in run.stages:
        console.rule(f'stage {s.index} {s.name}: batches {s.start_batch:,}-{s.end_batch - 1:,}')
        render_plan(s.plan, console, all_streams)
    at = Counter(stream_location(i) for s in run.stages for i in s.infos)
    reused = sorted({i.name for s in run.stages for i in s.infos if at[stream_location(i)] > 1})
    if reused:
        console.print(f'note: {", ".join(reused)} come back in a later stage and go on with their '
                      f'passes (as their first stage shuffles them), after an adaptive stage too: no '
                      f'row is trained k+1 times before every row of its stream k times')
    console.rule('whole run')
    if run.decided_during_run:
        console.print(f'rows trained per stream over the run: decided during the run (adaptive '
                      f'stage {", ".join(run.decided_during_run)}); the other stages: '
                      + (counts_text(run.rows_per_stream, all_streams) or 'none'))
        return
    console.print('rows trained per stream over the run: '
                  + counts_text(run.rows_per_stream, all_streams))
    rows = {p.name: p.rows for s in run.stages for p in s.plan.streams}
    if run.rows_per_stream:
        console.print(passes_line({k: v / rows[k] for k, v in run.rows_per_stream.items()},
                                  'the run', all_streams=all_streams))


def render_lr_schedule(schedule: Any, lr: float, console: Any) -> None:
    """The ``wsd`` schedule: each phase's batches and LR at its ends, the LR at each stage's
    first batch -- the values the trainer's scheduler gives those batches."""
    from rich.table import Table

    m = schedule.multiplier
    shape = {'linear': 'linear', 'cosine': 'cosine', 'sqrt': '1-sqrt'}[schedule.shape]
    table = Table(title=f'LR schedule: wsd, lr {lr:g}, {shape} decay to {schedule.to:g} x lr')
    for col in ('phase', 'batches', 'first batch', 'last batch', 'LR first', 'LR last'):
        table.add_column(col, justify='left' if col == 'phase' else 'right')
    for name, a, b in schedule.phases():
        table.add_row(name, f'{b - a:,}', f'{a:,}', f'{b - 1:,}', f'{lr * m(a):.6g}',
                      f'{lr * m(b - 1):.6g}')
    console.print(table)
    console.print('note: a batch trains with the schedule\'s LR at its end: the warmup\'s last batch '
                  'at lr, the decay\'s last at its end LR')
    if len(schedule.stage_starts) > 1:
        console.print('LR at the first batch of each stage: ' + ', '.join(
            f'{n} (batch {b:,}) {lr * m(b):.6g}' for n, b in schedule.stage_starts))
