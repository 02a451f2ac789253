"""StreamMixer refuses streams that cannot share a batch, before reading any row."""

from __future__ import annotations

import os

import pytest

from foundrymix.config import ConfigError
from foundrymix.loader.mixer import StreamMixer
from foundrymix.format.schema import MANIFEST_NAME, Manifest
from mix_helpers import build_stream, demo_tokenizer_info, loader_dict, other_tokenizer_info


@pytest.fixture(scope='module')
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp('validate')
    build_stream(str(root / 'pre32'), 'pretrain', 20, 0)
    build_stream(str(root / 'ft32'), 'finetune', 20, 1)
    build_stream(str(root / 'pre64'), 'pretrain', 20, 2, max_seq_len=64)
    build_stream(str(root / 'other_tok'), 'pretrain', 20, 3, tokenizer=other_tokenizer_info())
    build_stream(str(root / 'v0'), 'pretrain', 20, 4, schema_version=0)
    return root


def mixer(root, *names, **extra):
    return StreamMixer.from_dict(loader_dict({n: str(root / n) for n in names}, {}, **extra))


def test_pretrain_and_finetune_mix(root):
    m = mixer(root, 'pre32', 'ft32')
    m.validate()
    assert m.max_seq_len == 32
    assert m.tokenizer == demo_tokenizer_info()
    assert [man.kind for man in m.manifests.values()] == ['pretrain', 'finetune']


def test_mismatched_max_seq_len(root):
    with pytest.raises(ConfigError) as e:
        mixer(root, 'pre32', 'ft32', 'pre64').validate()
    assert str(e.value) == ('train_loader.streams: streams disagree on max_seq_len (pre32: 32, '
                            'ft32: 32, pre64: 64); every stream of one loader must be converted '
                            'with the same max_seq_len')


def test_different_tokenizer(root):
    with pytest.raises(ConfigError) as e:
        mixer(root, 'pre32', 'other_tok').validate()
    info = demo_tokenizer_info()
    fp, v = info.fingerprint[:12], info.vocab_size
    assert str(e.value) == (
        f'train_loader.streams: streams disagree on tokenizer (pre32: foundrymix-bpe-8k '
        f'(fingerprint {fp}, vocab {v}), other_tok: other-bpe (fingerprint xxxxxxxxxxxx, vocab '
        f'{v})); every stream of one loader must be converted with the same tokenizer')


def test_missing_manifest(root, tmp_path):
    bare = tmp_path / 'bare'
    bare.mkdir()
    m = StreamMixer.from_dict({'streams': {'pre32': {'local': str(root / 'pre32')},
                                           'bare': {'local': str(bare)}}})
    with pytest.raises(ConfigError) as e:
        m.validate()
    assert str(e.value) == (f"train_loader.streams.bare: no foundrymix manifest "
                            f"{bare / MANIFEST_NAME} (is '{bare}' a directory made by `foundrymix "
                            f"convert`?)")


def test_schema_version(root):
    with pytest.raises(ConfigError, match=r'^train_loader.streams.v0: manifest schema version 0, '
                                          r'this foundrymix reads version 1'):
        mixer(root, 'pre32', 'v0').validate()


def test_refusal_happens_before_any_store_is_built(root, monkeypatch):
    from foundrymix.loader import storage
    monkeypatch.setattr(storage, 'RowStore', None)  # building would crash, validation must not
    with pytest.raises(ConfigError, match='max_seq_len'):
        mixer(root, 'pre32', 'pre64').build_store()


def test_remote_only_stream_fetches_only_metadata_then_streams(root, tmp_path):
    cache = tmp_path / 'cache'
    m = StreamMixer.from_dict({'streams': {'pre': {'remote': str(root / 'pre32')},
                                           'ft': {'local': str(root / 'ft32')}},
                               'cache_root': str(cache), 'shuffle': False})
    assert m.manifests['pre'].counts.rows == 20
    local = m.config.stream_local('pre')
    assert sorted(os.listdir(local)) == ['foundrymix.json', 'index.json']
    ds = m.build_store()
    rows = [(int(s['stream_id']), int(s['input_ids'][1])) for s in ds]
    assert sorted(rows) == [(0, r) for r in range(20)] + [(1, r) for r in range(20)]
    assert any(name.endswith('.mds') for name in os.listdir(local))  # the store fetched shards
    ds.release()


def test_same_directory_twice_is_refused(root):
    m = StreamMixer.from_dict({'streams': {'a': {'local': str(root / 'pre32'), 'repeat': 2},
                                           'b': {'local': str(root / 'pre32') + '/', 'repeat': 1}}})
    with pytest.raises(ConfigError, match=r'^train_loader.streams: a and b use the same directory '):
        m.validate()


def test_one_tokenizer_agrees_however_its_path_was_spelled(tmp_path, monkeypatch, arxiv_jsonl):
    """Converted from one tokenizer directory given as an absolute and as a relative path: the
    manifests name it two ways, the fingerprints are equal, and the streams mix."""
    import shutil

    from foundrymix.convert.pretrain import PretrainOptions, convert_pretrain
    from helpers import ROOT
    tok = tmp_path / 'tok'
    shutil.copytree(ROOT / 'foundrymix' / 'assets' / 'tokenizers' / 'foundrymix-bpe-8k', tok)
    (tmp_path / 'work').mkdir()
    monkeypatch.chdir(tmp_path / 'work')
    for name, spelled in (('absolute', str(tok)), ('relative', '../tok')):
        convert_pretrain([str(arxiv_jsonl)], str(tmp_path / name),
                         PretrainOptions(max_seq_len=64, tokenizer=spelled, workers=1))
    m = StreamMixer.from_dict({'streams': {n: {'local': str(tmp_path / n)} for n in ('absolute', 'relative')}})
    names = {man.tokenizer.name for man in m.manifests.values()}
    assert len(names) == 2, names  # the case: two spellings in the manifests
    m.validate()
    assert m.tokenizer.fingerprint == Manifest.read(str(tmp_path / 'relative')).tokenizer.fingerprint
