"""What a run prints to the terminal: Composer's progress bar, the metric dump (only every
``log_interval``, not burying the bar), and one line saying where a resumed run continued from.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Optional


def console_kwargs(cfg: Any) -> dict[str, Any]:
    """Composer ``Trainer`` arguments for the bar and the dump (``progress_bar: null`` = on a tty)."""
    console = cfg.loggers.get('console')
    bar = cfg.progress_bar if cfg.progress_bar is not None else sys.stdout.isatty()
    if bar and console is not None:  # both is what we want: the dump only every log_interval
        warnings.filterwarnings('ignore', message='Setting both `progress_bar` and `log_to_console`')
    return {'progress_bar': bar, 'log_to_console': console is not None,
            'console_log_interval': cfg.log_interval,
            'console_stream': console.stream if console is not None else 'stdout'}


def resume_line(state: Any, position: Any, weights_only: bool = False) -> Optional[str]:
    """``resumed from PATH at batch B (epoch E, batch b of it[, stage S, batch s of it])``, or None;
    with ``load_weights_only`` it says that only the weights were taken."""
    if not getattr(state, 'load_path', None):
        return None
    if weights_only:
        return (f'weights from {state.load_path}; the data position, optimizer and LR schedule '
                f'start fresh at batch 0 (load_weights_only)')
    ts = state.timestamp
    where = f'epoch {int(ts.epoch)}, batch {int(ts.batch_in_epoch)} of it'
    if position.run.explicit:  # a run with stages
        stage = position.run.stage_at(position.batch)
        where += f', stage {stage.name!r}, batch {position.batch - stage.start_batch} of it'
    return f'resumed from {state.load_path} at batch {int(ts.batch)} ({where})'


def finished_line(state: Any) -> Optional[str]:
    """``already finished: ...`` when the checkpoint a run resumed from is at or past its
    ``max_duration`` (Composer's ``fit()`` would raise; a finished run is done, not failed), else None."""
    max_duration = getattr(state, 'max_duration', None)
    if not getattr(state, 'load_path', None) or max_duration is None:
        return None
    if state.timestamp.get(max_duration.unit) < max_duration:
        return None
    return (f'already finished: {state.load_path} is at batch {int(state.timestamp.batch)}, the end of '
            f'max_duration {max_duration.to_timestring()}; nothing to train (to train on, raise '
            f'max_duration)')


def extension_line(state: Any, position: Any, scheduler: Any, base_lr: float) -> Optional[str]:
    """The LR at the resume batch under the checkpoint's length and this run's, when a resume
    changed the run's length (Composer's schedules follow the fraction of ``max_duration``), or None."""
    resumed, run = position.resumed, position.run
    if resumed is None:
        return None
    saved = state.max_duration
    # per-stage batches: Composer runs in samples (foundrymix.train.preflight.composer_duration)
    in_samples = str(saved).endswith('sp')
    unit, what_unit = ('sp', 'samples') if in_samples else ('ba', 'batches')
    old = resumed.old_total_samples if in_samples else resumed.old_total_batches
    new = run.total_samples if in_samples else run.total_batches
    if old is None or old == new:
        return None
    try:
        state.max_duration = f'{old}{unit}'
        before = base_lr * scheduler(state)
        state.max_duration = f'{new}{unit}'
        after = base_lr * scheduler(state)
    finally:
        state.max_duration = saved
    what = 'extended' if new > old else 'shortened'
    at = int(state.timestamp.sample) if in_samples else resumed.batch
    done = ' (it had finished)' if at >= old else ''
    same = ' (unchanged)' if abs(before - after) <= 1e-12 * max(abs(before), 1e-30) else ''
    return (f'the run is {what} from {old} to {new} {what_unit}{done}: the LR schedule now spans '
            f'{new} {what_unit}; LR at batch {resumed.batch}: {before:.6g} under the checkpoint\'s '
            f'length, {after:.6g} now{same}')


def wsd_resume_line(state: Any, position: Any, scheduler: Any) -> Optional[str]:
    """For a ``wsd`` run resumed at batch B: B's LR as the checkpoint left it and under this run's
    schedule (an extended stable phase, an anneal branch), when they differ or the length changed."""
    resumed, run = position.resumed, position.run
    if resumed is None:
        return None
    base = state.schedulers[0].base_lrs[0]
    before = state.optimizers[0].param_groups[0]['lr']
    after = base * scheduler.multiplier(resumed.batch)
    old, new = resumed.old_total_batches, run.total_batches
    if old == new and abs(before - after) <= 1e-12 * max(abs(before), 1e-30):
        return None
    length = ('' if old is None or old == new else
              f'the run is {"extended" if new > old else "shortened"} from {old} to {new} batches'
              f'{" (it had finished)" if resumed.batch >= old else ""}; ')
    phase = next((n for n, a, b in scheduler.phases() if a <= resumed.batch < b), 'end')
    return (f'{length}LR at batch {resumed.batch}: {before:.6g} as the checkpoint left it, '
            f'{after:.6g} now (wsd {phase}; decay batches {scheduler.decay_start}-'
            f'{scheduler.decay_end - 1})')
