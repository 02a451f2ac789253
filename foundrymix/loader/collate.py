"""Collate samples into a batch of ``int64`` tensors, all views of one buffer: a worker hands it
over in one shared-memory segment, not one per key. A batch of stored rows pickles as the compact
rows and is decoded again where unpickled (cheaper than faulting in a segment's pages).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from foundrymix.format.schema import DECODED_KEYS, decode_rows


class Batch(dict):
    """``dict[str, Tensor]`` of views into one buffer. While the views are intact it pickles as its
    ``rows`` (buffer unwritten: a write through ``.numpy()`` goes unseen, so a worker that edits a
    batch must replace keys or use torch) or as its buffer; else as a dict."""

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

    def __copy__(self) -> 'Batch':  # what pin_memory does: copy, then pin the values (no decode)
        return Batch(self)

    def _intact(self) -> bool:
        """True while the values are still exactly the views this batch was built with."""
        ptr = self._buffer.data_ptr()
        return list(self.keys()) == [k for k, _, _ in self._layout] and all(
            isinstance(v := self[key], torch.Tensor) and v.data_ptr() == ptr + 8 * offset
            and tuple(v.shape) == shape and v.dtype == torch.int64 for key, offset, shape in self._layout)


def _rebuild_batch(buffer: torch.Tensor, layout: tuple) -> Batch:
    values, layout = _views(buffer, {key: shape for key, _, shape in layout})
    return Batch(values, buffer=buffer, layout=layout)


def _new_buffer(numel: int) -> torch.Tensor:
    """An int64 buffer; in a DataLoader worker, in shared memory up front (as ``default_collate``:
    no copy when the batch is handed to the main process)."""
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


def collate(samples: Sequence[dict[str, Any]]) -> Batch:
    """Batch samples (batch dimension first): stored rows with ids (``get_row``), decoded here
    for the whole batch, or decoded samples (``store[i]``), stacked -- bitwise the same batch."""
    if not samples:
        raise ValueError('cannot collate an empty batch')
    if 'loss_spans' in samples[0]:
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
