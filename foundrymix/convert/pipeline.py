"""Run chunk encoders in worker processes and bring their results back in input order.

Why this shape: tokenization dominates conversion time, so workers read, parse and
tokenize whole chunks themselves and return compact numpy arrays; the main process
only cuts rows and writes shards. Results are consumed strictly in chunk order, so
the output is the same for any number of workers, and at most ``2 * workers`` chunks
are in flight, so memory stays flat (``Pool.imap`` would queue every task up front,
which for compressed inputs means holding the whole decompressed corpus).
``workers == 1`` runs the very same encoder in the main process.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

from foundrymix.convert.readers import Chunk, InputError, location


def default_workers() -> int:
    """All cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _init_worker(initializer: Callable[..., None], initargs: tuple) -> None:
    # Each worker tokenizes single-threaded: N processes each running the Rust
    # tokenizer's own thread pool would oversubscribe the cores.
    os.environ['TOKENIZERS_PARALLELISM'] = 'false'
    initializer(*initargs)


class ordered_map:
    """Yield ``(chunk, fn(chunk))`` in chunk order, computed by ``workers`` processes.

    A context manager that starts the workers and hands out the first chunks at once,
    so tokenization is under way while the main process still imports the shard
    writer (``streaming`` pulls in torch: seconds of start-up). Workers are forked
    before that import, so they stay small and inherit the loaded tokenizer.
    """

    def __init__(self, fn: Callable[[Chunk], Any], chunks: Iterable[Chunk], workers: int,
                 initializer: Callable[..., None], initargs: tuple) -> None:
        self.fn = fn
        self.chunks = iter(chunks)
        self.pool = None
        self.pending: deque = deque()
        if workers <= 1:
            initializer(*initargs)
            return
        self.pool = mp.get_context('fork').Pool(workers, _init_worker, (initializer, initargs))
        self.depth = 2 * workers
        self._submit(self.depth)

    def _submit(self, n: int) -> None:
        for chunk in itertools.islice(self.chunks, n):
            self.pending.append((chunk, self.pool.apply_async(self.fn, (chunk,))))

    def __iter__(self) -> Iterator[tuple[Chunk, Any]]:
        if self.pool is None:
            for chunk in self.chunks:
                yield chunk, self.fn(chunk)
            return
        while self.pending:
            chunk, res = self.pending.popleft()
            self._submit(1)
            yield chunk, res.get()

    def __enter__(self) -> 'ordered_map':
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


@dataclass
class ChunkErrors:
    """What a worker could not read in its chunk: ``(path, index, reason, detail)`` each."""

    items: list[tuple[str, Optional[int], str, str]] = field(default_factory=list)

    def add(self, path: str, index: Optional[int], reason: str, detail: str) -> None:
        self.items.append((path, index, reason, detail))


class LineCounter:
    """Turns a chunk-relative record index into a file line, in chunk order.

    A byte range of a plain jsonl file does not know its first line; the main process
    does, because it sees the chunks of a file in order and each reports its line count.
    """

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def first_line(self, chunk: Chunk, n_lines: int) -> Optional[int]:
        if chunk.first_line is not None or chunk.fmt == 'txt':
            return chunk.first_line
        first = self._next.get(chunk.path, 1)
        self._next[chunk.path] = first + n_lines
        return first


def apply_error_policy(chunk: Chunk, errors: ChunkErrors, first_line: Optional[int],
                       on_error: str, skipped: dict[str, int]) -> None:
    """Raise :class:`InputError` for the first bad record, or count each one as skipped."""
    for path, index, reason, detail in errors.items:
        if on_error == 'skip':
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        line = None if index is None or first_line is None else first_line + index
        raise InputError(location(path, line, chunk.fmt), reason, detail)


class Progress:
    """A tqdm bar on stderr: documents, tokens and tokens/s (silent when disabled)."""

    def __init__(self, enabled: bool, desc: str) -> None:
        self.start = time.perf_counter()
        self.docs = 0
        self.tokens = 0
        self._bar = None
        if enabled:
            from tqdm import tqdm
            self._bar = tqdm(desc=desc, unit=' docs', file=sys.stderr, dynamic_ncols=True,
                             mininterval=0.5)

    def update(self, docs: int, tokens: int) -> None:
        self.docs += docs
        self.tokens += tokens
        if self._bar is not None:
            self._bar.update(docs)
            rate = self.tokens / max(1e-9, time.perf_counter() - self.start)
            self._bar.set_postfix_str(f'{self.tokens:,} tokens, {rate:,.0f} tok/s', refresh=False)

    def close(self) -> float:
        if self._bar is not None:
            self._bar.close()
        return time.perf_counter() - self.start
