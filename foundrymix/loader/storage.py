"""``RowStore``: the rows of one stage by sample id (streams numbered in config order), checked.
Only verified bytes are trained: a shard file is hashed against ``index.json`` when first opened
(docs/safety.md); remote and compressed shards are fetched or unpacked into the cache, never the
user's directory. Every failure names the stream, the shard (and row) and what to do."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from foundrymix.errors import WorkerError
from foundrymix.format.foundry_tokens import foundry_row
from foundrymix.format.schema import CorruptRowError, check_row, decode_row
from foundrymix.heap import collector_paused
from foundrymix.loader import cache
from foundrymix.loader.cache.hashes import CorruptLocalShardError, ShardHashes, cache_file, node_lock, write_atomic
from foundrymix.loader.cache import Source, disk_full_hint, has_file, sources_of
from foundrymix.format.streaming_format import ShardRows, decompress, get_hash
from foundrymix.s3.remote import RemoteError, download

if TYPE_CHECKING:
    from foundrymix.plan.catalog import StreamInfo
    from foundrymix.plan.config import LoaderConfig

log = logging.getLogger(__name__)


class ShardPrepareError(WorkerError):
    """A shard could not be fetched or unpacked; names stream and shard."""


class CorruptShardError(ShardPrepareError):
    """A remote stream's shard, fetched afresh, does not match the hash ``index.json`` records."""


class RowStore:
    """The rows of ``sources`` by sample id; pickles for DataLoader workers (readers and locks are
    per process)."""

    def __init__(self, sources: list[Source], config: Any, vocab_size: Optional[int] = None,
                 max_seq_len: Optional[int] = None, budget: Any = None) -> None:
        self.sources = sources
        self.vocab_size, self.max_seq_len = vocab_size, max_seq_len
        self.download_timeout = float(config.download_timeout)
        self.download_retry = max(1, int(config.download_retry))
        self.keep_zip = bool(config.keep_zip)
        self.cache_root = config.cache_root
        self.budget = budget
        rows = [sum(int(s['samples']) for s in src.shards) for src in sources]
        #: first sample id of each stream
        self.sample_offset_per_stream = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
        self.num_samples = int(sum(rows))
        #: (stream, shard within it) and first sample id of every shard
        self._where = [(k, j) for k, src in enumerate(sources) for j in range(len(src.shards))]
        counts = [int(s['samples']) for src in sources for s in src.shards]
        self._shard_start = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self.cache_claims: Any = None
        self._fresh()

    def _fresh(self) -> None:
        self._pid = os.getpid()  # a forked DataLoader worker starts afresh (locks held by a
        self._readers: dict[int, Any] = {}  # thread of the parent would never be released)
        self._opening: dict[int, threading.Lock] = {}  # one per shard: readers and prefetch
        self._failed: dict[int, BaseException] = {}  # what prefetching a shard raised
        self._hashes = ShardHashes(self.cache_root)

    def __getstate__(self) -> dict[str, Any]:
        per_process = ('_readers', '_opening', '_failed', '_hashes', 'cache_claims')
        return {k: v for k, v in self.__dict__.items() if k not in per_process}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.cache_claims = None
        self._fresh()

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, Any]:
        row = self.get_row(idx)
        sample = decode_row(row)
        sample['stream_id'], sample['sample_id'] = row['stream_id'], row['sample_id']
        return sample

    def _shard_of(self, sample_id: int) -> int:
        if not 0 <= sample_id < self.num_samples:
            raise IndexError(f'sample {sample_id} is not in 0..{self.num_samples - 1}')
        return int(np.searchsorted(self._shard_start, sample_id, 'right')) - 1

    def get_row(self, idx: int) -> dict[str, Any]:
        """The stored row plus ``stream_id``, ``sample_id``; one that cannot be read or fails
        :func:`check_row` raises :class:`CorruptRowError`."""
        idx = int(idx)
        shard = self._shard_of(idx)
        for attempt in (0, 1):
            reader = self._open(shard)
            try:
                row = reader[idx - int(self._shard_start[shard])]
                break
            except FileNotFoundError:
                self._readers.pop(shard, None)  # evicted by another process since we opened it
                if attempt:
                    raise self._shard_error(shard, 'its file vanished twice while being read')
            except Exception as e:
                hint = disk_full_hint(str(e), self.sources[self._where[shard][0]].directory)
                raise self._row_error(idx, f'cannot read the row: {type(e).__name__}: {e}{hint}') from e
        foundry = self.sources[self._where[shard][0]].foundry
        if foundry is not None:  # LLM-Foundry token rows, used in place
            try:
                row = foundry_row(row['tokens'], *foundry)
            except ValueError as e:
                raise self._row_error(idx, str(e)) from None
        problem = check_row(row, self.vocab_size, self.max_seq_len)
        if problem is not None:
            raise self._row_error(idx, problem)
        row['stream_id'] = self._where[shard][0]
        row['sample_id'] = idx
        return row

    def _row_error(self, sample_id: int, problem: str) -> CorruptRowError:
        shard = self._shard_of(sample_id)
        k, j = self._where[shard]
        src = self.sources[k]
        return CorruptRowError(stream=src.name, shard=src.shards[j]['raw_data']['basename'],
                               row=sample_id - int(self._shard_start[shard]), sample_id=sample_id,
                               problem=problem, directory=src.directory)

    def prefetch(self, sample_ids: Any) -> None:
        """Open (fetch, unpack, verify) the shards of these rows ahead of reading; a failure is
        kept for the read to raise, and stops this process's prefetching."""
        if self.budget is not None:
            return  # under cache_limit a shard fetched early may be evicted before it is read
        for shard in sorted({self._shard_of(int(i)) for i in sample_ids}):
            if self._failed:
                return
            try:
                self._open(shard)
            except Exception as e:
                self._failed[shard] = e
                return

    def _open(self, shard: int) -> Any:
        """The shard's reader, its file in place and verified (once per process)."""
        reader = self._readers.get(shard)
        if reader is not None:
            return reader
        if self._pid != os.getpid():
            self._fresh()
        with self._opening.setdefault(shard, threading.Lock()):
            failed = self._failed.pop(shard, None)  # a prefetch tried it (after we looked, too)
            if failed is not None:
                raise failed
            reader = self._readers.get(shard)
            return reader if reader is not None else self._open_now(shard)

    def _open_now(self, shard: int) -> Any:
        k, j = self._where[shard]
        src = self.sources[k]
        info = src.shards[j]
        raw = info['raw_data']['basename']
        path = os.path.join(src.directory, raw)
        fetched = self._fetch(src, j) if src.remote is not None else False
        if src.remote is None and not os.path.isfile(path):
            raise self._shard_error(shard, 'the shard file is missing')
        if not self._verified(src, info):
            if src.remote is None:
                raise CorruptLocalShardError(
                    f"stream '{src.name}' ({src.directory}): shard file {raw} does not match the "
                    f'{src.algorithm} hash its index.json records: the bytes changed after '
                    f'conversion (a damaged copy or disk); no row of it was read. Re-copy the '
                    f'stream from where it came from, or re-run `foundrymix convert` into '
                    f'{src.directory} with --overwrite; `foundrymix verify {src.directory}` '
                    f'checks every shard')
            if not fetched:  # a cached copy: damaged in the cache, or an older version
                removed = self._remove(src, info)
                log.warning(f"stream '{src.name}': cached shard file {path}: its {src.algorithm} "
                            f'hash does not match the one index.json records; removed it '
                            f'({", ".join(removed)}), it is downloaded again when needed')
                self._fetch(src, j)
            if not self._verified(src, info):
                raise _remote_damaged(src, info, self._remove(src, info))
        if self.budget is not None:
            with contextlib.suppress(OSError):
                os.utime(path)  # opened now: the last shard the budget evicts
        reader = ShardRows(info, path=path)
        self._readers[shard] = reader
        return reader

    def _verified(self, src: Source, info: dict[str, Any]) -> bool:
        raw = info['raw_data']
        expected = (raw.get('hashes') or {}).get(src.algorithm) if src.algorithm else None
        if expected is None:
            return True
        return self._hashes.check(src.directory, raw['basename'], expected, src.algorithm)

    def _remove(self, src: Source, info: dict[str, Any]) -> list[str]:
        removed = []
        for part in (info['raw_data'], info.get('zip_data')):
            if part:
                path = os.path.join(src.directory, part['basename'])
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
                    removed.append(path)
        return removed

    def _fetch(self, src: Source, j: int) -> bool:
        """Put shard ``j``'s raw file in ``src.directory`` if absent (or of another size);
        whether it fetched."""
        info = src.shards[j]
        raw = info['raw_data']
        path = os.path.join(src.directory, raw['basename'])
        if has_file(path, raw['bytes']):
            return False
        # one thread of one process of the node fetches a shard, the others wait
        with node_lock(cache_file(self.cache_root, 'locks', src.directory, f'-{j}.lock')):
            if has_file(path, raw['bytes']):
                return False  # another process of the node fetched it meanwhile
            with contextlib.suppress(FileNotFoundError):
                size = os.stat(path).st_size
                removed = self._remove(src, info)
                log.warning(f"stream '{src.name}': cached shard file {path}: {size:,} bytes, "
                            f"index.json records {int(raw['bytes']):,}; removed it "
                            f'({", ".join(removed)}), it is downloaded again when needed')
            zip_ = info.get('zip_data')
            need = int(raw['bytes']) + (int(zip_['bytes']) if zip_ else 0)
            budget = self.budget.reserved(path, need, keep=path) if self.budget else contextlib.nullcontext()
            try:
                with budget:
                    self._get(src, info)
                return True
            except ShardPrepareError:
                raise
            except Exception as e:
                raise ShardPrepareError(
                    f"stream '{src.name}' ({src.directory}), shard {raw['basename']}: could not "
                    f'fetch the shard: {type(e).__name__}: {e}{disk_full_hint(str(e), src.directory)}') from e

    def _get(self, src: Source, info: dict[str, Any]) -> None:
        os.makedirs(src.directory, exist_ok=True)
        raw, zip_ = info['raw_data'], info.get('zip_data')
        name = (zip_ or raw)['basename']
        local = os.path.join(src.directory, name)
        remote = f"{src.remote.rstrip('/')}/{name}"
        if zip_ and not src.remote.startswith('s3://') and '://' not in src.remote:
            local = os.path.join(src.remote, name)  # a mounted remote: unpack from it in place
        elif not has_file(local, (zip_ or raw)['bytes']):
            for attempt in range(self.download_retry):
                try:
                    download(remote, local, self.download_timeout)
                    break
                except RemoteError:
                    if attempt + 1 == self.download_retry:
                        raise
        if zip_:
            with open(local, 'rb') as f:
                data = f.read()
            want = (zip_.get('hashes') or {}).get(src.algorithm) if src.algorithm else None
            if want is not None and get_hash(src.algorithm, data) != want:
                removed = []
                if local.startswith(src.directory + os.sep):
                    os.remove(local)
                    removed.append(local)
                raise _remote_damaged(src, info, removed)
            write_atomic(os.path.join(src.directory, raw['basename']), decompress(info['compression'], data))
            if not self.keep_zip and local.startswith(src.directory + os.sep):
                os.remove(local)

    def _shard_error(self, shard: int, problem: str) -> ShardPrepareError:
        k, j = self._where[shard]
        src = self.sources[k]
        return ShardPrepareError(f"stream '{src.name}' ({src.directory}), shard "
                                 f"{src.shards[j]['raw_data']['basename']}: {problem}")

    def release(self) -> None:
        """Drop this process's shard readers and give the cache directories back."""
        self._readers.clear()
        if self.cache_claims is not None:
            self.cache_claims.release()
            self.cache_claims = None


def _remote_damaged(src: Source, info: dict[str, Any], removed: list[str]) -> CorruptShardError:
    """A compressed file that fails its hash: where it is damaged (the user's local stream, or
    the remote) and the fix there -- re-converting, restoring or re-uploading it."""
    remote = src.remote.rstrip('/') if src.remote else src.directory
    name = (info.get('zip_data') or info['raw_data'])['basename']
    convert = f'`foundrymix convert` on the same inputs with `--out {remote} --overwrite`'
    if src.local:
        what, done = 'local stream', ('Nothing of it was unpacked or used (the file is left as it is). Restore '
                                     f'the file from a good copy of the stream, or re-convert: re-run {convert}')
    else:
        what, done = 'remote', (f'Removed it from the cache ({", ".join(removed) or "nothing left"}). '
                                f'Re-upload the shard: re-run {convert}')
    return CorruptShardError(
        f"stream '{src.name}' ({src.directory}), shard {info['raw_data']['basename']}: {remote}/{name} "
        f'does not match the {src.algorithm} hash its index.json records: the shard in the {what} '
        f'is damaged (or was replaced without its index.json). {done}; `foundrymix verify {remote}` '
        f'checks every shard of the {what}')


@collector_paused()  # at each start and stage switch: per-stream objects (heap.py)
def build_store(config: LoaderConfig, infos: list['StreamInfo'], where: str = 'train_loader') -> 'RowStore':
    """The store of one stage's streams; claims, cleans and checks the cache directories first.
    The claims go back at :meth:`RowStore.release` or when the store is collected (a loader
    dropped unfinished or finished), never at process exit only."""
    infos, claims = cache.prepare(config, infos, where)
    manifest = infos[0].manifest
    try:
        store = RowStore(sources_of(infos, config), config, vocab_size=manifest.tokenizer.vocab_size,
                         max_seq_len=manifest.max_seq_len, budget=cache.budget_for(config, infos, where))
    except BaseException:
        claims.release()
        raise
    store.cache_claims = claims
    weakref.finalize(store, claims.release)
    return store
