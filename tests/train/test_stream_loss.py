"""Per-stream loss in a real in-process Composer run: microbatches and the eval loader.

One tiny run (lr 0, so every batch and the evaluation see the seeded initial weights):
3 batches of 6 rows in microbatches of 2 (Composer calls ``after_loss`` once per
microbatch), then an evaluation over an ``eval_loader`` of both streams. Each number is
checked against transformers' own loss of every row alone (rows from the sample log and
from the eval loader) and the eval total against Composer's own ``LanguageCrossEntropy``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from composer.core import Callback
from composer.loggers import LoggerDestination
from helpers import tiny_run_config

RTOL = 1e-5  # float32 row sums in batches of 2 against rows alone


class Recorder(LoggerDestination):
    """A Composer logger destination keeping every ``log_metrics`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict] = []

    def log_metrics(self, metrics: dict, step=None) -> None:
        self.calls.append(dict(metrics))


class EvalBatches(Callback):
    """Keeps every batch the evaluation ran (a second pass over the eval loader is another epoch)."""

    def __init__(self) -> None:
        self.batches: list[dict] = []

    def eval_batch_end(self, state, logger) -> None:
        self.batches.append({k: v.clone() for k, v in state.batch.items()})


def row_loss(model, row) -> tuple[float, int]:
    """transformers' own loss of one decoded row x its targets, and the targets."""
    labels = torch.as_tensor(row['labels'])[None]
    n = int((labels[:, 1:] != -100).sum())
    loss = model(input_ids=torch.as_tensor(row['input_ids'])[None],
                 position_ids=torch.as_tensor(row['position_ids'])[None], labels=labels).loss
    return float(loss) * n, n


@pytest.fixture(scope='module')
def run(small_streams, tmp_path_factory):
    from foundrymix.train.builder import build_trainer
    from foundrymix.train.config import TrainConfig

    tmp = tmp_path_factory.mktemp('stream-loss')
    loader = {'streams': {n: {'local': str(p)} for n, p in small_streams.items()}, 'num_workers': 0,
              'shuffle_seed': 7}
    cfg = TrainConfig.from_dict(tiny_run_config(
        loader, global_train_batch_size=6, device_train_microbatch_size=2, max_duration='3ba', device='cpu',
        optimizer={'lr': 0.0}, eval_interval='1000ba', eval_loader={**loader, 'shuffle': False},
        progress_bar=False, save_folder=None,
        callbacks={'stream_accounting': {'out_dir': str(tmp / 'report'), 'log_interval': '1ba', 'plot': False},
                   'sample_log': {'path': str(tmp / 's.jsonl'), 'interval': '1ba'}}))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model: 2 threads on 2 busy cores are ~16x slower (measured)
    try:
        built = build_trainer(cfg)
        recorder, evals = Recorder(), EvalBatches()
        built.trainer.logger.destinations = (*built.trainer.logger.destinations, recorder)
        built.trainer.state.callbacks.append(evals)
        built.trainer.fit()
        built.trainer.close()
        built.claims.release()
        yield {'run': built, 'calls': recorder.calls, 'tmp': tmp, 'cfg': cfg, 'eval_batches': evals.batches}
    finally:
        torch.set_num_threads(threads)


def test_microbatched_stream_loss_equals_the_rows_recomputed(run, small_streams):
    from foundrymix.loader.mixer import StreamMixer
    acc, model = run['run'].accounting, run['run'].trainer.state.model.model
    dataset = StreamMixer(run['cfg'].train_loader).build_store()
    lines = [json.loads(line) for line in (run['tmp'] / 's.jsonl').read_text().splitlines()]
    assert [line['batch'] for line in lines] == [0, 1, 2]
    before = np.zeros(2), np.zeros(2, dtype=np.int64)
    for line, point in zip(lines, acc.history):  # a history point after every batch
        sums, targets = np.zeros(2), np.zeros(2, dtype=np.int64)
        with torch.no_grad():
            for sid, stream in zip(line['sample_ids'], line['stream_ids']):
                loss_sum, n = row_loss(model, dataset[sid])
                sums[stream] += loss_sum
                targets[stream] += n
        assert (np.array(point['loss_targets']) - before[1]).tolist() == targets.tolist()
        np.testing.assert_allclose(np.array(point['loss_sum']) - before[0], sums, rtol=RTOL)
        logged = [c for c in run['calls'] if 'streams/epoch' in c][line['batch']]  # the accounting's calls
        for i, name in enumerate(acc.stream_names):
            if targets[i]:
                assert logged[f'streams/{name}/loss'] == pytest.approx(sums[i] / targets[i], rel=RTOL)
            else:
                assert f'streams/{name}/loss' not in logged
        before = np.array(point['loss_sum']), np.array(point['loss_targets'])
    assert acc.loss_targets.min() > 0
    report = json.loads((run['tmp'] / 'report' / 'stream_accounting.json').read_text())
    for i, name in enumerate(acc.stream_names):
        assert report['streams'][name]['loss_targets'] == int(before[1][i])
        assert report['streams'][name]['loss'] == pytest.approx(before[0][i] / before[1][i], rel=1e-12)


def test_eval_loss_per_stream(run):
    """``eval/streams/<name>/loss``: each stream's eval rows recomputed alone; over both streams,
    Composer's own ``LanguageCrossEntropy`` of the same evaluation."""
    trainer = run['run'].trainer
    names = run['run'].accounting.eval_stream_names
    assert names == ['arxiv', 'dolly']
    [logged] = [c for c in run['calls'] if any(k.startswith('eval/streams/') for k in c)]
    [metric] = [c['metrics/eval/LanguageCrossEntropy'] for c in run['calls']
                if 'metrics/eval/LanguageCrossEntropy' in c]
    model = trainer.state.model.model
    sums, targets = np.zeros(2), np.zeros(2, dtype=np.int64)
    with torch.no_grad():
        for batch in run['eval_batches']:
            for r in range(len(batch['stream_id'])):
                loss_sum, n = row_loss(model, {k: batch[k][r] for k in ('input_ids', 'labels', 'position_ids')})
                sums[int(batch['stream_id'][r])] += loss_sum
                targets[int(batch['stream_id'][r])] += n
    ids = [int(i) for b in run['eval_batches'] for i in b['sample_id']]
    assert targets.min() > 0 and len(set(ids)) == len(ids) == 60  # exact epochs: 10 batches of 6 of 63 rows
    assert sorted(logged) == [f'eval/streams/{n}/loss' for n in names]
    for i, name in enumerate(names):
        assert logged[f'eval/streams/{name}/loss'] == pytest.approx(sums[i] / targets[i], rel=RTOL)
    assert float(metric) == pytest.approx(sums.sum() / targets.sum(), rel=RTOL)
