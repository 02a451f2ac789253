"""``convert pretrain``: documents -> one token stream -> rows of exactly ``max_seq_len``.

Separator policy: every document is tokenized without special tokens and becomes
``[BOS] + ids + [EOS]``, where BOS is present iff the tokenizer adds one by default
(``TokenizerInfo.add_bos``; override with ``bos``) and EOS is present unless ``eos`` is
off; at least one separator is required, otherwise documents would run together.
All documents are concatenated in input order and cut into windows of
``max_seq_len``. Each row has one loss span over the whole row and ``doc_lens`` = the
lengths of the document pieces inside it (a document cut across rows gives a piece in
each row). The tokens after the last full row are not written; their number is
``counts.tail_tokens``.

Workers (threads or processes) read and tokenize whole chunks (see
:mod:`foundrymix.convert.pipeline`); the calling thread receives one flat token array
and the document lengths per chunk, in input order, cuts rows and writes them, so the
rows are the same for any number and kind of workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from foundrymix.convert.common import ConvertOptions, Setup, prepare
from foundrymix.convert.encode import encode_texts
from foundrymix.convert.pipeline import (ChunkErrors, LineCounter, Progress, apply_error_policy,
                                         ordered_map)
from foundrymix.convert.readers import BadRecord, Chunk, get_string, plan_chunks, read_records
from foundrymix.convert.report import print_summary
from foundrymix.convert.writer import ShardWriter
from foundrymix.schema import Counts, Manifest, encode_row
from foundrymix.tokenizer import load_tokenizer


@dataclass
class PretrainOptions(ConvertOptions):
    """Options of ``convert pretrain`` (see :class:`ConvertOptions` for the common ones)."""

    text_field: str = 'text'


@dataclass
class _ChunkTokens:
    """A worker's result: all documents of a chunk, separators included, back to back."""

    tokens: np.ndarray
    doc_lens: np.ndarray
    n_lines: int
    n_records: int
    errors: ChunkErrors = field(default_factory=ChunkErrors)


_worker: dict[str, Any] = {}


def _init(tokenizer: str, text_field: str, bos_id: Optional[int], eos_id: Optional[int],
          token_dtype: str, on_error: str) -> None:
    _worker.update(tok=load_tokenizer(tokenizer), field=text_field, bos=bos_id, eos=eos_id,
                   dtype=token_dtype, on_error=on_error)


def _encode_chunk(chunk: Chunk) -> _ChunkTokens:
    """Read, check and tokenize one chunk (runs in a worker thread or process)."""
    w = _worker
    n_lines, records = read_records(chunk, (w['field'],))
    errors = ChunkErrors()
    texts: list[str] = []
    for path, index, rec in records:
        text = rec if isinstance(rec, BadRecord) else get_string(rec, w['field'])
        if isinstance(text, str) and not text:
            text = BadRecord('empty_document', f"field '{w['field']}': empty document")
        if isinstance(text, BadRecord):
            errors.add(path, index, text.reason, text.detail)
            if w['on_error'] == 'raise':
                break  # the conversion stops at this error; no need to tokenize
            continue
        texts.append(text)
    ids = encode_texts(w['tok'], texts)
    head = [] if w['bos'] is None else [w['bos']]
    tail = [] if w['eos'] is None else [w['eos']]
    n_sep = len(head) + len(tail)
    doc_lens = np.fromiter((len(x) + n_sep for x in ids), dtype=np.int64, count=len(ids))
    tokens = np.empty(int(doc_lens.sum()), dtype=w['dtype'])
    pos = 0
    for x in ids:
        end = pos + len(x) + n_sep
        if isinstance(x, list):
            tokens[pos:end] = head + x + tail if n_sep else x
        else:  # a huge document, already an array (no list concatenation)
            tokens[pos:pos + len(head)] = head
            tokens[pos + len(head):end - len(tail)] = x
            tokens[end - len(tail):end] = tail
        pos = end
    return _ChunkTokens(tokens, doc_lens, n_lines, len(records), errors)


class RowCutter:
    """Cuts a token stream, fed chunk by chunk, into rows of ``max_seq_len``.

    Keeps the leftover (less than one row) between chunks, with the lengths of the
    document pieces in it, so a document may span chunk and row boundaries.
    """

    def __init__(self, max_seq_len: int, token_dtype: str) -> None:
        self.max_seq_len = max_seq_len
        self.dtype = token_dtype
        self.rest = np.zeros(0, dtype=token_dtype)
        self.rest_pieces = np.zeros(0, dtype=np.int64)
        self.rest_starts_doc = True  # does the leftover begin with a document's first token?

    def feed(self, tokens: np.ndarray, doc_lens: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Append a chunk; return the rows now complete as ``(input_ids, doc_lens)``."""
        L = self.max_seq_len
        stream = np.concatenate((self.rest, tokens))
        pieces = np.concatenate((self.rest_pieces, doc_lens))
        n_rows = len(stream) // L
        doc_ends = np.cumsum(pieces)
        cut = n_rows * L
        # Boundaries are document ends and row ends; consecutive differences are pieces.
        bounds = np.union1d(doc_ends[doc_ends < cut], np.arange(L, cut + 1, L)) if n_rows else []
        rows = []
        prev = 0
        row_pieces: list[int] = []
        for b in bounds:
            row_pieces.append(int(b - prev))
            prev = int(b)
            if b % L == 0:
                rows.append((stream[b - L:b], np.asarray(row_pieces, dtype=np.int32)))
                row_pieces = []
        if n_rows:
            self.rest_starts_doc = bool(np.isin(cut, doc_ends))
        ends_after = doc_ends[doc_ends > cut]
        self.rest = stream[cut:]
        self.rest_pieces = np.diff(np.concatenate(([cut], ends_after))) if len(ends_after) else \
            np.zeros(0, dtype=np.int64)
        return rows

    @property
    def tail_tokens(self) -> int:
        return len(self.rest)

    @property
    def tail_documents(self) -> int:
        """Documents that lie wholly in the unwritten tail."""
        return len(self.rest_pieces) - (0 if self.rest_starts_doc else 1)


def convert_pretrain(inputs: list[str], out: str, options: PretrainOptions) -> Manifest:
    """Convert pretraining corpora in ``inputs`` to MDS shards plus manifest in ``out``."""
    if options.bos is False and not options.eos:
        raise ValueError('--no-bos with --no-eos would join documents with no separator; '
                         'keep at least one of BOS and EOS')
    setup = prepare(inputs, out, options)
    manifest = Manifest(kind='pretrain', max_seq_len=options.max_seq_len,
                        token_dtype=setup.token_dtype, tokenizer=setup.info, inputs=setup.inputs,
                        options=_manifest_options(options, setup))
    seconds = run_pretrain(setup, out, options, manifest)
    if options.progress:
        print_summary(manifest, out, seconds)
    return manifest


def _manifest_options(options: PretrainOptions, setup: Setup) -> dict[str, Any]:
    d = options.to_manifest()
    d.update(separators={'bos': setup.bos_id is not None, 'eos': setup.eos_id is not None,
                         'policy': '[BOS] + document + [EOS] per document; BOS iff the tokenizer '
                                   'adds BOS unless overridden'})
    return d


def run_pretrain(setup: Setup, out: str, options: PretrainOptions, manifest: Manifest) -> float:
    """Stream chunks through the workers, cut rows, write shards and fill ``manifest``.

    Returns the seconds spent.
    """
    L = options.max_seq_len
    counts: Counts = manifest.counts
    cutter = RowCutter(L, setup.token_dtype)
    lines = LineCounter()
    progress = Progress(options.progress, 'convert pretrain')
    initargs = (options.tokenizer, options.text_field, setup.bos_id, setup.eos_id,
                setup.token_dtype, options.on_error)
    full_span = np.asarray([0, L], dtype=np.int32)
    chunks = plan_chunks(setup.inputs, options.chunk_bytes)
    with ordered_map(_encode_chunk, chunks, setup.workers, _init, initargs,
                     mode=options.parallel or 'threads') as results, \
            ShardWriter(out, L, setup.token_dtype, overwrite=options.overwrite,
                        compression=options.compression, size_limit=options.size_limit,
                        hashes=options.hash_algorithms) as writer:
        try:
            for chunk, res in results:
                apply_error_policy(chunk, res.errors, lines.first_line(chunk, res.n_lines),
                                   options.on_error, manifest)
                counts.documents_read += res.n_records
                counts.documents_written += len(res.doc_lens)
                for ids, pieces in cutter.feed(res.tokens, res.doc_lens):
                    writer.write(encode_row(ids, full_span, pieces, setup.token_dtype))
                    counts.rows += 1
                progress.update(len(res.doc_lens), int(res.doc_lens.sum()))
        finally:
            seconds = progress.close()
        if counts.documents_read == 0:
            raise ValueError(f'no documents found in {len(setup.inputs)} input file(s)')
        counts.tokens = counts.loss_tokens = counts.rows * L
        counts.tail_tokens = cutter.tail_tokens
        counts.documents_written -= cutter.tail_documents
        writer.finish(manifest)
    return seconds
