"""A span of global batches ``[first, end)`` of one stage: this rank's rows of each, read by index
in DataLoader workers. The order maps any batch to its rows (no sampler state), so resuming is
starting a span there; a span ends where the order is not yet known (an adaptive segment) or an
iteration ends. Worker ``w`` of ``W`` reads batches ``first + w, first + w + W, ...``, in turn."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from foundrymix.format import streaming_format
from foundrymix.loader.collate import collate

#: a worker's next batches whose shards are opened (fetched side by side) ahead of reading
PREFETCH_BATCHES = 8
PREFETCH_THREADS = 4

#: (global batch index within the stage) -> (stream index, row) of each of its rows
BatchRows = Callable[[int], tuple[np.ndarray, np.ndarray]]


class Span(IterableDataset):
    """Rank ``rank``'s ``batch_size`` rows of each batch, read from ``storage`` by sample id and
    collated. A (stream, row) becomes an id by the store's own numbering, the one it reads by."""

    def __init__(self, storage: Any, batch_rows: BatchRows, first: int, end: int, rank: int,
                 batch_size: int) -> None:
        self.storage = storage
        self.batch_rows = batch_rows
        self.first, self.end = first, end
        self.rank, self.batch_size = rank, batch_size
        self.offsets = np.asarray(storage.sample_offset_per_stream, np.int64)

    def sample_ids(self, b: int) -> np.ndarray:
        """This rank's sample ids of stage batch ``b``."""
        streams, rows = self.batch_rows(b)
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        return self.offsets[streams[mine]] + rows[mine]

    def __iter__(self) -> Iterator[Any]:
        """This worker's batches, the shards of the next ones opened in threads meanwhile."""
        info = get_worker_info()
        w, W = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = range(self.first + w, self.end, W)
        ahead = ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix='foundrymix-prefetch')
        try:
            for k in range(min(PREFETCH_BATCHES, len(mine))):
                ahead.submit(self.storage.prefetch, self.sample_ids(mine[k]))
            for k, b in enumerate(mine):
                if k + PREFETCH_BATCHES < len(mine):
                    ahead.submit(self.storage.prefetch, self.sample_ids(mine[k + PREFETCH_BATCHES]))
                yield collate([self.storage.get_row(int(i)) for i in self.sample_ids(b)])
        finally:
            ahead.shutdown(wait=True, cancel_futures=True)  # nothing runs on after the reader

    def __len__(self) -> int:
        return max(0, self.end - self.first)


def _as_is(batch: Any) -> Any:
    return batch


def span_loader(span: Span, num_workers: int, pin_memory: Optional[bool] = None, timeout: float = 0,
                prefetch_factor: Optional[int] = None) -> DataLoader:
    """A DataLoader over a span: collated batches in order; never more workers than batches,
    forked after streaming's format modules are imported here (else each imports streaming)."""
    workers = min(num_workers, len(span))
    extra = {'prefetch_factor': prefetch_factor} if workers > 0 and prefetch_factor is not None else {}
    if workers > 0:
        streaming_format.load()
    return DataLoader(span, batch_size=None, collate_fn=_as_is, num_workers=workers, timeout=timeout if workers else 0,
                      pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory, **extra)
