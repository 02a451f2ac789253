"""Load tokenizers offline (never a hub at run time) and describe them for the manifest.

``--tokenizer``: ``foundrymix-bpe-8k`` (bundled, no BOS), a Hugging Face tokenizer directory, a
SentencePiece ``.model`` file (adds BOS), or a name already in the local Hugging Face cache.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

from foundrymix.errors import FoundrymixError
from foundrymix.format.schema import TokenizerInfo

BUNDLED_DIR = Path(__file__).resolve().parent / 'assets' / 'tokenizers'
DEMO_TOKENIZER = 'foundrymix-bpe-8k'


#: a tokenizer directory holds one of these (or a ``*.model``); one with none is refused by name,
#: not with transformers' message, which lists hundreds of model types
TOKENIZER_FILES = frozenset({'tokenizer.json', 'tokenizer_config.json', 'config.json', 'vocab.json',
                             'vocab.txt'})


class TokenizerError(FoundrymixError, ValueError):
    """A tokenizer could not be loaded offline."""


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
    """Load a fast tokenizer offline (once per process); raise :class:`TokenizerError` naming what was tried."""
    os.environ.setdefault('HF_HUB_OFFLINE', '1')
    os.environ.setdefault('TRANSFORMERS_OFFLINE', '1')
    from transformers import AutoTokenizer

    kind, location = _resolve(name_or_path)
    try:
        if kind == 'spm':
            tok = _load_spm(location)
        else:
            tok = AutoTokenizer.from_pretrained(location, local_files_only=True, use_fast=True)
    except Exception as e:  # transformers raises OSError/ValueError/others
        # the cause in one line of at most 200 characters: transformers' can list every model type
        line = (str(e).strip().splitlines() or [''])[0]
        cause = f'{type(e).__name__}: {line if len(line) <= 200 else line[:197] + "..."}'
        if kind == 'spm':
            need = ' (needs the sentencepiece and protobuf packages)' if isinstance(e, ImportError) else ''
            raise TokenizerError(f'{name_or_path}: cannot load this SentencePiece model{need}: {cause}') from None
        bundled = sorted(p.name for p in BUNDLED_DIR.glob('*/'))
        raise TokenizerError(
            f'unknown tokenizer {name_or_path!r}: not a bundled name, a local tokenizer directory, '
            f'a SentencePiece .model file, or a name in the local Hugging Face cache '
            f'(nothing is downloaded). {"bundled: " + ", ".join(bundled) if bundled else ""}; '
            f'cause: {cause}') from None
    if not getattr(tok, 'is_fast', False):
        raise TokenizerError(f'tokenizer {name_or_path!r} has no fast (Rust) implementation')
    if tok.eos_token_id is None:
        raise TokenizerError(f'tokenizer {name_or_path!r} has no EOS token; foundrymix separates '
                             f'documents and ends examples with EOS')
    tok.model_max_length = 1 << 30  # we cut rows ourselves; silence length warnings
    tok.foundrymix_name = name_or_path
    return tok


def _load_spm(path: str) -> Any:
    """A Llama-style SentencePiece BPE model file as a fast tokenizer that adds BOS, not EOS, with
    SentencePiece's own ids (checked on :data:`SPM_PROBE`, else refused). Built here because
    transformers' converters do not reproduce them, and differ between its versions."""
    from sentencepiece import SentencePieceProcessor
    from sentencepiece import sentencepiece_model_pb2 as spm_pb
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    proto = spm_pb.ModelProto()
    with open(path, 'rb') as f:
        proto.ParseFromString(f.read())
    spec, pieces = proto.trainer_spec, proto.pieces
    if spec.model_type != spm_pb.TrainerSpec.BPE or min(spec.unk_id, spec.bos_id, spec.eos_id) < 0:
        raise ValueError('not a BPE model with unk, BOS and EOS pieces (Llama-style)')
    vocab = {p.piece: i for i, p in enumerate(pieces)}
    # SentencePiece merges the adjacent pair whose joined piece scores highest
    ranked = [(p.piece[:k], p.piece[k:], p.score) for p in pieces if p.type == p.NORMAL
              for k in range(1, len(p.piece)) if p.piece[:k] in vocab and p.piece[k:] in vocab]
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    unk, bos, eos = (pieces[i].piece for i in (spec.unk_id, spec.bos_id, spec.eos_id))
    backend = Tokenizer(BPE(vocab, [(a, b) for a, b, _ in ranked], unk_token=unk, fuse_unk=True,
                            byte_fallback=spec.byte_fallback))
    backend.add_special_tokens([AddedToken(p.piece, normalized=False, special=True) for p in pieces
                                if p.type in (p.UNKNOWN, p.CONTROL)])
    backend.add_tokens([AddedToken(p.piece, normalized=False) for p in pieces if p.type == p.USER_DEFINED])
    # spaces become U+2581 and one is put in front (SentencePiece's dummy prefix), even before
    # a leading space, which a Metaspace pre-tokenizer would not double
    prefix = proto.normalizer_spec.add_dummy_prefix
    backend.normalizer = normalizers.Sequence([normalizers.Prepend('\u2581')] * prefix
                                              + [normalizers.Replace(' ', '\u2581')])
    backend.decoder = decoders.Sequence([decoders.Replace('\u2581', ' '), decoders.ByteFallback(), decoders.Fuse()]
                                        + ([decoders.Strip(' ', 1, 0)] if prefix else []))
    backend.post_processor = processors.TemplateProcessing(single=f'{bos} $A', pair=f'{bos} $A {bos} $B',
                                                           special_tokens=[(bos, spec.bos_id)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=unk, bos_token=bos, eos_token=eos,
                                  clean_up_tokenization_spaces=False)
    if tok(SPM_PROBE, add_special_tokens=False)['input_ids'] != SentencePieceProcessor(model_file=path).encode(
            SPM_PROBE):
        raise ValueError('its tokens differ from SentencePiece\'s (not a Llama-style model: normalization?); '
                         'convert it to a tokenizer directory with transformers')
    return tok


#: text on which a SentencePiece model's tokens are checked: words, runs of spaces (leading
#: too), tabs, newlines, digits, accents, CJK and an emoji (byte fallback)
SPM_PROBE = '  Hello world, x  y   z    w\n\n\tcode(1234) \u00fcber na\u00efve \u6f22\u5b57 \U0001f917 end.'


def _info(name: str, serialized: str, bos: Optional[int], eos: int, pad: Optional[int], add_bos: bool,
          vocab: int) -> TokenizerInfo:
    """The manifest's description of a tokenizer: padding uses pad, else EOS; the fingerprint is
    SHA-256 over its canonical serialization and special-token settings."""
    h = hashlib.sha256(serialized.encode('utf-8'))
    h.update(json.dumps({'bos': bos, 'eos': eos, 'pad': pad, 'add_bos': add_bos, 'vocab': vocab},
                        sort_keys=True).encode('utf-8'))
    return TokenizerInfo(name=name, vocab_size=vocab, fingerprint=h.hexdigest(), bos_id=bos, eos_id=int(eos),
                         pad_id=int(eos if pad is None else pad), add_bos=add_bos)


def tokenizer_info(tok: Any) -> TokenizerInfo:
    """The manifest's description of a loaded tokenizer; ``add_bos``: whether it puts BOS in front of
    an encoded text by default."""
    add_bos = tok.bos_token_id is not None and tok('a', add_special_tokens=True)['input_ids'][:1] == [tok.bos_token_id]
    return _info(str(getattr(tok, 'foundrymix_name', tok.name_or_path)), tok.backend_tokenizer.to_str(),
                 tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, add_bos, len(tok))


def describe_tokenizer(name_or_path: str, memo_dir: Optional[str] = None) -> TokenizerInfo:
    """``tokenizer_info(load_tokenizer(name_or_path))``, without importing transformers where
    ``tokenizers`` alone gives the same (:func:`_plain_fast_info`).

    ``memo_dir`` keeps a plain directory's result keyed by its files' stat (``ctime`` included)
    and the ``tokenizers`` version, read only if this user alone may write it; else per process."""
    if memo_dir is None:
        return _describe(name_or_path)
    memo = _memo_path(name_or_path, memo_dir)
    known = None if memo is None else _read_memo(memo)
    if known is None:
        known = _plain_fast_info(name_or_path)
        if known is not None and memo is not None:
            _write_memo(memo, known)
    return known or tokenizer_info(load_tokenizer(name_or_path))


@functools.lru_cache(maxsize=8)
def _describe(name_or_path: str) -> TokenizerInfo:
    return _plain_fast_info(name_or_path) or tokenizer_info(load_tokenizer(name_or_path))


def _memo_path(name_or_path: str, memo_dir: str) -> Optional[str]:
    try:
        kind, location = _resolve(name_or_path)
    except TokenizerError:
        return None
    if kind != 'dir':
        return None
    import tokenizers
    idents = []
    for name in ('tokenizer_config.json', 'tokenizer.json', 'special_tokens_map.json'):
        try:
            st = os.stat(os.path.join(location, name))
            idents.append([st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev])
        except OSError:
            idents.append(None)
    with open(__file__, 'rb') as f:  # this module's reading of the files is part of the key
        code = hashlib.sha256(f.read()).hexdigest()
    key = json.dumps([name_or_path, location, idents, tokenizers.__version__, code])
    return os.path.join(memo_dir, hashlib.sha256(key.encode()).hexdigest() + '.json')


def _private(st: os.stat_result) -> bool:
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _digest(info: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()


def _read_memo(path: str) -> Optional[TokenizerInfo]:
    """The memo's result, or None (then the tokenizer is read again and the memo rewritten)
    if it is missing, not private, or does not match the digest stored with it -- a damaged
    memo is never trusted, as it decides whether a changed tokenizer is refused."""
    try:
        with open(path, encoding='utf-8') as f:
            if not (_private(os.fstat(f.fileno())) and _private(os.stat(os.path.dirname(path)))):
                return None
            got = json.load(f)
        info = got['info']
        if got.get('sha256') != _digest(info):
            logging.getLogger(__name__).warning('tokenizer memo %s is damaged (its digest does not '
                                                'match); reading the tokenizer again', path)
            return None
        return TokenizerInfo(**info)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _write_memo(path: str, info: TokenizerInfo) -> None:
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        if not _private(os.stat(folder)):
            return
        fd, tmp = tempfile.mkstemp(dir=folder, prefix='.tok-', suffix='.tmp')
        data = dataclasses.asdict(info)
        with os.fdopen(fd, 'w', encoding='utf-8') as f:
            json.dump({'info': data, 'sha256': _digest(data)}, f)
        os.replace(tmp, path)
    except OSError:
        pass


def _special(value: Any) -> Optional[str]:
    return value.get('content') if isinstance(value, dict) else value


def _plain_fast_info(name_or_path: str) -> Optional[TokenizerInfo]:
    """The :class:`TokenizerInfo` of a tokenizer directory read with ``tokenizers`` alone, or None
    unless ``PreTrainedTokenizerFast`` would keep ``tokenizer.json`` as it is (that class, no
    truncation or padding, every added and special token already in it)."""
    kind, location = _resolve(name_or_path)
    if kind != 'dir':
        return None
    folder = Path(location)
    try:
        config = json.loads((folder / 'tokenizer_config.json').read_text(encoding='utf-8'))
        text = (folder / 'tokenizer.json').read_text(encoding='utf-8')
        spec = json.loads(text)
        mapping = folder / 'special_tokens_map.json'
        special = json.loads(mapping.read_text(encoding='utf-8')) if mapping.is_file() else {}
    except (OSError, ValueError):
        return None
    if (not isinstance(config, dict) or not isinstance(spec, dict) or not isinstance(special, dict)
            or config.get('tokenizer_class') != 'PreTrainedTokenizerFast'
            or spec.get('truncation') or spec.get('padding')):
        return None
    added = {t.get('content'): t.get('id') for t in spec.get('added_tokens') or [] if t.get('special')}
    decoder = config.get('added_tokens_decoder') or {}
    if any(added.get(_special(t)) != int(i) for i, t in decoder.items()):
        return None
    ids: dict[str, Optional[int]] = {}
    for key in ('bos_token', 'eos_token', 'pad_token'):
        values = {_special(src[key]) for src in (config, special) if key in src}
        if len(values) > 1 or any(v is not None and v not in added for v in values):
            return None
        value = values.pop() if values else None
        ids[key] = None if value is None else added[value]
    if ids['eos_token'] is None:
        return None
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(text)
    bos, eos, pad = ids['bos_token'], ids['eos_token'], ids['pad_token']
    add_bos = bos is not None and tok.encode('a', add_special_tokens=True).ids[:1] == [bos]
    return _info(name_or_path, tok.to_str(), bos, eos, pad, add_bos, tok.get_vocab_size(with_added_tokens=True))
