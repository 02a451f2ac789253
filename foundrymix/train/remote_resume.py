"""Autoresume: the newest *complete* checkpoint of a local ``save_folder``; for a remote one
(``s3://...``) the latest checkpoint named in the bucket.

Local: Composer (0.32.1) writes ``ep{e}-ba{b}-rank0.pt`` in place with ``torch.save`` (no
temporary name, no fsync) and then points ``latest-rank0.pt`` at it, and its autoresume loads
whatever ``latest-rank0.pt`` points at. A job killed (pre-empted) while writing leaves a
truncated file: as the symlink's target autoresume died with ``PytorchStreamReader failed
reading zip archive: failed finding central directory``; as a newer file beside it, Composer's
start-of-fit check refused the folder ("may conflict with a future checkpoint").
:func:`local_checkpoint` checks each checkpoint's zip central directory (truncation removes it;
reading it costs a few KB whatever the checkpoint's size), newest batch first, and the run
loads the newest complete one; the incomplete newer ones are left where they are and named
in one line, and the run rewrites them as it passes their batches.

Remote:

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
A checkpoint in the bucket is whole or absent (an object appears only when its PUT or
multipart upload completes) and the symlink is uploaded after it: no completeness check there.
"""

from __future__ import annotations

import os
import re
import tempfile
import zipfile
from dataclasses import dataclass, field
from typing import Optional

from foundrymix.errors import UserError

LATEST = 'latest-rank0.pt.symlink'  # Composer's save_latest_filename for rank 0, plus '.symlink'


#: Composer's default ``save_filename`` for rank 0 (the one a monolithic checkpoint is)
CHECKPOINT = re.compile(r'^ep(\d+)-ba(\d+)-rank0\.pt$')
LOCAL_LATEST = 'latest-rank0.pt'  # Composer's save_latest_filename for rank 0


def incomplete(path: str) -> Optional[str]:
    """Why the checkpoint at ``path`` cannot be loaded (truncated, unreadable), or None when it
    is a whole ``torch.save`` zip archive."""
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        return f'{type(e).__name__}: {e}'
    if not any(n.endswith('/data.pkl') for n in names):
        return 'no data.pkl in its zip archive'
    return None


@dataclass
class LocalResume:
    """What autoresume found in a local ``save_folder``."""

    path: str                  # the newest complete checkpoint
    #: newer checkpoints that are incomplete, with why (left in place; the run rewrites them)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    is_latest: bool = True     # ``path`` is what ``latest-rank0.pt`` points at

    def line(self) -> str:
        """The one line a run that skipped files prints."""
        why = '; '.join(f'{os.path.basename(p)} is incomplete ({reason})' for p, reason in self.skipped)
        return (f'autoresume: {why} -- a job killed while writing it; left in place, resuming from '
                f'the newest complete checkpoint {self.path}')


def local_checkpoint(folder: str) -> Optional[LocalResume]:
    """The newest complete checkpoint in the local ``folder`` (newest batch first), or None
    when the folder holds no checkpoint (a fresh start).

    Refused (naming the files) when every checkpoint there is incomplete: starting over
    silently would overwrite them.
    """
    found: list[tuple[int, str]] = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        m = CHECKPOINT.match(name)
        if m:
            found.append((int(m[2]), os.path.join(folder, name)))
    latest = os.path.join(folder, LOCAL_LATEST)
    target = os.path.realpath(latest) if os.path.exists(latest) else None
    if target is not None and all(os.path.realpath(p) != target for _, p in found):
        found.append((-1, target))  # a latest-rank0.pt that is not Composer's name: after the named ones
    if not found:
        return None
    skipped: list[tuple[str, str]] = []
    for _, path in sorted(found, reverse=True):
        reason = incomplete(path)
        if reason is None:
            return LocalResume(path=path, skipped=skipped, is_latest=os.path.realpath(path) == target)
        skipped.append((path, reason))
    names = ', '.join(os.path.basename(p) for p, _ in skipped)
    raise UserError(f'autoresume: no complete checkpoint in {folder}: {names} incomplete ({skipped[0][1]}; '
                    f'a job killed while writing). Set autoresume=false save_overwrite=true to start the '
                    f'run over in this folder (it rewrites them), or give the run another save_folder')


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
