"""What a trainer's start reads from its records instead of computing again: the configured
tokenizer's fingerprint (:func:`foundrymix.tokenizer.describe_tokenizer` with a memo
directory). The record gives what a fresh computation gives, and a changed input is
computed afresh. (The plan is the order's arithmetic and has no record.)"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from foundrymix.config import ConfigError
from foundrymix.format.schema import TokenizerInfo
from foundrymix.tokenizer import BUNDLED_DIR, describe_tokenizer, load_tokenizer, tokenizer_info
from foundrymix.train.config import TrainConfig, check_streams
from helpers import DEMO_TOKENIZER, tiny_run_config


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv('FOUNDRYMIX_CACHE', str(tmp_path / 'cache'))
    return tmp_path / 'cache'


@pytest.fixture
def tok(tmp_path):
    out = tmp_path / 'tok'
    shutil.copytree(BUNDLED_DIR / DEMO_TOKENIZER, out)
    return out


def memo_files(cache) -> list[str]:
    folder = cache / 'tokenizers'
    return sorted(os.listdir(folder)) if folder.is_dir() else []


def sealed(info: dict) -> str:
    """A memo's text: the result and the sha256 of its canonical JSON (the memo's format)."""
    return json.dumps({'info': info, 'sha256': hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()})


def test_the_tokenizer_memo_equals_the_tokenizer_and_follows_its_files(cache, tok, caplog):
    truth = tokenizer_info(load_tokenizer(str(tok)))
    assert describe_tokenizer(str(tok), str(cache / 'tokenizers')) == truth
    (name,) = memo_files(cache)
    # a second call reads the memo: mark it (digest kept right) and see the mark come back
    path = cache / 'tokenizers' / name
    memo = json.loads(path.read_text())
    path.write_text(sealed(dict(memo['info'], vocab_size=1)))
    assert describe_tokenizer(str(tok), str(cache / 'tokenizers')).vocab_size == 1
    # every single-bit flip of the memo's bytes: never read as another result -- either the
    # true one (a flip JSON reads the same) or ignored, warned about and rebuilt
    good = sealed(memo['info']).encode()
    changed_results = 0
    for i in range(0, len(good) * 8, 7):
        data = bytearray(good)
        data[i // 8] ^= 1 << (i % 8)
        path.write_bytes(bytes(data))
        got = describe_tokenizer(str(tok), str(cache / 'tokenizers'))
        changed_results += got != truth
    assert changed_results == 0
    assert 'is damaged (its digest does not match); reading the tokenizer again' in caplog.text
    assert json.loads(path.read_text()) == json.loads(good)  # rebuilt
    # tokenizer.json rewritten with another vocabulary: the memo's key no longer matches
    spec = json.loads((tok / 'tokenizer.json').read_text())
    spec['model']['vocab'] = {k: v for k, v in list(spec['model']['vocab'].items())[:-1]}
    spec['model']['merges'] = spec['model']['merges'][:-1]
    (tok / 'tokenizer.json').write_text(json.dumps(spec))
    changed = describe_tokenizer(str(tok), str(cache / 'tokenizers'))
    assert changed == tokenizer_info(load_tokenizer.__wrapped__(str(tok)))  # (its own cache: by name)
    assert changed.fingerprint != truth.fingerprint
    assert len(memo_files(cache)) == 2


def test_a_memo_others_may_write_is_not_read(cache, tok):
    describe_tokenizer(str(tok), str(cache / 'tokenizers'))
    (name,) = memo_files(cache)
    path = cache / 'tokenizers' / name
    path.write_text(sealed(dict(json.loads(path.read_text())['info'], fingerprint='0' * 64)))
    os.chmod(path, 0o666)
    assert describe_tokenizer(str(tok), str(cache / 'tokenizers')).fingerprint != '0' * 64
    os.chmod(path, 0o600)
    os.chmod(cache / 'tokenizers', 0o777)
    assert describe_tokenizer(str(tok), str(cache / 'tokenizers')).fingerprint != '0' * 64


def test_check_streams_refuses_another_tokenizer_after_a_memo(cache, tok, small_streams):
    streams = {n: {'local': str(p)} for n, p in small_streams.items()}
    cfg = TrainConfig.from_dict(tiny_run_config({'streams': streams}, max_duration='2ba', global_train_batch_size=4,
                                                tokenizer=str(tok)))
    mine = describe_tokenizer(DEMO_TOKENIZER)
    check_streams(cfg, cfg.max_seq_len, mine)  # the same tokenizer: passes, memo written
    assert len(memo_files(cache)) == 1
    check_streams(cfg, cfg.max_seq_len, mine)  # again, from the memo
    other = TokenizerInfo(**{**mine.__dict__, 'fingerprint': 'f' * 64})
    with pytest.raises(ConfigError, match='differs from the one the streams were converted with'):
        check_streams(cfg, cfg.max_seq_len, other)


class CollectorPasses:
    """Counts the cyclic collector's passes (``gc.callbacks``) made while one of ``functions``
    runs (one of their frames is on the stack): the pass a paused block defers to its end
    runs after the function has returned."""

    def __init__(self, *functions) -> None:
        self.codes = {getattr(f, '__wrapped__', f).__code__ for f in functions}
        self.passes = 0

    def __enter__(self) -> 'CollectorPasses':
        import gc
        gc.callbacks.append(self._seen)
        return self

    def _seen(self, phase: str, info: dict) -> None:
        import sys
        frame = sys._getframe(1)
        while phase == 'start' and frame is not None:
            if frame.f_code in self.codes:
                self.passes += 1
                return
            frame = frame.f_back

    def __exit__(self, *exc) -> None:
        import gc
        gc.callbacks.remove(self._seen)


def test_a_start_runs_no_collector_pass_and_leaves_the_collector_as_it_was(cache, small_streams, tmp_path):
    """Reading the config, planning and building the loader and its first stage's dataset
    allocate much and free little: the collector is paused over them (foundrymix/heap.py;
    10,000 streams: ~3 s of a restart). The same work unpaused (``__wrapped__``) does make
    passes, so the count can see one."""
    import gc

    import yaml

    from foundrymix.loader import mixer
    from foundrymix.train import builder
    from foundrymix.train.config import load_config
    streams = {}
    for i in range(200):  # one real stream linked into 200 directories
        d = tmp_path / 'streams' / f's{i:03d}'
        d.mkdir(parents=True)
        for f in os.listdir(small_streams['arxiv']):
            os.link(small_streams['arxiv'] / f, d / f)
        streams[f's{i:03d}'] = {'local': str(d)}
    path = tmp_path / 'train.yaml'
    path.write_text(yaml.safe_dump(tiny_run_config({'streams': streams}, max_duration='1ba',
                                                   global_train_batch_size=4)))
    start = (load_config, builder._train_data, mixer.build_store)
    assert gc.isenabled()
    with CollectorPasses(*start) as paused:
        cfg = load_config(str(path))
        data = builder._train_data(cfg, 4)
        stage = data.run.stages[0]
        dataset = mixer.build_store(stage.config, stage.infos)
    dataset.cache_claims.release()
    data.loader.release()
    assert paused.passes == 0 and gc.isenabled()
    with CollectorPasses(*start) as unpaused:
        cfg = load_config.__wrapped__(str(path))
        data = builder._train_data.__wrapped__(cfg, 4)
        stage = data.run.stages[0]
        dataset = mixer.build_store.__wrapped__(stage.config, stage.infos)
    dataset.cache_claims.release()
    data.loader.release()
    assert unpaused.passes > 0

    # a refused config leaves it on; a caller that had disabled it keeps it disabled
    path.write_text(yaml.safe_dump(tiny_run_config({'streams': streams}, max_duration='1ba',
                                                   global_train_batch_size=-4)))
    with pytest.raises(ConfigError):
        load_config(str(path))
    assert gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(ConfigError):
            load_config(str(path))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_tokenizer_changed_since_the_conversion_is_refused_saying_what_differs(cache, tok, tmp_path,
                                                                                 arxiv_jsonl):
    """Streams converted with directory T, then T gains a special token: the refusal named T on
    both sides (``tokenizer 'T' differs from the one the streams were converted with (T)``);
    now it says what differs and that T changed, for ``tokenizer:`` and ``model.pretrained``."""
    import subprocess
    import sys

    from foundrymix.loader.mixer import StreamMixer
    from foundrymix.train.model_spec import ModelSpec
    from foundrymix.train.weights import check_pretrained_tokenizer
    from helpers import ROOT

    out = tmp_path / 'stream'
    subprocess.run([sys.executable, '-m', 'foundrymix.cli', 'convert', 'pretrain', str(arxiv_jsonl), '-o',
                    str(out), '--tokenizer', str(tok), '--max-seq-len', '64', '--workers', '1', '--no-progress'],
                   check=True, env={**os.environ, 'PYTHONPATH': str(ROOT)}, timeout=600)
    before = describe_tokenizer(str(tok))
    changed = load_tokenizer.__wrapped__(str(tok))  # not this process's cached copy
    changed.add_special_tokens({'additional_special_tokens': ['<|tool|>']})
    changed.save_pretrained(str(tok))
    after = tokenizer_info(load_tokenizer.__wrapped__(str(tok)))
    assert (after.vocab_size, before.vocab_size) == (8193, 8192)

    streams = StreamMixer.from_dict({'streams': {'a': {'local': str(out)}}}).tokenizer
    assert streams == TokenizerInfo(**{**before.__dict__, 'name': str(tok)})
    note = (f'; {tok} changed since the streams were converted with it: re-convert them (foundrymix convert '
            f'... --tokenizer {tok} --overwrite), or restore the tokenizer they were converted with')
    differs = f'vocabulary 8193 vs 8192; fingerprint {after.fingerprint[:12]} vs {before.fingerprint[:12]}'
    cfg = TrainConfig.from_dict(tiny_run_config({'streams': {'a': {'local': str(out)}}}, max_seq_len=64,
                                                global_train_batch_size=4, max_duration='2ba', tokenizer=str(tok)))
    with pytest.raises(ConfigError) as err:
        check_streams(cfg, 64, streams)
    assert str(err.value) == (f"tokenizer '{tok}' differs from the one the streams were converted with "
                              f"({tok}): {differs} (this one vs the streams'){note}")
    (tok / 'config.json').write_text(json.dumps({'model_type': 'llama', 'vocab_size': 8193}))  # a model dir
    with pytest.raises(ConfigError) as err:
        check_pretrained_tokenizer(ModelSpec.from_dict({'pretrained': str(tok)}), streams)
    assert str(err.value) == (f'model.pretrained: {tok} has another tokenizer than the streams ({tok}): '
                              f"{differs} (the directory's vs the streams'){note}")
