"""The ``wsd`` LR schedule on real runs: the LR of every batch, the decay at the anneal stage's
first batch, and the extend / branch recipes of docs/schedules.md.

Every run is in-process (a 1-layer Llama on ``small_streams``, 4-row batches): the LR each batch
trains with is read from the optimizer at ``BATCH_START``, and compared with the schedule's
formula written out here, independently of :mod:`foundrymix.train.lr_schedule`.
"""

from __future__ import annotations

import gc
import json
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


def loader_batches(cfg: TrainConfig) -> list[tuple[list[int], list[int]]]:
    """The run's batches (sample ids, stream ids) straight from its loader: the reference."""
    from helpers import build_staged_loader
    loader = build_staged_loader(cfg.train_loader, BATCH)
    out = [(b['sample_id'].tolist(), b['stream_id'].tolist()) for b in loader]
    loader.release()
    del loader
    gc.collect()
    return out


def trained(recorder: Recorder) -> dict[int, tuple[list[int], list[int]]]:
    return {b: (ids, streams) for b, _, _, ids, streams in recorder.rows}


def files(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


WSD_ANNEAL = {'name': 'wsd', 'warmup': '2ba', 'decay': {'stage': 'anneal', 'to': 0.1, 'shape': 'cosine'}}


def test_extending_the_stable_phase_moves_the_decay(straight, data, tmp_path, capsys):
    """Recipe 1: from the stable phase's last checkpoint (ba6), stable 6 -> 9 batches; the anneal
    moves to batches 9-12 with its data, and the LR follows the new spans from the resume batch."""
    before = files(straight['ckpt'])
    ckpt = straight['ckpt'] / 'ep0-ba6-rank0.pt'
    cfg = config(data, tmp_path, [{**STABLE, 'duration': '9ba'}, ANNEAL], WSD_ANNEAL,
                 load_path=str(ckpt), save_folder=str(tmp_path / 'ckpt'))
    rec, lines = fit(cfg, capsys)
    old = wsd(6, 2, 6, 10, 0.1, 'cosine')
    assert lines == [f"resumed from {ckpt} at batch 6 (epoch 0, batch 6 of it, stage 'stable', batch 6 of it)",
                     f'the run is extended from 10 to 13 batches; LR at batch 6: {old:.6g} as the checkpoint '
                     f'left it, {LR:.6g} now (wsd stable; decay batches 9-12)']
    assert_lrs(rec, {b: wsd(b, 2, 9, 13, 0.1, 'cosine') for b in range(6, 13)})
    got, reference = trained(rec), loader_batches(cfg)
    assert [got[b] for b in range(6, 13)] == reference[6:13]
    # the anneal's dolly goes on with its pass where the longer stable stage left it: the same
    # streams as in the straight run, 3 batches later (its rows: the reference loader's, above)
    assert [got[b][1] for b in range(9, 13)] == [trained(straight['recorder'])[b][1] for b in range(6, 10)]
    assert files(straight['ckpt']) == before  # the run branched from is untouched


def test_branching_an_anneal_keeps_the_data_position(straight, data, tmp_path, capsys):
    """Recipe 2, position kept: from the ba3 checkpoint (mid-stable), end the stable stage there and
    anneal on another mixture (sqrt to 0) in a new save_folder."""
    before = files(straight['ckpt'])
    ckpt = straight['ckpt'] / 'ep0-ba3-rank0.pt'
    code = {'name': 'code', 'duration': '4ba', 'streams': {'arxiv': {'repeat': 1}}}
    cfg = config(data, tmp_path, [{**STABLE, 'duration': '3ba'}, code],
                 {'name': 'wsd', 'warmup': '2ba', 'decay': {'stage': 'code', 'shape': 'sqrt'}},
                 load_path=str(ckpt), save_folder=str(tmp_path / 'ckpt'))
    rec, lines = fit(cfg, capsys)
    assert lines == [f"resumed from {ckpt} at batch 3 (epoch 0, batch 3 of it, stage 'code', batch 0 of it)",
                     f'the run is shortened from 10 to 7 batches; LR at batch 3: {LR:.6g} as the checkpoint '
                     f'left it, {wsd(3, 2, 3, 7, 0.0, "sqrt"):.6g} now (wsd decay; decay batches 3-6)']
    assert_lrs(rec, {b: wsd(b, 2, 3, 7, 0.0, 'sqrt') for b in range(3, 7)})
    assert rec.rows[-1][1] == 0.0
    got = trained(rec)
    assert [got[b] for b in range(3, 7)] == loader_batches(cfg)[3:7]
    assert {s for b in range(3, 7) for s in got[b][1]} == {0}  # arxiv only: the branch's mixture
    assert files(straight['ckpt']) == before


def test_branching_with_load_weights_only_resets_the_position(straight, data, tmp_path, capsys):
    """Recipe 2, position reset: the stable-phase weights (ba6), the anneal from its first row at
    batch 0, a fresh optimizer and schedule -- and the resume line says so."""
    from foundrymix.plan.config import STAGE_SEED_STEP
    ckpt = straight['ckpt'] / 'ep0-ba6-rank0.pt'
    # the seed the anneal had as the run's second stage (its rows differ: there dolly went on
    # from the stable stage's pass; here it starts one)
    anneal = {**ANNEAL, 'shuffle_seed': 3 + STAGE_SEED_STEP}
    cfg = config(data, tmp_path, [anneal], {'name': 'wsd', 'decay': {'stage': 'anneal', 'to': 0.1, 'shape': 'cosine'}},
                 load_path=str(ckpt), load_weights_only=True, save_folder=str(tmp_path / 'ckpt'))
    rec, lines = fit(cfg, capsys)
    assert lines == [f'weights from {ckpt}; the data position, optimizer and LR schedule start fresh at '
                     f'batch 0 (load_weights_only)']
    assert_lrs(rec, {b: wsd(b, 0, 0, 4, 0.1, 'cosine') for b in range(4)})
    got = trained(rec)
    assert [got[b] for b in range(4)] == loader_batches(cfg)[:4]  # from the anneal's batch 0
    assert {s for b in range(4) for s in got[b][1]} == {0}  # dolly: the only stream of this run


def write_yaml(data: dict, path: Path, stages: list[dict], scheduler: dict) -> Path:
    import yaml
    cfg = tiny_run_config(loader(data, stages), global_train_batch_size=BATCH, optimizer={'lr': LR},
                          scheduler=scheduler)
    path.write_text(yaml.safe_dump(cfg), encoding='utf-8')
    return path


def plan_cli(capsys, *args: str) -> tuple[int, str]:
    from foundrymix.cli import main
    capsys.readouterr()
    code = main(['plan', *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def table_rows(out: str) -> list[list[str]]:
    """The cells of every 6-column table row printed."""
    return [[c.strip() for c in line.split('│')[1:-1]] for line in out.splitlines() if line.count('│') == 7]


def test_plan_prints_and_draws_the_lr_the_run_trains_with(straight, data, tmp_path, capsys):
    """``foundrymix plan`` (text, --json, --png) against the LRs the straight run's optimizer had."""
    trained_lr = {b: lr for b, lr, *_ in straight['recorder'].rows}
    yaml_path = write_yaml(data, tmp_path / 'run.yaml', [STABLE, ANNEAL], WSD_ANNEAL)
    code, out = plan_cli(capsys, '--json', str(yaml_path))
    assert code == 0
    lr = json.loads(out)['lr_schedule']
    assert [(p['phase'], p['first_batch'], p['last_batch']) for p in lr['phases']] == [
        ('warmup', 0, 1), ('stable', 2, 5), ('decay', 6, 9)]
    for p in lr['phases']:
        assert (p['lr_first'], p['lr_last']) == (trained_lr[p['first_batch']], trained_lr[p['last_batch']])
    assert [(s['stage'], s['first_batch'], s['lr']) for s in lr['stages']] == [
        ('stable', 0, trained_lr[0]), ('anneal', 6, trained_lr[6])]

    png = tmp_path / 'plan.png'
    code, out = plan_cli(capsys, str(yaml_path), '--png', str(png))
    assert code == 0
    assert [c for c in table_rows(out) if c[0] in ('warmup', 'stable', 'decay')] == [
        [n, str(b - a + 1), str(a), str(b), f'{trained_lr[a]:.6g}', f'{trained_lr[b]:.6g}']
        for n, a, b in (('warmup', 0, 1), ('stable', 2, 5), ('decay', 6, 9))]
    assert (f'LR at the first batch of each stage: stable (batch 0) {trained_lr[0]:.6g}, anneal (batch 6) '
            f'{trained_lr[6]:.6g}') in out
    from PIL import Image
    with Image.open(png) as image:  # the LR panel below the mixture: 6.5 in at 100 dpi, not 4.5
        assert image.size == (900, 650)


@pytest.mark.parametrize('scheduler, messages', [
    ({'name': 'wsd', 'warmup': {'stage': 'warm'}, 'decay': {'stage': 'aneal'}},
     ["scheduler.warmup.stage: no stage 'warm'; the stages are: stable, anneal",
      "scheduler.decay.stage: no stage 'aneal'; the stages are: stable, anneal; did you mean 'anneal'?"]),
    ({'name': 'wsd', 't_warmup': '2ba'},
     ['scheduler.decay: wsd needs decay:', 'scheduler.t_warmup: is for the Composer schedulers; wsd takes warmup: 2ba']),
    ({'name': 'cosine_with_warmup', 'decay': {'duration': '2ba'}},
     ['scheduler.decay: only name: wsd takes decay']),
    ({'name': 'wsd', 'decay': {'duration': '2ba', 'stage': 'anneal', 'shape': 'square'}},
     ["scheduler.decay.shape: 'square' is not one of linear, cosine, sqrt"]),
])
def test_wsd_config_errors_name_every_problem(data, tmp_path, capsys, scheduler, messages):
    yaml_path = write_yaml(data, tmp_path / 'run.yaml', [STABLE, ANNEAL], scheduler)
    code, out = plan_cli(capsys, str(yaml_path))
    assert code == 2
    for message in messages:
        assert message in out


@pytest.mark.parametrize('scheduler, message', [
    ({'name': 'wsd', 'decay': {'duration': '15%'}},
     'scheduler.decay.duration: 15% is not a whole number of global batches (the run is 10 batches): '
     '1.5 batches; use 1ba or 2ba'),
    ({'name': 'wsd', 'warmup': '1ep', 'decay': {'stage': 'anneal'}},
     'scheduler.warmup: 1ep is ambiguous with stages (epochs of which stage?)'),
    ({'name': 'wsd', 'warmup': '8ba', 'decay': {'stage': 'anneal'}},
     'scheduler.warmup: 8ba ends at batch 8, after the decay starts (batch 6)'),
])
def test_wsd_spans_that_do_not_fit_the_run_are_refused(data, tmp_path, capsys, scheduler, message):
    yaml_path = write_yaml(data, tmp_path / 'run.yaml', [STABLE, ANNEAL], scheduler)
    code, out = plan_cli(capsys, str(yaml_path))
    assert code == 2 and message in out and len(out.strip().splitlines()) == 1


def test_plan_of_a_run_without_stages_reads_epochs_of_its_mixture(data, tmp_path, capsys):
    """Without stages the run is the stage ``main`` and ``ep`` is an epoch of its mixture."""
    import yaml
    cfg = tiny_run_config({'streams': {n: {'local': str(p), 'repeat': 1} for n, p in data.items()},
                           'num_workers': 0}, global_train_batch_size=BATCH, max_duration='40ba',
                          optimizer={'lr': LR},
                          scheduler={'name': 'wsd', 'warmup': '1ep', 'decay': {'duration': '25%', 'to': 0.5}})
    (tmp_path / 'run.yaml').write_text(yaml.safe_dump(cfg), encoding='utf-8')
    code, out = plan_cli(capsys, '--json', str(tmp_path / 'run.yaml'))
    assert code == 0, out
    plan = json.loads(out)
    epoch = plan['batches_per_epoch']
    assert 0 < epoch < 30
    assert [(p['phase'], p['first_batch'], p['last_batch'], p['lr_first'], p['lr_last'])
            for p in plan['lr_schedule']['phases']] == [
        ('warmup', 0, epoch - 1, LR / epoch, LR), ('stable', epoch, 29, LR, LR),
        ('decay', 30, 39, wsd(30, epoch, 30, 40, 0.5, 'linear'), LR * 0.5)]
    code, out = plan_cli(capsys, str(tmp_path / 'run.yaml'), '--png', str(tmp_path / 'plan.png'))
    assert code == 0 and (tmp_path / 'plan.png').stat().st_size > 0
    assert ['stable', str(30 - epoch), str(epoch), '29', f'{LR:g}', f'{LR:g}'] in table_rows(out)


def test_wsd_with_per_stage_batches_counts_batches_and_refuses_sample_spans(data, tmp_path, capsys):
    """With per-stage global batches (batch-size warm-up) the schedule still counts global
    batches: a stage-tied decay starts at the anneal's first batch, and a span in samples,
    which is no fixed number of batches any more, is refused rather than rounded."""
    warm = dict(STABLE, global_train_batch_size=2 * BATCH)
    yaml_path = write_yaml(data, tmp_path / 'run.yaml', [warm, ANNEAL],
                           {'name': 'wsd', 'warmup': '2ba', 'decay': {'stage': 'anneal', 'to': 0.0}})
    code, out = plan_cli(capsys, '--json', str(yaml_path))
    assert code == 0, out
    phases = json.loads(out)['lr_schedule']['phases']
    assert [(p['phase'], p['first_batch'], p['last_batch']) for p in phases] == [
        ('warmup', 0, 1), ('stable', 2, 5), ('decay', 6, 9)]
    yaml_path = write_yaml(data, tmp_path / 'run2.yaml', [warm, ANNEAL],
                           {'name': 'wsd', 'decay': {'duration': f'{4 * BATCH}sp'}})
    code, out = plan_cli(capsys, str(yaml_path))
    assert code == 2 and len(out.strip().splitlines()) == 1
    assert (f"scheduler.decay.duration: {4 * BATCH}sp is not a fixed number of global batches: the stages' "
            f"global batches differ ({2 * BATCH}, {BATCH} rows)") in out
