"""The one conversion driver: chunks -> workers -> rows -> shards, for every converter.

A :class:`Converter` supplies only its encode step (in the workers, which reach options through
:class:`~foundrymix.convert.common.WorkerState`) and row builder (in the calling thread); checks, error policy,
counts, progress, atomic writing and the summary are shared here.

``--holdout``: a held-out eval split decided by each record's content alone. A record goes to
``eval`` when the sha256 of its JSON (keys sorted) is below ``fraction`` of the range, or among the
``count`` smallest: the split is the same for any workers, chunking or order, and duplicates share
a side. One run per side (``OUT/eval``, then ``OUT/train``), each keeping its side before
``--preprocess``; an unreadable record is counted once, in train.
"""

from __future__ import annotations

import errno
import hashlib
import heapq
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Optional, Sequence

from foundrymix import claims
from foundrymix.convert import ray_engine
from foundrymix.convert.common import ConvertOptions, Setup, init_worker, prepare, worker_state
from foundrymix.convert.paths import OutSpec, split_out, sub_out
from foundrymix.convert.mapping import PREPROCESS_SKIPPED, apply_preprocess
from foundrymix.convert.pipeline import ChunkResult, InputTally, Progress, ordered_map
from foundrymix.convert.readers import BadRecord, Chunk, lone_surrogate, plan_chunks, read_records
from foundrymix.convert.report import check_rows, print_summary
from foundrymix.convert.writer import ShardWriter
from foundrymix.errors import UserError
from foundrymix.format.schema import Manifest


def parse_records(chunk: Chunk, fields: Optional[Sequence[str]], parse: Callable[[dict], Any]
                  ) -> tuple[ChunkResult, list[Any]]:
    """Read a chunk and ``parse`` each record: what was read (lines, records, errors, drops) and the
    parsed records. ``parse`` returns the usable form or a :class:`BadRecord`; ``--on-error raise``
    stops at the first. ``--preprocess`` runs first (its ``None`` counted as dropped); with
    ``--holdout`` only this run's side is read."""
    o = worker_state().options
    n_lines, records = (read_records(chunk, fields) if o.holdout is None
                        else side_records(chunk, fields, o.holdout, o.on_error))
    read = ChunkResult(n_lines, len(records), [], {})
    parsed: list[Any] = []
    for path, index, rec in records:
        if o.preprocess is not None and not isinstance(rec, BadRecord):
            rec = apply_preprocess(o.preprocess, rec)
            if rec is None:
                read.dropped[PREPROCESS_SKIPPED] = read.dropped.get(PREPROCESS_SKIPPED, 0) + 1
                continue
            if isinstance(rec, dict):  # what the function made must be tokenizable too
                rec = lone_surrogate(rec, None) or rec
        item = rec if isinstance(rec, BadRecord) else parse(rec)
        if isinstance(item, BadRecord):
            read.errors.append((path, index, item))
            if o.on_error == 'raise':
                break
            continue
        parsed.append(item)
    return read, parsed


class RowBuilder:
    """Turns encode results, in input order, into MDS rows and fills ``manifest.counts``."""

    def add(self, result: Any) -> Iterator[dict]:
        """Rows completed by one chunk's result."""
        raise NotImplementedError

    def flush(self) -> Iterator[dict]:
        """Rows still held at the end of the input."""
        return iter(())

    def progress(self, result: Any) -> tuple[int, ...]:
        """(documents read, tokens[, documents written]) of a result, for the progress bar."""
        raise NotImplementedError

    def close(self) -> None:
        """Final counts once every row is written (e.g. the unwritten tail)."""

    def fit_length(self, share: float) -> Optional[int]:
        """The sequence length that ``share`` of the records fit in, where known (for the summary)."""
        return None


@dataclass(frozen=True)
class Converter:
    """What one kind of conversion supplies to the driver."""

    kind: str  # Manifest.kind
    noun: str  # what a record is, for messages: documents | examples
    encode_chunk: Callable[[Chunk], ChunkResult]
    #: the default ConvertOptions.parallel, or what picks it from the inputs and options
    parallel: str | Callable[[Setup, Any], str]
    builder: Callable[[Setup, Any, Manifest], RowBuilder]
    manifest_options: Callable[[Any, Setup], dict[str, Any]]
    min_content: int = 1
    #: False: the encode step never tokenizes (only the tokenizer's ids are needed)
    tokenizes: bool = True

    def parallel_mode(self, setup: Setup, options: ConvertOptions) -> str:
        """``options.parallel`` if given, else this converter's default for these inputs."""
        return options.parallel or (self.parallel if isinstance(self.parallel, str) else self.parallel(setup, options))


def convert(converter: Converter, inputs: list[str], out: OutSpec, options: ConvertOptions) -> Manifest:
    """Check everything, convert ``inputs`` to shards plus manifest in ``out``, print the summary.

    The local output is claimed exclusively until the end. With ``options.holdout``, ``out/eval``
    then ``out/train`` are written, both checked first; the train manifest is returned."""
    if options.holdout is None:
        return _convert_claimed(converter, inputs, out, options)
    rule = parse_holdout(options.holdout)
    outs = {side: sub_out(out, side) for side in SIDES}
    setups = [prepare(inputs, outs[side], options, min_content=converter.min_content, load=False)
              for side in SIDES]
    rule = resolve(rule, setups[0].inputs, options.chunk_bytes, converter.noun)
    manifests = [_convert_claimed(converter, inputs, outs[side],
                                  replace(options, holdout=replace(rule, side=side)))
                 for side in SIDES]
    return manifests[-1]


def _convert_claimed(converter: Converter, inputs: list[str], out: OutSpec, options: ConvertOptions) -> Manifest:
    """Prepare, run the engine, print the summary, with the local output claimed exclusively: a live
    run reading it would be fed mixed old and new rows."""
    local = split_out(out).local
    path = None if local is None else claims.normalize(local)
    try:
        claim = None if path is None else claims.try_claim(path, claims.EXCLUSIVE)
    except claims.Busy as e:
        raise UserError(f'--out {local}: {path} is in use by a live run, {claims.describe(e.holders)}; '
                        f'writing there now would corrupt what it reads. Wait for that run to end, '
                        f'or choose another --out') from None
    try:
        setup = prepare(inputs, out, options, min_content=converter.min_content, load=converter.tokenizes)
        manifest = Manifest(kind=converter.kind, max_seq_len=options.max_seq_len, token_dtype=setup.token_dtype,
                            tokenizer=setup.info, inputs=setup.inputs,
                            options=converter.manifest_options(options, setup))
        engine = ray_engine.run if options.engine == 'ray' else run  # Ray: tasks on a cluster, this module reused
        seconds, fit_95, uploaded = engine(converter, setup, options, manifest)
        if options.progress:
            print_summary(manifest, str(setup.output), seconds, fit_95=fit_95, uploaded=uploaded)
        return manifest
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise UserError(no_space(local, e)) from None
    finally:
        if claim is not None:
            claim.release()


def no_space(local: Optional[str], error: OSError) -> str:
    """The one line for a disk (or quota) that filled up: the folder (the ``OSError`` names none),
    and that nothing was published."""
    what = 'no space left' if error.errno == errno.ENOSPC else 'the disk quota is used up'
    if local is None:  # --out s3:// only: shards are staged in the temporary directory
        where = tempfile.gettempdir()
        fix = 'set TMPDIR to a folder on a disk with more room, or give --keep-local DIR there'
        folder = f'the staging folder in {where}'
    else:
        where = os.path.dirname(os.path.abspath(local)) or '.'
        fix = 'free space there, or give --out a folder on a disk with more room'
        folder = f'--out {local}'
    try:
        free = f' ({shutil.disk_usage(where).free:,} bytes free now)'
    except OSError:
        free = ''
    return (f'{folder}: {what} on the device that holds it{free}; nothing was published (the partial '
            f'output was removed): {fix}')


def run(converter: Converter, setup: Setup, options: ConvertOptions,
        manifest: Manifest) -> tuple[float, Optional[int], Optional[str]]:
    """Stream chunks through the workers, build rows, write shards, fill ``manifest``: the output
    appears only if everything succeeded. ``(seconds, length 95 % of the examples fit in if known,
    upload summary or None)``."""
    builder = converter.builder(setup, options, manifest)
    tally = InputTally(options.on_error, manifest)
    progress = Progress(options.progress, f'convert {converter.kind}')
    initargs = (options, setup.bos_id, setup.eos_id, setup.token_dtype)
    chunks = plan_chunks(setup.inputs, options.chunk_bytes)
    with ordered_map(converter.encode_chunk, chunks, setup.workers, init_worker, initargs,
                     mode=converter.parallel_mode(setup, options)) as results, \
            ShardWriter(setup.output.local, options.max_seq_len, setup.token_dtype,
                        overwrite=options.overwrite, compression=options.compression,
                        size_limit=options.size_limit, hashes=options.hash_algorithms,
                        remote=setup.remote) as writer:
        try:
            for chunk, res in results:
                tally.add(chunk, res)
                for row in builder.add(res):
                    writer.write(row)
                progress.update(*builder.progress(res))
            for row in builder.flush():
                writer.write(row)
        finally:
            seconds = progress.close()
        builder.close()
        check_rows(manifest, len(setup.inputs), options.holdout)
        writer.finish(manifest)
    return seconds, builder.fit_length(0.95), writer.upload_summary


#: how a record is hashed, recorded in each side's manifest
RULE = 'sha256(json.dumps(record, sort_keys=True, ensure_ascii=False, default=str)) / 2**256'
SIDES = ('eval', 'train')
_HASH_RANGE = 1 << 256
#: formats parsed whole whatever fields are asked for (other formats read only the fields asked for)
_JSON_LINES = ('jsonl', 'jsonl_stream')


@dataclass(frozen=True)
class Holdout:
    """The rule and the side one conversion run keeps (recorded in its manifest's options)."""

    spec: str                         # as given: '2%', '0.02' or '500'
    fraction: Optional[float] = None  # held out: hash / 2**256 < fraction
    count: Optional[int] = None       # held out: the ``count`` smallest hashes ...
    cutoff: Optional[str] = None      # ... i.e. hash <= this (hex), found by a first pass
    side: str = 'train'
    rule: str = RULE

    def held_out(self, record: dict) -> bool:
        key = record_key(record)
        if self.fraction is not None:
            return key < self.fraction * _HASH_RANGE  # int < float compares exactly
        return key <= int(self.cutoff, 16)


def record_key(record: dict) -> int:
    """The record's sha256 as a number in [0, 2**256)."""
    text = json.dumps(record, sort_keys=True, ensure_ascii=False, default=str)
    return int.from_bytes(hashlib.sha256(text.encode('utf-8', 'surrogatepass')).digest(), 'big')


def parse_holdout(spec: Any) -> Holdout:
    """``--holdout`` as a rule: ``2%`` or ``0.02`` (a fraction in (0, 1)), or ``500`` (records)."""
    text = str(spec).strip()
    bad = (f'--holdout {spec}: give a fraction of the records held out for eval, as 2% or 0.02 '
           f'(above 0, below 1), or a number of records, as 500')
    if re.fullmatch(r'\d+', text) and int(text) > 0:
        return Holdout(spec=text, count=int(text))
    try:
        fraction = float(text[:-1]) / 100 if text.endswith('%') else float(text)
    except ValueError:
        raise UserError(bad) from None
    if not 0 < fraction < 1:  # also '0', which is no number of records either
        raise UserError(bad)
    return Holdout(spec=text, fraction=fraction)


def resolve(holdout: Holdout, inputs: Sequence[str], chunk_bytes: int, noun: str) -> Holdout:
    """A count's cutoff, from one pass over ``inputs`` (resolved files) that reads and hashes
    every record (no tokenizing); refuses a count that would leave train empty."""
    if holdout.count is None:
        return holdout
    n, largest, heap = 0, -1, []  # heap: the count smallest keys, negated (a max-heap)
    for chunk in plan_chunks(inputs, chunk_bytes):
        # every field: JSON lines are parsed whole either way (``()`` checks no field for lone
        # surrogates, as the conversion checks only those it reads); other formats all columns
        for _, _, rec in read_records(chunk, () if chunk.fmt in _JSON_LINES else None)[1]:
            if isinstance(rec, BadRecord):
                continue
            key = record_key(rec)
            n, largest = n + 1, max(largest, key)
            if len(heap) < holdout.count:
                heapq.heappush(heap, -key)
            elif key < -heap[0]:
                heapq.heapreplace(heap, -key)
    cutoff = -heap[0] if heap else -1
    if holdout.count >= n or cutoff >= largest:
        raise UserError(f'--holdout {holdout.spec}: the inputs hold {n} readable {noun}'
                        f'{" (the rest are exact duplicates of held-out ones)" if holdout.count < n else ""}, '
                        f'so no {noun} would be left to train on; give fewer, or a fraction such as 2%')
    return replace(holdout, cutoff=f'{cutoff:064x}')


def side_records(chunk: Chunk, fields: Optional[Sequence[str]], holdout: Holdout, on_error: str
                 ) -> tuple[int, list[tuple[str, Optional[int], Any]]]:
    """:func:`~foundrymix.convert.readers.read_records` keeping this side's records, each hashed
    whole and then cut to ``fields`` as ``read_records(chunk, fields)`` would have read it.
    Unreadable records go to train only (counted once), or to both sides with ``on_error='raise'``
    (either run stops at the first)."""
    n_lines, records = read_records(chunk, fields if chunk.fmt in _JSON_LINES else None)
    eval_side = holdout.side == 'eval'
    kept = []
    for path, index, rec in records:
        if isinstance(rec, BadRecord):
            if on_error == 'raise' or not eval_side:
                kept.append((path, index, rec))
        elif holdout.held_out(rec) == eval_side:
            kept.append((path, index, _cut(rec, chunk.fmt, fields)))
    return n_lines, kept


def _cut(rec: dict, fmt: str, fields: Optional[Sequence[str]]) -> dict:
    if fields is None or fmt in _JSON_LINES:
        return rec
    if fmt == 'txt':  # read whole under 'text'; the conversion names it by its first field
        return {fields[0] if fields else 'text': rec['text']}
    return {c: rec[c] for c in fields if c in rec}
