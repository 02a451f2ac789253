"""Run the chunk encoder in parallel and bring its results back in input order.

Results come in chunk order, so the output is the same for any workers and mode, with at most
``2 * workers`` chunks in flight (``Pool.imap`` would queue the whole input). ``threads`` suit
the Rust tokenizer (it releases the GIL); forked ``processes`` suit Python-heavy encoders.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

from foundrymix.convert.process_pool import PARALLELISM_ENV, ProcessPool, WorkerDied  # noqa: F401 (re-exported)
from foundrymix.convert.readers import Chunk, InputError, location
from foundrymix.errors import UserError
from foundrymix.format.schema import SKIP_LOCATIONS, Manifest

PARALLEL_MODES = ('threads', 'processes')


@contextlib.contextmanager
def importing(module: str) -> Iterator[None]:
    """Pause the cyclic garbage collector while ``module`` is imported for the first time:
    importing torch or transformers makes the collector run over and over, finding nothing."""
    if module in sys.modules or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def default_workers() -> int:
    """All cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class ordered_map:
    """Yield ``(chunk, fn(chunk))`` in chunk order, computed by ``workers`` threads or processes.

    A context manager that starts the first chunks at once; processes fork before the shard
    writer imports ``streaming``, so they stay small."""

    def __init__(self, fn: Callable[[Chunk], Any], chunks: Iterable[Chunk], workers: int,
                 initializer: Callable[..., None], initargs: tuple, mode: str = 'threads') -> None:
        if mode not in PARALLEL_MODES:
            raise UserError(f"parallel mode must be one of {', '.join(PARALLEL_MODES)}, got {mode!r}")
        self.fn = fn
        self.chunks = iter(chunks)
        self.pool: Optional[ProcessPool] = None
        self.threads: Optional[ThreadPoolExecutor] = None
        self.pending: deque = deque()
        self._saved_env: Optional[list[Optional[str]]] = None
        self.depth = 2 * workers
        if workers <= 1 or mode == 'threads':
            initializer(*initargs)
            # one Rust thread per worker thread: exactly ``workers`` cores tokenize
            self._saved_env = [os.environ.get(PARALLELISM_ENV)]
            os.environ[PARALLELISM_ENV] = 'false'
            if workers > 1:
                self.threads = ThreadPoolExecutor(workers, thread_name_prefix='foundrymix-encode')
                self._submit(self.depth)
            return
        self.pool = ProcessPool(fn, workers, initializer, initargs)
        self._submit(self.depth)

    def _submit(self, n: int) -> None:
        for chunk in itertools.islice(self.chunks, n):
            if self.threads is not None:
                self.pending.append((chunk, self.threads.submit(self.fn, chunk)))
            else:
                self.pending.append((chunk, self.pool.submit(chunk)))

    def __iter__(self) -> Iterator[tuple[Chunk, Any]]:
        if self.pool is None and self.threads is None:
            for chunk in self.chunks:
                yield chunk, self.fn(chunk)
            return
        while self.pending:
            chunk, res = self.pending.popleft()
            self._submit(1)
            yield chunk, res.result() if self.threads is not None else self.pool.result(res)

    def __enter__(self) -> 'ordered_map':
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.threads is not None:
            for _, fut in self.pending:
                fut.cancel()
            self.pending.clear()
            self.threads.shutdown(wait=True)  # at most one chunk per thread left to finish
            self.threads = None
        if self._saved_env is not None:
            os.environ.pop(PARALLELISM_ENV, None)
            if self._saved_env[0] is not None:
                os.environ[PARALLELISM_ENV] = self._saved_env[0]
            self._saved_env = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None


@dataclass
class ChunkErrors:
    """What a worker could not read in its chunk: ``(path, index, reason, detail)`` each."""

    items: list[tuple[str, Optional[int], str, str]] = field(default_factory=list)

    def add(self, path: str, index: Optional[int], reason: str, detail: str) -> None:
        self.items.append((path, index, reason, detail))


class LineCounter:
    """Turns a chunk-relative record index into a file line, fed the chunks in order (a byte
    range of a plain jsonl file does not know its first line)."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def first_line(self, chunk: Chunk, n_lines: int) -> Optional[int]:
        if chunk.first_line is not None or chunk.fmt == 'txt':
            return chunk.first_line
        first = self._next.get(chunk.path, 1)
        self._next[chunk.path] = first + n_lines
        return first


def apply_error_policy(chunk: Chunk, errors: ChunkErrors, first_line: Optional[int],
                       on_error: str, manifest: Manifest) -> None:
    """Raise :class:`InputError` for the first bad record, or count each in ``manifest.skipped``
    (the first ``SKIP_LOCATIONS`` per reason located in ``manifest.skipped_at``)."""
    for path, index, reason, detail in errors.items:
        line = None if index is None or first_line is None else first_line + index
        where = location(path, line, chunk.fmt)
        if on_error != 'skip':
            raise InputError(where, reason, detail)
        manifest.skipped[reason] = manifest.skipped.get(reason, 0) + 1
        seen = manifest.skipped_at.setdefault(reason, [])
        if len(seen) < SKIP_LOCATIONS:
            seen.append(where)


class Progress:
    """A tqdm bar on stderr: records read, tokens and tokens/s (silent when disabled); with
    ``written`` it also shows ``N written, D dropped``."""

    def __init__(self, enabled: bool, desc: str) -> None:
        self.start = time.perf_counter()
        self.docs = 0
        self.tokens = 0
        self.written: Optional[int] = None
        self._bar = None
        if enabled:
            from tqdm import tqdm
            self._bar = tqdm(desc=desc, unit=' docs', file=sys.stderr, dynamic_ncols=True,
                             mininterval=0.5)

    def update(self, docs: int, tokens: int, written: Optional[int] = None) -> None:
        self.docs += docs
        self.tokens += tokens
        if written is not None:
            self.written = (self.written or 0) + written
        if self._bar is not None:
            rate = self.tokens / max(1e-9, time.perf_counter() - self.start)
            kept = '' if self.written is None else \
                f'{self.written:,} written, {self.docs - self.written:,} dropped, '
            self._bar.set_postfix_str(f'{kept}{self.tokens:,} tokens, {rate:,.0f} tok/s', refresh=False)
            self._bar.update(docs)

    def close(self) -> float:
        if self._bar is not None:
            self._bar.close()
        return time.perf_counter() - self.start
