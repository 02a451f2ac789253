"""Tokenize texts through the Rust batch encoder, huge texts in slices with bounded memory.

A text over ``SLICE_CHARS`` is encoded in slices cut before a single space between non-spaces,
where pre-tokenizers split anyway; how the space is kept is calibrated per tokenizer
(:func:`slice_mode`), which is never sliced if neither way gives the whole-text tokens.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import numpy as np

#: texts longer than this many characters are tokenized in slices of about this size
SLICE_CHARS = 1 << 20
#: a safe cut: just before a single space between two non-whitespace characters
_CUT = re.compile(r'(?<=\S) (?=\S)')
#: word pairs that calibrate :func:`slice_mode`
_PROBES = (('hello', 'world'), ('The', 'cat sat.'), ('x=1,', '(y)'), ('über', 'naïve'))


def _batch_encoder(tok: Any) -> Any:
    """``encode_batch_fast`` (tokenizers >= 0.20) skips offset tracking, which we do not use."""
    backend = tok.backend_tokenizer
    return getattr(backend, 'encode_batch_fast', backend.encode_batch)


def encode_texts(tok: Any, texts: list[str],
                 slice_chars: int = SLICE_CHARS) -> list[list[int] | np.ndarray]:
    """Token ids of each text, without special tokens: lists of ints, or ``uint32`` arrays for
    texts over ``slice_chars`` (encoded in slices)."""
    if not any(len(t) > slice_chars for t in texts):
        return [e.ids for e in _batch_encoder(tok)(texts, add_special_tokens=False)] if texts else []
    out: list[Any] = [encode_long(tok, t, slice_chars) if len(t) > slice_chars else None for t in texts]
    short = [i for i, x in enumerate(out) if x is None]
    for i, e in zip(short, _batch_encoder(tok)([texts[i] for i in short], add_special_tokens=False)):
        out[i] = e.ids
    return out


def encode_long(tok: Any, text: str, slice_chars: int = SLICE_CHARS) -> np.ndarray:
    """Ids of one long text as ``uint32``, encoded in slices of about ``slice_chars``."""
    encode = _batch_encoder(tok)
    mode = slice_mode(tok)
    parts: list[np.ndarray] = []
    start = 0
    while start < len(text):
        cut = _next_cut(text, start + slice_chars) if mode is not None else None
        end = len(text) if cut is None else cut
        piece = encode([text[start:end]], add_special_tokens=False)[0].ids
        parts.append(np.asarray(piece, dtype=np.uint32))
        del piece
        start = end + (1 if cut is not None and mode == 'drop_space' else 0)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)


def _next_cut(text: str, pos: int) -> Optional[int]:
    if pos >= len(text):
        return None
    m = _CUT.search(text, pos)
    return None if m is None else m.start()


def slice_mode(tok: Any) -> Optional[str]:
    """How the slice after a cut must start for sliced tokens to equal whole-text tokens:
    ``'keep_space'`` (``" next..."``), ``'drop_space'`` (``"next..."``), or ``None``
    (slicing changes tokens: do not slice). Calibrated once per tokenizer object."""
    cached = getattr(tok, '_foundrymix_slice_mode', 'unset')
    if cached != 'unset':
        return cached
    encode = _batch_encoder(tok)

    def ids(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    mode = None
    for candidate, space in (('keep_space', ' '), ('drop_space', '')):
        wholes = ids([f'{a} {b}' for a, b in _PROBES])
        heads = ids([a for a, _ in _PROBES])
        tails = ids([space + b for _, b in _PROBES])
        if all(h + t == w for h, t, w in zip(heads, tails, wholes)):
            mode = candidate
            break
    try:
        tok._foundrymix_slice_mode = mode
    except AttributeError:
        pass
    return mode
