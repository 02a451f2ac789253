"""``--holdout``: a held-out eval split decided by each record's content alone.

A record goes to ``eval`` when the sha256 of its JSON (keys sorted) is below ``fraction`` of the
range, or among the ``count`` smallest: the split is the same for any workers, chunking or order,
and duplicates share a side. One run per side (``OUT/eval``, then ``OUT/train``), each keeping its
side before ``--preprocess``; an unreadable record is counted once, in train.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import json
import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from foundrymix.convert.readers import BadRecord, Chunk, plan_chunks, read_records
from foundrymix.errors import UserError

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
    try:
        if text.endswith('%'):
            fraction = float(text[:-1]) / 100
        elif re.fullmatch(r'\d+', text):
            count = int(text)
            if count <= 0:
                raise UserError(bad)
            return Holdout(spec=text, count=count)
        else:
            fraction = float(text)
    except ValueError:
        raise UserError(bad) from None
    if not 0 < fraction < 1:
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
    return dataclasses.replace(holdout, cutoff=f'{cutoff:064x}')


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
