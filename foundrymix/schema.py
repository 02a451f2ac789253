"""The one sample schema every foundrymix stream uses, and the manifest beside its shards.

Why one schema: LLM-Foundry's pretrain loader reads ``tokens`` and its finetune loader
reads ``input_ids``/``labels`` columns of varying length, so the two kinds of stream
cannot share a loader. Here every MDS row, pretrain or finetune, is exactly
``max_seq_len`` tokens plus two small integer arrays that say where the loss is and
where documents start. Because every row has the same length and meaning, weights by
rows are weights by tokens, and per-stream token counts are exact arithmetic.

MDS columns (see :data:`COLUMNS`):

* ``input_ids``  -- ``ndarray:<uint16|uint32>:<max_seq_len>``: the tokens, padding
  included (padding uses the pad id recorded in the manifest).
* ``loss_spans`` -- ``ndarray:int32``: flat ``[start0, end0, start1, end1, ...]``
  half-open position ranges whose tokens are loss targets (``labels == input_ids``
  there, ``-100`` elsewhere). Pretrain rows have one span covering the whole row.
* ``doc_lens``   -- ``ndarray:int32``: lengths of the consecutive segments (documents
  or packed examples) that make up the non-padding part of the row, in order; their
  sum is the number of real tokens, the rest of the row is padding.

Labels use the Hugging Face convention: ``labels[i]`` is the target *at* position ``i``
and the model shifts internally, so a span ``[s, e)`` means tokens ``s..e-1`` are
predicted (from the tokens before them).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Optional

import numpy as np

SCHEMA_VERSION = 1
MANIFEST_NAME = 'foundrymix.json'
IGNORE_INDEX = -100

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


COLUMN_NAMES = ('input_ids', 'loss_spans', 'doc_lens')


@dataclass(frozen=True)
class TokenizerInfo:
    """What identifies a tokenizer: streams may be mixed only if these agree.

    ``fingerprint`` is a SHA-256 over the tokenizer's canonical serialization and its
    special-token settings, so two copies of the same tokenizer from different paths
    agree and a retrained one does not.
    """

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


@dataclass
class Counts:
    """Exact counts of what a conversion read and wrote.

    ``tokens`` counts real (non-padding) tokens in rows; ``rows * max_seq_len ==
    tokens + pad_tokens``. For pretrain, ``tail_tokens`` are the tokens after the last
    full row, which are not written (counted, never silently lost).
    """

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
            raise FileNotFoundError(
                f'{path}: no foundrymix manifest. Is {directory!r} a foundrymix output directory '
                f'(made by `foundrymix convert`)?')
        with open(path, encoding='utf-8') as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f'{path}: manifest is not valid JSON: {e}') from e
        try:
            return cls.from_dict(data)
        except (KeyError, TypeError) as e:
            raise ValueError(f'{path}: manifest is missing or has a bad field: {e}') from e


def encode_row(input_ids: np.ndarray, loss_spans: list[tuple[int, int]] | np.ndarray,
               doc_lens: list[int] | np.ndarray, token_dtype: str) -> dict[str, np.ndarray]:
    """Build one MDS row dict from its parts (the inverse of :func:`decode_row`)."""
    spans = np.asarray(loss_spans, dtype=np.int32).reshape(-1)
    return {
        'input_ids': np.asarray(input_ids, dtype=token_dtype),
        'loss_spans': spans,
        'doc_lens': np.asarray(doc_lens, dtype=np.int32).reshape(-1),
    }


#: decoded keys, in the order of the rows of the per-sample block
DECODED_KEYS = ('input_ids', 'labels', 'attention_mask', 'sequence_id', 'position_ids')
_ARANGE = np.arange(1 << 16, dtype=np.int64)


def decode_row(row: dict[str, Any]) -> dict[str, np.ndarray]:
    """Turn a stored MDS row into model inputs (all ``int64`` arrays of ``max_seq_len``).

    Returns ``input_ids``, ``labels`` (``-100`` outside loss spans), ``attention_mask``
    (0 on padding), ``sequence_id`` (segment index per token, ``-1`` on padding) and
    ``position_ids`` (restarting at 0 in every segment, 0 on padding), so attention and
    positions can stay inside one document or packed example.

    It runs once per sample in the DataLoader workers, so it is written for speed: one
    ``(5, L)`` allocation and a slice write per segment and span (rows hold few), which
    costs several times less than whole-row ``repeat``/``cumsum`` arithmetic.
    """
    ids = np.asarray(row['input_ids'])
    seq_len = ids.shape[0]
    block = np.empty((5, seq_len), dtype=np.int64)
    input_ids, labels, attention_mask, sequence_id, position_ids = block
    input_ids[:] = ids
    labels.fill(IGNORE_INDEX)
    spans = np.asarray(row['loss_spans']).reshape(-1).tolist()
    for i in range(0, len(spans) - 1, 2):
        start, end = spans[i], spans[i + 1]
        labels[start:end] = input_ids[start:end]
    start = 0
    for seg, length in enumerate(np.asarray(row['doc_lens']).reshape(-1).tolist()):
        end = start + length
        sequence_id[start:end] = seg
        position_ids[start:end] = _ARANGE[:length] if length <= _ARANGE.shape[0] else np.arange(length)
        start = end
    attention_mask[:start] = 1
    attention_mask[start:] = 0
    sequence_id[start:] = -1
    position_ids[start:] = 0
    return dict(zip(DECODED_KEYS, block))
