"""``convert pretrain``: documents -> one token stream -> rows of exactly ``max_seq_len``.

A document becomes ``[BOS] + ids + [EOS]`` (at least one of the two, or documents run together);
documents are concatenated in input order and cut into rows, each one loss span with ``doc_lens``
its document pieces; the tail after the last full row is counted, not written. Rows are the same
for any workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np

from foundrymix.convert.common import ConvertOptions, Setup, worker_state
from foundrymix.convert.paths import OutSpec
from foundrymix.convert.driver import Converter, RowBuilder, convert, parse_records
from foundrymix.convert.mapping import Template, concat_ids, encode_texts, parse_template, read_fields
from foundrymix.convert.pipeline import ChunkResult
from foundrymix.convert.readers import BadRecord, Chunk, get_string
from foundrymix.errors import UserError
from foundrymix.format.schema import Manifest, RowBatch


@dataclass
class PretrainOptions(ConvertOptions):
    """Options of ``convert pretrain`` (see :class:`ConvertOptions` for the common ones)."""

    text_field: str = 'text'
    text_template: Optional[str] = None  # --text '{title}\n\n{body}' (see mapping.py)


@dataclass
class _ChunkTokens(ChunkResult):
    """A worker's result: all documents of a chunk, separators included, back to back, and their
    lengths (adopt's token shards: the tokens up to each document end)."""

    tokens: np.ndarray
    doc_lens: np.ndarray


def _document(rec: dict, text_field: str, template: Optional[Template]) -> str | BadRecord:
    text = get_string(rec, text_field) if template is None else template.render(rec)
    if isinstance(text, str) and not text:
        what = f"field '{text_field}'" if template is None else f'--text {template.source!r}'
        return BadRecord('empty_document', f'{what}: empty document')
    return text


def _encode_chunk(chunk: Chunk) -> _ChunkTokens:
    """Read, check and tokenize one chunk (runs in a worker thread or process)."""
    w = worker_state()
    o: PretrainOptions = w.options
    field, template = o.text_field, parse_template(o.text_template, '--text')
    fields = read_fields((field,), (template,), o.preprocess)
    read, texts = parse_records(chunk, fields, lambda rec: _document(rec, field, template))
    ids = encode_texts(w.tok, texts)
    head = [] if w.bos_id is None else [w.bos_id]
    tail = [] if w.eos_id is None else [w.eos_id]
    doc_lens = np.fromiter((len(head) + len(x) + len(tail) for x in ids), dtype=np.int64, count=len(ids))
    tokens = concat_ids([part for x in ids for part in (head, x, tail)], w.token_dtype)
    return _ChunkTokens(**vars(read), tokens=tokens, doc_lens=doc_lens)


class RowCutter:
    """Cuts a token stream, fed chunk by chunk, into rows of ``max_seq_len``; the leftover and
    its document pieces are kept between chunks, so a document may span chunks and rows."""

    def __init__(self, max_seq_len: int, token_dtype: str) -> None:
        self.max_seq_len = max_seq_len
        self.dtype = token_dtype
        self.rest = np.zeros(0, dtype=token_dtype)
        self.rest_pieces = np.zeros(0, dtype=np.int64)
        self.rest_starts_doc = True  # does the leftover begin with a document's first token?

    def feed(self, tokens: np.ndarray, doc_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Append a chunk; return the rows now complete at once: ``(input_ids [rows,
        max_seq_len], every row's doc_lens back to back (int32), how many each row has)``."""
        L = self.max_seq_len
        stream = np.concatenate((self.rest, tokens))
        pieces = np.concatenate((self.rest_pieces, doc_lens))
        n_rows = len(stream) // L
        doc_ends = np.cumsum(pieces)
        cut = n_rows * L
        # Boundaries are document ends and row ends; consecutive differences are pieces.
        bounds = np.union1d(doc_ends[doc_ends < cut], np.arange(L, cut + 1, L))
        row_pieces = np.diff(bounds, prepend=0).astype(np.int32)
        counts = np.bincount((bounds - 1) // L, minlength=n_rows) if n_rows else np.zeros(0, np.int64)
        if n_rows:
            self.rest_starts_doc = bool(np.isin(cut, doc_ends))
        ends_after = doc_ends[doc_ends > cut]
        self.rest = stream[cut:]
        self.rest_pieces = np.diff(np.concatenate(([cut], ends_after))) if len(ends_after) else \
            np.zeros(0, dtype=np.int64)
        return stream[:cut].reshape(n_rows, L), row_pieces, counts

    @property
    def tail_documents(self) -> int:
        """Documents that lie wholly in the unwritten tail."""
        return len(self.rest_pieces) - (0 if self.rest_starts_doc else 1)


class _PretrainRows(RowBuilder):
    """Cuts the token stream into rows with one loss span over the whole row."""

    def __init__(self, setup: Setup, options: PretrainOptions, manifest: Manifest) -> None:
        self.counts = manifest.counts
        self.dtype = setup.token_dtype
        self.cutter = RowCutter(options.max_seq_len, setup.token_dtype)
        self.full_span = np.asarray([0, options.max_seq_len], dtype=np.int32)

    def add(self, result: _ChunkTokens) -> Iterator[dict]:
        self.counts.documents_written += len(result.doc_lens)
        for batch in self._rows(result.tokens, result.doc_lens):  # a chunk's rows: few, written one by one
            yield from batch.rows()

    def _rows(self, tokens: np.ndarray, lens: np.ndarray) -> Iterator[RowBatch]:
        """The rows completed, as one batch (a chunk's worth: thousands of rows at once)."""
        ids, pieces, counts = self.cutter.feed(tokens, lens)
        n = len(ids)
        if n:
            self.counts.rows += n
            yield RowBatch(ids.astype(self.dtype, copy=False), np.tile(self.full_span, n),
                           np.full(n, len(self.full_span), dtype=np.int64), pieces, counts)

    def progress(self, result: _ChunkTokens) -> tuple[int, int]:
        return len(result.doc_lens), int(result.doc_lens.sum())

    def close(self) -> None:
        c = self.counts
        c.tokens = c.loss_tokens = c.rows * self.cutter.max_seq_len
        c.tail_tokens = len(self.cutter.rest)
        c.documents_written -= self.cutter.tail_documents


def _manifest_options(options: PretrainOptions, setup: Setup) -> dict[str, Any]:
    d = options.to_manifest()
    d.update(separators={'bos': setup.bos_id is not None, 'eos': setup.eos_id is not None,
                         'policy': '[BOS] + document + [EOS] per document; BOS iff the tokenizer '
                                   'adds BOS unless overridden'})
    return d


PRETRAIN = Converter(kind='pretrain', noun='documents', encode_chunk=_encode_chunk, parallel='threads',
                     builder=_PretrainRows, manifest_options=_manifest_options)


def convert_pretrain(inputs: list[str], out: 'OutSpec', options: PretrainOptions) -> Manifest:
    """Convert pretraining corpora in ``inputs`` to MDS shards plus manifest in ``out``."""
    if options.bos is False and not options.eos:
        raise UserError('--no-bos with --no-eos would join documents with no separator; '
                         'keep at least one of BOS and EOS')
    return convert(PRETRAIN, inputs, out, options)
