"""The one sample schema every foundrymix stream uses, and the manifest beside its shards.

Every MDS row, pretrain or finetune, is exactly ``max_seq_len`` tokens plus where the loss is
and where documents start, so weights by rows are weights by tokens and token counts are exact.

* ``input_ids``  -- ``ndarray:<uint16|uint32>:<max_seq_len>``: the tokens, padding
  included (padding uses the pad id recorded in the manifest).
* ``loss_spans`` -- ``ndarray:int32``: flat ``[start0, end0, start1, end1, ...]``
  half-open position ranges whose tokens are loss targets (``labels == input_ids``
  there, ``-100`` elsewhere). Pretrain rows have one span covering the whole row.
* ``doc_lens``   -- ``ndarray:int32``: lengths of the consecutive segments (documents
  or packed examples) that make up the non-padding part of the row, in order; their
  sum is the number of real tokens, the rest of the row is padding.

Labels follow Hugging Face: ``labels[i]`` is the target at position ``i`` (the model shifts).
Schema, encoder/decoder and row checks must agree bitwise, so they are one module.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Optional

import numpy as np

from foundrymix.errors import FoundrymixError, MissingError, UserError
from foundrymix.format.advice import MANIFEST_NAME, adopt_advice, read_index_or_none, splits_advice

SCHEMA_VERSION = 1
IGNORE_INDEX = -100
#: how many skipped-record locations a manifest keeps per reason
SKIP_LOCATIONS = 10

Kind = Literal['pretrain', 'finetune']


def token_dtype_for(vocab_size: int) -> str:
    """Smallest unsigned dtype that holds every id of a vocabulary of ``vocab_size``."""
    if vocab_size <= 0:
        raise ValueError(f'vocab_size must be positive, got {vocab_size}')
    return 'uint16' if vocab_size <= 1 << 16 else 'uint32'


def mds_columns(max_seq_len: int, token_dtype: str) -> dict[str, str]:
    """MDS column encodings for rows of ``max_seq_len`` tokens stored as ``token_dtype``."""
    return {
        'input_ids': f'ndarray:{token_dtype}:{max_seq_len}',
        'loss_spans': 'ndarray:int32',
        'doc_lens': 'ndarray:int32',
    }


@dataclass(frozen=True)
class TokenizerInfo:
    """What identifies a tokenizer: streams may be mixed only if these agree. ``fingerprint``
    hashes the serialization and special tokens: copies agree, a retrained one does not."""

    name: str
    vocab_size: int
    fingerprint: str
    bos_id: Optional[int]
    eos_id: int
    pad_id: int
    add_bos: bool

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> 'TokenizerInfo':
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


def tokenizer_differences(one: TokenizerInfo, other: TokenizerInfo) -> str:
    """What differs between two tokenizers (sizes, special ids, BOS, fingerprints), ``one`` first."""
    parts = [f'{label} {getattr(one, key)} vs {getattr(other, key)}'
             for label, key in (('vocabulary', 'vocab_size'), ('BOS id', 'bos_id'), ('EOS id', 'eos_id'),
                                ('pad id', 'pad_id'), ('adds BOS', 'add_bos'))
             if getattr(one, key) != getattr(other, key)]
    if not parts:
        parts.append('same vocabulary size and special ids, other tokens, merges or normalization')
    return '; '.join(parts + [f'fingerprint {one.fingerprint[:12]} vs {other.fingerprint[:12]}'])


def changed_tokenizer_note(name: str, streams: TokenizerInfo) -> str:
    """If refused tokenizer ``name`` is the streams' own (it changed since), say so and what to do."""
    same = name == streams.name or (os.path.abspath(os.path.expanduser(name))
                                    == os.path.abspath(os.path.expanduser(streams.name)))
    if not same:
        return ''
    return (f'; {streams.name} changed since the streams were converted with it: re-convert them '
            f'(foundrymix convert ... --tokenizer {streams.name} --overwrite), or restore the tokenizer '
            f'they were converted with')


@dataclass
class Counts:
    """Exact counts of what a conversion read and wrote: ``rows * max_seq_len == tokens +
    pad_tokens``; pretrain's ``tail_tokens`` after the last full row are counted, not written."""

    rows: int = 0
    tokens: int = 0
    pad_tokens: int = 0
    loss_tokens: int = 0
    documents_read: int = 0
    documents_written: int = 0
    tail_tokens: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> 'Counts':
        return cls(**{k: int(d.get(k, 0)) for k in cls.__dataclass_fields__})


@dataclass
class Manifest:
    """``foundrymix.json``: what a directory of MDS shards holds and how it was made."""

    kind: Kind
    max_seq_len: int
    token_dtype: str
    tokenizer: TokenizerInfo
    counts: Counts = field(default_factory=Counts)
    dropped: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    #: where the first skipped records of each reason were (``file:line``), so they can be
    #: found and fixed; at most ``SKIP_LOCATIONS`` per reason (absent in older manifests)
    skipped_at: dict[str, list[str]] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    created_by: str = 'foundrymix'

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + '\n'

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> 'Manifest':
        return cls(
            kind=d['kind'],
            max_seq_len=int(d['max_seq_len']),
            token_dtype=d['token_dtype'],
            tokenizer=TokenizerInfo.from_dict(d['tokenizer']),
            counts=Counts.from_dict(d.get('counts', {})),
            dropped={k: int(v) for k, v in d.get('dropped', {}).items()},
            skipped={k: int(v) for k, v in d.get('skipped', {}).items()},
            skipped_at={k: [str(x) for x in v] for k, v in (d.get('skipped_at') or {}).items()},
            inputs=list(d.get('inputs', [])),
            options=dict(d.get('options', {})),
            schema_version=int(d.get('schema_version', -1)),
            created_by=d.get('created_by', ''),
        )

    @classmethod
    def read(cls, directory: str) -> 'Manifest':
        """Read the manifest of a local shard directory; a clear error if it is missing."""
        path = os.path.join(directory, MANIFEST_NAME)
        if not os.path.isfile(path):
            index = read_index_or_none(os.path.join(directory, 'index.json'))
            if index is not None:  # MDS from another tool
                raise MissingError(f'{path}: no foundrymix manifest; {adopt_advice(directory, index)}')
            raise MissingError(f'{path}: no foundrymix manifest. ' + (splits_advice(directory) or (
                f'Is {directory!r} a foundrymix output directory (made by `foundrymix convert`)?')))
        with open(path, encoding='utf-8') as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise UserError(f'{path}: manifest is not valid JSON: {e}') from e
        try:
            return cls.from_dict(data)
        except (KeyError, TypeError) as e:
            raise UserError(f'{path}: manifest is missing or has a bad field: {e}') from e


def encode_row(input_ids: np.ndarray, loss_spans: list[tuple[int, int]] | np.ndarray,
               doc_lens: list[int] | np.ndarray, token_dtype: str) -> dict[str, np.ndarray]:
    """Build one MDS row dict from its parts (the inverse of :func:`decode_row`)."""
    spans = np.asarray(loss_spans, dtype=np.int32).reshape(-1)
    return {
        'input_ids': np.asarray(input_ids, dtype=token_dtype),
        'loss_spans': spans,
        'doc_lens': np.asarray(doc_lens, dtype=np.int32).reshape(-1),
    }


@dataclass(frozen=True)
class RowBatch:
    """Consecutive rows as whole arrays, written byte for byte as their :func:`encode_row` dicts.

    ``input_ids`` is ``[rows, max_seq_len]``; ``loss_spans``/``doc_lens`` are every row's values
    back to back, each row's count in ``*_counts``."""

    input_ids: np.ndarray
    loss_spans: np.ndarray
    loss_span_counts: np.ndarray
    doc_lens: np.ndarray
    doc_len_counts: np.ndarray

    def __len__(self) -> int:
        return len(self.input_ids)

    def columns(self) -> dict[str, Any]:
        """Column name -> a 2-D array (one row each) or ``(values, counts)`` (ragged)."""
        return {'input_ids': self.input_ids, 'loss_spans': (self.loss_spans, self.loss_span_counts),
                'doc_lens': (self.doc_lens, self.doc_len_counts)}

    def rows(self) -> list[dict[str, np.ndarray]]:
        """The same rows as :func:`encode_row` dicts (for writers without :meth:`write_batch`)."""
        spans = np.split(self.loss_spans, np.cumsum(self.loss_span_counts)[:-1])
        docs = np.split(self.doc_lens, np.cumsum(self.doc_len_counts)[:-1])
        return [{'input_ids': ids, 'loss_spans': s, 'doc_lens': d}
                for ids, s, d in zip(self.input_ids, spans, docs)]


def rows_of(item: dict[str, np.ndarray] | RowBatch) -> list[dict[str, np.ndarray]]:
    """The row dicts of what a row builder yields: one row, or a :class:`RowBatch`."""
    return item.rows() if isinstance(item, RowBatch) else [item]


def check_row(row: dict[str, Any], vocab_size: Optional[int] = None,
              max_seq_len: Optional[int] = None) -> Optional[str]:
    """What is wrong with a stored row, or ``None`` if it keeps the schema: ``max_seq_len`` ids in
    ``[0, vocab_size)``, ``doc_lens`` non-negative summing to at most the row, spans inside it
    (``None`` skips that check). Cheap enough for every row read; flips into valid ids need hashes."""
    try:
        ids, spans, lens = row['input_ids'], row['loss_spans'], row['doc_lens']
    except KeyError as e:
        return f'no column {e} (not a foundrymix row)'
    if not isinstance(ids, np.ndarray) or ids.ndim != 1:
        return f'input_ids has shape {np.shape(ids)}, expected ({max_seq_len},)'
    n = ids.shape[0]
    if max_seq_len is not None and n != max_seq_len:
        return f'input_ids has {n} tokens, expected max_seq_len {max_seq_len}'
    if n:
        if vocab_size is not None:
            top = int(ids.max())
            if top >= vocab_size:
                pos = int(np.argmax(ids >= vocab_size))
                return (f'token id {top} >= vocabulary size {vocab_size} (first bad id '
                        f'{int(ids[pos])} at position {pos})')
        if ids.dtype.kind == 'i':
            low = int(ids.min())
            if low < 0:
                return f'negative token id {low} at position {int(np.argmax(ids < 0))}'
    lens_list = np.asarray(lens).reshape(-1).tolist()
    if lens_list:
        if min(lens_list) < 0:
            return f'negative document length in doc_lens {_short(lens_list)}'
        if sum(lens_list) > n:
            return f'doc_lens {_short(lens_list)} sum to {sum(lens_list)} > {n} tokens in the row'
    spans_list = np.asarray(spans).reshape(-1).tolist()
    if len(spans_list) % 2:
        return f'loss_spans has odd length {len(spans_list)} {_short(spans_list)}'
    for j in range(0, len(spans_list), 2):
        start, end = spans_list[j], spans_list[j + 1]
        if not 0 <= start <= end <= n:
            return f'loss span [{start}, {end}) is outside 0 <= start <= end <= {n}'
    return None


def _short(values: list) -> str:
    return str(values) if len(values) <= 8 else f'[{", ".join(map(str, values[:8]))}, ...]'


class CorruptRowError(FoundrymixError, ValueError):
    """A stored row that cannot be read or breaks the schema, named by stream, shard and row,
    so a damaged shard stops the run there rather than in the model's embedding.

    Constructible from its message alone (torch's DataLoader re-raises a worker's error as
    ``type(e)(text)``): the fields are parsed back from the worker's text."""

    def __init__(self, text: str = '', *, stream: Optional[str] = None, shard: Optional[str] = None,
                 row: Optional[int] = None, sample_id: Optional[int] = None,
                 problem: Optional[str] = None, directory: Optional[str] = None) -> None:
        found = list(_ROW_ERROR_RE.finditer(text)) if problem is None else []
        if found:  # the last row error line of ``text`` (e.g. a worker's traceback)
            m = found[-1]
            text, stream, shard, problem, directory = m[0], m['stream'], m['shard'], m['problem'], m['sdir'] or m['dir']
            row, sample_id = int(m['row']), int(m['sample']) if m['sample'] is not None else None
        elif problem is not None and not text:
            text = format_row_error(problem, shard=shard, row=row, stream=stream,
                                    sample_id=sample_id, directory=directory)
        super().__init__(text)
        self.stream, self.shard, self.row = stream, shard, row
        self.sample_id, self.problem, self.directory = sample_id, problem, directory


def format_row_error(problem: str, *, shard: Optional[str], row: Optional[int],
                     stream: Optional[str] = None, sample_id: Optional[int] = None,
                     directory: Optional[str] = None) -> str:
    """One line: ``corrupt row: stream 'S' (DIR), shard F, row R (sample N): PROBLEM``."""
    where = []
    if stream is not None:
        where.append(f"stream '{stream}'" + (f' ({directory})' if directory else ''))
    elif directory:
        where.append(directory)
    where.append(f'shard {shard}, row {row}' + (f' (sample {sample_id})' if sample_id is not None else ''))
    problem = ' '.join(str(problem).split())  # one line, so it survives a worker's traceback
    return f"corrupt row: {', '.join(where)}: {problem}"


_ROW_ERROR_RE = re.compile(
    r"corrupt row: (?:stream '(?P<stream>[^']*)'(?: \((?P<sdir>[^)]*)\))?, |(?P<dir>[^,\n]*), )?"
    r"shard (?P<shard>[^,\n]*), row (?P<row>\d+)(?: \(sample (?P<sample>\d+)\))?: "
    r"(?P<problem>[^\n]*)")


#: decoded keys, in the order of the rows of the per-sample block
DECODED_KEYS = ('input_ids', 'labels', 'attention_mask', 'sequence_id', 'position_ids')
_ARANGE = np.arange(1 << 16, dtype=np.int64)


def decode_row(row: dict[str, Any]) -> dict[str, np.ndarray]:
    """A stored row as ``int64`` model inputs: ``input_ids``, ``labels`` (``-100`` outside loss
    spans), ``attention_mask``, ``sequence_id`` (segment per token, ``-1`` on padding) and
    ``position_ids`` (from 0 in each segment). The one-row case of :func:`decode_rows`."""
    ids = np.asarray(row['input_ids'])
    spans = np.asarray(row['loss_spans']).reshape(-1)
    doc_lens = np.asarray(row['doc_lens']).reshape(-1)
    block = np.empty((5, 1, ids.shape[0]), dtype=np.int64)
    decode_rows(ids[None], spans, [spans.size], doc_lens, [doc_lens.size], out=block)
    return dict(zip(DECODED_KEYS, block[:, 0]))


def decode_rows(input_ids: np.ndarray, loss_spans: Any, span_counts: Any, doc_lens: Any,
                doc_counts: Any, out: np.ndarray) -> np.ndarray:
    """:func:`decode_row` for a batch of rows, written into ``out`` (``int64``, ``(5, n, L)``).

    ``loss_spans``/``doc_lens`` are the rows' arrays concatenated, ``*_counts`` each row's share;
    ``out[k]`` holds ``DECODED_KEYS[k]``. Slice writes per span and segment: faster than vectorised.
    """
    n = input_ids.shape[0]
    ids_out, labels, attention_mask, sequence_id, position_ids = out
    ids_out[...] = input_ids
    labels.fill(IGNORE_INDEX)
    attention_mask.fill(0)
    sequence_id.fill(-1)
    position_ids.fill(0)
    spans = np.asarray(loss_spans).reshape(-1).tolist()
    lens = np.asarray(doc_lens).reshape(-1).tolist()
    span_at = doc_at = 0
    for i, n_spans, n_docs in zip(range(n), np.asarray(span_counts).tolist(),
                                  np.asarray(doc_counts).tolist()):
        tokens, row_labels = ids_out[i], labels[i]
        row_spans = spans[span_at:span_at + n_spans]
        span_at += n_spans
        for j in range(0, n_spans - 1, 2):
            start, end = row_spans[j], row_spans[j + 1]
            row_labels[start:end] = tokens[start:end]
        row_seq, row_pos = sequence_id[i], position_ids[i]
        start = 0
        for seg, length in enumerate(lens[doc_at:doc_at + n_docs]):
            end = start + length
            row_seq[start:end] = seg
            row_pos[start:end] = _ARANGE[:length] if length <= _ARANGE.shape[0] else np.arange(length)
            start = end
        doc_at += n_docs
        attention_mask[i, :start] = 1
        row_seq[start:] = -1  # already so, unless a negative length moved ``start`` back
        row_pos[start:] = 0
    return out
