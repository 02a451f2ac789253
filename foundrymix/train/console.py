"""What a run prints to the terminal: Composer's progress bar, the metric dump, the resume line.

Why: on an interactive terminal a progress bar says how far the run is; the full metric
dump (Composer's ``ConsoleLogger``) is printed only every ``log_interval`` so it does
not bury the bar. A resumed run says in one line which checkpoint it continued from
and where (batch, epoch and, for a staged run, stage), so a log shows at a glance
that nothing restarted from zero.
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


def resume_line(state: Any) -> Optional[str]:
    """``resumed from PATH at batch B (epoch E, batch b of it[, stage S, batch s of it])``, or None."""
    if not getattr(state, 'load_path', None):
        return None
    ts = state.timestamp
    where = f'epoch {int(ts.epoch)}, batch {int(ts.batch_in_epoch)} of it'
    position = getattr(state.train_dataloader, 'dataset', None)
    run = getattr(position, 'run', None)
    if run is not None and hasattr(run, 'stage_at'):  # a StagedDataLoader's position
        stage = run.stage_at(position.batch)
        where += f', stage {stage.name!r}, batch {position.batch - stage.start_batch} of it'
    return f'resumed from {state.load_path} at batch {int(ts.batch)} ({where})'
