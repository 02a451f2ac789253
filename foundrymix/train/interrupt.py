"""Ctrl-C (SIGINT) and SIGTERM stop a command-line run with one line: where it stopped, the newest
complete checkpoint, and how to resume; exit ``128 + signal`` (130, 143), no traceback.

Composer's own handler calls ``sys.exit`` wherever the main thread is (inside ``torch.save``: a long
traceback). :func:`install` replaces it with one that records the signal and raises ``KeyboardInterrupt``;
whatever then leaves the run is reported as the stop. A checkpoint being written is abandoned, so the
one named is whole; the DataLoader's reports of its stopped workers ("Exception ignored") are dropped.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, Optional

from foundrymix.errors import Interrupted, UserError
from foundrymix.train.remote_resume import local_checkpoint

#: the signal that stopped this process (None: none yet)
received: Optional[int] = None


def install() -> None:
    """SIGINT and SIGTERM raise ``KeyboardInterrupt`` in this process, recording the signal."""
    main = os.getpid()

    def stop(signum: int, frame: Any) -> None:
        global received
        if os.getpid() == main and received is None:
            received = signum
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    before = sys.unraisablehook

    def quiet(unraisable: Any) -> None:
        if received is None:  # after a stop: a DataLoader's __del__ finding its workers stopped too
            before(unraisable)
    sys.unraisablehook = quiet


def stopped(cfg: Any, batch: Optional[int], rank: int = 0) -> Interrupted:
    """The error a run stopped by :data:`received` leaves with, after ``batch`` batches (None:
    before training); ranks but 0 say nothing (rank 0 speaks for the run)."""
    assert received is not None
    name = signal.Signals(received).name
    if rank != 0:
        return Interrupted('', received)
    where = 'before its first batch' if batch is None else f'after batch {batch}'
    if not cfg.save_folder:
        return Interrupted(f'stopped by {name} {where}; with no save_folder nothing was saved: run the '
                           f'same command again to start over', received)
    again = ('run the same command again (autoresume=true resumes there)' if cfg.autoresume else
             'run the same command with autoresume=true')
    if '://' in cfg.save_folder:
        return Interrupted(f'stopped by {name} {where}; to resume from the newest complete checkpoint in '
                           f'{cfg.save_folder}, {again}', received)
    from composer.utils import format_name_with_dist

    folder = format_name_with_dist(cfg.save_folder, cfg.run_name)
    try:
        found = local_checkpoint(folder)
    except UserError:
        found = None
    if found is None:
        return Interrupted(f'stopped by {name} {where}; no complete checkpoint in {folder} yet: run the '
                           f'same command again to start over', received)
    return Interrupted(f'stopped by {name} {where}; newest complete checkpoint: {found.path}; to resume '
                       f'there, {again} (or with load_path={found.path})', received)
