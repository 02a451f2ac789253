"""``MixedDataset``: the storage of one stage -- streaming's ``StreamingDataset`` read by index.

The order is foundrymix's own (:mod:`foundrymix.plan.order`); this dataset only turns a
sample id (streams numbered one after another in config order) into the stored row,
checked, with streaming's shard preparation (download, cache, eviction) behind it. What it
adds to streaming: damaged or missing shards and rows are named (stream, shard, row and
what to do) instead of streaming's bare errors or hangs, a remote shard that fails its
hash is removed from the cache, and the shared memory is released when a stage ends.
"""

from __future__ import annotations

import bisect
import os
from typing import Any, Iterator, Optional, Sequence

from streaming import StreamingDataset

from foundrymix.errors import FoundrymixError
from foundrymix.format.schema import CorruptRowError, check_row, decode_row
from foundrymix.loader import streaming_compat


class ShardPrepareError(FoundrymixError, ValueError):
    """streaming could not download, decompress or hash-check a shard; names stream and shard.

    Re-raised by torch in the main process as ``ShardPrepareError(worker text)``; the
    worker's traceback is dropped there, keeping the one-line message.
    """

    def __init__(self, text: str = '') -> None:
        marker = f'{type(self).__name__}: '
        if 'Original Traceback' in text and marker in text:
            text = text.rsplit(marker, 1)[1].strip()
        super().__init__(text)


class CorruptShardError(ShardPrepareError):
    """A remote stream's shard does not match the hash its ``index.json`` records.

    Names the stream, the shard, the remote file and what to do; the damaged copy is
    removed from the cache first (:meth:`MixedDataset._corrupt_shard`), so the next run
    downloads it again instead of training on it.
    """


#: how streaming 0.13 words a ``validate_hash`` mismatch (``ValueError``, ``stream.py``)
_CHECKSUM_FAILURE = 'Checksum failure: '


class MixedDataset(StreamingDataset):
    """A ``StreamingDataset`` over foundrymix streams whose samples are model inputs.

    Each sample is ``decode_row(row)`` (``input_ids``, ``labels``, ``attention_mask``,
    ``sequence_id``, ``position_ids``) plus ``stream_id`` (index into
    :attr:`stream_names`) and ``sample_id`` (the global sample index).
    """

    def __init__(self, *, stream_names: Sequence[str], vocab_size: Optional[int] = None,
                 max_seq_len: Optional[int] = None, check_shard_files: bool = True,
                 global_batch_size: Optional[int] = None, **kwargs: Any) -> None:
        from foundrymix.loader.cache import registering_prefix
        streaming_compat.warn_if_untested()
        with registering_prefix(), streaming_compat.choosing_prefix():
            super().__init__(**kwargs)
        self.global_batch_size = global_batch_size
        self.stream_names = list(stream_names)
        #: rows are checked against these (:func:`foundrymix.format.schema.check_row`); ``None`` skips
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        if len(self.stream_names) != self.num_streams:
            raise ValueError(f'{len(self.stream_names)} stream names for {self.num_streams} streams')
        if check_shard_files:
            self.check_shard_files()
        # First global sample index of streams 1..n-1: bisect gives the stream of a sample.
        self._stream_starts = [int(x) for x in self.sample_offset_per_stream[1:]]
        #: the cache directories this dataset claimed (:mod:`foundrymix.loader.cache`), if any
        self.cache_claims: Any = None

    def check_shard_files(self) -> None:
        """Raise :class:`~foundrymix.format.shards.ShardFilesError` if a stream's shard files are damaged.

        One ``stat`` per shard (:func:`foundrymix.format.shards.check_shard_files`). A stream with
        no remote must have every shard, each of the size its ``index.json`` records:
        streaming would otherwise notice a missing shard only in a background thread and
        end the epoch early without an error. For a remote stream only the shards already
        in the local cache are checked (the others are downloaded when needed).
        """
        from foundrymix.format.shards import check_shard_files, shard_files_error

        def entry(info: Any) -> Optional[dict[str, Any]]:
            # what check_shard_files reads; dataclasses.asdict deep-copied every FileInfo
            # (0.03 s of a 1,000-stream start)
            return {'basename': info.basename, 'bytes': info.bytes} if info else None

        for stream_id, stream in enumerate(self.streams):
            begin = int(self.shard_offset_per_stream[stream_id])
            end = begin + int(self.shards_per_stream[stream_id])
            index = {'shards': [{'raw_data': entry(shard.file_pairs[0][0]),
                                 'zip_data': entry(shard.file_pairs[0][1])}
                                for shard in self.shards[begin:end]]}
            directory = os.path.join(stream.local, stream.split or '').rstrip(os.sep)
            problems = check_shard_files(directory, index, allow_missing=bool(stream.remote))
            if problems:
                raise shard_files_error(self.stream_names[stream_id], directory, problems)

    def stream_of(self, sample_id: int) -> int:
        """Index of the stream a global sample index belongs to."""
        return bisect.bisect_right(self._stream_starts, sample_id)

    def get_row(self, idx: int, retry: int = 7) -> dict[str, Any]:
        """The stored row (``input_ids``, ``loss_spans``, ``doc_lens``) plus ``stream_id``, ``sample_id``.

        The row is checked (:func:`foundrymix.format.schema.check_row`: ids below ``vocab_size``,
        ``max_seq_len`` tokens, sane spans and lengths) and a bad row, or a streaming error
        while reading it (truncated shard, corrupt offsets, a shard that is gone), raises
        :class:`~foundrymix.format.schema.CorruptRowError` naming the stream, shard file, row
        within the shard and global sample id -- before the model sees the row.
        """
        try:
            row = super().get_item(idx, retry)
        except ShardPrepareError:
            raise
        except Exception as e:
            where = self.row_location(idx)
            if where is None:  # not a valid sample index: not a data problem
                raise
            shard_id = int(self.spanner[int(idx)][0])
            if self._shard_states[shard_id] != streaming_compat.shard_state().LOCAL:
                # the shard never became readable: its download or unpacking failed
                raise self._shard_error(shard_id, f'reading sample {int(idx)}') from e
            from foundrymix.loader.cache import disk_full_hint
            raise self._row_error(idx, f'cannot read the row: {type(e).__name__}: {e}'
                                       f'{disk_full_hint(str(e), where[1])}') from e
        problem = check_row(row, self.vocab_size, self.max_seq_len)
        if problem is not None:
            raise self._row_error(idx, problem)
        idx = int(idx)
        row['stream_id'] = bisect.bisect_right(self._stream_starts, idx)
        row['sample_id'] = idx
        return row

    def row_location(self, sample_id: int) -> Optional[tuple[str, str, str, int]]:
        """(stream name, stream directory, shard file, row within the shard) of a sample.

        ``None`` if ``sample_id`` is not a sample of this dataset.
        """
        try:
            shard_id, row = self.spanner[int(sample_id)]
        except (IndexError, ValueError, RuntimeError):
            return None
        stream_id = int(self.stream_per_shard[shard_id])
        stream = self.streams[stream_id]
        shard = self.shards[shard_id]
        basename = shard.file_pairs[0][0].basename
        directory = os.path.join(stream.local, stream.split or '')
        return self.stream_names[stream_id], directory.rstrip(os.sep), basename, int(row)

    def _row_error(self, sample_id: int, problem: str) -> CorruptRowError:
        location = self.row_location(sample_id)
        stream, directory, shard, row = location if location is not None else (None, None, None, None)
        return CorruptRowError(stream=stream, shard=shard, row=row, sample_id=int(sample_id),
                               problem=problem, directory=directory)

    def get_item(self, idx: int, retry: int = 7) -> dict[str, Any]:
        row = self.get_row(idx, retry)
        sample = decode_row(row)
        sample['stream_id'] = row['stream_id']
        sample['sample_id'] = row['sample_id']
        return sample

    def prepare_shard(self, shard_id: int, blocking: bool = True) -> None:
        """streaming's ``prepare_shard``, but a blocking wait on a shard that another thread is
        preparing gives up (naming the shard) once that preparation has failed.

        streaming waits ``while state == PREPARING`` with no end: when its background thread
        fails on a shard (missing, hash mismatch) the shard stays PREPARING and a row read
        that needs it waited forever (seen as a hung test). Here: if this process's thread
        failed, raise at once; otherwise give up after ``2 * download_timeout + 60`` s (a
        preparation that failed in another worker process leaves no trace here).
        """
        if not blocking:
            self._prepare_shard_once(shard_id)
            return
        from time import monotonic, sleep

        _ShardState = streaming_compat.shard_state()
        stream = self.streams[int(self.stream_per_shard[shard_id])]
        limit = 2 * float(stream.download_timeout) + 60
        while True:
            # Non-blocking: prepares the shard here if it is remote (raising on failure), and
            # returns at once if someone else is preparing it -- then we wait, with an end.
            self._prepare_shard_once(shard_id)
            deadline = monotonic() + limit
            while self._shard_states[shard_id] == _ShardState.PREPARING:
                event = getattr(self, '_event', None)
                if event is not None and event.is_set():
                    raise self._shard_error(shard_id, "streaming's shard-preparing thread failed")
                if monotonic() > deadline:
                    raise self._shard_error(shard_id, f'the shard stayed "preparing" for {limit:.0f} s '
                                                      '(its preparation failed in another worker?)')
                sleep(0.007)
            if self._shard_states[shard_id] == _ShardState.LOCAL:
                return

    def _prepare_shard_once(self, shard_id: int) -> None:
        """:meth:`_start_shard`, a shard that fails its hash raising :class:`CorruptShardError`."""
        try:
            self._start_shard(shard_id)
        except ValueError as e:
            if not self._is_remote_checksum_failure(shard_id, e):
                raise
            raise self._corrupt_shard(shard_id, str(e)) from e

    def _is_remote_checksum_failure(self, shard_id: int, error: BaseException) -> bool:
        stream = self.streams[int(self.stream_per_shard[shard_id])]
        return (isinstance(error, ValueError) and not isinstance(error, ShardPrepareError)
                and str(error).startswith(_CHECKSUM_FAILURE)
                and bool(stream.remote) and stream.remote != stream.local)

    def _corrupt_shard(self, shard_id: int, failure: str) -> CorruptShardError:
        """Remove a remote stream's shard that failed its hash from the cache; the error naming it.

        Why: streaming 0.13 checks ``validate_hash`` right after a download and leaves the
        file in place when it fails; the next run (a restart after a pre-emption) found it
        cached, never checked it again, and trained on it. Remembered per process, so
        a later read of the shard names this error (:meth:`_shard_error`).
        """
        from foundrymix.loader.cache import remove_shard_files
        stream_id = int(self.stream_per_shard[shard_id])
        stream, shard = self.streams[stream_id], self.shards[shard_id]
        raw, zip_ = shard.file_pairs[0]
        directory = os.path.join(stream.local, stream.split or '').rstrip(os.sep)
        failed = os.path.basename(failure[len(_CHECKSUM_FAILURE):].strip()) or raw.basename
        remote = os.path.join(stream.remote, stream.split or '').rstrip('/')
        removed = remove_shard_files(directory, [raw.basename] + ([zip_.basename] if zip_ else []))
        damaged = os.path.join(directory, failed)
        if damaged not in removed and not os.path.lexists(damaged):
            removed.append(damaged)  # streaming-community 0.14 deletes it itself before raising
        error = CorruptShardError(
            f"stream '{self.stream_names[stream_id]}' ({directory}), shard {raw.basename}: "
            f'{remote}/{failed} does not match the {stream.validate_hash} hash its index.json '
            f'records: the shard in the remote is damaged (or was replaced without its '
            f'index.json). Removed it from the cache ({", ".join(removed) or "nothing left"}). '
            f'Re-upload the shard: re-run `foundrymix convert` on the same inputs with '
            f'`--out {remote} --overwrite`; `foundrymix verify {remote}` checks every shard '
            f'of the remote')
        if not hasattr(self, '_corrupt'):
            self._corrupt: dict[int, CorruptShardError] = {}
        self._corrupt[shard_id] = error
        return error

    def _start_shard(self, shard_id: int) -> None:
        """streaming's non-blocking ``prepare_shard``, but with ``cache_limit`` a download in
        flight counts against the limit from its start.

        Why: streaming evicts until ``cache usage + the new shard`` fits, then downloads with
        the lock released and adds the shard to the usage only when it is complete. Two
        downloads at once (the prepare-ahead thread and the reading thread of each worker)
        both see room for one shard: the disk held ``cache_limit`` plus a shard or more
        (measured: 102 KB on disk under an 88 KB limit). Here the shard's size is reserved
        before the download and settled after, so the cache never holds more than the
        limit. If only downloads in flight fill the limit, this waits for one to finish
        (then evicts it if need be) instead of streaming's "no shards present locally to
        evict".

        The state is read and acted on under one hold of the cache lock, and every state is
        handled here, never handed to streaming's ``prepare_shard``: that re-reads the state
        under a lock of its own, and a shard evicted between the two reads (LOCAL when we
        looked, REMOTE when streaming did) was downloaded by streaming's path, unreserved.
        Under CPU load that happened a few times an epoch and the cache reached a shard over
        the limit (94,049 bytes under an 88,314-byte limit; cache_usage said so too).
        """
        if not self.cache_limit:
            super().prepare_shard(shard_id, False)
            return
        import time

        _ShardState = streaming_compat.shard_state()
        lock = self._cache_lock()
        stream = self.streams[int(self.stream_per_shard[shard_id])]
        shard = self.shards[shard_id]
        with lock:
            state = self._shard_states[shard_id]
            if state == _ShardState.PREPARING:
                return  # someone else prepares it; the blocking caller waits on the state
            if state == _ShardState.LOCAL:
                raw = os.path.join(stream.local, stream.split or '', shard.file_pairs[0][0].basename)
                if os.path.isfile(raw):
                    self._shard_access_times[shard_id] = time.time_ns()  # touch it
                    return
                need = int(shard.get_raw_size())  # only the zip is here: unpack it
            elif state == _ShardState.REMOTE:
                need = int(shard.get_max_size())  # raw and zip at once while unpacking
            else:
                raise RuntimeError(f'shard {shard_id}: invalid shard state {state}')
            self._shard_states[shard_id] = _ShardState.PREPARING  # ours now: not evicted
        while True:
            with lock:
                while self.cache_limit < self.cache_usage + need and \
                        (self._shard_states.numpy() == _ShardState.LOCAL).any():
                    self._evict_coldest_shard()
                if self.cache_limit >= self.cache_usage + need:
                    self.cache_usage += need  # reserved until the download is done
                    break
            time.sleep(0.007)  # only downloads in flight fill the cache: wait for one to finish
        try:
            delta = stream.prepare_shard(shard)
        except BaseException:
            with lock:  # the shard stays PREPARING: the waiting readers report it failed
                self.cache_usage -= need
            raise
        with lock:
            self.cache_usage += int(delta) - need
            self._shard_access_times[shard_id] = time.time_ns()
            self._shard_states[shard_id] = _ShardState.LOCAL

    def _cache_lock(self) -> Any:
        """streaming's cache filelock (download, evict and ``cache_usage`` under one lock)."""
        return streaming_compat.cache_lock(self)

    def _shard_error(self, shard_id: int, context: str) -> 'ShardPrepareError':
        """Name a shard streaming failed to prepare (retried here to get its exception)."""
        known = getattr(self, '_corrupt', {}).get(shard_id)
        if known is not None:
            return known
        stream_id = int(self.stream_per_shard[shard_id])
        stream, shard = self.streams[stream_id], self.shards[shard_id]
        directory = os.path.join(stream.local, stream.split or '').rstrip(os.sep)
        where = (f"stream '{self.stream_names[stream_id]}' ({directory}), shard "
                 f'{shard.file_pairs[0][0].basename}')
        try:
            delta = stream.prepare_shard(shard)
            if self.cache_limit and delta:
                # What the retry put in the cache counts against cache_limit like any download
                # (at worst a shard someone else also fetched is counted twice: more eviction,
                # never more disk than counted).
                with self._cache_lock():
                    self.cache_usage += int(delta)
        except Exception as e:
            if self._is_remote_checksum_failure(shard_id, e):
                return self._corrupt_shard(shard_id, str(e))
            from foundrymix.loader.cache import disk_full_hint
            return ShardPrepareError(f'{where}: streaming could not prepare the shard: '
                                     f'{type(e).__name__}: {e}{disk_full_hint(str(e), directory)}; '
                                     f'{context}')
        return ShardPrepareError(f'{where}: streaming failed to prepare the shard and it '
                                 f'succeeded on a retry (a transient error?); {context}')

    # ------------------------------------------------------------ teardown
    def release(self) -> None:
        """Close this dataset's shared memory now (and unlink what this process created).

        Why: streaming registers every shared-memory segment's cleanup with ``atexit``, so
        a dataset that is dropped keeps its segments -- and about 36 file descriptors per
        stream -- until the process exits. A staged run drops one dataset per stage, and
        a long session (a notebook, the test suite) would run out of descriptors. Call
        it only when the dataset and its DataLoader iterators are done.
        """
        import atexit

        iterator = getattr(self, '_iterator', None)
        if iterator is not None:
            iterator.exit()  # stop streaming's prepare/ready threads before their memory goes
        for shm in streaming_compat.shared_memories(self):
            atexit.unregister(shm.cleanup)
            try:
                shm.cleanup()
            except (BufferError, OSError):  # a numpy view still exports the buffer
                pass
        if self.cache_claims is not None:  # after the shared memory: the next run may take the dirs
            self.cache_claims.release()


def check_resume(obj: dict[str, Any], global_batch_size: Optional[int]) -> None:
    """Refuse a checkpointed data position made with another global batch size (a
    :class:`~foundrymix.config.ConfigError` naming both values)."""
    from foundrymix.config import ConfigError
    old_g = obj.get('global_batch_size')
    if old_g is not None and global_batch_size is not None and old_g != global_batch_size:
        raise ConfigError(
            f'global_train_batch_size: the checkpoint was trained with a global batch of '
            f'{old_g} rows, this run has {global_batch_size}; the epoch and every batch are made '
            f'of global batches, so it must stay fixed across a resize (the per-rank batch is '
            f'global_train_batch_size / ranks). Set global_train_batch_size: {old_g} to resume')
