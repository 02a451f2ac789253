"""Plain helpers shared by test modules (import them: ``from helpers import ...``).

Fixtures stay in ``conftest.py``; this module holds the constants and functions tests
import directly.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / 'data' / 'samples'

#: bundled byte-level BPE (GPT-2 style: no BOS, EOS ``<|endoftext|>``, ChatML template)
DEMO_TOKENIZER = 'foundrymix-bpe-8k'

#: rows of the ``small_streams`` fixture (tokens per row)
SMALL_SEQ = 128


def spm_tokenizer_path() -> str:
    """Mistral's Llama-style SentencePiece model shipped inside ``mistral-common`` (adds BOS)."""
    return str(resources.files('mistral_common') / 'data' / 'tokenizer.model.v1')


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
