"""Autoresume from a remote ``save_folder`` (``s3://...``): the latest checkpoint named in the bucket.

Why not Composer's own autoresume for remote folders: for a monolithic checkpoint Composer
(0.32.1) first looks for a *local* file ``<cwd>/<save_folder>/latest-rank0.pt`` -- for
``s3://b/run/ckpts`` literally ``./s3:/b/run/ckpts/latest-rank0.pt``, the place where its
previous autoresume downloaded the checkpoint -- and downloads from the bucket only when that
file is missing. A job restarted in the same working directory would therefore resume from
the checkpoint an *earlier* job resumed from, not the latest one in the bucket: it repeats
batches and then fails to upload a checkpoint name that already exists. The bucket is the
truth: Composer uploads ``latest-rank0.pt.symlink`` (a small object holding the key of the
newest checkpoint) after each checkpoint's upload is confirmed; this module reads it, as
Composer itself does for sharded checkpoints, and the run loads that URI (``load_path``).
"""

from __future__ import annotations

import os
import tempfile
from typing import Optional

from foundrymix.errors import UserError

LATEST = 'latest-rank0.pt.symlink'  # Composer's save_latest_filename for rank 0, plus '.symlink'


def is_remote(path: Optional[str]) -> bool:
    return bool(path) and '://' in str(path)


def latest_checkpoint(save_folder: str) -> Optional[str]:
    """URI of the newest checkpoint in the remote ``save_folder``, or None when it holds none.

    Every rank reads the (tiny) object itself: the trainer has not initialised the process
    group yet, and a monolithic checkpoint is the whole state on every rank anyway.
    """
    from composer.utils import maybe_create_object_store_from_uri, parse_uri

    store = maybe_create_object_store_from_uri(save_folder)
    if store is None:
        raise UserError(f'save_folder {save_folder!r}: not an object store URI Composer can write to')
    _, _, prefix = parse_uri(save_folder)
    key = f"{prefix.strip('/')}/{LATEST}" if prefix.strip('/') else LATEST
    with tempfile.TemporaryDirectory(prefix='fmx-autoresume-') as tmp:
        local = os.path.join(tmp, LATEST)
        try:
            store.download_object(key, local)
        except FileNotFoundError:
            return None
        except Exception as e:  # credentials, endpoint, permissions: say where and what
            raise UserError(f'autoresume: cannot read {store.get_uri(key)}: {type(e).__name__}: {e}. '
                               f'Check the credentials and S3_ENDPOINT_URL, and that save_folder '
                               f'{save_folder!r} is right') from e
        with open(local, encoding='utf-8') as f:
            target = f.read().strip()
    if not target:
        raise UserError(f'autoresume: {store.get_uri(key)} is empty (it should name the latest checkpoint)')
    return store.get_uri(target)


#: seconds between checks that a checkpoint's upload is complete (Composer's default: 30)
UPLOAD_POLL_S = 2.0


def poll_uploads_sooner(trainer) -> None:
    """Make Composer check every :data:`UPLOAD_POLL_S` s (not 30 s) that a checkpoint's upload
    is complete before it uploads ``latest-rank0.pt.symlink`` pointing at it.

    Why: the symlink is what autoresume reads; with a 30 s poll, a job killed up to 30 s after
    a checkpoint was uploaded resumes from the checkpoint before it, and every job's end waits
    up to 30 s for the last poll. A HEAD request every 2 s costs nothing. The setting is a
    private attribute of Composer 0.32's ``CheckpointSaver``; if it is gone, nothing changes.
    """
    saver = getattr(trainer, '_checkpoint_saver', None)
    if saver is not None and hasattr(saver, '_symlink_upload_wait_before_next_try_in_seconds'):
        saver._symlink_upload_wait_before_next_try_in_seconds = UPLOAD_POLL_S
