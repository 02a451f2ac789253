"""Many ranks through Composer's launcher (``composer -n 2 train.py``, CPU, gloo).

The guarantee asserted here: foundrymix's order is one global order of global batches,
the same for any world size, and rank ``r`` of ``R`` trains columns ``[rB, (r+1)B)`` of
every global batch of ``R*B`` rows. So global batch ``k`` of a 2-rank run (ranks
concatenated in rank order, as ``sample_log`` writes it) is exactly batch ``k`` of the
1-rank run, and a run stopped on 2 ranks and resumed on 1 continues with the 1-rank run's
batches. (Runs here use ``num_workers: 0``.)

The runs here train with ``lr: 0``: the weights stay at their seeded init, so a batch's
loss depends on its rows only, and the per-stream loss the accounting reports must be the
same on 1 and 2 ranks (up to float summation order) and equal a recomputation from the
sample log. With a real LR it would not be, and not through the reporting: each rank's
loss is the mean over its own loss targets, so 2 ranks step on another gradient than 1
whenever their rows hold different numbers of targets.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from distributed_helpers import BATCH, N_BATCHES, RANKS, checkpoint, report, train_1rank, train_nranks, write_config
from helpers import ROOT, LoggedTokens, free_port, moto_s3, tiny_run_config
from integrity_helpers import copy_stream, flip_bits, index_of, rank_one_only, shard_hash_error
from train_helpers import sample_log

EPOCH = 12         # batches per epoch of the data below (checked in the data fixture)
STOP = 14          # the 2-rank run stops mid epoch 1; 1 rank resumes from there


@pytest.fixture(scope='module')
def data(small_streams, tmp_path_factory) -> dict[str, str]:
    """Part of one arXiv paper (pretrain, 22 rows) and 150 Dolly examples (finetune, 41 rows)."""
    root = tmp_path_factory.mktemp('dist-config')
    paths = {name: str(path) for name, path in small_streams.items()}
    # Preconditions of the exact assertions below, on 1 and 2 ranks: EPOCH global batches an
    # epoch, every one full.
    from foundrymix.loader.mixer import StreamMixer
    mixer = StreamMixer.from_dict(yaml.safe_load(write_config(root, paths).read_text())['train_loader'])
    for ranks in (1, RANKS):
        plan = mixer.plan(BATCH // ranks, world_size=ranks)
        assert plan.batches_per_epoch == EPOCH and plan.epoch_size == EPOCH * BATCH
    return paths


LOSS_RTOL = 1e-5  # float32 row sums over 1 or 2 ranks' batches, float64 sums in another order


def without_loss(points: list[dict]) -> tuple[list[dict], np.ndarray, list]:
    """History points without their loss sums (compared exactly), the sums (compared within
    ``LOSS_RTOL``) and the loss targets."""
    rest = [{k: v for k, v in p.items() if k != 'loss_sum'} for p in points]
    return rest, np.array([p['loss_sum'] for p in points]), [p['loss_targets'] for p in points]


def assert_same_history(a: list[dict], b: list[dict]) -> None:
    (rest_a, loss_a, _), (rest_b, loss_b, _) = without_loss(a), without_loss(b)
    assert rest_a == rest_b
    np.testing.assert_allclose(loss_a, loss_b, rtol=LOSS_RTOL)


def assert_same_streams(a: dict, b: dict) -> None:
    """Two reports' ``streams``: counts exactly, the mean loss within ``LOSS_RTOL``."""
    assert {n: {k: v for k, v in s.items() if k != 'loss'} for n, s in a.items()} == {
        n: {k: v for k, v in s.items() if k != 'loss'} for n, s in b.items()}
    for name in a:
        assert a[name]['loss'] == pytest.approx(b[name]['loss'], rel=LOSS_RTOL)


@pytest.fixture(scope='module')
def straight(tmp_path_factory, data) -> dict:
    """Reference: N_BATCHES on one rank."""
    d = tmp_path_factory.mktemp('one-rank')
    train_1rank(write_config(d, data))
    return {'dir': d, 'log': sample_log(d / 'samples.jsonl'), 'report': report(d)}


@pytest.fixture(scope='module')
def two_ranks(tmp_path_factory, data) -> dict:
    """2 ranks via the launcher, stopped at STOP (past the epoch boundary), checkpoint there.

    Counters are summed over the ranks every 4 batches and the sample log gathered every 5,
    so the checkpoint at STOP holds batches 13-14 of both ranks only through the reduce at save.
    """
    d = tmp_path_factory.mktemp('two-ranks')
    cfg = write_config(d, data, log_interval='4ba', save_interval=f'{STOP}ba')
    train_nranks(cfg, f'callbacks.stop_at.time={STOP}ba')
    return {'dir': d, 'config': cfg, 'log': sample_log(d / 'samples.jsonl'), 'report': report(d),
            'ckpt': d / 'ckpt' / f'ep1-ba{STOP}-rank0.pt'}


@pytest.mark.slow  # trainings on 1 and 2 ranks (composer -n 2)
def test_two_ranks_see_the_one_rank_global_batches(straight, two_ranks):
    log1, log2 = straight['log'], two_ranks['log']
    assert [b['batch'] for b in log2] == list(range(STOP))
    assert [b['epoch'] for b in log2] == [b['epoch'] for b in log1[:STOP]]
    assert [b['epoch'] for b in log1].index(1) == EPOCH  # the 2-rank run crossed an epoch boundary
    for b1, b2 in zip(log1, log2):  # the ranks' slices, in rank order, are the 1-rank batch
        assert b2['sample_ids'] == b1['sample_ids'], b1['batch']
        assert b2['stream_ids'] == b1['stream_ids'], b1['batch']
    # each batch's token digest covers both ranks' rows (recomputed from the rows below), and
    # equals the 1-rank run's
    assert [b2['tokens'] for b2 in log2] == [b1['tokens'] for b1 in log1[:STOP]]
    data = _data_of(two_ranks['config'])
    tokens = LoggedTokens([data['arxiv'], data['dolly']])
    assert all(b2['tokens'] == tokens.digest(b2['sample_ids'], b2['stream_ids']) for b2 in log2)
    state = checkpoint(two_ranks['ckpt'])
    assert len(state['rng']) == RANKS  # one RNG state per rank: the run really had 2 ranks
    ts = state['state']['timestamp']['Timestamp']
    assert (ts['batch'], ts['epoch'], ts['sample'], ts['sample_in_epoch']) == (
        STOP, 1, STOP * BATCH, (STOP - EPOCH) * BATCH)
    position = state['state']['dataset_state']['train']  # the run's position (one stage: main)
    assert (position['batch'], position['global_batch_size']) == (STOP, BATCH)
    assert position['stages'][0]['fingerprint']['knobs']['shuffle_seed'] == 3


@pytest.mark.slow  # trainings on 1 and 2 ranks (composer -n 2)
def test_two_rank_accounting_equals_one_rank(straight, two_ranks):
    """Counters are all-reduced over ranks: every logged point equals the 1-rank run's."""
    hist1 = [p for p in straight['report']['history'] if p['batch'] <= STOP]
    assert_same_history(two_ranks['report']['history'], [p for p in hist1 if p['batch'] % 4 == 0] + hist1[-1:])
    saved = checkpoint(two_ranks['ckpt'])['state']['callbacks']['StreamAccounting']
    assert [saved[c] for c in ('samples', 'tokens', 'loss_tokens')] == [hist1[-1][c] for c in (
        'samples', 'tokens', 'loss_tokens')]  # reduced at the save, 2 batches after the last log point
    assert two_ranks['report']['batch'] == STOP
    at_stop = hist1[-1]
    assert at_stop['batch'] == STOP
    for i, name in enumerate(('arxiv', 'dolly')):
        got = two_ranks['report']['streams'][name]
        assert (got['samples'], got['tokens'], got['loss_tokens']) == (
            at_stop['samples'][i], at_stop['tokens'][i], at_stop['loss_tokens'][i])
    assert two_ranks['report']['total']['samples'] == STOP * BATCH


@pytest.mark.slow  # trainings on 1 and 2 ranks (composer -n 2)
def test_two_rank_checkpoint_resumes_on_one_rank(straight, two_ranks, tmp_path):
    """Elastic: stopped on 2 ranks, resumed on 1; the remaining global samples exactly."""
    import shutil
    d = tmp_path / 'resumed'
    shutil.copytree(two_ranks['dir'], d)  # the 2-rank run's log, report and checkpoints
    cfg = write_config(d, _data_of(two_ranks['config']), save_interval=f'{STOP}ba')
    train_1rank(cfg, f'load_path={d / "ckpt" / two_ranks["ckpt"].name}')
    log1, log = straight['log'], sample_log(d / 'samples.jsonl')
    assert [b['batch'] for b in log] == list(range(N_BATCHES))
    assert log[:STOP] == two_ranks['log']                 # kept as the 2-rank run wrote it
    assert log[STOP:] == log1[STOP:]                      # then the 1-rank run's batches
    for b, b1 in zip(log, log1):                          # every global batch: the same rows
        assert b['sample_ids'] == b1['sample_ids']
        assert b['epoch'] == b1['epoch']
    # the same rows per global batch on 2 and 1 ranks: foundrymix compare finds the logs equal,
    # token digests included
    assert [b['tokens'] for b in log] == [b1['tokens'] for b1 in log1]
    from foundrymix.cli import main
    assert main(['compare', str(straight['dir']), str(d), '--parts', 'samples,accounting']) == 0
    rep = report(d)
    assert_same_streams(rep['streams'], straight['report']['streams'])
    hist1 = straight['report']['history']
    assert_same_history(rep['history'], [p for p in hist1 if p['batch'] <= 12 and p['batch'] % 4 == 0] + hist1[STOP:])


@pytest.mark.filterwarnings('ignore:Attempting to partition')  # resuming near an epoch's end
@pytest.mark.slow  # two trainings on 2 ranks (composer -n 2) against moto's S3
def test_two_ranks_resume_from_the_newest_complete_checkpoint_in_s3(straight, two_ranks, data, tmp_path):
    """2 ranks save to ``s3://`` and stop at STOP; the bucket is then as a pre-empted job leaves
    it (no ``latest-rank0.pt.symlink``, a newer checkpoint object cut short). The same command on
    2 ranks resumes every rank from the checkpoint at STOP: the first STOP global batches are
    the local 2-rank run's, each later one holds the 1-rank run's samples."""
    bucket, prefix = 'fmx-dist', 'runs/dist/ckpts/'
    save = f's3://{bucket}/{prefix.rstrip("/")}'
    name, cut = f'ep1-ba{STOP}-rank0.pt', f'ep1-ba{STOP + 2}-rank0.pt'
    with moto_s3(bucket) as s3:
        cfg = write_config(tmp_path, data, log_interval='4ba', save_interval=f'{STOP}ba', save_folder=save,
                           autoresume=True)
        train_nranks(cfg, f'callbacks.stop_at.time={STOP}ba')
        client = s3['client']
        client.delete_object(Bucket=bucket, Key=prefix + 'latest-rank0.pt.symlink')
        body = client.get_object(Bucket=bucket, Key=prefix + name)['Body'].read()
        client.put_object(Bucket=bucket, Key=prefix + cut, Body=body[:-100])
        out = train_nranks(cfg)
        assert f'resumed from {save}/{name} at batch {STOP} (epoch 1, batch {STOP - EPOCH} of it)' in out, out
        assert f'autoresume: {save}/{cut} is incomplete (BadZipFile' in out
    log = sample_log(tmp_path / 'samples.jsonl')
    assert [b['batch'] for b in log] == list(range(N_BATCHES))
    assert log[:STOP] == two_ranks['log']
    for b, b1 in zip(log[STOP:], straight['log'][STOP:]):
        assert sorted(b['sample_ids']) == sorted(b1['sample_ids'])


@pytest.mark.slow  # trainings on 1 and 2 ranks (composer -n 2)
def test_stream_loss_on_two_ranks_equals_one_rank_and_the_rows_recomputed(straight, two_ranks, data):
    """Per-stream loss: every 2-rank reduction equals the 1-rank run's over the same batches,
    and every batch of the 1-rank run equals transformers' loss of its rows (from the sample
    log) under the saved weights (lr 0: the weights every batch saw), row by row."""
    hist1 = {p['batch']: p for p in straight['report']['history']}
    for p in two_ranks['report']['history']:  # batches 4, 8, 12, 14: sums over both ranks
        assert p['loss_targets'] == hist1[p['batch']]['loss_targets']
        np.testing.assert_allclose(p['loss_sum'], hist1[p['batch']]['loss_sum'], rtol=LOSS_RTOL)
    assert min(two_ranks['report']['history'][0]['loss_targets']) > 0

    from foundrymix.loader.mixer import StreamMixer
    from foundrymix.train.model import CausalLM, ModelSpec, build_hf_model
    cfg = yaml.safe_load(two_ranks['config'].read_text())
    mixer = StreamMixer.from_dict(cfg['train_loader'])
    dataset = mixer.build_store()
    model = CausalLM(build_hf_model(ModelSpec.from_dict(cfg['model']), mixer.tokenizer, cfg['max_seq_len']))
    model.load_state_dict(checkpoint(two_ranks['ckpt'])['state']['model'])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model: 2 threads on 2 busy cores are ~16x slower
    try:
        points = [{'loss_sum': [0.0, 0.0], 'loss_targets': [0, 0]}] + [hist1[b] for b in range(1, N_BATCHES + 1)]
        for line, before, after in zip(straight['log'], points, points[1:]):
            sums, targets = np.zeros(2), [0, 0]
            with torch.no_grad():
                for sid, stream in zip(line['sample_ids'], line['stream_ids']):
                    row = dataset[sid]
                    assert row['stream_id'] == stream
                    labels = torch.as_tensor(row['labels'])[None]
                    n = int((labels[:, 1:] != -100).sum())
                    loss = model.model(input_ids=torch.as_tensor(row['input_ids'])[None],
                                       position_ids=torch.as_tensor(row['position_ids'])[None], labels=labels).loss
                    sums[stream] += float(loss) * n
                    targets[stream] += n
            assert np.subtract(after['loss_targets'], before['loss_targets']).tolist() == targets, line['batch']
            np.testing.assert_allclose(np.subtract(after['loss_sum'], before['loss_sum']), sums, rtol=LOSS_RTOL)
    finally:
        torch.set_num_threads(threads)
    assert straight['report']['streams']['dolly']['loss'] == pytest.approx(
        hist1[N_BATCHES]['loss_sum'][1] / hist1[N_BATCHES]['loss_targets'][1], rel=1e-12)


def _data_of(config: Path) -> dict[str, str]:
    streams = yaml.safe_load(config.read_text())['train_loader']['streams']
    return {name: s['local'] for name, s in streams.items()}


def damaged_for_rank_one(data, stream: Path) -> tuple[int, str]:
    """A copy of ``arxiv`` at ``stream`` whose shard that rank 1 alone reads first (unshuffled,
    :func:`rank_one_only`) is damaged: the global batch and the loader's message for it."""
    copy_stream(Path(data['arxiv']), stream)
    g, k, _ = rank_one_only(stream)
    flip_bits(stream, k, 0, token=10)
    return g, shard_hash_error(stream, index_of(stream)['shards'][k]['raw_data']['basename'])


def both_ranks_name_it(cfg: dict, tmp_path: Path, damaged: str, doing: str = 'could not read its rows of this batch',
                       kind: str = 'CorruptLocalShardError') -> None:
    """Start two ``train.py`` ranks as ``composer -n 2`` starts them (its environment), without the
    launcher, which stops the other ranks as soon as one exits: here each rank's own ending is
    seen. Rank 1 ends with ``damaged`` (its error), rank 0 naming rank 1 and its message."""
    path = tmp_path / 'c.yaml'
    path.write_text(yaml.safe_dump(cfg), encoding='utf-8')
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, 'FOUNDRYMIX_CACHE': str(tmp_path / 'cache'), 'RANK': str(rank),
               'LOCAL_RANK': str(rank), 'NODE_RANK': '0', 'WORLD_SIZE': '2', 'LOCAL_WORLD_SIZE': '2',
               'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': port}
        procs.append(subprocess.Popen([sys.executable, str(ROOT / 'train.py'), str(path)], cwd=tmp_path,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        ends = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    errors = [[line for line in err.splitlines() if line.startswith('foundrymix train: error:')]
              for _, err in ends]
    assert [p.returncode for p in procs] == [2, 2], [err[-3000:] for _, err in ends]
    assert errors[1] == [f'foundrymix train: error: {damaged}']
    assert errors[0] == [f'foundrymix train: error: rank 1 {doing}, so every rank stops here: {kind}: {damaged}']


@pytest.mark.slow  # two train.py ranks on gloo, started as the launcher starts them
def test_a_damaged_shard_one_rank_reads_stops_both_training_ranks_each_naming_it(data, tmp_path):
    """The trainer sets the loader's ``StopTogether``: rank 1 alone opens the damaged shard, and
    both ranks end with one line naming stream, shard and fix -- not rank 0 waiting in the
    gradient all-reduce for the launcher to kill it."""
    arxiv = tmp_path / 'arxiv'
    g, damaged = damaged_for_rank_one(data, arxiv)
    loader = {'streams': {'arxiv': {'local': str(arxiv)}}, 'shuffle': False, 'num_workers': 1}
    both_ranks_name_it(tiny_run_config(loader, run_name='stop-together', global_train_batch_size=g,
                                       max_duration='1ep', save_folder=str(tmp_path / 'ckpt')), tmp_path, damaged)


@pytest.mark.slow  # two train.py ranks on gloo, started as the launcher starts them
def test_a_damaged_eval_shard_one_rank_reads_stops_both_ranks_each_naming_it(data, tmp_path):
    """As above, with the damaged shard in the ``eval_loader`` (the training streams intact):
    the evaluation's loader agrees before each batch as the training loader does. Without it,
    rank 0 ended with exit code 1 in a collective that lost rank 1, naming no shard."""
    arxiv = tmp_path / 'eval-arxiv'
    g, damaged = damaged_for_rank_one(data, arxiv)
    both_ranks_name_it(tiny_run_config(
        {'streams': {'arxiv': {'local': data['arxiv']}}, 'num_workers': 0}, run_name='stop-together-eval',
        global_train_batch_size=4, max_duration='2ba', eval_interval='1ba', device_eval_batch_size=g // 2,
        eval_loader={'streams': {'arxiv': {'local': str(arxiv)}}, 'shuffle': False, 'num_workers': 1},
        save_folder=str(tmp_path / 'ckpt')), tmp_path, damaged)


@pytest.mark.slow  # two train.py ranks on gloo, started as the launcher starts them
def test_an_eval_stream_missing_on_one_rank_stops_both_ranks_at_start_each_naming_it(data, tmp_path):
    """The start is agreed: rank 1 alone lacks its ``eval_loader`` stream (the path names the rank,
    as a node's own disk would), so it fails building the evaluator before any collective. Both
    ranks end with one line; without the agreement rank 0 waited in the trainer's process-group
    start for its timeout."""
    copy_stream(Path(data['arxiv']), tmp_path / 'eval0')
    missing = tmp_path / 'eval1'
    said = (f"eval_loader.streams.arxiv: no foundrymix manifest {missing / 'foundrymix.json'} (is "
            f"'{missing}' a directory made by `foundrymix convert`?)")
    both_ranks_name_it(tiny_run_config(
        {'streams': {'arxiv': {'local': data['arxiv']}}, 'num_workers': 0}, run_name='start-together',
        global_train_batch_size=4, max_duration='2ba', eval_interval='1ba',
        eval_loader={'streams': {'arxiv': {'local': str(tmp_path / 'eval') + '${oc.env:RANK}'}}},
        save_folder=str(tmp_path / 'ckpt')), tmp_path, said, doing='could not start', kind='ConfigError')
