"""LLM-Foundry token shards read in place: their ``tokens`` rows as foundrymix rows, no copy.

The row length comes from shard 0 and every shard's size in ``index.json`` must match it, so
rows x length is exact. Each row becomes what ``foundrymix adopt`` would write; nothing is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from foundrymix.format.advice import COLUMN, shard_dtype
from foundrymix.format.schema import SCHEMA_VERSION, Counts, Manifest, TokenizerInfo, token_dtype_for
from foundrymix.format.mds import ndarray_rows
from foundrymix.format.streaming_format import ShardRows


@dataclass(frozen=True)
class Layout:
    """What every row of a token stream is: ``length`` tokens stored as ``dtype``."""

    length: int
    dtype: str
    row_bytes: int    # one row's bytes in a shard (its encoding included)
    header: int       # a shard's bytes before its offset table ends, less 4 x (rows + 1)

    def shard_bytes(self, rows: int) -> int:
        return self.header + 4 * (rows + 1) + rows * self.row_bytes


def shard0_layout(data: bytes, shard: dict[str, Any], where: str) -> tuple[Layout, np.ndarray]:
    """The rows' layout and the tokens (``[rows, length]``) of shard 0 from its raw bytes;
    refuses rows of several lengths."""
    n = int(shard['samples'])
    offsets = np.frombuffer(data[4:4 + 4 * (n + 1)], np.uint32).astype(np.int64)
    sizes = np.diff(offsets)
    if n == 0 or len(set(sizes.tolist())) != 1:
        raise ValueError(f'{where}: rows of {len(set(sizes.tolist()))} sizes in its first shard; LLM-Foundry '
                         f'token rows used in place must all be one length: adopt it (`foundrymix adopt`)')
    dtype = str(shard_dtype(shard))
    tokens = ndarray_rows(data, shard)  # one view of every row (ndarray encodings)
    if tokens is None:  # LLM-Foundry's older bytes column: int64 values as raw bytes
        rows = ShardRows(shard, data)
        tokens = np.stack([np.frombuffer(rows[r][COLUMN], dtype) for r in range(n)])
    layout = Layout(length=int(tokens.shape[1]), dtype=dtype, row_bytes=int(sizes[0]),
                    header=int(offsets[0]) - 4 * (n + 1))
    return layout, tokens


def document_rule(tokens: np.ndarray, eos_id: Optional[int], bos_id: Optional[int]) -> tuple[str, Optional[int]]:
    """How documents are marked in a token stream: ``('eos', id)`` when an EOS comes first
    (documents end after each), ``('bos', id)`` when a BOS not after an EOS does (documents
    start at each), else ``('none', None)`` (each row is one document)."""
    tail = tokens[1:]
    eos = np.flatnonzero(tail == eos_id) if eos_id is not None else tail[:0]
    bos = np.flatnonzero(tail == bos_id) if bos_id is not None else tail[:0]
    bos = bos[tokens[bos] != eos_id] if len(bos) else bos
    if len(eos) and (not len(bos) or eos[0] < bos[0]):
        return 'eos', eos_id
    if len(bos):
        return 'bos', bos_id
    return 'none', None


def in_place_manifest(index: dict[str, Any], shard0: bytes, tokenizer: TokenizerInfo,
                      where: str) -> Manifest:
    """The manifest a token directory would have if converted: rows and tokens from
    ``index.json``, the row length and document rule from shard 0's bytes (``shard0``), the
    converted dtype for ``tokenizer``. ValueError (naming ``where``) for rows of another length."""
    layout, rows0 = shard0_layout(shard0, index['shards'][0], where)
    uneven = [s['raw_data']['basename'] for s in index['shards']  # not rows of the layout's one size
              if int(s['raw_data']['bytes']) != layout.shard_bytes(int(s['samples'])) or shard_dtype(s) != layout.dtype]
    if uneven:
        raise ValueError(f"{where}: {', '.join(uneven[:3])}{' ...' if len(uneven) > 3 else ''}: rows of "
                         f"another length than shard 0's {layout.length} tokens; LLM-Foundry token rows "
                         f"used in place must all be one length: adopt them (`foundrymix adopt DIR --tokenizer "
                         f"NAME_OR_DIR --out OUT`)")
    rule, separator = document_rule(rows0.reshape(-1), tokenizer.eos_id, tokenizer.bos_id)
    rows = sum(int(s['samples']) for s in index['shards'])
    tokens = rows * layout.length
    hashes = set.intersection(*[set(s.get('raw_data', {}).get('hashes') or {}) for s in index['shards']])
    return Manifest(
        kind='pretrain', max_seq_len=layout.length, token_dtype=token_dtype_for(tokenizer.vocab_size),
        tokenizer=tokenizer, counts=Counts(rows=rows, tokens=tokens, loss_tokens=tokens),
        options={'format': 'llm-foundry-tokens', 'documents': rule, 'separator': separator,
                 'file_dtype': layout.dtype, 'hashes': sorted(hashes)},
        schema_version=SCHEMA_VERSION, created_by='LLM-Foundry tokens, used in place')


def foundry_row(value: Any, dtype: str, rule: str, separator: Optional[int], length: int,
                token_dtype: Optional[str] = None) -> dict[str, np.ndarray]:
    """A stored ``tokens`` row as a foundrymix row, its tokens as ``token_dtype`` (as converted)."""
    tokens = np.frombuffer(value, dtype=dtype) if isinstance(value, (bytes, bytearray)) else np.asarray(value)
    if tokens.size != length:
        raise ValueError(f'a row of {tokens.size} tokens, the stream\'s rows have {length}')
    if token_dtype is not None and tokens.dtype != token_dtype:
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > np.iinfo(token_dtype).max):
            raise ValueError(f'token ids {int(tokens.min())}..{int(tokens.max())} are outside the '
                             f'tokenizer\'s vocabulary')
        tokens = tokens.astype(token_dtype)
    if rule == 'eos':
        cuts = np.flatnonzero(tokens[:-1] == separator) + 1
    elif rule == 'bos':
        cuts = np.flatnonzero(tokens[1:] == separator) + 1
    else:
        cuts = np.zeros(0, np.int64)
    bounds = np.concatenate(([0], cuts, [length]))
    return {'input_ids': tokens, 'loss_spans': np.array([0, length], np.int32),
            'doc_lens': np.diff(bounds).astype(np.int32)}
