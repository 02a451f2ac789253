"""Autoresume: the newest *complete* checkpoint of a local or a remote (``s3://...``) ``save_folder``.

Why: Composer's autoresume loads a truncated file a killed job left, and on S3 a stale local copy
(it uploads ``latest-rank0.pt.symlink`` late or not at all). So the checkpoint files (objects) are the
truth: the newest batch whose zip central directory is whole (on S3 a few ranged GETs read it) is
resumed, and newer incomplete ones are named and left for the run to rewrite. On S3 rank 0 decides
for every rank (:func:`agreed`).
"""

from __future__ import annotations

import io
import os
import re
import tempfile
import zipfile
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from foundrymix.errors import UserError
from foundrymix.s3.remote import RemoteError, attempts, classify, within
from foundrymix.s3.retries import watch

LATEST = 'latest-rank0.pt.symlink'  # Composer's save_latest_filename for rank 0, plus '.symlink'


#: Composer's default ``save_filename`` for rank 0 (the one a monolithic checkpoint is)
CHECKPOINT = re.compile(r'^ep(\d+)-ba(\d+)-rank0\.pt$')
LOCAL_LATEST = 'latest-rank0.pt'  # Composer's save_latest_filename for rank 0


@dataclass
class Found:
    """What autoresume found in a ``save_folder``: the newest complete checkpoint (a local path or a
    URI) and the newer incomplete ones, with why (left in place; the run rewrites them)."""

    path: str
    skipped: list[tuple[str, str]] = field(default_factory=list)
    is_latest: bool = True     # ``path`` is what ``latest-rank0.pt`` points at

    def line(self) -> str:
        """The one line a run that skipped files prints."""
        why = '; '.join(f'{_shown(p)} is incomplete ({reason})' for p, reason in self.skipped)
        if is_remote(self.path):
            return (f'autoresume: {why} -- not a whole checkpoint; left in place, resuming from the newest '
                    f'complete checkpoint {self.path} (the run rewrites it)')
        return (f'autoresume: {why} -- a job killed while writing it; left in place, resuming from '
                f'the newest complete checkpoint {self.path}')


def _shown(path: str) -> str:
    """A checkpoint as messages name it: a local one by its file name, a remote one by its URI."""
    return path if is_remote(path) else os.path.basename(path)


def _newest_complete(found: list[tuple[int, str]], check: Callable[[str], Optional[str]],
                     folder: str) -> tuple[Optional[str], list[tuple[str, str]]]:
    """(the newest of ``found`` (batch, name) that ``check`` passes or None when ``found`` is empty,
    the newer ones that it does not, with why). Refused (naming them) when none passes: starting
    over silently would overwrite them."""
    skipped: list[tuple[str, str]] = []
    for _, name in sorted(found, reverse=True):
        reason = check(name)
        if reason is None:
            return name, skipped
        skipped.append((name, reason))
    if not skipped:
        return None, skipped
    names = ', '.join(_shown(p) for p, _ in skipped)
    killed = '' if is_remote(folder) else '; a job killed while writing'
    raise UserError(f'autoresume: no complete checkpoint in {folder}: {names} incomplete ({skipped[0][1]}{killed}). '
                    f'Set autoresume=false save_overwrite=true to start the run over in this folder (it '
                    f'rewrites them), or give the run another save_folder')


def local_checkpoint(folder: str) -> Optional[Found]:
    """The newest complete checkpoint in the local ``folder``, or None when it holds none."""
    found: list[tuple[int, str]] = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        m = CHECKPOINT.match(name)
        if m:
            found.append((int(m[2]), os.path.join(folder, name)))
    latest = os.path.join(folder, LOCAL_LATEST)
    target = os.path.realpath(latest) if os.path.exists(latest) else None
    if target is not None and all(os.path.realpath(p) != target for _, p in found):
        found.append((-1, target))  # a latest-rank0.pt that is not Composer's name: after the named ones
    path, skipped = _newest_complete(found, incomplete, folder)
    return None if path is None else Found(path, skipped, is_latest=os.path.realpath(path) == target)


def sharded(cfg: Any) -> bool:
    """A run whose FSDP checkpoints are sharded (one file per rank)."""
    return cfg.fsdp is not None and cfg.fsdp.state_dict_type == 'sharded'


def resume_kwargs(cfg: Any, device: str) -> dict[str, Any]:
    """Composer's ``autoresume``/``load_path``/``save_overwrite``, with the newest complete
    checkpoint found here where Composer's own choice could be incomplete."""
    from composer.utils import dist, format_name_with_dist
    if cfg.autoresume and cfg.save_folder:
        folder = format_name_with_dist(cfg.save_folder, cfg.run_name)
        remote, timeout = is_remote(folder), float(cfg.train_loader.download_timeout)
        if remote and sharded(cfg):
            latest = agreed(lambda: latest_checkpoint(folder, timeout), device)
            return {'autoresume': False, 'load_path': latest or cfg.load_path}
        found = agreed(lambda: remote_checkpoint(folder, timeout), device) if remote else local_checkpoint(folder)
        if found is None and not sharded(cfg):  # (LocalSave's folder: Composer's autoresume wants a remote name)
            return {'autoresume': False, 'load_path': cfg.load_path}
        if found is not None and (found.skipped or not found.is_latest or not sharded(cfg)):
            # Loaded here, all of it, as Composer's autoresume does; overwriting lets Composer's
            # start-of-fit check pass the newer, incomplete files and the run rewrite them.
            if found.skipped and dist.get_global_rank() == 0:
                print(found.line(), flush=True)
            # named as Composer's autoresume names it
            named = found.is_latest and not found.skipped and not remote
            return {'autoresume': False, 'load_path': os.path.join(folder, LOCAL_LATEST) if named else found.path,
                    'load_weights_only': False, 'save_overwrite': cfg.save_overwrite or bool(found.skipped)}
    return {'autoresume': cfg.autoresume,
            'load_path': None if cfg.autoresume and not cfg.load_path else cfg.load_path}


def is_remote(path: Optional[str]) -> bool:
    return bool(path) and '://' in str(path)


class _RangedObject(io.RawIOBase):
    """A read-only, seekable view of one S3 object: each read is one ranged GET."""

    def __init__(self, client: Any, bucket: str, key: str, size: int, timeout: float) -> None:
        self.client, self.bucket, self.key, self.size, self.pos = client, bucket, key, size, 0
        self.timeout = timeout

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = max(0, {0: 0, 1: self.pos, 2: self.size}[whence] + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        if self.pos >= self.size or not len(buffer):
            return 0
        end = min(self.size, self.pos + len(buffer)) - 1
        data = within(lambda: self.client.get_object(Bucket=self.bucket, Key=self.key,
                                                     Range=f'bytes={self.pos}-{end}')['Body'].read(),
                      f's3://{self.bucket}/{self.key}', self.timeout, attempts())
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


def incomplete(source: Any, size: Optional[int] = None) -> Optional[str]:
    """Why the checkpoint ``source`` (a path, or a seekable file of ``size`` bytes) cannot be loaded
    (truncated, unreadable), or None when it is a whole ``torch.save`` zip archive."""
    try:
        with zipfile.ZipFile(source) as z:
            infos = z.infolist()
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        return f'{type(e).__name__}: {e}'
    if not any(i.filename.endswith('/data.pkl') for i in infos):
        return 'no data.pkl in its zip archive'
    if size is not None and any(i.header_offset + i.compress_size > size for i in infos):
        return 'its zip archive names data past the end of the object'
    return None


def _listed(store: Any, prefix: str) -> dict[str, int]:
    """``{key: size}`` of the objects directly under ``prefix`` (size -1 where the store does not say)."""
    from composer.utils.object_store import S3ObjectStore
    if isinstance(store, S3ObjectStore):
        pages = store.client.get_paginator('list_objects_v2').paginate(Bucket=store.bucket, Prefix=prefix)
        return {o['Key']: int(o['Size']) for page in pages for o in page.get('Contents', [])}
    return {key: -1 for key in store.list_objects(prefix)}


def _object_store(save_folder: str, timeout: float) -> tuple[Any, str]:
    """Composer's object store for the remote ``save_folder`` and the key prefix of its objects
    (``''`` or ending in ``/``); refused when Composer cannot write there. On S3 its client
    makes one attempt per call, waiting at most ``timeout`` s (:func:`foundrymix.s3.remote.within` retries)."""
    from composer.utils import maybe_create_object_store_from_uri, parse_uri
    from composer.utils.object_store import S3ObjectStore

    backend, bucket, _ = parse_uri(save_folder)
    if backend == 's3':
        store = S3ObjectStore(bucket, client_config={
            'retries': {'mode': 'standard', 'total_max_attempts': 1},
            'connect_timeout': timeout, 'read_timeout': timeout})
        watch(store.client)
    else:
        store = maybe_create_object_store_from_uri(save_folder)
    if store is None:
        raise UserError(f'save_folder {save_folder!r}: not an object store URI Composer can write to')
    path = parse_uri(save_folder)[2].strip('/')
    return store, f'{path}/' if path else ''


def remote_checkpoint(save_folder: str, timeout: float = 60) -> Optional[Found]:
    """The newest complete checkpoint under the remote ``save_folder``, or None when it holds none
    (refused as :func:`local_checkpoint` refuses). Read errors name the URL and S3's error code;
    each request is retried within ``timeout`` s (download_timeout) as the reads are, so a store
    that never answers is named after it.
    """
    from composer.utils.object_store import S3ObjectStore

    store, prefix = _object_store(save_folder, timeout)
    found, objects = [], {}  # (batch, URI); URI -> (key, size)

    def check(uri: str) -> Optional[str]:
        if not isinstance(store, S3ObjectStore):
            return None
        key, size = objects[uri]
        raw = _RangedObject(store.client, store.bucket, key, size, timeout)
        return incomplete(io.BufferedReader(raw, buffer_size=1 << 16), size)

    try:
        for key, size in within(lambda: _listed(store, prefix), save_folder, timeout, attempts()).items():
            if m := CHECKPOINT.match(key[len(prefix):]):
                found.append((int(m[2]), store.get_uri(key)))
                objects[store.get_uri(key)] = (key, size)
        uri, skipped = _newest_complete(found, check, save_folder)
    except Exception as e:  # credentials, endpoint, permissions: say where and what
        if isinstance(e, UserError):
            raise
        raise UserError(f'autoresume: cannot read the checkpoints in {save_folder}: {classify(e, save_folder).text} '
                        f'(check the credentials and S3_ENDPOINT_URL, and that save_folder is right)') from None
    return None if uri is None else Found(uri, skipped)


def agreed(find: Callable[[], Any], device: str) -> Any:
    """``find()`` as rank 0 computed it, on every rank (its error raised on every rank).

    Why: ranks reading the bucket at different moments could see different newest checkpoints
    (a dead job's last upload landing). Starts the process group, which the trainer reuses.
    """
    from composer.utils import dist
    if dist.get_world_size() == 1:
        return find()
    dist.initialize_dist(device)
    box: list[Any] = [None]
    if dist.get_global_rank() == 0:
        try:
            box = [('value', find())]
        except UserError as e:
            box = [('error', str(e))]
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == 'error':
        raise UserError(value)
    return value


def latest_checkpoint(save_folder: str, timeout: float = 60) -> Optional[str]:
    """URI of the checkpoint the remote ``save_folder``'s ``latest-rank0.pt.symlink`` names, or
    None when there is none (sharded checkpoints: Composer uploads that symlink only after every
    rank's shard is in the bucket).
    """
    store, prefix = _object_store(save_folder, timeout)
    key = prefix + LATEST
    with tempfile.TemporaryDirectory(prefix='fmx-autoresume-') as tmp:
        local = os.path.join(tmp, LATEST)
        try:
            within(lambda: store.download_object(key, local, overwrite=True), store.get_uri(key), timeout,
                   attempts())
        except RemoteError as e:
            if e.kind == 'not_found':
                return None
            raise UserError(f'autoresume: cannot read {e} (and that save_folder {save_folder!r} is right)') from None
        with open(local, encoding='utf-8') as f:
            target = f.read().strip()
    if not target:
        raise UserError(f'autoresume: {store.get_uri(key)} is empty (it should name the latest checkpoint)')
    return store.get_uri(target)
