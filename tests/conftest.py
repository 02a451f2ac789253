"""Shared fixtures: bundled sample data and the two real offline tokenizers.

Area-specific fixtures live in each test module (or ``tests/<area>_helpers.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TRANSFORMERS_OFFLINE', '1')
# torch on one thread in the tests and every process they start (train.py, the launchers' ranks, the
# examples): the suite runs in 2 processes on 2 cores, and each tiny-model process's default thread
# per core spins against the other test process (2 threads on 2 busy cores made the tiny model's
# steps ~16x slower, measured; see test_accounting's one_thread). Every comparison the tests make is
# between runs under this same setting. Set before torch is imported; an explicit value is kept.
os.environ.setdefault('OMP_NUM_THREADS', '1')

# Still importable from here for the test modules not yet switched to ``from helpers import``.
from helpers import DEMO_TOKENIZER, ROOT, SAMPLES, SMALL_SEQ, spm_tokenizer_path, tiny_run_config  # noqa: F401


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


@pytest.fixture
def process_group_ends():
    """For an in-process FSDP run: Composer starts a 1-rank process group (NCCL on a GPU) for
    FSDP and leaves it for the process; end it after the test, so that a later in-process CPU
    trainer's collectives do not go to NCCL (which takes CUDA tensors only)."""
    yield
    import torch.distributed as torch_dist
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def pytest_collection_modifyitems(items):
    """The files with slow tests first (a stable sort: each file's tests stay together, in order).
    Under ``--dist loadfile`` the two test processes then end on short files together, instead
    of one waiting while the other runs a long training file that came last."""
    slow = {item.path for item in items if item.get_closest_marker('slow')}
    items.sort(key=lambda item: item.path not in slow)
