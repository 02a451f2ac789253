"""Run the chunk encoder in parallel and bring its results back in input order.

Results come in chunk order, so the output is the same for any workers and mode, with at most
``2 * workers`` chunks in flight (``Pool.imap`` would queue the whole input). ``threads`` suit
the Rust tokenizer (it releases the GIL); forked ``processes`` suit Python-heavy encoders.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import os
import sys
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

from foundrymix.convert.process_pool import PARALLELISM_ENV, ProcessPool
from foundrymix.convert.readers import BadRecord, Chunk, InputError, location
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


@contextlib.contextmanager
def _set_env(name: str, value: str) -> Iterator[None]:
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
        if saved is not None:
            os.environ[name] = saved


@contextlib.contextmanager
def ordered_map(fn: Callable[[Chunk], Any], chunks: Iterable[Chunk], workers: int,
                initializer: Callable[..., None], initargs: tuple,
                mode: str = 'threads') -> Iterator[Iterator[tuple[Chunk, Any]]]:
    """Yield an iterator of ``(chunk, fn(chunk))`` in chunk order, computed by ``workers`` threads
    or processes. The first chunks start on entry: processes fork before the shard writer imports
    ``streaming``, so they stay small."""
    chunks = iter(chunks)
    with contextlib.ExitStack() as stack:
        if workers > 1 and mode == 'processes':
            pool = stack.enter_context(contextlib.closing(ProcessPool(fn, workers, initializer, initargs)))
            submit, result = pool.submit, pool.result
        else:
            initializer(*initargs)
            # one Rust thread per worker thread: exactly ``workers`` cores tokenize
            stack.enter_context(_set_env(PARALLELISM_ENV, 'false'))
            if workers <= 1:
                yield ((chunk, fn(chunk)) for chunk in chunks)
                return
            threads = ThreadPoolExecutor(workers, thread_name_prefix='foundrymix-encode')
            # at most one chunk per thread is left to finish
            stack.callback(threads.shutdown, wait=True, cancel_futures=True)
            submit, result = functools.partial(threads.submit, fn), Future.result
        pending = deque((chunk, submit(chunk)) for chunk in itertools.islice(chunks, 2 * workers))

        def ordered() -> Iterator[tuple[Chunk, Any]]:
            while pending:
                chunk, handle = pending.popleft()
                pending.extend((c, submit(c)) for c in itertools.islice(chunks, 1))
                yield chunk, result(handle)
        yield ordered()


#: what a worker could not read in its chunk: ``(path, index in the chunk, why)`` each
ChunkErrors = list[tuple[str, Optional[int], BadRecord]]


@dataclass
class ChunkResult:
    """What every encode step returns besides its arrays: lines and records seen, errors."""

    n_lines: int
    n_records: int
    errors: ChunkErrors
    dropped: dict[str, int]  # records left out on purpose, by reason (manifest.dropped)


class InputTally:
    """Counts each chunk's result into ``manifest`` and applies the error policy, fed the chunks
    in input order (a byte range of a plain jsonl file does not know its first line)."""

    def __init__(self, on_error: str, manifest: Manifest) -> None:
        self.on_error = on_error
        self.manifest = manifest
        self._next: dict[str, int] = {}

    def add(self, chunk: Chunk, res: ChunkResult) -> None:
        """Raise :class:`InputError` for the first bad record, or count each in ``manifest.skipped``
        (the first ``SKIP_LOCATIONS`` per reason located in ``manifest.skipped_at``)."""
        m = self.manifest
        first = chunk.first_line
        if first is None and chunk.fmt != 'txt':
            first = self._next.get(chunk.path, 1)
            self._next[chunk.path] = first + res.n_lines
        for path, index, bad in res.errors:
            where = location(path, None if index is None or first is None else first + index, chunk.fmt)
            if self.on_error != 'skip':
                raise InputError(where, bad.reason, bad.detail)
            m.skipped[bad.reason] = m.skipped.get(bad.reason, 0) + 1
            seen = m.skipped_at.setdefault(bad.reason, [])
            if len(seen) < SKIP_LOCATIONS:
                seen.append(where)
        m.counts.documents_read += res.n_records
        for reason, n in res.dropped.items():
            m.dropped[reason] = m.dropped.get(reason, 0) + n


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
