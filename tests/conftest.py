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
