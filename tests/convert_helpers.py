"""Helpers for the converter tests: read rows back and tokenize the reference independently."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
from streaming import LocalDataset

from foundrymix.tokenizer import load_tokenizer


def read_rows(directory: str | Path) -> list[dict[str, np.ndarray]]:
    ds = LocalDataset(local=str(directory))
    return [ds[i] for i in range(len(ds))]


def read_jsonl(path: str | Path, limit: int | None = None) -> list[dict]:
    with open(path, encoding='utf-8') as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[:limit]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text(''.join(json.dumps(r) + '\n' for r in records), encoding='utf-8')
    return path


def ids(tokenizer: str, text: str) -> list[int]:
    """Reference tokenization through the HF Python API (not the converter's path)."""
    return load_tokenizer(tokenizer)(text, add_special_tokens=False)['input_ids']


def spans(row: dict) -> list[tuple[int, int]]:
    return [tuple(s) for s in np.asarray(row['loss_spans']).reshape(-1, 2).tolist()]


def tree_hash(root) -> dict[str, str]:
    """Every entry below ``root``: files by content hash, links by target, directories by name."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = 'link:' + os.readlink(p)
            elif os.path.isfile(p):
                with open(p, 'rb') as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
            else:
                out[rel] = 'dir'
    return out
