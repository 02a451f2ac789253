"""Checkpoints to a local ``save_folder``, never left truncated under their final name.

Why: Composer (0.32.1) writes ``ep{e}-ba{b}-rank{r}.pt`` in place, so a run stopped during the
write (Ctrl-C, SIGTERM, SIGKILL, a full disk) leaves a truncated file that looks like a
checkpoint. This saver is Composer's public ``CheckpointSaver`` writing ``ep{e}-ba{b}-rank{r}.part.pt``;
once that is whole (flushed to disk) it is renamed to ``<name>`` and ``latest-rank{r}.pt`` is
re-pointed by an atomic rename too. A ``.part.pt`` is removed when its write fails, and ones a
killed run left are removed at the next start (never the one ``latest`` points at).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from composer.callbacks import CheckpointSaver
from composer.core import State
from composer.loggers import Logger
from composer.utils import ensure_folder_has_no_conflicting_files, format_name_with_dist

from foundrymix.train.remote_save import FILENAME, LATEST

PART = '.part.pt'  # in place of '.pt' (a name ending '.pt.<x>' is a compressed one to Composer)


class LocalSave(CheckpointSaver):
    """``CheckpointSaver`` into ``folder`` by write-then-rename; keeps the newest ``keep`` (-1: all)."""

    def __init__(self, folder: str, save_interval: Any, overwrite: bool, keep: int) -> None:
        # keep=0 (Composer: keep none locally) is Composer's own; else rotation is of the final names
        super().__init__(folder=folder, filename=FILENAME[:-len('.pt')] + PART, remote_file_name=None,
                         latest_filename=LATEST, latest_remote_file_name=None, save_interval=save_interval, overwrite=overwrite,
                         num_checkpoints_to_keep=0 if keep == 0 else -1)
        self.keep = keep
        self.published: list[str] = []

    def fit_start(self, state: State, logger: Logger) -> None:
        folder = format_name_with_dist(self.folder, state.run_name)
        latest = os.path.realpath(os.path.join(folder, format_name_with_dist(LATEST, state.run_name)))
        for name in os.listdir(folder) if os.path.isdir(folder) else []:
            path = os.path.join(folder, name)
            if name.endswith(PART) and os.path.realpath(path) != latest:
                with contextlib.suppress(FileNotFoundError):  # (another rank of this node removed it)
                    os.remove(path)  # a write a killed run left unfinished
        if not self.overwrite:  # Composer's check, of the names checkpoints are published under
            ensure_folder_has_no_conflicting_files(folder, FILENAME, state.timestamp)
        super().fit_start(state, logger)

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        self._publish(state, lambda: super(LocalSave, self).batch_checkpoint(state, logger))

    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        self._publish(state, lambda: super(LocalSave, self).epoch_checkpoint(state, logger))

    def iteration_checkpoint(self, state: State, logger: Logger) -> None:
        self._publish(state, lambda: super(LocalSave, self).iteration_checkpoint(state, logger))

    def _publish(self, state: State, save: Any) -> None:
        """Run Composer's save; a ``.part`` it wrote becomes the checkpoint and ``latest``."""
        part = self.filename.format(state)
        try:
            save()
        except BaseException:
            if os.path.exists(part):
                os.remove(part)
            raise
        if not os.path.exists(part):
            return  # no save at this event, or not this rank's
        with open(part, 'rb') as f:
            os.fsync(f.fileno())
        final = part[:-len(PART)] + '.pt'
        os.replace(part, final)
        latest = self.latest_filename.format(state) if self.latest_filename is not None else None
        if latest is not None:
            tmp = latest + '.part'
            if os.path.lexists(tmp):
                os.remove(tmp)
            os.symlink(os.path.relpath(final, os.path.dirname(latest)), tmp)
            os.replace(tmp, latest)
        self.published.append(final)
        while self.keep > 0 and len(self.published) > self.keep:
            os.remove(self.published.pop(0))
