"""The ``wsd`` LR schedule on real runs: the LR of every batch, the decay at the anneal stage's
first batch, and the extend / branch recipes of docs/schedules.md.

Every run is in-process (a 1-layer Llama on ``small_streams``, 4-row batches): the LR each batch
trains with is read from the optimizer at ``BATCH_START``, and compared with the schedule's
formula written out here, independently of :mod:`foundrymix.plan.schedule`.
"""

from __future__ import annotations

import gc
import math
from pathlib import Path

import pytest
from composer.core import Callback
from helpers import tiny_run_config

from foundrymix.train.config import TrainConfig

LR = 0.01
BATCH = 4


class Recorder(Callback):
    """Per trained batch: (global batch, LR, stage id, sample ids, stream ids)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, float, int, list[int], list[int]]] = []

    def batch_start(self, state, logger) -> None:
        b = state.batch
        self.rows.append((int(state.timestamp.batch), state.optimizers[0].param_groups[0]['lr'],
                          int(b['stage_id'][0]) if 'stage_id' in b else 0,
                          b['sample_id'].tolist(), b['stream_id'].tolist()))


def loader(data: dict, stages: list[dict]) -> dict:
    return {'streams': {n: {'local': str(p)} for n, p in data.items()}, 'num_workers': 0,
            'shuffle_seed': 3, 'stages': stages}


STABLE = {'name': 'stable', 'duration': '6ba', 'streams': {'arxiv': {'repeat': 1}, 'dolly': {'repeat': 0.5}}}
ANNEAL = {'name': 'anneal', 'duration': '4ba', 'streams': {'dolly': {'repeat': 1}}}


def config(data: dict, tmp: Path, stages: list[dict], scheduler: dict, **top) -> TrainConfig:
    callbacks = {'stream_accounting': {'out_dir': str(tmp / 'report'), 'plot': False}}
    return TrainConfig.from_dict(tiny_run_config(loader(data, stages), global_train_batch_size=BATCH,
                                                 callbacks=callbacks, optimizer={'lr': LR},
                                                 scheduler=scheduler, **top))


def fit(cfg: TrainConfig, capsys=None) -> tuple[Recorder, list[str]]:
    """Build and fit ``cfg`` in-process; (what each batch trained with, the lines printed at build)."""
    from foundrymix.train.builder import build_trainer
    if capsys is not None:
        capsys.readouterr()
    run = build_trainer(cfg)
    lines = capsys.readouterr().out.splitlines() if capsys is not None else []
    recorder = Recorder()
    run.trainer.state.callbacks.append(recorder)
    try:
        run.trainer.fit()
        run.trainer.close()
    finally:
        run.claims.release()
    del run
    gc.collect()  # streaming's shared memory for these local dirs goes with the datasets
    return recorder, lines


def wsd(b: int, warmup: int, start: int, end: int, to: float, shape: str) -> float:
    """The documented formula (docs/schedules.md), written out: LR of batch b at its end."""
    t = b + 1
    if t <= warmup:
        return LR * t / warmup
    if t <= start:
        return LR
    p = min(1.0, (t - start) / (end - start))
    f = {'linear': 1 - p, 'cosine': (1 + math.cos(math.pi * p)) / 2, 'sqrt': 1 - math.sqrt(p)}[shape]
    return LR * (to + (1 - to) * f)


def assert_lrs(recorder: Recorder, expected: dict[int, float]) -> None:
    got = {b: lr for b, lr, *_ in recorder.rows}
    assert sorted(got) == sorted(expected)
    for b in expected:
        assert got[b] == pytest.approx(expected[b], rel=1e-12, abs=1e-15), f'batch {b}'


@pytest.fixture(scope='module')
def data(small_streams) -> dict:
    return dict(small_streams)


@pytest.fixture(scope='module')
def straight(tmp_path_factory, data) -> dict:
    """stable 6ba + anneal 4ba, warmup 2ba, cosine decay over the anneal to 0.1 lr; a checkpoint
    every 3 batches (ba6: the end of the stable phase)."""
    tmp = tmp_path_factory.mktemp('wsd-straight')
    cfg = config(data, tmp, [STABLE, ANNEAL], {'name': 'wsd', 'warmup': '2ba',
                                               'decay': {'stage': 'anneal', 'to': 0.1, 'shape': 'cosine'}},
                 save_folder=str(tmp / 'ckpt'), save_interval='3ba')
    recorder, _ = fit(cfg)
    return {'tmp': tmp, 'recorder': recorder, 'ckpt': tmp / 'ckpt'}


def test_lr_of_every_batch_is_the_wsd_formula(straight):
    rec = straight['recorder']
    assert_lrs(rec, {b: wsd(b, 2, 6, 10, 0.1, 'cosine') for b in range(10)})
    stages = [s for _, _, s, _, _ in rec.rows]
    assert stages == [0] * 6 + [1] * 4
    # the decay starts at exactly the anneal stage's first batch
    lrs = [lr for _, lr, *_ in rec.rows]
    assert lrs[5] == LR and lrs[6] < LR
    assert lrs[9] == pytest.approx(0.1 * LR)
