"""A SentencePiece model file gives SentencePiece's own ids, on transformers 4.x and 5.x alike.

The reference is the ``sentencepiece`` library itself, not transformers: transformers' own
conversion of this file drops the leading word's prefix (4.x, from ``vocab_file``) or merges
runs of spaces differently (5.x), so comparing with it would prove nothing.
"""

from __future__ import annotations

import pytest
import sentencepiece

from convert_helpers import read_jsonl
from foundrymix.tokenizer import TokenizerError, load_tokenizer, tokenizer_info

#: spaces, tabs and newlines in runs, digits, accents, CJK, emoji (byte fallback), code
SPACEY = ['Hello world', 'a', 'x    y', '    code()', 'Hello  world\n\n  x', ' lead', 'trail  ',
          'über naïve 漢字 🤗', 'def f(x):\n\tif x:\n        return  x  # two', '\u3000wide\u00a0nbsp', '']


def test_ids_equal_sentencepiece(spm_tokenizer, arxiv_jsonl):
    sp = sentencepiece.SentencePieceProcessor(model_file=spm_tokenizer)
    tok = load_tokenizer(spm_tokenizer)
    texts = [r['text'] for r in read_jsonl(arxiv_jsonl)] + SPACEY
    for text in texts:
        want = sp.encode(text)
        assert tok(text, add_special_tokens=False)['input_ids'] == want, text[:60]
        assert tok(text)['input_ids'] == [sp.bos_id()] + want  # BOS in front, no EOS
        assert tok.decode(want) == sp.decode(want)
    info = tokenizer_info(tok)
    assert (info.bos_id, info.eos_id, info.add_bos, info.vocab_size) == (sp.bos_id(), sp.eos_id(), True,
                                                                         sp.get_piece_size())
    assert tok.convert_ids_to_tokens(list(range(sp.get_piece_size()))) == [
        sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def test_saved_directory_is_the_same_tokenizer(spm_tokenizer, tmp_path):
    """``save_pretrained`` of it (what ``export`` writes beside a model) loads back with the
    same ids and fingerprint, so the exported directory is accepted for the same streams."""
    tok = load_tokenizer(spm_tokenizer)
    tok.save_pretrained(tmp_path / 'tok')
    again = load_tokenizer(str(tmp_path / 'tok'))
    mine, back = tokenizer_info(tok), tokenizer_info(again)
    assert back == type(mine)(**{**mine.__dict__, 'name': str(tmp_path / 'tok')})
    for text in SPACEY:
        assert again(text)['input_ids'] == tok(text)['input_ids']


#: how Llama's SentencePiece model was trained: no normalization, spaces kept, byte fallback
LLAMA_STYLE = dict(normalization_rule_name='identity', remove_extra_whitespaces=False, byte_fallback=True)


def _train(tmp_path, name: str, **options) -> str:
    text = tmp_path / 'train.txt'
    text.write_text('\n'.join(f'the cat {i} sat on  the mat number {i * 7}' for i in range(300)), encoding='utf-8')
    prefix = tmp_path / name
    sentencepiece.SentencePieceTrainer.train(input=str(text), model_prefix=str(prefix), vocab_size=300,
                                             bos_id=1, eos_id=2, unk_id=0, minloglevel=2, **options)
    return f'{prefix}.model'


def test_a_small_llama_style_model_matches_others_are_refused(tmp_path):
    bpe = _train(tmp_path, 'bpe', model_type='bpe', **LLAMA_STYLE)
    sp = sentencepiece.SentencePieceProcessor(model_file=bpe)
    tok = load_tokenizer(bpe)
    for text in ('the cat 12 sat  on the mat', 'unseen words: zebra!', *SPACEY):
        assert tok(text, add_special_tokens=False)['input_ids'] == sp.encode(text)
    unigram = _train(tmp_path, 'unigram', model_type='unigram', **LLAMA_STYLE)
    with pytest.raises(TokenizerError) as e:
        load_tokenizer(unigram)
    assert str(e.value) == (f'{unigram}: cannot load this SentencePiece model: ValueError: not a BPE model '
                            f'with unk, BOS and EOS pieces (Llama-style)')
    normalizing = _train(tmp_path, 'nfkc', model_type='bpe')  # NFKC, runs of spaces collapsed
    with pytest.raises(TokenizerError) as e:
        load_tokenizer(normalizing)
    assert str(e.value) == (f"{normalizing}: cannot load this SentencePiece model: ValueError: its tokens differ "
                            f"from SentencePiece's (not a Llama-style model: normalization?); convert it to a "
                            f"tokenizer directory with transformers")


def test_a_damaged_model_file_is_one_line(tmp_path):
    bad = tmp_path / 'tokenizer.model'
    bad.write_bytes(b'not a model')
    with pytest.raises(TokenizerError) as e:
        load_tokenizer(str(bad))
    assert str(e.value).startswith(f'{bad}: cannot load this SentencePiece model: DecodeError: ')
    assert '\n' not in str(e.value)
