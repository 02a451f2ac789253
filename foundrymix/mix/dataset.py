"""``MixedDataset``: streaming's ``StreamingDataset`` that decodes rows and fixes epoch-end resumption.

Why a subclass and not a wrapper: shuffling, per-epoch sampling, partitioning over
ranks/workers and mid-epoch resumption all live in ``StreamingDataset``; we only change
what one sample looks like (:func:`foundrymix.schema.decode_row` plus where it came
from) and how ``state_dict`` names a finished epoch.

The resumption fix. Composer 0.32.1 checkpoints with
``dataset.state_dict(num_samples=timestamp.sample_in_epoch, from_beginning=True)``. At
an epoch boundary ``sample_in_epoch`` is already 0 while streaming's ``next_epoch - 1``
still names the finished epoch ``e``, so the saved state is ``{epoch: e,
sample_in_epoch: 0}`` and a resumed run replays epoch ``e``. Here a finished epoch is
recognised two ways and saved as ``{epoch: e + 1, sample_in_epoch: 0}``:

1. the sample count handed to ``state_dict`` reaches the epoch's global size;
2. :meth:`MixedDataset.mark_epoch_complete` was called (the trainer does so on
   Composer's ``EPOCH_END``; plain-PyTorch users after exhausting an epoch).

The mark remembers *which* epoch was completed. ``next_epoch`` lives in shared memory
and is advanced by the DataLoader worker that starts the next epoch, so as soon as the
next epoch's iteration begins the mark no longer names the current epoch and is void.
"""

from __future__ import annotations

import bisect
from typing import Any, Iterator, Optional, Sequence

from streaming import StreamingDataset

from foundrymix.schema import decode_row


class _RowIndex(int):
    """A sample index that asks :meth:`MixedDataset.get_item` for the stored row, undecoded."""

    __slots__ = ()


class MixedDataset(StreamingDataset):
    """A ``StreamingDataset`` over foundrymix streams whose samples are model inputs.

    Each sample is ``decode_row(row)`` (``input_ids``, ``labels``, ``attention_mask``,
    ``sequence_id``, ``position_ids``) plus ``stream_id`` (index into
    :attr:`stream_names`) and ``sample_id`` (the global sample index).

    With :attr:`yield_rows` set (``StreamMixer.build_dataloader`` sets it), *iterating*
    yields :meth:`get_row` samples instead -- the stored row, undecoded -- and
    :func:`foundrymix.mix.collate.collate` decodes the whole batch at once, straight into
    the batch buffer (a few numpy calls per batch instead of a few dozen per sample).
    Indexing (``ds[i]``) always decodes. How: streaming's ``__iter__`` maps
    ``__getitem__`` over the ids from ``_each_sample_id``; those ids come back marked, and
    ``get_item`` skips decoding for marked ids. If a streaming version stops passing them
    through, samples arrive decoded, which ``collate`` also accepts (only slower).
    """

    def __init__(self, *, stream_names: Sequence[str], global_batch_size: Optional[int] = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.global_batch_size = global_batch_size
        self.stream_names = list(stream_names)
        if len(self.stream_names) != self.num_streams:
            raise ValueError(f'{len(self.stream_names)} stream names for {self.num_streams} streams')
        # First global sample index of streams 1..n-1: bisect gives the stream of a sample.
        self._stream_starts = [int(x) for x in self.sample_offset_per_stream[1:]]
        self._completed_epoch: Optional[int] = None
        self.yield_rows = False

    def stream_of(self, sample_id: int) -> int:
        """Index of the stream a global sample index belongs to."""
        return bisect.bisect_right(self._stream_starts, sample_id)

    def get_row(self, idx: int, retry: int = 7) -> dict[str, Any]:
        """The stored row (``input_ids``, ``loss_spans``, ``doc_lens``) plus ``stream_id``, ``sample_id``."""
        row = super().get_item(idx, retry)
        idx = int(idx)
        row['stream_id'] = bisect.bisect_right(self._stream_starts, idx)
        row['sample_id'] = idx
        return row

    def get_item(self, idx: int, retry: int = 7) -> dict[str, Any]:
        row = self.get_row(idx, retry)
        if type(idx) is _RowIndex:
            return row
        sample = decode_row(row)
        sample['stream_id'] = row['stream_id']
        sample['sample_id'] = row['sample_id']
        return sample

    def _each_sample_id(self, it: Any) -> Iterator[int]:
        ids = super()._each_sample_id(it)
        return map(_RowIndex, ids) if self.yield_rows else ids

    # ------------------------------------------------------------ resumption
    def _current_epoch(self) -> int:
        """The epoch ``state_dict`` would name (the last one started, or a loaded one)."""
        epoch, _ = self._resume(self._parallel_rank_world, self.next_epoch - 1)
        return epoch

    def mark_epoch_complete(self) -> None:
        """Record that the current epoch was fully consumed (call in the main process).

        Until the next epoch's iteration begins, ``state_dict`` then names the start of
        the next epoch instead of the (already finished) current one.
        """
        self._completed_epoch = self._current_epoch()

    def state_dict(self, num_samples: int, from_beginning: bool) -> dict[str, Any]:
        state = super().state_dict(num_samples, from_beginning)
        finished = state['sample_in_epoch'] >= self.epoch_size or (
            self._completed_epoch is not None and self._completed_epoch == state['epoch'])
        if finished:
            state['epoch'] += 1
            state['sample_in_epoch'] = 0
        state['global_batch_size'] = self.global_batch_size
        return state

    def load_state_dict(self, obj: dict[str, Any]) -> None:
        """Resume at a checkpoint's position, refusing what would change the sample order.

        Streaming would silently adopt the checkpoint's ``num_canonical_nodes``, so the run
        would no longer follow its plan; a different global batch changes the exact epoch
        and where every batch starts. Both must stay fixed across a resize.
        """
        check_resume(obj, self.num_canonical_nodes, self.global_batch_size)
        super().load_state_dict(obj)


def check_resume(obj: dict[str, Any], num_canonical_nodes: int,
                 global_batch_size: Optional[int]) -> None:
    """Refuse a checkpointed data position made with another ``num_canonical_nodes`` or
    global batch size (a :class:`~foundrymix.config.ConfigError` naming both values)."""
    from foundrymix.config import ConfigError
    old = obj.get('num_canonical_nodes')
    if old is not None and old != num_canonical_nodes:
        raise ConfigError(
            f'train_loader.num_canonical_nodes: the checkpoint was trained with {old}, this run '
            f'has {num_canonical_nodes}; it fixes the global sample order, so resuming would '
            f'lose or repeat rows. Set train_loader.num_canonical_nodes: {old} to resume')
    old_g = obj.get('global_batch_size')
    if old_g is not None and global_batch_size is not None and old_g != global_batch_size:
        raise ConfigError(
            f'global_train_batch_size: the checkpoint was trained with a global batch of '
            f'{old_g} rows, this run has {global_batch_size}; the epoch and every batch are made '
            f'of global batches, so it must stay fixed across a resize (the per-rank batch is '
            f'global_train_batch_size / ranks). Set global_train_batch_size: {old_g} to resume')
