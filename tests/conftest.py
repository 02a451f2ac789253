"""Shared fixtures: bundled sample data and the two real offline tokenizers.

Area-specific fixtures live in each test module (or ``tests/<area>_helpers.py``).
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

import pytest

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TRANSFORMERS_OFFLINE', '1')

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / 'data' / 'samples'

#: bundled byte-level BPE (GPT-2 style: no BOS, EOS ``<|endoftext|>``, ChatML template)
DEMO_TOKENIZER = 'foundrymix-bpe-8k'


def spm_tokenizer_path() -> str:
    """Mistral's Llama-style SentencePiece model shipped inside ``mistral-common`` (adds BOS)."""
    return str(resources.files('mistral_common') / 'data' / 'tokenizer.model.v1')


@pytest.fixture(scope='session')
def samples() -> Path:
    return SAMPLES


@pytest.fixture(scope='session')
def arxiv_jsonl() -> Path:
    return SAMPLES / 'arxiv_sample.jsonl'


@pytest.fixture(scope='session')
def dolly_jsonl() -> Path:
    return SAMPLES / 'dolly_hhrlhf_sample.jsonl'


@pytest.fixture(scope='session', params=[DEMO_TOKENIZER, 'spm'])
def any_tokenizer(request) -> str:
    """Both kinds of tokenizer: without BOS (bundled BPE) and with BOS (SentencePiece)."""
    return DEMO_TOKENIZER if request.param == DEMO_TOKENIZER else spm_tokenizer_path()


@pytest.fixture(scope='session')
def spm_tokenizer() -> str:
    return spm_tokenizer_path()


#: rows of the small real streams below (tokens per row)
SMALL_SEQ = 128


@pytest.fixture(scope='session')
def small_streams(tmp_path_factory) -> dict[str, Path]:
    """Small real streams shared by the training, S3 and distributed tests.

    The first 12,000 characters of one arXiv paper (pretrain, 22 rows of 128) and the
    first 150 Dolly examples (finetune, packed), converted by the real converters into
    several small shards each. Read-only for the tests.
    """
    import json

    from foundrymix.convert.finetune import FinetuneOptions, convert_finetune
    from foundrymix.convert.pretrain import PretrainOptions, convert_pretrain

    root = tmp_path_factory.mktemp('small-streams')
    with open(SAMPLES / 'arxiv_sample.jsonl', encoding='utf-8') as f:
        paper = json.loads(f.readline())['text'][:12000]
    (root / 'paper.jsonl').write_text(json.dumps({'text': paper}) + '\n', encoding='utf-8')
    with open(SAMPLES / 'dolly_hhrlhf_sample.jsonl', encoding='utf-8') as f:
        dolly = [next(f) for _ in range(150)]
    (root / 'dolly.jsonl').write_text(''.join(dolly), encoding='utf-8')
    convert_pretrain([str(root / 'paper.jsonl')], str(root / 'arxiv'),
                     PretrainOptions(max_seq_len=SMALL_SEQ, workers=1, size_limit='4kb'))
    convert_finetune([str(root / 'dolly.jsonl')], str(root / 'dolly'),
                     FinetuneOptions(max_seq_len=SMALL_SEQ, workers=1, size_limit='4kb'))
    return {'arxiv': root / 'arxiv', 'dolly': root / 'dolly'}


def tiny_run_config(train_loader: dict, **top) -> dict:
    """A training config for a tiny Llama on ``SMALL_SEQ`` rows; ``top`` overrides any key."""
    cfg = {
        'seed': 5,
        'max_seq_len': SMALL_SEQ,
        'model': {'type': 'llama', 'hidden_size': 32, 'intermediate_size': 64, 'num_hidden_layers': 1,
                  'num_attention_heads': 2, 'num_key_value_heads': 2, 'max_position_embeddings': SMALL_SEQ},
        'train_loader': train_loader,
        'optimizer': {'lr': 0.01},
        'save_interval': '1000ba',
        'loggers': {},
    }
    cfg.update(top)
    return cfg
