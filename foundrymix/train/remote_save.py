"""Checkpoints to a remote ``save_folder`` (``s3://...``), uploaded by threads of the trainer.

Why not Composer's default for a remote ``save_folder`` (0.32.1): its ``RemoteUploader`` runs
uploads and existence checks in spawned worker processes (a ``ProcessPoolExecutor`` and a
``multiprocessing`` manager, each importing torch) that do not watch their parent: after a
SIGKILL or SIGTERM of the trainer they run on, holding memory and landing uploads after the
job is gone. Composer's public ``RemoteUploaderDownloader`` logger with ``use_procs=False``
uploads from threads of the trainer's own process instead, so a killed run leaves nothing
running; network I/O releases the GIL. The ``CheckpointSaver`` here is the one Composer's
trainer would build (same names, interval, overwrite and local rotation), given a local
scratch folder: it hands each checkpoint, then ``latest-rank0.pt.symlink``, to that uploader,
which uploads them one at a time (a symlink waiting behind an earlier one keeps its place in
the queue, so when uploads lag it can land before the checkpoint it names). Autoresume does
not rely on the symlink (:mod:`foundrymix.train.remote_resume` lists the checkpoints).

A sharded (``fsdp.state_dict_type: sharded``) run keeps Composer's own uploader: its symlink
is uploaded only after every rank's shard is in the bucket, which is what autoresume reads.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Any

from composer.callbacks import CheckpointSaver
from composer.loggers import RemoteUploaderDownloader
from composer.utils import parse_uri

FILENAME = 'ep{epoch}-ba{batch}-rank{rank}.pt'  # Composer's default save_filename
LATEST = 'latest-rank{rank}.pt'                 # Composer's default save_latest_filename


@dataclass
class RemoteSave:
    """The saver and uploader a run with a remote ``save_folder`` is given, and its scratch folder."""

    saver: CheckpointSaver
    uploader: RemoteUploaderDownloader
    scratch: tempfile.TemporaryDirectory  # local copies before upload; removed when the run ends

    def close(self) -> None:
        self.scratch.cleanup()


def remote_save(save_folder: str, save_interval: Any, overwrite: bool, keep: int) -> RemoteSave:
    """A ``CheckpointSaver`` writing under ``save_folder`` (an object store URI, ``{run_name}``
    allowed) through a thread-based ``RemoteUploaderDownloader``."""
    backend, bucket, path = parse_uri(save_folder)
    prefix = path.strip('/')
    remote = f'{prefix}/{FILENAME}' if prefix else FILENAME
    latest = f'{prefix}/{LATEST}' if prefix else LATEST
    scratch = tempfile.TemporaryDirectory(prefix='fmx-ckpt-')
    uploader = RemoteUploaderDownloader(bucket_uri=f'{backend}://{bucket}', num_concurrent_uploads=1,
                                        use_procs=False, upload_staging_folder=None)
    saver = CheckpointSaver(folder=scratch.name, filename=FILENAME, remote_file_name=remote,
                            latest_filename=LATEST, latest_remote_file_name=latest,
                            save_interval=save_interval, overwrite=overwrite, num_checkpoints_to_keep=keep)
    return RemoteSave(saver=saver, uploader=uploader, scratch=scratch)
