"""MDS datasets written as LLM-Foundry 0.22 and streaming write them, for the adopt tests.

LLM-Foundry is not installed here, so its converters are mirrored with streaming's own
``MDSWriter`` (the writer Foundry calls):

* :func:`write_foundry_pretrain` mirrors ``scripts/data_prep/convert_dataset_hf.py`` /
  ``convert_dataset_json.py`` with ``--concat_tokens`` (and ``convert_text_to_mds.py``):
  columns ``{'tokens': 'ndarray:int32'}``; rows from ``llmfoundry.data.data.
  ConcatTokensDataset.__iter__``: each text is tokenized with the tokenizer's defaults
  (``tokenizer(text, truncation=False, padding=False)``, so its own BOS if it adds one),
  ``bos_tokens + ids + eos_tokens`` is appended to one buffer (``bos_tokens``/``eos_tokens``
  are ``--bos_text``/``--eos_text`` tokenized without special tokens), every full window
  of ``max_length`` is emitted as ``np.int32`` and the tail after the last window is dropped.
* :func:`write_foundry_finetune` mirrors ``convert_finetuning_dataset.py`` without a
  tokenizer: ``{'prompt': 'str', 'response': 'str'}`` under ``<out>/<split>/``.
* :func:`write_foundry_turns` mirrors ``convert_finetuning_dataset.py`` with a tokenizer:
  ``{'turns': 'json'}``, each example's turns as ``llmfoundry.data.finetuning.tasks``
  tokenizes a prompt/response pair: ``{'input_ids': tokenizer(prompt)['input_ids'],
  'labels': tokenizer(response, add_special_tokens=False)['input_ids'] + [eos]}``.
* :func:`write_raw_text` is streaming's own raw-text layout: ``{'text': 'str'}``, zstd.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

import numpy as np
from streaming import MDSWriter

from foundrymix.tokenizer import load_tokenizer


def concat_tokens(texts: Iterable[str], tokenizer: str, max_length: int, bos_text: str = '',
                  eos_text: str = '') -> list[np.ndarray]:
    """``ConcatTokensDataset`` rows (``no_wrap=False``, the default)."""
    tok = load_tokenizer(tokenizer)
    bos = tok(bos_text, truncation=False, padding=False, add_special_tokens=False)['input_ids']
    eos = tok(eos_text, truncation=False, padding=False, add_special_tokens=False)['input_ids']
    buffer: list[int] = []
    rows = []
    for text in texts:
        ids = tok(text, truncation=False, padding=False)['input_ids']
        buffer += bos + ids + eos
        start = 0  # Foundry slices ``buffer = buffer[max_length:]`` per window; same windows
        while len(buffer) - start >= max_length:
            rows.append(np.asarray(buffer[start:start + max_length], dtype=np.int32))
            start += max_length
        buffer = buffer[start:]
    return rows


def write_foundry_pretrain(out: Path, rows: list[np.ndarray], compression: Optional[str] = 'zstd',
                           size_limit: int | str = '64mb') -> Path:
    with MDSWriter(out=str(out), columns={'tokens': 'ndarray:int32'}, compression=compression,
                   size_limit=size_limit) as w:
        for row in rows:
            w.write({'tokens': row})
    return out


def write_foundry_finetune(root: Path, splits: dict[str, list[dict]],
                           compression: Optional[str] = None) -> Path:
    for split, records in splits.items():
        with MDSWriter(out=str(root / split), columns={'prompt': 'str', 'response': 'str'},
                       compression=compression) as w:
            for rec in records:
                w.write({'prompt': rec['prompt'], 'response': rec['response']})
    return root


def write_raw_text(out: Path, texts: list[str], size_limit: int | str = '64mb') -> Path:
    with MDSWriter(out=str(out), columns={'text': 'str'}, compression='zstd', size_limit=size_limit) as w:
        for t in texts:
            w.write({'text': t})
    return out


def write_foundry_turns(out: Path, records: list[dict], tokenizer: str) -> Path:
    tok = load_tokenizer(tokenizer)
    with MDSWriter(out=str(out), columns={'turns': 'json'}) as w:
        for rec in records:
            labels = tok(rec['response'], add_special_tokens=False)['input_ids'] + [tok.eos_token_id]
            w.write({'turns': [{'input_ids': tok(rec['prompt'])['input_ids'], 'labels': labels}]})
    return out
