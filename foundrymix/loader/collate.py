"""Collate decoded samples into a batch of ``int64`` tensors that share one storage.

Every key is a view into one ``int64`` buffer, so a worker hands a batch to the main
process through one shared-memory segment, not one per key (torch makes a segment per
storage, and a segment costs far more than decoding a row). The views behave as ordinary
tensors.

A batch of stored rows (what the loader's workers read) *pickles as the rows* -- tokens in
their stored ``uint16``/``uint32``, spans, document lengths, ids: ~1/20 of the ``int64``
batch -- and is decoded again where it is unpickled, because faulting in a fresh segment's
pages costs more than decoding twice. A batch changed after collation (a key replaced, a
tensor written in place by torch) pickles as its buffer. Writes through a value's
``.numpy()`` view bump no version counter and go unseen: a collate wrapper that edits the
batch in a worker must replace keys or use torch operations.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from foundrymix.format.schema import DECODED_KEYS, decode_rows


class Batch(dict):
    """``dict[str, Tensor]`` whose values are views into one buffer; pickles as that buffer.

    A batch collated from stored rows keeps them (``rows``) and pickles as them instead,
    while its values are untouched since (same views, buffer version unchanged).
    """

    def __init__(self, *args: Any, buffer: torch.Tensor | None = None,
                 layout: tuple | None = None, rows: tuple | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._buffer = buffer
        self._layout = layout
        self._rows = rows
        self._version = buffer._version if buffer is not None else None

    def __reduce__(self):
        if self._buffer is not None and self._layout is not None and self._intact():
            if self._rows is not None and self._buffer._version == self._version:
                return _batch_from_rows, self._rows
            return _rebuild_batch, (self._buffer, self._layout)
        return Batch, (dict(self),)

    def _intact(self) -> bool:
        """True while the values are still exactly the views this batch was built with."""
        if list(self.keys()) != [k for k, _, _ in self._layout]:
            return False
        ptr = self._buffer.data_ptr()
        for key, offset, shape in self._layout:
            v = self[key]
            if (not isinstance(v, torch.Tensor) or v.data_ptr() != ptr + 8 * offset
                    or tuple(v.shape) != shape or v.dtype != torch.int64):
                return False
        return True


def _rebuild_batch(buffer: torch.Tensor, layout: tuple) -> Batch:
    values = {}
    for key, offset, shape in layout:
        size = int(np.prod(shape, dtype=np.int64))
        values[key] = buffer[offset:offset + size].view(shape)
    return Batch(values, buffer=buffer, layout=layout)


def _new_buffer(numel: int) -> torch.Tensor:
    """An int64 buffer; in a DataLoader worker, allocated in shared memory up front.

    As torch's ``default_collate`` does: writing straight into shared memory saves the
    copy torch would otherwise make when handing the batch to the main process.
    """
    if torch.utils.data.get_worker_info() is not None:
        storage = torch.empty(0, dtype=torch.int64)._typed_storage()._new_shared(numel, device='cpu')
        return torch.empty(0, dtype=torch.int64).new(storage)
    return torch.empty(numel, dtype=torch.int64)


def _views(buffer: torch.Tensor, shapes: dict[str, tuple]) -> tuple[dict, tuple]:
    """Key -> view of ``buffer`` for consecutive blocks of ``shapes``, and their layout."""
    values, layout, offset = {}, [], 0
    for key, shape in shapes.items():
        size = int(np.prod(shape, dtype=np.int64))
        values[key] = buffer[offset:offset + size].view(shape)
        layout.append((key, offset, shape))
        offset += size
    return values, tuple(layout)


def _batch_from_rows(input_ids: np.ndarray, loss_spans: np.ndarray, span_counts: np.ndarray,
                     doc_lens: np.ndarray, doc_counts: np.ndarray, stream_id: np.ndarray,
                     sample_id: np.ndarray) -> Batch:
    """Decode a batch of stored rows (stacked tokens, concatenated spans/lengths) into a :class:`Batch`."""
    n, seq_len = input_ids.shape
    block = 5 * n * seq_len
    buffer = torch.empty(block + 2 * n, dtype=torch.int64)
    flat = buffer.numpy()
    decode_rows(input_ids, loss_spans, span_counts, doc_lens, doc_counts,
                out=flat[:block].reshape(5, n, seq_len))
    flat[block:block + n] = stream_id
    flat[block + n:] = sample_id
    shapes = {key: (n, seq_len) for key in DECODED_KEYS}
    shapes.update(stream_id=(n,), sample_id=(n,))
    values, layout = _views(buffer, shapes)
    rows = (input_ids, loss_spans, span_counts, doc_lens, doc_counts, stream_id, sample_id)
    return Batch(values, buffer=buffer, layout=layout, rows=rows)


def _collate_rows(samples: Sequence[dict[str, Any]]) -> Batch:
    """Stored rows -> compact batch arrays -> :func:`_batch_from_rows`."""
    spans = [s['loss_spans'] for s in samples]
    docs = [s['doc_lens'] for s in samples]
    return _batch_from_rows(
        np.stack([s['input_ids'] for s in samples]),
        np.concatenate(spans).astype(np.int32, copy=False).reshape(-1),
        np.fromiter(map(np.size, spans), dtype=np.int64, count=len(spans)),
        np.concatenate(docs).astype(np.int32, copy=False).reshape(-1),
        np.fromiter(map(np.size, docs), dtype=np.int64, count=len(docs)),
        np.fromiter((s['stream_id'] for s in samples), dtype=np.int64, count=len(samples)),
        np.fromiter((s['sample_id'] for s in samples), dtype=np.int64, count=len(samples)))


def collate(samples: Sequence[dict[str, Any]]) -> Batch:
    """Batch samples into ``int64`` tensors (batch dimension first) sharing one buffer.

    ``samples`` are either stored rows with ids (``input_ids``, ``loss_spans``,
    ``doc_lens``, ``stream_id``, ``sample_id``: what ``MixedDataset`` yields under
    ``build_dataloader``), decoded here for the whole batch at once, or already decoded
    samples (``ds[i]``), stacked. Either way the batch has the keys of a decoded sample:
    ``input_ids``, ``labels``, ``attention_mask``, ``sequence_id``, ``position_ids``,
    ``stream_id``, ``sample_id`` -- bitwise the same for both.
    """
    if not samples:
        raise ValueError('cannot collate an empty batch')
    if 'loss_spans' in samples[0]:
        return _collate_rows(samples)
    n = len(samples)
    shapes = {key: (n,) + tuple(np.shape(value)) for key, value in samples[0].items()}
    buffer = _new_buffer(sum(int(np.prod(shape, dtype=np.int64)) for shape in shapes.values()))
    values, layout = _views(buffer, shapes)
    for key, shape in shapes.items():
        out = values[key].numpy()
        if len(shape) > 1:
            np.stack([s[key] for s in samples], out=out, casting='unsafe')
        else:
            out[:] = [s[key] for s in samples]
    return Batch(values, buffer=buffer, layout=layout)
