"""Run the chunk encoder in parallel and bring its results back in input order.

Results come in chunk order, so the output is the same for any workers and mode, with at most
``2 * workers`` chunks in flight (``Pool.imap`` would queue the whole input). ``threads`` suit
the Rust tokenizer (it releases the GIL); forked ``processes`` suit Python-heavy encoders. A
worker process that dies stops the conversion at once, named with its chunk and how it died
(:class:`WorkerDied`), never waited on forever; workers end when the process that forked them
dies, even by SIGKILL, so an inherited ``flock`` on ``--out`` never keeps a rerun out
(``PR_SET_PDEATHSIG``, else a polling thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import wait as mp_wait
from typing import Any, Callable, Iterable, Iterator, Optional

from foundrymix.convert.readers import BadRecord, Chunk, InputError, describe, location
from foundrymix.errors import FoundrymixError
from foundrymix.format.schema import SKIP_LOCATIONS, Manifest

#: set to ``false`` in each worker, which tokenizes single-threaded
PARALLELISM_ENV = 'TOKENIZERS_PARALLELISM'
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: how often the fallback thread looks for its parent, in seconds
POLL_S = 0.2


class WorkerDied(FoundrymixError, ValueError):
    """A worker process died (a signal, or ``sys.exit``/``os._exit``) mid-conversion; a
    ``ValueError`` so that the CLI prints it as its one-line error (exit 2)."""


def _how(exitcode: Optional[int]) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f'signal {-exitcode}'
        if name == 'SIGKILL':
            return 'was killed by SIGKILL (out of memory? fewer --workers need less memory)'
        return f'was killed by {name} (a crash in native code, e.g. one a --preprocess function calls?)'
    return f'exited with code {exitcode} (sys.exit or os._exit, e.g. in a --preprocess function?)'


def die_with_parent(parent: int) -> None:
    """Make this process (forked by ``parent``, in the thread that lives as long as the
    pool: ``PR_SET_PDEATHSIG`` follows the forking thread) end when ``parent`` does."""
    if sys.platform.startswith('linux'):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
            if os.getppid() != parent:  # died before the setting was made
                os._exit(1)
            return
    threading.Thread(target=_watch, args=(parent,), daemon=True, name='foundrymix-lifeline').start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os._exit(1)


def _work(index: int, fn: Callable[[Chunk], Any], initializer: Callable[..., None], initargs: tuple,
          tasks: Any, out: Any, current: Any, parent: int) -> None:
    """A forked worker: encode chunks from ``tasks``, send results on its own pipe ``out``.

    SIGTERM is the default (an inherited ``sys.exit`` handler could hang on held locks), SIGINT
    ignored (the parent stops workers); ``current[index]`` is the chunk being encoded (-1: none)."""
    die_with_parent(parent)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ[PARALLELISM_ENV] = 'false'
    try:
        initializer(*initargs)
    except Exception as e:  # noqa: BLE001 -- re-raised in the parent
        out.send((None, False, e))
        return
    results: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_send_results, args=(out, results), daemon=True).start()
    while True:  # until the parent stops it, or dies (die_with_parent)
        seq, chunk = tasks.get()
        current[index] = seq
        try:
            result = (seq, True, fn(chunk))
        except Exception as e:  # noqa: BLE001 -- re-raised in the parent, as Pool.get() did
            result = (seq, False, e)
        current[index] = -1
        results.put(result)


def _send_results(out: Any, results: queue.SimpleQueue) -> None:
    while True:
        seq, ok, value = results.get()
        try:
            out.send((seq, ok, value))
        except (pickle.PicklingError, TypeError, AttributeError) as e:  # pickled before anything is sent
            out.send((seq, False, RuntimeError(f'cannot send the result of a chunk back: {e!r}')))


class ProcessPool:
    """``workers`` forked processes encoding chunks; a dead worker stops the conversion at once.

    Not ``multiprocessing.Pool`` (waits forever for a dead worker's chunk) nor
    ``ProcessPoolExecutor`` (names neither chunk nor exit code): the parent waits on result pipes
    and sentinels together. Workers end with the thread that created the pool: create it there."""

    def __init__(self, fn: Callable[[Chunk], Any], workers: int, initializer: Callable[..., None],
                 initargs: tuple) -> None:
        ctx = mp.get_context('fork')
        self.tasks = ctx.Queue()
        self.current = ctx.RawArray('q', [-1] * workers)
        self.chunks: dict[int, Chunk] = {}  # handed out, result not yet taken
        self.done: dict[int, tuple[bool, Any]] = {}
        self.seq = 0
        self.procs: list[Any] = []
        self.pipes: list[Any] = []
        for index in range(workers):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_work, daemon=True, name=f'foundrymix-encode-{index}',
                               args=(index, fn, initializer, initargs, self.tasks, writer, self.current,
                                     os.getpid()))
            proc.start()
            writer.close()  # the worker's is then the only write end: its death is an end of file
            self.procs.append(proc)
            self.pipes.append(reader)

    def submit(self, chunk: Chunk) -> int:
        self.seq += 1
        self.chunks[self.seq] = chunk
        self.tasks.put((self.seq, chunk))
        return self.seq

    def result(self, seq: int) -> Any:
        """The result of chunk ``seq``, its worker's exception re-raised, or :class:`WorkerDied`."""
        while seq not in self.done:
            sentinels = [p.sentinel for p in self.procs]
            for ready in mp_wait([*self.pipes, *sentinels]):
                if isinstance(ready, int):
                    self._died(sentinels.index(ready))
                try:
                    got, ok, value = ready.recv()
                except EOFError:
                    self._died(self.pipes.index(ready))
                if got is None:  # the worker's initializer failed
                    raise value
                self.done[got] = (ok, value)
        ok, value = self.done.pop(seq)
        del self.chunks[seq]
        if not ok:
            raise value
        return value

    def _died(self, index: int) -> None:
        proc = self.procs[index]
        proc.join(5)  # it is dead or dying: its pipe or sentinel said so
        seq = self.current[index]
        what = f'for {describe(self.chunks[seq])}' if seq in self.chunks else '(between chunks)'
        raise WorkerDied(f'worker process {proc.pid} {what} {_how(proc.exitcode)}; the conversion '
                         f'was stopped')

    def close(self) -> None:
        """Stop every worker (SIGTERM, then SIGKILL after 5 s) and wait for them: no orphans."""
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.join(5)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        for reader in self.pipes:
            reader.close()
        self.tasks.cancel_join_thread()  # tasks nobody will read must not hold up exit
        self.tasks.close()


PARALLEL_MODES = ('threads', 'processes')


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


@dataclass
class ChunkResult:
    """What every encode step returns besides its arrays: lines and records seen, errors."""

    n_lines: int
    n_records: int
    errors: list[tuple[str, Optional[int], BadRecord]]  # (path, index in the chunk, why) it could not read
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
                raise InputError(f'{where}: {bad.detail}')
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
