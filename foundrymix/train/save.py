"""Checkpoint savers for a ``save_folder`` (a sharded run keeps Composer's own).

Local: Composer writes ``ep{e}-ba{b}-rank{r}.pt`` in place, so a run stopped during the write leaves a
truncated file that looks like a checkpoint. :class:`LocalSave` writes ``<name>.part.pt`` and renames it,
then ``latest-rank{r}.pt``, once it is whole and flushed; a failed write's ``.part.pt`` is removed, and a
killed run's at the next start (never the one ``latest`` points at).

Remote (``s3://...``): Composer's saver writes to a local scratch folder and :class:`CheckpointUploader`
uploads in order, from one thread, every request retried (:func:`foundrymix.s3.remote.make_client`):
Composer's uploader gives up after 3 attempts and loses the checkpoints after a failed one. The pointer
goes up after its checkpoint; a file that still fails stops the run in one line naming its kept local
copy. A killed run's unfinished multipart uploads of our names are aborted at start.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Optional

from boto3.exceptions import S3UploadFailedError
from composer.callbacks import CheckpointSaver
from composer.core import State
from composer.loggers import Logger, LoggerDestination
from composer.utils import dist, ensure_folder_has_no_conflicting_files, format_name_with_dist, parse_uri

from foundrymix.errors import ExistsError, FoundrymixError
from foundrymix.s3.remote import S3Url, attempts, classify, make_client, within

FILENAME = 'ep{epoch}-ba{batch}-rank{rank}.pt'  # Composer's default save_filename
LATEST = 'latest-rank{rank}.pt'                 # Composer's default save_latest_filename
#: the names this module uploads (a checkpoint of any rank, the latest pointer)
OURS = re.compile(r'^(ep\d+-ba\d+-rank\d+\.pt|latest-rank\d+\.pt\.symlink)$')
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


class CheckpointUploader(LoggerDestination):
    """Uploads the files the saver hands over (``Logger.upload_file``), in order, on one thread."""

    def __init__(self, url: S3Url, scratch: str, timeout: float) -> None:
        self.url, self.unsent = url, os.path.join(scratch, 'unsent')
        self.client = make_client(connect_timeout=timeout, read_timeout=timeout, threads=10)
        self.failure: Optional[str] = None  # the one line, once a file could not be uploaded
        self._queue: queue.Queue = queue.Queue()
        self._staged = 0
        self._thread = threading.Thread(target=self._work, name='fmx-ckpt-upload', daemon=True)
        self._thread.start()

    def upload_file(self, state: Any, remote_file_name: str, file_path: Any, *, overwrite: bool) -> None:
        # A link (a copy across file systems): the saver may delete its file before the upload.
        self._staged += 1  # a folder each: the pointer is handed over again before it went up
        staged = os.path.join(self.unsent, str(self._staged), os.path.basename(remote_file_name))
        os.makedirs(os.path.dirname(staged))
        try:
            os.link(file_path, staged)
        except OSError:
            shutil.copyfile(file_path, staged)
        self._queue.put((remote_file_name.lstrip('/'), staged, overwrite))

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, staged, overwrite = item
                if self.failure is None:
                    self._upload(key, staged, overwrite)
                    shutil.rmtree(os.path.dirname(staged))
            except Exception as e:  # S3, credentials, the network: named with the local copy
                uri = f's3://{self.url.bucket}/{key}'
                if isinstance(e, S3UploadFailedError):  # boto3 wraps S3's answer (its code) in it
                    e = e.__context__ or e
                why = str(e) if isinstance(e, ExistsError) else classify(
                    e, uri, attempts=attempts(), more=f'raise AWS_MAX_ATTEMPTS (now {attempts()})').text
                self.failure = (f'checkpoint upload failed, the run stopped: {uri}: {why}. Its local '
                                f'copy is kept: {staged} (upload it there, or resume from it with '
                                f'load_path={staged})')
            finally:
                self._queue.task_done()

    def _upload(self, key: str, path: str, overwrite: bool) -> None:
        from botocore.exceptions import ClientError
        if not overwrite:
            try:
                self.client.head_object(Bucket=self.url.bucket, Key=key)
                raise ExistsError('it already exists (an earlier run\'s checkpoint: save_overwrite=true '
                                  'replaces it, autoresume=true continues that run)')
            except ClientError as e:
                if e.response.get('Error', {}).get('Code') not in ('404', 'NoSuchKey', 'NotFound'):
                    raise
        # s3transfer: multipart above 8 MB, each part retried; a failed one aborts the upload
        self.client.upload_file(path, self.url.bucket, key)

    def failed(self) -> Optional[FoundrymixError]:
        """The failed upload's error, or None: the run's ``StopTogether`` asks before each batch, so
        every rank stops at the same batch (one rank raising alone would leave the others waiting)."""
        return None if self.failure is None else FoundrymixError(self.failure)

    def fit_end(self, state: Any, logger: Any) -> None:
        self._queue.join()  # the last checkpoint and its pointer are in the bucket, or named
        if self.failure is not None:
            raise FoundrymixError(self.failure)

    def post_close(self) -> None:
        if self._thread.is_alive():
            self._queue.join()  # a run stopped by SIGTERM lets the upload in flight finish
            self._queue.put(None)


@dataclass
class RemoteSave:
    """The saver and uploader a run with a remote ``save_folder`` is given, and its scratch folder."""

    saver: CheckpointSaver
    uploader: CheckpointUploader
    scratch: str  # local copies before upload; removed when the run ends unless an upload failed

    def close(self) -> None:
        self.uploader.post_close()
        if self.uploader.failure is None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def abort_unfinished(url: S3Url, timeout: float) -> list[str]:
    """Abort the unfinished multipart uploads of our file names directly under ``url`` (a run
    killed mid-upload leaves them, billed until aborted); returns their keys. The listing is
    bounded by ``timeout`` as every start-up request is (:func:`foundrymix.s3.remote.within`)."""
    client = make_client(max_attempts=1, connect_timeout=timeout, read_timeout=timeout)
    start = f'{url.prefix}/' if url.prefix else ''

    def listed() -> list[tuple[str, str]]:
        pages = client.get_paginator('list_multipart_uploads').paginate(Bucket=url.bucket, Prefix=start)
        return [(u['Key'], u['UploadId']) for page in pages for u in page.get('Uploads', [])]

    aborted = []
    for key, upload_id in within(listed, url.url(), timeout, attempts()):
        if OURS.match(key[len(start):]):
            within(lambda: client.abort_multipart_upload(Bucket=url.bucket, Key=key, UploadId=upload_id),
                   f's3://{url.bucket}/{key}', timeout, attempts())
            aborted.append(key)
    return aborted


def remote_save(cfg: Any, overwrite: bool) -> RemoteSave:
    """A ``CheckpointSaver`` writing under ``cfg.save_folder`` (an ``s3://`` URI, ``{run_name}``
    allowed) through a :class:`CheckpointUploader` whose requests wait at most the loader's
    ``download_timeout``; rank 0 first aborts the unfinished uploads a killed run left there."""
    _, bucket, path = parse_uri(cfg.save_folder)
    prefix, timeout = path.strip('/'), float(cfg.train_loader.download_timeout)
    if dist.get_global_rank() == 0:
        abort_unfinished(S3Url(bucket, format_name_with_dist(prefix, cfg.run_name)), timeout)
    remote = f'{prefix}/{FILENAME}' if prefix else FILENAME
    latest = f'{prefix}/{LATEST}' if prefix else LATEST
    scratch = tempfile.mkdtemp(prefix='fmx-ckpt-')
    uploader = CheckpointUploader(S3Url(bucket, prefix), scratch, timeout)
    saver = CheckpointSaver(folder=scratch, filename=FILENAME, remote_file_name=remote,
                            latest_filename=LATEST, latest_remote_file_name=latest,
                            save_interval=cfg.save_interval, overwrite=overwrite,
                            num_checkpoints_to_keep=cfg.save_num_checkpoints_to_keep)
    return RemoteSave(saver=saver, uploader=uploader, scratch=scratch)
