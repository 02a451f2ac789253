"""Training: exact resumption (mid-epoch, at an epoch boundary, after SIGKILL), accounting, errors.

Every run is a real ``python train.py`` process on real shards converted from the bundled
samples, with a tiny Llama on CPU. A "straight" run is compared with runs that stop and
resume: the per-batch global sample ids (``sample_log`` callback) must be identical and
the final weights bitwise equal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, tiny_run_config
from helpers import SMALL_SEQ as SEQ
from train_helpers import assert_same_weights, final_state, sample_log, train

BATCH = 6
N_BATCHES = 40


@pytest.fixture(scope='module')
def data(small_streams) -> dict[str, str]:
    return {name: str(path) for name, path in small_streams.items()}


def write_config(path: Path, data: dict[str, str], **top) -> Path:
    loader = {'streams': {'arxiv': {'local': data['arxiv'], 'repeat': 1.5}, 'dolly': {'local': data['dolly']}},
              'shuffle': True, 'shuffle_seed': 3, 'num_workers': 0}
    defaults = {'run_name': 'resume-test', 'global_train_batch_size': BATCH, 'max_duration': f'{N_BATCHES}ba',
                'scheduler': {'name': 'cosine_with_warmup', 't_warmup': '3ba', 'alpha_f': 0.1},
                'log_interval': '5ba'}
    cfg = tiny_run_config(loader, **{**defaults, **top})
    path.write_text(yaml.safe_dump(cfg), encoding='utf-8')
    return path


def compare_cli(capsys, run_a: Path, run_b: Path, *options: str) -> tuple[int, list[str]]:
    """``foundrymix compare`` (in-process): (exit code, printed lines)."""
    from foundrymix.cli import main
    capsys.readouterr()
    code = main(['compare', str(run_a), str(run_b), *options])
    return code, capsys.readouterr().out.splitlines()


@pytest.fixture(scope='module')
def straight(tmp_path_factory, data) -> dict:
    """The reference: N batches in one go."""
    run = tmp_path_factory.mktemp('straight')
    cfg = write_config(run / 'c.yaml', data, save_folder=str(run / 'ckpt'),
                       callbacks={'sample_log': {'path': str(run / 'samples.jsonl')},
                                  'stream_accounting': {'out_dir': str(run / 'report')}})
    train(cfg)
    state = final_state(run / 'ckpt')
    log = sample_log(run / 'samples.jsonl')
    epoch_batches = next(b['batch'] for b in log if b['epoch'] == 1)
    return {'dir': run, 'state': state, 'log': log, 'epoch_batches': epoch_batches,
            'report': json.loads((run / 'report' / 'stream_accounting.json').read_text())}


@pytest.mark.slow  # whole train.py runs
def test_straight_run_covers_epochs(straight):
    log = straight['log']
    assert [b['batch'] for b in log] == list(range(N_BATCHES))
    assert all(len(b['sample_ids']) == BATCH for b in log)
    e = straight['epoch_batches']
    assert 2 < e < N_BATCHES // 2, 'the test needs 2+ epochs in the run'
    first = [s for b in log[:e] for s in b['sample_ids']]
    second = [s for b in log[e:2 * e] for s in b['sample_ids']]
    assert first != second, 'epochs must be reshuffled'
    assert straight['state']['timestamp']['Timestamp']['batch'] == N_BATCHES


def resumed_run(tmp_path: Path, data: dict, stop_at: str, save_interval: str) -> tuple[dict, list[dict], dict]:
    cfg = write_config(tmp_path / 'c.yaml', data, save_folder=str(tmp_path / 'ckpt'), save_interval=save_interval,
                       callbacks={'sample_log': {'path': str(tmp_path / 'samples.jsonl')},
                                  'stream_accounting': {'out_dir': str(tmp_path / 'report')}})
    train(cfg, f'callbacks.stop_at.time={stop_at}')
    stopped = final_state(tmp_path / 'ckpt')
    ckpt = os.path.realpath(tmp_path / 'ckpt' / 'latest-rank0.pt')
    train(cfg, f'load_path={ckpt}')
    report = json.loads((tmp_path / 'report' / 'stream_accounting.json').read_text())
    return stopped, sample_log(tmp_path / 'samples.jsonl'), report


@pytest.mark.slow  # whole train.py runs
def test_resume_mid_epoch_is_exact(tmp_path, data, straight, capsys):
    k = straight['epoch_batches'] // 2
    stopped, log, report = resumed_run(tmp_path, data, f'{k}ba', f'{k}ba')
    assert stopped['timestamp']['Timestamp']['batch'] == k and stopped['timestamp']['Timestamp']['epoch'] == 0
    assert log == straight['log']
    assert_same_weights(final_state(tmp_path / 'ckpt'), straight['state'])
    assert report['streams'] == straight['report']['streams']
    # ... and `foundrymix compare` says so, part by part
    assert compare_cli(capsys, straight['dir'], tmp_path) == (0, [
        f'samples:    equal ({N_BATCHES} batches, {N_BATCHES * BATCH} samples)',
        'accounting: equal (2 streams: ' + ', '.join(
            f'{n} {c["samples"]:,} samples' for n, c in report['streams'].items()) + ')',
        f'weights:    equal (12 tensors bitwise equal: {straight["dir"] / "ckpt" / "latest-rank0.pt"} '
        f'and {tmp_path / "ckpt" / "latest-rank0.pt"})'])


@pytest.mark.slow  # whole train.py runs
def test_resume_at_epoch_boundary_is_exact(tmp_path, data, straight):
    """composer 0.32.1 + streaming 0.13.0 alone replay epoch 0 here; we must not."""
    stopped, log, report = resumed_run(tmp_path, data, '1ep', '1ep')
    e = straight['epoch_batches']
    assert stopped['timestamp']['Timestamp']['batch'] == e and stopped['timestamp']['Timestamp']['epoch'] == 1
    assert stopped['timestamp']['Timestamp']['batch_in_epoch'] == 0
    assert log == straight['log']
    first = [b['sample_ids'] for b in log[:e]]
    second = [b['sample_ids'] for b in log[e:2 * e]]
    assert first != second
    assert_same_weights(final_state(tmp_path / 'ckpt'), straight['state'])
    assert report['streams'] == straight['report']['streams']


@pytest.mark.slow  # whole train.py runs
def test_sigkill_then_autoresume_is_exact(tmp_path, data, straight):
    cfg = write_config(tmp_path / 'c.yaml', data, save_folder=str(tmp_path / 'ckpt'), save_interval='3ba',
                       autoresume=True, run_name='killed',
                       callbacks={'sample_log': {'path': str(tmp_path / 'samples.jsonl')}})
    cmd = [sys.executable, str(ROOT / 'train.py'), str(cfg)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = tmp_path / 'ckpt' / 'latest-rank0.pt'

    def saved_ba6() -> bool:  # what autoresume will find (Composer's symlink) is ba6
        return latest.is_symlink() and os.readlink(latest).endswith('ep0-ba6-rank0.pt')
    deadline = time.time() + 240
    while not saved_ba6() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert saved_ba6(), 'no checkpoint at batch 6 before the deadline'
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = len(sample_log(tmp_path / 'samples.jsonl'))
    assert killed_at < N_BATCHES, 'the run finished before it was killed'
    train(cfg)  # same command: autoresume finds latest-rank0.pt
    assert sample_log(tmp_path / 'samples.jsonl') == straight['log']
    assert_same_weights(final_state(tmp_path / 'ckpt'), straight['state'])


@pytest.mark.slow  # whole train.py runs
def test_accounting_matches_sample_log(straight, data):
    """Per-stream counters equal what the logged sample ids say; shares sum to 1."""
    report = straight['report']
    streams = list(report['streams'])
    assert streams == ['arxiv', 'dolly']
    counted = [0, 0]
    for b in straight['log']:
        for s in b['stream_ids']:
            counted[s] += 1
    assert [report['streams'][n]['samples'] for n in streams] == counted
    assert report['total']['samples'] == N_BATCHES * BATCH
    arxiv = report['streams']['arxiv']
    assert arxiv['tokens'] == arxiv['samples'] * SEQ == arxiv['loss_tokens']  # pretrain rows are full
    dolly = report['streams']['dolly']
    assert dolly['loss_tokens'] < dolly['tokens'] <= dolly['samples'] * SEQ  # loss only on responses
    assert abs(sum(s['share'] for s in report['streams'].values()) - 1) < 1e-9
    assert (straight['dir'] / 'report' / 'stream_accounting.png').stat().st_size > 1000


@pytest.mark.slow  # whole train.py runs
def test_sample_log_tokens_are_the_digest_of_the_rows_streaming_reads(straight, data):
    """Each logged batch's ``tokens`` equals a digest recomputed here from the rows streaming
    itself reads for the logged sample ids (global id = the streams' rows end to end, in
    the YAML's order), decoded by the schema's reference: the log says which data trained."""
    from helpers import LoggedTokens
    tokens = LoggedTokens([data['arxiv'], data['dolly']])
    for b in straight['log']:
        assert b['tokens'] == tokens.digest(b['sample_ids'], b['stream_ids']), b['batch']
    assert len({b['tokens'] for b in straight['log']}) == N_BATCHES


@pytest.mark.parametrize('override, message', [
    ('train_loader.streams.missing={local: /nonexistent/dir}', 'missing'),
    ('model.max_position_embeddings=32', 'max_position_embeddings=32 does not fit max_seq_len=128'),
    ('model.vocab_size=100', 'model.vocab_size=100 is smaller than the tokenizer vocabulary (8192'),
    ('global_train_batch_size=0', 'global_train_batch_size must be positive'),
    ('load_path=/nonexistent/ckpt.pt', 'load_path: /nonexistent/ckpt.pt: no such checkpoint'),
    ('max_seq_len=256', 'max_seq_len=256, but the train streams hold rows of 128 tokens'),
    ('bogus_key=1', "unknown key 'bogus_key'"),
    ('optimizer.lrr=1', "optimizer: unknown key 'lrr'"),
    ('device_train_microbatch_size=4', 'device_train_microbatch_size=4 does not divide the per-rank batch'),
])
def test_bad_config_fails_before_training(tmp_path, data, override, message):
    from foundrymix.train.builder import build_trainer
    from foundrymix.train.config import load_config

    cfg_path = write_config(tmp_path / 'c.yaml', data, save_folder=str(tmp_path / 'ckpt'))
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        build_trainer(load_config(str(cfg_path), [override]))
    assert message in str(err.value)
    assert not (tmp_path / 'ckpt').exists()


def test_cli_reports_config_error(tmp_path, data):
    """Through train.py: exit code 2, one clear line, no traceback, no step run."""
    cfg = write_config(tmp_path / 'c.yaml', data, save_folder=str(tmp_path / 'ckpt'))
    proc = train(cfg, 'model.max_position_embeddings=32', check=False)
    assert proc.returncode == 2
    assert 'foundrymix train: error: model.max_position_embeddings=32 does not fit max_seq_len=128' in proc.stderr
    assert 'Traceback' not in proc.stderr
    assert not (tmp_path / 'ckpt').exists()


def test_batch_not_divisible_by_ranks(tmp_path, data, monkeypatch):
    from composer.utils import dist

    from foundrymix.config import ConfigError
    from foundrymix.train.builder import build_trainer
    from foundrymix.train.config import load_config

    cfg = load_config(str(write_config(tmp_path / 'c.yaml', data)))
    monkeypatch.setattr(dist, 'get_world_size', lambda: 4)
    with pytest.raises(ConfigError, match=r'global_train_batch_size=6 is not divisible by the 4 ranks'):
        build_trainer(cfg)


def half(path: Path) -> None:
    """What a job killed while ``torch.save`` wrote ``path`` leaves: its first half."""
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


@pytest.mark.slow  # whole train.py runs
def test_truncated_latest_checkpoint_autoresumes_from_the_previous_one(tmp_path, data, straight):
    """The checkpoint ``latest-rank0.pt`` points at is truncated (a pre-emption during its write):
    Composer 0.32's autoresume died with ``failed finding central directory``; the run resumes
    from the newest complete one, says so in one line, and ends as the straight run did."""
    save = tmp_path / 'ckpt'
    cfg = write_config(tmp_path / 'c.yaml', data, save_folder=str(save), save_interval='10ba',
                       autoresume=True, run_name='truncated',
                       callbacks={'sample_log': {'path': str(tmp_path / 'samples.jsonl')}})
    train(cfg)
    last = Path(os.path.realpath(save / 'latest-rank0.pt'))
    previous = sorted(save.glob('ep*-ba30-rank0.pt'))
    assert last.name.endswith('-ba40-rank0.pt') and len(previous) == 1
    half(last)
    out = train(cfg)
    assert (f'autoresume: {last.name} is incomplete (BadZipFile: File is not a zip file) -- a job killed '
            f'while writing it; left in place, resuming from the newest complete checkpoint {previous[0]}'
            in out.stdout.splitlines())
    assert 'at batch 30' in out.stdout
    assert sample_log(tmp_path / 'samples.jsonl') == straight['log']
    assert_same_weights(final_state(save), straight['state'])  # ba40 written again, whole


def test_autoresume_skips_incomplete_checkpoints_or_names_them(tmp_path, data, straight, capsys):
    """A newer checkpoint left half-written beside ``latest-rank0.pt`` (killed before Composer
    moved the symlink) is skipped and named; with no complete checkpoint the run is refused,
    naming the file, and the advice given (start over in the folder) works."""
    from foundrymix.errors import UserError
    from foundrymix.train.builder import build_trainer
    from foundrymix.train.config import load_config

    whole = Path(os.path.realpath(straight['dir'] / 'ckpt' / 'latest-rank0.pt')).read_bytes()  # batch 40
    save = tmp_path / 'ckpt'
    save.mkdir()
    (save / 'ep1-ba30-rank0.pt').write_bytes(whole)
    (save / 'ep1-ba35-rank0.pt').write_bytes(whole)
    half(save / 'ep1-ba35-rank0.pt')
    (save / 'latest-rank0.pt').symlink_to('ep1-ba30-rank0.pt')
    cfg = write_config(tmp_path / 'c.yaml', data, save_folder=str(save), autoresume=True)
    run = build_trainer(load_config(str(cfg), []))
    run.claims.release()
    assert run.trainer.state.timestamp.batch == 40  # what the file named ba30 holds
    assert ('autoresume: ep1-ba35-rank0.pt is incomplete (BadZipFile: File is not a zip file) -- a job '
            'killed while writing it; left in place, resuming from the newest complete checkpoint '
            f'{save}/ep1-ba30-rank0.pt') in capsys.readouterr().out.splitlines()
    assert len((save / 'ep1-ba35-rank0.pt').read_bytes()) == len(whole) // 2  # left as it was

    half(save / 'ep1-ba30-rank0.pt')
    with pytest.raises(UserError) as err:
        build_trainer(load_config(str(cfg), []))
    assert str(err.value).startswith(f'autoresume: no complete checkpoint in {save}: ep1-ba35-rank0.pt, '
                                     f'ep1-ba30-rank0.pt incomplete (BadZipFile: File is not a zip file; ')
    assert 'Set autoresume=false save_overwrite=true to start the run over' in str(err.value)
    train(cfg, 'autoresume=false', 'save_overwrite=true', 'max_duration=2ba', 'save_interval=1ba')
    assert final_state(save)['timestamp']['Timestamp']['batch'] == 2


