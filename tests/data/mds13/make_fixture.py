"""Writes the MDS fixture in this folder with mosaicml-streaming 0.13 (README.md says why and how).

Run from the repository root in a throwaway venv that holds mosaicml-streaming 0.13 (and so not
streaming-community; both install the ``streaming`` package), plus the two packages foundrymix's
converter imports that 0.13 does not pull in:

    python3 -m venv /tmp/ms13 && /tmp/ms13/bin/pip install 'mosaicml-streaming==0.13.*' rich omegaconf
    PYTHONPATH=$PWD HF_HUB_OFFLINE=1 /tmp/ms13/bin/python tests/data/mds13/make_fixture.py

It rewrites ``foundry_tokens/``, ``text/``, ``foundrymix/`` and ``values.json``: the values it
wrote, which ``tests/format/test_mds_compat.py`` compares with what foundrymix reads. The
suite never runs this script.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from streaming import MDSWriter, StreamingDataset
from transformers import AutoTokenizer

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
TOKENIZER_DIR = ROOT / 'foundrymix' / 'assets' / 'tokenizers' / 'foundrymix-bpe-8k'
MAX_LENGTH = 32     # --concat_tokens of the Foundry dataset, --max-seq-len of the foundrymix one
SIZE_LIMIT = 700    # bytes: a few shards of this tiny data (Foundry passes none: 64 MB, one shard)

TEXTS = [
    'The quick brown fox jumps over the lazy dog while the cat sleeps on the warm windowsill.',
    'Streaming datasets split a corpus into shards, each with its own header and row offsets.',
    'Résumé, naïve café, Straße: non-ASCII text must survive tokenization and storage unchanged.',
    'def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5',
    'In 1969 the first humans walked on the Moon; 53 years later the rovers still roll on Mars.',
    'Short.',
    'A longer paragraph about mixing data: each stream contributes rows in proportion to its '
    'weight, and an exact plan says how many rows of each one a run trains before it starts.',
    'Tokens, rows and shards: the three units a data loader counts when it resumes mid-epoch.',
]


def concat_tokens(tokenizer, texts: list[str], max_length: int, eos_text: str) -> list[np.ndarray]:
    """LLM-Foundry 0.22's ``ConcatTokensDataset.__iter__`` (llmfoundry/data/data.py, wrapping on,
    no --bos_text): each text tokenized with the tokenizer's defaults, the --eos_text ids (no
    special tokens) after it, every full window of ``max_length`` emitted as int32, the tail
    after the last window dropped."""
    eos_tokens = tokenizer(eos_text, truncation=False, padding=False, add_special_tokens=False)['input_ids']
    buffer: list[int] = []
    rows = []
    for text in texts:
        iids = tokenizer(text, truncation=False, padding=False)['input_ids']
        buffer = buffer + iids + eos_tokens
        while len(buffer) >= max_length:
            rows.append(np.asarray(buffer[:max_length], dtype=np.int32))
            buffer = buffer[max_length:]
    return rows


def write_foundry_tokens(out: Path) -> list[list[int]]:
    """As ``convert_dataset_json --concat_tokens 32 --tokenizer <bundled bpe> --eos_text
    '<|endoftext|>' --compression zstd`` writes it (llmfoundry/command_utils/data_prep/
    convert_dataset_json.py): ``AutoTokenizer.from_pretrained`` with ``model_max_length`` lifted,
    one ``tokens: ndarray:int32`` column; only ``size_limit`` is added, for several shards."""
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    tokenizer.model_max_length = int(1e30)
    rows = concat_tokens(tokenizer, TEXTS, MAX_LENGTH, '<|endoftext|>')
    with MDSWriter(columns={'tokens': 'ndarray:int32'}, out=str(out), compression='zstd',
                   size_limit=SIZE_LIMIT) as w:
        for row in rows:
            w.write({'tokens': row})
    return [row.tolist() for row in rows]


def write_text(out: Path) -> list[str]:
    """streaming's raw-text layout (``text: str``), uncompressed, with two shard hashes."""
    with MDSWriter(columns={'text': 'str'}, out=str(out), hashes=['sha1', 'xxh3_64'], size_limit=SIZE_LIMIT) as w:
        for text in TEXTS:
            w.write({'text': text})
    return list(TEXTS)


def write_foundrymix(out: Path) -> list[dict[str, list[int]]]:
    """``foundrymix convert pretrain`` of the texts, zstd (so through 0.13's ``MDSWriter``) with
    sha1 and xxh3_64; the rows as 0.13's own ``StreamingDataset`` reads them back (from a copy:
    it decompresses shards beside the compressed ones)."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / 'texts.jsonl').write_text(''.join(json.dumps({'text': t}) + '\n' for t in TEXTS),
                                               encoding='utf-8')
        subprocess.run([sys.executable, '-m', 'foundrymix.cli', 'convert', 'pretrain', 'texts.jsonl', '--out', str(out),
                        '--max-seq-len', str(MAX_LENGTH), '--compression', 'zstd', '--hash', 'sha1',
                        '--size-limit', f'{SIZE_LIMIT}b', '--workers', '1', '--no-progress'], check=True, cwd=tmp,
                       env={**os.environ, 'PYTHONPATH': str(ROOT), 'HF_HUB_OFFLINE': '1'})
        copy = shutil.copytree(out, Path(tmp) / 'copy')
        ds = StreamingDataset(local=str(copy), batch_size=1, shuffle=False)
        return [{k: np.asarray(ds[i][k]).tolist() for k in ('input_ids', 'loss_spans', 'doc_lens')}
                for i in range(len(ds))]


def main() -> None:
    version = metadata.version('mosaicml-streaming')
    assert version.startswith('0.13.'), f'mosaicml-streaming {version}: run this in a venv with 0.13'
    try:
        metadata.version('streaming-community')
        sys.exit('streaming-community is installed here too: use a venv with mosaicml-streaming 0.13 only')
    except metadata.PackageNotFoundError:
        pass
    for name in ('foundry_tokens', 'text', 'foundrymix'):
        shutil.rmtree(HERE / name, ignore_errors=True)
    values = {
        'made_with': {d: metadata.version(d) for d in ('mosaicml-streaming', 'transformers', 'numpy')},
        'foundry_tokens': {'max_length': MAX_LENGTH, 'eos_text': '<|endoftext|>', 'tokenizer': 'foundrymix-bpe-8k',
                           'rows': write_foundry_tokens(HERE / 'foundry_tokens')},
        'text': {'texts': write_text(HERE / 'text')},
        'foundrymix': {'max_seq_len': MAX_LENGTH, 'rows': write_foundrymix(HERE / 'foundrymix')},
    }
    text = json.dumps(values, indent=1, ensure_ascii=False)
    text = re.sub(r'\[[\d,\s]*\]', lambda m: json.dumps(json.loads(m.group())), text)  # a row on one line
    (HERE / 'values.json').write_text(text + '\n', encoding='utf-8')
    for name in ('foundry_tokens', 'text', 'foundrymix'):
        print(name, sorted(os.listdir(HERE / name)))
    print('made with', values['made_with'])


if __name__ == '__main__':
    main()
