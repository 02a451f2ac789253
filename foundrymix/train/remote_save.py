"""Checkpoints to a remote ``save_folder`` (``s3://...``), uploaded by threads of the trainer.

Why not Composer's default (0.32.1): its ``RemoteUploader`` uploads from spawned worker
processes that outlive a killed trainer, landing uploads after the job is gone.
``RemoteUploaderDownloader`` with ``use_procs=False`` uploads from threads of the trainer, so
a killed run leaves nothing running. The ``CheckpointSaver`` is the one Composer's trainer
would build, writing to a local scratch folder. A sharded run keeps Composer's own uploader,
whose symlink autoresume reads (it is uploaded after every rank's shard).
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
