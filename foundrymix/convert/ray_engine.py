"""``--engine ray``: the default engine's conversion, split into Ray tasks over a cluster.

Each task encodes consecutive chunks into its own ``task-NNNNN/`` shards (a retry clears it
first); the driver applies the error policy in input order and merges indexes in task order, so
output differs from the local engine's only at task boundaries. docs/convert.md ("On a Ray cluster").
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional

from foundrymix.convert.common import ConvertOptions, Setup, init_worker
from foundrymix.convert.pipeline import ChunkResult, InputTally, Progress, default_workers
from foundrymix.convert.readers import Chunk, plan_chunks
from foundrymix.convert.report import check_rows
from foundrymix.convert.writer import ShardWriter, mds_writer, write_rows
from foundrymix.format.schema import Counts, Manifest, mds_columns
from foundrymix.format.shards import stored_name
from foundrymix.heap import collector_paused

if TYPE_CHECKING:
    from foundrymix.convert.driver import Converter

#: Ray re-runs a failed task (worker crash or exception) this many times
MAX_RETRIES = 3
#: test hook, read in the driver and handed to the tasks: ``"<task index>:<marker file>"``
#: makes that task's attempt die half-way (``os._exit``) unless the marker file exists;
#: the dying attempt creates it, so only the first attempt dies
FAIL_ENV = 'FOUNDRYMIX_RAY_FAIL_ONCE'


def plan_tasks(chunks: Iterable[Chunk], task_bytes: int) -> Iterator[list[Chunk]]:
    """Lazily group consecutive chunks into tasks of about ``task_bytes`` input bytes (a chunk
    without a byte range counts ``task_bytes / 16``)."""
    current: list[Chunk] = []
    size = 0
    for chunk in chunks:
        current.append(chunk)
        size += (len(chunk.payload) if chunk.payload is not None else
                 chunk.end - chunk.start if chunk.fmt == 'jsonl' else max(1, task_bytes // 16))
        if size >= task_bytes:
            yield current
            current, size = [], 0
    if current:
        yield current


@dataclass
class TaskResult:
    """What a task hands back: each chunk (without its payload) and its result without the arrays,
    the task's counts, and its shard files (relative to the output)."""

    index: int
    chunks: list[tuple[Chunk, ChunkResult]]
    counts: Counts
    docs: int = 0  # for progress
    tokens: int = 0
    files: list[str] = field(default_factory=list)


def _maybe_fail(spec: Optional[str], index: int, rows_written: int) -> None:
    """The :data:`FAIL_ENV` test hook: kill this worker once, mid-task (after some rows)."""
    if not spec or rows_written == 0:
        return
    target, marker = spec.split(':', 1)
    if int(target) == index and not os.path.exists(marker):
        open(marker, 'w').close()
        os._exit(17)


def run_task(converter: 'Converter', chunks: list[Chunk], index: int, partial: str,
             options: ConvertOptions, setup: Setup, fail: Optional[str] = None) -> TaskResult:
    """Encode ``chunks`` in order, build rows and write them as MDS shards (in a Ray worker)."""
    os.environ['TOKENIZERS_PARALLELISM'] = 'false'  # one task = one core
    init_worker(options, setup.bos_id, setup.eos_id, setup.token_dtype)  # the tokenizer is cached per process
    manifest = Manifest(kind=converter.kind, max_seq_len=options.max_seq_len,
                        token_dtype=setup.token_dtype, tokenizer=setup.info)
    builder = converter.builder(setup, options, manifest)
    out = os.path.join(partial, f'task-{index:05d}')
    shutil.rmtree(out, ignore_errors=True)  # a previous attempt's rows
    result = TaskResult(index, [], manifest.counts)
    writer = mds_writer(out, mds_columns(options.max_seq_len, setup.token_dtype), options.compression,
                        options.size_limit, options.hash_algorithms)
    for chunk in chunks:
        res = converter.encode_chunk(chunk)
        result.chunks.append((dataclasses.replace(chunk, payload=None),
                              ChunkResult(res.n_lines, res.n_records, res.errors, res.dropped)))
        if res.errors and options.on_error == 'raise':
            break  # the driver raises for this record; nothing after it matters
        for item in builder.add(res):
            write_rows(writer, item)
        docs, tokens = builder.progress(res)[:2]
        result.docs += docs
        result.tokens += tokens
        _maybe_fail(fail, index, manifest.counts.rows)
    for item in builder.flush():
        write_rows(writer, item)
    writer.finish()
    builder.close()
    result.files = [f'task-{index:05d}/{stored_name(shard)}' for shard in writer.shards]
    return result


def merge_task_indexes(partial: str, n_tasks: int) -> None:
    """One ``index.json`` listing every task's shards in task order, as ``task-NNNNN/<file>``
    (streaming resolves basenames against the stream's root, so shards stay where written)."""
    shards = []
    for i in range(n_tasks):
        sub = f'task-{i:05d}'
        with open(os.path.join(partial, sub, 'index.json'), encoding='utf-8') as f:
            index = json.load(f)
        for shard in index['shards']:
            for key in ('raw_data', 'zip_data'):
                if shard.get(key):
                    shard[key]['basename'] = f"{sub}/{shard[key]['basename']}"
            shards.append(shard)
        os.remove(os.path.join(partial, sub, 'index.json'))
    with open(os.path.join(partial, 'index.json'), 'w', encoding='utf-8') as f:
        json.dump({'version': 2, 'shards': shards}, f)
        f.flush()
        os.fsync(f.fileno())


def _connect(options: ConvertOptions) -> bool:
    """Use the Ray already initialized, else join ``ray_address`` or start a local one
    (``workers`` CPUs, no dashboard). True if this call started it (the caller shuts it down)."""
    with collector_paused():  # importing makes it run over and over, finding nothing
        import ray
    if ray.is_initialized():
        return False
    if options.ray_address:
        ray.init(address=options.ray_address, log_to_driver=True)
    else:
        ray.init(num_cpus=options.workers or default_workers(), include_dashboard=False)
    return True


def _run_tasks(submit: Callable[[int, list[Chunk]], Any], tasks: Iterable[list[Chunk]], window: int,
               progress: Progress, on_done: Callable[[TaskResult], None]) -> list[TaskResult]:
    """Submit tasks as planned, at most ``window`` in flight: results in task order;
    ``on_done(result)`` per task; on failure the rest are cancelled."""
    import ray
    futures: list[Any] = []
    results: dict[int, TaskResult] = {}
    pending: list[Any] = []
    try:
        for i, chunks in enumerate(itertools.chain(tasks, [None])):  # None: every task is submitted
            if chunks is not None:
                futures.append(submit(i, chunks))
                pending.append(futures[-1])
            while pending and (chunks is None or len(pending) >= window):
                done, pending = ray.wait(pending, num_returns=1)
                res = ray.get(done[0])
                results[res.index] = res
                progress.update(res.docs, res.tokens)
                on_done(res)
    except BaseException:
        _cancel(futures)  # before the partial directory is removed
        raise
    return [results[i] for i in range(len(futures))]


def _cancel(futures: list[Any], timeout: float = 60) -> None:
    """Cancel the unfinished tasks and wait, so none writes after the partial directory goes
    (cancelling a finished one can abort the driver: ray-project/ray#54846)."""
    import ray
    if not futures:
        return
    _, running = ray.wait(futures, num_returns=len(futures), timeout=0)
    for ref in running:
        ray.cancel(ref, force=True)
    if running:
        ray.wait(running, num_returns=len(running), timeout=timeout)


def run(converter: 'Converter', setup: Setup, options: ConvertOptions,
        manifest: Manifest) -> tuple[float, None, Optional[str]]:
    """:func:`foundrymix.convert.driver.run` on Ray (same contract)."""
    started = _connect(options)
    import ray
    try:
        tasks = plan_tasks(plan_chunks(setup.inputs, options.chunk_bytes), options.ray_task_bytes)
        progress = Progress(options.progress, f'convert {converter.kind} (ray)')
        lean = dataclasses.replace(setup, tokenizer=None, remote=None)  # workers load their own; no S3 client
        remote = ray.remote(num_cpus=1, max_retries=MAX_RETRIES, retry_exceptions=True)(run_task)
        window = max(2, 2 * int(ray.cluster_resources().get('CPU', 1)))
        fail = os.environ.get(FAIL_ENV)
        # the default engine's atomic output directory (partial, publish, abort), filled by tasks
        with ShardWriter(setup.output.local, options.max_seq_len, setup.token_dtype, overwrite=options.overwrite,
                         remote=setup.remote, tasks=True) as output:
            try:
                results = _run_tasks(
                    lambda i, chunks: remote.remote(converter, chunks, i, output.partial, options, lean, fail),
                    tasks, window, progress, lambda res: output.upload(res.files))  # while others run
            finally:
                seconds = progress.close()
            tally = InputTally(options.on_error, manifest)  # in input order, as the default engine
            for res in results:
                for chunk, chunk_res in res.chunks:
                    tally.add(chunk, chunk_res)
                for f in dataclasses.fields(Counts):
                    setattr(manifest.counts, f.name, getattr(manifest.counts, f.name) + getattr(res.counts, f.name))
            check_rows(manifest, len(setup.inputs), options.holdout)
            merge_task_indexes(output.partial, len(results))
            output.rows = manifest.counts.rows
            output.finish(manifest)
        return seconds, None, output.upload_summary
    finally:
        if started:
            ray.shutdown()
