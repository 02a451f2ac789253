"""Load tokenizers offline and describe them for the manifest.

Why offline only: conversion and training must never reach a model hub at run time.
``--tokenizer`` accepts

* ``foundrymix-bpe-8k`` -- the bundled demo tokenizer (byte-level BPE, no BOS);
* a directory holding a Hugging Face tokenizer (``tokenizer.json`` etc.);
* a SentencePiece ``.model``/``.model.v*`` file (Llama-style: adds BOS), loaded as a
  ``LlamaTokenizerFast``;
* a name already in the local Hugging Face cache (looked up with
  ``local_files_only=True``; never downloaded).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from foundrymix.errors import FoundrymixError
from foundrymix.format.schema import TokenizerInfo

BUNDLED_DIR = Path(__file__).resolve().parent / 'assets' / 'tokenizers'
DEMO_TOKENIZER = 'foundrymix-bpe-8k'


#: files of which a Hugging Face tokenizer directory holds at least one (or a ``*.model``);
#: a directory with none of them (an empty one, a model without its tokenizer) is refused
#: by name instead of with transformers' message, which ran to hundreds of model types
TOKENIZER_FILES = frozenset({'tokenizer.json', 'tokenizer_config.json', 'config.json', 'vocab.json',
                             'vocab.txt'})


class TokenizerError(FoundrymixError, ValueError):
    """A tokenizer could not be loaded offline."""


def bundled_tokenizers() -> list[str]:
    return sorted(p.name for p in BUNDLED_DIR.iterdir() if p.is_dir()) if BUNDLED_DIR.is_dir() else []


def _resolve(name_or_path: str) -> tuple[str, str]:
    """Return (kind, location) for a tokenizer reference: kind is dir | spm | cache."""
    bundled = BUNDLED_DIR / name_or_path  # a path (absolute or with a slash) is not a bundled name
    if not os.path.isabs(name_or_path) and '/' not in name_or_path and bundled.is_dir():
        return 'dir', str(bundled)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        try:
            names = set(os.listdir(path))
        except OSError as e:
            raise TokenizerError(f'{name_or_path}: cannot list this tokenizer directory '
                                 f'({e.strerror.lower()})') from None
        if not names & TOKENIZER_FILES and not any('.model' in n for n in names):
            raise TokenizerError(f'{name_or_path}: not a tokenizer directory (it holds none of '
                                 f'{", ".join(sorted(TOKENIZER_FILES))} or a SentencePiece .model file)')
        return 'dir', str(path)
    if path.is_file():
        if '.model' in path.name:
            return 'spm', str(path)
        if path.name == 'tokenizer.json':
            return 'dir', str(path.parent)
        raise TokenizerError(f'{name_or_path}: not a tokenizer (expected a directory with '
                             f'tokenizer.json or a SentencePiece .model file)')
    return 'cache', name_or_path


@functools.lru_cache(maxsize=8)
def load_tokenizer(name_or_path: str) -> Any:
    """Load a fast tokenizer offline; raise :class:`TokenizerError` naming what was tried.

    Cached per process: conversion workers and the trainer ask for the same one often.
    """
    os.environ.setdefault('HF_HUB_OFFLINE', '1')
    os.environ.setdefault('TRANSFORMERS_OFFLINE', '1')
    from transformers import AutoTokenizer, LlamaTokenizerFast

    kind, location = _resolve(name_or_path)
    try:
        if kind == 'spm':
            tok = LlamaTokenizerFast(vocab_file=location, legacy=False)
        else:
            tok = AutoTokenizer.from_pretrained(location, local_files_only=True, use_fast=True)
    except Exception as e:  # transformers raises OSError/ValueError/others
        hint = f'bundled: {", ".join(bundled_tokenizers())}' if bundled_tokenizers() else ''
        raise TokenizerError(
            f'unknown tokenizer {name_or_path!r}: not a bundled name, a local tokenizer directory, '
            f'a SentencePiece .model file, or a name in the local Hugging Face cache '
            f'(nothing is downloaded). {hint}; cause: {type(e).__name__}: {_first_line(e)}') from None
    if not getattr(tok, 'is_fast', False):
        raise TokenizerError(f'tokenizer {name_or_path!r} has no fast (Rust) implementation')
    if tok.eos_token_id is None:
        raise TokenizerError(f'tokenizer {name_or_path!r} has no EOS token; foundrymix separates '
                             f'documents and ends examples with EOS')
    tok.model_max_length = 1 << 30  # we cut rows ourselves; silence length warnings
    tok.foundrymix_name = name_or_path
    return tok


def _first_line(e: BaseException, limit: int = 200) -> str:
    """An exception's message cut to one line of at most ``limit`` characters (the CLI's
    errors are one line; transformers' can list every model type it knows)."""
    text = (str(e).strip().splitlines() or [''])[0]
    return text if len(text) <= limit else text[:limit - 3] + '...'


def adds_bos(tok: Any) -> bool:
    """Whether the tokenizer puts BOS in front of an encoded text by default."""
    if tok.bos_token_id is None:
        return False
    ids = tok('a', add_special_tokens=True)['input_ids']
    return bool(ids) and ids[0] == tok.bos_token_id


def fingerprint(tok: Any) -> str:
    """SHA-256 over the tokenizer's canonical serialization and special-token settings."""
    h = hashlib.sha256()
    h.update(tok.backend_tokenizer.to_str().encode('utf-8'))
    h.update(json.dumps({
        'bos': tok.bos_token_id, 'eos': tok.eos_token_id, 'pad': tok.pad_token_id,
        'add_bos': adds_bos(tok), 'vocab': len(tok),
    }, sort_keys=True).encode('utf-8'))
    return h.hexdigest()


def tokenizer_info(tok: Any) -> TokenizerInfo:
    """The manifest's description of a tokenizer. Padding uses pad, else EOS."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return TokenizerInfo(
        name=str(getattr(tok, 'foundrymix_name', tok.name_or_path)),
        vocab_size=len(tok),
        fingerprint=fingerprint(tok),
        bos_id=tok.bos_token_id,
        eos_id=int(tok.eos_token_id),
        pad_id=int(pad),
        add_bos=adds_bos(tok),
    )
