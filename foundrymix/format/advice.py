"""What to say about a directory that is not a foundrymix dataset: a folder of splits, or MDS
written by another tool (LLM-Foundry token shards can be trained in place; anything else is
adopted first). Every suggestion here is a command or key that works as written. It is the bottom
of ``format``: it recognises a directory by its files (manifest name, token shards) and imports no
other module of the package, so ``schema`` can advise when a manifest is missing."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

#: the file that makes a directory a foundrymix dataset (format/schema.py reads it)
MANIFEST_NAME = 'foundrymix.json'
#: LLM-Foundry's pretraining column
COLUMN = 'tokens'
_INT_DTYPES = ('int8', 'int16', 'int32', 'int64', 'uint8', 'uint16', 'uint32', 'uint64')


def is_foundry_tokens(index: dict[str, Any]) -> bool:
    """Every shard of ``index`` holds exactly one ``tokens`` column of integers (or bytes)."""
    shards = index.get('shards') or []
    return bool(shards) and all(s.get('column_names') == [COLUMN] and shard_dtype(s) is not None for s in shards)


def shard_dtype(shard: dict[str, Any]) -> Optional[str]:
    """The integer dtype of a token shard's one column, None if it is not integers."""
    encoding = (shard.get('column_encodings') or [''])[0]
    if encoding == 'bytes':
        return 'int64'  # LLM-Foundry's older writer: np.int64 tokens as raw bytes
    parts = encoding.split(':')
    if parts[0] == 'ndarray' and len(parts) >= 2 and parts[1] in _INT_DTYPES:
        return parts[1]
    return None


#: where the tokenizer of LLM-Foundry token shards read in place is given (plan/catalog reads them)
IN_PLACE_TOKENIZER = ('the tokenizer they were made with (stream key tokenizer: NAME_OR_DIR, or '
                      'train_loader.tokenizer, or a top-level tokenizer:)')
#: what adopt needs of token shards: they do not record their tokenizer (its EOS/BOS ids cut documents)
_TOKENIZER_FLAG = ' --tokenizer NAME_OR_DIR'


def read_index_or_none(path: str) -> Optional[dict[str, Any]]:
    """``index.json`` at ``path`` as read, ``{}`` if it does not parse, None if there is none."""
    try:
        with open(path, encoding='utf-8') as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def splits_advice(directory: str) -> Optional[str]:
    """For a local folder of splits (adopt's output, LLM-Foundry's ``--out_root``): which
    splits it holds and what to give instead; None when it holds none."""
    try:
        names = sorted(e.name for e in os.scandir(directory) if e.is_dir() and not e.name.startswith('.'))
    except OSError:
        return None
    ours = [n for n in names if os.path.isfile(os.path.join(directory, n, MANIFEST_NAME))]
    theirs = [n for n in names if n not in ours and os.path.isfile(os.path.join(directory, n, 'index.json'))]
    if ours:
        return (f'{directory!r} is a folder of splits ({", ".join(ours)}: foundrymix datasets); '
                f'give one of them, e.g. {os.path.join(directory, ours[0])}')
    if theirs:
        tokens = all(is_foundry_tokens(read_index_or_none(os.path.join(directory, n, 'index.json')) or {})
                     for n in theirs)
        adopt = (f'make foundrymix datasets of them with `foundrymix adopt {directory}'
                 f'{_TOKENIZER_FLAG if tokens else ""} --out DIR` (each split goes to DIR/<split>) and '
                 f'give one of those')
        if tokens:
            return (f'{directory!r} is a folder of splits ({", ".join(theirs)}: LLM-Foundry token shards); '
                    f'train one in place by giving its stream local: {os.path.join(directory, theirs[0])} '
                    f'and {IN_PLACE_TOKENIZER}, or {adopt}')
        return f'{directory!r} is a folder of splits ({", ".join(theirs)}: MDS written by another tool); {adopt}'
    return None


def adopt_advice(directory: str, index: Optional[dict[str, Any]] = None) -> str:
    """What to do with MDS shards that have no manifest (LLM-Foundry's, streaming's own);
    ``index`` (their ``index.json``) tells LLM-Foundry token shards, which train in place."""
    if index and is_foundry_tokens(index):
        adopt = f'`foundrymix adopt {directory}{_TOKENIZER_FLAG} --out DIR` and use DIR'
        return (f'{directory!r} holds LLM-Foundry token shards (one tokens column): train them in place '
                f'by giving their stream {IN_PLACE_TOKENIZER}, or make a foundrymix dataset of them '
                f'with {adopt}')
    return (f'{directory!r} holds MDS shards (index.json) written by another tool: make it a foundrymix '
            f'dataset with `foundrymix adopt {directory} --out DIR` and use DIR')
